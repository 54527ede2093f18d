"""Static fidelity audit of production's SM100 *backward* against the backward model.

For each backward compile group of a suite, production's backward (``interface._flash_attn_bwd``:
the preprocess, ``FlashAttentionBackwardSm100`` or, for head dims (256, 256), the dedicated
``BlackwellFusedMultiHeadAttentionBackward``, and the postprocesses) is compiled to sm_100a PTX
(``fa4.sm100_compile --backward``), its facts are read (``audits.checks.static.facts_bwd``) and each is
compared with what the backward model assumes (:func:`expected_backward_facts`, from
``FA4Numerics.sm100`` and ``fa4.model_bwd.bwd_plan``).  A difference fails the audit (exit 1);
PTX the extractor does not understand or a failed compile is exit 2, as in the forward
(``audits.checks.static.core``, whose compile-and-cache step this module shares).

Backward compile groups (:func:`backward_groups`): production's backward compile key
(``interface._flash_attn_bwd``, ``compile_key``) varies over the suites with the dtype, head
dims, GQA ratio, causal, the window's two sides, softcap (``score_mod_hash``), and
``single_q_block`` / ``single_k_block`` (one 128-row / 128-key block); the postprocess's key adds
the learnable sink.  So a group is ``Case.compile_key`` plus ``seqlen_q <= 128`` and ``seqlen_k
<= 128`` (a split at least as fine as production's).  fp8 inputs have no backward (production:
``FA4 CuTe FP8 backward is not supported``): their cases are counted, not compiled.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from audits.checks.static.core import P_CONVERT, StaticError, cached_ptx, case_numerics
from audits.checks.static.facts import PtxFormatError
from audits.checks.static.facts_bwd import backward_facts
from audits.checks.static.mod_facts import (
    compare_mod_facts,
    differential,
    expected_mod_facts,
    f32_elements,
    main_kernel_text,
    mask_baseline,
    production_attributes,
    score_baseline,
    scores_of_main,
)
from audits.suites.cases import Case
from fa4.model_bwd import bwd_plan, fold_order

__all__ = ["backward_groups", "expected_backward_facts", "compare_backward_facts", "audit_backward_group"]

PRE, POST = "FlashAttentionBackwardPreprocess", "FlashAttentionBackwardPostprocess"
GENERIC, HD256 = "FlashAttentionBackwardSm100", "BlackwellFusedMultiHeadAttentionBackward"


FLUSH = "every reduction: float32 adds flushing subnormal inputs and results (fa4/model_bwd.py reduce_add)"


def is_fp8(c: Case) -> bool:
    return c.dtype.startswith("float8")


def backward_groups(cases: list[Case]) -> list[tuple[Case, list[str]]]:
    """One representative case (batch 1, family-independent) per backward compile group of the
    non-fp8 fixed-length ``cases`` (module doc), with the names of the cases it stands for; suite order."""
    groups: dict = {}
    for c in cases:
        if is_fp8(c) or c.varlen:  # the varlen entry's backward is not audited (mod cases are: with their mods)
            continue
        key = (c.compile_key, c.seqlen_q <= 128, c.seqlen_k <= 128)
        rep = dataclasses.replace(c, batch=1, layout="contiguous", family="normal", seed=0)
        groups.setdefault(key, (rep, []))[1].append(c.name)
    return list(groups.values())


def forward_refusal(c: Case) -> str | None:
    """Why no ``flash_attn_func`` call reaches this backward, or None: its forward refuses the
    block sparsity (``block_sparsity.normalize_block_sparse_config``: the sparse query block must
    be a multiple of the forward's ``q_stage * tile_m``, 256 rows with two Q stages), while
    ``_flash_attn_bwd`` called alone would compile it (its own check,
    ``normalize_block_sparse_config_bwd``, takes the backward's smaller tile).  Auditing a
    backward no forward call leads to would report on code users never run."""
    if not c.block_sparse:
        return None
    rows = case_numerics(c).tile_m
    if c.block_sparse[0] % rows:
        return (
            f"production's forward refuses block_q {c.block_sparse[0]} (a multiple of q_stage * tile_m = {rows} "
            "rows: block_sparsity.normalize_block_sparse_config), so no flash_attn_func call reaches this backward"
        )
    return None


def expected_backward_facts(c: Case) -> dict:
    """What the backward model implies for each fact of ``audits.checks.static.facts_bwd`` (its module
    doc: ``fa4.model_bwd``; the knobs: ``FA4Numerics.sm100`` for this case and ``bwd_plan``)."""
    nm = case_numerics(c)
    # the backward keeps causal and the window beside a mask_mod (_flash_attn_bwd resolves them
    # without it); block sparsity decides the 2-CTA pair (bwd_plan's block_sparse)
    plan = bwd_plan(nm, c.d, c.dv, c.causal, c.local, block_sparse=tuple(c.block_sparse) or None)
    dt = getattr(torch, c.dtype)
    gqa = c.heads_q // c.heads_kv > 1
    return {
        "model": {**dataclasses.asdict(plan), "ds_dtype": str(nm.ds_dtype or dt)},
        "kernels": sorted({PRE, HD256 if plan.hd256 else GENERIC} | (set() if plan.hd256 else {POST})),
        "tiles": {"tile_m": plan.tile_m, "tile_n": plan.tile_n, "dq_keys": plan.dq_keys},
        "exp2.hardware": ["ex2.approx.ftz.f32"],  # model_bwd step 5: hardware_exp2, never the polynomial
        "exp2.emulated": 0,
        "exp2.poly_degree": None,
        "arith.nonstandard": {},  # IEEE float32, round to nearest, no flush
        "p_convert": P_CONVERT[dt],  # step 7: cvt.rn to the input dtype
        "ds_convert": P_CONVERT[nm.ds_dtype or dt],  # step 7: ds_dtype, None = the input dtype
        "out_convert": not gqa or plan.hd256,  # step 8: GQA adds float32 partials, then the postprocess casts
        "reduce.targets": 0 if plan.hd256 else 1 + 2 * gqa,  # steps 8-9: dq_accum (+ dk_accum, dv_accum)
        "reduce.flush": "all",  # model_bwd.reduce_add: the accumulators' adds flush subnormals
        "tanh": c.softcap > 0 or c.score_mod == "softcap",  # step 3 (softcap as a score_mod is the flag's code)
        "postprocess": not plan.hd256,  # step 9: dq_accum * scale, cast (hd256: no postprocess)
        "preprocess.fold": [fold_order(c.dv, plan.hdimv_multiple)],  # step 1: row_dot
    }


def _production_tiles(chosen: dict) -> dict:
    """Production's tiles from the main kernel's attributes (``fa4.sm100_compile``'s JSON)."""
    a = chosen.get("attributes", {})
    if chosen.get("kernel_class") == HD256:  # dQ kernel: one MMA per (tile_m_dq, tile_n_dq) block
        return {"tile_m": a.get("tile_m_dq"), "tile_n": a.get("tile_n_dq"), "dq_keys": a.get("tile_n_dq")}
    pair = 2 if a.get("use_2cta_instrs") else 1
    return {"tile_m": a.get("tile_m"), "tile_n": a.get("tile_n"), "dq_keys": a.get("tile_n", 0) * pair}


def _cvt_ok(got: dict, want: str) -> bool:
    return set(got) == {want}


def _entries_ok(entries: dict) -> bool:
    """Per main ``.entry``: one dS per exp2; one P per exp2, except the hd256 dQ kernel (no P^T dO)."""
    return bool(entries) and all(
        e["dS"] == e["ex2"] and e["P"] == (0 if cls.endswith("DQKernel") else e["ex2"]) for cls, e in entries.items()
    )


def compare_backward_facts(f: dict, want: dict) -> list[dict]:
    """Differences ``[{"fact", "production", "model"}]`` between backward facts and expectations."""
    diffs = []

    def check(name: str, ok: bool, model) -> None:
        if not ok:
            diffs.append({"fact": name, "production": f[name], "model": model})

    check("kernels", sorted(set(f["kernels"])) == want["kernels"], want["kernels"])
    check("tiles", f["tiles"] == want["tiles"], want["tiles"])
    check("exp2.hardware", sorted(f["exp2.hardware"]) == want["exp2.hardware"], want["exp2.hardware"])
    for name in ("exp2.emulated", "exp2.poly_degree", "arith.nonstandard", "reduce.targets"):
        check(name, f[name] == want[name], want[name])
    check("reduce.flush", sorted(set(f["reduce.flush"])) == sorted(set(f["reduce"])), FLUSH)
    check("p_convert", _cvt_ok(f["p_convert"], want["p_convert"]), f"only {want['p_convert']}")
    check("ds_convert", _cvt_ok(f["ds_convert"], want["ds_convert"]), f"only {want['ds_convert']}")
    check("main.entries", _entries_ok(f["main.entries"]), "per kernel: dS elements = ex2 = P elements (hd256 dQ: P 0)")
    out = {want["p_convert"], want["p_convert"].replace("x2", "")}
    model_out = f"{' or '.join(sorted(out))}" if want["out_convert"] else "none (GQA: float32 accumulators)"
    check("out_convert", bool(f["out_convert"]) == want["out_convert"] and set(f["out_convert"]) <= out, model_out)
    reduce_ok = all(op.endswith(".add.f32") for op in f["reduce"]) and bool(f["reduce"]) == bool(want["reduce.targets"])
    check("reduce", reduce_ok, "float32 adds (.add.f32) only" if want["reduce.targets"] else "none")
    check("tanh", f["tanh"] == (f["main.ex2"] if want["tanh"] else 0), "one per exp2" if want["tanh"] else 0)
    post = f["postprocess.convert"]
    post_ok = _cvt_ok(post, want["p_convert"]) if want["postprocess"] else not post
    check("postprocess.convert", post_ok, f"only {want['p_convert']}" if want["postprocess"] else "no postprocess")
    check("preprocess.fold", f["preprocess.fold"] == want["preprocess.fold"], want["preprocess.fold"])
    reads_ok = all(op.startswith("mul.") and "f32" in op for op in f["postprocess.convert_reads"])
    check("postprocess.convert_reads", reads_ok, "a float32 multiply (accumulator * scale)")
    return diffs


def audit_backward_group(c: Case, cases: list[str], *, ptx_dir: Path, no_driver: bool, gpu: str | None = None) -> dict:
    """Compile (or reuse ``ptx_dir/bwd-<name>.ptx.gz``), extract, compare: one report record.  A
    configuration production compiles but the model does not take (``bwd_plan`` raises
    NotImplementedError) is a difference, fact ``supported``."""
    rec = {"group": c.name, "config": c.as_dict(), "cases": len(cases)}
    refused = forward_refusal(c)
    if refused is not None:
        return {**rec, "verdict": "skipped", "reason": refused}
    got = cached_ptx(c, f"bwd-{c.name}", ptx_dir=ptx_dir, no_driver=no_driver, backward=True, gpu=gpu)
    if isinstance(got, str):
        return {**rec, "verdict": "skipped", "reason": got}
    ptx, chosen, rec["compiled"] = got
    rec["kernel_class"] = chosen.get("kernel_class")
    attrs = chosen.get("attributes", {})
    rec["production"] = {k: attrs[k] for k in ("use_2cta_instrs", "cluster_size", "tile_m", "tile_n") if k in attrs}
    try:
        facts = backward_facts(ptx)
    except PtxFormatError as exc:
        raise StaticError(f"{c.name}: the backward PTX was not recognised: {exc}") from exc
    if facts["target"] != ["sm_100a"]:
        raise StaticError(f"{c.name}: PTX target is {facts['target']}, expected sm_100a")
    facts["tiles"] = _production_tiles(chosen)
    rec["facts"] = facts
    try:
        rec["expected"] = expected_backward_facts(c)
    except NotImplementedError as exc:
        rec["differences"] = [{"fact": "supported", "production": f"compiles {rec['kernel_class']}", "model": str(exc)}]
        return {**rec, "verdict": "diverged"}
    rec["differences"] = compare_backward_facts(facts, rec["expected"])
    if c.mods:
        try:
            mod, rec["baselines"] = _mod_facts_bwd(c, ptx, chosen, ptx_dir=ptx_dir, no_driver=no_driver, gpu=gpu)
        except PtxFormatError as exc:
            raise StaticError(f"{c.name}: the backward's mod facts were not recognised: {exc}") from exc
        want = expected_mod_facts(c, backward=True)
        rec["facts"].update(mod)
        rec["expected"].update(want)
        rec["differences"] += compare_mod_facts(mod, want)
    rec["verdict"] = "diverged" if rec["differences"] else "match"
    return rec


def _mod_facts_bwd(c: Case, ptx: str, chosen: dict, **compile_kw) -> tuple[dict, dict]:
    """The mod facts of a mod case's backward (``audits.checks.static.mod_facts``): the main kernel's
    recorded mod attributes and its differentials against the baselines' backward (compiled or
    cached as ``bwd-<baseline>``); and ``{fact: "<baseline> (<compiled>)"}``."""
    facts, baselines = {"mod.attributes": production_attributes(chosen, backward=True)}, {}
    mine, scores = f32_elements(main_kernel_text(ptx)), scores_of_main(ptx)
    for name, base in (("mod.score_ops", score_baseline(c)), ("mod.mask_ops", mask_baseline(c, backward=True))):
        if base is None:
            continue
        got = cached_ptx(base, f"bwd-{base.name}", backward=True, **compile_kw)
        if isinstance(got, str):
            raise StaticError(f"{c.name}: production refuses {base.name}, the backward baseline of {name}: {got}")
        base_ptx, _, how = got
        facts[name] = differential(
            mine,
            f32_elements(main_kernel_text(base_ptx)),
            scores=scores,
            scores_without=scores_of_main(base_ptx),
            what=f"backward {name} of {c.name} against {base.name}",
            selects=name == "mod.mask_ops",
        )
        baselines[name] = f"{base.name} ({how})"
    return facts, baselines
