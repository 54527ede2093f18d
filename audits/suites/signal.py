"""Which features of the call a case's inputs make matter: the "carries signal" rule, stated once
(issue 33 item 6).  A case exercises a feature only when a kernel that ignores the feature, or
gets it subtly wrong, computes something else on that case's inputs: a case whose keys are
subnormal has logits of about 2**-130, where any softmax scale gives the same attention, so it
does not exercise the scale (nor the head dim the scale is taken from).

:func:`signal` gives the features a case carries signal for; ``audits.verdict.coverage`` counts a
head-dim pair or a feature as covered only by such a case, and ``tests/test_feature_bugs.py``
checks that smoke has one for every feature it has and fails the seeded feature bugs
(``tests/feature_bugs.py``) on them.  The rule, per feature:

* ``head_dims`` (the pair (d, dv): the scale 1/sqrt(d), the head dims' loops): the logits vary
  (the family is not one of :data:`FLAT_LOGITS`) and the reference is finite
  (not :data:`POISONED`);
* ``dtype=X``: the reference is finite (not :data:`POISONED`): the output is rounded to the
  dtype's format and compared;
* ``mask=none``: likewise (an unmasked call whose outputs are all NaN compares nothing);
* ``mask=causal`` / ``mask=local``: some query row sees some key and not another it would see
  with the mask's edges one key wider (or without the mask): ignoring the mask, or an edge off by
  one, changes the keys a row averages (``numerics.reference.visible_mask``);
* ``softcap``: the logits vary and reach half the cap (:data:`LOGIT_REACH` >= softcap / 2: there
  tanh(x)/x <= 0.92, so the capped logit is 8 % below the raw one, > 0.5 nats at a cap of 15);
* ``sink``: the reference is finite (``audits.suites.inputs`` places the sink against each
  head's largest logit, so it always carries weight: ``tests/test_catalogue.py``);
* ``gqa``: heads_q > heads_kv >= 2 (with one KV head every mapping of query heads is right) and
  the reference is finite;
* ``score_mod``, ``mask_mod``, ``block_sparse``, ``aux_scalars``: the case has it and the
  reference is finite (the library mods' aux tensors and scalars are drawn by seed, each
  shaping the scores at the suites' lengths);
* ``varlen``: two sequences or more with queries and keys; ``seqused_k``: some sequence uses
  fewer keys than allocated; ``paged``: pages and a sequence longer than one page.
"""

from __future__ import annotations

import torch

__all__ = ["FEATURES", "FLAT_LOGITS", "POISONED", "LOGIT_REACH", "logit_reach", "signal", "features_of"]

#: families whose logits are (nearly) all equal: subnormal keys (|logit| < 2**-100), and flat
#: (every logit the same up to noise of 1e-4): the scale and the cap change nothing there
FLAT_LOGITS = frozenset({"subnormal", "flat"})
#: families whose FP64 reference is non-finite on most rows: the NaN and -inf keys of
#: nan_inf_visible are visible to every row of an unmasked call (NaN scores, +inf scores where q
#: meets the -inf channel), so its outputs test NaN handling, not the features' arithmetic
POISONED = frozenset({"nan_inf_visible"})
#: a lower bound on the largest |logit| (natural units) a family reaches at the suites' shapes
#: (lengths >= 64, d >= 64), checked against the inputs by ``tests/test_feature_bugs.py``:
#: N(0, 1)-like logits reach 2.5 over 64 x 64 draws; peaked's key sits 12 above the rest; drift
#: rises to 40 (at 256 keys and more); offset's means give 16 sqrt(d); huge_logits start at 120.
#: A family not listed is taken to reach 0 (no softcap signal claimed).
LOGIT_REACH = {
    "normal": 2.5,
    "uniform": 2.0,
    "student_t": 2.5,
    "outliers": 10.0,
    "offset": 100.0,
    "peaked": 11.0,
    "drift": 30.0,
    "huge_logits": 120.0,
    "near_max": 2.5,
    "long_tail": 0.0,
    "nan_inf_masked": 2.5,
}

#: the features :func:`signal` judges (``dtype=`` and ``mask=`` take each value)
FEATURES = (
    "head_dims",
    "dtype",
    "mask",
    "softcap",
    "sink",
    "gqa",
    "score_mod",
    "mask_mod",
    "block_sparse",
    "aux_scalars",
    "varlen",
    "seqused_k",
    "paged",
)


def logit_reach(family: str) -> float:
    """:data:`LOGIT_REACH` of ``family``; the tile-step families rise by their step per 128-key
    tile (``audits.suites.inputs.TILE_STEPS_LOG2``), at least one step: step * ln 2."""
    if family.startswith("tile_step_"):
        return float(family[len("tile_step_") :]) * 0.6931471805599453
    return LOGIT_REACH.get(family, 0.0)


def _edges(case) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per query row of ``case`` (its longest sequence, varlen), the first and last key it sees
    (unclipped: bottom-right aligned as ``numerics.reference.visible_mask``: row i sees key j iff
    i + sk - sq - left <= j <= i + sk - sq + right, right = 0 when causal), and seqlen_k.  O(seqlen_q):
    coverage asks it of every record of a release run, at lengths up to 32k."""
    sq, sk = (case.seqlen_q, case.seqlen_k) if not case.varlen else max(case.seqlens, key=lambda p: p[0] * p[1])
    left, right = case.window
    right = 0 if case.causal else right
    i = torch.arange(sq, dtype=torch.int64) + (sk - sq)
    lo = i - left if left is not None else torch.full_like(i, -(1 << 40))
    hi = i + right if right is not None else torch.full_like(i, 1 << 40)
    return lo, hi, sk


def _mask_matters(case) -> bool:
    """Whether some row that sees a key misses the key just past one of its window's edges (key
    lo - 1 or hi + 1 exists): then a mask ignored, or an edge off by one, changes that row."""
    lo, hi, sk = _edges(case)
    sees = (lo.clamp(min=0) <= hi.clamp(max=sk - 1)) & (sk > 0)
    return bool((sees & ((lo >= 1) | (hi <= sk - 2))).any())


def features_of(case) -> set[str]:
    """The features ``case`` has (coverage's names: ``dtype=X``, ``mask=none|causal|local``,
    softcap, sink, gqa, the mod kinds), before asking whether its inputs make them matter."""
    mask = "causal" if case.causal else "local" if case.local else "none"
    got = {f"dtype={case.dtype}", f"mask={mask}"}
    got |= {"softcap"} if case.softcap > 0 else set()
    got |= {"sink"} if case.sink else set()
    got |= set(case.mods)
    return got | ({"gqa"} if case.heads_q != case.heads_kv else set())


def signal(case) -> frozenset[str]:
    """The features whose effect ``case``'s inputs make visible (the module's rule): among
    ``head_dims``, ``dtype=X``, ``mask=none|causal|local``, softcap, sink, gqa, the mod kinds,
    varlen, seqused_k and paged."""
    finite = case.family not in POISONED
    varies = finite and case.family not in FLAT_LOGITS
    out = set()
    if varies:
        out.add("head_dims")
    if finite:
        out.add(f"dtype={case.dtype}")
        out |= {"sink"} if case.sink else set()
        out |= set(case.mods)
        if 2 <= case.heads_kv < case.heads_q:
            out.add("gqa")
        if not case.causal and not case.local:
            out.add("mask=none")
    if (case.causal or case.local) and _mask_matters(case):
        out.add("mask=causal" if case.causal else "mask=local")
    if case.softcap > 0 and varies and logit_reach(case.family) >= case.softcap / 2:
        out.add("softcap")
    if case.varlen:
        live = [p for p in case.seqlens if p[0] and p[1]]
        out |= {"varlen"} if len(live) >= 2 else set()
        if case.seqused_k and any(u < p[1] for u, p in zip(case.seqused_k, case.seqlens)):
            out.add("seqused_k")
        if case.page_size and any(p[1] > case.page_size for p in case.seqlens):
            out.add("paged")
    return frozenset(out)
