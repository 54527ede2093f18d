"""Fidelity of the numerics model to the production kernel: run both on identical inputs.

On an H200 the production kernel runs its SM90 path, so the model's Hopper configuration
(``FA4Numerics.sm90``) is compared with it output for output: the distribution of output
differences in integer ULP steps of the output dtype, the LSE difference, and both kernels'
errors against the FP64 reference.  ``CASES`` spans head dims 64-256, causal and not, GQA/MQA,
seqlen_q != seqlen_k, a local window, softcap, a learnable sink, fp16 and drifting logits.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import torch

from audits.engine.worker import KernelTimeout, WorkerCrashed
from audits.kernels import production_arch
from audits.suites.cases import Case, fidelity_cases
from audits.suites.inputs import make_inputs
from fa4.model import FA4Numerics, attention, hardware_exp2
from fa4.production import ex2_kernel
from numerics.call import AttentionCall
from numerics.forward_bound import forward_error_bound
from numerics.fp import ulp_distance
from numerics.metrics import bound_check, lse_errors, output_errors, row_scaled_ulp_diff, ulp_diff_histogram
from numerics.reference import attention_reference

__all__ = ["CASES", "run_case", "run_cases", "summarize", "markdown", "mufu_vs_model"]

#: Goals (issue: "FA4 numerics model"): >= 99% identical or 1 ULP apart, none beyond 2.
MIN_WITHIN_1 = 0.99


#: the fidelity cases by label: the ``fidelity`` named suite (``audits.suites.cases.fidelity_cases``),
#: ``fa4-audit fidelity``'s default selection; their inputs come from ``audits.suites.inputs.make_inputs``
#: like every other audit's (the reports committed before 2026-12-01 drew float32 N(0, 1) inputs
#: of their own; those figures are the H200 run's)
CASES = fidelity_cases()


def run_case(label: str, c: Case, production, device, *, mma: str = "exact") -> dict:
    """Production vs model vs FP64 on one case; the model in the configuration of this GPU's
    production path (``audits.kernels.production_arch``: SM90 on an H200, SM100 on Blackwell;
    SM90 for CPU stand-ins), its MMA summation ``mma`` (``FA4Numerics.mma``)."""
    x = make_inputs(c, device=device)
    q, k, v, kw = x["q"], x["k"], x["v"], x["kw"]
    t0 = time.perf_counter()
    po, pl = production(q, k, v, return_lse=True, **kw)
    nm = FA4Numerics.for_call(
        production_arch() if torch.device(device).type == "cuda" else "sm90",
        q,
        k,
        v,
        causal=c.causal,
        window_size=c.window,
        mask_mod=kw.get("mask_mod"),
        block_sparse_tensors=kw.get("block_sparse_tensors"),
    )
    nm = dataclasses.replace(nm, mma=mma)
    mo, ml = attention(q, k, v, return_lse=True, numerics=nm, **kw)
    call = AttentionCall.from_kwargs(**kw)
    ref, rl = attention_reference(q, k, v, call=call, return_lse=True)
    hist = ulp_diff_histogram(mo, po)
    ob, lb = forward_error_bound(q, k, v, nm, call=call)

    def against_bound(out, lse):
        r = bound_check(out, ref, ob, lse, rl, lb)
        return {k: r[k] for k in ("violations", "lse_violations", "tightness", "lse_tightness")}

    dl = ml.double() - pl.double()
    fin = torch.isfinite(pl) & torch.isfinite(ml)
    res = {
        "case": {"name": label, "case": c.name, **c.as_dict()},
        "tiles": [nm.tile_m, nm.tile_n],
        "ulp_diff": hist,
        "row_scaled_ulp_diff": row_scaled_ulp_diff(mo, po, ref),
        "max_abs_diff": float((mo.double() - po.double()).abs().nan_to_num(math.inf).max()),
        "lse_max_abs_diff": float(dl[fin].abs().max()) if bool(fin.any()) else 0.0,
        "lse_nonfinite_agree": bool(torch.equal(torch.isfinite(pl), torch.isfinite(ml))),
        "lse_identical": int((pl.contiguous().view(torch.int32) == ml.contiguous().view(torch.int32)).sum()),
        "lse_values": pl.numel(),
        "production_vs_fp64": output_errors(po, ref),
        "model_vs_fp64": output_errors(mo, ref),
        "production_lse_vs_fp64": lse_errors(pl, rl),
        "model_lse_vs_fp64": lse_errors(ml, rl),
        "production_vs_bound": against_bound(po, pl),
        "model_vs_bound": against_bound(mo, ml),
        "seconds": time.perf_counter() - t0,
    }
    no_violation = all(
        res[k]["violations"] == 0 and res[k]["lse_violations"] == 0 for k in ("production_vs_bound", "model_vs_bound")
    )
    res["ok"] = hist["fraction_within_1"] >= MIN_WITHIN_1 and res["lse_nonfinite_agree"] and no_violation
    return res


def run_cases(
    cases: list[tuple[str, Case]], production, device, *, mma: str = "exact", advance: Callable[[], None] = lambda: None
) -> tuple[list[dict], list[dict]]:
    """Each (label, case)'s :func:`run_case`, calling ``advance`` after each: (the results, the
    cases that did not finish).  A case whose production call passed ``--timeout`` or killed its
    worker is unfinished: {case, name, verdict: timeout | crash, reason}."""
    results, unfinished = [], []
    for label, c in cases:
        try:
            results.append(run_case(label, c, production, device, mma=mma))
        except (KernelTimeout, WorkerCrashed) as exc:
            verdict = "timeout" if isinstance(exc, KernelTimeout) else "crash"
            unfinished.append({"case": label, "name": c.name, "verdict": verdict, "reason": str(exc)})
        advance()
    return results, unfinished


def summarize(results: list[dict]) -> dict:
    tot = {k: sum(r["ulp_diff"][k] for r in results) for k in ("0", "1", "2", ">2", "total")}
    return {
        "cases": len(results),
        "cases_ok": sum(r["ok"] for r in results),
        "outputs": tot,
        "fraction_identical": tot["0"] / tot["total"],
        "fraction_within_1": (tot["0"] + tot["1"]) / tot["total"],
        "lse_fraction_identical": sum(r.get("lse_identical", 0) for r in results)
        / max(sum(r.get("lse_values", 0) for r in results), 1),
        "max_ulp_diff": max(r["ulp_diff"]["max"] for r in results),
        "row_scaled": {k: sum(r["row_scaled_ulp_diff"][k] for r in results) for k in ("le_1", "le_2", "gt_2", "total")},
        "row_scaled_max": max(r["row_scaled_ulp_diff"]["max"] for r in results),
        "lse_max_abs_diff": max(r["lse_max_abs_diff"] for r in results),
        "bound_violations": sum(
            r[k]["violations"] + r[k]["lse_violations"]
            for r in results
            for k in ("production_vs_bound", "model_vs_bound")
        ),
        "production_tightness_median": sorted(r["production_vs_bound"]["tightness"] for r in results)[
            len(results) // 2
        ],
    }


def _summary_lines(report: dict) -> tuple[list[str], list[str]]:
    """The integer-step summary, and the row-scaled one (the MUFU lines go between them)."""
    s = report["summary"]
    rs = s["row_scaled"]
    steps = [
        f"{s['cases']} cases, {s['outputs']['total']:,} outputs: {100 * s['fraction_identical']:.3f}% "
        f"bit-identical, {100 * s['fraction_within_1']:.3f}% identical or 1 ULP apart, {s['outputs']['2']:,} "
        f"2 ULP apart, {s['outputs']['>2']:,} more than 2 (max {s['max_ulp_diff']}); "
        f"LSE max |model - production| = {s['lse_max_abs_diff']:.3g}.",
        "",
    ]
    rows = [
        f"In ULPs at each row's largest |reference| (row-scaled; integer steps overstate entries near 0): "
        f"{rs['le_1']:,} within 1, {rs['le_2'] - rs['le_1']:,} in (1, 2], "
        f"{rs['gt_2']:,} beyond 2 (max {s['row_scaled_max']:.3g}).",
        "",
    ]
    return steps, rows


def _mufu_lines(report: dict) -> list[str]:
    """The MUFU measurements, when the report has them (``--mufu``)."""
    L = []
    if "mufu_accuracy" in report:
        a = report["mufu_accuracy"]
        per = "; ".join(
            f"{k}: " + ", ".join(f"{m} {v:.4g}" for m, v in a[k].items()) for k in ("ex2", "lg2", "rcp", "tanh")
        )
        L += [f"MUFU accuracy over all 2^32 inputs against float64: {per} (domains in the JSON).", ""]
    if "mufu_ex2_vs_model" in report:
        m = report["mufu_ex2_vs_model"]
        u = m["ulp_distance"]
        L += [
            f"MUFU.EX2 (the H200's `ex2.approx.ftz.f32`) vs the model's `hardware_exp2` (correctly rounded, ftz) "
            f"over all {m['inputs']:,} float32 inputs: {u['0']:,} identical, {u['1']:,} 1 ULP apart, "
            f"{u['2']:,} 2 apart, {u['>2']:,} more (max {m['max']} at x = {m['max_at_x_bits']}).",
            "",
        ]
    return L


def _case_row(r: dict) -> str:
    h, c = r["ulp_diff"], r["case"]
    return (
        f"| {c['name']} | {c['dtype']} | {r['tiles'][0]}x{r['tiles'][1]} "
        f"| {h['0']:,} / {h['1']:,} / {h['2']:,} / {h['>2']:,} ({h['max']}) "
        f"| {r['row_scaled_ulp_diff']['max']:.3g} | {r['lse_max_abs_diff']:.2g} "
        f"| {r['production_vs_fp64']['max_abs']:.3g} | {r['model_vs_fp64']['max_abs']:.3g} "
        f"| {r['production_vs_fp64']['rel_l2']:.3g} | {r['model_vs_fp64']['rel_l2']:.3g} "
        f"| {r['production_vs_bound']['tightness']:.3f} | {'yes' if r['ok'] else 'NO'} |"
    )


def markdown(report: dict) -> str:
    s = report["summary"]
    steps, rows = _summary_lines(report)
    L = [
        "# Fidelity of the SM90 numerics model to the production kernel",
        "",
        f"Generated by `{report['command']}` on {report['created']}; {report['environment']}.",
        "",
        *steps,
        *_mufu_lines(report),
        *rows,
        "ULP diff = integer steps of the output dtype between model and production outputs; row ULP = the largest "
        "difference in ULPs at the row's largest |reference|. Errors against FP64: max |out - ref|.",
        "",
        f"Error bound (numerics.forward_bound, SM90 numerics): {s['bound_violations']} violations by production "
        f"or model; median over cases of max(production error / bound) = {s['production_tightness_median']:.3f}.",
        "",
        "| case | dtype | tiles | ULP diff 0 / 1 / 2 / >2 (max) | row ULP max | LSE diff | prod max err "
        "| model max err | prod rel L2 | model rel L2 | prod err/bound | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gone = [f"- **{u['verdict']}** {u['case']}: {u['reason']}" for u in report.get("unfinished") or []]
    if gone:  # production calls past --timeout, or that killed their worker: no figures
        gone = ["", f"{len(gone)} cases did not finish:", "", *gone]
    return "\n".join(L + [_case_row(r) for r in report["results"]] + gone) + "\n"


def mufu_vs_model(device, *, chunk_log2: int = 28) -> dict:
    """All 2**32 float32 inputs through the GPU's MUFU.EX2 (``ex2.approx.ftz.f32`` in a CuTe-DSL
    kernel) and through ``fa4.model.hardware_exp2``: how many results are 0, 1, 2, >2 float32
    steps apart (NaN results compared as equal when both are NaN)."""
    hw = ex2_kernel("hardware")
    counts = {"0": 0, "1": 0, "2": 0, ">2": 0}
    worst = (0, None)
    chunk = 1 << chunk_log2
    for s in range(0, 1 << 32, chunk):
        x = torch.arange(s, s + chunk, dtype=torch.int64, device=device).to(torch.int32).view(torch.float32)
        a, b = hw(x), hardware_exp2(x)
        d = ulp_distance(a, b)
        both_nan = torch.isnan(a) & torch.isnan(b)
        d = torch.where(both_nan, torch.zeros_like(d), d)
        d = torch.where(d < 0, torch.full_like(d, 1 << 30), d)  # NaN on one side only
        counts["0"] += int((d == 0).sum())
        counts["1"] += int((d == 1).sum())
        counts["2"] += int((d == 2).sum())
        counts[">2"] += int((d > 2).sum())
        m = int(d.max())
        if m > worst[0]:
            i = int(d.argmax())
            worst = (m, f"0x{(s + i) & 0xFFFFFFFF:08X}")
    return {"inputs": 1 << 32, "ulp_distance": counts, "max": worst[0], "max_at_x_bits": worst[1]}
