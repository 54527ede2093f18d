"""Rounding bias as a cause (docs/diagnosis.md, "Rounding bias"): a case whose errors lean one way
(``numerics.metrics.bias_record``, ``rec["bias"]``) beyond what their standard error explains,
by the verdict's own rule (``audits.verdict.gate.bias_findings``), named ``rounding_bias``."""

from __future__ import annotations

import functools
import math

from audits.report.records import CaseRecord
from audits.verdict.causes import Cause
from audits.verdict.gate import bias_findings, load_thresholds

__all__ = ["bias_cause"]


@functools.cache
def _shipped() -> dict:
    """The shipped thresholds, read once (a cause named without the run's thresholds)."""
    return load_thresholds()


def bias_cause(rec: CaseRecord, *, th: dict | None = None) -> Cause | None:
    """The ``rounding_bias`` cause of case record ``rec``, or None: the tensor (out or LSE) whose
    signed bias the gate finds under ``th`` (default: the shipped thresholds; one without a
    [bias] table finds none), the most significant when both are.  ``detail``: the tensor and
    its direction ("out biased low by 0.2 ULP on average (z = -23.6)"); ``evidence``: the test
    and its numbers; ``score``: the share of the tensor's mean squared error (in ULPs) that the
    bias accounts for, mean**2 / (mean**2 + variance): 1 when every element errs by the same
    amount, near 0 when the bias is a small lean under a wide spread."""
    found = bias_findings(m=rec, th=_shipped() if th is None else th)
    if not found:
        return None
    f = max(found, key=lambda f: abs(f.worst))
    b = rec["bias"]["out" if f.quantity == "out" else "lse"]
    mean, z, n = b["mean_ulp"], f.worst, b["n"]
    way = "low" if mean < 0 else "high"
    detail = f"{f.quantity} biased {way} by {abs(mean):.2g} ULP on average (z = {z:.3g})"
    clusters = f"{b.get('rows', n):,} rows and {b.get('cols', n):,} columns"
    evidence = (
        f"the mean signed error of {f.quantity} against the FP64 reference over {n:,} elements is "
        f"{mean:+.3g} {b.get('dtype', '')} ULP ({b.get('mean', 0.0):+.3g} raw), {abs(z):.3g} standard errors "
        f"clustered over {clusters} from 0, beyond |z| {f.allowed:g} and {f.detail['min_ulps']:g} ULP"
    )
    var = (b.get("stderr_ulp", 0.0) ** 2) * n
    score = mean**2 / (mean**2 + var) if mean else 0.0
    return Cause("rounding_bias", detail, evidence, score if math.isfinite(score) else 1.0)
