r"""Per-element error bound of the FA4 forward pass: ``forward_error_bound(q, k, v, numerics)``.

Bounds |out - exact| and |lse - exact| for the computation ``fa4.model`` performs with the given
``FA4Numerics`` (default: production SM100 for the inputs), evaluated from the inputs and FP64
intermediates.  The hardware approximations are bounded by their exhaustive H200 measurement
(``MUFU``; the model's correctly rounded stand-ins are within these too), so the bound also
covers the production kernel whose numerics the knobs describe, whatever order its tensor cores
sum in.

Notation, for one query row (index i dropped), visible keys j = 1..n, output column c:
``u = 2**-24``; ``gamma(m) = m u / (1 - m u)``; ``s_j`` the exact logit in natural units
(``scale * q.k_j``, ``softcap * tanh(scale * q.k_j / softcap)``, or a score_mod's
``f(scale * q.k_j)``); ``m`` the row max of s;
``p_j = 2**((s_j - m) log2 e + max_offset)`` ("P units": the kernel's P when its reference max
equals m; by (R2) of ``numerics.bounds`` the denominator is >= 2**max_offset in these units,
so fixed absolute errors weigh most here); ``o = sum p_j v_j / sum p_j`` (+ sink) the exact output.

1. Score.  The float32 dot of d exactly representable products, summed in any order, is within
   ``E_dot = gamma(d) sum_k |q_k k_jk|`` of q.k (Higham, Accuracy and Stability, 3.1); the model's
   single rounding is a special case.  The tensor cores do not round to nearest: per k16
   instruction they truncate the m <= 16 products and the accumulator C to multiples of
   ``2**(emax - 25)`` and truncate the exact sum to float32 (``numerics.tensor_core``, measured on
   the H200).  Since ``2**emax <= max |term|`` (a product's significand is >= 1), one instruction
   errs by at most ``(m + 1) 2**-25 max|term| + 2**-23 |sum| <= ((m + 1)/2 + 2) u sum|terms|``,
   and K = m_1 + ... products over ceil(K/16) instructions by at most ``sum_i ((m_i + 1)/2 + 2) u``
   times the running sum of |terms| (first order), which is below ``gamma(K) sum|terms|`` for
   every K >= 8 (K = 8: 6.5 u against 8 u; K = 16: 10.5 u against 16 u; then 10.5 u per 16).  So
   the bound covers production's tensor cores for every head dim FA4 accepts (>= 8), and step 6's
   gamma for the P V sums likewise.
   Score mods (softcap included: production's softcap flag *is* the score_mod
   ``utils.create_softcap_scoremod``, here :func:`softcap_score_mod`).  The kernel keeps the
   scale apart (``utils.compute_softmax_scale_log2``): ``s^ = fl(fl32(q.k) scale32)``
   (``softmax.py`` ``apply_score_mod_inner``), within ``e_pre = e_a + u (|q.k| scale + e_a)``,
   ``e_a = E_dot scale32 + |q.k| |scale32 - scale|``, of ``s = scale q.k``; then the mod's
   float32 form ``f^ = fl32(f)(s^)``, and the exponent uses ``sl2 = fl32(log2 e)`` on f^ in
   natural units.  By the mean value theorem on ``I = [s - e_pre, s + e_pre]``:
   ``|f^ - f(s)| <= |f^ - f(s^)| + |f(s^) - f(s)| <= value_error(s^) + sup_I |f'| e_pre``,
   with the mod's hooks ``slope(I) >= sup_I |f'|`` and ``value_error`` (its own float32
   rounding at a float32 argument), which is taken as ``max(value_error(s - e_pre),
   value_error(s + e_pre))`` (:func:`hook_at_ends`: exact for the quasi-convex hooks the
   contract asks for), plus 2**-126 for a flushed result (:func:`mod_score`).  A hook that is
   None makes the score error +inf wherever the mod applies (every visible key): those rows'
   bounds are +inf, as for infinite LSEs.  Softcap's hooks: ``s / cap`` (div.rn, or a
   multiply by fl(1/cap): relative 2u + u^2), MUFU.TANH (absolute ``TANH_ABS``), tanh's slope
   ``sech^2`` at the quotient's nearest value, the FMUL by cap (:func:`softcap_value_error`);
   ``slope = sech^2`` at the interval's least |s| (:func:`softcap_slope`).
2. Exponent.  The kernel computes ``t_j = fma(s^_j, sl2, fma(-m_ref, sl2, offset))`` with
   ``sl2 = fl32(fl32(scale) fl32(log2 e))``.  A shift common to the row cancels in the output,
   so only the j-dependent part of the error counts:
   ``E_j = E_dot sl2 + |q.k_j - q.k_max| |sl2 - scale log2 e| + u |t_j|`` (log2 units), with
   ``|t_j| <= (s_j - m) log2 e + threshold + offset + 1`` (the reference max lags by at most the
   threshold).
3. exp2.  Relative error ``eps_j``: MUFU.EX2 (``EX2_REL``) or the proven polynomial bound
   (``ex2_error_bound``) on the columns ``j mod tile_n`` production emulates.  Results below
   2**-126 are flushed (hardware) or wrongly scaled (polynomial): absolute error ``alpha_j <=
   2**-126`` where ``log2 p_j + E_j < -125``.  So ``P^_j = p_j (1 + eta_j) + a_j`` with
   ``|eta_j| <= 2**E_j (1 + eps_j) - 1``, ``|a_j| <= alpha_j``.
4. Cast of P to p_dtype (round to nearest even): ``P~_j = P^_j (1 + rho_j) + sigma_j``,
   ``|rho_j| <= u_p`` (the format's unit roundoff), ``|sigma_j| <= min_subnormal_p / 2``; where
   P can exceed the format's largest value (an unsafe threshold+offset) saturation adds
   ``rho_j <= 1 - max_p / (p_j 2**threshold (1 + eta_j))``.
5. Numerator and denominator.  With ``N = sum P~_j v_j`` and ``D~ = sum P^_j`` (+ the sink term
   ``p_s (1 + eta_s)``, which enters D only), using ``sum p_j (v_j - o) - o p_s = 0``:
   ``|N - o D~| <= sum p_j|eta_j|(|v_j|+|o|) + sum alpha_j(|v_j|+|o|)
   + sum (p_j(1+|eta_j|)+alpha_j) rho_j |v_j| + sum sigma_j |v_j| + |o| p_s |eta_s|``, and
   ``D~ >= D_low = sum p_j (1 - |eta_j|) - sum alpha_j + p_s (1 - |eta_s|)``; so
   ``B1 = |N - o D~| / D_low`` bounds ``|N/D~ - o|``.
6. float32 accumulation.  The row sum and each O column are sums of n + n_blocks terms and
   rescalings by the same float32 acc_scale (whose own error cancels between them): relative
   ``gamma(n + n_blocks + 2)`` for D, ``gamma(...) sum P~|v|`` absolute for O.  The reciprocal
   (MUFU.RCP, ``RCP_REL``) and the product add ``kappa = (1+RCP_REL)(1+u)/(1-gamma) - 1``:
   ``B2 = (|o| + B1) kappa + gamma S_abs / D_low (1 + kappa)``.
7. Output cast: ``|out - o| <= B + u_out (|o| + B) + min_subnormal_out / 2`` with B = B1 + B2.

LSE.  The kernel computes ``ln2_f32 * fma(m_ref, sl2, fl(lg2(D^) - offset))``; the m_ref*sl2
term equals the one inside the exponents, so the row shift cancels again, leaving the full
(not j-relative) exponent errors ``E'_j = E_dot sl2 + |q.k_j| |sl2 - scale log2 e| + u |t_j| +
u (|m| sl2 + threshold + offset + 1)``, the relative error of D, lg2.approx (``LG2_REL`` |L| for
|L| >= 1, ``LG2_ABS`` otherwise), two roundings and ln2_f32; where D's relative error bound
reaches 1 (D may be 0: an unbounded score error, e.g. a score_mod without hooks) the LSE bound
is +inf.  Rows with no visible key have an
exact output (0) and LSE (-inf, or the sink up to its few roundings).

Mask mods and block sparsity (``numerics.mods.visibility``) only change which keys are visible,
per batch and head: every sum above runs over the visible keys of the row, so the bound
evaluates with a (B|1, H|1, sq, sk) visibility (the flags intersected with the mods:
``numerics.reference.call_visibility``) and nothing else changes.  The model's visit order under
block sparsity (partial blocks first, each list from its last entry) is one order of the sums,
which the bound covers for any order.  docs/mods.md "Bounds with mods" gives the whole derivation.

Inputs that are not finite give an infinite bound where they can reach (the model's NaN
semantics are audited separately).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from numerics.bounds import ex2_error_bound
from numerics.call import AttentionCall
from numerics.fp import format_of
from numerics.fp import to_f32 as _f32
from numerics.mods import ScoreMod, index_grid
from numerics.reference import apply_score_mod, attention_reference, call_visibility
from numerics.tiles import split_key_masks

__all__ = [
    "forward_error_bound",
    "split_error_bound",
    "MUFU",
    "mod_score",
    "softcap_score_mod",
    "softcap_value_error",
    "softcap_slope",
    "softcap_curvature",
    "softcap_grad_error",
    "hook_at_ends",
    "score_product_error",
]

#: MUFU accuracy measured over all 2**32 float32 inputs on the H200 (reports/fidelity,
#: ``fa4-audit fidelity --mufu``), rounded up: ex2 relative 1.4584e-7; lg2 absolute 7.778e-6
#: overall, relative 2.2925e-7 where |log2 x| >= 1; rcp relative 9.829e-8; tanh absolute 7.984e-6.
#: Blackwell's MUFU may differ: re-measure there before trusting SM100 runs of production.
MUFU = {"ex2_rel": 1.46e-7, "lg2_abs": 7.78e-6, "lg2_rel": 2.3e-7, "rcp_rel": 9.83e-8, "tanh_abs": 7.99e-6}
#: float32's unit roundoff u (round to nearest), the u of every formula here and in ``numerics.backward_bound``
UNIT_ROUNDOFF = 2.0**-24
_U = UNIT_ROUNDOFF


def gamma(m: torch.Tensor | float):
    """Higham's ``gamma(m) = m u / (1 - m u)`` (Accuracy and Stability, 3.1): the relative error
    bound of a float32 sum or dot product of m terms in any order.  Public: the backward bound
    (``numerics.backward_bound``) bounds its float32 sums with it too."""
    return m * _U / (1 - m * _U)


def dot_products(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(dot, e_dot, v64): q.k_j in float64, step 1's ``E_dot = gamma(d) sum_k |q_k k_jk|``, and
    v in float64 with the kv heads repeated to the query heads.  Public: the backward bound
    (``numerics.backward_bound``) starts from the same S and its error."""
    d, hq, hk = q.shape[3], q.shape[2], k.shape[2]
    rep = hq // hk
    q64 = q.double()
    k64 = k.double().repeat_interleave(rep, dim=2)
    v64 = v.double().repeat_interleave(rep, dim=2)
    dot = torch.einsum("bihd,bjhd->bhij", q64, k64)
    e_dot = gamma(d) * torch.einsum("bihd,bjhd->bhij", q64.abs(), k64.abs())
    return dot, e_dot, v64


#: float32's smallest normal: a float32 result below it may be flushed to zero (FTZ), an
#: absolute error of at most this much
TINY32 = 2.0**-126
#: a relative error of a quotient ``x / c`` computed as ``div.rn`` (one rounding, production's
#: softcap, ``fa4.primitives.div_rn``) or as ``x * fl(1/c)`` (two: torch on CUDA, a compiler
#: with fast division): ``(1 + u)^2 - 1``
_DIV_REL = 2 * _U + _U * _U


def hook_at_ends(hook, lo, hi, *idx):
    """A value_error or grad_error hook evaluated for every float32 point of [lo, hi]:
    ``max(hook(lo), hook(hi))``.  The bound knows the kernel's float32 score only to within
    [lo, hi]; the hooks' contract (docs/mods.md "Bounds with mods") is that this maximum bounds the
    hook over the interval, which holds for every hook that is quasi-convex in s (u |s + bias|,
    or any function nondecreasing in |s|)."""
    return torch.maximum(hook(lo, *idx), hook(hi, *idx))


def mod_score(dot, e_dot, scale: float, scale32: float, score_mod, aux_tensors, *, rows=None):
    """The score_mod step (module doc, step 1 with a score_mod): ``(s, e_pre, f, e_post)``.

    ``s = scale * q.k`` the exact pre-mod score (natural units); the kernel's float32 score is
    ``s^ = fl(fl32(q.k) * scale32)`` (``apply_score_mod_inner``: ``score_tensor * softmax_scale``),
    within ``e_pre = e_a + u (|q.k| scale + e_a)``, ``e_a = E_dot scale32 + |q.k| |scale32 -
    scale|`` (the dot's error, the scale's float32 rounding, then the FMUL's rounding of
    ``|a^ scale32| <= |q.k| scale + e_a``).  ``f = fn(s)`` in float64; the kernel's ``f^ =
    fl32(fn)(s^)`` obeys ``|f^ - f(s)| <= |f^ - f(s^)| + |f(s^) - f(s)| <= value_error +
    slope e_pre + 2**-126`` (the mean value theorem on [s - e_pre, s + e_pre]; the value_error
    hook at the interval's ends, :func:`hook_at_ends`; 2**-126 for a flushed result) = ``e_post``.
    A hook that is None makes e_post +inf (a mod without bounds is unbounded, element by
    element); a zero e_pre makes the slope term 0 whatever the slope (s^ = s exactly).
    ``dot``, ``e_dot``: (batch, heads_q, rows, seqlen_k); ``rows``: the query indices of dim 2.
    Public: the backward bound recomputes P through it and needs e_pre for ``f'``."""
    s = dot * scale
    e_a = e_dot * scale32 + dot.abs() * abs(scale32 - scale)
    e_pre = dot.abs().mul_(_U * scale).add_(e_a, alpha=1 + _U)  # e_a + u (|q.k| scale + e_a)
    del e_a  # full-size float64 tensors: the bound holds as few at once as it can
    f = apply_score_mod(s, score_mod, aux_tensors, rows=rows)
    if score_mod.slope is None or score_mod.value_error is None:
        return s, e_pre, f, torch.full_like(s, math.inf)

    b, h, i, j = s.shape
    idx = (*index_grid(b, h, i, j, rows=rows, device=s.device), aux_tensors)
    lo, hi = s - e_pre, s + e_pre
    moved = score_mod.slope(lo, hi, *idx).to(s.dtype) * e_pre
    e_post = torch.where(e_pre > 0, moved, 0.0)  # inf * 0 is no error: s^ = s exactly
    del moved
    e_post = e_post.add_(hook_at_ends(score_mod.value_error, lo, hi, *idx).to(s.dtype)).add_(TINY32)
    return s, e_pre, f, e_post.expand(s.shape)


def step1_score(dot, e_dot, scale: float, scale32: float, l2e: float, *, call: AttentionCall, rows=None):
    """Step 1 (score error) and the exponent's scale: (sl2, |sl2 - ideal|, base, e_score) where
    the ideal exponent is ``base * ideal`` (log2 units) and ``e_score`` the score's error in
    log2 units.  With a score_mod, or the softcap flag (production's softcap *is* a score_mod,
    ``utils.create_softcap_scoremod``; here :func:`softcap_score_mod`), the kernel keeps the scale
    apart (``utils.compute_softmax_scale_log2``): ``base = f(s)`` in natural units, ``sl2 =
    fl32(log2 e)``, and the error is :func:`mod_score`'s.  Public: the backward bound recomputes
    P from the same scores (its step 4(b)).  ``call``: its softcap, score_mod and aux_tensors
    (scalars bound)."""
    score_mod, aux_tensors = call.score_mod, call.aux_tensors
    if call.softcap > 0:
        score_mod, aux_tensors = softcap_score_mod(call.softcap), None
    if score_mod is not None:  # step 1, score_mod branch: exponent fma(f^, fl32(log2 e), ...)
        sl2 = _f32(l2e)
        _s, _e_pre, f, e_post = mod_score(dot, e_dot, scale, scale32, score_mod, aux_tensors, rows=rows)
        return sl2, abs(sl2 - l2e), f, e_post * sl2
    sl2 = _f32(scale32 * _f32(l2e))
    d_sl2 = abs(sl2 - scale * l2e)
    base = dot  # exponent = dot * scale * log2e (ideal)
    e_score = e_dot * sl2
    return sl2, d_sl2, base, e_score


def score_product_error(products: int) -> float:
    """The relative error, against step 1's rounded constant ``sl2``, of a base-2 score formed by
    ``products`` chained float32 multiplies (docs/peers.md, "The bound"): ``y = fl(fl(a s32) l32)``
    equals ``a sl2 (1 + theta)`` with ``|theta| <= (1+u)^k / (1-u)^(k-1) - 1`` (two roundings, and
    the unrounded constant ``s32 l32 = sl2 / (1 + delta)``, ``|delta| <= u``); 0 for none (FA4's FFMA
    rounds only the difference ``t_j``, step 2's ``u |t_j|``).  With a score_mod the scale's product
    is already in :func:`mod_score`'s ``e_pre``: the caller passes one product fewer."""
    if products < 0:
        raise ValueError(f"score_products must be >= 0, got {products}")
    return 0.0 if products == 0 else (1 + _U) ** products / (1 - _U) ** (products - 1) - 1


def _sech2(x):
    """sech^2 x in float64, without cancellation (cosh = inf past 710 gives the limit 0)."""
    return torch.cosh(x).pow(-2)


#: x sech^2(x (1 - _DIV_REL)) rises for x below this (its peak is at 0.7717 / (1 - _DIV_REL),
#: where 2 x tanh x = 1) ...
_X_RISE = 0.77
#: ... and never exceeds this (max_z z sech^2 z = 0.44787 at z = 0.7717, over 1 - _DIV_REL)
_XSECH2_MAX = 0.4479


def _tanh_input_error(x):
    """How far tanh moves when softcap's quotient ``x = |s| / cap`` is computed in float32,
    made nondecreasing in x: ``sech^2(x (1 - _DIV_REL)) (_DIV_REL x + 2**-126)`` (tanh's slope
    at the quotient's nearest possible value times the quotient's error) below ``_X_RISE``,
    where it rises, and its maximum over all x past it."""
    rising = _sech2(x * (1 - _DIV_REL)) * (_DIV_REL * x + TINY32)
    return torch.where(x < _X_RISE, rising, torch.full_like(x, _XSECH2_MAX * _DIV_REL + TINY32))


def softcap_value_error(s, cap: float):
    """value_error hook of the softcap score_mod ``cap * tanh(s / cap)`` at a float32 score s
    (``utils.create_softcap_scoremod``: ``s / cap`` div.rn, ``cute.math.tanh(fastmath=True)`` =
    MUFU.TANH, ``cap * t`` FMUL; ``cap`` representable in float32).  With x = s / cap: the
    quotient ``x^ = x (1 + d)``, ``|d| <= _DIV_REL`` (div.rn, or a multiply by fl(1/cap)), plus
    2**-126 if flushed; tanh moves by at most ``dt`` (:func:`_tanh_input_error`); MUFU.TANH is
    within ``MUFU["tanh_abs"]`` of tanh(x^) (exhaustive H200 measurement; a correctly rounded
    tanh, the CPU model's, is within 2**-24); the FMUL rounds ``u cap |t^|``.  So
    ``|f^ - f| <= cap (TANH_ABS + dt) + u cap (|tanh x| + TANH_ABS + dt)``, nondecreasing in |s|
    (quasi-convex: the contract of :func:`hook_at_ends`)."""
    x = s.abs() / cap
    dt = _tanh_input_error(x)
    tanh_abs = MUFU["tanh_abs"]
    return cap * (tanh_abs + dt) + _U * cap * (torch.tanh(x) + tanh_abs + dt)


def softcap_slope(lo, hi, cap: float):
    """slope hook of the softcap score_mod: sup of ``f' = sech^2(s / cap)`` over [lo, hi], at the
    point of least |s| (0 when the interval straddles it)."""
    a = torch.where((lo <= 0) & (hi >= 0), torch.zeros_like(lo), torch.minimum(lo.abs(), hi.abs()))
    return _sech2(a / cap)


#: atanh(1/sqrt(3)): where |tanh y sech^2 y| peaks, at 2 / (3 sqrt 3)
_Y_PEAK = math.atanh(1 / math.sqrt(3))


def softcap_curvature(lo, hi, cap: float):
    """curvature hook of the softcap score_mod: sup of ``|f''| = (2 / cap) |tanh(y) sech^2(y)|``
    (y = s / cap) over [lo, hi].  ``tanh y sech^2 y`` rises on [0, _Y_PEAK] to 2 / (3 sqrt 3)
    and falls after it, so its sup over |y| in [a, b] is the peak when a <= _Y_PEAK <= b, else
    the value at the end nearer the peak."""
    a = torch.where((lo <= 0) & (hi >= 0), torch.zeros_like(lo), torch.minimum(lo.abs(), hi.abs())) / cap
    b = torch.maximum(lo.abs(), hi.abs()) / cap
    g = lambda y: torch.tanh(y) * _sech2(y)
    peak = torch.full_like(a, 2 / (3 * math.sqrt(3)))
    sup = torch.where(b < _Y_PEAK, g(b), torch.where(a > _Y_PEAK, g(a), peak))
    return 2 / cap * sup


def softcap_grad_error(g, s, cap: float):
    """grad_error hook of the softcap score_mod: a bound on ``|fl32(grad)(g, s) - g f'(s)|`` for
    float32 g (|g| given) and s, production's ``create_softcap_scoremod_bwd``: ``x^ = s / cap``
    (as in :func:`softcap_value_error`), ``t^ = MUFU.TANH(x^)`` within ``et = TANH_ABS + dt`` of
    ``t = tanh x``; ``f^ = 1 - t^ t^`` (one FFMA, or FMUL then FSUB: both covered) within
    ``ef = e2 + u (|t| + et)^2 + u (1 + e2 + u (|t| + et)^2) + 2**-126`` of ``f = sech^2 x``,
    ``e2 = et (2|t| + et) >= |t^2 - t^^2|`` (f <= 1 bounds the last rounding's size); then
    ``fl(g f^)``: ``|g| ef + u |g| (1 + ef)``.  Nondecreasing in |g| and in |s|."""
    x = s.abs() / cap
    et = MUFU["tanh_abs"] + _tanh_input_error(x)
    t = torch.tanh(x)
    sq = _U * (t + et) ** 2
    e2 = et * (2 * t + et)
    ef = e2 + sq + _U * (1 + e2 + sq) + TINY32
    ga = g.abs()
    return ga * ef + _U * ga * (1 + ef)


def softcap_score_mod(cap: float):
    """The softcap flag as a score_mod (production's own form, ``utils.create_softcap_scoremod``
    and ``create_softcap_scoremod_bwd``) with its bound hooks: the forward and backward bounds
    treat ``softcap=cap`` as this mod, so the flag and ``numerics.mod_library``'s softcap mod share
    one derivation.  ``fn``/``grad`` are the mathematical function (float64 here)."""
    cap = float(cap)

    def fn(s, b, h, q, kv, aux):
        return cap * torch.tanh(s / cap)

    def grad(g, s, b, h, q, kv, aux):
        return g * _sech2(s / cap)

    return ScoreMod(
        "softcap_flag",
        fn,
        grad,
        value_error=lambda s, b, h, q, kv, aux: softcap_value_error(s, cap),
        slope=lambda lo, hi, b, h, q, kv, aux: softcap_slope(lo, hi, cap),
        grad_error=lambda g, s, b, h, q, kv, aux: softcap_grad_error(g, s, cap),
        curvature=lambda lo, hi, b, h, q, kv, aux: softcap_curvature(lo, hi, cap),
        params={"cap": cap},
        per_head=False,
    )


def _step2_exponent(base, vis, e_score, d_sl2: float, ideal: float, thr: float, off: float, ninf):
    """Step 2: (m_base, m_safe, rel_exp, t_abs, e_j): the row max of ``base`` over visible keys
    (-inf -> 0 in m_safe), the exact exponent relative to it, the bound on |t_j| and E_j."""
    base_m = torch.where(vis, base, ninf)
    m_base = base_m.amax(-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m_base), m_base, torch.zeros_like(m_base))
    rel_exp = (base - m_safe) * ideal  # <= 0 on visible keys
    t_abs = rel_exp.abs() + thr + off + 1.0
    e_j = e_score + (base - m_safe).abs() * d_sl2 + _U * t_abs  # step 2 (j-dependent part)
    return m_base, m_safe, rel_exp, t_abs, e_j


def _step3_exp2(nm, sk: int, dev, vis, rel_exp, e_j, off: float):
    """Step 3: (eps, p, eta, low, alpha): exp2's relative error per key column, p_j in P units,
    |eta_j|'s bound, the keys whose result may be flushed or wrongly scaled and their alpha_j."""
    cols = torch.arange(sk, device=dev) % nm.tile_n
    emu = nm.emulated_mask().to(dev)[cols]  # which key columns of a tile take the polynomial
    poly = ex2_error_bound(nm.poly_coefficients)
    eps = torch.where(
        emu,
        torch.tensor(poly, device=dev, dtype=torch.float64),
        torch.tensor(MUFU["ex2_rel"], device=dev, dtype=torch.float64),
    )

    p = torch.where(vis, torch.exp2(rel_exp + off), torch.zeros_like(rel_exp))
    eta = torch.where(vis, torch.exp2(e_j) * (1 + eps) - 1, torch.zeros_like(e_j))  # step 3
    low = vis & (torch.log2(p.clamp(min=1e-300)) + e_j < -125)  # may be flushed or wrongly scaled
    eta = torch.where(low, torch.ones_like(eta).clamp(min=eta), eta)
    alpha = torch.where(low, torch.full_like(p, 2.0**-126), torch.zeros_like(p))
    return eps, p, eta, low, alpha


def _step4_cast(p, eta, vis, fmt_p, thr: float):
    """Step 4: (rho, sigma) of the cast of P to p_dtype, saturation included."""
    rho = torch.full_like(p, fmt_p.unit_roundoff)  # step 4
    p_hi = p * 2.0**thr * (1 + eta)
    rho = torch.where(p_hi > fmt_p.max, torch.maximum(rho, 1 - fmt_p.max / p_hi), rho)
    sigma = torch.where(vis, torch.full_like(p, fmt_p.smallest_subnormal / 2), torch.zeros_like(p))
    return rho, sigma


def _sink_terms(learnable_sink, m_base, shape, dev, *, natural: bool, scale: float, l2e: float, thr, off):
    """The sink's term of step 5: (p_s, eta_s), p_s in P units and the bound on |eta_s| (zeros
    without a sink); ``natural``: ``m_base`` is in natural units (softcap, a score_mod), else in
    units of q.k."""
    p_s = torch.zeros(shape, dtype=torch.float64, device=dev)
    eta_s = torch.zeros_like(p_s)
    if learnable_sink is not None:
        sink = learnable_sink.double().view(1, shape[1], 1, 1)
        m_nat = m_base * (1.0 if natural else scale)
        m_nat_safe = torch.where(torch.isfinite(m_nat), m_nat, torch.zeros_like(m_nat))
        p_s = torch.where(torch.isfinite(m_nat), torch.exp2((sink - m_nat_safe) * l2e + off), torch.zeros_like(p_s))
        e_s = (
            sink.abs() * abs(_f32(l2e) - l2e)
            + m_nat_safe.abs() * l2e * 2 * _U
            + 3 * _U * ((sink.abs() + m_nat_safe.abs()) * l2e + thr + off + 1)
        )
        eta_s = torch.exp2(e_s) * (1 + MUFU["ex2_rel"]) - 1
    return p_s, eta_s


def _step5_num_den(p, eta, alpha, rho, sigma, av, ao, p_s, eta_s):
    """Step 5: (b1, d_low): the bound B1 on |N/D~ - o| and the lower bound D_low of D~ (NaN
    where it is not positive)."""
    w1 = p * eta.abs() + alpha
    a_num = (
        torch.einsum("bhij,bjhc->bhic", w1, av)
        + w1.sum(-1, keepdim=True) * ao
        + torch.einsum("bhij,bjhc->bhic", (p * (1 + eta.abs()) + alpha) * rho + sigma, av)
        + ao * p_s * eta_s.abs()
    )  # step 5
    d_low = (p * (1 - eta.abs())).sum(-1, keepdim=True) - alpha.sum(-1, keepdim=True) + p_s * (1 - eta_s.abs())
    d_low = torch.where(d_low > 0, d_low, torch.full_like(d_low, math.nan))
    b1 = a_num / d_low
    return b1, d_low


def _step6_accumulation(p, eta, alpha, rho, sigma, av, ao, b1, d_low, n_vis, nblk: int):
    """Step 6: (gam, b2): gamma of the float32 sums and the bound B2 they and the reciprocal add."""
    gam = gamma(n_vis + nblk + 2)  # step 6
    s_abs = torch.einsum("bhij,bjhc->bhic", (p * (1 + eta.abs()) + alpha) * (1 + rho) + sigma, av)
    kappa = (1 + MUFU["rcp_rel"]) * (1 + _U) / (1 - gam) - 1
    b2 = (ao + b1) * kappa + gam * s_abs / d_low * (1 + kappa)
    return gam, b2


def _step7_output_cast(b1, b2, ao, fmt_o, n_vis):
    """Step 7: the output bound after the cast (0 for rows without a visible key, NaN -> inf)."""
    pre = b1 + b2
    out_b = pre + fmt_o.unit_roundoff * (ao + pre) + fmt_o.smallest_subnormal / 2  # step 7
    empty = (n_vis == 0).expand_as(out_b)
    out_b = torch.where(empty, torch.zeros_like(out_b), out_b)
    out_b = torch.where(torch.isnan(out_b), torch.full_like(out_b, math.inf), out_b)
    return out_b


def _lse_rel_d(e_full, vis, eps, low, p, alpha, p_s, eta_s, gam):
    """LSE: (w, rel_d): the exact denominator in P units (1 where it is 0) and the relative
    error of the kernel's D, with the full exponent errors ``E'_j``."""
    eta_l = torch.where(vis, torch.exp2(e_full) * (1 + eps) - 1, torch.zeros_like(e_full))
    eta_l = torch.where(low, torch.ones_like(eta_l).clamp(min=eta_l), eta_l)
    dd = p.sum(-1, keepdim=True) + p_s
    w = torch.where(dd > 0, dd, torch.ones_like(dd))
    rel_d = ((p * eta_l).sum(-1, keepdim=True) + alpha.sum(-1, keepdim=True) + p_s * eta_s.abs()) / w
    rel_d = rel_d + gam + rel_d * gam
    return w, rel_d


def _lse_bound(w, rel_d, ref_lse, n_vis, learnable_sink, *, hq: int, off: float, l2e: float):
    """LSE: the bound from D's relative error, lg2.approx, the roundings and ln2_f32; rows with
    no visible key: the sink's few roundings, or 0 (LSE -inf exactly); NaN -> inf."""
    log2_d = torch.log2(w)
    lg2_err = torch.where(log2_d.abs() >= 1, MUFU["lg2_rel"] * log2_d.abs(), torch.full_like(log2_d, MUFU["lg2_abs"]))
    # max |log2(1 +- r)| = -log2(1 - r); r >= 1: D may be 0, the LSE unbounded (not a clamp's 996)
    l2_total = torch.where(rel_d < 1, -torch.log2((1 - rel_d).clamp(min=1e-300)), math.inf)
    lse_abs = ref_lse.unsqueeze(-1).abs()
    x_log2 = lse_abs / math.log(2) + off + 1.0
    lse_b = (
        math.log(2) * (l2_total + lg2_err + 2 * _U * x_log2)
        + abs(_f32(math.log(2)) - math.log(2)) * x_log2
        + _U * lse_abs
    )
    lse_b = lse_b.squeeze(-1)
    if learnable_sink is not None:
        only_sink = n_vis.squeeze(-1) == 0
        sink_b = (
            learnable_sink.double().abs().view(1, hq, 1) * (8 * _U + abs(_f32(l2e) * _f32(math.log(2)) - 1))
            + MUFU["lg2_abs"] * math.log(2)
        ).expand_as(lse_b)
        lse_b = torch.where(only_sink, sink_b, lse_b)
    else:
        lse_b = torch.where(n_vis.squeeze(-1) == 0, torch.zeros_like(lse_b), lse_b)
    lse_b = torch.where(torch.isnan(lse_b), torch.full_like(lse_b, math.inf), lse_b)
    return lse_b


def forward_error_bound(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    numerics,
    *,
    call: AttentionCall,
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_splits: int = 1,
    pack_gqa: bool = False,
    key_mask: torch.Tensor | None = None,
    partial: bool = False,
    score_products: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_bound, lse_bound): float64 tensors shaped like the output (b, sq, hq, dv) and the
    LSE (b, hq, sq), bounding |out - exact| and |lse - exact| elementwise (module doc).
    ``reference``: the FP64 ``(out, lse)`` of ``numerics.reference.attention_reference`` for
    these inputs, when the caller has it (computed here otherwise).  ``num_splits`` > 1:
    split-KV and its combine (:func:`split_error_bound`; ``pack_gqa`` moves the splits).
    ``key_mask`` (heads_q, sq, sk) restricts each row to some keys and ``partial`` drops the
    output cast (a split's float32 partial): the bound of one split's partial results.
    ``call``: the call's keywords, its mods included (``numerics.mods``; module doc, "Mods").
    ``score_products``: the float32 products that form a peer's base-2 score before its row max
    is subtracted (0: FA4's FFMA, module doc step 2; 2: the scale and log2 e as two multiplies,
    flex_attention's Triton template and the generic flash-attention kernels:
    :func:`score_product_error`)."""
    call = call.bind_scalars()  # the call's runtime scalars (numerics.mods)
    if num_splits > 1:
        return split_error_bound(
            q,
            k,
            v,
            numerics,
            call=call,
            num_splits=num_splits,
            pack_gqa=pack_gqa,
            reference=reference,
            score_products=score_products,
        )
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    nm = numerics
    fmt_p = format_of(nm.p_dtype or q.dtype)
    fmt_o = format_of(torch.float32 if partial else torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype)
    thr, off = float(nm.rescale_threshold), float(nm.max_offset)
    l2e = math.log2(math.e)
    scale = call.scale(d)
    scale32 = _f32(scale)
    dev = q.device

    dot, e_dot, v64 = dot_products(q, k, v)
    vis = call_visibility(batch=b, heads=hq, seqlen_q=sq, seqlen_k=sk, call=call, device=dev)
    vis = vis.view(1, 1, sq, sk) if vis.dim() == 2 else vis  # (1|B, 1|H, sq, sk)
    if key_mask is not None:
        vis = vis & key_mask.to(dev).view(1, hq, sq, sk)
    ninf = torch.tensor(-math.inf, dtype=torch.float64, device=dev)

    sl2, d_sl2, base, e_score = step1_score(dot, e_dot, scale, scale32, l2e, call=call)
    natural = call.softcap > 0 or call.score_mod is not None  # base in natural units (module doc, step 1)
    if score_products:  # a peer's exponent formed by float32 products (docs/peers.md, "The bound")
        e_score = e_score + score_product_error(score_products - 1 if natural else score_products) * (
            e_score + base.abs() * sl2
        )
    ideal = l2e if natural else scale * l2e  # log2 units per unit of `base`
    m_base, m_safe, rel_exp, t_abs, e_j = _step2_exponent(base, vis, e_score, d_sl2, ideal, thr, off, ninf)
    eps, p, eta, low, alpha = _step3_exp2(nm, sk, dev, vis, rel_exp, e_j, off)
    rho, sigma = _step4_cast(p, eta, vis, fmt_p, thr)
    p_s, eta_s = _sink_terms(
        call.learnable_sink, m_base, (b, hq, sq, 1), dev, natural=natural, scale=scale, l2e=l2e, thr=thr, off=off
    )

    if reference is None:
        reference = attention_reference(q, k, v, call=call, return_lse=True, key_mask=key_mask)
    ref, ref_lse = reference
    o = ref.permute(0, 2, 1, 3)  # (b, h, i, c)
    av = v64.abs()
    ao = o.abs()
    b1, d_low = _step5_num_den(p, eta, alpha, rho, sigma, av, ao, p_s, eta_s)
    n_vis = vis.sum(-1, keepdim=True).to(torch.float64)
    nblk = -(-sk // nm.tile_n)
    gam, b2 = _step6_accumulation(p, eta, alpha, rho, sigma, av, ao, b1, d_low, n_vis, nblk)
    out_b = _step7_output_cast(b1, b2, ao, fmt_o, n_vis)

    # LSE
    e_full = e_score + base.abs() * d_sl2 + _U * t_abs + _U * (m_safe.abs() * sl2 + thr + off + 1.0)
    w, rel_d = _lse_rel_d(e_full, vis, eps, low, p, alpha, p_s, eta_s, gam)
    lse_b = _lse_bound(w, rel_d, ref_lse, n_vis, call.learnable_sink, hq=hq, off=off, l2e=l2e)
    return out_b.permute(0, 2, 1, 3).contiguous(), lse_b


def split_error_bound(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    numerics,
    *,
    call: AttentionCall,
    num_splits: int,
    pack_gqa: bool = False,
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
    score_products: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""(out_bound, lse_bound) of split-KV: each split's float32 partials, then the combine
    (``flash_fwd_combine.py``; ``fa4.varlen.combine``), for any order of its sums.

    Split s of a row sees keys K_s (``numerics.tiles.split_key_masks``; the learnable sink
    enters split 0).  Exactly, its partial output is ``o_s`` (softmax over K_s) and LSE ``L_s``;
    the row's ``L = ln sum_s e^{L_s}`` and ``o = sum_s w_s o_s`` with ``w_s = e^{L_s - L}``.  The
    kernel's partials satisfy ``|O^_s - o_s| <= B_s``, ``|L^_s - L_s| <= beta_s``: the bound
    above on K_s with a float32 "cast" (``partial``).  Empty splits give O = 0, L = -inf exactly.

    Combine: ``t_s = fma(L^_s, l2e_f, -fl(M l2e_f))`` with ``M = max L^_s``; against
    ``(L^_s - M) log2 e`` its error is ``E_s <= u |M| l2e + u |t_s| + |L^_s - M| |l2e_f -
    log2 e|`` (log2 units, each factor taken with a margin of 2**-20).  ``a_s = ex2(t_s)`` (MUFU
    relative ``x``), their float32 sum (``gamma(S)``), the reciprocal (MUFU.RCP or a correctly
    rounded division, both within ``r``) and the product with a_s (u): so ``w^_s = w~_s (1 +
    theta_s)``, ``w~_s = e^{L^_s} / sum_t e^{L^_t}``, ``1 + |theta_s| <= 2**(E_s + E_max) (1 + x) /
    (1 - x) (1 + r)(1 + u) / (1 - gamma(S))``.  And ``w~_s / w_s`` lies within
    ``e^{+-(beta_s + beta_max)}``; so ``w^_s = w_s (1 + phi_s)`` with ``|phi_s| <=
    e^{beta_s + beta_max} (1 + |theta_s|) - 1``.  The output ``O = fl(sum_s w^_s O^_s)`` (FFMAs,
    ``gamma(S)``) then obeys

    ``|O - o| <= sum_s w_s (1 + phi_s) B_s + sum_s w_s phi_s |o_s| + gamma(S) sum_s w_s (1 +
    phi_s) (|o_s| + B_s)``,

    and the cast to the output format adds ``u_out (|o| + that) + min_subnormal / 2``.

    LSE: ``fl(lg2(sum a_s) ln2_f + M)``: the sum's relative error ``2**E_max (1 + x)(1 +
    gamma(S)) - 1``, lg2.approx (``lg2_rel`` |y| or ``lg2_abs``), ``|ln2_f - ln2| |y|``, two
    roundings (u each on |L| + beta_max), and ``beta_max`` from the partial LSEs (``ln sum e^{L^_s}``
    moves by at most max_s beta_s).  Rows where every split is empty: out 0, LSE -inf, bound 0.
    ``score_products``: each split's score as :func:`forward_error_bound` takes it.
    Mods: each split's keys are its share intersected with the mods' visibility (the partial
    bound applies them); the combine does not see the mods."""
    b, sq, hq, d = q.shape
    call = call.bind_scalars()
    rest = replace(call, learnable_sink=None)  # the sink enters split 0 only
    pack = hq // k.shape[2] if pack_gqa else 1
    masks = split_key_masks(
        sq,
        k.shape[1],
        numerics.tile_m,
        numerics.tile_n,
        call.causal,
        call.window_size,
        q.device,
        heads=hq,
        pack=pack,
        num_splits=num_splits,
    )
    parts = []
    for s, m in enumerate(masks):
        part = call if s == 0 else rest
        ref_s = attention_reference(q, k, v, call=part, return_lse=True, key_mask=m)
        ob, lb = forward_error_bound(
            q, k, v, numerics, call=part, reference=ref_s, key_mask=m, partial=True, score_products=score_products
        )
        parts.append((ref_s[0].permute(0, 2, 1, 3), ref_s[1], ob.permute(0, 2, 1, 3), lb))  # (b, h, i, ·)
    if reference is None:
        reference = attention_reference(q, k, v, call=call, return_lse=True)
    o_full, lse_full = reference[0].permute(0, 2, 1, 3), reference[1]
    fmt_o = format_of(torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype)
    out_b, lse_b = _combine_bound(parts, o_full, lse_full, num_splits)
    out_b = out_b + fmt_o.unit_roundoff * (o_full.abs() + out_b) + fmt_o.smallest_subnormal / 2
    empty = torch.isinf(lse_full) & (lse_full < 0)
    out_b = torch.where(empty.unsqueeze(-1), torch.zeros_like(out_b), out_b)
    lse_b = torch.where(empty, torch.zeros_like(lse_b), lse_b)
    nan = lambda t: torch.where(torch.isnan(t), torch.full_like(t, math.inf), t)
    return nan(out_b).permute(0, 2, 1, 3).contiguous(), nan(lse_b)


def _combine_bound(parts, o_full, lse_full, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The combine's part of :func:`split_error_bound` (its docstring), before the output cast:
    ``parts`` per split (o_s (b, h, i, c), L_s (b, h, i), B_s (b, h, i, c), beta_s (b, h, i))."""
    margin = 1 + 2.0**-20
    l2e, l2e_f, ln2 = math.log2(math.e), _f32(math.log2(math.e)), math.log(2)
    fin = lambda t: torch.where(torch.isfinite(t), t, torch.zeros_like(t))
    betas = torch.stack([p[3] for p in parts])  # (S, b, h, i)
    lses = torch.stack([p[1] for p in parts])
    beta_max = betas.amax(0)
    l_max = lses.amax(0)
    m_abs = fin(l_max).abs() + beta_max
    gam = gamma(float(n) + 1)
    x, r = MUFU["ex2_rel"], MUFU["rcp_rel"]
    e = [
        margin
        * (
            _U * m_abs * l2e
            + _U * (fin(lses[s] - l_max).abs() + 2 * beta_max) * l2e
            + (fin(lses[s] - l_max).abs() + 2 * beta_max) * abs(l2e_f - l2e)
        )
        for s in range(n)
    ]
    e_max = torch.stack(e).amax(0)
    out_b = torch.zeros_like(o_full)
    for s, (o_s, l_s, b_s, beta_s) in enumerate(parts):
        theta = 2.0 ** (e[s] + e_max) * (1 + x) / (1 - x) * (1 + r) * (1 + _U) / (1 - gam) - 1
        phi = (torch.exp(beta_s + beta_max) * (1 + theta) - 1).unsqueeze(-1)
        w = torch.exp(l_s - lse_full).unsqueeze(-1)  # 0 for an empty split
        w = torch.where(torch.isnan(w), torch.zeros_like(w), w)
        term = w * (1 + phi) * b_s + w * phi * o_s.abs() + gam * w * (1 + phi) * (o_s.abs() + b_s)
        out_b = out_b + torch.where(w > 0, term, torch.zeros_like(term))
    y = fin(l_max - lse_full).abs() / ln2 + 1.0  # |lg2 of the sum| <= this
    rel = 2.0**e_max * (1 + x) * (1 + gam) - 1
    lg2_err = torch.maximum(MUFU["lg2_rel"] * y, torch.full_like(y, MUFU["lg2_abs"]))
    lse_b = (
        beta_max
        + ln2 * (torch.where(rel < 1, -torch.log2((1 - rel).clamp(min=1e-300)), math.inf) + lg2_err)
        + abs(_f32(ln2) - ln2) * y
        + 2 * _U * margin * (fin(lse_full).abs() + beta_max + y)
    )
    return out_b, lse_b
