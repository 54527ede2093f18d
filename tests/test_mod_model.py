"""fa4.model / fa4.model_bwd with mods (score_mod, mask_mod, aux tensors, block sparsity): the
equivalences production's order of operations implies (bitwise where it implies them, with the
reason where it does not), the visit orders, the refusals, and the model against FP64.

Production facts these tests pin (flash-attn-4 4.0.0b36, ``flash_attn/cute``; the model's module
docs cite them): the score_mod runs on ``fl32(S * scale)`` with ``scale_log2 = LOG2_E``
(``softmax.apply_score_mod_inner``, ``utils.compute_softmax_scale_log2``), before the mask; a
mask_mod drops causal / window in the forward (``interface._resolve_causal_local_window``) but not
in the backward; block sparsity visits the partial list then the full list, each from its last
entry (``block_sparse_utils.consume_block_sparse_loads``), and the backward the partial then the
full query blocks in list order (``consume_block_sparse_mma_bwd_sm90``).
"""

import dataclasses

import pytest
import torch

import fa4.forward_loop as loop
from fa4.block_sparse import block_sparse_kv_order
from fa4.model import FA4Numerics, attention
from fa4.model_bwd import attention_backward, block_sparse_q_order, bwd_plan
from fa4.primitives import div_rn, fma, hardware_tanh
from fa4.varlen import varlen_attention
from numerics.call import AttentionCall
from numerics.grad_reference import attention_grad_reference
from numerics.metrics import row_scaled_ulp_diff
from numerics.mod_library import make_mask_mod, make_score_mod
from numerics.mods import BlockSparse, MaskMod, ScoreMod, block_sparse_from_mask
from numerics.reference import attention_reference

ARCHS = ("sm90", "sm100")
CAP = 15.0


def _qkv(b=1, sq=200, sk=300, hq=2, hk=2, d=64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda s, h: torch.randn(b, s, h, d, generator=g).bfloat16().requires_grad_(grad)  # noqa: E731
    return mk(sq, hq), mk(sk, hk), mk(sk, hk), torch.randn(b, sq, hq, d, generator=g).bfloat16()


def _causal_mod(sq, sk):
    off = sk - sq
    return MaskMod("causal", lambda b, h, q, kv, aux: kv <= q + off)


def _doc_mod(b, sq, sk, cuts=(70, 150, 260)):
    """Document mask: aux[0] the query's document (b, sq), aux[1] the key's (b, sk); bottom-right
    aligned (query i at key position i + sk - sq).  Documents of 70-110 keys: some key blocks of
    128 are whole inside a document (full blocks), some straddle (partial)."""
    kdoc = torch.zeros(b, sk, dtype=torch.int32)
    for c in cuts:
        kdoc[:, c:] += 1
    qdoc = kdoc[:, torch.arange(sq) + sk - sq]
    fn = lambda bb, h, q, kv, aux: aux[0][bb, q] == aux[1][bb, kv]  # noqa: E731
    return MaskMod("document", fn), [qdoc, kdoc]


#: production's softcap score_mod (utils.create_softcap_scoremod / _bwd) in the model's
#: primitives: div.rn, MUFU.TANH (modelled correctly rounded on the CPU), FMUL; 1 - t*t one FFMA
SOFTCAP = ScoreMod(
    "softcap",
    lambda x, b, h, q, kv, aux: hardware_tanh(div_rn(x, CAP)) * CAP,
    lambda g, x, b, h, q, kv, aux: g * fma(-(t := hardware_tanh(div_rn(x, CAP))), t, 1.0),
)
IDENTITY = ScoreMod("identity", lambda x, b, h, q, kv, aux: x, lambda g, x, b, h, q, kv, aux: g)


def _run(q, k, v, do, nm, **kw):
    """(out, lse, dq, dk, dv) of the model (autograd: the forward, then fa4.model_bwd)."""
    out, lse = attention(q, k, v, numerics=nm, return_lse=True, **kw)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, (q, k, v), do))


def _assert_same(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"output {i} differs: max |diff| {(x.double() - y.double()).abs().max()}"


@pytest.mark.parametrize("arch", ARCHS)
def test_causal_mask_mod_equals_causal_flag(arch):
    """With a mask_mod production visits every KV block (causal dropped), the diagonal's right
    side fully masked: those blocks change no state on finite inputs (row max -inf, sum and O
    times a 0 rescale), so at head dim 64, where the causal and non-causal numerics coincide,
    the forward and the backward (all query blocks visited, the extra ones adding exact zeros) are
    the causal flag's, bit for bit."""
    q, k, v, do = _qkv(grad=True)
    nm_c = FA4Numerics.for_inputs(arch, q, k, v, True)
    nm = FA4Numerics.for_inputs(arch, q, k, v, False)
    assert nm == nm_c  # hd 64: same tiles, same interleave (why the bits can agree)
    _assert_same(_run(q, k, v, do, nm_c, causal=True), _run(q, k, v, do, nm, mask_mod=_causal_mod(200, 300)))


def test_causal_mask_mod_sm100_hd128_differs_by_the_interleave_only():
    """SM100 at head dim 128: the mask_mod's call is non-causal to production (2-CTA, exp2
    emulated on every 10th fragment) where causal=True runs 1-CTA with every 16th: the outputs
    differ, and with the causal numerics forced on the mask_mod call they agree bitwise — the
    interleave is the whole difference."""
    q, k, v, do = _qkv(sq=300, sk=300, d=128, grad=True)
    nm_c, nm = FA4Numerics.for_inputs("sm100", q, k, v, True), FA4Numerics.for_inputs("sm100", q, k, v, False)
    assert (nm.emu_freq, nm_c.emu_freq) == (10, 16)
    mm = _causal_mod(300, 300)
    flag = attention(q, k, v, causal=True, numerics=nm_c).detach()
    assert not torch.equal(attention(q, k, v, mask_mod=mm, numerics=nm).detach(), flag)
    assert torch.equal(attention(q, k, v, mask_mod=mm, numerics=nm_c).detach(), flag)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fast", [True, False])
def test_softcap_score_mod_equals_softcap_flag(arch, fast, monkeypatch):
    """Production's softcap flag *is* this score_mod (``interface._flash_attn_fwd``:
    ``score_mod = utils.create_softcap_scoremod(softcap)``): the same operations in the same
    order, forward (fast loop and plain loop) and backward, bit for bit."""
    monkeypatch.setattr(loop, "_FAST_CPU", fast)
    q, k, v, do = _qkv(d=128, grad=True)
    nm = FA4Numerics.for_inputs(arch, q, k, v)
    _assert_same(_run(q, k, v, do, nm, softcap=CAP), _run(q, k, v, do, nm, score_mod=SOFTCAP))


def test_library_softcap_close_to_flag():
    """numerics.mod_library's softcap form uses torch's float32 tanh (the reference form cannot
    call the model's MUFU.TANH), so on the CPU it is the flag to within tanh's last bit: outputs
    at most 1 ULP apart at the row's scale, LSE within 1e-5."""
    q, k, v, _ = _qkv(d=128)
    sm, aux = make_score_mod("softcap", batch=1, heads_q=2, seqlen_q=200, seqlen_k=300)
    nm = FA4Numerics.for_inputs("sm90", q, k, v)
    o1, l1 = attention(q, k, v, softcap=CAP, numerics=nm, return_lse=True)
    o2, l2 = attention(q, k, v, score_mod=sm, aux_tensors=aux, numerics=nm, return_lse=True)
    assert row_scaled_ulp_diff(o2, o1, o1)["max"] <= 1.0
    assert (l1 - l2).abs().max() <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_identity_score_mod_follows_production_scale_handling(arch):
    """With a score_mod the scale is applied first (``fl32(S * scale)``) and exp2 takes LOG2_E;
    without, exp2 takes ``fl32(scale * LOG2_E)`` on S.  With a power-of-two scale (head dim 64:
    1/8) both products are exact, so an identity mod is bitwise no mod, forward and backward; at
    head dim 128 (scale 2**-3.5) the roundings differ and so do some outputs — by at most one ULP
    at the row's scale (a model that folded the scale into LOG2_E for the mod too would equal no
    mod here; one that dropped the scale would be far off in the first case)."""
    q, k, v, do = _qkv(grad=True)
    nm = FA4Numerics.for_inputs(arch, q, k, v)
    _assert_same(_run(q, k, v, do, nm), _run(q, k, v, do, nm, score_mod=IDENTITY))
    q, k, v, do = _qkv(d=128)
    nm = FA4Numerics.for_inputs(arch, q, k, v)
    plain, mod = attention(q, k, v, numerics=nm), attention(q, k, v, score_mod=IDENTITY, numerics=nm)
    assert not torch.equal(plain, mod)
    assert row_scaled_ulp_diff(mod, plain, plain)["max"] <= 1.0


def _bsz(arch):
    """Sparse block sizes production takes here: SM90 (128, 128) (tile 128 x 128 after the fit);
    SM100 (256, 128) (a multiple of q_stage * tile_m = 256 rows)."""
    return (128, 128) if arch == "sm90" else (256, 128)


@pytest.mark.parametrize("arch", ARCHS)
def test_block_sparse_from_causal_mask_equals_dense_mask_mod(arch):
    """A causal mask's partial blocks are the diagonal's, its full blocks all left of them: the
    block-sparse order (partial list from its last entry, then full from its last) is the dense
    order without the fully masked blocks, so forward and backward are bitwise the dense
    mask_mod's."""
    q, k, v, do = _qkv(b=2, grad=True)
    mm = _causal_mod(200, 300)
    bs = block_sparse_from_mask(mm, batch=2, heads=2, seqlen_q=200, seqlen_k=300, block_size=_bsz(arch))
    nm = FA4Numerics.for_inputs(arch, q, k, v, block_sparse=_bsz(arch))
    _assert_same(_run(q, k, v, do, nm, mask_mod=mm), _run(q, k, v, do, nm, mask_mod=mm, block_sparse_tensors=bs))


def test_block_sparse_visit_order():
    """block_sparse_kv_order (forward): partial list from its last entry, then full list from its
    last entry, a coarse block's tiles from the last; block_sparse_q_order (backward): partial
    then full query blocks in list order, each sparse block's tiles in order."""
    z = torch.zeros(1, 1, 1, 4, dtype=torch.bool)
    part, full = z.clone(), z.clone()
    part[..., [0, 2]], full[..., [1, 3]] = True, True
    bs = BlockSparse(full, part, (128, 128))
    assert block_sparse_kv_order(bs, 0, 0, 0, 128, 512) == [
        (2, "partial"),
        (0, "partial"),
        (3, "full_first"),
        (1, "full"),
    ]
    bs2 = BlockSparse(full, part, (128, 256))  # kv_subtile_factor 2 (SM100); the last tile past seqlen_k dropped
    assert block_sparse_kv_order(bs2, 0, 0, 0, 128, 800) == [
        (5, "partial"), (4, "partial"), (1, "partial"), (0, "partial"), (6, "full_first"), (3, "full"), (2, "full"),
    ]  # fmt: skip
    qz = torch.zeros(1, 1, 4, 1, dtype=torch.bool)
    qp, qf = qz.clone(), qz.clone()
    qp[:, :, [1, 3]], qf[:, :, [0, 2]] = True, True
    plan = bwd_plan(FA4Numerics.sm90(torch.bfloat16, 128), 128, 128, False, False, block_sparse=(128, 128))
    assert plan.tile_m == 64  # 128 is not a multiple of 80: _tile_size_bwd_sm90 takes 64, q_subtile_factor 2
    got = block_sparse_q_order(BlockSparse(qf, qp, (128, 128)), 0, 0, 0, plan, m_block_max=7)
    assert got == [(2, True), (3, True), (6, True), (0, False), (1, False), (4, False), (5, False)]


def test_block_sparse_order_decides_the_bits():
    """All keys kept, no mask_mod: the dense loop visits KV tile 1 then 0.  Blocks (partial
    [1], full [0]) keep that order and the bits; (partial [0], full [1]) visit 0 then 1, the
    online softmax rounds differently, and the output changes (while staying within an ULP)."""
    q, k, v, _ = _qkv(sq=128, sk=256)
    nm = FA4Numerics.for_inputs("sm90", q, k, v, block_sparse=(128, 128))
    dense = attention(q, k, v, numerics=nm)
    one = torch.ones(1, 1, 1, 2, dtype=torch.bool)
    a, b = one.clone(), one.clone()
    a[..., 0], b[..., 1] = False, False
    same_order = attention(q, k, v, numerics=nm, block_sparse_tensors=BlockSparse(b, a, (128, 128)))
    swapped = attention(q, k, v, numerics=nm, block_sparse_tensors=BlockSparse(a, b, (128, 128)))
    assert torch.equal(same_order, dense)
    assert not torch.equal(swapped, dense)
    assert row_scaled_ulp_diff(swapped, dense, dense)["max"] <= 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_block_sparse_document_mask_against_dense_and_reference(arch):
    """Two documents cut at key 200: the last query tiles see KV tile 1 partially and 2, 3 fully,
    so the block-sparse order (1, then 3, 2) is not the dense one (3, 2, 1, 0): not bitwise, but
    within 1 ULP at the row's scale of the dense mask_mod, both within 2 ULPs of the FP64
    reference, gradients within 1% of the largest FP64 entry (measured: at most 0.4%)."""
    q, k, v, do = _qkv(sq=512, sk=512, grad=True)
    mm, aux = _doc_mod(1, 512, 512, cuts=(200,))
    bs = block_sparse_from_mask(mm, batch=1, heads=2, seqlen_q=512, seqlen_k=512, block_size=_bsz(arch), aux=aux)
    assert bool(bs.full.any()) and bool(bs.partial.any())
    nm = FA4Numerics.for_inputs(arch, q, k, v, block_sparse=_bsz(arch))
    dense = _run(q, k, v, do, nm, mask_mod=mm, aux_tensors=aux)
    sparse = _run(q, k, v, do, nm, mask_mod=mm, aux_tensors=aux, block_sparse_tensors=bs)
    ref = attention_reference(q.detach(), k.detach(), v.detach(), call=AttentionCall(mask_mod=mm, aux_tensors=aux))
    assert not torch.equal(sparse[0], dense[0])  # the order changed the bits ...
    assert row_scaled_ulp_diff(sparse[0], dense[0], ref)["max"] <= 1.0  # ... by at most an ULP
    for out in (dense[0], sparse[0]):
        assert row_scaled_ulp_diff(out, ref, ref)["max"] <= 2.0
    gref = attention_grad_reference(
        q.detach(), k.detach(), v.detach(), do, call=AttentionCall(mask_mod=mm, aux_tensors=aux)
    )
    for name, i in (("dq", 2), ("dk", 3), ("dv", 4)):
        for got in (dense[i], sparse[i]):
            err = (got.double() - gref[name]).abs().max() / gref[name].abs().max()
            assert err <= 1e-2, (name, float(err))


def test_full_block_gets_no_mask_mod():
    """A full block is visited without the mask_mod (``mask_fn(mask_mod=None)``): marking every
    block full with a causal mask_mod gives the unmasked output bit for bit, while the same
    blocks marked partial give the causal one."""
    q, k, v, _ = _qkv(sq=256, sk=256)
    mm = _causal_mod(256, 256)
    nm = FA4Numerics.for_inputs("sm90", q, k, v, block_sparse=(128, 128))
    allb, none = torch.ones(1, 1, 2, 2, dtype=torch.bool), torch.zeros(1, 1, 2, 2, dtype=torch.bool)
    as_full = attention(q, k, v, numerics=nm, mask_mod=mm, block_sparse_tensors=BlockSparse(allb, none, (128, 128)))
    as_part = attention(q, k, v, numerics=nm, mask_mod=mm, block_sparse_tensors=BlockSparse(none, allb, (128, 128)))
    assert torch.equal(as_full, attention(q, k, v, numerics=nm))
    assert torch.equal(as_part, attention(q, k, v, numerics=nm, mask_mod=mm))


@pytest.mark.parametrize("arch", ARCHS)
def test_empty_query_tile_gives_zero_and_minus_inf(arch):
    """A sparse query block with no block at all: out 0 and LSE -inf (SM90 ``softmax.reset();
    acc_O.fill(0)``; SM100's empty-tile correction); its dQ is 0, and the KV blocks no query
    block visits get dK = dV = 0."""
    bq = _bsz(arch)[0]
    q, k, v, do = _qkv(sq=2 * bq, sk=256, grad=True)
    full = torch.zeros(1, 1, 2, 2, dtype=torch.bool)
    full[0, 0, 1, 0] = True  # query block 1 sees KV block 0; query block 0 nothing; KV block 1 no one
    bs = BlockSparse(full, torch.zeros_like(full), (bq, 128))
    nm = FA4Numerics.for_inputs(arch, q, k, v, block_sparse=(bq, 128))
    out, lse, dq, dk, dv = _run(q, k, v, do, nm, block_sparse_tensors=bs)
    assert torch.equal(out[:, :bq], torch.zeros_like(out[:, :bq])) and bool((lse[..., :bq] == -torch.inf).all())
    assert bool(out[:, bq:].abs().sum() > 0) and bool(torch.isfinite(lse[..., bq:]).all())
    assert not bool(dq[:, :bq].any()) and bool(dq[:, bq:].any())
    assert not bool(dk[:, 128:].any()) and not bool(dv[:, 128:].any()) and bool(dk[:, :128].any())


def test_mask_mod_drops_causal_forward_not_backward():
    """causal=True beside a (document) mask_mod: the forward is the mask_mod alone
    (``_resolve_causal_local_window(..., mask_mod)`` -> causal False), the backward is the causal
    flag alone (``_flash_attn_bwd`` resolves without the mask_mod, and ``apply_mask``'s causal
    branch ignores it): production differentiates a different function than it evaluates."""
    q, k, v, do = _qkv(sq=256, sk=256)
    mm, aux = _doc_mod(1, 256, 256)
    nm = FA4Numerics.for_inputs("sm90", q, k, v)
    out, lse = attention(q, k, v, causal=True, mask_mod=mm, aux_tensors=aux, numerics=nm, return_lse=True)
    o2, l2 = attention(q, k, v, mask_mod=mm, aux_tensors=aux, numerics=nm, return_lse=True)
    assert torch.equal(out, o2) and torch.equal(lse, l2)
    assert not torch.equal(out, attention(q, k, v, causal=True, numerics=nm))
    both = attention_backward(q, k, v, out, lse, do, causal=True, mask_mod=mm, aux_tensors=aux, numerics=nm)
    flag = attention_backward(q, k, v, out, lse, do, causal=True, numerics=nm)
    mod = attention_backward(q, k, v, out, lse, do, mask_mod=mm, aux_tensors=aux, numerics=nm)
    _assert_same(both[:3], flag[:3])
    assert not torch.equal(both[0], mod[0])


def test_masked_exp2_hardware_with_mask_mod_is_all_hardware():
    """``masked_exp2="hardware"`` (the behaviour FA#2595 removed): every block of a mask_mod
    call applies a mask, so every exp2 is MUFU.EX2 — the all-hardware numerics, bitwise."""
    q, k, v, _ = _qkv(d=128)
    mm, aux = _doc_mod(1, 200, 300)
    nm = FA4Numerics.for_inputs("sm100", q, k, v)
    assert nm.emu_freq > 0
    got = attention(q, k, v, mask_mod=mm, aux_tensors=aux, numerics=dataclasses.replace(nm, masked_exp2="hardware"))
    want = attention(q, k, v, mask_mod=mm, aux_tensors=aux, numerics=dataclasses.replace(nm, exp2="hardware"))
    assert torch.equal(got, want)
    assert not torch.equal(got, attention(q, k, v, mask_mod=mm, aux_tensors=aux, numerics=nm))


LIB = [("score", n) for n in ("alibi", "relbias", "softcap")] + [
    ("mask", n) for n in ("causal", "sliding_window", "document", "prefix_lm")
]


# the fast tier runs each library mod on SM90's path; SM100's (same mod code, other tiles) is slow-tier
@pytest.mark.parametrize("arch", ["sm90", pytest.param("sm100", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind,name", LIB)
def test_library_mods_against_fp64(arch, kind, name):
    """Every library mod (GQA 4:2, two batches, seqlen_q != seqlen_k): the model's output within
    2 ULPs at the row's scale of the FP64 reference (measured: at most 1.23), LSE within 1e-3
    where finite (measured: 8.4e-5, SM100 ALiBi) and -inf exactly where the reference's is;
    gradients within 1% of the largest reference entry (measured: at most 0.49%; bf16's
    rounding of P and dS alone is 0.39% relative each).  Loose on purpose: the tests above pin
    the bits, this one the meaning."""
    b, sq, sk, hq, hk = 2, 192, 320, 4, 2
    q, k, v, do = _qkv(b=b, sq=sq, sk=sk, hq=hq, hk=hk, grad=True, seed=1)
    make = make_score_mod if kind == "score" else make_mask_mod
    mod, aux = make(name, batch=b, heads_q=hq, seqlen_q=sq, seqlen_k=sk, seed=3)
    kw = {f"{kind}_mod": mod, "aux_tensors": aux}
    nm = FA4Numerics.for_inputs(arch, q, k, v)
    out, lse, dq, dk, dv = _run(q, k, v, do, nm, **kw)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    ref, lref = attention_reference(qd, kd, vd, call=AttentionCall.from_kwargs(**kw), return_lse=True)
    assert row_scaled_ulp_diff(out, ref, ref)["max"] <= 2.0
    fin = torch.isfinite(lref)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse.double() - lref)[fin].abs().max() <= 1e-3
    g = attention_grad_reference(qd, kd, vd, do, call=AttentionCall.from_kwargs(**kw))
    for name_, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        err = (got.double() - g[name_]).abs().max() / g[name_].abs().max()
        assert err <= 1e-2, (name_, float(err))


def test_refusals():
    """What production refuses, refused with its reason; varlen takes block sparsity per sequence only."""
    q, k, v, do = _qkv()
    with pytest.raises(ValueError, match="softcap and score_mod"):
        attention(q, k, v, softcap=CAP, score_mod=SOFTCAP)
    with pytest.raises(TypeError, match="numerics.mods.MaskMod"):
        attention(q, k, v, mask_mod=lambda *a: True)
    no_bwd = ScoreMod("nobwd", IDENTITY.fn)
    out, lse = attention(q, k, v, score_mod=no_bwd, return_lse=True)
    with pytest.raises(NotImplementedError, match="score_mod_bwd is required"):
        attention_backward(q, k, v, out, lse, do, score_mod=no_bwd, numerics=FA4Numerics.sm90())
    bs = block_sparse_from_mask(
        _causal_mod(200, 300), batch=1, heads=2, seqlen_q=200, seqlen_k=300, block_size=(128, 256)
    )
    nm = FA4Numerics.for_inputs("sm90", q, k, v, block_sparse=(128, 256))
    # production's refusals (its ValueErrors, fa4.refusals.REFUSALS): the model refuses alike
    with pytest.raises(NotImplementedError, match="to match tile_n=128"):
        attention(q, k, v, block_sparse_tensors=bs, numerics=nm)
    with pytest.raises(NotImplementedError, match="must be a multiple of 256"):  # SM100: q_stage 2 x 128 rows
        bs2 = block_sparse_from_mask(
            _causal_mod(300, 300), batch=1, heads=2, seqlen_q=300, seqlen_k=300, block_size=(128, 128)
        )
        q3 = torch.zeros(1, 300, 2, 64, dtype=torch.bfloat16)
        attention(q3, q3, q3, block_sparse_tensors=bs2)
    q4, k4, v4, do4 = _qkv(sq=256, sk=512, d=128)  # SM100 backward: 2 tiles per sparse KV block -> 2-CTA
    bs4 = block_sparse_from_mask(
        _causal_mod(256, 512), batch=1, heads=2, seqlen_q=256, seqlen_k=512, block_size=(256, 256)
    )
    nm4 = FA4Numerics.for_inputs("sm100", q4, k4, v4, block_sparse=(256, 256))
    o4, l4 = attention(q4, k4, v4, block_sparse_tensors=bs4, numerics=nm4, return_lse=True)  # the forward takes it
    with pytest.raises(NotImplementedError, match="block-sparse backward with 2-CTA"):
        attention_backward(q4, k4, v4, o4, l4, do4, block_sparse_tensors=bs4, numerics=nm4)
    with pytest.raises(TypeError, match="one numerics.mods.BlockSparse .batch 1. or None per sequence"):
        varlen_attention(q, k, v, mask_mod=_causal_mod(200, 300), block_sparse_tensors=bs)


def test_block_sparse_tiles():
    """The tiles production fits to the sparse block (``_tile_size_fwd_sm90`` with
    ``sparse_block_size_q``, ``_fit_sm90_fwd_tile_to_block_sparsity``; SM100 no 2-CTA)."""
    sm90 = lambda d, bs: (lambda n: (n.tile_m, n.tile_n))(FA4Numerics.sm90(torch.bfloat16, d, block_sparse=bs))  # noqa: E731
    assert sm90(128, (64, 64)) == (64, 64)
    assert sm90(128, (128, 128)) == (128, 128)
    assert sm90(64, (128, 128)) == (128, 128)  # 128 is not a multiple of 192: no 192-row tile
    assert sm90(64, (384, 128)) == (192, 128)
    assert sm90(64, None) == (192, 128)
    nm = FA4Numerics.sm100(torch.bfloat16, 128, seqlen_q=1024, block_sparse=(256, 128))
    assert nm.tile_m == 256 and nm.emu_freq == 16  # 1-CTA (no (True, False, 128) tuning key)
    assert FA4Numerics.sm100(torch.bfloat16, 128, seqlen_q=1024).tile_m == 512


@pytest.mark.parametrize("arch", ARCHS)
def test_block_sparse_full_inner_blocks_with_causal_flag(arch):
    """Block sparsity with ``causal=True`` and no mask_mod, every block listed full: SM90 masks
    each visited block causally (``consume_block_sparse_loads``: the flags stay in ``mask_fn``),
    bitwise the dense causal call; SM100 runs the full list's inner blocks with ``mask_fn=None``
    (``softmax_block_sparse_sm100_list``), so KV tile 0 is seen whole by every row: bitwise a
    mask_mod keeping tile 0 and the causal part of tile 1, visited in the same order."""
    bq = _bsz(arch)[0]
    q, k, v, _ = _qkv(sq=256, sk=256)
    full = torch.ones(1, 1, 256 // bq, 2, dtype=torch.bool)
    bs = BlockSparse(full, torch.zeros_like(full), (bq, 128))
    nm = FA4Numerics.for_inputs(arch, q, k, v, True, block_sparse=(bq, 128))
    got = attention(q, k, v, causal=True, block_sparse_tensors=bs, numerics=nm)
    causal = attention(q, k, v, causal=True, numerics=nm)
    if arch == "sm90":
        assert torch.equal(got, causal)
        return
    assert not torch.equal(got, causal)
    leak = MaskMod("tile0_whole", lambda b, h, qi, kv, aux: (kv < 128) | (kv <= qi))
    assert torch.equal(got, attention(q, k, v, mask_mod=leak, numerics=nm))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_model_with_mods_on_cuda(arch):
    """The model on CUDA (MUFU.EX2 / MUFU.TANH themselves, ``fa4.mufu``) against the model on the
    CPU (those instructions modelled correctly rounded; MUFU.EX2 is within ~2 float32 ULPs of
    that): a score_mod, a document mask_mod and block sparsity together, forward within 1 ULP
    at the row's scale and the same -inf LSE pattern, gradients within 0.1% of their largest
    entry (bf16 rounding of P and dS flips where the float32 values differ by an ULP)."""
    b, sq, sk, hq = 2, 256, 512, 2
    q, k, v, do = _qkv(b=b, sq=sq, sk=sk, hq=hq, hk=hq, grad=True, seed=5)
    mm, aux_m = _doc_mod(b, sq, sk, cuts=(200, 330))
    sm, aux_s = make_score_mod("alibi", batch=b, heads_q=hq, seqlen_q=sq, seqlen_k=sk, aux_base=2)
    aux = aux_m + aux_s  # the document mod reads aux 0 and 1, ALiBi (aux_base 2) aux 2
    bs = block_sparse_from_mask(mm, batch=b, heads=hq, seqlen_q=sq, seqlen_k=sk, block_size=_bsz(arch), aux=aux)
    nm = FA4Numerics.for_inputs(arch, q, k, v, block_sparse=_bsz(arch))
    kw = dict(score_mod=sm, mask_mod=mm, block_sparse_tensors=bs)
    cpu = _run(q, k, v, do, nm, aux_tensors=aux, **kw)
    dev = [t.detach().cuda().requires_grad_(t.requires_grad) for t in (q, k, v)]
    bs_d = BlockSparse(bs.full.cuda(), bs.partial.cuda(), bs.block_size)
    gpu = _run(*dev, do.cuda(), nm, aux_tensors=[t.cuda() for t in aux], **{**kw, "block_sparse_tensors": bs_d})
    gpu = [t.cpu() for t in gpu]
    assert row_scaled_ulp_diff(gpu[0], cpu[0], cpu[0])["max"] <= 1.0
    assert torch.equal(torch.isfinite(gpu[1]), torch.isfinite(cpu[1]))
    for a, c in zip(gpu[2:], cpu[2:]):
        assert (a.double() - c.double()).abs().max() <= 1e-3 * c.double().abs().max()


def test_sm90_deterministic_block_sparse_backward_is_refused_as_production_refuses_it():
    """flash-attn-4 4.0.0b36's SM90 backward asserts "Deterministic not implemented for
    block-sparse backward" (flash_bwd_sm90.py dQaccum_store; met on the H200, 2026-12-02): the
    model refuses the same call with production's words, so both are ``skipped``; dense and
    non-deterministic block-sparse backwards run."""
    import dataclasses

    from audits.suites.cases import Case
    from audits.suites.inputs import make_inputs
    from fa4.model_bwd import bwd_plan
    from fa4.refusals import REFUSALS, refusal_of

    c = Case("bfloat16", 64, 64, 1, 2, 2, 128, 128, mask_mod="causal", block_sparse=(128, 128))
    x = make_inputs(c)
    nm = FA4Numerics.for_call("sm90", x["q"], x["k"], x["v"], mask_mod=x["kw"]["mask_mod"],
                              block_sparse_tensors=x["kw"]["block_sparse_tensors"])  # fmt: skip
    det = dataclasses.replace(nm, bwd_deterministic=True)
    with pytest.raises(NotImplementedError, match="Deterministic not implemented for block-sparse backward") as e:
        bwd_plan(det, 64, 64, False, False, block_sparse=(128, 128))
    assert refusal_of(AssertionError(str(e.value))) in REFUSALS  # production's words, production's rule
    bwd_plan(nm, 64, 64, False, False, block_sparse=(128, 128))
    bwd_plan(det, 64, 64, False, False)
