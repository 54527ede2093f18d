"""The named suites, each defined once as a function of the domain it is built in.

``smoke`` is the CPU/CI suite: every feature axis and every input family at least once, each
non-finite family with every mask kind it applies to (:data:`NONFINITE_MASKS`: a kernel masking
with a large negative score instead of -inf is caught only by a causal NaN key), small enough for
the model on 2 cores.  ``release`` (GPU) is a pairwise-covering array of FA's test axes times
every input family, the varlen array, and :func:`class_cases` (every code-path class of both
archs, forward and backward); ``head-dims`` is every head dim SM90 accepts, both 16-bit dtypes,
causal and not (:func:`head_dim_sweep`); ``nightly`` is release with three seeds, lengths up to
32k, and ``head-dims``; ``fidelity`` is the fixed list the model is compared with production on
(``fa4-audit fidelity``); ``mods`` is every library score_mod and mask_mod, alone and paired,
dense and block-sparse, with the cross-check pairs (``audits.suites.mod_cases``, ``docs/mods.md``),
part of release and nightly; smoke has a few mod cases.  ``bias`` is the fixed list of the adversarial
``tied_max`` family (:func:`bias_suite`), which no generated suite places.

:func:`build_suite` builds a suite inside a domain (``audits.suites.domain``): the unrestricted
one (or one restricting only the mod kinds) gives the suite as defined; a restricted one builds
it over the domain, not filtered (the supported axis values' covering array, lengths made from
the domain's block, cases moved into it), and says which families cannot be placed.  A mod case
is built only where the domain declares its kinds.  :func:`suite` gives the cases alone.
"""

from __future__ import annotations

import dataclasses

from audits.suites.axes import (
    RELEASE_AXES,
    SEQLEN_PAIRS,
    axes_within,
    case_within,
    fit,
    inside,
    pairs_covered,
    pairwise,
    release_case,
)
from audits.suites.case import (
    DTYPES,
    LAYOUTS,
    MOD_KINDS,
    Case,
    case_from_dict,
    case_from_json,
    cases_from_file,
    seed_of,
    varlen_case,
)
from audits.suites.domain import Domain, seqlens_within
from audits.suites.inputs import FAMILIES
from audits.suites.mod_cases import (
    MOD_BLOCK,
    MOD_BLOCK_SM100,
    MODS_ADVERSARIAL,
    mods_cross_checks,
    mods_suite,
    smoke_mods,
    varlen_mods,
)
from audits.suites.varlen_cases import release_varlen, smoke_varlen

__all__ = [
    "SUITES",
    "suite",
    "build_suite",
    "smoke_suite",
    "release_suite",
    "bias_suite",
    "nightly_suite",
    "head_dims_suite",
    "fidelity_suite",
    "mods_suite",
    "smoke_within",
    "release_within",
    "nightly_within",
    "head_dims_within",
    "mods_within",
    "mask_kind",
    "sweep_head_dims",
    "fidelity_cases",
    "head_dim_sweep",
    "class_cases",
    "SM90_HEAD_DIMS",
    "NONFINITE_MASKS",
    "NIGHTLY_SEEDS",
    "NIGHTLY_PAIRS",
    # defined in the modules of the case, the axes, the mod and the varlen cases; importable from here
    "Case",
    "varlen_case",
    "case_from_dict",
    "case_from_json",
    "cases_from_file",
    "DTYPES",
    "LAYOUTS",
    "MOD_KINDS",
    "pairwise",
    "release_case",
    "RELEASE_AXES",
    "SEQLEN_PAIRS",
    "smoke_varlen",
    "release_varlen",
    "smoke_mods",
    "varlen_mods",
    "mods_cross_checks",
    "MOD_BLOCK",
    "MOD_BLOCK_SM100",
    "MODS_ADVERSARIAL",
]


#: the mask kinds ("none", "causal", "local") each non-finite input family applies to; smoke has
#: each pair (nan_inf_masked needs keys no query sees: a left window, so local only)
NONFINITE_MASKS = {"nan_inf_visible": ("none", "causal", "local"), "nan_inf_masked": ("local",)}


def _smoke_fixed() -> list[Case]:
    """smoke's fixed-length cases as defined (the unrestricted domain's): every feature axis and
    input family at least once, and the range-stressing families per dtype (tests/test_inputs.py
    and the seeded-bug catalogue, tests/test_catalogue.py, keep it so)."""
    base = [
        Case("bfloat16", 64, 64, 2, 4, 2, 200, 300, causal=True, family="normal"),  # GQA, batch 2, non-multiple-of-128
        Case("float16", 128, 128, 1, 4, 1, 160, 160, family="uniform"),  # MQA
        Case("float8_e4m3fn", 128, 128, 1, 2, 2, 128, 384, family="student_t"),
        Case("float8_e5m2", 64, 64, 1, 2, 2, 96, 200, causal=True, family="outliers"),
        Case("bfloat16", 256, 256, 1, 2, 1, 64, 260, family="offset"),
        Case("bfloat16", 96, 96, 1, 2, 2, 130, 70, causal=True, family="peaked"),  # sq > sk: rows with no visible key
        Case("bfloat16", 128, 128, 1, 2, 2, 200, 200, window=(64, 16), family="flat"),
        Case("float8_e4m3fn", 64, 64, 1, 1, 1, 64, 2048, family="long_tail"),
        Case("bfloat16", 64, 64, 1, 1, 1, 64, 2048, family="long_tail", seed=1),  # flush of small P, 16-bit
        Case("bfloat16", 64, 64, 1, 2, 2, 64, 1024, family="drift", sink=True),
        Case("bfloat16", 128, 128, 1, 2, 2, 128, 128, softcap=15.0, layout="packed_qkv", family="huge_logits"),
        Case("float16", 64, 64, 1, 2, 2, 100, 100, family="near_max", layout="strided"),
        Case("bfloat16", 64, 72, 1, 2, 2, 64, 96, family="subnormal"),  # head_dim_v not a multiple of 32
        # d != dv where the scale matters (the subnormal case above has logits of 2**-130: any scale
        # gives the same attention there; audits.suites.signal): a kernel scaling by 1/sqrt(dv), or
        # by 1/sqrt of d padded to 96, fails here (tests/test_feature_bugs.py)
        Case("float16", 72, 80, 1, 2, 2, 96, 160, family="student_t"),
        # the non-finite families with every mask kind they apply to (NONFINITE_MASKS): a kernel
        # that masks by adding -1e6 to the scores lets the NaN key past the diagonal poison the
        # rows before it, which only a causal nan_inf_visible case shows; the fp16 ones at equal
        # lengths of 128 lie inside restricted domains (fp16, multiples of 128)
        Case("bfloat16", 64, 64, 1, 2, 2, 64, 200, causal=True, family="nan_inf_visible"),
        Case("float16", 64, 64, 1, 2, 2, 128, 128, causal=True, family="nan_inf_visible"),
        Case("float16", 64, 64, 1, 2, 2, 128, 128, family="nan_inf_visible"),
        Case("bfloat16", 64, 64, 1, 2, 2, 64, 256, window=(64, 16), family="nan_inf_visible"),
        Case("bfloat16", 64, 64, 1, 2, 2, 64, 400, window=(32, 0), family="nan_inf_masked"),
        Case("float16", 64, 64, 1, 2, 2, 64, 300, window=(40, 24), family="nan_inf_masked"),
        Case("bfloat16", 128, 128, 1, 16, 4, 160, 256, family="normal"),  # 2560 query rows x heads
        # the learnable sink on 3 heads (above, near and below the head's max logit: see
        # audits.suites.inputs.SINK_PLACES), MQA, and rows with no visible key (out 0, lse = sink)
        Case("float16", 64, 64, 1, 3, 1, 96, 64, causal=True, sink=True, family="normal"),
        # softcap where tanh does not saturate: logits 0..40 against a cap of 15
        Case("bfloat16", 64, 64, 1, 2, 2, 96, 256, softcap=15.0, family="drift"),
        # range stress per dtype: drifting maxima (19 log2 units per 128-key tile; causal rows end
        # at every key of the last tile, so the max's lag at the last rescale takes every value),
        # V near the dtype's largest value, outlier channels.  bf16 near_max is absent: V ~ 3.4e38
        # makes P.V overflow float32 in any float32-accumulating kernel (out of every domain).
        Case("float16", 64, 64, 1, 2, 2, 128, 384, causal=True, family="drift"),
        Case("float16", 128, 128, 1, 2, 2, 64, 256, family="outliers"),
        Case("bfloat16", 128, 128, 1, 2, 2, 64, 256, family="outliers"),
        Case("float8_e4m3fn", 64, 64, 1, 2, 2, 128, 384, causal=True, family="drift"),
        Case("float8_e4m3fn", 64, 64, 1, 2, 2, 64, 200, family="near_max"),
        Case("float8_e4m3fn", 128, 128, 1, 2, 2, 64, 256, family="outliers"),
        Case("float8_e5m2", 64, 64, 1, 2, 2, 128, 384, causal=True, family="drift"),
        Case("float8_e5m2", 64, 64, 1, 2, 2, 64, 200, family="near_max"),
    ]
    steps = [Case("bfloat16", 64, 64, 1, 1, 1, 32, 1024, family=f) for f in FAMILIES if f.startswith("tile_step_")]
    return base + steps


def _with_mods(d: Domain, cases: list[Case]) -> list[Case]:
    """``cases`` without the mod cases whose kinds ``d`` does not declare."""
    return [c for c in cases if all(d.takes(k) for k in c.mods)]


def mask_kind(case: Case) -> str:
    """The mask kind of ``case``: ``"causal"``, ``"local"`` (a window) or ``"none"``."""
    return "causal" if case.causal else "local" if case.local else "none"


def _smoke_case_within(d: Domain, row: dict, family: str) -> tuple[Case | None, str | None]:
    """:func:`~audits.suites.axes.case_within` for smoke, which leaves bf16 ``near_max`` out as its
    definition does: V ~ 3.4e38 makes P.V overflow float32 in any float32-accumulating kernel."""
    if family == "near_max" and row["dtype"] == "bfloat16":
        return None, "smoke leaves bfloat16 near_max out (P.V overflows float32 in every kernel)"
    return case_within(d, row, family, 0)


def _smoke_generated(d: Domain) -> tuple[list[Case], dict, dict]:
    """smoke's fixed-length cases rebuilt in a restricted domain, (cases, axes, not applicable):
    the pairwise rows of its axes with short lengths (up to five blocks), each input family on one
    row (families and rows taken in turn until both are used up), and each non-finite family
    again on a row of every mask kind it applies to (:data:`NONFINITE_MASKS`) that the domain
    supports and it has no case of yet (a NaN key beyond the causal diagonal is another test than
    one in an unmasked row)."""
    short = dataclasses.replace(d, max_seqlen=min(d.max_seqlen or 1 << 30, max(3 * d.seqlen_multiple, 256)))
    axes = {**axes_within(d), "seqlens": seqlens_within(short, [(64, 128), (130, 70), (200, 300), (256, 256)])}
    rows, fams = pairwise(axes), list(FAMILIES)
    cases, missing = [], {}
    for i in range(max(len(rows), len(fams))):
        f = fams[i % len(fams)]
        tries = [_smoke_case_within(d, rows[(i + j) % len(rows)], f) for j in range(len(rows))]
        case = next((c for c, _ in tries if c is not None), None)
        if case is None:
            missing.setdefault(f, f"no case of family {f} fits the domain; e.g. {tries[0][1]}")
        else:
            cases.append(case)
    for f, kinds in NONFINITE_MASKS.items():
        for m in (k for k in kinds if k in axes["mask"]):
            if any(c.family == f and mask_kind(c) == m for c in cases):
                continue
            tries = (_smoke_case_within(d, r, f) for r in rows if r["mask"] == m)
            case = next((c for c, _ in tries if c is not None and mask_kind(c) == m), None)
            cases += [case] if case is not None else []
    return cases, axes, missing


def smoke_within(d: Domain) -> dict:
    """``smoke`` in the domain: its fixed-length cases (as defined when ``d`` restricts no case
    but by mod kinds, else rebuilt over the domain: :func:`_smoke_generated`), then its varlen
    cases inside the domain and its mod cases moved into it (:func:`mods_within`).  Returns
    ``{"cases", "axes", "pairs_covered", "not_applicable": {family: reason}}``."""
    if d.unrestricted_but_mods():
        fixed, axes, missing = _smoke_fixed(), None, {}
    else:
        fixed, axes, missing = _smoke_generated(d)
    cases = fixed + inside(d, smoke_varlen()) + mods_within(d, smoke_mods() + varlen_mods(smoke=True))["cases"]
    return {
        "cases": list(dict.fromkeys(cases)),
        "axes": axes,
        "pairs_covered": None if axes is None else pairs_covered(axes),
        "not_applicable": missing,
    }


def release_within(d: Domain, *, seeds: tuple[int, ...] = (0,), extra_pairs: list | None = None) -> dict:
    """``release`` in the domain, built over it, not filtered: the pairwise covering array of the
    supported axis values (:func:`~audits.suites.axes.axes_within`; :data:`RELEASE_AXES` when
    unrestricted) times every input family and seed, then release's varlen cases that lie inside
    the domain, the code-path class cases (:func:`class_cases`) that lie inside it, and the
    ``mods`` suite within it (:func:`mods_within`).  A family none of whose cases fits the domain
    (``nan_inf_masked`` needs keys no query sees: a left window and unequal lengths) is listed
    under ``not_applicable`` with the reason, never a case outside the domain."""
    axes = axes_within(d)
    if extra_pairs:
        axes["seqlens"] = list(dict.fromkeys(axes["seqlens"] + seqlens_within(d, list(extra_pairs))))
    rows = pairwise(axes)
    placed = {(s, f): [case_within(d, r, f, s) for r in rows] for s in seeds for f in FAMILIES}
    missing = {}
    for f in FAMILIES:
        tried = [p for s in seeds for p in placed[s, f]]
        if all(c is None for c, _ in tried):
            need = " (it needs keys no query sees: a left window short of them)" if f == "nan_inf_masked" else ""
            missing[f] = f"no case of family {f} fits the domain{need}; e.g. {next(why for _, why in tried)}"
    # seed-major as defined (the unrestricted domain), family-major within a domain: the orders reports carry
    order = [(s, f) for s in seeds for f in FAMILIES]
    if d != Domain():
        order = [(s, f) for f in FAMILIES for s in seeds]
    cases = [c for key in order for c, _ in placed[key] if c is not None]
    cases += inside(d, release_varlen(seeds)) + inside(d, class_cases()) + mods_within(d)["cases"]
    return {
        "cases": list(dict.fromkeys(cases)),
        "axes": axes,
        "pairs_covered": pairs_covered(axes),
        "not_applicable": missing,
    }


#: ``nightly``'s seeds and the lengths it adds to release's
NIGHTLY_SEEDS = (0, 1, 2)
NIGHTLY_PAIRS = ((16384, 16384), (2048, 32768), (32768, 32768))


def nightly_within(d: Domain) -> dict:
    """``nightly`` in the domain: release over :data:`NIGHTLY_SEEDS` with :data:`NIGHTLY_PAIRS`
    (lengths up to 32k), and every head dim SM90 accepts (:func:`head_dims_within`)."""
    built = release_within(d, seeds=NIGHTLY_SEEDS, extra_pairs=list(NIGHTLY_PAIRS))
    sweep = head_dims_within(d)
    return {
        **built,
        "cases": list(dict.fromkeys(built["cases"] + sweep["cases"])),
        "not_applicable": {**built["not_applicable"], **sweep["not_applicable"]},
    }


#: the masks :func:`head_dim_sweep` takes, as (causal, window)
SWEEP_MASKS = {"none": (False, (None, None)), "causal": (True, (None, None)), "local": (False, (96, 32))}
#: the sweep's lengths: a multiple of no tile of either arch or direction (fa4.code_paths)
SWEEP_SEQLENS = (200, 333)


def head_dim_sweep(
    *, pairs: tuple | list, dtypes: tuple | list, masks: tuple | list = ("none", "causal")
) -> list[Case]:
    """One case per (d, dv) pair x dtype x mask ("none", "causal" or "local"): batch 2, 4 query
    heads on 2 KV heads, 200 queries x 333 keys (partial tiles at both ends), family normal,
    the seed derived from the case.  Nightly's every-head-dim axis (``head-dims``)."""
    bad = [m for m in masks if m not in SWEEP_MASKS]
    if bad:
        raise ValueError(f"head_dim_sweep: mask(s) {bad} are not known; accepted: {', '.join(SWEEP_MASKS)}")
    sq, sk = SWEEP_SEQLENS
    out = []
    for d, dv in pairs:
        for dtype in dtypes:
            for m in masks:
                causal, window = SWEEP_MASKS[m]
                seed = seed_of("head-dims", dtype, d, dv, m)
                out.append(Case(dtype, d, dv, 2, 4, 2, sq, sk, causal=causal, window=window, seed=seed))
    return out


#: every head dim production's SM90 path accepts for 16-bit inputs (``interface._validate_head_dims``:
#: 8..256, a multiple of 16 bytes / element size = 8)
SM90_HEAD_DIMS = tuple(range(8, 257, 8))


_SIXTEEN_BIT = ("bfloat16", "float16")


def sweep_head_dims(d: Domain) -> list[tuple[int, int]]:
    """The head dims the ``head-dims`` sweep takes in ``d``: per accepted d, (d, d) when the
    domain accepts it, else every accepted pair with that d (production SM100's (192, 128));
    production SM90's (d, d) for d in 8..256 step 8 (:data:`SM90_HEAD_DIMS`) when head dims are
    unrestricted."""
    pairs = d.head_dim_pairs()
    if pairs is None:  # production SM90's, every multiple of 8 in 8..256 (interface.py, _validate_head_dims)
        return [(x, x) for x in SM90_HEAD_DIMS]
    out = []
    for x in dict.fromkeys(p[0] for p in pairs):
        out += [(x, x)] if d.accepts_head_dims(x, x) else [p for p in pairs if p[0] == x]
    return out


def head_dims_within(d: Domain) -> dict:
    """The ``head-dims`` suite in the domain: :func:`head_dim_sweep` at :func:`sweep_head_dims`, on
    the domain's 16-bit dtypes, unmasked and (if supported) causal, each case moved into the domain
    where its lengths, heads or layout are not (:func:`~audits.suites.axes.fit`); unrestricted: d = dv
    at every SM90 head dim, bf16 and fp16, causal and not (128 cases)."""
    axes = {
        "d": sweep_head_dims(d),
        "dtype": [t for t in (d.dtypes or _SIXTEEN_BIT) if t in _SIXTEEN_BIT],
        "mask": ["none"] + ["causal"] * d.causal,
    }
    if not axes["dtype"]:
        why = f"the head-dim sweep runs bfloat16 and float16; the domain's dtypes are {d.dtypes}"
        return {"cases": [], "axes": axes, "pairs_covered": 0, "not_applicable": {"head-dims": why}}
    sweep = head_dim_sweep(pairs=axes["d"], dtypes=tuple(axes["dtype"]), masks=tuple(axes["mask"]))
    placed = [fit(d, c) for c in sweep]
    cases = [c for c, _ in placed if c is not None]
    missing = {}
    if len(cases) < len(placed):
        why = next(w for _, w in placed if w is not None)
        missing["head-dims"] = (
            f"{len(placed) - len(cases)} of the sweep's {len(placed)} cases fit no length, head or layout "
            f"of the domain; e.g. {why}"
        )
    return {
        "cases": list(dict.fromkeys(cases)),
        "axes": axes,
        "pairs_covered": pairs_covered(axes),
        "not_applicable": missing,
    }


def mods_within(d: Domain, cases: list[Case] | None = None) -> dict:
    """The ``mods`` suite (``audits.suites.mod_cases.mods_suite``; or ``cases``, mod cases of another
    suite) in the domain: nothing when it declares no mod kind; else each case whose kinds it
    takes, moved into it along the axes a mod case does not test (lengths, heads, layout:
    :func:`~audits.suites.axes.fit`; a dtype or head dim outside it is not moved).  A case that still
    lies outside is left out and counted under ``not_applicable["mods"]`` with the first reason."""
    cases = mods_suite() if cases is None else cases
    if d.mods == ():
        why = (
            "the domain declares no mod kinds (mods = [], or absent in a kernel's declaration): mod cases run only "
            "where the kernel takes them"
        )
        return {"cases": [], "axes": None, "pairs_covered": None, "not_applicable": {"mods": why}}
    placed = [fit(d, c) for c in _with_mods(d, cases)]
    kept = [c for c, _ in placed if c is not None]
    missing = {}
    if len(kept) < len(placed):
        why = next(w for _, w in placed if w is not None)
        n = len(placed) - len(kept)
        missing["mods"] = f"{n} of {len(placed)} mod cases fit no length, head or layout of the domain; e.g. {why}"
    return {"cases": list(dict.fromkeys(kept)), "axes": None, "pairs_covered": None, "not_applicable": missing}


#: the input families class cases take in turn: finite ones whose errors sit well inside the
#: bounds on a correct kernel (a code path's fault then shows as a plain failure), several of them
#: so that a class case's head dim or lengths, which no other case of ``release`` has, need not
#: wait for the ``normal`` slot of the run order (``audits.engine.shards.run_order``: every axis
#: value of release within its first 26 cases, ``tests/test_run_stop.py``)
_CLASS_FAMILIES = ("normal", "uniform", "student_t", "outliers", "offset", "peaked", "flat", "long_tail")


def class_cases() -> list[Case]:
    """Cases that together fall in every code-path class of every arch (``fa4.code_paths``)
    in the forward and the backward — the deterministic backward aside, a run option
    (``deterministic=True``), not a case: SM90's forward tiles by head-dim band, mask and dv; its
    backward tiles (the 80-row dQ_swapAB tile, 64x96 at both dv, 64x48); head dims padded at
    every granularity (16, 32, 64) and exact; SM100's 2-CTA and 1-CTA, one and two Q stages,
    (192, 128) and (256, 256) with the dedicated hd256 backward; GQA packed and not; softcap,
    sink, varlen, paged and split-KV (with the 64-key tile of split d != dv); score_mod,
    mask_mod, block sparsity with SM90's block-sparse tiles and runtime scalars.  Lengths off every tile; batch
    1-2.  ``tests/test_cases.py`` checks the coverage."""

    families = iter(_CLASS_FAMILIES * 4)

    def fixed(dtype, d, dv, hq, hk, sq, sk, **kw) -> Case:
        tag = "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
        seed = seed_of("class", dtype, d, dv, hq, hk, sq, sk, tag)
        return Case(dtype, d, dv, 2, hq, hk, sq, sk, seed=seed, family=next(families), **kw)

    def var(seqlens, d, dv, hq, hk, **kw) -> Case:
        seed = seed_of("class-varlen", seqlens, d, dv, hq, hk, sorted(kw.items()))
        return varlen_case(seqlens=seqlens, dtype="bfloat16", d=d, dv=dv, heads_q=hq, heads_kv=hk, seed=seed, **kw)

    local = (96, 32)
    return [
        fixed("bfloat16", 64, 64, 4, 2, 300, 333),  # SM90 192x128 / 128x128; SM100 q_stage 2, 1-CTA
        fixed("bfloat16", 96, 96, 2, 2, 300, 333, causal=True),  # 192x128 causal / 64x128 one-WG dQ
        fixed("float16", 96, 96, 2, 2, 300, 333),  # 192x144
        fixed("bfloat16", 128, 128, 2, 2, 300, 333),  # 128x128 / 80x128 dQ_swapAB; SM100 2-CTA both ways
        fixed("float16", 128, 128, 2, 2, 300, 333, causal=True),  # 64x128
        fixed("bfloat16", 192, 128, 2, 2, 300, 333),  # 128x128 at hd192 / 64x96; SM100 (192, 128)
        fixed("bfloat16", 192, 192, 2, 2, 300, 333),  # 128x112 / 64x96 with one dO stage
        fixed("float16", 192, 128, 2, 2, 300, 333, window=local),  # 128x96 local
        fixed("bfloat16", 256, 256, 2, 2, 300, 333),  # 128x80 / 64x48; SM100 hd256, dedicated backward
        fixed("float16", 256, 256, 2, 2, 300, 333, window=local),  # 128x64 local
        fixed("float16", 72, 72, 2, 2, 300, 333, causal=True),  # padded to 16 (SM90), 32 (SM100 backward);
        # SM90's backward accumulators wider than its tile (96 vs 80)
        fixed("bfloat16", 104, 104, 2, 2, 300, 333),  # SM90 80-row dQ_swapAB tile at padded head dim 112
        fixed("bfloat16", 200, 200, 2, 2, 300, 333),  # SM90 backward padded to 64
        fixed("bfloat16", 128, 128, 2, 2, 100, 333),  # SM100 q_stage 1: one M block, 1-CTA
        fixed("bfloat16", 256, 256, 6, 2, 300, 333),  # SM100 hd256 at 128 % 3 != 0: pack_gqa off
        fixed("bfloat16", 64, 64, 2, 2, 300, 333, softcap=15.0, sink=True),
        # the mods (docs/mods.md), at blocks production's SM90 takes in both directions: score_mod,
        # mask_mod and block sparsity; the 128-row forward tile at d <= 96 (block_q no multiple of 192);
        # runtime scalars (aux_scalars: the temperature score mod)
        fixed("bfloat16", 64, 64, 2, 2, 300, 333, score_mod="alibi", mask_mod="document", block_sparse=MOD_BLOCK),
        fixed("float16", 96, 96, 2, 2, 300, 333, score_mod="temperature", mask_mod="causal", block_sparse=MOD_BLOCK),
        # hd256 block-sparse: backward 64x64 (block_k = its tile_n 64), forward 128x80 fitted to 64
        fixed("bfloat16", 256, 256, 2, 2, 300, 333, mask_mod="sliding_window", block_sparse=(128, 64)),
        # a 64-row sparse block: the forward's tile_m 64 (a fitted tile), the backward's 64 x 128
        fixed("bfloat16", 128, 128, 2, 2, 300, 333, score_mod="softcap", mask_mod="prefix_lm", block_sparse=(64, 128)),
        var(((100, 400), (37, 300), (0, 20)), 64, 64, 4, 2, page_size=64, causal=True),  # varlen, paged
        var(((100, 400), (37, 300)), 64, 64, 4, 2, pack_gqa=False),  # GQA without pack_gqa
        var(((2, 700), (77, 400)), 64, 64, 4, 2, num_splits=3, pack_gqa=True),  # split-KV
        var(((1, 8192), (3, 8100)), 192, 128, 2, 2, num_splits=2),  # split at d != dv, 64 blocks: 64-key tiles
    ]


def _fidelity_case(d: int, sq: int, sk: int, *, hq: int = 4, hk: int = 4, b: int = 2, **kw) -> Case:
    return Case(kw.pop("dtype", "bfloat16"), d, d, b, hq, hk, sq, sk, **kw)


def fidelity_cases() -> dict[str, Case]:
    """The ``fidelity`` suite's cases by label (``--case`` globs match these labels as well as the
    case names): head dims 64-256, causal and not, GQA/MQA, seqlen_q != seqlen_k, a local window,
    softcap, a learnable sink, fp16 and drifting logits; the default of ``fa4-audit fidelity``
    (``audits.checks.fidelity.core``), whose committed H200 reports name them."""
    out = {}
    for d in (64, 96, 128, 192, 256):
        for causal in (False, True):
            for hk in (4, 1):
                label = f"d{d}{'_causal' if causal else ''}{'_mqa' if hk == 1 else ''}"
                out[label] = _fidelity_case(d, 384, 640, hk=hk, causal=causal, seed=d + causal)
        out[f"d{d}_sq_gt_sk_causal"] = _fidelity_case(d, 600, 333, causal=True, seed=d + 7)
    out.update(
        d128_window=_fidelity_case(128, 512, 512, window=(100, 20), seed=11),
        d64_window_left=_fidelity_case(64, 300, 700, window=(64, None), seed=12),
        d128_softcap=_fidelity_case(128, 256, 512, softcap=15.0, seed=13),
        d128_sink=_fidelity_case(128, 256, 384, sink=True, seed=14),
        d128_fp16=_fidelity_case(128, 256, 1024, dtype="float16", seed=15),
        d128_fp16_drift=_fidelity_case(128, 128, 2048, dtype="float16", family="drift", seed=16),
        d128_bf16_drift_gqa=_fidelity_case(128, 256, 1536, hq=8, hk=2, family="drift", seed=17),
        d256_long=_fidelity_case(256, 128, 4096, hq=2, hk=2, b=1, seed=18),
    )
    return out


def fidelity_suite() -> list[Case]:
    """:func:`fidelity_cases` in order: the model against production, case for case."""
    return list(fidelity_cases().values())


def bias_suite() -> list[Case]:
    """``bias``: the ``tied_max`` family (``audits.suites.inputs.ADVERSARIAL_FAMILIES``: several
    keys per row tie at the max, P = 1 on each, V of one sign), where a rounding that is not to
    nearest in P V shows as a signed bias (docs/diagnosis.md, "Rounding bias"): both 16-bit
    dtypes and fp8, GQA, causal, a local window, a learnable sink, a softcap, batch 2.  A fixed
    list, small enough for the CPU (the model runs it in seconds)."""
    fam = "tied_max"
    return [
        Case("bfloat16", 64, 64, 1, 4, 2, 128, 384, family=fam),  # GQA
        Case("bfloat16", 128, 128, 2, 2, 2, 200, 300, causal=True, family=fam),
        Case("float16", 64, 64, 1, 2, 2, 128, 256, family=fam),
        Case("bfloat16", 128, 128, 1, 2, 2, 256, 256, window=(64, 0), family=fam),
        Case("bfloat16", 64, 64, 1, 3, 1, 64, 1024, sink=True, family=fam),  # MQA
        Case("float16", 128, 128, 1, 2, 2, 128, 128, softcap=15.0, causal=True, family=fam),
        Case("float8_e4m3fn", 64, 64, 1, 2, 2, 128, 256, family=fam),
    ]


def smoke_suite() -> list[Case]:
    """``smoke`` as defined (:func:`smoke_within` in the unrestricted domain)."""
    return suite("smoke")


def release_suite(seeds: tuple[int, ...] = (0,), extra_pairs: list | None = None) -> list[Case]:
    """``release`` as defined, over ``seeds`` with ``extra_pairs`` lengths (:func:`release_within` in
    the unrestricted domain)."""
    return release_within(Domain(), seeds=seeds, extra_pairs=extra_pairs)["cases"]


def nightly_suite() -> list[Case]:
    """``nightly`` as defined (:func:`nightly_within` in the unrestricted domain)."""
    return suite("nightly")


def head_dims_suite() -> list[Case]:
    """``head-dims`` as defined (:func:`head_dims_within` in the unrestricted domain)."""
    return suite("head-dims")


#: the named suites, each as defined (its cases in the unrestricted domain)
SUITES = {
    "smoke": smoke_suite,
    "release": release_suite,
    "nightly": nightly_suite,
    "head-dims": head_dims_suite,
    "fidelity": fidelity_suite,
    "mods": mods_suite,
    "bias": bias_suite,
}
#: how each generated suite is built in a domain; a suite of :data:`SUITES` not here is a fixed list
_WITHIN = {
    "smoke": smoke_within,
    "release": release_within,
    "nightly": nightly_within,
    "head-dims": head_dims_within,
    "mods": mods_within,
}


def build_suite(name: str, domain: Domain | None = None) -> dict:
    """The named suite built in ``domain`` (None: unrestricted): ``{"cases", "axes",
    "pairs_covered", "not_applicable": {family: reason}}``; a fixed list (``fidelity``'s) is
    filtered to the domain, none made.  A domain restricting no case but by its mod kinds gives
    the suite as defined (built in the unrestricted domain) without the mod cases whose kinds it
    does not take, and no axes.  ValueError naming the valid suites for an unknown name."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; accepted: {', '.join(SUITES)}, or a suite file FILE.toml")
    d = Domain() if domain is None else domain
    if d.unrestricted_but_mods():  # the suite as defined, without the mod cases whose kinds d does not take
        cases = _with_mods(d, _build(name, Domain())["cases"])
        return {"cases": cases, "axes": None, "pairs_covered": None, "not_applicable": {}}
    return _build(name, d)


def _build(name: str, d: Domain) -> dict:
    if name in _WITHIN:
        return _WITHIN[name](d)
    # a fixed list (fidelity's): its cases inside the domain, none made
    return {"cases": inside(d, SUITES[name]()), "axes": None, "pairs_covered": None, "not_applicable": {}}


def suite(name: str, domain: Domain | None = None) -> list[Case]:
    """The cases of the named suite in ``domain`` (None: unrestricted; :func:`build_suite`)."""
    return build_suite(name, domain)["cases"]
