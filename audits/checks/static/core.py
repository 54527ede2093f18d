"""Static fidelity audit: the compiled production SM100 forward kernel against the numerics
model, without running it.

For each compile group of a suite (the cases that give one kernel variant *and* one model
configuration), production's ``FlashAttentionForwardSm100`` is compiled to sm_100a PTX
(``fa4.sm100_compile``, a fresh process per compile), its numerics facts are read
(``audits.checks.static.facts``) and each is compared with what ``FA4Numerics.sm100`` assumes for those
inputs (:func:`expected_facts`).  A difference means production and the model have diverged —
a new tuning table, a new polynomial, a new threshold — and is reported with the fact, both
values and the compile group; it fails the audit (exit 1).  PTX the extractor does not
understand, a failed compile, or a missing production package is exit 2, never a "match".
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from audits.checks.static.facts import PtxFormatError, kernel_facts
from audits.checks.static.mod_facts import (
    compare_mod_facts,
    differential,
    expected_mod_facts,
    f32_elements,
    mask_baseline,
    production_attributes,
    score_baseline,
)
from audits.suites.cases import Case
from fa4.ex2 import POLY_EX2, emulated_columns
from fa4.model import FA4Numerics

__all__ = ["static_groups", "expected_facts", "compare_facts", "audit_group", "StaticError"]

#: the P conversion production emits per P dtype (``cvt.rn`` to nearest even; fp8 saturating)
P_CONVERT = {
    torch.bfloat16: "cvt.rn.bf16x2.f32",
    torch.float16: "cvt.rn.f16x2.f32",
    torch.float8_e4m3fn: "cvt.rn.satfinite.e4m3x2.f32",
    torch.float8_e5m2: "cvt.rn.satfinite.e5m2x2.f32",
}


#: one compile takes ~8 s on 2 CPU cores (docs/static.md); 15 minutes means it hung
COMPILE_TIMEOUT_S = 900


class StaticError(RuntimeError):
    """The static audit could not produce facts (exit 2): no production package, a compile
    failure, or PTX the extractor does not understand."""


def case_numerics(c: Case) -> FA4Numerics:
    """The SM100 model numerics of a case's compile group: what the PTX of the group is checked
    against.  Public: the static backward audit (``audits.checks.static.backward``) checks its kernels
    against the same numerics.  With a mask_mod the forward runs non-causal and non-local:
    production drops the flags (``interface._resolve_causal_local_window(..., mask_mod)`` returns
    causal=False, local=False; ``fa4.model.attention`` resolves them so, and
    ``FA4Numerics.for_inputs`` is told so), which changes the tuning key and 2-CTA; block sparsity
    turns 2-CTA off (``FA4Numerics.sm100(block_sparse=)``)."""
    causal, local = (False, False) if c.mask_mod else (c.causal, c.local)
    return FA4Numerics.sm100(
        getattr(torch, c.dtype),
        c.d,
        causal,
        local,
        seqlen_q=c.seqlen_q,
        qhead_per_kvhead=c.heads_q // c.heads_kv,
        head_dim_v=c.dv,
        block_sparse=tuple(c.block_sparse) or None,
    )


def static_groups(cases: list[Case]) -> list[tuple[Case, list[str]]]:
    """One representative case (batch 1, family-independent) per distinct (compile key, model
    numerics), with the names of the cases it stands for; suite order."""
    groups: dict = {}
    for c in cases:
        # the static audit compiles flash_attn_func (with the case's mods: fa4.sm100_compile builds
        # them); the varlen entry's kernels are not audited here, and say so (audits/cli/static.py)
        if c.varlen:
            continue
        key = (c.compile_key, case_numerics(c))
        rep = dataclasses.replace(c, batch=1, layout="contiguous", family="normal", seed=0)
        groups.setdefault(key, (rep, []))[1].append(c.name)
    return list(groups.values())


def expected_facts(c: Case) -> dict:
    """What the model (``FA4Numerics.sm100`` for this case, and its fixed instruction-level
    assumptions, ``fa4.model`` module doc) implies for each fact of ``audits.checks.static.facts``."""
    nm = case_numerics(c)
    dt = getattr(torch, c.dtype)
    emu = (
        int(
            emulated_columns(
                nm.tile_n, ex2_emu_freq=nm.emu_freq, ex2_emu_res=nm.emu_res, ex2_emu_start_frg=nm.emu_start_frg
            ).sum()
        )
        if nm.exp2 == "mixed"
        else (nm.tile_n if nm.exp2 == "emulated" else 0)
    )
    return {
        "exp2.hardware": ["ex2.approx.ftz.f32"],  # MUFU.EX2 with flush-to-zero (hardware_exp2)
        "exp2.emulated_scalar": 0,  # SM100 uses the packed ex2_emulation_2 only
        "exp2.emulated_per_step": float(emu),
        # no emulated element, no polynomial in the PTX
        "exp2.poly_degree": nm.poly_degree if emu else None,
        "exp2.poly_coefficients": [float(x) for x in POLY_EX2[nm.poly_degree]] if emu else [],
        "exp2.fma_per_pair": float(nm.poly_degree) if emu else None,
        "rescale.threshold": float(nm.rescale_threshold),
        "max_offset": float(nm.max_offset),
        "arith.nonstandard": {},  # IEEE round-to-nearest, no flush, off the emulation's add.rm
        "p_convert": P_CONVERT[nm.p_dtype or dt],
        "reciprocal": ["rcp.approx.ftz.f32"],  # the finalize's rcp_approx
        # softcap as a score_mod is production's softcap flag (utils.create_softcap_scoremod): the same facts
        "tanh": c.softcap > 0 or c.score_mod == "softcap",
        "division": "div.rn.f32",  # fa4.primitives.div_rn: softcap, one per score; the sink's
    }


def compare_facts(facts: dict, want: dict, *, tile_n: int = 128) -> list[dict]:
    """Differences ``[{"fact", "production", "model"}]`` between PTX facts and expectations."""
    diffs = []

    def differ(name, prod, model):
        diffs.append({"fact": name, "production": prod, "model": model})

    if sorted(facts["exp2.hardware"]) != want["exp2.hardware"]:
        differ("exp2.hardware", facts["exp2.hardware"], want["exp2.hardware"])
    for name in (
        "exp2.emulated_scalar",
        "exp2.emulated_per_step",
        "exp2.poly_degree",
        "exp2.poly_coefficients",
        "exp2.fma_per_pair",
        "rescale.threshold",
        "max_offset",
        "arith.nonstandard",
    ):
        if facts[name] != want[name]:
            differ(name, facts[name], want[name])
    pc, steps = facts["p_convert"], facts["softmax.steps"]
    if pc.get(want["p_convert"], 0) < steps * tile_n // 2:
        differ("p_convert", pc, f"{want['p_convert']} x >= {steps * tile_n // 2} (steps * tile_n / 2)")
    other = set(pc) - {want["p_convert"], "cvt.rn.bf16x2.f32"}  # fp8 inputs write a bf16 output
    if other:
        differ("p_convert", pc, f"only {want['p_convert']} (and the bf16 output's cvt.rn.bf16x2.f32)")
    if sorted(facts["reciprocal"]) != want["reciprocal"]:
        differ("reciprocal", facts["reciprocal"], want["reciprocal"])
    if bool(facts["tanh"]) != want["tanh"] or (want["tanh"] and facts["tanh"] != steps * tile_n):
        differ("tanh", facts["tanh"], f"{steps * tile_n} tanh.approx (steps * tile_n)" if want["tanh"] else 0)
    div = facts["division"]
    if set(div) - {want["division"]} or (want["tanh"] and div.get(want["division"], 0) < facts["tanh"]):
        differ(
            "division", div, f"only {want['division']}" + (", one per tanh.approx (softcap)" if want["tanh"] else "")
        )
    return diffs


def _compile(
    c: Case, ptx_path: Path, *, no_driver: bool, backward: bool = False, gpu: str | None = None
) -> tuple[str, dict] | str:
    """Compile in a fresh process; the PTX text and production's recorded choices, or the
    refusal message (str) when production does not support the configuration."""
    cfg = {k: v for k, v in c.as_dict().items() if k not in ("layout", "family", "seed")}
    flags = (["--no-driver"] if no_driver else []) + (["--backward"] if backward else [])
    cmd = [sys.executable, "-m", "fa4.sm100_compile", json.dumps(cfg), str(ptx_path)] + flags
    what = "backward kernels" if backward else "forward kernel"
    try:
        env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}  # static --jobs: one GPU each
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as exc:  # a hung compile proves nothing: exit 2, never a pass
        raise StaticError(f"compiling the SM100 {what} for {c.name} did not finish in {COMPILE_TIMEOUT_S} s") from exc
    if proc.returncode == 3:
        return proc.stderr.strip().splitlines()[-1]
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-4:])
        raise StaticError(f"compiling the SM100 {what} for {c.name} failed (exit {proc.returncode}):\n{tail}")
    return ptx_path.read_text(), json.loads(Path(str(ptx_path) + ".json").read_text())


def cached_ptx(
    c: Case, stem: str, *, ptx_dir: Path, no_driver: bool, backward: bool = False, gpu: str | None = None
) -> tuple | str:
    """``(ptx, production's choices, "cached" | "<seconds> s")`` from ``ptx_dir/<stem>.ptx.gz``
    (and ``.ptx.json``), else compiled now and kept there; or the refusal message (str)."""
    ptx_dir.mkdir(parents=True, exist_ok=True)
    gz, side = ptx_dir / f"{stem}.ptx.gz", ptx_dir / f"{stem}.ptx.json"
    if gz.exists() and side.exists():
        return gzip.decompress(gz.read_bytes()).decode(), json.loads(side.read_text()), "cached"
    t0 = time.perf_counter()
    tmp = ptx_dir / f"{stem}.ptx"
    got = _compile(c, tmp, no_driver=no_driver, backward=backward, gpu=gpu)
    if isinstance(got, str):
        return got
    gz.write_bytes(gzip.compress(got[0].encode(), 9))
    os.replace(str(tmp) + ".json", side)
    tmp.unlink()
    return (*got, f"{time.perf_counter() - t0:.1f} s")


def audit_group(c: Case, cases: list[str], *, ptx_dir: Path, no_driver: bool, gpu: str | None = None) -> dict:
    """Compile (or reuse ``ptx_dir/<name>.ptx.gz``), extract, compare: one report record."""
    rec = {"group": c.name, "config": c.as_dict(), "cases": len(cases), "model": dataclasses.asdict(case_numerics(c))}
    rec["model"]["p_dtype"] = str(rec["model"]["p_dtype"])
    got = cached_ptx(c, c.name, ptx_dir=ptx_dir, no_driver=no_driver, gpu=gpu)
    if isinstance(got, str):
        return {**rec, "verdict": "skipped", "reason": got}
    ptx, chosen, rec["compiled"] = got
    attrs = chosen.get("attributes", {})
    tile_n = int(attrs.get("n_block_size", 128))
    rec["production"] = {
        k: attrs.get(k)
        for k in (
            "use_2cta_instrs",
            "pack_gqa",
            "q_stage",
            "m_block_size",
            "n_block_size",
            "enable_ex2_emu",
            "is_persistent",
        )
        if k in attrs
    }
    rec["kernel_class"] = chosen.get("kernel_class")
    try:
        facts = kernel_facts(ptx, tile_n=tile_n)
    except PtxFormatError as exc:
        raise StaticError(f"{c.name}: the PTX of {chosen.get('kernel_class')} was not recognised: {exc}") from exc
    if facts["target"] != "sm_100a":
        raise StaticError(f"{c.name}: PTX target is {facts['target']}, expected sm_100a")
    rec["facts"] = facts
    rec["expected"] = expected_facts(c)
    rec["differences"] = compare_facts(facts, rec["expected"], tile_n=tile_n)
    if c.mods:
        try:
            mod, rec["baselines"] = _mod_facts(
                c, ptx, chosen, facts["softmax.steps"] * tile_n, ptx_dir=ptx_dir, no_driver=no_driver, gpu=gpu
            )
        except PtxFormatError as exc:
            raise StaticError(f"{c.name}: the mod facts were not recognised: {exc}") from exc
        want = expected_mod_facts(c)
        rec["facts"].update(mod)
        rec["expected"].update(want)
        rec["differences"] += compare_mod_facts(mod, want)
    rec["verdict"] = "diverged" if rec["differences"] else "match"
    return rec


def _mod_facts(c: Case, ptx: str, chosen: dict, scores: int, **compile_kw) -> tuple[dict, dict]:
    """The mod facts of a mod case's forward (``audits.checks.static.mod_facts``): its recorded mod
    attributes and the differentials against its baselines (compiled or cached like any group,
    under the baseline case's name); and ``{fact: "<baseline> (<compiled>)"}``."""
    facts, baselines = {"mod.attributes": production_attributes(chosen)}, {}
    mine = f32_elements(ptx)
    for name, base in (("mod.score_ops", score_baseline(c)), ("mod.mask_ops", mask_baseline(c))):
        if base is None:
            continue
        got = cached_ptx(base, base.name, **compile_kw)
        if isinstance(got, str):
            raise StaticError(f"{c.name}: production refuses {base.name}, the baseline of {name}: {got}")
        base_ptx, base_chosen, how = got
        base_tile_n = int(base_chosen.get("attributes", {}).get("n_block_size", 128))
        facts[name] = differential(
            mine,
            f32_elements(base_ptx),
            scores=scores,
            scores_without=kernel_facts(base_ptx, tile_n=base_tile_n)["softmax.steps"] * base_tile_n,
            what=f"{name} of {c.name} against {base.name}",
            selects=name == "mod.mask_ops",
        )
        baselines[name] = f"{base.name} ({how})"
    return facts, baselines
