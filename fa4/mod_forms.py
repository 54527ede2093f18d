"""The library mods as production's compiled code computes them: the model's float32 forms.

A mod's reference form (``numerics.mod_library``) says *what* it computes, one rounding per torch
operation.  Production's compiled code can round less: ``softmax.py`` ``apply_score_mod_inner``
multiplies the accumulator by ``softmax_scale`` and hands the product to the score_mod, and
NVVM contracts that multiply with the mod's first addition into one ``fma.rn.f32``.  Read from
the sm_90a PTX of ``FlashAttentionForwardSm90`` compiled with these mods (flash-attn-4 4.0.0b36,
nvidia-cutlass-dsl 4.8.1, compiled on a CPU-only machine in fake-tensor mode, 2026-12-02):

* ALiBi ``s + slope * dist``: ``cvt.rn.f32.s32`` (the distance, exact), ``mul.f32`` (slope *
  distance, rounded), then ``fma.rn.f32 scale, acc, bias``: the scaled score is never rounded;
* relbias ``s + table[h, bucket]``: the table value is loaded (``ld.global.b32``), then
  ``fma.rn.f32 scale, acc, bias``;
* softcap ``c * tanh(s / c)``: ``mul.f32`` (acc * scale) then ``div.rn.f32``: no contraction
  (a division is not an addition), as the model's softcap flag already computes
  (``fa4.primitives.softcap_tanh``);
* temperature ``s * aux_scalars[i]`` (the scalar a kernel parameter, ``.param .f32``):
  ``mul.f32 scale, acc`` then ``mul.f32 tau, that``: two roundings, nothing to contract (the same
  in sm_100a's forward).  Its backward (sm_90a ``FlashAttentionBackwardSm90``): the recomputed
  P's score the same two FMULs, and ``score_mod_bwd`` one ``mul.f32 tau, dS`` after dS's
  ``sub.f32`` / ``mul.f32`` (compiled with the scalar as ``cutlass.Float32``: a Python float does
  not compile, ``fa4.mods.dsl_scalars``).

Each form here has the signature ``model(acc, scale, b, h, q_idx, kv_idx, aux) -> float32``
(``acc`` the float32 unscaled accumulator, ``scale`` the softmax scale) and the backward
``model_bwd(g, x, b, h, q_idx, kv_idx, aux) -> float32``, each also taking the keyword
``aux_scalars=`` (the call's runtime scalars, given only when there are any:
``fa4.primitives.bind_model_scalars``) (``g`` = dS after the mod, ``x`` =
``fl32(S_pre * scale)``: ``apply_score_mod_bwd_inner`` scales the kept pre-mod score with one
FMUL and hands it to the mod's backward, which the sm_90a PTX of the backward shows uncontracted
for softcap; the bias mods' backward does no arithmetic).  The
bias mods' backward returns ``g`` untouched (no arithmetic: their derivative is 1); softcap's is
``g * (1 - t * t)`` with ``1 - t*t`` one FFMA (``fa4.model_bwd`` states the same for the flag).
A mod without a model form is evaluated as its reference form on ``fl32(acc * scale)``
(``fa4.primitives.apply_score_mod``): right for a mod whose compiled code does not contract, and
otherwise off by the scaled score's one rounding, which the forward bound covers.  The backward's
recomputation of P contracts the same way (sm_90a PTX of ``FlashAttentionBackwardSm90`` with
ALiBi: ``mul.f32`` bias, ``fma.rn.f32`` scale-acc-bias), so one model form serves both passes.
"""

from __future__ import annotations

import functools

import torch

from fa4.primitives import div_rn, hardware_tanh, softcap_tanh
from numerics.fp import fma_f32
from numerics.fp import to_f32 as _f32
from numerics.mod_library import RELBIAS_SPAN

__all__ = ["MODEL_FORMS", "forms_of"]


def _f(x, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32, device=like.device)


def _fused_bias(acc: torch.Tensor, scale: float, bias: torch.Tensor) -> torch.Tensor:
    """``fma.rn.f32(scale, acc, bias)``: the scaled score plus a float32 bias, rounded once."""
    return fma_f32(acc, _f(_f32(scale), acc), bias.to(torch.float32))


def _alibi(acc, scale, b, h, q, kv, aux, *, aux_base: int, aux_scalars=None):
    slope = aux[aux_base].to(acc.device)[h].to(torch.float32)
    bias = slope * (kv - q).to(torch.float32)  # mul.f32 of the exact distance: one rounding
    return _fused_bias(acc, scale, bias)


def _relbias(acc, scale, b, h, q, kv, aux, *, aux_base: int, span: int, aux_scalars=None):
    bucket = aux[aux_base + 1].to(acc.device)[(kv - q + span).long()].long()
    return _fused_bias(acc, scale, aux[aux_base].to(acc.device)[h, bucket].to(torch.float32))


def _softcap(acc, scale, b, h, q, kv, aux, *, cap: float, aux_scalars=None):
    """FMUL, div.rn, MUFU.TANH (the instruction on CUDA: ``fa4.primitives.hardware_tanh``), FMUL."""
    return softcap_tanh(acc, scale, cap) * _f32(cap)


def _tau32(aux_scalars, i: int, like: torch.Tensor) -> torch.Tensor:
    """The runtime scalar as the kernel holds it: production's DSL converts a Python float to a
    Float32 argument (round to nearest; an int to Int32, exact below 2**24)."""
    if aux_scalars is None or len(aux_scalars) <= i:
        raise ValueError(f"score_mod temperature reads aux_scalars[{i}]; the call has aux_scalars={aux_scalars!r}")
    return _f(float(aux_scalars[i]), like)


def _temperature(acc, scale, b, h, q, kv, aux, *, scalar_base: int, aux_scalars=None):
    """``fl(fl(acc * scale) * tau32)``: two FMULs, each rounded (a product of products does not contract)."""
    return (acc * _f(_f32(scale), acc)) * _tau32(aux_scalars, scalar_base, acc)


def _temperature_bwd(g, x, b, h, q, kv, aux, *, scalar_base: int, aux_scalars=None):
    """``fl(g * tau32)``: one FMUL."""
    return g * _tau32(aux_scalars, scalar_base, g)


def _identity_bwd(g, x, b, h, q, kv, aux, **_):
    return g


def _softcap_bwd(g, x, b, h, q, kv, aux, *, cap: float, aux_scalars=None):
    """``create_softcap_scoremod_bwd`` on ``x = fl32(S_pre * scale)``: div.rn, MUFU.TANH, then
    ``1 - t*t`` as one FFMA and the FMUL by g."""
    t = hardware_tanh(div_rn(x, cap))
    return g * fma_f32(-t, t, torch.ones_like(t))


#: library mod name -> (model form, model backward form); the keyword arguments each needs are
#: taken from the mod (``aux_base``, ``params``) by :func:`forms_of`
MODEL_FORMS = {
    "alibi": (_alibi, _identity_bwd),
    "relbias": (_relbias, _identity_bwd),
    "softcap": (_softcap, _softcap_bwd),
    "temperature": (_temperature, _temperature_bwd),
}


def forms_of(mod) -> dict:
    """``{"model": ..., "model_bwd": ...}`` for a library score mod (bound to its aux_base and
    params), or {} for another mod."""
    if mod.name not in MODEL_FORMS:
        return {}
    fwd, bwd = MODEL_FORMS[mod.name]
    if mod.name == "softcap":
        kw = {"cap": float(mod.params["cap"])}
    elif mod.name == "temperature":
        kw = {"scalar_base": int(mod.params["scalar_base"])}
    else:
        kw = {"aux_base": mod.aux_base, **({"span": RELBIAS_SPAN} if mod.name == "relbias" else {})}
    return {"model": functools.partial(fwd, **kw), "model_bwd": functools.partial(bwd, **kw)}
