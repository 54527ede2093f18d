"""The cause vocabulary (docs/diagnosis.md, "Causes"): what a tested cause hypothesis reports,
and the causes in the order ties are broken.  Shared by the data hypotheses
(``audits.verdict.causes``, ``audits.verdict.nonfinite``), the poisoned runs
(``audits.engine.poison``) and the rounding bias (``audits.verdict.bias``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Cause", "CAUSES", "CAUSE_KEYS"]


@dataclass(frozen=True)
class Cause:
    """One tested cause hypothesis of a failing (or biased) case (docs/diagnosis.md, "Causes")."""

    cause: str
    detail: str
    evidence: str
    score: float

    def as_dict(self) -> dict:
        return {"cause": self.cause, "detail": self.detail, "evidence": self.evidence, "score": round(self.score, 4)}


#: the cause vocabulary, in the order ties are broken.  ``nan_leak`` before ``mask_edge``: where
#: every violation is NaN from masked keys, a mask ignored (or an edge moved onto a NaN key)
#: predicts the same NaN as the leak; the leak claims less (finite masked keys stay out), and the
#: data cannot tell more (tests/test_causes_data.py, ``nan_from_masked_keys``).  ``dropped_tile``
#: before ``accum_stride`` for the same reason: a row tile read from past everything written is
#: zero, which both predict, and the zero rows claim less than a stride the data cannot pin
#: (production's dq at d = 8, where six pairs of widths fit alike: docs/diagnosis.md)
CAUSES = (
    "softmax_scale",
    "grad_scale",
    "nan_leak",
    "mask_edge",
    "head_mapping",
    "misplaced_rows",
    "unwritten_output",
    "uninitialized_read",
    "overflow",
    "dropped_tile",
    "accum_stride",
    "softcap_chain",
    "rounding_bias",
)


#: the keys of a case's diagnosis that are its causes, not a tensor's violations: the causes named,
#: why their analysis broke, what the poisoned re-runs showed when they named none
CAUSE_KEYS = ("causes", "causes_error", "poisoned")
