"""The model's float32 forms of the library mods (fa4/mod_forms.py): production's contraction of
the scale multiply with a bias mod's addition, and softcap as a score_mod == the softcap flag."""

import dataclasses
import math

import pytest
import torch

from fa4.mod_forms import MODEL_FORMS, forms_of
from fa4.model import FA4Numerics, attention
from fa4.mods import build_mods
from numerics.fp import fma_f32
from numerics.mod_library import SCORE_MODS, SOFTCAP_CAP
from numerics.mods import index_grid

SHAPE = dict(batch=1, heads_q=3, seqlen_q=40, seqlen_k=56)


def _grid():
    return index_grid(1, 3, 40, 56)


def test_every_library_score_mod_has_model_forms():
    assert set(MODEL_FORMS) == set(SCORE_MODS)
    for name in SCORE_MODS:
        mod = build_mods(score_mod=name, seed=0, **SHAPE)["score_mod"]
        assert {"model", "model_bwd"} <= set(mod.forms), name


def test_alibi_model_form_is_one_fma_of_scale_acc_and_the_rounded_bias():
    """sm_90a PTX (fa4/mod_forms.py): cvt (exact), mul.f32 slope*dist, fma.rn.f32 scale, acc, bias.
    Three heads: the slopes 2**(-8/3 (h+1)) are not powers of two, so the bias product rounds."""
    kw = build_mods(score_mod="alibi", seed=0, **SHAPE)
    mod, aux = kw["score_mod"], kw["aux_tensors"]
    b, h, q, kv = _grid()
    acc = torch.randn(1, 3, 40, 56, generator=torch.Generator().manual_seed(1)) * 30
    scale = 1 / math.sqrt(128)  # not a power of two: fl32(acc * scale) rounds
    got = mod.forms["model"](acc, scale, b, h, q, kv, aux)
    bias = aux[0][h] * (kv - q).float()
    want = fma_f32(acc, torch.tensor(scale, dtype=torch.float32), bias.expand_as(acc))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    unfused = mod.fn(acc * torch.tensor(scale, dtype=torch.float32), b, h, q, kv, aux)
    differ = (got != unfused).sum().item()
    assert differ > 0, "the contraction must matter somewhere on these inputs, else this test proves nothing"


def test_relbias_model_form_is_one_fma():
    kw = build_mods(score_mod="relbias", seed=0, **SHAPE)
    mod, aux = kw["score_mod"], kw["aux_tensors"]
    b, h, q, kv = _grid()
    acc = torch.randn(1, 3, 40, 56, generator=torch.Generator().manual_seed(2)) * 30
    scale = 1 / math.sqrt(96)
    got = mod.forms["model"](acc, scale, b, h, q, kv, aux)
    bias = aux[0][h, aux[1][(kv - q + 8192).long()].long()]
    assert torch.equal(got, fma_f32(acc, torch.tensor(scale, dtype=torch.float32), bias.expand_as(acc)))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_softcap_score_mod_equals_the_softcap_flag_bitwise(arch):
    """Production's softcap flag *is* ``create_softcap_scoremod`` (interface._flash_attn_fwd), and
    the library's production form is that very function: the model must give the same bits,
    forward and gradients."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 2, 64, generator=g).mul(3).to(torch.bfloat16) for n in (70, 130, 130))
    kw = build_mods(score_mod="softcap", seed=0, batch=1, heads_q=2, seqlen_q=70, seqlen_k=130)
    nm = FA4Numerics.for_inputs(arch, q, k, v, False, (None, None))
    outs = []
    for call in ({"softcap": SOFTCAP_CAP}, kw):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o, lse = attention(qq, kk, vv, return_lse=True, numerics=nm, **call)
        grads = torch.autograd.grad(o, (qq, kk, vv), torch.ones_like(o))
        outs.append((o, lse, *grads))
    for a, b in zip(*outs):
        assert torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


def test_the_model_uses_the_model_form():
    """The model with the library ALiBi (its model form) differs in bits from the same mod without
    it (the reference form on fl32(acc*scale)): the form is what the model runs."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, n, 3, 128, generator=g).mul(2).to(torch.bfloat16) for n in (64, 96, 96))
    kw = build_mods(score_mod="alibi", seed=0, batch=1, heads_q=3, seqlen_q=64, seqlen_k=96)
    nm = FA4Numerics.for_inputs("sm90", q, k, v, False, (None, None))
    with_form = attention(q, k, v, numerics=nm, return_lse=True, **kw)[1]  # the float32 LSE: bf16 out hides bits
    bare = dict(kw, score_mod=dataclasses.replace(kw["score_mod"], forms={}))
    without = attention(q, k, v, numerics=nm, return_lse=True, **bare)[1]
    assert not torch.equal(with_form, without)
    assert (with_form - without).abs().max() < 1e-4  # the same function, one rounding apart


def test_forms_of_is_empty_for_a_mod_outside_the_library():
    mod = dataclasses.replace(build_mods(score_mod="alibi", seed=0, **SHAPE)["score_mod"], name="mine")
    assert forms_of(mod) == {}
