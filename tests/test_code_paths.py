"""fa4.code_paths: every class reachable, known calls in the right classes, every class's
source a function that exists in production's source, and the model's tiles taken from it
unchanged (the rules as the model stated them before, copied here as the reference)."""

import importlib.util
import itertools
import os
import re
from pathlib import Path

import pytest
import torch

from audits.suites.cases import Case
from fa4.code_paths import (
    ARCHS,
    Call,
    classes,
    classes_of,
    hdim_multiple,
    sm90_bwd_tile,
    sm90_fwd_tile,
)
from fa4.model import FA4Numerics
from fa4.model_bwd import bwd_plan

DIRS = ("forward", "backward")
HEAD_DIMS = range(8, 257, 8)
MASKS = ((False, False), (True, False), (False, True))


def _reach_calls():
    """Calls varying every input classes_of looks at (all head dims, both dtypes, the masks,
    GQA packed and not, the features, decode and long queries, splits)."""
    dims = [(d, d) for d in HEAD_DIMS] + [(192, 128), (192, 256), (136, 200), (64, 72), (256, 256)]
    for (d, dv), mask, (hq, hk, pack), sq in itertools.product(
        dims, ("none", "causal", "local"), ((2, 2, None), (4, 1, None), (4, 1, False), (6, 2, None)), (64, 1000)
    ):
        base = dict(causal=mask == "causal", local=mask == "local", heads_q=hq, heads_kv=hk, pack_gqa=pack)
        yield Call("bfloat16", d, dv, seqlen_q=sq, seqlen_k=sq, **base)
    for d, dv in ((64, 64), (128, 128), (192, 128), (256, 256)):
        yield Call("float16", d, dv, softcap=True, sink=True, varlen=True, paged=True, num_splits=3, deterministic=True)
        yield Call("float16", d, dv, seqlen_k=64 * 128 + 1, num_splits=2)
    # the mods (docs/mods.md): every head-dim band with a mask_mod, a score_mod and block sparsity
    # at the suites' (128, 128) and at a block SM90 fits its tile to (64 x 64)
    for (d, dv), bs in itertools.product(dims, ((), (128, 128), (64, 64))):
        yield Call("bfloat16", d, dv, score_mod=True, mask_mod=True, block_sparse=bs, aux_scalars=bool(bs))


def test_every_class_is_reachable_and_classes_of_names_only_listed_classes():
    for arch in ARCHS:
        listed = {c.name: c for c in classes(arch)}
        assert len(listed) == len(classes(arch)), f"{arch}: duplicate class names"
        for c in listed.values():
            assert c.arch == arch and c.direction in DIRS and c.description and c.source
            assert c.name.startswith(f"{arch}.{'fwd' if c.direction == 'forward' else 'bwd'}.")
        seen = set()
        for call in _reach_calls():
            for direction in DIRS:
                got = classes_of(arch, call, direction=direction)
                unknown = set(got) - set(listed)
                assert not unknown, f"{arch} {direction} {call}: classes_of names unlisted classes {unknown}"
                assert all(listed[n].direction == direction for n in got), (arch, direction, got)
                seen.update(got)
        assert set(listed) - seen == set(), f"{arch}: classes no call reaches: {sorted(set(listed) - seen)}"


@pytest.mark.parametrize(
    "arch,call,direction,expected",
    [
        ("sm90", Call("bfloat16", 200, 200), "backward", {"sm90.bwd.tile64x48.hd256", "sm90.bwd.hdim_padded64"}),
        ("sm90", Call("bfloat16", 256, 256), "backward", {"sm90.bwd.tile64x48.hd256", "sm90.bwd.hdim_exact"}),
        ("sm90", Call("bfloat16", 72, 72), "backward", {"sm90.bwd.tile64x128.hd96", "sm90.bwd.hdim_padded16"}),
        ("sm90", Call("bfloat16", 72, 72), "forward", {"sm90.fwd.tile192x144.hd96", "sm90.fwd.hdim_padded16"}),
        ("sm90", Call("float16", 128, 128), "backward", {"sm90.bwd.tile80x128.hd128", "sm90.bwd.mask.none"}),
        ("sm90", Call("float16", 128, 128, causal=True), "backward", {"sm90.bwd.tile64x128.hd128"}),
        ("sm90", Call("float16", 160, 160), "backward", {"sm90.bwd.tile64x96.dv256.hd192", "sm90.bwd.hdim_padded64"}),
        ("sm90", Call("float16", 192, 128), "forward", {"sm90.fwd.tile128x128.hd192", "sm90.fwd.hdim_exact"}),
        (
            "sm90",
            Call("float16", 224, 224, local=True),
            "forward",
            {"sm90.fwd.tile128x64.hd256", "sm90.fwd.mask.local"},
        ),
        ("sm90", Call("float16", 64, 64, heads_q=8, heads_kv=2), "forward", {"sm90.fwd.gqa.packed"}),
        ("sm90", Call("float16", 64, 64, heads_q=8, heads_kv=2), "backward", {"sm90.bwd.gqa"}),
        ("sm90", Call("float16", 64, 64, deterministic=True), "backward", {"sm90.bwd.deterministic"}),
        ("sm100", Call("bfloat16", 256, 256), "backward", {"sm100.bwd.hd256_dedicated", "sm100.bwd.hdim_exact"}),
        ("sm100", Call("bfloat16", 256, 256, deterministic=True), "backward", {"sm100.bwd.hd256_dedicated"}),
        ("sm100", Call("bfloat16", 128, 128), "backward", {"sm100.bwd.2cta"}),
        ("sm100", Call("bfloat16", 80, 80), "backward", {"sm100.bwd.1cta", "sm100.bwd.hdim_padded32"}),
        ("sm100", Call("bfloat16", 128, 128, seqlen_q=1024), "forward", {"sm100.fwd.2cta", "sm100.fwd.q_stage2"}),
        ("sm100", Call("bfloat16", 128, 128, seqlen_q=100), "forward", {"sm100.fwd.1cta", "sm100.fwd.q_stage1"}),
        ("sm100", Call("bfloat16", 128, 128, seqlen_q=1024, causal=True), "forward", {"sm100.fwd.1cta"}),
        ("sm100", Call("bfloat16", 256, 256, seqlen_q=64), "forward", {"sm100.fwd.2cta", "sm100.fwd.hd256"}),
        ("sm100", Call("bfloat16", 64, 64, num_splits=4), "forward", {"sm100.fwd.splitkv", "sm100.fwd.1cta"}),
        ("sm100", Call("bfloat16", 192, 128, seqlen_k=100, num_splits=4), "forward", {"sm100.fwd.hd192"}),
        ("sm100", Call("bfloat16", 192, 128, seqlen_k=9000, num_splits=4), "forward", {"sm100.fwd.splitkv.tile_n64"}),
    ],
)
def test_classes_of_known_calls(arch, call, direction, expected):
    got = set(classes_of(arch, call, direction=direction))
    assert expected <= got, f"{arch} {direction} {call}: missing {expected - got}, got {sorted(got)}"


def test_classes_of_excludes():
    """The negative side of the rules: what a call must not fall in."""
    assert "sm100.fwd.splitkv" not in classes_of("sm100", Call("bf16", 192, 128, seqlen_k=100, num_splits=4),
                                                 direction="forward")  # fmt: skip
    assert "sm100.bwd.deterministic" not in classes_of(
        "sm100", Call("bfloat16", 256, 256, deterministic=True), direction="backward"
    )  # the dedicated hd256 backward is deterministic without semaphores
    assert "sm90.bwd.hdim_padded64" not in classes_of("sm90", Call("bfloat16", 120, 120), direction="backward")
    assert not any("splitkv" in c.name for c in classes("sm90")), "SM90 refuses split-KV: no class"


def test_bad_arch_and_direction_name_the_value():
    with pytest.raises(ValueError, match=r"arch 'sm80' is not known; accepted: sm90, sm100"):
        classes("sm80")
    with pytest.raises(ValueError, match=r"direction 'fwd' is not known; accepted: forward, backward"):
        classes_of("sm90", Call("bfloat16", 64, 64), direction="fwd")
    with pytest.raises(ValueError, match=r"Call.heads_q 3 must be a multiple of heads_kv 2"):
        Call("bfloat16", 64, 64, heads_q=3, heads_kv=2)


def test_case_call_maps_the_case():
    c = Case("float16", 96, 64, 2, 8, 2, 100, 300, window=(32, 0), softcap=5.0, sink=True)
    call = c.call(deterministic=True)
    assert call == Call(
        "float16", 96, 64, local=True, softcap=True, sink=True, seqlen_q=100, seqlen_k=300, heads_q=8,
        heads_kv=2, deterministic=True,
    )  # fmt: skip
    assert Case().call().deterministic is False


# ---------------------------------------------------------------- production's source


def _source_dir() -> Path | None:
    env = os.environ.get("FA4_SOURCE")
    if env:
        return Path(env)
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    cute = Path(next(iter(spec.submodule_search_locations))) / "cute"
    return cute if (cute / "interface.py").is_file() else None


def test_every_class_cites_a_function_in_production_source():
    src = _source_dir()
    if src is None:
        pytest.skip("production's source not found: set FA4_SOURCE to flash_attn/cute (e.g. of flash-attn-4 4.0.0b36)")
    for arch in ARCHS:
        for c in classes(arch):
            file, _, func = c.source.partition(": ")
            path = src / file
            assert path.is_file(), f"{c.name}: cites {file}, not in {src}"
            text = path.read_text()
            for part in func.split("."):
                assert re.search(rf"^\s*(def|class) {re.escape(part)}\b", text, re.M), (
                    f"{c.name}: cites {c.source}, but {part} is not defined in {path}"
                )


def _production_tile_functions(src: Path) -> dict:
    """production's ``_tile_size_fwd_sm90`` / ``_tile_size_bwd_sm90`` and their config classes,
    taken from ``interface.py``'s text and run here (pure functions: no GPU, no cutlass)."""
    import ast
    from dataclasses import dataclass

    tree = ast.parse((src / "interface.py").read_text())
    want = {"FwdConfig", "BwdConfig", "_tile_size_fwd_sm90", "_tile_size_bwd_sm90"}
    nodes = [n for n in tree.body if getattr(n, "name", None) in want]
    assert {n.name for n in nodes} == want, f"interface.py lacks {want - {n.name for n in nodes}}"
    ns = {"dataclass": dataclass}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(src / "interface.py"), "exec"), ns)
    return ns


def test_tile_rules_are_production_functions_results():
    """Every SM90 tile here is what production's own tile functions return, at every head dim,
    dv and mask; the head-dim granularities are the ones its kernels' constructors state."""
    src = _source_dir()
    if src is None:
        pytest.skip("production's source not found: set FA4_SOURCE to flash_attn/cute (e.g. of flash-attn-4 4.0.0b36)")
    ns = _production_tile_functions(src)
    for d, dv, (causal, local) in itertools.product(HEAD_DIMS, HEAD_DIMS, MASKS):
        f = ns["_tile_size_fwd_sm90"](d, dv, causal, local)
        assert sm90_fwd_tile(d=d, dv=dv, causal=causal, local=local) == (f.m_block_size, f.n_block_size), (d, dv)
        b = ns["_tile_size_bwd_sm90"](d, dv, causal, local)
        t = sm90_bwd_tile(d=d, dv=dv, causal=causal, local=local)
        assert (t.tile_m, t.tile_n, t.dq_single_wg, t.dkv_swap_ab, t.dq_swap_ab, t.stages_do) == (
            b.m_block_size, b.n_block_size, b.dQ_single_wg, b.dKV_swapAB, b.dQ_swapAB, b.num_stages_dO,
        ), (d, dv, causal, local)  # fmt: skip
    assert "hdim_multiple_of = 64 if dKV_swapAB else 16" in (src / "flash_bwd_sm90.py").read_text()
    assert "hdim_multiple_of = 32" in (src / "flash_bwd_sm100.py").read_text()
    assert "hdim_multiple_of = 16" in (src / "flash_fwd_sm100.py").read_text()
    assert "hdim_multiple_of = 16" in (src / "flash_fwd.py").read_text()


# ---------------------------------------------------------------- the model, unchanged


def _old_sm90_fwd(d, dv, causal, local):
    """fa4.model.FA4Numerics.sm90's tile rule before it moved to fa4.code_paths."""
    if d <= 64:
        return 192, 128
    if d <= 96:
        return (192, 128) if causal or local else (192, 144)
    if d <= 128:
        return 128, 128
    if d <= 192:
        return 128, 96 if local else (128 if dv <= 128 else 112)
    return 128, 64 if local else 80


def _old_sm90_bwd(d, causal, local):
    """fa4.model_bwd.bwd_plan's SM90 rule before it moved: (tm, tn, post, mult)."""
    if d <= 64:
        tm, tn, single, swap = 128, 128, False, False
    elif d <= 96:
        tm, tn, single, swap = 64, 128, True, False
    elif d <= 128:
        tm, tn, single, swap = (64 if causal or local else 80), 128, False, False
    elif d <= 192:
        tm, tn, single, swap = 64, 96, False, True
    else:
        tm, tn, single, swap = 64, 48, False, True
    return tm, tn, 128 if single else 256, 64 if swap else 32


def _old_sm100_fwd(d, dv, causal, local, seqlen_q, g, pack):
    hdp, hdvp = -(-d // 16) * 16, -(-dv // 16) * 16
    rows = None if seqlen_q is None else seqlen_q * (g if pack else 1)
    q_stage = 2 if rows is None or (rows > 128 and hdvp != 256) else 1
    one = rows is not None and rows <= q_stage * 128
    two = (
        (hdp == 256 or (not causal and not local and hdp in (128, 192) and hdvp == 128))
        and (not one or hdp == 256)
        and (128 % g == 0 or not pack)
    )
    return q_stage * 128 * (2 if two else 1), 128


def test_model_sm90_tiles_unchanged():
    for d, dv, (causal, local) in itertools.product(HEAD_DIMS, HEAD_DIMS, MASKS):
        nm = FA4Numerics.sm90(torch.bfloat16, d, causal=causal, local=local, head_dim_v=dv)
        assert (nm.tile_m, nm.tile_n) == _old_sm90_fwd(d, dv, causal, local), (d, dv, causal, local)
        p = bwd_plan(nm, d, dv, causal, local)
        tm, tn, post, mult = _old_sm90_bwd(d, causal, local)
        assert (p.tile_m, p.tile_n, p.post_threads, p.hdimv_multiple) == (tm, tn, post, mult), (d, dv, causal, local)


def test_model_sm100_tiles_unchanged():
    for d, dv, (causal, local), sq, (g, pack) in itertools.product(
        HEAD_DIMS, (64, 128, 256), MASKS, (None, 1, 100, 200, 300, 1000), ((1, False), (4, True), (3, True), (4, False))
    ):
        nm = FA4Numerics.sm100(
            torch.bfloat16, d, causal, local, seqlen_q=sq, qhead_per_kvhead=g, head_dim_v=dv, pack_gqa=pack
        )
        assert (nm.tile_m, nm.tile_n) == _old_sm100_fwd(d, dv, causal, local, sq, g, pack), (d, dv, causal, sq, g)
    for d, dv in [(d, d) for d in range(8, 129, 8)] + [(192, 128), (256, 256)]:
        p = bwd_plan(FA4Numerics.sm100(torch.bfloat16, d), d, dv, False, False)
        dedicated = (d, dv) == (256, 256)
        assert (p.tile_m, p.tile_n, p.dq_keys) == (128, 128, 256 if d >= 128 and not dedicated else 128), (d, dv)


def test_hdim_multiple_follows_the_backward_swap():
    assert [hdim_multiple(arch="sm90", direction="backward", d=d) for d in (128, 136, 256)] == [16, 64, 64]
    assert hdim_multiple(arch="sm100", direction="backward", d=72) == 32
    assert hdim_multiple(arch="sm100", direction="forward", d=72) == 16
