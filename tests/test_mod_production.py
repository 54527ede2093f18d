"""The mods' kernel side: ``fa4.mods`` (build_mods, the production conversion), production's
mod refusals (``fa4.refusals.REFUSALS``) and the ``flex`` peer (``audits.kernels``).

CPU: the aux layout of a call, the block masks of each library mask mod, production's index
lists against a brute-force re-derivation, the forms' laziness, production's mod refusals; and,
marked ``slow`` (flex's eager path warms dynamo up for ~10 s), flex_attention (eager, forward:
flex refuses a CPU backward) against a float64 formula with the mods.  GPU (``gpu``; skipped
without CUDA and the production package): production with each library mod, forward and
backward, against the float64 formula, and the flag cross-checks of issue 26.
"""

import math
import sys

import pytest
import torch

from audits.kernels import KERNELS, claims_nonfinite_inputs, get_kernel
from fa4.mods import MASK_FORMS, SCORE_FORMS, LazyForms, block_sparse_index_lists, build_mods
from fa4.refusals import PRODUCTION_MODS, REFUSALS, production_domain, refusal_of
from numerics.mod_library import MASK_MODS, SCORE_MODS, make_mask_mod, make_score_mod
from numerics.mods import BlockSparse, bind_aux_scalars, index_grid, visibility
from numerics.reference import visible_mask
from tests.production_defects import SM90_GQA_SCORE_MOD_BWD

SHAPE = dict(batch=2, heads_q=4, seqlen_q=48, seqlen_k=80)


def _reference(q, k, v, *, softmax_scale, causal=False, window_size=(None, None), softcap=0.0, **kw):
    """Float64 attention with the mods (numerics.mods semantics: the score mod on the scaled
    score, the flags intersected with the mods' visibility); (out, lse), rows with no key 0 / -inf.
    Differentiable (float64 autograd gives the exact gradients of the same function).  Runtime
    scalars are bound into the mods as every reference binds them (``numerics.mods.bind_aux_scalars``)."""
    sm, mm, bs = bind_aux_scalars(kw.get("aux_scalars"), score_mod=kw.get("score_mod"), mask_mod=kw.get("mask_mod"),
                                  block_sparse=kw.get("block_sparse_tensors"))  # fmt: skip
    kw = {**kw, "score_mod": sm, "mask_mod": mm, "block_sparse_tensors": bs}
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    aux = kw.get("aux_tensors")
    q64, k64, v64 = (t.double() for t in (q, k, v))
    k64, v64 = k64.repeat_interleave(hq // hk, 2), v64.repeat_interleave(hq // hk, 2)
    s = torch.einsum("bihd,bjhd->bhij", q64, k64) * softmax_scale
    bi, hi, qi, ki = index_grid(b, hq, sq, sk, device=q.device)
    if kw.get("score_mod") is not None:
        s = kw["score_mod"].fn(s, bi, hi, qi, ki, aux)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    vis = visible_mask(sq, sk, causal=causal, window_size=window_size, device=q.device).view(1, 1, sq, sk)
    mv = visibility(
        batch=b, heads=hq, seqlen_q=sq, seqlen_k=sk, mask_mod=kw.get("mask_mod"),
        block_sparse=kw.get("block_sparse_tensors"), aux=aux, device=q.device,
    )  # fmt: skip
    if mv is not None:
        vis = vis & mv
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    return torch.einsum("bhij,bjhd->bihd", p, v64), lse


# ---- build_mods -------------------------------------------------------------------------------


@pytest.mark.parametrize("score", ["alibi", "relbias", "softcap"])
@pytest.mark.parametrize("mask", ["document", "prefix_lm", "causal"])
def test_build_mods_places_the_score_mods_aux_first_and_the_mask_mods_after(score, mask):
    kw = build_mods(score_mod=score, mask_mod=mask, seed=5, device="cpu", **SHAPE)
    sm_alone, sm_aux = make_score_mod(score, seed=5, **SHAPE)
    mm_alone, mm_aux = make_mask_mod(mask, aux_base=len(sm_aux), seed=5, **SHAPE)
    aux = kw.get("aux_tensors", [])
    assert len(aux) == len(sm_aux) + len(mm_aux)
    assert kw["score_mod"].aux_base == 0 and kw["mask_mod"].aux_base == len(sm_aux)
    for got, want in zip(aux, sm_aux + mm_aux, strict=True):
        assert torch.equal(got, want)
    # each mod reads its own entries of the shared list: the same values as alone at index 0
    b, h, qi, ki = index_grid(2, 4, 48, 80)
    s = torch.randn(2, 4, 48, 80, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(kw["score_mod"].fn(s, b, h, qi, ki, aux), sm_alone.fn(s, b, h, qi, ki, sm_aux))
    _, mm_own = make_mask_mod(mask, seed=5, **SHAPE)
    alone = make_mask_mod(mask, seed=5, **SHAPE)[0].fn(b, h, qi, ki, mm_own)
    assert torch.equal(kw["mask_mod"].fn(b, h, qi, ki, aux), alone)


def test_build_mods_without_mods_is_empty_and_block_sparsity_needs_a_mask_mod():
    assert build_mods(seed=0, **SHAPE) == {}
    with pytest.raises(ValueError, match="needs a mask_mod"):
        build_mods(score_mod="alibi", block_sparse=(16, 16), seed=0, **SHAPE)


def test_forms_are_lazy_and_named_without_importing_the_cute_dsl():
    had_cutlass = "cutlass" in sys.modules
    kw = build_mods(score_mod="relbias", mask_mod="document", block_sparse=(16, 16), seed=1, **SHAPE)
    assert isinstance(kw["score_mod"].forms, LazyForms)
    assert set(kw["score_mod"].forms) == {"cute", "cute_bwd", "model", "model_bwd"}  # model: fa4.mod_forms
    assert set(kw["mask_mod"].forms) == {"cute"}
    assert kw["block_sparse_tensors"].mask_mod is kw["mask_mod"]
    assert ("cutlass" in sys.modules) == had_cutlass
    assert set(SCORE_FORMS) == set(SCORE_MODS) and set(MASK_FORMS) == set(MASK_MODS)
    if not had_cutlass:  # no production here: building a form says what is missing
        with pytest.raises(ImportError, match="production package flash-attn-4"):
            kw["mask_mod"].forms["cute"]


# ---- block sparsity ------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", MASK_MODS)
@pytest.mark.parametrize("block", [(16, 16), (16, 32), (32, 16)])
def test_block_sparse_of_each_mask_mod_keeps_exactly_the_mask(mask, block):
    kw = build_mods(mask_mod=mask, block_sparse=block, seed=2, **SHAPE)
    bs, mm, aux = kw["block_sparse_tensors"], kw["mask_mod"], kw.get("aux_tensors")
    shape = dict(batch=2, heads=4, seqlen_q=48, seqlen_k=80, aux=aux)
    dense = visibility(mask_mod=mm, **shape).expand(2, 4, 48, 80)
    assert torch.equal(visibility(block_sparse=bs, **shape).expand(2, 4, 48, 80), dense)
    bq, bk = block
    for b, _h, i, j in bs.full.nonzero().tolist():  # a full block: every in-range key kept
        assert bool(dense[b, 0, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].all())
    for b, _h, i, j in bs.partial.nonzero().tolist():  # a partial block: some kept, some not
        tile = dense[b, 0, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
        assert bool(tile.any()) and not bool(tile.all())


def _brute_lists(blocks: torch.Tensor):
    cnt = torch.zeros(blocks.shape[:-1], dtype=torch.int32)
    idx = torch.zeros(blocks.shape, dtype=torch.int32)
    for b in range(blocks.shape[0]):
        for h in range(blocks.shape[1]):
            for r in range(blocks.shape[2]):
                cols = [c for c in range(blocks.shape[3]) if blocks[b, h, r, c]]
                cnt[b, h, r] = len(cols)
                idx[b, h, r, : len(cols)] = torch.tensor(cols, dtype=torch.int32)
    return cnt, idx


@pytest.mark.parametrize("mask", MASK_MODS)
def test_index_lists_match_a_brute_force_derivation_forward_and_transposed(mask):
    bs = build_mods(mask_mod=mask, block_sparse=(16, 16), seed=4, **SHAPE)["block_sparse_tensors"]
    for blocks in (bs.partial, bs.full, bs.partial.transpose(-1, -2), bs.full.transpose(-1, -2)):
        cnt, idx = block_sparse_index_lists(blocks)
        want_cnt, want_idx = _brute_lists(blocks)
        assert cnt.dtype == idx.dtype == torch.int32
        assert torch.equal(cnt, want_cnt) and torch.equal(idx, want_idx)


def test_index_lists_of_a_random_block_mask_and_bad_input():
    blocks = torch.rand(2, 3, 5, 7, generator=torch.Generator().manual_seed(3)) < 0.4
    cnt, idx = block_sparse_index_lists(blocks)
    want_cnt, want_idx = _brute_lists(blocks)
    assert torch.equal(cnt, want_cnt) and torch.equal(idx, want_idx)
    with pytest.raises(ValueError, match="4-d bool"):
        block_sparse_index_lists(blocks.int())


def _fake_block_sparsity(monkeypatch) -> list:
    """A stand-in for ``flash_attn.cute.block_sparsity`` (which imports the CuTe DSL): its
    ``BlockSparseTensorsTorch`` fields (flash-attn-4 4.0.0b36) and a recording
    ``compute_dq_write_order``; returns the list of recorded calls."""
    import types
    from typing import NamedTuple

    class BlockSparseTensorsTorch(NamedTuple):
        mask_block_cnt: torch.Tensor
        mask_block_idx: torch.Tensor
        full_block_cnt: torch.Tensor | None = None
        full_block_idx: torch.Tensor | None = None
        cu_total_m_blocks: torch.Tensor | None = None
        cu_block_idx_offsets: torch.Tensor | None = None
        block_size: tuple | None = None
        dq_write_order: torch.Tensor | None = None
        dq_write_order_full: torch.Tensor | None = None
        spt: bool | None = None

    calls = []

    def compute_dq_write_order(*lists, spt=False):
        calls.append((lists, spt))
        return torch.zeros_like(lists[5]), torch.zeros_like(lists[7])

    mod = types.ModuleType("flash_attn.cute.block_sparsity")
    mod.BlockSparseTensorsTorch, mod.compute_dq_write_order = BlockSparseTensorsTorch, compute_dq_write_order
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.block_sparsity", mod)
    return calls


@pytest.mark.parametrize("deterministic", [False, True])
def test_production_kwargs_converts_mods_and_both_directions_of_block_sparsity(monkeypatch, deterministic):
    import dataclasses

    from fa4.mods import production_kwargs

    calls = _fake_block_sparsity(monkeypatch)
    kw = build_mods(score_mod="alibi", mask_mod="document", block_sparse=(16, 32), seed=6, **SHAPE)
    kw["score_mod"] = dataclasses.replace(
        kw["score_mod"], forms=LazyForms({"cute": lambda: "F", "cute_bwd": lambda: "B"})
    )
    kw["mask_mod"] = dataclasses.replace(kw["mask_mod"], forms=LazyForms({"cute": lambda: "M"}))
    kw["aux_tensors"] = [t.t() if t.dim() == 2 else t for t in kw["aux_tensors"]]  # a strided view must not leak
    got = production_kwargs(dict(kw, softcap=0.0), deterministic=deterministic)
    assert (got["score_mod"], got["score_mod_bwd"], got["mask_mod"], got["softcap"]) == ("F", "B", "M", 0.0)
    assert all(t.is_contiguous() for t in got["aux_tensors"])
    bs = kw["block_sparse_tensors"]
    fwd, bwd = got["block_sparse_tensors"], got["block_sparse_tensors_bwd"]
    assert fwd.block_size == bwd.block_size == (16, 32)
    pairs = [
        ((fwd.mask_block_cnt, fwd.mask_block_idx), bs.partial),
        ((fwd.full_block_cnt, fwd.full_block_idx), bs.full),
        ((bwd.mask_block_cnt, bwd.mask_block_idx), bs.partial.transpose(-1, -2)),  # per key block: query blocks
        ((bwd.full_block_cnt, bwd.full_block_idx), bs.full.transpose(-1, -2)),
    ]
    for (cnt, idx), blocks in pairs:
        want_cnt, want_idx = _brute_lists(blocks)
        assert torch.equal(cnt, want_cnt) and torch.equal(idx, want_idx)
    assert fwd.dq_write_order is None
    if deterministic:  # production's deterministic block-sparse backward requires the write order
        assert len(calls) == 1 and calls[0][1] is False and bwd.spt is False
        assert bwd.dq_write_order is not None and bwd.dq_write_order_full is not None
    else:
        assert calls == [] and bwd.dq_write_order is None and bwd.spt is None
    # a BlockSparse alone: production gets the mask its partial blocks apply
    alone = production_kwargs({"block_sparse_tensors": dataclasses.replace(bs, mask_mod=kw["mask_mod"])})
    assert alone["mask_mod"] == "M"


# ---- production's refusals and domain ------------------------------------------------------------

#: production's messages (flash-attn-4 4.0.0b36, as its code formats them) and the rule each is
_MOD_REFUSALS = [
    (AssertionError, "softcap and score_mod cannot be used together"),
    (AssertionError, "softcap and score_mod/score_mod_bwd cannot be used together"),
    (NotImplementedError, "Custom user-provided score_mod is not supported on SM8x architectures."),
    (AssertionError, "mask_mod backward not supported on SM 12.0"),
    (AssertionError, "Varlen backward with block sparsity is not yet supported"),
    (AssertionError, "Deterministic not implemented for block-sparse backward"),
    (ValueError, "Block sparsity requires sparse_block_size[1]=256 to match tile_n=128."),
    (ValueError, "Block sparsity requires sparse_block_size[1] to be a multiple of tile_n=128."),
    (ValueError, "Block sparse tensorsforward have block size 64, which must be a multiple of 128."),
    (ValueError, "Block sparse tensorsforward require BLOCK_SIZE_KV to be a multiple of 128."),
    (ValueError, "Block sparsity requires sparse_block_size[0] to be a multiple of tile_m=80; got 96."),
    (ValueError, "Block sparsity expects sparse_block_size_q=128 for q_subtile_factor=2."),
    (ValueError, "Block sparsity expects sparse_block_size[1]=128 for kv_subtile_factor=1."),
    (ValueError, "SM100 block-sparse backward with head_dim=192 requires 2CTA; 2CTA was disabled by request."),
]


@pytest.mark.parametrize(("exc_type", "message"), _MOD_REFUSALS)
def test_production_mod_refusals_are_matched_by_their_rule_only(exc_type, message):
    rule = refusal_of(exc_type(message))
    assert rule is not None and rule in REFUSALS
    assert refusal_of(RuntimeError(message)) is None  # the type is part of the rule
    assert refusal_of(exc_type("block sparse kernel returned garbage")) is None


def test_production_and_flex_declare_the_mod_kinds():
    from audits.suites.cases import MOD_KINDS
    from audits.suites.domain import Domain, domain_of

    assert set(PRODUCTION_MODS) == set(MOD_KINDS)
    for major in (9, 10, 11):
        assert Domain.from_dict(production_domain(major), where="production").mods == tuple(MOD_KINDS)
    assert "flex" in KERNELS
    dom = domain_of(get_kernel("flex"))
    assert set(dom.mods) == set(MOD_KINDS) and not claims_nonfinite_inputs("flex")


# ---- flex on the CPU -------------------------------------------------------------------------------

_FLEX_CONFIGS = [
    dict(score_mod="alibi"),
    dict(score_mod="relbias"),
    dict(score_mod="softcap"),
    *[dict(mask_mod=m) for m in MASK_MODS],
    *[dict(mask_mod=m, block_sparse=(16, 32)) for m in MASK_MODS],
    dict(score_mod="alibi", mask_mod="prefix_lm", block_sparse=(16, 16), flags=dict(causal=True)),
    dict(mask_mod="document", flags=dict(causal=True)),
    dict(flags=dict(softcap=15.0)),
    dict(flags=dict(causal=True, window_size=(10, 0))),
]


def _flex_inputs(sq=48, sk=80):
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, n, h, 32, generator=g) for n, h in ((sq, 4), (sk, 2), (sk, 2)))
    return q, k, v


@pytest.mark.slow  # flex's first eager call pays ~10 s of dynamo warm-up; each later one ~1-2 s
@pytest.mark.parametrize("cfg", _FLEX_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_flex_on_cpu_matches_the_float64_formula(cfg):
    """float32 flex against float64: |error| <= 2e-5.  Rationale: at d 32 with unit normal
    inputs and scale 0.3 the scores are O(3) and each float32 rounding is 2**-24 relative; the
    dot products, the exp/log and the P.V sums of 80 terms stay under 1e-5 (measured ~1e-6),
    while a wrong mod (a bias on the wrong head, a kept masked key) moves them by O(0.1)."""
    cfg = dict(cfg)
    flags = cfg.pop("flags", {})
    q, k, v = _flex_inputs()
    kw = build_mods(**cfg, seed=3, **SHAPE)
    out, lse = get_kernel("flex")(q, k, v, softmax_scale=0.3, return_lse=True, **flags, **kw)
    ro, rl = _reference(q, k, v, softmax_scale=0.3, **flags, **kw)
    assert out.shape == q.shape and lse.shape == (2, 4, 48) and lse.dtype == torch.float32
    assert (out.double() - ro).abs().max().item() <= 2e-5
    assert (lse.double() - rl).abs().max().item() <= 2e-5


@pytest.mark.slow
def test_flex_rows_without_keys_give_zero_and_minus_inf():
    q, k, v = _flex_inputs(sq=80, sk=48)  # causal, bottom-right: rows 0..31 see no key
    out, lse = get_kernel("flex")(q, k, v, causal=True, return_lse=True)
    assert bool((out[:, :32] == 0).all()) and bool((lse[:, :, :32] == -math.inf).all())
    assert bool(torch.isfinite(lse[:, :, 32:]).all())


@pytest.mark.slow
def test_flex_refuses_the_sink_softcap_with_a_score_mod_and_a_cpu_backward():
    q, k, v = _flex_inputs()
    flex = get_kernel("flex")
    with pytest.raises(NotImplementedError, match="sink"):
        flex(q, k, v, learnable_sink=torch.zeros(4))
    kw = build_mods(score_mod="alibi", seed=0, **SHAPE)
    with pytest.raises(NotImplementedError, match="softcap and a score_mod"):
        flex(q, k, v, softcap=15.0, **kw)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex(q.requires_grad_(True), k, v)


@pytest.mark.slow
def test_flex_block_sparse_without_the_mask_mod_visits_partial_blocks_whole():
    """A BlockSparse with no mask_mod: its partial blocks are visited unmasked (numerics.mods
    ``visibility``); flex's BlockMask must say the same (a noop mask on partial blocks)."""
    q, k, v = _flex_inputs()
    full = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    part = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    full[0, 0, 0, 1] = full[0, 0, 2, 4] = True
    part[0, 0, 1, 0] = part[0, 0, 1, 2] = part[0, 0, 2, 3] = True
    part[0, 0, 0, 0] = True
    bs = BlockSparse(full=full, partial=part, block_size=(16, 16))
    out, lse = get_kernel("flex")(q, k, v, softmax_scale=0.3, return_lse=True, block_sparse_tensors=bs)
    ro, rl = _reference(q, k, v, softmax_scale=0.3, block_sparse_tensors=bs)
    assert (out.double() - ro).abs().max().item() <= 2e-5 and (lse.double() - rl).abs().max().item() <= 2e-5


# ---- production on the GPU -------------------------------------------------------------------------

_GPU_SHAPE = dict(batch=2, heads_q=4, seqlen_q=256, seqlen_k=384)
_GPU_CONFIGS = [  # GQA 4:2 (_gpu_inputs): the bias score mods meet production's GQA backward defect
    *[
        # softcap and temperature read neither the query index nor the head: the defect misses them
        dict(score_mod=s)
        if s in ("softcap", "temperature")
        else pytest.param(dict(score_mod=s), marks=SM90_GQA_SCORE_MOD_BWD)
        for s in SCORE_MODS
    ],
    *[dict(mask_mod=m) for m in MASK_MODS],
    *[dict(mask_mod=m, block_sparse=(128, 128)) for m in MASK_MODS],
]


def _gpu_inputs(dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda n, h: torch.randn(2, n, h, 128, device="cuda", generator=g).to(dtype)  # noqa: E731
    return mk(256, 4), mk(384, 2), mk(384, 2), mk(256, 4)


def _run_production(q, k, v, do, **kw):
    from fa4.production import flash_attn

    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = flash_attn(qq, kk, vv, return_lse=True, **kw)
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), do)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _run_reference(q, k, v, do, **kw):
    qq, kk, vv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, lse = _reference(qq, kk, vv, **kw)
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), do.double())
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _GPU_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_production_with_each_library_mod_forward_and_backward(cfg):
    """bf16 production against float64, each tensor's max |error| over its max |value| <= 2e-2:
    bf16's unit roundoff is 2**-8 = 3.9e-3 and FA4's clean errors at this shape are a few of
    those (docs/h200-results.md); a dropped mod, a wrong head's bias, a leaked masked key or a
    lost block's dQ move them by O(1)."""
    q, k, v, do = _gpu_inputs()
    kw = build_mods(**cfg, seed=1, device="cuda", **_GPU_SHAPE)
    got = _run_production(q, k, v, do, softmax_scale=0.088, **kw)
    want = _run_reference(q, k, v, do, softmax_scale=0.088, **kw)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert _rel_err(got[name], want[name]) <= 2e-2, name


@pytest.mark.gpu
def test_softcap_score_mod_equals_the_softcap_flag_bitwise():
    """Production's softcap flag is its softcap score_mod (``_flash_attn_fwd`` builds
    ``utils.create_softcap_scoremod``): the same code, so the same bits."""
    q, k, v, do = _gpu_inputs()
    kw = build_mods(score_mod="softcap", seed=1, device="cuda", **_GPU_SHAPE)
    # deterministic: dQ's reduce-adds in a fixed order; without it two runs of one call differ in a
    # few dQ bits (H200, 2026-12-02: 0.002% of dQ between the flag and the mod, dK/dV/out/LSE equal)
    as_mod = _run_production(q, k, v, do, softmax_scale=0.088, deterministic=True, **kw)
    cap = kw["score_mod"].params["cap"]
    as_flag = _run_production(q, k, v, do, softmax_scale=0.088, deterministic=True, softcap=cap)
    for name in as_mod:
        assert torch.equal(as_mod[name], as_flag[name]), name


@pytest.mark.gpu
def test_mask_mod_with_causal_flag_forward_drops_the_flag():
    """``_resolve_causal_local_window`` returns causal=False when a mask_mod is given: the
    forward with causal=True is the forward without it, bit for bit."""
    from fa4.production import flash_attn

    q, k, v, _ = _gpu_inputs()
    kw = build_mods(mask_mod="document", seed=1, device="cuda", **_GPU_SHAPE)
    with_flag = flash_attn(q, k, v, causal=True, return_lse=True, **kw)
    without = flash_attn(q, k, v, causal=False, return_lse=True, **kw)
    assert torch.equal(with_flag[0], without[0]) and torch.equal(with_flag[1], without[1])


@pytest.mark.gpu
@pytest.mark.parametrize("mask", MASK_MODS)
def test_block_sparse_matches_the_dense_mask_mod(mask):
    q, k, v, do = _gpu_inputs()
    dense = _run_production(q, k, v, do, **build_mods(mask_mod=mask, seed=1, device="cuda", **_GPU_SHAPE))
    kw = build_mods(mask_mod=mask, block_sparse=(128, 128), seed=1, device="cuda", **_GPU_SHAPE)
    sparse = _run_production(q, k, v, do, **kw)
    for name in dense:  # same math, other tile visits: within bf16 rounding of each other
        assert _rel_err(sparse[name], dense[name].double()) <= 2e-2, name


@pytest.mark.gpu
def test_flex_on_cuda_with_a_mod_forward_and_backward():
    q, k, v, do = _gpu_inputs()
    kw = build_mods(score_mod="alibi", mask_mod="document", seed=1, device="cuda", **_GPU_SHAPE)
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = get_kernel("flex")(qq, kk, vv, softmax_scale=0.088, return_lse=True, **kw)
    got = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (qq, kk, vv), do), strict=True))
    want = _run_reference(q, k, v, do, softmax_scale=0.088, **kw)
    got.update(out=out, lse=lse)
    for name in want:
        assert _rel_err(got[name], want[name]) <= 2e-2, name
