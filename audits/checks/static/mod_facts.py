"""Facts of the mod paths in production's compiled SM100 kernels, against the model's forms.

A mod's numerics are the float32 instructions it adds to the score path.  They are read as a
*differential*: the kernel compiled with the mod against the same configuration compiled without
it (:func:`score_baseline`, :func:`mask_baseline`), so everything the mod does not touch cancels.
Per instruction (packed ``.f32x2`` forms counted as two elements under the scalar name), the
difference in elements must be a whole number per score the kernel computes — forward: the
softmax steps times tile_n (``audits.checks.static.facts``: each inlined softmax step handles one row
tile of tile_n scores); backward: the main kernel's exp2 count (one P per score) — and both
compiles must compute the same number of scores.  Anything else is :class:`PtxFormatError` (exit
2): a structure the differential does not understand, never a default.

* ``mod.score_ops`` (a case with a score_mod; baseline: the same case without it): the float32
  instructions per score the score_mod adds, against :data:`SCORE_OPS` (forward) /
  :data:`SCORE_OPS_BWD` (backward), the model's forms (``fa4.mod_forms``) written as
  instructions.  ALiBi's scale multiply contracted with the bias add into one ``fma.rn.f32``,
  which ``fa4.mod_forms`` was written from by hand, is this fact.
* ``mod.mask_ops`` (a dense case with a mask_mod; baseline: the same case without it, with the
  flags production resolves — the forward drops causal and the window beside a mask_mod,
  ``interface._resolve_causal_local_window``, the backward keeps them): per score, at least one
  select of -inf (``selp.f32 ..., 0fFF800000``; the backward's ``selp.b32 ..., -8388608``, -inf's
  bits; counted as ``selp.f32 -inf``, the one count not held to a whole number per score:
  :data:`MASK_OPS`) and no other float32 instruction: a mask changes which keys count, never the
  arithmetic (``fa4.model`` step 3).  In the backward beside causal or a window: nothing — it
  applies the flags alone, the mask_mod not at all (``mask.py`` ``apply_mask_sm100_transposed``;
  ``fa4.model_bwd`` does the same).
  Block-sparse cases inline the softmax once per block kind (full and partial lists), so their
  kernels have more softmax steps than the dense baseline and no like-for-like differential; for
  them the exp2 / rescale / P-conversion facts of every kernel (``audits.checks.static.core`` /
  ``backward``) and the attributes below are checked, with the score_mod differential (against
  the same block-sparse mask without the score_mod).
* ``mod.attributes``: what the compiled kernel object records (``fa4.sm100_compile``
  ``MOD_ATTRIBUTES``, read after its compile): a score_mod exactly when the case has one or the
  softcap flag (production's softcap is the score_mod ``utils.create_softcap_scoremod``), a
  score_mod_bwd with it (backward), a mask_mod, ``use_block_sparsity``, and the flags:
  ``is_causal`` / ``is_local`` False in the forward beside a mask_mod, the case's own in the
  backward (the semantic trap of docs/mods.md, visible in the kernels production builds).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from audits.checks.static.facts import PtxFormatError, instructions
from audits.checks.static.facts_bwd import split_kernels
from audits.suites.cases import Case
from fa4.sm100_compile import AUX_KERNELS

__all__ = [
    "SCORE_OPS",
    "SCORE_OPS_BWD",
    "MASK_OPS",
    "NEG_INF_SELECT",
    "score_baseline",
    "mask_baseline",
    "f32_elements",
    "differential",
    "expected_attributes",
    "production_attributes",
    "expected_mod_facts",
    "compare_mod_facts",
    "scores_of_main",
    "main_kernel_text",
]

#: the pseudo-instruction a -inf select counts under: ``selp.f32 %r, %r, 0fFF800000, %p`` (the
#: forward), or ``selp.b32 %r, -8388608, %r, %p``, -inf's bit pattern as an integer (the backward)
NEG_INF_SELECT = "selp.f32 -inf"
_NEG_INF = {"0FFF800000", "-8388608", "0XFF800000"}

#: float32 instructions per score each library score_mod adds to the forward, from the model's
#: forms (``fa4.mod_forms``, the float32 operations in production's order):
#: ``_alibi``: the distance converted exactly, ``slope * dist`` one FMUL, then ``_fused_bias`` —
#: ``fma.rn.f32(scale, acc, bias)``, the scale's multiply contracted with the add;
#: ``_relbias``: the table value loaded (no float arithmetic), ``_fused_bias``;
#: ``_softcap`` (``fa4.primitives.softcap_tanh``): FMUL ``acc * scale``, ``div.rn`` by the cap,
#: MUFU.TANH, FMUL by the cap;
#: ``_temperature``: FMUL ``acc * scale``, FMUL by the runtime scalar (no contraction: two products).
#: Without a score_mod the scale is folded into the exp2's factor (``utils.compute_softmax_scale_log2``),
#: so the scale's multiply is part of what the mod adds.
SCORE_OPS = {
    "alibi": {"cvt.rn.f32.s32": 1, "mul.f32": 1, "fma.rn.f32": 1},
    "relbias": {"fma.rn.f32": 1},
    "softcap": {"mul.f32": 2, "div.rn.f32": 1, "tanh.approx.f32": 1},
    "temperature": {"mul.f32": 2},
}

#: float32 instructions per score each library score_mod adds to the backward's main kernel: the
#: forward form again (P is recomputed from the modded score, ``fa4.mod_forms`` module doc: "one
#: model form serves both passes") plus the backward form (``fa4.mod_forms`` ``_identity_bwd``:
#: none, and the pre-mod score it would read is never formed; ``_softcap_bwd`` on ``x = fl32(S_pre
#: * scale)``, the very value the recomputed forward form divides, so ``x / c`` and its tanh are
#: computed once for both: then ``1 - t*t`` and the FMUL by g; ``_temperature_bwd``: the FMUL by
#: the scalar).  Softcap's ``1 - t*t`` is ``mul.f32`` then ``sub.f32``: without a rounding
#: modifier, which the PTX ISA lets ptxas contract into the one FFMA the model computes
#: (``fma_f32(-t, t, 1)``); a ``.rn`` form (not contractible) would be another instruction name.
SCORE_OPS_BWD = {
    "alibi": dict(SCORE_OPS["alibi"]),
    "relbias": dict(SCORE_OPS["relbias"]),
    "softcap": {"mul.f32": 4, "div.rn.f32": 1, "tanh.approx.f32": 1, "sub.f32": 1},
    "temperature": {"mul.f32": 3},
}

#: what a mask_mod adds per score (forward and backward): at least one -inf select, no float
#: arithmetic.  A select of -inf leaves the score or makes it -inf, so how many a mask takes does
#: not change a value: the sliding window's ``(kv <= c) & (kv >= c - w)`` is two selects in one
#: of the two softmax steps of the mods suite's kernels (1.5 per score); every other library mask one
MASK_OPS = {NEG_INF_SELECT: ">= 1"}

_F32_KINDS = {"add", "sub", "mul", "fma", "div", "rcp", "sqrt", "rsqrt", "tanh", "ex2", "lg2", "sin", "cos"}
_F32_KINDS |= {"min", "max", "neg", "abs", "cvt", "copysign", "testp"}


def score_baseline(c: Case) -> Case | None:
    """The case the score_mod differential compares against: ``c`` without its score_mod (mask,
    block sparsity and flags kept); None without a score_mod."""
    return dataclasses.replace(c, score_mod="") if c.score_mod else None


def mask_baseline(c: Case, *, backward: bool = False) -> Case | None:
    """The case the mask_mod differential compares against: ``c`` without its mask_mod and, in
    the forward, with production's resolved flags (causal and the window dropped); None without
    a mask_mod or with block sparsity (module doc)."""
    if not c.mask_mod or c.block_sparse:
        return None
    base = dataclasses.replace(c, mask_mod="")
    return base if backward else dataclasses.replace(base, causal=False, window=(None, None))


def f32_elements(ptx: str) -> Counter:
    """Float32 instructions of ``ptx`` by name, in elements: a packed ``.f32x2`` instruction
    counts two under its scalar name, another ``x2`` form (``cvt.rn.bf16x2.f32``) two under its
    own; -inf selects (float or bit pattern) under :data:`NEG_INF_SELECT`."""
    out = Counter()
    for op, args in instructions(ptx):
        parts = op.split(".")
        if op in ("selp.f32", "selp.b32") and _NEG_INF.intersection(a.strip().upper() for a in args.split(",")):
            out[NEG_INF_SELECT] += 1
        elif parts[0] in _F32_KINDS and any(p in ("f32", "f32x2") for p in parts[1:]):
            out[op.replace(".f32x2", ".f32")] += 2 if any(p.endswith("x2") for p in parts[1:]) else 1
    return out


def differential(
    with_mod: Counter, without: Counter, *, scores: int, scores_without: int, what: str, selects: bool = True
) -> dict:
    """Per score, the float32 elements ``with_mod`` has beyond ``without`` (:func:`f32_elements`
    of the two compiles): ``{op: n}``, zeros left out.  ``scores``: the scores each kernel
    computes (forward: steps x tile_n; backward: the main kernel's exp2 count); they must agree,
    and every difference must be a whole multiple of them, else PtxFormatError naming ``what``.
    -inf selects are a ratio per score (:data:`MASK_OPS`), left out with ``selects=False`` (the
    score_mod differential: the compiler merges a mask's conditions into more or fewer selects
    beside a score_mod — the backward with the sliding window selects once less per score beside
    ALiBi or relbias — which changes no value)."""
    if scores != scores_without or scores < 1:
        raise PtxFormatError(
            f"{what}: the kernel computes {scores} scores with the mod and {scores_without} without: "
            "no like-for-like differential (a loop structure the extractor does not know)"
        )
    out = {}
    for op in sorted(set(with_mod) | set(without)):
        d = with_mod[op] - without[op]
        if op == NEG_INF_SELECT:  # a mask may select in several steps (a & b as two selects): a ratio
            if d and selects:
                out[op] = round(d / scores, 4)
            continue
        if d % scores:
            raise PtxFormatError(
                f"{what}: {op} differs by {d} elements ({with_mod[op]} with the mod, {without[op]} without), "
                f"not a whole number per score ({scores} scores)"
            )
        if d:
            out[op] = d // scores
    return out


def scores_of_main(text: str) -> int:
    """The backward's scores: ``ex2`` instructions of its main kernel(s) (``split_kernels``)."""
    n = sum(
        1
        for cls, ptx in split_kernels(text)
        if cls not in AUX_KERNELS
        for op, _ in instructions(ptx)
        if op.startswith("ex2.")
    )
    if not n:
        raise PtxFormatError("no ex2 in the backward's main kernel: not an attention backward")
    return n


def main_kernel_text(text: str) -> str:
    """The backward's main kernel(s) PTX (the preprocess and postprocesses left out)."""
    return "".join(ptx for cls, ptx in split_kernels(text) if cls not in AUX_KERNELS)


def expected_attributes(c: Case, *, backward: bool = False) -> dict:
    """``mod.attributes`` the model implies (module doc): presence of each mod, block sparsity
    and the flags production resolves."""
    if backward:
        causal, local = c.causal, c.local
    else:
        causal, local = (False, False) if c.mask_mod else (c.causal, c.local)
    want = {
        "score_mod": bool(c.score_mod) or c.softcap > 0,
        "mask_mod": bool(c.mask_mod),
        "use_block_sparsity": bool(c.block_sparse),
        "is_causal": causal,
        "is_local": local,
    }
    if backward:
        want["score_mod_bwd"] = want["score_mod"]
    return want


def production_attributes(chosen: dict, *, backward: bool = False) -> dict:
    """``mod.attributes`` as production recorded them (``fa4.sm100_compile``'s JSON: the main
    kernel's ``mods`` and ``attributes``); PtxFormatError when the record has no ``mods`` (a
    compile from before ``MOD_ATTRIBUTES`` was recorded: delete the cached PTX)."""
    mods, attrs = chosen.get("mods"), chosen.get("attributes", {})
    if mods is None or "is_causal" not in attrs:
        raise PtxFormatError(
            f"the compile record of {chosen.get('kernel_class')} has no mod attributes ({sorted(chosen)}): "
            "recompile (delete its cached .ptx.gz / .ptx.json)"
        )
    got = {
        "score_mod": mods.get("score_mod") is not None,
        "mask_mod": mods.get("mask_mod") is not None,
        "use_block_sparsity": bool(mods.get("use_block_sparsity")),
        "is_causal": bool(attrs["is_causal"]),
        "is_local": bool(attrs.get("is_local")),
    }
    if backward:
        got["score_mod_bwd"] = mods.get("score_mod_bwd") is not None
    return got


def expected_mod_facts(c: Case, *, backward: bool = False) -> dict:
    """The expectations of the mod facts for ``c`` (those that apply to it)."""
    want = {"mod.attributes": expected_attributes(c, backward=backward)}
    if c.score_mod:
        table = SCORE_OPS_BWD if backward else SCORE_OPS
        # a score_mod without a table is a difference naming what is missing, never a match
        want["mod.score_ops"] = (
            dict(sorted(table[c.score_mod].items()))
            if c.score_mod in table
            else f"no instruction table for score_mod {c.score_mod!r} in audits.checks.static.mod_facts "
            f"(it has: {', '.join(table)})"
        )
    if mask_baseline(c, backward=backward) is not None:
        # the backward keeps causal / the window beside a mask_mod, and then applies only them:
        # mask.py apply_mask_sm100_transposed takes the mask_mod branch only "not mask_causal and not
        # mask_local" (fa4.model_bwd: ``use_mm = mask_mod is not None and not flags``) — no mask op at all
        flags_only = backward and (c.causal or c.local)
        want["mod.mask_ops"] = {} if flags_only else dict(MASK_OPS)
    return want


def _agrees(got, want) -> bool:
    """``got == want``, where a ``">= x"`` value in a dict ``want`` takes any number at least x."""
    if not (isinstance(want, dict) and isinstance(got, dict)):
        return got == want
    if set(got) != set(want):
        return False
    return all(
        isinstance(got[k], (int, float)) and got[k] >= float(v[2:])
        if isinstance(v, str) and v.startswith(">= ")
        else got[k] == v
        for k, v in want.items()
    )


def compare_mod_facts(facts: dict, want: dict) -> list[dict]:
    """Differences ``[{"fact", "production", "model"}]`` between the mod facts and expectations."""
    return [
        {"fact": name, "production": facts.get(name), "model": value}
        for name, value in want.items()
        if not _agrees(facts.get(name), value)
    ]
