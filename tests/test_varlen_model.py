"""fa4.varlen (the model of production's varlen entry) against the fixed-length model per
sequence (bit for bit), against FP64 within the split-KV bound, the combine's edge cases, the
block ranges of pack_gqa and split-KV, and the key-masked FP64 reference."""

import dataclasses
import math

import pytest
import torch

from audits.suites.cases import varlen_case
from audits.suites.inputs import make_varlen_inputs
from fa4.model import FA4Numerics, attention
from fa4.varlen import combine, varlen_attention
from numerics.call import AttentionCall
from numerics.forward_bound import forward_error_bound
from numerics.reference import attention_reference
from numerics.tiles import block_ranges, split_key_masks, split_ranges

LENS = ((5, 300), (0, 17), (1, 1), (130, 140), (3, 0))
FWD = ("causal", "window_size", "softcap", "learnable_sink")


def _fwd(kw: dict) -> dict:
    return {k: kw[k] for k in FWD if k in kw}


def _numerics(arch, q, k, v, causal, window):
    if arch == "sm90":
        return FA4Numerics.for_inputs("sm90", q, k, v, causal, window)
    local = not causal and any(w is not None for w in window)
    return FA4Numerics.sm100(
        q.dtype, q.shape[-1], causal, local, seqlen_q=max(a for a, _ in LENS),
        qhead_per_kvhead=q.shape[2] // k.shape[2], head_dim_v=v.shape[-1], use_2cta=False,
    )  # fmt: skip


def _bits(t):
    return t.view(torch.int16) if t.dtype.itemsize == 2 else t.view(torch.int32)


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"seqused_k": (250, 10, 1, 100, 0)},
        {"page_size": 16, "seqused_k": (300, 17, 1, 140, 0)},
        {"page_size": 48},
        {"page_size": 256, "pack_gqa": False},
        {"pack_gqa": True, "window": (40, 8)},
    ],
    ids=["packed", "seqused", "page16", "page48", "page256", "packgqa-window"],
)
def test_each_sequence_equals_the_fixed_length_model(arch, extra):
    """Finite inputs: a sequence of a varlen call (packed, seqused, any page size, pack_gqa) is
    bit for bit the batch-1 fixed-length call on its rows and used keys; rows of an empty
    sequence are untouched (out 0, LSE -inf); a sequence without keys gives 0 / -inf."""
    causal = "window" not in extra
    c = varlen_case(seqlens=LENS, heads_q=4, heads_kv=2, d=64, dv=64, causal=causal, family="normal", **extra)
    x = make_varlen_inputs(c)
    out, lse = varlen_attention(x["q"], x["k"], x["v"], return_lse=True, arch=arch, **x["kw"])
    cu = x["kw"]["cu_seqlens_q"].tolist()
    for i, (q, k, v) in enumerate(x["parts"]):
        a, b = cu[i], cu[i + 1]
        if a == b:
            continue
        nm = _numerics(arch, q, k, v, causal, c.window)
        o2, l2 = attention(q, k, v, return_lse=True, numerics=nm, **_fwd(x["kw"]))
        assert torch.equal(_bits(out[a:b]), _bits(o2[0])), f"sequence {i}"
        assert torch.equal(lse[:, a:b], l2[0]), f"sequence {i}"
        if k.shape[1] == 0:
            assert bool((out[a:b] == 0).all()) and bool((lse[:, a:b] == -math.inf).all())


def test_one_split_is_the_unsplit_call():
    c = varlen_case(seqlens=LENS, heads_q=4, heads_kv=2, d=64, dv=64, causal=True)
    x = make_varlen_inputs(c)
    a = varlen_attention(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    b = varlen_attention(x["q"], x["k"], x["v"], return_lse=True, **{**x["kw"], "num_splits": 1})
    assert torch.equal(_bits(a[0]), _bits(b[0])) and torch.equal(a[1], b[1])


SPLIT_CASES = [
    dict(family="normal", causal=True, num_splits=3, pack_gqa=True),
    dict(family="drift", causal=True, sink=True, num_splits=2, pack_gqa=True),
    dict(family="normal", num_splits=7),  # more splits than blocks: empty splits
    dict(family="peaked", window=(100, 0), num_splits=4, pack_gqa=False),
    dict(family="long_tail", num_splits=5),
]


@pytest.mark.parametrize("kw", SPLIT_CASES, ids=lambda d: f"{d['family']}-split{d['num_splits']}")
def test_split_kv_within_its_bound(kw):
    """Split-KV against FP64: every output and LSE within ``split_error_bound``, and the split
    result differs from the unsplit one somewhere (else the test would not exercise the combine)."""
    c = varlen_case(seqlens=((5, 700), (130, 400), (1, 1), (64, 300)), heads_q=4, heads_kv=2, d=64, dv=64, **kw)
    x = make_varlen_inputs(c)
    out, lse = varlen_attention(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    one = varlen_attention(x["q"], x["k"], x["v"], return_lse=True, **{**x["kw"], "num_splits": 1})
    assert not torch.equal(_bits(out), _bits(one[0])) or not torch.equal(lse, one[1])
    cu = x["kw"]["cu_seqlens_q"].tolist()
    for i, (q, k, v) in enumerate(x["parts"]):
        a, b = cu[i], cu[i + 1]
        nm = _numerics("sm100", q, k, v, c.causal, c.window)
        ref, rl = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**_fwd(x["kw"])), return_lse=True)
        ob, lb = forward_error_bound(
            q,
            k,
            v,
            nm,
            call=AttentionCall.from_kwargs(**_fwd(x["kw"])),
            reference=(ref, rl),
            num_splits=c.num_splits,
            pack_gqa=bool(c.pack_gqa),
        )
        err = (out[a:b].double() - ref[0]).abs()
        assert bool((err <= ob[0]).all()), f"sequence {i}: {(err / ob[0]).max().item():.3g} x the bound"
        lerr = (lse[:, a:b].double() - rl[0]).abs()
        lerr = torch.where(lse[:, a:b].double() == rl[0], torch.zeros_like(lerr), lerr)
        assert bool((lerr <= lb[0]).all()), f"sequence {i}: LSE {(lerr / lb[0]).max().item():.3g} x the bound"


def test_split_bound_catches_a_dropped_partial():
    """The split bound is not vacuous: a combine that loses the last split's LSE (its weight
    treated as 0) leaves the bound on rows whose last split carries weight."""
    c = varlen_case(seqlens=((64, 600),), heads_q=2, heads_kv=2, d=64, dv=64, family="flat", num_splits=3)
    x = make_varlen_inputs(c)
    q, k, v = x["parts"][0]
    nm = _numerics("sm100", q, k, v, False, (None, None))
    masks = split_key_masks(64, 600, nm.tile_m, nm.tile_n, False, (None, None), "cpu", heads=2, pack=1, num_splits=3)
    parts = [attention_reference(q, k, v, call=AttentionCall(), return_lse=True, key_mask=m) for m in masks]
    o_p = torch.stack([p[0].permute(0, 2, 1, 3).float() for p in parts])
    l_p = torch.stack([p[1].float() for p in parts])
    good, _ = combine(o_p, l_p, torch.bfloat16)
    l_p[-1] = -math.inf  # the bug
    bad, _ = combine(o_p, l_p, torch.bfloat16)
    ref, rl = attention_reference(q, k, v, call=AttentionCall(), return_lse=True)
    ob, _ = forward_error_bound(q, k, v, nm, call=AttentionCall(), reference=(ref, rl), num_splits=3)
    err = lambda o: (o.permute(0, 2, 1, 3).double() - ref).abs()
    assert bool((err(good) <= ob).all())
    assert int((err(bad) > ob).sum()) > ob.numel() // 2  # measured: 7,069 of 8,192


def test_combine_edge_cases():
    """Rows whose splits are all empty give 0 and -inf; an empty split (-inf, O = 0) changes
    nothing; a split of weight 0 with an infinite O is skipped (0 * inf never enters)."""
    o = torch.tensor([[[1.5, -2.0]], [[0.0, 0.0]]])  # (splits 2, rows 1, dv 2)
    lse = torch.tensor([[0.25], [-math.inf]])
    out, l_out = combine(o, lse, torch.float32)
    assert out.tolist() == [[1.5, -2.0]] and abs(l_out.item() - 0.25) < 1e-6
    out, l_out = combine(torch.zeros(3, 1, 2), torch.full((3, 1), -math.inf), torch.bfloat16)
    assert out.tolist() == [[0.0, 0.0]] and l_out.tolist() == [-math.inf]
    o_inf = torch.tensor([[[1.0, 1.0]], [[math.inf, math.inf]]])
    out, _ = combine(o_inf, torch.tensor([[0.0], [-200.0]]), torch.float32)  # exp2(-288) flushes to 0
    assert out.tolist() == [[1.0, 1.0]]


def test_block_ranges_follow_production():
    """``block_info.get_n_block_min_max`` worked by hand: tile 128x128, causal, sq = sk = 300.
    Row 200 is in m_block 1: keys < ceil(256 / 128) * 128 -> blocks [0, 2); with pack_gqa of 2,
    packed index 2 * 200 + h: m_block 3, m_idx_max = ceil(512 / 2) = 256 -> blocks [0, 2).
    Row 100 with pack 2: packed 200 (m_block 1), m_idx_max = 128 -> [0, 1)."""
    lo, hi, n = block_ranges(300, 300, 128, 128, True, (None, None), "cpu", heads=2, pack=1)
    assert n == 3 and hi[:, 200].tolist() == [2, 2] and hi[:, 299].tolist() == [3, 3]
    lo, hi, _ = block_ranges(300, 300, 128, 128, True, (None, None), "cpu", heads=2, pack=2)
    assert hi[:, 200].tolist() == [2, 2] and hi[:, 100].tolist() == [1, 1] and hi[:, 63].tolist() == [1, 1]
    # windows: left 40 at row 200 (m_block 1 -> m_idx_min 128 -> keys >= 88 -> block 0)
    lo, hi, _ = block_ranges(300, 300, 128, 128, False, (140, 0), "cpu", heads=1)
    assert lo[0, 299].tolist() == 0 and lo[0, 200].tolist() == 0
    # split: 3 blocks in 2 splits -> 2 + 1; in 4 splits -> 1, 1, 1, 0 (the last has no work)
    n_min, n_max = torch.tensor([0]), torch.tensor([3])
    assert [tuple(int(t) for t in split_ranges(n_min, n_max, s, 2)) for s in range(2)] == [(0, 2), (2, 3)]
    got = [tuple(int(t) for t in split_ranges(n_min, n_max, s, 4)) for s in range(4)]
    assert got == [(0, 1), (1, 2), (2, 3), (3, 3)]


def test_key_masked_reference_equals_the_sliced_call():
    """``attention_reference(key_mask=...)`` on keys [128, 256) equals the reference on those
    keys alone (same rows, non-causal)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 10, 2, 32, generator=g).bfloat16()
    k = torch.randn(1, 300, 2, 32, generator=g).bfloat16()
    v = torch.randn(1, 300, 2, 32, generator=g).bfloat16()
    m = torch.zeros(2, 10, 300, dtype=torch.bool)
    m[..., 128:256] = True
    a, la = attention_reference(q, k, v, call=AttentionCall(), return_lse=True, key_mask=m)
    b, lb = attention_reference(q, k[:, 128:256], v[:, 128:256], call=AttentionCall(), return_lse=True)
    assert torch.allclose(a, b, rtol=0, atol=1e-12) and torch.allclose(la, lb, rtol=0, atol=1e-12)


def test_bad_input_is_named():
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    kv = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="num_splits must be an int >= 1"):
        varlen_attention(q, kv, kv, cu_seqlens_q=cu, cu_seqlens_k=cu, num_splits=0)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be a 1-d int32"):
        varlen_attention(q, kv, kv, cu_seqlens_q=cu.long(), cu_seqlens_k=cu)
    with pytest.raises(ValueError, match=r"q must be \(total_q, heads, d\)"):
        varlen_attention(q[None], kv, kv, cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_numerics_knob_reaches_every_sequence():
    """An explicit ``numerics`` (a variant to gate) is used for every sequence: tile_n 64 moves
    the block boundaries and changes some bits against the default (128)."""
    c = varlen_case(seqlens=((64, 400), (32, 300)), heads_q=2, heads_kv=2, d=64, dv=64, family="drift")
    x = make_varlen_inputs(c)
    base = FA4Numerics.sm100(torch.bfloat16, 64, use_2cta=False)
    a = varlen_attention(x["q"], x["k"], x["v"], numerics=base, **x["kw"])
    b = varlen_attention(x["q"], x["k"], x["v"], numerics=dataclasses.replace(base, tile_n=64), **x["kw"])
    assert not torch.equal(_bits(a), _bits(b))


def _decode_vs_prefill(numerics_of) -> bool:
    """Whether the last query row computed in a causal prefill (sq = sk = 200) equals the same row
    computed as a decode step (q = that row, same KV), bitwise on out and LSE, under production
    SM100 numerics for each call's shape (``numerics_of(nm)`` adjusts them)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 200, 2, 64, generator=g).bfloat16() for _ in range(3))
    nm_p = numerics_of(FA4Numerics.sm100(torch.bfloat16, 64, True, seqlen_q=200))
    nm_d = numerics_of(FA4Numerics.sm100(torch.bfloat16, 64, True, seqlen_q=1))
    op, lp = attention(q, k, v, causal=True, return_lse=True, numerics=nm_p)
    od, ld = attention(q[:, -1:], k, v, causal=True, return_lse=True, numerics=nm_d)
    return torch.equal(_bits(op[:, -1:]), _bits(od)) and torch.equal(lp[..., -1:], ld)


def test_reproduces_flash_attention_2596():
    """flash-attention #2596 (fixed by #2595): when the exp2 choice depended on whether a block
    was masked, decode and prefill disagreed bitwise.  Row 199 of a 200-row prefill sits in a
    256-row tile (q_stage 2) whose diagonal mask starts at block 0; as a decode step its mask
    starts at block 1, so block 0 is masked in one and not the other.  With 4.0.0b36's knobs
    (``masked_exp2="same"``) the row is the same; with the pre-fix choice it is not."""
    assert _decode_vs_prefill(lambda nm: nm)
    assert not _decode_vs_prefill(lambda nm: dataclasses.replace(nm, masked_exp2="hardware"))


def test_reproduces_flash_attention_2752():
    """flash-attention PR #2752 (SM80/SM120 sink support) saw an all-NaN LSE for
    ``seqused_k = 0`` and an inf LSE for a sink logit of 100.  With 4.0.0b36's SM100 and SM90
    knobs the model predicts: no keys gives out 0 and LSE = the sink (finite, not NaN), except
    under split-KV, where an empty split writes -inf and the sink (split 0's) is lost; a sink of
    100 against logits near 0 overflows the float32 row sum (2**(100 log2 e) = 2**144) to an inf
    LSE on both paths."""
    g = torch.Generator().manual_seed(0)
    q = (0.01 * torch.randn(3, 2, 64, generator=g)).bfloat16()
    kv = (0.01 * torch.randn(8, 2, 64, generator=g)).bfloat16()
    cu_q = torch.tensor([0, 3], dtype=torch.int32)
    cu_k = torch.tensor([0, 8], dtype=torch.int32)
    sink = torch.tensor([0.5, 100.0])
    for arch in ("sm100", "sm90"):
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, learnable_sink=sink, return_lse=True, arch=arch)
        out, lse = varlen_attention(q, kv, kv, seqused_k=torch.tensor([0], dtype=torch.int32), **kw)
        assert bool((out == 0).all()) and bool(torch.isfinite(lse).all()), arch
        assert abs(float(lse[0, 0]) - 0.5) < 1e-6 and abs(float(lse[1, 0]) - 100.0) < 1e-4, arch
        _, lse = varlen_attention(q, kv, kv, **kw)
        assert bool(torch.isinf(lse[1]).all()) and bool(torch.isfinite(lse[0]).all()), arch
    out, lse = varlen_attention(
        q, kv, kv, seqused_k=torch.tensor([0], dtype=torch.int32), num_splits=2,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, learnable_sink=sink, return_lse=True,
    )  # fmt: skip
    assert bool((lse == -math.inf).all()) and bool((out == 0).all())


def test_sm100_dynamic_splits_follow_the_prepare_scheduler():
    """``prepare_scheduler.py`` by hand: 3 sequences (2, 900), (77, 600), (128, 384), 6 query
    heads on 2 KV heads, pack_gqa: m = 1, 2, 3 and n = 8, 5, 3 blocks, total 27; bps =
    int(27 * 1.157 * 2 / 148) = 0 -> 1, so min(n, 3) = 3 each.  Long sequences fill the GPU:
    (2048, 2048), (1000, 4096), (4224, 4224) on 8/2 heads give m = 64, 32, 132 and n = 16, 32,
    33: total 6,404, bps = int(6404 * 1.157 * 2 / 148) = 100 > every n_b, so none splits.  The model then runs
    sequence by sequence with those counts, a single split still through the split path."""
    from fa4.varlen import dynamic_splits, split_counts

    assert dynamic_splits([(2, 900), (77, 600), (128, 384)], 3, heads=6, heads_kv=2, pack=True) == [3, 3, 3]
    long = [(2048, 2048), (1000, 4096), (4224, 4224)]
    assert dynamic_splits(long, 4, heads=8, heads_kv=2, pack=True) == [1, 1, 1]
    # ten (64, 4096) on 8 heads: m 1, n 32, total 320, bps = int(320 * 1.15703 * 8 / 148) = 20 -> 2
    assert dynamic_splits([(64, 4096)] * 10, 4, heads=8, heads_kv=8, pack=False) == [2] * 10
    assert dynamic_splits([(64, 4096)], 4, heads=8, heads_kv=8, pack=False) == [4]  # bps 2 -> 16 -> 4
    c = varlen_case(seqlens=((4, 600), (1, 300)), heads_q=2, heads_kv=2, d=64, dv=64, num_splits=3)
    x = make_varlen_inputs(c)
    assert split_counts(x["q"], x["k"], **x["kw"]) == [3, 3]
    assert split_counts(x["q"], x["k"], arch="sm90", **x["kw"]) == [3, 3]
    # 1 SM: one split per sequence, still through the split path (partials and the combine)
    assert split_counts(x["q"], x["k"], num_sms=1, **x["kw"]) == [1, 1]
    few = varlen_attention(x["q"], x["k"], x["v"], return_lse=True, num_sms=1, **x["kw"])
    one = varlen_attention(x["q"], x["k"], x["v"], return_lse=True, **{**x["kw"], "num_splits": 1})
    three = varlen_attention(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    assert not torch.equal(few[1], three[1])  # one split is not three
    assert not torch.equal(few[1], one[1])  # nor the unsplit call: the combine reweighs (LSE bits)
