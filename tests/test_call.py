"""``numerics.call.AttentionCall``: the call's keyword bundle checked once, read from and given
back as the kernel contract's keywords, and its runtime scalars bound to its mods once."""

from __future__ import annotations

import math

import pytest
import torch

from examples.reference_kernel import attention as reference_kernel
from fa4.model import attention as model_attention
from numerics.call import AttentionCall, effective_window
from numerics.mods import MaskMod, ScoreMod
from numerics.reference import attention_reference, call_visibility


def _bias(s, b, h, q, kv, aux):
    return s + 0.25


def test_softcap_and_a_score_mod_are_refused_together_naming_both():
    sm = ScoreMod("bias", _bias)
    with pytest.raises(ValueError, match=r"softcap and score_mod are exclusive.*softcap=15\.0.*ScoreMod\('bias'\)"):
        AttentionCall(softcap=15.0, score_mod=sm)
    assert AttentionCall(softcap=0.0, score_mod=sm).score_mod is sm  # softcap 0 is no softcap
    assert AttentionCall(softcap=None).softcap == 0.0


def test_window_size_must_be_a_pair():
    with pytest.raises(ValueError, match=r"window_size must be a \(left, right\) pair.*\(1, 2, 3\)"):
        AttentionCall(window_size=(1, 2, 3))
    assert AttentionCall(window_size=None).window_size == (None, None)
    assert AttentionCall(window_size=[4, 0]).window_size == (4, 0)  # a list (a case's JSON) becomes a tuple


@pytest.mark.parametrize(
    ("causal", "window", "want"),
    [
        (False, (None, None), (None, None)),
        (True, (None, None), (None, 0)),
        (True, (8, 3), (8, 0)),
        (True, (8, -2), (8, -2)),
    ],
)
def test_effective_window_caps_right_with_causal(causal, window, want):
    assert AttentionCall(causal=causal, window_size=window).effective_window() == want
    assert effective_window(causal=causal, window_size=window) == want


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"score_mod": _bias}, "score_mod must be a numerics.mods.ScoreMod, got function"),
        ({"mask_mod": ScoreMod("bias", _bias)}, "mask_mod must be a numerics.mods.MaskMod, got ScoreMod"),
        ({"block_sparse_tensors": torch.ones(1, 1, 2, 2)}, "block_sparse_tensors must be a numerics.mods.BlockSparse"),
        (
            {"aux_tensors": [torch.zeros(2), 3]},
            r"aux_tensors must be a list of tensors .* got list of \['Tensor', 'int'\]",
        ),
    ],
)
def test_the_mods_types_are_checked_for_the_references_and_the_model(kw, match):
    """One check for both sides of the contract: the record (the references' input) and the
    model's keyword API (``fa4.primitives.check_mods`` builds the record)."""
    with pytest.raises(TypeError, match=match):
        AttentionCall(**kw)
    q = torch.zeros(1, 4, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=match):
        model_attention(q, q, q, **kw)


def test_aux_scalars_are_normalised_and_checked():
    assert AttentionCall(aux_scalars=[]).aux_scalars is None  # production: an empty sequence is None
    assert AttentionCall(aux_scalars=[0.5, 3]).aux_scalars == (0.5, 3)
    with pytest.raises(TypeError, match=r"aux_scalars\[1\] is str"):
        AttentionCall(aux_scalars=(0.5, "x"))


def test_from_kwargs_refuses_a_keyword_outside_the_bundle_naming_it():
    with pytest.raises(TypeError, match=r"from_kwargs got dlse, return_lse; accepted: softmax_scale, causal"):
        AttentionCall.from_kwargs(causal=True, return_lse=True, dlse=None)


def test_kernel_kwargs_give_back_the_keywords_and_mods_only_when_set():
    sink = torch.zeros(2)
    kw = {"causal": True, "window_size": (8, 0), "softcap": 5.0, "learnable_sink": sink}
    got = AttentionCall.from_kwargs(**kw).kernel_kwargs()
    assert got == {"softmax_scale": None, **kw}  # no mods: a kernel without mods gets none of their keywords
    mm = MaskMod("keep", lambda b, h, q, kv, aux: kv <= q)
    got = AttentionCall(mask_mod=mm, aux_scalars=(1.0,)).kernel_kwargs()
    assert got["mask_mod"] is mm and got["aux_scalars"] == (1.0,) and "score_mod" not in got


def test_a_kernel_given_kernel_kwargs_computes_the_call_the_reference_computes():
    """The round trip through the kernel contract: the README's reference kernel, called with
    the record's keywords, agrees with the FP64 reference of the same record."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 24, 2, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    call = AttentionCall(causal=True, window_size=(6, None), softcap=4.0, learnable_sink=torch.tensor([0.5, -1.0]))
    out, lse = reference_kernel(q, k, v, return_lse=True, **call.kernel_kwargs())
    ref, rl = attention_reference(q, k, v, call=call, return_lse=True)
    assert float((out.double() - ref).abs().max()) < 2e-2
    assert float((lse.double() - rl).abs().max()) < 1e-4
    plain, _ = attention_reference(q, k, v, call=AttentionCall(), return_lse=True)
    assert float((plain - ref).abs().max()) > 0.1  # the keywords did change the call


def test_bind_scalars_hands_the_scalars_to_the_mods_once():
    seen = []

    def keep(b, h, q, kv, aux, *, aux_scalars):
        seen.append(aux_scalars)
        return kv <= q + int(aux_scalars[0])

    call = AttentionCall(mask_mod=MaskMod("lag", keep), aux_scalars=(2,))
    bound = call.bind_scalars()
    assert bound.aux_scalars is None and bound.bind_scalars() is bound  # binding again is a no-op
    assert AttentionCall().bind_scalars().aux_scalars is None
    vis = call_visibility(batch=1, heads=1, seqlen_q=4, seqlen_k=8, call=call)
    assert seen == [(2,)]
    assert vis.reshape(4, 8).sum(-1).tolist() == [3, 4, 5, 6]  # keys 0..q+2


def test_scale_defaults_to_one_over_sqrt_d():
    assert AttentionCall().scale(64) == 1 / math.sqrt(64)
    assert AttentionCall(softmax_scale=0.3).scale(64) == 0.3
