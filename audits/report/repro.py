"""Reproducers: the one-line command that re-runs exactly one case.  Every reproducer the tool
prints (the run's terminal summary, reports, the fuzzer, the pytest fixture) comes from here,
and the tests execute them, from another working directory too."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from audits.engine.worker import DEFAULT_TIMEOUT_S
from audits.kernels import portable_spec
from audits.suites.cases import Case
from audits.verdict.gate import DEFAULT_THRESHOLDS

__all__ = ["reproducer", "REPRO_OUT"]

#: where a reproducer writes its report (relative to the directory it is run from)
REPRO_OUT = "fa4-audit-repro"


def reproducer(
    kernel: str,
    case: Case,
    *,
    device: str,
    thresholds_path: str | None = None,
    backward=None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> str:
    """``fa4-audit run`` on exactly ``case`` (``--config`` with the case as JSON), runnable from
    any directory (the kernel as a built-in name or an absolute ``file.py:fn``) and repeatable
    (``--overwrite`` into ``fa4-audit-repro/``); ``backward``: the run's ``BackwardOptions``;
    ``timeout``: the run's per-call limit (None: none), carried when it is not the default, so
    that a case that timed out times out again after the same limit, not after the default's."""
    cfg = json.dumps(case.as_dict(), separators=(",", ":"))
    cmd = ["fa4-audit", "run", "--kernel", portable_spec(kernel), "--config", cfg, "--device", str(device)]
    if thresholds_path and str(thresholds_path) != str(DEFAULT_THRESHOLDS):
        cmd += ["--thresholds", str(Path(thresholds_path).resolve())]
    if backward is not None:  # audits.engine.backward.BackwardOptions
        cmd += ["--backward", "--repeat", str(backward.repeat)]
        cmd += ["--deterministic"] if backward.deterministic else []
    if timeout != DEFAULT_TIMEOUT_S:
        cmd += ["--timeout", "0" if timeout is None else f"{timeout:g}"]
    cmd += ["--out", REPRO_OUT, "--overwrite"]
    return " ".join(shlex.quote(a) for a in cmd)
