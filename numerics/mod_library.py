"""The standard mods, reference forms (``numerics.mods``): what users build on FA4 and flex_attention.

Score mods: ``alibi`` (a per-head linear bias in the key distance), ``relbias`` (a learned bias
per head and T5-style distance bucket, read from aux tensors), ``softcap`` (production's own
softcap, ``flash_attn/cute/utils.py`` ``create_softcap_scoremod``, as a score_mod),
``temperature`` (the score times a runtime scalar read from the call's ``aux_scalars``).  Mask mods:
``causal``, ``sliding_window`` (causal, a window of ``WINDOW`` keys to the left), ``document``
(per-token segment ids in aux tensors), ``prefix_lm`` (a per-batch bidirectional prefix, causal
after it).  Each factory returns the mod and its aux tensors (placed by the caller from
``aux_base`` on in the call's ``aux_tensors``), deterministic from ``seed``; a mod reading runtime
scalars lists their values in ``params["aux_scalars"]`` (placed by the caller from ``scalar_base``
on in the call's ``aux_scalars``; its forms receive them as the keyword ``aux_scalars=``).

Each ``fn`` is written twice-usable: in float64 it is the mathematical function (the reference);
in float32 each torch operation rounds once, in the order the docstring gives, which is the order
the CuTe-DSL forms (``fa4.mods``) compute in; a form that fuses two of them (an FFMA) would have to
say so, and the model follow it.  Integer index arithmetic is exact (positions < 2**24, so their
int -> float32 conversion is exact too).

Every form and hook takes the keyword ``aux_scalars=`` (None by default): a call with runtime
scalars hands them to *every* mod it has (``numerics.mods.bind_aux_scalars``, as production's
``call_score_mod`` / ``call_mask_mod`` do), so a mod beside one that reads scalars must accept them.

Masks align queries to keys bottom-right, as FA's ``causal=True`` does when seqlen_q != seqlen_k:
query i sits at key position ``i + (seqlen_k - seqlen_q)``.
"""

from __future__ import annotations

import math

import torch

from numerics.forward_bound import (
    UNIT_ROUNDOFF,
    softcap_curvature,
    softcap_grad_error,
    softcap_slope,
    softcap_value_error,
)
from numerics.mods import MaskMod, ScoreMod

__all__ = [
    "SCORE_MODS",
    "MASK_MODS",
    "SOFTCAP_CAP",
    "WINDOW",
    "RELBIAS_BUCKETS",
    "RELBIAS_MAX_DISTANCE",
    "RELBIAS_SPAN",
    "TEMPERATURE_RANGE",
    "SCALAR_SCORE_MODS",
    "make_score_mod",
    "make_mask_mod",
    "t5_bucket",
]

SCORE_MODS = ("alibi", "relbias", "softcap", "temperature")
#: the score mods that read the call's runtime ``aux_scalars`` (a call naming one carries them):
#: the ``mods`` suite takes them in a few configurations of their own, smoke not at all
#: (``audits.suites.cases._mod_configs``)
SCALAR_SCORE_MODS = ("temperature",)
MASK_MODS = ("causal", "sliding_window", "document", "prefix_lm")

#: the softcap score_mod's cap: a value FA's own tests use (flash-attention/tests/cute/test_flash_attn.py
#: parametrizes softcap over 0.0 and 15.0); the flag cross-check runs ``softcap=SOFTCAP_CAP``
SOFTCAP_CAP = 15.0
#: keys to the left a sliding_window query sees besides its own position: the mask equals the
#: flags ``causal=False, window_size=(WINDOW, 0)``
WINDOW = 96
#: T5's relative-attention defaults (bidirectional): 32 buckets, exact below 8, log-spaced to 128
RELBIAS_BUCKETS = 32
RELBIAS_MAX_DISTANCE = 128
#: the bucket table covers distances kv - q in [-RELBIAS_SPAN, RELBIAS_SPAN): sequences up to
#: this long (64 KiB of int32); longer ones are refused by the factory
RELBIAS_SPAN = 8192
#: the ``temperature`` mod's factor is drawn uniformly from [lo, hi) by the seed, a float64 value
#: (generally not a float32 one, so the kernel's Float32 conversion of the scalar rounds it); above
#: 1 the mod's slope exceeds 1, which the bounds must carry
TEMPERATURE_RANGE = (0.5, 2.0)


def _gen(seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + salt) % (1 << 63))


def t5_bucket(rel: torch.Tensor, *, num_buckets: int = RELBIAS_BUCKETS, max_distance: int = RELBIAS_MAX_DISTANCE):
    """T5's bidirectional relative-position bucket of ``rel = kv - q`` (int64 tensor): half the
    buckets for rel > 0; |rel| < num_buckets/4 exact, then log-spaced up to ``max_distance``
    (Raffel et al. 2020; ``transformers`` ``T5Attention._relative_position_bucket``), computed
    here in float64 once per distance: the kernel only reads the table."""
    half = num_buckets // 2
    ret = (rel > 0).long() * half
    n = rel.abs()
    max_exact = half // 2
    ratio = torch.log(n.double().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (ratio * (half - max_exact)).long()
    large = large.clamp(max=half - 1)
    return ret + torch.where(n < max_exact, n, large)


#: relative margin on a float64 evaluation of ``|s + bias|`` in the bias mods' value_error (its
#: one float64 rounding, 2**-53, with room)
_F64_MARGIN = 1 + 2.0**-50


def _bias_hooks(fn, *, rounded_bias: bool) -> dict:
    """Bound hooks (``numerics.mods.ScoreMod``; derivation in docs/mods.md "Bounds with mods") of a mod
    ``f(s) = s + bias`` whose float32 form rounds the sum once (FADD) and, with
    ``rounded_bias``, the bias once before it (ALiBi's FMUL ``slope * dist``; an FFMA fusing the
    two rounds once and is covered too).  The bias is ``fn(0)`` (float64: exact, the float32
    slope times an integer distance below 2**24 needs at most 48 bits).
      value_error = u |s + bias| (the FADD) + [u |bias| (1 + u)] (the bias's rounding, which
        the FADD's relative bound then sees too): convex in s, so its maximum over an interval
        is at an end (``numerics.forward_bound.hook_at_ends``'s contract);
      slope = 1, curvature = 0 (f' = 1 everywhere);
      grad_error = 0: the backward form ``g * 1`` is exact in float32 (production's
      score_mod_bwd of a bias returns its gradient unchanged)."""
    u = UNIT_ROUNDOFF

    def value_error(s, b, h, q, kv, aux, aux_scalars=None):
        err = u * fn(s, b, h, q, kv, aux).abs() * _F64_MARGIN
        if rounded_bias:
            err = err + u * (1 + u) * fn(torch.zeros_like(s), b, h, q, kv, aux).abs()
        return err

    return {
        "value_error": value_error,
        "slope": lambda lo, hi, b, h, q, kv, aux, aux_scalars=None: torch.ones_like(lo),
        "grad_error": lambda g, s, b, h, q, kv, aux, aux_scalars=None: torch.zeros_like(s),
        "curvature": lambda lo, hi, b, h, q, kv, aux, aux_scalars=None: torch.zeros_like(lo),
    }


def _alibi(*, heads_q: int, aux_base: int, device, **_) -> tuple[ScoreMod, list]:
    """ALiBi (Press et al. 2022) in flex_attention's form: ``s + slope[h] * (kv - q)``.
    Slopes ``2**(-8 (h + 1) / heads)`` (the geometric sequence of the paper), rounded to float32
    once into aux tensor 0.  float32 order: ``dist = float(kv - q)`` (exact), ``bias = slope * dist``
    (FMUL, rounded), ``s + bias`` (FADD, rounded)."""
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads_q) for h in range(heads_q)], dtype=torch.float32)
    a = aux_base

    def fn(s, b, h, q, kv, aux, aux_scalars=None):
        slope = aux[a].to(s.device)[h].to(s.dtype)
        return s + slope * (kv - q).to(s.dtype)

    def grad(g, s, b, h, q, kv, aux, aux_scalars=None):
        return g * torch.ones_like(s)

    hooks = _bias_hooks(fn, rounded_bias=True)
    params = {"slopes": "2**(-8(h+1)/heads)"}
    return ScoreMod("alibi", fn, grad, aux_base=a, params=params, **hooks), [slopes.to(device)]


def _relbias(*, heads_q: int, seqlen_q: int, seqlen_k: int, aux_base: int, seed: int, device, **_):
    """A learned relative-position bias, T5-style: ``s + table[h, bucket[kv - q + RELBIAS_SPAN]]``.
    aux tensor 0: the table (heads, RELBIAS_BUCKETS) float32, N(0, 1) from the seed; aux tensor 1:
    the bucket of each distance (int32, 2 * RELBIAS_SPAN).  float32 order: one FADD (the table value
    is read exactly)."""
    if max(seqlen_q, seqlen_k) > RELBIAS_SPAN:
        raise ValueError(f"relbias covers sequences up to {RELBIAS_SPAN} tokens; got {seqlen_q}x{seqlen_k}")
    table = torch.randn(heads_q, RELBIAS_BUCKETS, generator=_gen(seed, 1), dtype=torch.float64).float()
    buckets = t5_bucket(torch.arange(-RELBIAS_SPAN, RELBIAS_SPAN)).to(torch.int32)
    a = aux_base

    def fn(s, b, h, q, kv, aux, aux_scalars=None):
        bucket = aux[a + 1].to(s.device)[(kv - q + RELBIAS_SPAN).long()].long()
        return s + aux[a].to(s.device)[h, bucket].to(s.dtype)

    def grad(g, s, b, h, q, kv, aux, aux_scalars=None):
        return g * torch.ones_like(s)

    params = {"buckets": RELBIAS_BUCKETS, "max_distance": RELBIAS_MAX_DISTANCE}
    hooks = _bias_hooks(fn, rounded_bias=False)  # the table value is read exactly: the FADD only
    return ScoreMod("relbias", fn, grad, aux_base=a, params=params, **hooks), [table.to(device), buckets.to(device)]


def _softcap(*, aux_base: int, **_) -> tuple[ScoreMod, list]:
    """Production's softcap score_mod (``utils.create_softcap_scoremod``): ``c * tanh(s / c)``,
    c = SOFTCAP_CAP.  float32 order: ``s / c`` (div), ``tanh`` (production: ``cute.math.tanh``
    with fastmath, MUFU.TANH on the GPU; here torch's tanh), ``c * t`` (FMUL).  Backward
    (``create_softcap_scoremod_bwd``): ``t = tanh(s / c)``, ``g * (1 - t * t)``."""
    c = SOFTCAP_CAP

    def fn(s, b, h, q, kv, aux, aux_scalars=None):
        return c * torch.tanh(s / c)

    def grad(g, s, b, h, q, kv, aux, aux_scalars=None):
        t = torch.tanh(s / c)
        return g * (1.0 - t * t)

    hooks = {  # the softcap flag's own bound (numerics.forward_bound's softcap hooks): one derivation for both
        "value_error": lambda s, b, h, q, kv, aux, aux_scalars=None: softcap_value_error(s, c),
        "slope": lambda lo, hi, b, h, q, kv, aux, aux_scalars=None: softcap_slope(lo, hi, c),
        "grad_error": lambda g, s, b, h, q, kv, aux, aux_scalars=None: softcap_grad_error(g, s, c),
        "curvature": lambda lo, hi, b, h, q, kv, aux, aux_scalars=None: softcap_curvature(lo, hi, c),
    }
    return ScoreMod("softcap", fn, grad, aux_base=aux_base, params={"cap": c}, per_head=False, **hooks), []


def _offset(seqlen_q: int, seqlen_k: int) -> int:
    return seqlen_k - seqlen_q


def _causal(*, seqlen_q: int, seqlen_k: int, aux_base: int, **_) -> tuple[MaskMod, list]:
    """``kv <= q + (seqlen_k - seqlen_q)``: FA's ``causal=True`` (bottom-right aligned)."""
    off = _offset(seqlen_q, seqlen_k)
    fn = lambda b, h, q, kv, aux, aux_scalars=None: kv <= q + off  # noqa: E731
    return MaskMod("causal", fn, aux_base=aux_base, params={"offset": off}), []


def _sliding_window(*, seqlen_q: int, seqlen_k: int, aux_base: int, **_) -> tuple[MaskMod, list]:
    """Causal with ``WINDOW`` keys to the left: FA's ``window_size=(WINDOW, 0)``."""
    off, w = _offset(seqlen_q, seqlen_k), WINDOW

    def fn(b, h, q, kv, aux, aux_scalars=None):
        return (kv <= q + off) & (kv >= q + off - w)

    return MaskMod("sliding_window", fn, aux_base=aux_base, params={"offset": off, "window": w}), []


def _segments(n: int, g: torch.Generator, *, min_len: int = 16) -> torch.Tensor:
    """Segment ids (int32, length n) of documents of random lengths: 2..5 cut points, at least
    ``min_len`` apart where n allows, so each document has a few key blocks' worth of tokens."""
    cuts = int(torch.randint(2, 6, (1,), generator=g))
    pos = sorted(set(int(x) for x in torch.randint(1, max(2, n), (cuts,), generator=g)))
    kept, last = [], 0
    for p in pos:
        if p - last >= min_len and n - p >= min_len:
            kept.append(p)
            last = p
    ids = torch.zeros(n, dtype=torch.int32)
    for p in kept:
        ids[p:] += 1
    return ids


def _document(*, batch: int, seqlen_q: int, seqlen_k: int, aux_base: int, seed: int, device, **_):
    """Document masking: a query sees the keys of its own document.  aux tensor 0: the document
    of each query (batch, seqlen_q) int32; aux tensor 1: of each key (batch, seqlen_k) int32; a
    query's document is that of its aligned key position ``i + seqlen_k - seqlen_q`` (clamped)."""
    g = _gen(seed, 2)
    kv_doc = torch.stack([_segments(seqlen_k, g) for _ in range(batch)])
    pos = (torch.arange(seqlen_q) + _offset(seqlen_q, seqlen_k)).clamp(0, seqlen_k - 1)
    q_doc = kv_doc[:, pos]
    a = aux_base

    def fn(b, h, q, kv, aux, aux_scalars=None):
        return aux[a].to(q.device)[b, q] == aux[a + 1].to(q.device)[b, kv]

    return MaskMod("document", fn, aux_base=a), [q_doc.to(device), kv_doc.to(device)]


def _prefix_lm(*, batch: int, seqlen_q: int, seqlen_k: int, aux_base: int, seed: int, device, **_):
    """Prefix-LM: keys before the batch's prefix length are seen by every query, the rest
    causally.  aux tensor 0: the prefix length per batch (int32, drawn in [0, seqlen_k])."""
    prefix = torch.randint(0, seqlen_k + 1, (batch,), generator=_gen(seed, 3)).to(torch.int32)
    off, a = _offset(seqlen_q, seqlen_k), aux_base

    def fn(b, h, q, kv, aux, aux_scalars=None):
        return (kv < aux[a].to(q.device)[b]) | (kv <= q + off)

    return MaskMod("prefix_lm", fn, aux_base=a, params={"offset": off}), [prefix.to(device)]


def _temperature(*, scalar_base: int = 0, seed: int, **_) -> tuple[ScoreMod, list]:
    """``s * tau``, ``tau = aux_scalars[scalar_base]``: a logit scale (inverse temperature) the
    caller changes at run time without a recompile (production's compile key holds only the
    scalars' types, ``interface._flash_attn_fwd`` ``aux_scalar_metadata``) — the use
    ``aux_scalars`` exists for, and the simplest mod whose slope is not 1.  tau is drawn from the
    seed in :data:`TEMPERATURE_RANGE` (``params["aux_scalars"]``: the call's scalars from
    ``scalar_base``); the forms read it from the call's ``aux_scalars``, never from the closure.
    float32 order: production's DSL receives a Python float as a Float32 runtime argument
    (``jit_arg_adapters._PYTHON_SCALAR_CONVERSION_MAP``: one rounding, ``tau^ = fl32(tau)``), then
    ``fl(s * tau^)`` (one FMUL on the already rounded scaled score: two multiplies do not contract).
    Backward: ``g * tau^`` (one FMUL).  Hooks (docs/mods.md "Bounds"), with ``dt = |tau^ - tau|``:
      value_error = |s| (u (|tau| + dt) + dt): ``|fl(s tau^) - s tau| <= u |s tau^| + |s| dt``;
      slope = |tau|, curvature = 0; grad_error = |g| (u (|tau| + dt) + dt), the same for ``g tau``.
    Each is evaluated in float64 and widened by ``1 + 2^-50`` for its own few roundings; the
    underflow of a product (TINY) is the bounds' own term."""
    i = int(scalar_base)
    tau = float(
        TEMPERATURE_RANGE[0]
        + (TEMPERATURE_RANGE[1] - TEMPERATURE_RANGE[0]) * torch.rand((), generator=_gen(seed, 4), dtype=torch.float64)
    )

    def scalar(aux_scalars) -> float:
        if aux_scalars is None or len(aux_scalars) <= i:
            raise ValueError(
                f"score_mod temperature reads aux_scalars[{i}]; the call has aux_scalars={aux_scalars!r} (pass "
                f"aux_scalars=({tau!r},) as fa4.mods.build_mods does)"
            )
        return aux_scalars[i]

    # a Python float, never torch.tensor(tau, dtype=s.dtype): flex_attention traces a score_mod on
    # an example score of the query's dtype (bf16), which would bake in tau rounded to bf16 (seen
    # on the H200: LSE errors of 1e-2 against float64, 2026-12-02); a Python scalar takes the
    # dtype of the score the kernel computes (float64 in the reference: tau itself; float32: fl32(tau))
    def fn(s, b, h, q, kv, aux, *, aux_scalars=None):
        return s * float(scalar(aux_scalars))

    def grad(g, s, b, h, q, kv, aux, *, aux_scalars=None):
        return g * float(scalar(aux_scalars))

    def rel(aux_scalars) -> float:  # u (|tau| + dt) + dt, widened for its float64 evaluation
        t = float(scalar(aux_scalars))
        dt = abs(float(torch.tensor(t, dtype=torch.float32)) - t)  # exact: two nearby doubles (Sterbenz)
        return (UNIT_ROUNDOFF * (abs(t) + dt) + dt) * _F64_MARGIN

    hooks = {
        "value_error": lambda s, b, h, q, kv, aux, *, aux_scalars=None: s.abs() * rel(aux_scalars),
        "slope": lambda lo, hi, b, h, q, kv, aux, *, aux_scalars=None: torch.full_like(
            lo, abs(float(scalar(aux_scalars)))
        ),
        "grad_error": lambda g, s, b, h, q, kv, aux, *, aux_scalars=None: (g.abs() * rel(aux_scalars)).expand(
            torch.broadcast_shapes(g.shape, s.shape)
        ),
        "curvature": lambda lo, hi, b, h, q, kv, aux, *, aux_scalars=None: torch.zeros_like(lo),
    }
    params = {"aux_scalars": (tau,), "scalar_base": i, "range": TEMPERATURE_RANGE}
    return ScoreMod("temperature", fn, grad, params=params, per_head=False, **hooks), []


_SCORE = {"alibi": _alibi, "relbias": _relbias, "softcap": _softcap, "temperature": _temperature}
_MASK = {"causal": _causal, "sliding_window": _sliding_window, "document": _document, "prefix_lm": _prefix_lm}


def _make(table: dict, kind: str, name: str, **kw):
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; accepted: {', '.join(table)}")
    return table[name](**kw)


def make_score_mod(
    name: str,
    *,
    batch: int,
    heads_q: int,
    seqlen_q: int,
    seqlen_k: int,
    aux_base: int = 0,
    seed: int = 0,
    device="cpu",
    scalar_base: int = 0,
) -> tuple[ScoreMod, list[torch.Tensor]]:
    """The library score mod ``name`` (one of SCORE_MODS) for a call of this shape, and its aux
    tensors (to sit at ``aux_base``, ``aux_base + 1``, ... of the call's ``aux_tensors``); its
    runtime scalars, if any, are ``mod.params["aux_scalars"]`` (to sit from ``scalar_base`` on in
    the call's ``aux_scalars``)."""
    kw = dict(batch=batch, heads_q=heads_q, seqlen_q=seqlen_q, seqlen_k=seqlen_k, aux_base=aux_base, seed=seed)
    return _make(_SCORE, "score_mod", name, device=device, scalar_base=scalar_base, **kw)


def make_mask_mod(
    name: str,
    *,
    batch: int,
    heads_q: int,
    seqlen_q: int,
    seqlen_k: int,
    aux_base: int = 0,
    seed: int = 0,
    device="cpu",
) -> tuple[MaskMod, list[torch.Tensor]]:
    """The library mask mod ``name`` (one of MASK_MODS), as :func:`make_score_mod`."""
    kw = dict(batch=batch, heads_q=heads_q, seqlen_q=seqlen_q, seqlen_k=seqlen_k, aux_base=aux_base, seed=seed)
    return _make(_MASK, "mask_mod", name, device=device, **kw)
