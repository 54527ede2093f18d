"""The production releases each of the model's bit-faithful claims was verified against, and the
note a run on any other release carries.

The model (``fa4.model``, ``fa4.model_bwd``) is tied to production by measurements made on one
release at a time: a claim such as "``fa4-model-sm90-tc`` reproduces every output bit" holds for
the releases it was measured on, and a new flash-attn-4 release may change the arithmetic.  So an
audit of production on a release outside :data:`VERIFIED_VERSIONS` still runs, and says so
(:func:`release_note`: on stderr and in the report's environment, ``audits.report.header``); the
``gpu`` extra accepts exactly the verified range.  Pure Python: no GPU, no production package.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Verified", "VERIFIED_RELEASES", "VERIFIED_VERSIONS", "release_note"]

_B36, _B40 = "4.0.0b36", "4.0.0b40"


@dataclass(frozen=True)
class Verified:
    """One claim of the model's fidelity to production (``claim``), the flash-attn-4 releases it
    was measured against (``releases``) and where the measurement is recorded (``evidence``)."""

    claim: str
    releases: tuple[str, ...]
    evidence: str


#: Each bit-faithful claim and the releases it was verified against (docs/model-and-fidelity.md,
#: "Releases verified").  A claim measured on one release only names that one: the others are
#: unmeasured there, not known to differ.
VERIFIED_RELEASES: tuple[Verified, ...] = (
    Verified(
        "forward bit-identical: the SM90 tensor-core model (fa4-model-sm90-tc on CUDA) reproduces every output "
        "and LSE bit of production's SM90 forward on the 33 fidelity cases",
        (_B36, _B40),
        "b36: docs/model-and-fidelity.md, 'Bit for bit with the tensor cores and MUFU' (H200, 2026-12-01, "
        "reports/h200/bitexact-2026-12-01/); b40: the same 33 cases, outputs and LSE, measured on the H200 on "
        "2026-12-03 (the project's notes on flash-attn-4 4.0.0b40; no report committed)",
    ),
    Verified(
        "backward bit-identical: the SM90 backward model with tensor-core sums reproduces every dQ, dK, dV and "
        "dsink bit of production's deterministic SM90 backward on the 10 backward fidelity cases",
        (_B36,),
        "docs/backward.md, 'With the tensor-core summation and MUFU: bit for bit' (H200, 2026-12-01)",
    ),
    Verified(
        "exp2 emulation bit-identical: fa4.ex2 against production's ex2_emulation, degrees 1-5, all 2^32 float32 "
        "inputs (the SM100 forward's polynomial exp2)",
        (_B36,),
        "docs/ex2.md, 'Results' (H200, 2026-11-29)",
    ),
    Verified(
        "SM100 numerics facts: the sm_100a PTX of production's forward and backward kernels agrees with the "
        "model's SM100 knobs (no Blackwell GPU: compiled, not run)",
        (_B36,),
        "docs/static.md, 'Results' and 'The backward' (reports/static/, reports/static-backward/)",
    ),
    Verified(
        "refusal rules: every rule of fa4.refusals.REFUSALS cites production's raising line per release, and "
        "the release gate's verdicts (smoke --backward, release) are the same on both",
        (_B36, _B40),
        "fa4/refusals.py (SUPPORTED_VERSIONS); docs/h200-results.md, 'The release gate on 4.0.0b36 and "
        "4.0.0b40' (H200, 2026-12-04, reports/h200/gate-2026-12-04/)",
    ),
)

#: every release some claim was verified against, oldest first: the range the ``gpu`` extra accepts
VERIFIED_VERSIONS: tuple[str, ...] = tuple(dict.fromkeys(r for v in VERIFIED_RELEASES for r in v.releases))


def release_note(version: str | None) -> str | None:
    """The note a run of production on flash-attn-4 ``version`` carries when no bit-faithful
    claim was verified against that release (None for a verified release, and for no production
    at all): the model may still match it, but nothing measured says so."""
    if version is None or version in VERIFIED_VERSIONS:
        return None
    return (
        f"flash-attn-4 {version} is not among the releases the model's bit-faithful claims were verified against "
        f"({', '.join(VERIFIED_VERSIONS)}): model comparisons are unverified there"
    )
