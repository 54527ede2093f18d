"""Mods through the varlen entry (docs/varlen.md, "Mods on varlen cases"): the model applies each
mod per sequence with production's indices (the sequence as ``batch_idx``, positions within it),
the references and bounds do the same, block sparsity per sequence in production's varlen layout,
the suites carry varlen mod cases, and what production refuses, the model does not model (split-KV
with block sparsity) or ``--per-sequence`` cannot pass is refused.  GPU (``gpu``): production's varlen
entry with the mods against the model's verdicts and against its own fixed-length call per sequence."""

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from audits.engine import run as engine
from audits.engine.options import RunOptions
from audits.kernels import per_sequence
from audits.suites.cases import case_from_dict, mods_suite, smoke_suite, varlen_case, varlen_mods
from audits.suites.strategies import mask_mod_of, varlen_batches
from audits.verdict.gate import load_thresholds
from fa4.model import FA4Numerics, attention
from fa4.mods import build_mods
from fa4.varlen import sequence_mods, varlen_attention
from numerics.call import AttentionCall
from numerics.forward_bound import forward_error_bound
from numerics.mods import BlockSparse
from numerics.reference import attention_reference

SEQLENS = ((5, 7), (0, 3), (1, 1), (40, 30), (3, 0), (17, 64))


def _packed(seqlens, hq=4, hk=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(a for a, _ in seqlens), sum(b for _, b in seqlens)
    q, k, v = (torch.randn(t, h, d, generator=g).bfloat16() for t, h in ((tq, hq), (tk, hk), (tk, hk)))
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu([a for a, _ in seqlens]), cu_seqlens_k=cu([b for _, b in seqlens]),
              max_seqlen_q=max(a for a, _ in seqlens), max_seqlen_k=max(b for _, b in seqlens))  # fmt: skip
    return q, k, v, kw


@pytest.mark.parametrize("score_mod, mask_mod", [("alibi", "document"), ("relbias", "prefix_lm"), ("softcap", "")])
def test_each_sequence_computes_the_fixed_length_call_at_its_batch_index(score_mod, mask_mod):
    """Sequence i of the model's varlen entry is bit for bit row i of the fixed-length model on a
    batch holding it at index i (the per-batch aux rows of the document and prefix-LM masks are
    sequence i's), under the same numerics; production's ``batch_idx`` in the varlen entry is the
    sequence (``SeqlenInfoQK``; ``apply_score_mod_inner`` wraps positions by the sequence's
    lengths).  An entry handing every sequence batch 0 reads row 0's documents and prefix."""
    q, k, v, vk = _packed(SEQLENS)
    n = len(SEQLENS)
    mods = build_mods(score_mod=score_mod, mask_mod=mask_mod, batch=n, heads_q=4, seqlen_q=vk["max_seqlen_q"],
                      seqlen_k=vk["max_seqlen_k"], seed=3)  # fmt: skip
    nm = FA4Numerics.for_inputs("sm90", q[None], k[None], v[None], False, (None, None))
    out, lse = varlen_attention(q, k, v, **vk, **mods, numerics=nm, return_lse=True)
    cq, ck = vk["cu_seqlens_q"].tolist(), vk["cu_seqlens_k"].tolist()
    checked = 0
    for i, (sq, sk) in enumerate(SEQLENS):
        if sq == 0:
            continue
        qb = torch.zeros(n, sq, 4, 64, dtype=q.dtype)
        kb, vb = (torch.zeros(n, sk, 2, 64, dtype=q.dtype) for _ in range(2))
        qb[i], kb[i], vb[i] = q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]]
        o_ref, l_ref = attention(qb, kb, vb, **mods, numerics=nm, return_lse=True)
        assert torch.equal(out[cq[i] : cq[i + 1]], o_ref[i]), (score_mod, mask_mod, i)
        assert torch.equal(lse[:, cq[i] : cq[i + 1]], l_ref[i]), (score_mod, mask_mod, i)
        checked += sk > 0
    assert checked == 4


def test_sequence_mods_hand_each_mod_the_sequence_index():
    """``sequence_mods(i)``: the reference form, the bound hooks and the model form see b + i;
    the CuTe forms stay with the caller's mods (production gets those)."""
    mods = build_mods(score_mod="alibi", mask_mod="prefix_lm", batch=3, heads_q=2, seqlen_q=8, seqlen_k=8, seed=1)
    seen = []
    mm = replace(mods["mask_mod"], fn=lambda b, h, q, kv, aux: seen.append(int(b.flatten()[0])) or (kv >= 0))
    got = sequence_mods(2, score_mod=mods["score_mod"], mask_mod=mm, aux_tensors=mods["aux_tensors"])
    b0 = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    got["mask_mod"].fn(b0, b0, b0, b0, got["aux_tensors"])
    assert seen == [2] and "cute" not in got["score_mod"].forms and "model" in got["score_mod"].forms
    assert got["aux_tensors"] == mods["aux_tensors"]
    # sequence 2's blocks, their own mask mod (what the references apply when the call names none) shifted alike
    bs = BlockSparse(torch.ones(1, 1, 1, 1, dtype=torch.bool), torch.zeros(1, 1, 1, 1, dtype=torch.bool), (128, 128),
                     mask_mod=mm)  # fmt: skip
    got = sequence_mods(2, block_sparse_tensors=[None, None, bs])
    got["block_sparse_tensors"].mask_mod.fn(b0, b0, b0, b0, mods["aux_tensors"])
    assert seen == [2, 2] and torch.equal(got["block_sparse_tensors"].full, bs.full)
    assert sequence_mods(1, block_sparse_tensors=[None, None, bs]) == {}


BS_CASE = dict(seqlens=((0, 50), (1, 1), (200, 300), (5, 0), (130, 260)), dtype="bfloat16", d=64, dv=64, heads_q=4,
               heads_kv=2, score_mod="alibi", mask_mod="document", block_sparse=(128, 128), seed=3)  # fmt: skip


def test_block_sparse_sequences_compute_the_fixed_length_block_sparse_call_at_their_batch_index():
    """Varlen block sparsity (one BlockSparse per sequence, production's varlen layout): sequence i
    is bit for bit row i of the fixed-length model with those blocks at batch index i (other rows'
    blocks empty) and the call's mask mod; the blocks hold full and partial ones."""
    from audits.suites.inputs import make_varlen_inputs

    case = varlen_case(**BS_CASE)
    x = make_varlen_inputs(case)
    kw, n = x["kw"], len(case.seqlens)
    bsl = kw["block_sparse_tensors"]
    assert any(b is not None and b.full.any() for b in bsl) and any(b is not None and b.partial.any() for b in bsl)
    nm = FA4Numerics.for_inputs("sm90", *(t[None] for t in (x["q"], x["k"], x["v"])), block_sparse=(128, 128))
    out, lse = varlen_attention(x["q"], x["k"], x["v"], **kw, numerics=nm, return_lse=True)
    cq = kw["cu_seqlens_q"].tolist()
    for i, (q_i, k_i, v_i) in enumerate(x["parts"]):
        if bsl[i] is None:
            continue
        qb, kb, vb = (t.new_zeros(n, *t.shape[1:]) for t in (q_i, k_i, v_i))
        qb[i], kb[i], vb[i] = q_i[0], k_i[0], v_i[0]
        full, part = (torch.zeros(n, *t.shape[1:], dtype=torch.bool) for t in (bsl[i].full, bsl[i].partial))
        full[i], part[i] = bsl[i].full[0], bsl[i].partial[0]
        bs = BlockSparse(full, part, (128, 128), mask_mod=kw["mask_mod"])
        mods = {n_: kw[n_] for n_ in ("score_mod", "mask_mod", "aux_tensors")}
        o_f, l_f = attention(qb, kb, vb, **mods, block_sparse_tensors=bs, numerics=nm, return_lse=True)
        assert torch.equal(out[cq[i] : cq[i + 1]], o_f[i]) and torch.equal(lse[:, cq[i] : cq[i + 1]], l_f[i]), i


def test_varlen_block_lists_are_production_layout():
    """``varlen_block_lists``: per query block the counts at ``cu_total_m_blocks[b] + j``, the
    key-block lists at ``cu_block_idx_offsets[b] + j * n_b`` (``_get_curr_blocksparse_tensors_varlen``),
    each list the ascending kept blocks; decoded back it is every sequence's masks."""
    from audits.suites.inputs import make_varlen_inputs
    from fa4.varlen import varlen_block_lists

    case = varlen_case(**BS_CASE)
    bsl = make_varlen_inputs(case)["kw"]["block_sparse_tensors"]
    lens = list(case.seqlens)
    got = varlen_block_lists(bsl, lens, heads=4)
    assert got["cu_total_m_blocks"].tolist() == [0, 0, 1, 3, 4, 6]
    assert got["cu_block_idx_offsets"].tolist() == [0, 0, 1, 7, 7, 13]
    assert got["mask_block_cnt"].shape == (1, 6) and got["mask_block_idx"].shape == (1, 13)  # heads broadcast
    for kind, attr in (("mask", "partial"), ("full", "full")):
        for b, ((sq, sk), bs) in enumerate(zip(lens, bsl)):
            mb, nb = -(-sq // 128), -(-sk // 128)
            for j in range(mb):
                c = int(got[f"{kind}_block_cnt"][0, got["cu_total_m_blocks"][b] + j])
                off = int(got["cu_block_idx_offsets"][b]) + j * nb
                cols = got[f"{kind}_block_idx"][0, off : off + c].tolist()
                want = [] if bs is None else getattr(bs, attr)[0, 0, j].nonzero().flatten().tolist()
                assert cols == want, (kind, b, j)


def _entry_partial_as_full(q, k, v, *, block_sparse_tensors=None, **kw):
    """A seeded bug: every sequence's partial blocks visited as full (the mask mod not applied)."""
    bsl = [None if b is None else replace(b, full=b.full | b.partial, partial=torch.zeros_like(b.partial))
           for b in block_sparse_tensors]  # fmt: skip
    return varlen_attention(q, k, v, block_sparse_tensors=bsl, arch="sm90", **kw)  # SM90 takes the 128-row block


_entry_partial_as_full.fa4_audit_contract = "varlen"
_entry_partial_as_full.fa4_audit_domain = {"mods": ["score_mod", "mask_mod", "block_sparse"]}


def test_varlen_block_sparse_case_passes_and_catches_a_partial_block_treated_as_full(tmp_path):
    case = varlen_case(**BS_CASE)
    recs = engine.run_suites(
        ["fa4-model-sm90", "tests.test_varlen_mods:_entry_partial_as_full"], [case],
        RunOptions(out=tmp_path, thresholds=load_thresholds(), isolate=False),
    )  # fmt: skip
    good, bad = recs["fa4-model-sm90"][0], recs["tests.test_varlen_mods:_entry_partial_as_full"][0]
    assert good["verdict"] == "pass" and good["bound"]["violations"] == 0, good["reasons"]
    assert bad["verdict"] == "fail" and any("exceed the forward-pass bound" in r for r in bad["reasons"])


def test_varlen_block_sparsity_refusals():
    """Production's refusal of a sparse query block other than q_stage * tile_m on varlen
    (``normalize_block_sparse_config``), and split-KV (not modelled: FA#2761), each a skip."""
    from audits.suites.inputs import make_varlen_inputs

    x = make_varlen_inputs(varlen_case(**{**BS_CASE, "block_sparse": (256, 128)}))
    with pytest.raises(NotImplementedError, match=r"Varlen block sparsity requires sparse_block_size\[0\]=128"):
        varlen_attention(x["q"], x["k"], x["v"], **x["kw"], arch="sm90")
    x = make_varlen_inputs(varlen_case(**BS_CASE))
    with pytest.raises(NotImplementedError, match="block sparsity with split-KV .* not modelled.*FA#2761"):
        varlen_attention(x["q"], x["k"], x["v"], **{**x["kw"], "num_splits": 2})
    with pytest.raises(TypeError, match="one numerics.mods.BlockSparse .* or None per sequence"):
        varlen_attention(
            x["q"], x["k"], x["v"], **{**x["kw"], "block_sparse_tensors": x["kw"]["block_sparse_tensors"][2]}
        )


def test_per_sequence_refuses_mods():
    """``--per-sequence`` calls a fixed-length kernel with batch 1 per sequence: a mod would see
    batch 0 for every sequence, so it refuses (a skip) rather than audit the wrong indices."""
    q, k, v, vk = _packed(((4, 4), (2, 3)))
    mods = build_mods(mask_mod="document", batch=2, heads_q=4, seqlen_q=4, seqlen_k=4, seed=0)
    with pytest.raises(NotImplementedError, match=r"--per-sequence does not pass mods \(mask_mod, aux_tensors\)"):
        per_sequence(attention)(q, k, v, **vk, **mods)


def test_varlen_cases_take_score_and_mask_mods_and_the_suites_carry_them():
    c = case_from_dict({"dtype": "bfloat16", "seqlens": [[3, 5], [0, 2]], "score_mod": "alibi", "mask_mod": "document"},
                       where="x")  # fmt: skip
    assert c.varlen and c.mods == ("score_mod", "mask_mod") and "sm-alibi-mm-document-vl3x5.0x2" in c.name
    vm = varlen_mods()
    assert set(vm) <= set(mods_suite()) and [c for c in smoke_suite() if c.varlen and c.mods] == vm[:1]
    from numerics.mod_library import MASK_MODS, SCORE_MODS

    assert {c.score_mod for c in vm} - {""} == set(SCORE_MODS) and {c.mask_mod for c in vm} - {""} == set(MASK_MODS)
    lens = [p for c in vm for p in c.seqlens]
    assert (1, 1) in lens and any(a == 0 for a, _ in lens) and any(a and not b for a, b in lens)
    assert any(c.page_size for c in vm) and any(c.num_splits > 1 for c in vm) and any(c.seqused_k for c in vm)
    from audits.suites.cases import MOD_BLOCK, MOD_BLOCK_SM100

    assert {c.block_sparse for c in vm} - {()} == {MOD_BLOCK, MOD_BLOCK_SM100}  # SM90's and SM100's sparse block


def _entry_without_sequence_index(q, k, v, *, score_mod=None, mask_mod=None, aux_tensors=None, **kw):
    """A seeded bug: the varlen entry evaluates every sequence with the mods at batch 0 (as a
    batch-1 call would), reading sequence 0's aux rows for all of them."""
    from fa4 import varlen

    real = varlen.sequence_mods
    try:
        varlen.sequence_mods = lambda i, **m: real(0, **m)
        return varlen_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors, **kw)
    finally:
        varlen.sequence_mods = real


_entry_without_sequence_index.fa4_audit_contract = "varlen"
_entry_without_sequence_index.fa4_audit_domain = {"mods": ["score_mod", "mask_mod"]}  # absent: none (docs/mods.md)


def test_smoke_varlen_mod_case_passes_on_the_model_and_catches_the_wrong_sequence_index(tmp_path):
    """smoke's varlen mod case (ALiBi + document on mixed lengths, an empty sequence, 1x1, queries
    without keys) passes on the model of SM90, held to its bound with the sequences' mods; the
    same entry handing every sequence batch 0 fails it on the output (the documents of sequence 0
    masked onto the others)."""
    case = varlen_mods(smoke=True)[0]
    recs = engine.run_suites(
        ["fa4-model-sm90", "tests.test_varlen_mods:_entry_without_sequence_index"], [case],
        RunOptions(out=tmp_path, thresholds=load_thresholds(), isolate=False),
    )  # fmt: skip
    good, bad = recs["fa4-model-sm90"][0], recs["tests.test_varlen_mods:_entry_without_sequence_index"][0]
    assert good["verdict"] == "pass" and good["bound"]["violations"] == 0, good["reasons"]
    assert good["varlen"]["entry"] == "varlen"
    assert bad["verdict"] == "fail" and bad["varlen"]["worst_sequence"] > 0  # sequence 0 reads its own rows
    assert any("exceed the forward-pass bound" in r for r in bad["reasons"]), bad["reasons"]
    assert any(r.startswith("FA criterion: max|out - ref|") for r in bad["reasons"]), bad["reasons"]


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(x=varlen_batches(max_sequences=4, max_len=40))
def test_varlen_model_with_random_mods_is_within_each_sequences_bound(x):
    """Random varlen batches with a random score mod and a random block mask per sequence: the
    model's varlen entry is within the forward bound of each sequence's own fixed-length FP64
    reference, whose mask is the sequence's pattern row sliced out (a batch-1 mask: no batch
    index involved), so an entry reading another sequence's row fails."""
    q, k, v, kw = x["q"], x["k"], x["v"], x["kw"]
    sm, mm, aux = kw["score_mod"], kw["mask_mod"], kw["aux_tensors"]
    out, lse = varlen_attention(q, k, v, **kw, arch="sm90", return_lse=True)
    cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    for i, (sq, sk) in enumerate(x["seqlens"]):
        if sq == 0 or sk == 0:
            if sq:
                assert not out[cq[i] : cq[i + 1]].any() and bool((lse[:, cq[i] : cq[i + 1]] == -torch.inf).all())
            continue
        own, own_aux = mask_mod_of(x["pattern"][i : i + 1], aux_base=mm.aux_base)
        mods = dict(score_mod=sm, mask_mod=own, aux_tensors=[*aux[: mm.aux_base], *own_aux])
        qs, ks, vs = q[cq[i] : cq[i + 1]][None], k[ck[i] : ck[i + 1]][None], v[ck[i] : ck[i + 1]][None]
        ref, rl = attention_reference(qs, ks, vs, call=AttentionCall.from_kwargs(**mods), return_lse=True)
        nm = FA4Numerics.for_inputs("sm90", qs, ks, vs, False, (None, None))
        ob, lb = forward_error_bound(qs, ks, vs, nm, call=AttentionCall.from_kwargs(**mods), reference=(ref, rl))
        err = (out[cq[i] : cq[i + 1]][None].double() - ref).abs()
        assert bool((err <= ob).all()), (i, x["seqlens"], float((err - ob).max()))
        fin = torch.isfinite(rl)
        lerr = (lse[:, cq[i] : cq[i + 1]][None].double() - rl).abs()
        assert bool((lerr[fin] <= lb[fin]).all()), (i, x["seqlens"])


# ---- production (GPU) -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in varlen_mods() if c.num_splits == 1], ids=lambda c: c.name)
def test_production_varlen_with_mods_passes_and_is_its_fixed_length_call_at_the_sequence_index(case, tmp_path):
    """Production's varlen entry with each library mod (split-KV left out: SM90 refuses it; block
    sparsity in its varlen layout, ``fa4.varlen.varlen_block_lists``) gets the verdict the model
    of this GPU's arch gets (pass, or skipped for the same refusal) against the per-sequence
    references of the model's semantics (``fa4.varlen.sequence_mods``); and sequence i of its
    output is, bit for bit, its own fixed-length call on a batch holding that sequence (and its
    blocks) at batch index i with the same (unshifted) mods: production's varlen entry hands a mod
    the sequence as ``batch_idx`` and positions within it, which is what the model assumes."""
    from audits.kernels import production_arch
    from audits.suites.inputs import make_varlen_inputs
    from fa4.production import flash_attn, flash_attn_varlen

    model = "fa4-model-sm90" if production_arch() == "sm90" else "fa4-model"
    options = RunOptions(device="cuda", out=tmp_path, thresholds=load_thresholds(), isolate=False)
    recs = engine.run_suites(["fa4", model], [case], options)
    p, m = recs["fa4"][0], recs[model][0]
    assert m["verdict"] in ("pass", "skipped") and p["verdict"] == m["verdict"], (p["reasons"], m["reasons"])
    if p["verdict"] == "skipped":  # the sparse block this arch refuses: both say so
        assert (
            "Varlen block sparsity requires" in p["reasons"][0] and "Varlen block sparsity requires" in m["reasons"][0]
        )
        return
    assert p["varlen"]["entry"] == "varlen" and p["bound"]["violations"] == 0
    x = make_varlen_inputs(case, device="cuda")
    kw = dict(x["kw"])
    out, lse = flash_attn_varlen(x["q"], x["k"], x["v"], return_lse=True, **kw)
    mods = {n: kw[n] for n in ("score_mod", "mask_mod", "aux_tensors", "aux_scalars") if kw.get(n) is not None}
    fixed = {n: kw[n] for n in ("causal", "window_size", "softcap") if n in kw}
    bsl = kw.get("block_sparse_tensors")
    cq, n = kw["cu_seqlens_q"].tolist(), len(case.seqlens)
    for i, (q_i, k_i, v_i) in enumerate(x["parts"]):
        sq, sk = q_i.shape[1], k_i.shape[1]
        if sq == 0 or sk == 0:
            continue
        qb, kb, vb = (t.new_zeros(n, *t.shape[1:]) for t in (q_i, k_i, v_i))
        qb[i], kb[i], vb[i] = q_i[0], k_i[0], v_i[0]
        extra = {}
        if bsl is not None:  # sequence i's blocks at batch index i, the other rows' empty
            full, part = (torch.zeros(n, *t.shape[1:], dtype=torch.bool, device=t.device)
                          for t in (bsl[i].full, bsl[i].partial))  # fmt: skip
            full[i], part[i] = bsl[i].full[0], bsl[i].partial[0]
            extra["block_sparse_tensors"] = BlockSparse(full, part, tuple(bsl[i].block_size), mask_mod=kw["mask_mod"])
        o_f, l_f = flash_attn(qb, kb, vb, return_lse=True, **fixed, **mods, **extra)
        assert torch.equal(out[cq[i] : cq[i + 1]], o_f[i]), (case.name, i)
        assert torch.equal(lse[:, cq[i] : cq[i + 1]], l_f[i]), (case.name, i)


def test_production_varlen_block_refusal_is_a_refusal_rule():
    """Production's ValueError for a varlen sparse query block other than q_stage * tile_m
    (``block_sparsity.normalize_block_sparse_config``, its f-string with values filled in) maps to a
    refusal (the case skipped on production, as on the model), and only that message does."""
    from fa4.refusals import refusal_of

    msg = "Varlen block sparsity requires sparse_block_size[0]=128 (= q_stage * tile_m); got 256."
    rule = refusal_of(ValueError(msg))
    assert rule is not None and "normalize_block_sparse_config" in rule.source
    assert refusal_of(ValueError("Varlen block sparsity requires block_sparse_tensors.cu_total_m_blocks.")) is None
