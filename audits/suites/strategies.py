"""Random mods for the audit: score mods composed from elementwise ops with bounded derivatives,
random block masks as mask mods, and Hypothesis strategies drawing both (docs/invariance.md,
"Random mods").

Score mods
==========
A random score mod is a chain ``f = op_n o ... o op_1`` of ops from :data:`SCORE_OPS`, each
increasing in the score ``x`` (so the image of an interval is the interval of the images):

==========  ==============================  =========  ===============================  ==========
op          value                           f'         float32 evaluation (the model's)  roundings
==========  ==============================  =========  ===============================  ==========
scale a     ``a * x``, a in [1/4, 4]        a          FMUL                              1
hbias       ``x + aux[k][h]`` (per head)    1          FADD (the table value exact)      1
relpos m    ``x + m * float(kv - q)``       1          int->f32 exact, FMUL, FADD        2
tanh c      ``c * tanh(x / c)``, c > 0      sech^2     div (<= 2 roundings), tanh, FMUL  3 + tanh
==========  ==============================  =========  ===============================  ==========

Constants are float32 numbers (read exactly in both precisions); ``kv - q`` is exact in float32
(|kv - q| < 2**24).  The tanh op is production's own softcap (``flash_attn/cute/utils.py``
``create_softcap_scoremod``: ``scores / c``, ``c * cute.math.tanh(., fastmath=True)``).

Rounding model: each float32 operation returns ``x (1 + d) + t`` with ``|d| <= u = 2**-24`` and
``|t| <= eta = 2**-126`` (round to nearest; ``eta`` covers subnormal results and flush-to-zero,
as ``numerics.backward_bound``'s ``_TINY`` does).  A division may be computed as a multiply by
the rounded reciprocal (torch on CUDA divides by a scalar that way: ``fa4.primitives.div_rn``'s
docstring): two roundings, ``|fl(x/c) - x/c| <= (2u + u^2)|x/c| + 2 eta``.  tanh is MUFU.TANH
on the GPU, absolute error ``TANH_ABS`` = ``numerics.forward_bound.MUFU["tanh_abs"]`` (measured
over all float32 inputs on the H200); torch's float32 tanh on the CPU is within an ulp of a
value <= 1, far inside it.

Per-op bounds, for a computed input ``x^`` with ``|x^ - x| <= e``:

* own rounding ``r_op(M, R)`` (``M >= |x^|``, ``R >= |op(x^)|``): scale, hbias: ``u R + eta``;
  relpos: the bias ``fl(m d)`` is off by ``u|m d| + eta``, the sum by ``u (R + u|m d| + eta) +
  eta``; tanh: ``y^ = fl(x^/c)`` is off by ``dy = (2u + u^2) M/c + 2 eta``, ``t^`` off from
  ``tanh(x^/c)`` by ``dt = TANH_ABS + dy`` (tanh is 1-Lipschitz), ``fl(c t^)`` adds
  ``u (R + c dt) + eta``: ``c dt + u (R + c dt) + eta``.  A fused multiply-add (ptxas may
  contract relpos' FMUL+FADD or a scale followed by an add) rounds once, ``<= u |result| +
  eta``, inside the two-rounding bound.
* slope over [lo, hi]: scale ``a``; hbias, relpos 1; tanh ``sech^2(m / c)``, m the smallest
  |x| of the interval (0 when it straddles 0).
* curvature over [lo, hi]: 0 but tanh: ``|f''| = (2/c) |tanh y sech^2 y|`` at ``y = x/c``, whose
  sup over an interval is at an end or at ``y* = atanh(1/sqrt 3)`` (value ``2/(3 sqrt 3)``) when
  the interval holds +-y*.

Composition (rigorous, by induction over the chain; ``x_k`` exact intermediates, ``e_k`` bounds
on the computed ones' errors, ``e_0 = 0`` since the score the mod sees is the float32 score):

* value:  ``e_k = L_k e_{k-1} + r_k(|x_{k-1}| + e_{k-1}, |x_k| + L_k e_{k-1})``, ``L_k`` the
  slope of op k over ``[x_{k-1} - e_{k-1}, x_{k-1} + e_{k-1}]`` (mean value theorem on the
  propagated error, plus the op's own rounding at the computed input).
* slope:  ``sup|f'| <= prod_k slope_k(I_{k-1})``, ``I_k`` the image of [lo, hi] through ops 1..k
  (chain rule; each op increasing, so ``I_k = [op_k(lo_{k-1}), op_k(hi_{k-1})]``).
* curvature: ``(g o h)'' = g''(h) h'^2 + g'(h) h''``: ``C_k = curv_k(I_{k-1}) S_{k-1}^2 +
  slope_k(I_{k-1}) C_{k-1}``, ``S_k = slope_k(I_{k-1}) S_{k-1}``.
* grad: ``f'(s) = prod_k phi_k``, ``phi_k = op_k'(x_{k-1})``; the float32 grad multiplies ``g``
  by the non-unit factors (scale: ``a`` exact; tanh: ``fl(1 - fl(t^ t^))``, production's
  ``create_softcap_scoremod_bwd``), ``m`` multiplications.  tanh's factor is off by
  ``eps = dt (2|t| + dt) + u (|t| + dt)^2 + eta + u (|phi| + dt (2|t| + dt) + u (|t| + dt)^2 +
  eta) + eta`` with ``dt = TANH_ABS + e_{k-1}/c + dy``; ``|prod phi^ - prod phi| <= prod(|phi| +
  eps) - prod|phi|`` and the m roundings scale by ``(1 + u)^m`` (plus ``eta`` each, carried
  through the later factors): ``|g| ((1 + u)^m prod(|phi| + eps) - prod|phi|) + m eta
  prod max(1, |phi| + eps) (1 + u)^m``.
``value_error`` and ``grad_error`` run these recursions over the whole interval ``[-|s|, |s|]``
(sup magnitudes and slopes over its images, each op being increasing), so each bounds every
score of magnitude at most |s| and is nondecreasing in |s|: the contract of
``numerics.forward_bound.hook_at_ends``, which bounds a hook over an interval by its ends.  For
grad_error, ``prod(|phi| + eps) - prod|phi|`` is nondecreasing in each |phi_k| and eps_k, so the
sups ``Phi_k``, ``E_k`` over the interval give ``(1 + u)^m prod(Phi + E) - prod Phi``.
The hooks are evaluated in float64 (their own rounding, relative 2**-52, is far below the
slack of the u-terms).  Where an intermediate could exceed float32's range the value bound is
infinite (said per element, as the forward bound does for infinite LSEs).

Kernel forms: ``forms["cute"]`` / ``forms["cute_bwd"]`` are built on first access by the same op
table in CuTe-DSL (``cutlass`` imported only then): arithmetic on the SSA values, ``cute.math.tanh
(x, fastmath=True)``.  The ``hbias`` op
reads its table as ``fa4.mods``' ALiBi form reads its slopes.  Not compiled here (no CUDA on the
machine this was written on): the forms are built by the lead's GPU test
(``tests/test_mod_fuzz.py``, ``gpu``-marked).
``fa4.mods.production_kwargs`` hands them to production as it does the library's.

Mask mods
=========
:func:`random_mask` draws a block pattern: per (batch | broadcast, head | broadcast, query
block, key block) a *full*, *partial* or *empty* block, a partial one with a random elementwise
pattern inside (at least one key kept and one dropped where the block has two in-range
elements); every query row keeps at least one key unless asked otherwise.  :func:`mask_mod_of`
makes it a MaskMod reading the dense pattern from an aux tensor (int32, (B|1, H|1, sq, sk)),
so its block sparsity (``numerics.mods.block_sparse_from_mask``) has the drawn full / partial /
empty blocks.

Spec strings: a random score mod is also named by a string (:func:`score_spec`, ``"rand:"``
then its ops), from which :func:`score_mod_from_spec` rebuilds it exactly, so that a case can
carry one.

Varlen
======
:func:`varlen_batches` draws a varlen call with mods: per-sequence lengths (empty sequences,
1x1 ones, queries without keys among them), packed q and k, a random score mod and a random
block mask drawn per sequence (the pattern's batch axis is the sequence: production hands a
mod the sequence as ``batch_idx`` and positions within it, ``fa4.varlen.sequence_mods``).  No
block sparsity: the model of the varlen entry does not model production's varlen layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from fa4.mods import LazyForms
from numerics.forward_bound import MUFU, UNIT_ROUNDOFF
from numerics.mods import BlockSparse, MaskMod, ScoreMod, block_sparse_from_mask

__all__ = [
    "SCORE_OPS",
    "TANH_ABS",
    "ETA",
    "ScoreOp",
    "compose_score_mod",
    "score_spec",
    "parse_score_spec",
    "score_mod_from_spec",
    "random_mask",
    "mask_mod_of",
    "mask_cute_form",
    "cute_forms",
    "score_ops",
    "score_mods",
    "mask_mods",
    "block_sparse_mods",
    "SCALE_RANGE",
    "CAP_RANGE",
    "RELPOS_RANGE",
    "HBIAS_STD",
]

SCORE_OPS = ("scale", "hbias", "relpos", "tanh")
#: MUFU.TANH's absolute error (numerics.forward_bound.MUFU, measured on the H200)
TANH_ABS = MUFU["tanh_abs"]
_U = UNIT_ROUNDOFF
#: absolute term per float32 rounding: subnormal results and flush-to-zero (FTZ flushes below
#: 2**-126; numerics.backward_bound uses the same)
ETA = 2.0**-126
_FLT_MAX = float(torch.finfo(torch.float32).max)
#: y* where |tanh y sech^2 y| peaks, and the peak 2 / (3 sqrt 3)
_Y_STAR = math.atanh(1.0 / math.sqrt(3.0))
_G_STAR = 2.0 / (3.0 * math.sqrt(3.0))

#: the multiplier's range: the brief's [1/4, 4] (a temperature-like rescale; larger would only
#: scale the score error, which the bound carries)
SCALE_RANGE = (0.25, 4.0)
#: the tanh cap's range: production tests softcap 15 (FA's own test_flash_attn.py) and models
#: use 30 or 50; 2 is harsh (scores of a few units saturate), 64 nearly linear
CAP_RANGE = (2.0, 64.0)
#: relpos slope per key of distance: ALiBi's slopes are 2**-8h/H <= 1/2; a quarter keeps the
#: bias of 512-key calls at most 128 (scores of that size make the softmax one-hot, still valid)
RELPOS_RANGE = (-0.25, 0.25)
#: the per-head bias table's spread (N(0, HBIAS_STD^2), rounded to float32)
HBIAS_STD = 2.0


def _f32(x: float) -> float:
    """The float32 number nearest ``x`` (a constant both precisions then read exactly)."""
    return float(torch.tensor(x, dtype=torch.float32))


@dataclass(frozen=True)
class ScoreOp:
    """One op of a chain: ``name`` in SCORE_OPS, ``param`` (a float32 number: a, m or c; for
    hbias the aux tensor's offset from the mod's aux_base)."""

    name: str
    param: float = 0.0

    def __post_init__(self):
        if self.name not in SCORE_OPS:
            raise ValueError(f"unknown score op {self.name!r}; accepted: {', '.join(SCORE_OPS)}")
        if self.name == "scale" and not SCALE_RANGE[0] <= self.param <= SCALE_RANGE[1]:
            raise ValueError(f"scale {self.param} outside {SCALE_RANGE} (the derivative bound's premise)")
        if self.name == "tanh" and not self.param > 0:
            raise ValueError(f"tanh cap {self.param} must be > 0 (the op is then increasing)")

    # -- float64 / float32 evaluation (the mod's fn: one rounding per torch op in float32) -------
    def apply(self, x, b, h, q, kv, aux, base):
        if self.name == "scale":
            return x * self.param
        if self.name == "hbias":
            return x + aux[base + int(self.param)].to(x.device)[h].to(x.dtype)
        if self.name == "relpos":
            return x + self.param * (kv - q).to(x.dtype)
        c = self.param
        return c * torch.tanh(x / c)

    def factor(self, x):
        """The derivative at the (same-precision) input ``x``, as the grad form computes it:
        None for the ops whose derivative is 1 (no multiply)."""
        if self.name == "scale":
            return self.param
        if self.name == "tanh":
            t = torch.tanh(x / self.param)
            return 1.0 - t * t
        return None

    # -- bound pieces (float64 tensors) -----------------------------------------------------------
    def slope(self, lo, hi):
        if self.name == "scale":
            return torch.full_like(lo, self.param)
        if self.name != "tanh":
            return torch.ones_like(lo)
        m = torch.where((lo <= 0) & (hi >= 0), torch.zeros_like(lo), torch.minimum(lo.abs(), hi.abs()))
        return 1.0 / torch.cosh(m / self.param) ** 2

    def curv(self, lo, hi):
        if self.name != "tanh":
            return torch.zeros_like(lo)
        c = self.param
        g = lambda y: (torch.tanh(y) / torch.cosh(y) ** 2).abs()  # noqa: E731
        ylo, yhi = lo / c, hi / c
        peak = ((ylo <= _Y_STAR) & (yhi >= _Y_STAR)) | ((ylo <= -_Y_STAR) & (yhi >= -_Y_STAR))
        sup = torch.where(peak, torch.full_like(lo, _G_STAR), torch.maximum(g(ylo), g(yhi)))
        return 2.0 / c * sup

    def rounding(self, m_in, r_out, q, kv):
        """r_op(M, R): the op's own float32 rounding at a computed input (module doc)."""
        if self.name in ("scale", "hbias"):
            return _U * r_out + ETA
        if self.name == "relpos":
            md = (self.param * (kv - q).double()).abs()
            return (_U * md + ETA) * (1 + _U) + _U * r_out + ETA
        c = self.param
        dt = TANH_ABS + (2 * _U + _U * _U) * m_in / c + 2 * ETA
        return c * dt + _U * (r_out + c * dt) + ETA

    def token(self) -> str:
        return self.name if self.name == "hbias" else f"{self.name}:{self.param!r}"


def _chain(ops, s, b, h, q, kv, aux, base):
    x = s
    for op in ops:
        x = op.apply(x, b, h, q, kv, aux, base)
    return x


def _images(op, lo, hi, b, h, q, kv, aux, base):
    return op.apply(lo, b, h, q, kv, aux, base), op.apply(hi, b, h, q, kv, aux, base)


def _value_error(ops, s, b, h, q, kv, aux, base):
    """The value recursion (module doc) run over the whole interval [-|s|, |s|]: its magnitudes
    and slopes are sups over the interval's images, so the result bounds the error at every
    score of magnitude at most |s| and is nondecreasing in |s| (the hooks' contract with
    ``numerics.forward_bound.hook_at_ends``: a max over an interval's ends bounds the interval)."""
    hi = s.double().abs()
    lo = -hi
    e = torch.zeros_like(hi)
    for op in ops:
        lip = op.slope(lo - e, hi + e)
        nlo, nhi = _images(op, lo, hi, b, h, q, kv, aux, base)
        m_in = torch.maximum(lo.abs(), hi.abs()) + e
        r_out = torch.maximum(nlo.abs(), nhi.abs()) + lip * e
        e = lip * e + op.rounding(m_in, r_out, q, kv)
        lo, hi = nlo, nhi
    # past float32's range an intermediate overflows: no finite bound there
    big = torch.maximum(lo.abs(), hi.abs()) + e
    return torch.where(torch.isfinite(big) & (big < _FLT_MAX / 4), e, torch.full_like(e, math.inf))


def _slope_curv(ops, lo, hi, b, h, q, kv, aux, base):
    lo, hi = lo.double(), hi.double()
    s = torch.ones_like(lo)
    c = torch.zeros_like(lo)
    for op in ops:
        sl = op.slope(lo, hi)
        c = op.curv(lo, hi) * s * s + sl * c
        s = sl * s
        lo, hi = op.apply(lo, b, h, q, kv, aux, base), op.apply(hi, b, h, q, kv, aux, base)
    return s, c


def _grad(ops, g, s, b, h, q, kv, aux, base):
    r = g
    x = s
    for op in ops:
        f = op.factor(x)
        if f is not None:
            r = r * f
        x = op.apply(x, b, h, q, kv, aux, base)
    return r


def _grad_error(ops, g, s, b, h, q, kv, aux, base):
    """The grad recursion (module doc) over [-|s|, |s|] as :func:`_value_error`: each factor's
    sup ``Phi_k`` and error sup ``E_k`` over the interval; ``prod(|phi| + eps) - prod|phi|`` is
    nondecreasing in every |phi_k| and eps_k, so ``(1 + u)^m prod(Phi + E) - prod Phi`` bounds it
    at every score of the interval, and grows with |s|."""
    hi = s.double().abs()
    lo = -hi
    e = torch.zeros_like(hi)
    loose = torch.ones_like(hi)
    tight = torch.ones_like(hi)
    carry = torch.ones_like(hi)
    m = 0
    for op in ops:
        if op.name == "scale":
            loose, tight, carry = loose * op.param, tight * op.param, carry * max(1.0, op.param)
            m += 1
        elif op.name == "tanh":
            c = op.param
            mag = torch.maximum(lo.abs(), hi.abs())
            t_sup = torch.tanh((mag + e) / c)
            phi = op.slope(lo - e, hi + e)  # sup sech^2 over the computed arguments' range
            dt = TANH_ABS + e / c + (2 * _U + _U * _U) * (mag + e) / c + 2 * ETA
            sq = dt * (2 * t_sup + dt) + _U * (t_sup + dt) ** 2 + ETA
            eps = sq + _U * (phi + sq) + ETA
            loose, tight = loose * (phi + eps), tight * phi
            carry = carry * torch.clamp(phi + eps, min=1.0)
            m += 1
        lip = op.slope(lo - e, hi + e)
        nlo, nhi = _images(op, lo, hi, b, h, q, kv, aux, base)
        m_in = torch.maximum(lo.abs(), hi.abs()) + e
        r_out = torch.maximum(nlo.abs(), nhi.abs()) + lip * e
        e = lip * e + op.rounding(m_in, r_out, q, kv)
        lo, hi = nlo, nhi
    grow = (1 + _U) ** m
    return g.double().abs() * (grow * loose - tight) + m * ETA * carry * grow


# ----------------------------------------------------------------------------------------------
# CuTe-DSL forms (production's signature), built lazily
# ----------------------------------------------------------------------------------------------


def cute_forms(ops: tuple[ScoreOp, ...], aux_base: int = 0):
    """(score_mod, score_mod_bwd) in CuTe-DSL with production's signatures
    (``utils.create_softcap_scoremod`` / ``create_softcap_scoremod_bwd`` are the model: SSA
    arithmetic, ``cute.math.tanh(., fastmath=True)``, and for the backward ``g * (1 - t * t)``).
    The op order and operations are those of :meth:`ScoreOp.apply` / :meth:`ScoreOp.factor`.
    hbias reads its table as ``fa4.mods``' ALiBi form reads its slopes (the head index through a
    one-element Int32 fragment, the value through a one-element fragment of the table's type)."""
    import cutlass
    import cutlass.cute as cute

    def head_value(table, head_idx):
        h_frag = cute.make_rmem_tensor(1, cutlass.Int32)
        h_frag.store(head_idx)
        v_frag = cute.make_rmem_tensor(1, table.element_type)
        v_frag[0] = table[h_frag[0]]
        return v_frag.load().to(cutlass.Float32)

    # plain Python run at trace time (the DSL rewrites only the @cute.jit bodies' control flow):
    # the chain unrolls into straight-line SSA arithmetic
    def step(x, op, head_idx, q_idx, kv_idx, aux_tensors):
        if op.name == "scale":
            return x * op.param
        if op.name == "hbias":
            return x + head_value(aux_tensors[aux_base + int(op.param)], head_idx)
        if op.name == "relpos":
            return x + op.param * (kv_idx - q_idx).to(cutlass.Float32)
        return op.param * cute.math.tanh(x / op.param, fastmath=True)

    def forward(x, head_idx, q_idx, kv_idx, aux_tensors):
        for op in ops:
            x = step(x, op, head_idx, q_idx, kv_idx, aux_tensors)
        return x

    def backward(r, x, head_idx, q_idx, kv_idx, aux_tensors):
        for op in ops:
            if op.name == "scale":
                r = r * op.param
            elif op.name == "tanh":
                t = cute.math.tanh(x / op.param, fastmath=True)
                r = r * (1.0 - t * t)
            x = step(x, op, head_idx, q_idx, kv_idx, aux_tensors)
        return r

    @cute.jit
    def score_mod(scores, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return forward(scores, head_idx, q_idx, kv_idx, aux_tensors)

    @cute.jit
    def score_mod_bwd(grad_out, scores, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return backward(grad_out, scores, head_idx, q_idx, kv_idx, aux_tensors)

    return score_mod, score_mod_bwd


# ----------------------------------------------------------------------------------------------
# building score mods
# ----------------------------------------------------------------------------------------------


class _Forms(LazyForms):
    """``fa4.mods.LazyForms`` whose ``in`` reads the declared keys: Mapping's default
    ``__contains__`` looks the key up, which would build (and import cutlass) to answer."""

    def __contains__(self, key) -> bool:
        return any(k == key for k in self)


def _forms(ops: tuple[ScoreOp, ...], aux_base: int):
    """The chain's kernel forms, each compiled on first access (``fa4.mods.LazyForms``)."""
    built: dict = {}

    def get(i: int):
        if not built:
            built["pair"] = cute_forms(ops, aux_base)
        return built["pair"][i]

    return _Forms({"cute": lambda: get(0), "cute_bwd": lambda: get(1)})


def compose_score_mod(
    ops, *, heads_q: int, aux_base: int = 0, seed: int = 0, device="cpu"
) -> tuple[ScoreMod, list[torch.Tensor]]:
    """The ScoreMod of the chain ``ops`` (ScoreOp, applied first to last) and its aux tensors
    (one float32 (heads_q,) table per hbias op, N(0, HBIAS_STD^2) from ``seed``, to sit at
    ``aux_base``...).  fn, grad and the four bound hooks per the module doc."""
    ops = list(ops)
    if not ops:
        raise ValueError("a score mod needs at least one op")
    aux, placed = [], []
    for i, op in enumerate(ops):
        if op.name == "hbias":
            g = torch.Generator().manual_seed((int(seed) * 1_000_003 + 17 * i + 5) % (1 << 63))
            aux.append((torch.randn(heads_q, generator=g, dtype=torch.float64) * HBIAS_STD).float().to(device))
            op = ScoreOp("hbias", float(len(aux) - 1))
        placed.append(op)
    ops = tuple(placed)
    base = aux_base

    def fn(s, b, h, q, kv, a):
        return _chain(ops, s, b, h, q, kv, a, base)

    def grad(g, s, b, h, q, kv, a):
        return _grad(ops, g, s, b, h, q, kv, a, base)

    def value_error(s, b, h, q, kv, a):
        return _value_error(ops, s, b, h, q, kv, a, base)

    def slope(lo, hi, b, h, q, kv, a):
        return _slope_curv(ops, lo, hi, b, h, q, kv, a, base)[0]

    def curvature(lo, hi, b, h, q, kv, a):
        return _slope_curv(ops, lo, hi, b, h, q, kv, a, base)[1]

    def grad_error(g, s, b, h, q, kv, a):
        return _grad_error(ops, g, s, b, h, q, kv, a, base)

    spec = score_spec(ops)
    mod = ScoreMod(
        spec,
        fn,
        grad,
        value_error,
        slope,
        grad_error,
        curvature,
        aux_base=aux_base,
        forms=_forms(ops, aux_base),
        params={"ops": [op.token() for op in ops], "seed": seed},
        per_head=any(op.name == "hbias" for op in ops),
    )
    return mod, aux


def score_spec(ops) -> str:
    """The chain's name: ``rand:`` and its ops, comma-separated (``scale:0.5``, ``hbias``,
    ``relpos:-0.0625``, ``tanh:15.0``), which :func:`parse_score_spec` reads back."""
    return "rand:" + ",".join(op.token() for op in ops)


def parse_score_spec(spec: str) -> tuple[ScoreOp, ...]:
    """The ops of a :func:`score_spec` string; ValueError naming what is wrong."""
    if not spec.startswith("rand:") or spec == "rand:":
        raise ValueError(f"a random score mod spec is 'rand:' then ops ({', '.join(SCORE_OPS)}); got {spec!r}")
    ops = []
    for tok in spec[5:].split(","):
        name, _, val = tok.partition(":")
        if name == "hbias" and not val:
            ops.append(ScoreOp("hbias"))
            continue
        try:
            x = float(val)
        except ValueError:
            raise ValueError(f"{spec!r}: op {tok!r} needs a number after ':'") from None
        if _f32(x) != x:
            raise ValueError(f"{spec!r}: {x!r} is not a float32 number (the op's constant must be one)")
        ops.append(ScoreOp(name, x))
    return tuple(ops)


def score_mod_from_spec(spec: str, *, heads_q: int, aux_base: int = 0, seed: int = 0, device="cpu"):
    """:func:`compose_score_mod` of a spec string: the same mod for the same (spec, seed)."""
    return compose_score_mod(parse_score_spec(spec), heads_q=heads_q, aux_base=aux_base, seed=seed, device=device)


# ----------------------------------------------------------------------------------------------
# random masks
# ----------------------------------------------------------------------------------------------


def random_mask(
    *,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    block_size: tuple[int, int],
    seed: int,
    per_head: bool = True,
    per_batch: bool = False,
    weights: tuple[float, float, float] = (1.0, 1.0, 1.0),
    density: float = 0.5,
    empty_rows: bool = False,
) -> torch.Tensor:
    """Bool (B, H, seqlen_q, seqlen_k), B = batch if per_batch else 1, H = heads if per_head else
    1: each block (block_size) drawn full / partial / empty with relative ``weights``, a partial
    one kept elementwise with probability ``density`` and holding at least one kept and one
    dropped key (where it has two in-range elements).  Unless ``empty_rows``, a query row left
    with no key gets one (the key at its bottom-right-aligned position, clamped), which may turn
    its block partial: :func:`numerics.mods.block_sparse_from_mask` classifies the result."""
    bq, bk = block_size
    g = torch.Generator().manual_seed(int(seed))
    nb, nh = (batch if per_batch else 1), (heads if per_head else 1)
    nq, nk = -(-seqlen_q // bq), -(-seqlen_k // bk)
    w = torch.tensor(weights, dtype=torch.float64)
    state = torch.multinomial(w, nb * nh * nq * nk, replacement=True, generator=g).view(nb, nh, nq, nk)
    inner = torch.rand(nb, nh, nq * bq, nk * bk, generator=g) < density
    blk = state.repeat_interleave(bq, dim=2).repeat_interleave(bk, dim=3)
    mask = (blk == 0) | ((blk == 1) & inner)
    mask = mask[:, :, :seqlen_q, :seqlen_k].clone()
    for bi in range(nb):  # a partial block keeps one key and drops one (else it would be full or empty)
        for hi in range(nh):
            for i, j in (state[bi, hi] == 1).nonzero().tolist():
                r0, r1 = i * bq, min((i + 1) * bq, seqlen_q)
                c0, c1 = j * bk, min((j + 1) * bk, seqlen_k)
                n = (r1 - r0) * (c1 - c0)
                if n < 2:
                    continue
                a, z = torch.randperm(n, generator=g)[:2].tolist()
                w_ = c1 - c0
                mask[bi, hi, r0 + a // w_, c0 + a % w_] = True
                mask[bi, hi, r0 + z // w_, c0 + z % w_] = False
    if not empty_rows:
        rows = torch.arange(seqlen_q)
        key = (rows + seqlen_k - seqlen_q).clamp(0, seqlen_k - 1)
        lonely = ~mask.any(dim=-1)
        mask[..., rows, key] |= lonely
    return mask


def mask_mod_of(pattern: torch.Tensor, *, aux_base: int = 0, name: str = "random_blocks", device="cpu"):
    """(MaskMod keeping ``pattern[b, h, q, kv]``, [the pattern as int32 aux tensor]): B or H
    of size 1 broadcast (index 0 whatever the call's index; a static choice, not a branch on
    values, so the function also runs under flex_attention's vmap).  Its CuTe form
    (:func:`mask_cute_form`) is built on first access."""
    if pattern.dim() != 4:
        raise ValueError(f"a mask pattern is (B|1, H|1, seqlen_q, seqlen_k); got shape {tuple(pattern.shape)}")
    table = pattern.to(torch.int32).to(device)
    per_b, per_h = table.shape[0] > 1, table.shape[1] > 1
    sq, sk = table.shape[2], table.shape[3]
    a = aux_base

    def fn(b, h, q, kv, aux):
        t = aux[a].to(q.device)
        return t[b * per_b, h * per_h, q, kv] != 0

    params = {"shape": list(table.shape), "per_batch": per_b}
    forms = _Forms({"cute": lambda: mask_cute_form(a, per_b, per_h, sq - 1, sk - 1)})
    return MaskMod(name, fn, aux_base=a, forms=forms, params=params, per_head=per_h), [table]


def mask_cute_form(index: int, per_b: bool, per_h: bool, last_q: int, last_kv: int):
    """The random block mask in CuTe-DSL, production's mask_mod signature: one int32 read of
    ``aux_tensors[index][b, h, q, kv]`` (b, h = 0 where broadcast), nonzero = kept.  Written as
    ``fa4.mods``' document form reads its aux tensors (the first lane's indices, the query and
    key clamped into the sequence: SM90's ``Mask.apply_mask`` wraps a mask mod's indices only
    on the block that masks seqlen_k, so rows past seqlen_q of a last query block reach the mod
    unwrapped; their results are discarded, the clamp keeps the read in bounds)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils as fa_utils

    bm, hm = int(per_b), int(per_h)

    @cute.jit
    def random_block_mask_mod(batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        table = aux_tensors[index]
        qi = cutlass.min(q_idx[0], cutlass.Int32(last_q))
        ki = cutlass.min(kv_idx[0], cutlass.Int32(last_kv))
        kept = fa_utils.scalar_to_ssa(table[batch_idx[0] * bm, head_idx[0] * hm, qi, ki], cutlass.Int32)
        return kept != fa_utils.scalar_to_ssa(0, cutlass.Int32)

    return random_block_mask_mod


# ----------------------------------------------------------------------------------------------
# Hypothesis strategies
# ----------------------------------------------------------------------------------------------


def _f32_in(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False).map(_f32)


def _op():
    return st.one_of(
        st.builds(ScoreOp, st.just("scale"), _f32_in(*SCALE_RANGE)),
        st.just(ScoreOp("hbias")),
        st.builds(ScoreOp, st.just("relpos"), _f32_in(*RELPOS_RANGE)),
        st.builds(ScoreOp, st.just("tanh"), _f32_in(*CAP_RANGE)),
    )


def score_ops(*, max_ops: int = 4):
    """A chain of 1..max_ops ops (shrinking toward one scale op)."""
    return st.lists(_op(), min_size=1, max_size=max_ops).map(tuple)


@st.composite
def score_mods(draw, *, heads_q: int, aux_base: int = 0, max_ops: int = 4, device="cpu"):
    """(ScoreMod, aux tensors) of a random chain (:func:`score_ops`, :func:`compose_score_mod`)."""
    ops = draw(score_ops(max_ops=max_ops))
    return compose_score_mod(ops, heads_q=heads_q, aux_base=aux_base, seed=draw(st.integers(0, 2**16)), device=device)


@st.composite
def mask_mods(
    draw, *, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, block_size, aux_base: int = 0, device="cpu"
):
    """(MaskMod, aux tensors) of a random block pattern (:func:`random_mask`): per head or
    broadcast, per batch or broadcast, the block kinds' weights (one kind alone among them, so
    all-full / all-partial / all-empty-but-one-key patterns occur), the density inside partial
    blocks."""
    weights = draw(
        st.sampled_from(
            [
                (1.0, 1.0, 1.0),
                (1.0, 0.0, 0.0),
                (0.0, 1.0, 0.0),
                (1.0, 1.0, 0.0),
                (0.0, 1.0, 1.0),
                (1.0, 0.0, 1.0),
                (0.2, 0.5, 0.3),
            ]
        )
    )
    pat = random_mask(
        batch=batch,
        heads=heads_q,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        block_size=tuple(block_size),
        seed=draw(st.integers(0, 2**16)),
        per_head=draw(st.booleans()),
        per_batch=draw(st.booleans()),
        weights=weights,
        density=draw(st.sampled_from([0.5, 0.1, 0.9])),
    )
    return mask_mod_of(pat, aux_base=aux_base, device=device)


@st.composite
def block_sparse_mods(
    draw, *, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, block_size, aux_base: int = 0, device="cpu"
) -> tuple[MaskMod, list, BlockSparse]:
    """(MaskMod, aux tensors, BlockSparse from it at ``block_size``) (:func:`mask_mods`,
    ``numerics.mods.block_sparse_from_mask``)."""
    mm, aux = draw(
        mask_mods(
            batch=batch,
            heads_q=heads_q,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            block_size=block_size,
            aux_base=aux_base,
            device=device,
        )
    )
    full_aux = [None] * aux_base + aux
    bs = block_sparse_from_mask(
        mm,
        batch=batch,
        heads=heads_q,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        block_size=tuple(block_size),
        aux=full_aux,
        device=device,
    )
    return mm, aux, bs


@st.composite
def varlen_batches(draw, *, max_sequences: int = 4, max_len: int = 48, device="cpu") -> dict:
    """A varlen call with mods (module doc, "Varlen"): ``q`` (total_q, hq, d), ``k``, ``v``
    (total_k, hk, d) bfloat16, ``kw`` (``cu_seqlens_q`` / ``_k``, ``max_seqlen_q`` / ``_k``,
    ``score_mod``, ``mask_mod``, ``aux_tensors``: the score mod's from 0, the mask's pattern
    last), ``seqlens`` (per sequence (seqlen_q, seqlen_k)) and ``pattern``: the mask's (sequences,
    H|1, max_seqlen_q, max_seqlen_k) bool pattern, row i sequence i's (drawn per sequence, so a
    mod reading another sequence's row reads another mask).  Lengths shrink toward one short
    sequence; 0-length queries or keys and 1x1 sequences are drawn."""
    n = draw(st.integers(1, max_sequences))
    length = st.one_of(st.just(0), st.just(1), st.integers(2, max_len))
    seqlens = [(draw(length), draw(length)) for _ in range(n)]
    hk = draw(st.sampled_from([1, 2]))
    hq = hk * draw(st.sampled_from([1, 2]))
    d = 64
    sm, sm_aux = draw(score_mods(heads_q=hq, max_ops=3, device=device))
    mq, mk = max(1, max(a for a, _ in seqlens)), max(1, max(b for _, b in seqlens))
    pat = random_mask(
        batch=n,
        heads=hq,
        seqlen_q=mq,
        seqlen_k=mk,
        block_size=(16, 16),
        seed=draw(st.integers(0, 2**16)),
        per_head=draw(st.booleans()),
        per_batch=True,
        density=draw(st.sampled_from([0.5, 0.1, 0.9])),
    )
    mm, mm_aux = mask_mod_of(pat, aux_base=len(sm_aux), device=device)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    tq, tk = sum(a for a, _ in seqlens), sum(b for _, b in seqlens)
    q, k, v = (
        torch.randn(t, h, d, generator=g).to(torch.bfloat16).to(device) for t, h in ((tq, hq), (tk, hk), (tk, hk))
    )
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    kw = {
        "cu_seqlens_q": cu([a for a, _ in seqlens]).to(device),
        "cu_seqlens_k": cu([b for _, b in seqlens]).to(device),
        "max_seqlen_q": mq,
        "max_seqlen_k": mk,
        "score_mod": sm,
        "mask_mod": mm,
        "aux_tensors": [*sm_aux, *mm_aux],
    }
    return {"q": q, "k": k, "v": v, "kw": kw, "seqlens": seqlens, "pattern": pat}
