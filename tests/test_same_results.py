"""benchmarks/same_results.py, the check that a refactor keeps every case record: it ignores only
what two runs of the same code may differ in (a case's time, a traceback's frames)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("same_results", ROOT / "benchmarks" / "same_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _report(**fields) -> dict:
    case = {"case": "c1", "verdict": "pass", "out": {"max_abs": 1e-3}, "seconds": 1.0} | fields
    return {"k": {"cases": [case], "summary": {"cases": 1, "seconds": 1.0}}}


def test_time_and_traceback_frames_are_not_differences():
    s = _module()
    a = _report(traceback="Traceback:\n  File a/x.py, line 1\nValueError: no", seconds=1.0)
    b = _report(traceback="Traceback:\n  File b/x.py, line 9\nValueError: no", seconds=7.5)
    assert s.differences(a, b) == []


def test_a_changed_metric_verdict_or_exception_is_a_difference():
    s = _module()
    base = _report(traceback="Traceback:\nValueError: no")
    assert s.differences(base, _report(traceback="Traceback:\nValueError: no", out={"max_abs": 2e-3})) == [
        "k / c1: out: {'max_abs': 0.001} vs {'max_abs': 0.002}"
    ]
    assert any(
        "verdict" in d for d in s.differences(base, _report(traceback="Traceback:\nValueError: no", verdict="fail"))
    )
    assert any("ValueError: yes" in d for d in s.differences(base, _report(traceback="Traceback:\nValueError: yes")))
    other = {"k": {"cases": [{"case": "c2"}], "summary": {}}}
    assert s.differences(base, other) == ["k: cases differ: 1 vs 1, 2 not in both"]
