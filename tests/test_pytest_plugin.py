"""The pytest plugin: users audit their kernels inside their own test suites."""

pytest_plugins = ["pytester"]


def test_fixture_passes_a_correct_kernel_and_fails_a_bugged_one(pytester, monkeypatch):
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1]))
    pytester.makepyfile(
        """
        def test_good(fa4_audit):
            rep = fa4_audit("tests.bugged_kernels:online", case="*uniform*")
            assert rep["summary"]["verdicts"]["pass"] == 1

        def test_bad(fa4_audit):
            fa4_audit("tests.bugged_kernels:bug_lse_log2", case="*uniform*")
        """
    )
    result = pytester.runpytest()  # the plugin is loaded by its pytest11 entry point
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*fa4-audit: tests.bugged_kernels:bug_lse_log2 fails 1 case(s) of suite smoke*", "*LSE*"]
    )


def test_fixture_audits_gradients_with_backward(pytester, monkeypatch):
    """``fa4_audit(..., backward=True)``: a kernel with a wrong dQ fails on dQ, the model passes."""
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1]))
    pytester.makepyfile(
        """
        def test_good(fa4_audit):
            rep = fa4_audit("fa4-model", case="*uniform*", backward=True)
            assert rep["cases"][0]["backward"]["status"] == "ran"

        def test_bad(fa4_audit):
            fa4_audit("tests.fake_kernels:dq_doubled", case="*uniform*", backward=True)
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*dq_doubled fails 1 case(s)*", "*FA criterion: max|dq - ref|*", "*--backward*"])


def test_fixture_builds_the_suite_in_the_kernels_domain_and_takes_suite_files(pytester, monkeypatch):
    """As ``fa4-audit run``: a restricted kernel gets smoke built inside its declared domain
    (no case skipped), and ``suite=`` takes a suite file."""
    import pathlib

    root = pathlib.Path(__file__).parents[1]
    monkeypatch.syspath_prepend(str(root))
    pytester.makepyfile(
        f"""
        def test_restricted(fa4_audit):
            rep = fa4_audit("examples.restricted_kernel:attention", case="*normal*")
            assert rep["summary"]["cases"] >= 1 and rep["summary"]["verdicts"]["skipped"] == 0
            assert all(c["config"]["dtype"] == "float16" for c in rep["cases"])

        def test_suite_file(fa4_audit):
            rep = fa4_audit("fa4-model", suite={str(root / "examples" / "suite.toml")!r}, case="*normal*")
            assert rep["summary"]["verdicts"]["pass"] == rep["summary"]["cases"] >= 1
        """
    )
    pytester.runpytest().assert_outcomes(passed=2)
