"""The pytest plugin: users audit their kernels inside their own test suites."""

import pytest

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


def test_fixture_under_xdist_shards_the_cases_and_merges_one_report(pytester, monkeypatch):
    """``pytest -n 2``: the test runs once per worker, each auditing its shard; the controller
    merges the shards into one report holding every case once (the cases of the unsharded call)."""
    import json
    import pathlib
    import re

    pytest.importorskip("xdist")
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1]))
    pytester.makepyfile(
        """
        def test_model(fa4_audit):
            fa4_audit("fa4-model", case="*tile_step*")
        """
    )
    result = pytester.runpytest_subprocess("-n", "2", "-p", "xdist")
    result.assert_outcomes(passed=2)  # shard0of2 and shard1of2
    line = next(x for x in result.outlines if "merged report of the shards" in x)
    merged = json.loads((pathlib.Path(re.search(r": (\S+)$", line).group(1)).parent / "report.json").read_text())
    from audits.cases import smoke_suite

    want = sorted(c.name for c in smoke_suite() if "tile_step" in c.name)
    assert sorted(c["case"] for c in merged["cases"]) == want and len(want) >= 4
    assert merged["summary"]["verdicts"]["pass"] == len(want)


def test_worker_gpu_pins_round_robin():
    from audits.runner.pytest_plugin import worker_gpu

    assert [worker_gpu(f"gw{i}", 2) for i in range(4)] == ["0", "1", "0", "1"]
    assert worker_gpu("gw3", 1) is None and worker_gpu("gw0", 0) is None and worker_gpu("master", 4) is None
