"""numerics.reference / numerics.grad_reference with mods (score_mod, mask_mod, aux tensors, block
sparsity): against flag equivalents bitwise, a direct float64 brute force (torch.softmax over an
explicit per-(batch, head) mask), float64 autograd for the gradients, and the exact rows."""

import math

import pytest
import torch

from numerics.call import AttentionCall
from numerics.grad_reference import (
    attention_grad_reference,
    attention_lowprec_grads,
    exact_grad_elements,
)
from numerics.mod_library import SOFTCAP_CAP, WINDOW, make_mask_mod, make_score_mod
from numerics.mods import BlockSparse, MaskMod, ScoreMod, block_sparse_from_mask
from numerics.reference import attention_lowprec, attention_reference, exact_attention_rows, mp_attention_rows

B, SQ, SK, HQ, HK, D = 2, 9, 13, 4, 2, 16


def _inputs(seed=0, b=B, sq=SQ, sk=SK, hq=HQ, hk=HK, d=D, dt=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, sq, hq, d, generator=g) * 1.5).to(dt)
    k = (torch.randn(b, sk, hk, d, generator=g) * 1.5).to(dt)
    v = torch.randn(b, sk, hk, d, generator=g).to(dt)
    do = torch.randn(b, sq, hq, d, generator=g).to(dt)
    return q, k, v, do


def _shape(q, k):
    return dict(batch=q.shape[0], heads_q=q.shape[2], seqlen_q=q.shape[1], seqlen_k=k.shape[1])


def _mods(q, k, score="", mask="", block=()):
    """The call's mod kwargs (aux tensors laid out score mod first, as ``fa4.mods`` does)."""
    kw, aux = {}, []
    if score:
        sm, a = make_score_mod(score, aux_base=len(aux), seed=3, **_shape(q, k))
        kw["score_mod"], aux = sm, aux + a
    if mask:
        mm, a = make_mask_mod(mask, aux_base=len(aux), seed=3, **_shape(q, k))
        kw["mask_mod"], aux = mm, aux + a
        if block:
            b, sq, hq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
            kw["block_sparse_tensors"] = block_sparse_from_mask(
                mm, batch=b, heads=hq, seqlen_q=sq, seqlen_k=sk, block_size=block, aux=aux
            )
    kw["aux_tensors"] = aux
    return kw


def brute(q, k, v, *, scale=None, logits=None, keep=None):
    """Attention in float64 written independently of numerics.reference: explicit (b, h, i, j)
    scores, ``logits(s, b, h, i, j)`` applied elementwise, an explicit mask ``keep(b, h, i, j)``
    (bool, broadcastable), torch.softmax, empty rows out 0 and lse -inf; differentiable."""
    b, sq, hq, d = q.shape
    sk, g = k.shape[1], hq // k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    kk = k.double().repeat_interleave(g, 2)
    vv = v.double().repeat_interleave(g, 2)
    s = scale * torch.einsum("bihd,bjhd->bhij", q.double(), kk)
    bi, hi = torch.arange(b).view(-1, 1, 1, 1), torch.arange(hq).view(1, -1, 1, 1)
    ii, jj = torch.arange(sq).view(1, 1, -1, 1), torch.arange(sk).view(1, 1, 1, -1)
    if logits is not None:
        s = logits(s, bi, hi, ii, jj)
    m = torch.ones(b, hq, sq, sk, dtype=torch.bool) if keep is None else keep(bi, hi, ii, jj).expand(b, hq, sq, sk)
    s = s.masked_fill(~m, -math.inf)
    empty = ~m.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(~m, 0.0)
    out = torch.einsum("bhij,bjhc->bihc", p, vv)
    lse = torch.logsumexp(s, dim=-1)  # -inf on empty rows
    return out, lse


def _close(a, b, tol):
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    assert torch.equal(a[~fin], b[~fin])
    assert (a[fin] - b[fin]).abs().max().item() <= tol


@pytest.mark.parametrize("sq,sk", [(SQ, SK), (13, 9)])
def test_causal_mask_mod_is_the_causal_flag_bitwise(sq, sk):
    q, k, v, do = _inputs(sq=sq, sk=sk)
    o1, l1 = attention_reference(q, k, v, call=AttentionCall(causal=True), return_lse=True)
    o2, l2 = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**_mods(q, k, mask="causal")), return_lse=True)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    g1 = attention_grad_reference(q, k, v, do, call=AttentionCall(causal=True))
    g2 = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**_mods(q, k, mask="causal")))
    for n in ("dq", "dk", "dv", "lse"):
        assert torch.equal(g1[n], g2[n]), n


def test_sliding_window_mask_mod_is_the_window_flags():
    q, k, v, _ = _inputs(sq=140, sk=150, b=1, hq=2, hk=1)
    o1, l1 = attention_reference(q, k, v, call=AttentionCall(window_size=(WINDOW, 0)), return_lse=True)
    o2, l2 = attention_reference(
        q, k, v, call=AttentionCall.from_kwargs(**_mods(q, k, mask="sliding_window")), return_lse=True
    )
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_mask_mod_and_flags_intersect():
    """The audit's meaning of causal=True with a mask_mod: both masks (production drops causal)."""
    q, k, v, _ = _inputs()
    kw = _mods(q, k, mask="prefix_lm")
    got = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw, causal=True), return_lse=True)
    mm, aux = kw["mask_mod"], kw["aux_tensors"]
    off = SK - SQ
    want = brute(q, k, v, keep=lambda b, h, i, j: mm.fn(b, h, i, j, aux) & (j <= i + off))
    _close(got[0], want[0], 1e-14)
    _close(got[1], want[1], 1e-13)


def test_softcap_score_mod_is_the_softcap_flag():
    q, k, v, do = _inputs()
    q = q * 4  # logits past the cap: tanh saturates
    o1, l1 = attention_reference(q, k, v, call=AttentionCall(softcap=SOFTCAP_CAP), return_lse=True)
    o2, l2 = attention_reference(
        q, k, v, call=AttentionCall.from_kwargs(**_mods(q, k, score="softcap")), return_lse=True
    )
    _close(o2, o1, 1e-15)
    _close(l2, l1, 1e-13)
    g1 = attention_grad_reference(q, k, v, do, call=AttentionCall(softcap=SOFTCAP_CAP))
    g2 = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**_mods(q, k, score="softcap")))
    for n in ("dq", "dk", "dv"):  # the flag's factor is cosh**-2, the mod's 1 - tanh**2: float64 apart
        scale = g1[n].abs().max().item()
        assert (g1[n] - g2[n]).abs().max().item() <= 1e-13 * scale, n


def test_alibi_against_its_formula():
    q, k, v, _ = _inputs()
    kw = _mods(q, k, score="alibi")
    slopes = [2.0 ** (-8.0 * (h + 1) / HQ) for h in range(HQ)]
    sl = torch.tensor(slopes, dtype=torch.float32).double().view(1, -1, 1, 1)  # the float32 slopes, exactly
    want = brute(q, k, v, logits=lambda s, b, h, i, j: s + sl * (j - i))
    got = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True)
    _close(got[0], want[0], 1e-14)
    _close(got[1], want[1], 1e-13)
    # and the bias does move the result (a reference ignoring the score_mod fails this test)
    assert (attention_reference(q, k, v, call=AttentionCall()) - got[0]).abs().max() > 1e-2


def test_relbias_reads_its_table_by_head_and_bucket():
    q, k, v, _ = _inputs()
    kw = _mods(q, k, score="relbias")
    table, buckets = kw["aux_tensors"]
    bias = torch.zeros(HQ, SQ, SK, dtype=torch.float64)
    for h in range(HQ):
        for i in range(SQ):
            for j in range(SK):
                bias[h, i, j] = float(table[h, int(buckets[j - i + 8192])])
    want = brute(q, k, v, logits=lambda s, b, h, i, j: s + bias.unsqueeze(0))
    got = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True)
    _close(got[0], want[0], 1e-14)
    _close(got[1], want[1], 1e-13)


@pytest.mark.parametrize("mask,block", [("document", (8, 8)), ("prefix_lm", (2, 8)), ("causal", (3, 5))])
def test_block_sparse_from_a_mask_is_the_mask_dense(mask, block):
    q, k, v, do = _inputs(sq=40, sk=48) if mask == "document" else _inputs()  # documents of >= 16 tokens
    dense = _mods(q, k, mask=mask)
    sparse = _mods(q, k, mask=mask, block=block)
    assert sparse["block_sparse_tensors"].full.any() and sparse["block_sparse_tensors"].partial.any()
    a = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**dense), return_lse=True)
    b = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**sparse), return_lse=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ga = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**dense))
    gb = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**sparse))
    for n in ("dq", "dk", "dv"):
        assert torch.equal(ga[n], gb[n]), n


def test_full_block_ignores_the_mask_and_skipped_block_hides_keys():
    """A block marked full is visited whole (the mask_mod is not applied: a wrong full block
    leaks keys, which the reference must show); a block in neither list is skipped."""
    q, k, v, _ = _inputs(b=1, hq=2, hk=1, sq=8, sk=8)
    mm, aux = make_mask_mod("causal", batch=1, heads_q=2, seqlen_q=8, seqlen_k=8)
    full = torch.zeros(1, 1, 2, 2, dtype=torch.bool)
    part = torch.zeros(1, 1, 2, 2, dtype=torch.bool)
    full[0, 0, 0, 1] = True  # above the diagonal, "full": every key visible
    part[0, 0, 1, 1] = True  # the causal mask on the diagonal block
    bs = BlockSparse(full=full, partial=part, block_size=(4, 4), mask_mod=mm)
    got = attention_reference(q, k, v, call=AttentionCall(block_sparse_tensors=bs, aux_tensors=aux), return_lse=True)
    keep = torch.zeros(8, 8, dtype=torch.bool)
    keep[:4, 4:] = True
    keep[4:, 4:] = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    want = brute(q, k, v, keep=lambda b, h, i, j: keep.view(1, 1, 8, 8))
    _close(got[0], want[0], 1e-14)
    _close(got[1], want[1], 1e-13)


def _per_head_mask():
    """A mask that differs per head and batch: head h sees keys kv <= q + h - 3 (head 0 sees
    nothing in the first rows), batch 1 also drops even keys."""
    return MaskMod("per_head", lambda b, h, q, kv, aux: (kv <= q + h - 3) & ((b == 0) | (kv % 2 == 1)), per_head=True)


def test_per_head_and_batch_mask_with_empty_rows():
    q, k, v, do = _inputs()
    mm = _per_head_mask()
    got = attention_reference(q, k, v, call=AttentionCall(mask_mod=mm), return_lse=True)
    want = brute(q, k, v, keep=lambda b, h, i, j: mm.fn(b, h, i, j, None))
    _close(got[0], want[0], 1e-14)
    _close(got[1], want[1], 1e-13)
    assert torch.isinf(got[1][0, 0, :3]).all() and (got[0][0, :3, 0] == 0).all()  # empty rows of head 0
    assert torch.isfinite(got[1][0, 3, :]).all()  # head 3 of batch 0 sees a key on every row
    # the same through block sparsity built per head, and in low precision
    bs = block_sparse_from_mask(mm, batch=B, heads=HQ, seqlen_q=SQ, seqlen_k=SK, block_size=(4, 4))
    assert bs.full.shape[:2] == (B, HQ)
    got_bs = attention_reference(q, k, v, call=AttentionCall(block_sparse_tensors=bs), return_lse=True)
    assert torch.equal(got_bs[0], got[0]) and torch.equal(got_bs[1], got[1])
    low = attention_lowprec(q, k, v, call=AttentionCall(mask_mod=mm))
    assert low.dtype == torch.bfloat16 and (low.double() - got[0]).abs().max() < 3e-2
    assert (low[0, :3, 0] == 0).all()


def _autograd_grads(q, k, v, do, **brute_kw):
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, _ = brute(*leaves, **brute_kw)
    return dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, do.double())))


@pytest.mark.parametrize("score,mask", [("alibi", ""), ("relbias", "document"), ("softcap", "prefix_lm"),
                                        ("alibi", "per_head")])  # fmt: skip
def test_gradients_against_float64_autograd(score, mask):
    q, k, v, do = _inputs()
    kw = _mods(q, k, score=score, mask="" if mask == "per_head" else mask)
    if mask == "per_head":
        kw["mask_mod"] = _per_head_mask()
    sm, mm, aux = kw["score_mod"], kw.get("mask_mod"), kw["aux_tensors"]
    want = _autograd_grads(
        q, k, v, do, logits=lambda s, b, h, i, j: sm.fn(s, b, h, i, j, aux),
        keep=None if mm is None else (lambda b, h, i, j: mm.fn(b, h, i, j, aux)),
    )  # fmt: skip
    got = attention_grad_reference(
        q, k, v, do, call=AttentionCall.from_kwargs(**kw), chunk_rows=4
    )  # 3 chunks: the per-chunk visibility
    for n in ("dq", "dk", "dv"):
        scale = want[n].abs().max().item()
        assert (got[n] - want[n]).abs().max().item() <= 1e-13 * scale, n


def test_gradient_uses_the_mods_derivative():
    """f' comes from the mod's backward reference form: a wrong one changes dQ and dK, not dV."""
    q, k, v, do = _inputs()
    kw = _mods(q, k, score="alibi")
    sm = kw["score_mod"]
    wrong = ScoreMod("alibi_wrong_grad", sm.fn, lambda g, s, *idx: 1.5 * g)
    a = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**kw))
    b = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**{**kw, "score_mod": wrong}))
    assert torch.equal(a["dv"], b["dv"])
    assert torch.allclose(b["dq"], 1.5 * a["dq"], rtol=1e-12, atol=0)


def test_lowprec_grads_with_mods_track_the_fp64_ones():
    q, k, v, do = _inputs()
    kw = _mods(q, k, score="relbias", mask="document")
    low = attention_lowprec_grads(q, k, v, do, call=AttentionCall.from_kwargs(**kw))
    ref = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**kw))
    for n in ("dq", "dk", "dv"):
        assert low[n].dtype == torch.bfloat16
        assert (low[n].double() - ref[n]).abs().max() <= 0.05 * ref[n].abs().max(), n


@pytest.mark.parametrize("score,mask", [("alibi", "document"), ("softcap", "per_head"), ("", "prefix_lm")])
def test_exact_rows_with_mods(score, mask):
    q, k, v, do = _inputs()
    kw = _mods(q, k, score=score, mask="" if mask == "per_head" else mask)
    if mask == "per_head":
        kw["mask_mod"] = _per_head_mask()
    out, lse = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True)
    rows = [(1, 3, 8), (0, 0, 0), (1, 2, 4)]
    got = exact_attention_rows(q, k, v, rows, call=AttentionCall.from_kwargs(**kw))
    slow = mp_attention_rows(q, k, v, rows[:1], call=AttentionCall.from_kwargs(**kw), dps=40)
    for (bi, h, i), (mo, ml) in zip(rows, got):
        assert max(abs(float(x) - out[bi, i, h, c].item()) for c, x in enumerate(mo)) <= 1e-14
        assert float(ml) == lse[bi, h, i].item() or abs(float(ml) - lse[bi, h, i].item()) <= 1e-13
    mo, ml = slow[0]
    assert max(abs(float(a) - float(b)) for a, b in zip(mo, got[0][0])) <= 1e-20
    g = attention_grad_reference(q, k, v, do, call=AttentionCall.from_kwargs(**kw))
    ex = exact_grad_elements(
        q, k, v, do, call=AttentionCall.from_kwargs(**kw), dq_rows=[(1, 8, 3)], dk_rows=[(1, 5, 1)], dv_rows=[(0, 7, 0)]
    )
    for name, key in (("dq", (1, 8, 3)), ("dk", (1, 5, 1)), ("dv", (0, 7, 0))):
        scale = g[name].abs().max().item()
        diff = max(abs(float(x) - g[name][key][c].item()) for c, x in enumerate(ex[name][key]))
        assert diff <= 1e-14 * scale, (name, diff)


def test_exact_rows_see_the_mods():
    """The exact rows are not the mod-free ones (a certification ignoring the mods would pass a
    reference that ignores them)."""
    q, k, v, _ = _inputs()
    kw = _mods(q, k, score="alibi", mask="document")
    (with_mods,) = exact_attention_rows(q, k, v, [(1, 3, 8)], call=AttentionCall.from_kwargs(**kw))
    (without,) = exact_attention_rows(q, k, v, [(1, 3, 8)], call=AttentionCall())
    assert max(abs(float(a) - float(b)) for a, b in zip(with_mods[0], without[0])) > 1e-3


def test_refusals():
    q, k, v, do = _inputs()
    kw = _mods(q, k, score="softcap")
    with pytest.raises(ValueError, match="softcap and score_mod are exclusive"):
        attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw, softcap=5.0))
    no_grad = ScoreMod("no_bwd", kw["score_mod"].fn)
    with pytest.raises(ValueError, match="no grad"):
        attention_grad_reference(q, k, v, do, call=AttentionCall(score_mod=no_grad))
