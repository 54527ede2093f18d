"""The pytest plugin: users audit their kernels inside their own test suites."""

import os
import pathlib

import pytest

# imported here, before any pytester fixture: pytester puts sys.modules back as it found it when
# a test ends, and torch (which smoke_suite() imports) cannot be imported a second time in a process
import torch  # noqa: F401

from audits.suites.cases import smoke_suite

pytest_plugins = ["pytester"]

ROOT = pathlib.Path(__file__).parents[1]
#: hypothesis's plugin is most of a bare pytest start-up here, and these runs need neither it nor a cache
QUICK = ("-p", "no:hypothesispytest", "-p", "no:cacheprovider")


def _run(pytester, monkeypatch, *args):
    """pytest in a fresh process, as a user runs it (the plugin loaded by its entry point), with
    this checkout on the path for the test kernels.  Not in-process: pytester's ``runpytest`` puts
    ``sys.modules`` back after each run, and torch and numba cannot be imported twice in one
    process (the second run crashed, or numba's types no longer matched)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return pytester.runpytest_subprocess(*QUICK, *args)


def test_fixture_passes_a_correct_kernel_and_fails_a_bugged_one(pytester, monkeypatch):
    pytester.makepyfile(
        """
        def test_good(fa4_audit):
            rep = fa4_audit("tests.bugged_kernels:online", case="*uniform*")
            assert rep["summary"]["verdicts"]["pass"] == 1

        def test_bad(fa4_audit):
            fa4_audit("tests.bugged_kernels:bug_lse_log2", case="*uniform*")
        """
    )
    result = _run(pytester, monkeypatch)  # the plugin is loaded by its pytest11 entry point
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*fa4-audit: tests.bugged_kernels:bug_lse_log2 fails 1 case(s) of suite smoke*", "*LSE*"]
    )


@pytest.mark.slow  # 13 s CPU
def test_fixture_audits_gradients_with_backward(pytester, monkeypatch):
    """``fa4_audit(..., backward=True)``: a kernel with a wrong dQ fails on dQ, the model passes."""
    pytester.makepyfile(
        """
        def test_good(fa4_audit):
            rep = fa4_audit("fa4-model", case="*uniform*", backward=True)
            assert rep["cases"][0]["backward"]["status"] == "ran"

        def test_bad(fa4_audit):
            fa4_audit("tests.fake_kernels:dq_doubled", case="*uniform*", backward=True)
        """
    )
    result = _run(pytester, monkeypatch)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*dq_doubled fails 1 case(s)*", "*FA criterion: max|dq - ref|*", "*--backward*"])


@pytest.mark.slow  # 19 s CPU
def test_fixture_builds_the_suite_in_the_kernels_domain_and_takes_suite_files(pytester, monkeypatch):
    """As ``fa4-audit run``: a restricted kernel gets smoke built inside its declared domain
    (no case skipped), and ``suite=`` takes a suite file."""
    pytester.makepyfile(
        f"""
        def test_restricted(fa4_audit):
            rep = fa4_audit("examples.restricted_kernel:attention", case="*normal*")
            assert rep["summary"]["cases"] >= 1 and rep["summary"]["verdicts"]["skipped"] == 0
            assert all(c["config"]["dtype"] == "float16" for c in rep["cases"])

        def test_suite_file(fa4_audit):
            rep = fa4_audit("fa4-model", suite={str(ROOT / "examples" / "suite.toml")!r}, case="*normal*")
            assert rep["summary"]["verdicts"]["pass"] == rep["summary"]["cases"] >= 1
        """
    )
    _run(pytester, monkeypatch).assert_outcomes(passed=2)


@pytest.mark.slow  # pytest -n 2 in a subprocess: 30 s CPU
def test_fixture_under_xdist_shards_the_cases_and_merges_one_report(pytester, monkeypatch):
    """``pytest -n 2``: the test runs once per worker, each auditing its shard; the controller
    merges the shards into one report holding every case once (the cases of the unsharded call)."""
    import json
    import re

    pytest.importorskip("xdist")
    pytester.makepyfile(
        """
        def test_model(fa4_audit):
            fa4_audit("fa4-model", case="*tile_step*")
        """
    )
    result = _run(pytester, monkeypatch, "-n", "2", "-p", "xdist")
    result.assert_outcomes(passed=2)  # shard0of2 and shard1of2
    line = next(x for x in result.outlines if "merged report of the shards" in x)
    merged = json.loads((pathlib.Path(re.search(r": (\S+)$", line).group(1)).parent / "report.json").read_text())
    want = sorted(c.name for c in smoke_suite() if "tile_step" in c.name)
    assert sorted(c["case"] for c in merged["cases"]) == want and len(want) >= 4
    assert merged["summary"]["verdicts"]["pass"] == len(want)


def test_worker_gpu_pins_round_robin():
    from audits.integrations.pytest_plugin import worker_gpu

    assert [worker_gpu(f"gw{i}", 2) for i in range(4)] == ["0", "1", "0", "1"]
    assert worker_gpu("gw3", 1) is None and worker_gpu("gw0", 0) is None and worker_gpu("master", 4) is None


def test_importing_the_plugin_imports_nothing_heavy_and_sets_no_environment_variable():
    """The entry point loads the plugin into every pytest run of the environment: importing it must
    not import torch, numpy or the audit modules, nor touch ``os.environ``."""
    import json
    import subprocess
    import sys

    code = (
        "import json, os, sys; before = dict(os.environ); import audits.integrations.pytest_plugin; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'fa4', 'numerics') "
        "or m.startswith('audits.') and m not in ('audits.integrations', 'audits.integrations.pytest_plugin')); "
        "print(json.dumps({'heavy': heavy, 'env_changed': sorted(set(os.environ.items()) ^ set(before.items()))}))"
    )
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert out == {"heavy": [], "env_changed": []}


#: a conftest for the runs below: the plugin's GPU count says two GPUs (the count is simulated, and
#: each test records the environment and the heavy modules its process sees
_PROBE_CONFTEST = """
import audits.integrations.pytest_plugin as plugin

plugin._gpu_count = lambda: 2
"""
_PROBE_TEST = """
import json, os, pathlib, sys

def test_probe():
    who = os.environ.get("PYTEST_XDIST_WORKER", "controller")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "PYTEST_XDIST_TESTRUNUID")}
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "fa4", "numerics")
                   or m.startswith("audits.") and m not in ("audits.integrations", "audits.integrations.pytest_plugin"))
    out = pathlib.Path(__file__).parent / "probe"
    out.mkdir(exist_ok=True)
    (out / f"{who}.json").write_text(json.dumps({"env": env, "heavy": heavy}))
"""


def _probe(pytester, *args) -> dict:
    """Run the probe test under ``pytest -n 2 --dist each`` (once in each worker): what each worker saw."""
    import json
    import shutil

    pytester.makeconftest(_PROBE_CONFTEST)
    pytester.makepyfile(test_probe=_PROBE_TEST)
    shutil.rmtree(pytester.path / "probe", ignore_errors=True)
    pytester.runpytest_subprocess("-n", "2", "-p", "xdist", "--dist", "each", *QUICK, *args).assert_outcomes(passed=2)
    return {p.stem: json.loads(p.read_text()) for p in sorted((pytester.path / "probe").glob("*.json"))}


def test_a_pytest_run_with_the_plugin_has_the_environment_and_modules_it_has_without(pytester, monkeypatch):
    """Loaded (by its entry point) but unasked, the plugin changes nothing an xdist worker sees: the
    same environment (no ``CUDA_VISIBLE_DEVICES``, though two GPUs are counted) and no torch."""
    pytest.importorskip("xdist")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    without = _probe(pytester, "-p", "no:fa4_audit")
    loaded = _probe(pytester)
    assert sorted(loaded) == ["gw0", "gw1"]
    for w in loaded:
        assert "CUDA_VISIBLE_DEVICES" not in loaded[w]["env"]
        assert loaded[w]["env"] == without[w]["env"]
        assert not [m for m in loaded[w]["heavy"] if m.split(".")[0] == "torch"], loaded[w]["heavy"]
        assert loaded[w]["heavy"] == without[w]["heavy"]


def test_gpu_pinning_happens_only_when_asked(pytester, monkeypatch):
    """``--fa4-audit-pin-gpus`` pins worker gwI to GPU I mod G of the (simulated) two; the ini option
    does the same, choosing among the controller's own ``CUDA_VISIBLE_DEVICES`` entries."""
    pytest.importorskip("xdist")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen = _probe(pytester, "--fa4-audit-pin-gpus")
    assert {w: seen[w]["env"].get("CUDA_VISIBLE_DEVICES") for w in seen} == {"gw0": "0", "gw1": "1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    pytester.makeini("[pytest]\nfa4_audit_pin_gpus = true\n")
    seen = _probe(pytester)
    assert {w: seen[w]["env"].get("CUDA_VISIBLE_DEVICES") for w in seen} == {"gw0": "5", "gw1": "7"}


def test_the_plugin_uses_no_private_name_of_another_module():
    """No ``x._name`` in the plugin (pytest's ``config._tmp_path_factory`` was one): only public
    pytest and xdist API, which does not change under it between releases."""
    import ast
    import pathlib

    import audits.integrations.pytest_plugin as plugin

    tree = ast.parse(pathlib.Path(plugin.__file__).read_text())
    private = [
        f"line {n.lineno}: .{n.attr}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
    ]
    assert private == []
