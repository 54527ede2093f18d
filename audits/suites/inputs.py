"""Input families for the audit: each deterministic from a seed, each hunting one failure.

``make_inputs(case, device=...)`` builds q, k, v (and the learnable sink) for a
``audits.suites.cases.Case``: values drawn in float64 by the case's family, rounded to the case's
dtype (so the reference sees exactly what the kernel sees), laid out as the case says
(contiguous, or non-contiguous views).  ``FAMILIES`` maps a family name to its one-line purpose.
The learnable sink is placed against each head's largest logit (``SINK_PLACES``: above it,
near it, below it) so that it always carries weight.

Logit-shaping families work through one feature channel: ``q[..., 0] = c`` and
``k[j, 0] = target_j / (scale * c)``, so the logit ``scale * q.k_j`` is ``target_j`` up to the
small noise of the remaining channels and the dtype's rounding.
"""

from __future__ import annotations

import copyreg
import math
import pickle
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from fa4.mods import build_mods
from numerics.call import AttentionCall
from numerics.fp import format_of
from numerics.mod_library import RELBIAS_SPAN
from numerics.mods import BlockSparse, MaskMod, ScoreMod, bind_aux_scalars, block_sparse_from_mask, visibility
from numerics.reference import apply_score_mod, call_visibility, visible_mask

__all__ = [
    "sequence_case",
    "Family",
    "FAMILIES",
    "ADVERSARIAL_FAMILIES",
    "TIED_STRIDE",
    "SINK_PLACES",
    "TILE_STEPS_LOG2",
    "make_inputs",
    "DO_FAMILIES",
    "make_grad_output",
    "NotApplicable",
    "make_varlen_inputs",
    "page_table",
    "paged",
    "saveable_kw",
    "rebuild_mod",
]


class NotApplicable(ValueError):
    """A case whose configuration a family's (or layout's) precondition excludes: the family
    cannot build its inputs there (e.g. ``nan_inf_masked`` needs keys no query sees).  The runner
    reports the case ``skipped`` with this reason; it never ends a run."""


#: logit steps between consecutive 128-key tiles, in log2 units: around the 16-bit rescale
#: threshold (8), and far above it
TILE_STEPS_LOG2 = (1.0, 4.0, 7.9, 8.1, 12.0, 17.0, 24.0, 40.0)


@dataclass(frozen=True)
class Family:
    name: str
    hunts: str
    build: Callable  # (shape_q, shape_k, shape_v, case, gen) -> (q, k, v) float64


def _normal(sq, sk, sv, case, g):
    return (
        torch.randn(sq, generator=g, dtype=torch.float64),
        torch.randn(sk, generator=g, dtype=torch.float64),
        torch.randn(sv, generator=g, dtype=torch.float64),
    )


def _uniform(sq, sk, sv, case, g):
    u = lambda s: (torch.rand(s, generator=g, dtype=torch.float64) * 2 - 1) * math.sqrt(3)
    return u(sq), u(sk), u(sv)


def _student_t(sq, sk, sv, case, g, df: float = 3.0):
    def t(shape):
        z = torch.randn(shape, generator=g, dtype=torch.float64)
        chi2 = (torch.randn((*shape, int(df)), generator=g, dtype=torch.float64) ** 2).sum(-1)
        return z / torch.sqrt(chi2 / df)

    return t(sq), t(sk), t(sv)


def _outliers(sq, sk, sv, case, g):
    q, k, v = _normal(sq, sk, sv, case, g)
    d = sq[-1]
    # a few channels 10-100x larger (LLM activations) ...
    ch = torch.randperm(d, generator=g)[: max(1, d // 32)]
    gain = 10 ** (1 + torch.rand(len(ch), generator=g, dtype=torch.float64))
    q[..., ch] *= gain
    k[..., ch] *= gain
    # ... plus FA3's N(0,1) + N(0,100) * Bernoulli(0.001)
    for t in (q, k, v):
        t += (
            torch.randn(t.shape, generator=g, dtype=torch.float64)
            * 10
            * (torch.rand(t.shape, generator=g, dtype=torch.float64) < 1e-3)
        )
    return q, k, v


def _offset(sq, sk, sv, case, g):
    q, k, v = _normal(sq, sk, sv, case, g)
    return 4 + 0.05 * q, 4 + 0.05 * k, 50 + v  # means large against the spread


def _logit_channel(sq, sk, sv, case, g, targets: torch.Tensor):
    """q, k with logit(i, j) ~= targets[j] (natural units), via channel 0; small noise elsewhere."""
    q = 0.01 * torch.randn(sq, generator=g, dtype=torch.float64)
    k = 0.01 * torch.randn(sk, generator=g, dtype=torch.float64)
    v = torch.randn(sv, generator=g, dtype=torch.float64)
    scale = 1 / math.sqrt(sq[-1])
    c = 4.0
    q[..., 0] = c
    k[..., 0] = (targets / (scale * c)).view(1, -1, 1)
    return q, k, v


def _peaked(sq, sk, sv, case, g):
    t = torch.zeros(sk[1], dtype=torch.float64)
    t[torch.randint(0, sk[1], (1,), generator=g)] = 12.0  # one key ~e^12 above the rest
    return _logit_channel(sq, sk, sv, case, g, t)


def _flat(sq, sk, sv, case, g):
    q, k, v = _logit_channel(sq, sk, sv, case, g, torch.zeros(sk[1], dtype=torch.float64))
    return q, k, v


def _long_tail(sq, sk, sv, case, g):
    n = sk[1]
    t = torch.full((n,), -math.log(max(n, 2)) + 3.0, dtype=torch.float64)  # n small entries hold ~e^3 the mass of ...
    t[0] = 0.0  # ... the single largest one
    t -= 6.0 * torch.rand(n, generator=g, dtype=torch.float64)
    return _logit_channel(sq, sk, sv, case, g, t)


def _drift(sq, sk, sv, case, g):
    n = sk[1]
    return _logit_channel(sq, sk, sv, case, g, torch.linspace(0, 40, n, dtype=torch.float64))


def _tile_steps(step_log2: float):
    def build(sq, sk, sv, case, g):
        n = sk[1]
        tiles = torch.arange(n, dtype=torch.float64) // 128
        t = (tiles * step_log2 * math.log(2)).clamp(max=80.0)  # rising by `step` per KV tile
        t = t + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
        return _logit_channel(sq, sk, sv, case, g, t)

    return build


def _huge(sq, sk, sv, case, g):
    n = sk[1]
    t = 120 + 60 * torch.rand(n, generator=g, dtype=torch.float64)  # |s| in [120, 180]: > 100
    return _logit_channel(sq, sk, sv, case, g, t)


def _near_max(sq, sk, sv, case, g):

    m = format_of(case.dtype).max
    q, k, v = _normal(sq, sk, sv, case, g)
    return q, k, v.clamp(-1, 1).sign() * m * (1 - 0.01 * torch.rand(sv, generator=g, dtype=torch.float64))


def _subnormal(sq, sk, sv, case, g):

    f = format_of(case.dtype)
    tiny = f.smallest_subnormal
    q, k, v = _normal(sq, sk, sv, case, g)
    sub = lambda s: torch.randint(-(2 ** (f.p - 1)) + 1, 2 ** (f.p - 1), s, generator=g).double() * tiny
    return q, sub(sk), sub(sv)


#: tied_max: every TIED_STRIDE-th key from key 0 on ties at the row max (so that every row that
#: sees key 0, or a window of TIED_STRIDE keys, sees a tie), the others TIED_GAP natural-log units
#: below it before a per-row term of at most TIED_ROW_SPREAD either way (P in about
#: e**-3.5..e**-0.75: about half the row's mass, rounded in P V)
TIED_STRIDE = 8
TIED_GAP = (0.25, 2.0)
TIED_ROW_SPREAD = 0.5


def _tied_max(sq, sk, sv, case, g):
    """Several keys per row whose logits tie at the max exactly: the tied keys are copies of one
    key (every channel), so every kernel computes their scores with the same bits and P = 1 on
    each; V of one sign (log-normal, median 1), the similar representations under which Qiu & Yao
    (arXiv 2510.04212) find bf16 rounding in P V biased: a rounding that is not to nearest then
    moves every output the same way instead of averaging out.  Channel 1 adds a_i b_j to logit
    (i, j) (a_i, b_j uniform in +-1, b the same on tied keys) so that rows differ: on identical
    rows (the logit channel alone) every row's rounding error repeats, and a mean over rows
    counts one error many times."""
    n, w = sk[1], TIED_ROW_SPREAD
    lo, hi = TIED_GAP
    t = -(lo + 2 * w + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64))  # below any tie by >= lo
    tied = torch.arange(0, n, TIED_STRIDE)
    t[tied] = 0.0
    q, k, _ = _logit_channel(sq, sk, sv, case, g, t)
    a = 2 * torch.rand(sq[:-1], generator=g, dtype=torch.float64) - 1
    b = 2 * w * torch.rand(n, generator=g, dtype=torch.float64) - w
    c, scale = 4.0, 1 / math.sqrt(sq[-1])
    q[..., 1] = c * a
    k[..., 1] = (b / (scale * c)).view(1, -1, 1)
    k[:, tied] = k[:, :1].clone()
    v = torch.exp(0.5 * torch.randn(sv, generator=g, dtype=torch.float64))
    return q, k, v


def _seen_by_all(nq: int, nk: int, case, near: int) -> int:
    """The key every one of ``nq`` queries sees under ``case``'s mask (bottom-right aligned, as
    ``numerics.reference``) nearest ``near``; ``near`` when no key is seen by all."""
    left, right = case.window
    right = 0 if case.causal else right
    lo = 0 if left is None else max(0, nk - 1 - left)
    hi = nk - 1 if right is None else min(nk - 1, nk - nq + right)
    return near if lo > hi else min(max(near, lo), hi)


def _nan_inf(where: str):
    def build(sq, sk, sv, case, g):
        q, k, v = _normal(sq, sk, sv, case, g)
        n = sk[1]
        if where == "visible":
            # NaN in K at the last key (visible to the last query under every mask, past the
            # diagonal of the others: a mask that adds a large negative score instead of -inf lets
            # it poison them); -inf in K at the middle key; inf in V at a key every query sees
            # when there is one (the middle key, or the seen key nearest it): at a key some
            # queries do not see, a correct tiled kernel's 0 * inf in P V makes their rows NaN
            # where the reference is not
            js = [n - 1, n // 2]
            vj = _seen_by_all(sq[1], n, case, n // 2)
        else:
            # keys no query can see: before the left edge of every local window
            left = case.window[0]
            if left is None:
                raise NotApplicable(f"family nan_inf_masked needs a case with a left window, got {case.window}")
            js = list(range(0, max(0, n - sq[1] - left)))[:2]
            if not js:
                raise NotApplicable(
                    f"case has no key masked for every query (seqlen_q {sq[1]}, seqlen_k {n}, left {left})"
                )
            vj = js[-1]
        k[:, js[0], :, 0] = math.nan
        v[:, vj, :, 1] = math.inf
        k[:, js[-1], :, 2] = -math.inf
        return q, k, v

    return build


_FAMS = [
    Family("normal", "baseline: FA's own test distribution", _normal),
    Family("uniform", "bounded inputs: flat logit distribution, accumulation of many similar terms", _uniform),
    Family("student_t", "heavy tails (df 3): rare huge products inside the QK^T dot", _student_t),
    Family(
        "outliers",
        "outlier feature channels (10-100x; FA3's N(0,1)+N(0,100)Bernoulli(0.001)): large logits from few channels",
        _outliers,
    ),
    Family(
        "offset", "shared offset (mean >> spread): cancellation in the scale-and-subtract, V far from zero", _offset
    ),
    Family("peaked", "one dominant key per row: P = 1 at the max, its rounding and saturation", _peaked),
    Family("flat", "identical logits: the denominator sums seqlen_k equal terms", _flat),
    Family("long_tail", "mass in many small entries: underflow/flush of small P (fp8), sum accuracy", _long_tail),
    Family("drift", "logits rising along the keys: the running max moves at every tile", _drift),
    *[
        Family(
            f"tile_step_{s:g}",
            f"logit step of {s:g} log2 units between KV tiles: lazy rescaling around its threshold",
            _tile_steps(s),
        )
        for s in TILE_STEPS_LOG2
    ],
    Family("huge_logits", "|s| > 100: exponent range, fma error growing with |logit|", _huge),
    Family("near_max", "V near the dtype's largest value: overflow in P.V and the output cast", _near_max),
    Family("subnormal", "subnormal K and V: flush-to-zero of inputs", _subnormal),
    Family(
        "nan_inf_visible",
        "NaN/inf at visible positions: NaN propagation (emulated exp2 swallows NaN scores)",
        _nan_inf("visible"),
    ),
    Family(
        "nan_inf_masked",
        "NaN/inf at keys no query sees: must not leak (0 * NaN in a processed tile)",
        _nan_inf("masked"),
    ),
]
FAMILIES: dict[str, Family] = {f.name: f for f in _FAMS}
#: families of named adversarial suites only (``bias``: ``audits.suites.cases.bias_suite``), not placed
#: in every generated suite as :data:`FAMILIES` are (smoke, release and nightly cover those); cases
#: and make_inputs accept them alike
ADVERSARIAL_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "tied_max",
            "several keys per row tie at the max exactly (P = 1 on each), V of one sign: rounding bias in P V",
            _tied_max,
        ),
    )
}


def _layout(t: torch.Tensor, layout: str, g: torch.Generator) -> torch.Tensor:
    if layout == "contiguous":
        return t.contiguous()
    if layout == "strided":  # every other head-dim element of a twice-wider buffer
        buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        buf[..., ::2] = t
        return buf[..., ::2]
    raise ValueError(f"unknown layout {layout!r}; accepted: contiguous, strided, packed_qkv")


def make_inputs(case, *, device: str | torch.device = "cpu") -> dict:
    """q, k, v (case.dtype, on ``device``, laid out per ``case.layout``) and the keyword
    arguments of the audited call for ``case`` (an ``audits.suites.cases.Case``), with its mods
    (``fa4.mods.build_mods``: score_mod, mask_mod, aux_tensors, block_sparse_tensors) when it
    has any; :class:`NotApplicable` where the family's or a mod's precondition fails."""
    family = FAMILIES.get(case.family) or ADVERSARIAL_FAMILIES.get(case.family)
    if family is None:
        accepted = ", ".join([*FAMILIES, *ADVERSARIAL_FAMILIES])
        raise ValueError(f"unknown input family {case.family!r}; accepted: {accepted}")
    g = torch.Generator().manual_seed(case.seed)
    dt = getattr(torch, case.dtype)
    sq = (case.batch, case.seqlen_q, case.heads_q, case.d)
    sk = (case.batch, case.seqlen_k, case.heads_kv, case.d)
    sv = (case.batch, case.seqlen_k, case.heads_kv, case.dv)
    q, k, v = family.build(sq, sk, sv, case, g)
    if (
        case.layout == "packed_qkv"
        and case.heads_q == case.heads_kv
        and case.d == case.dv
        and case.seqlen_q == case.seqlen_k
    ):
        qkv = torch.stack([q, k, v], dim=3).to(dt).to(device)  # (b, s, h, 3, d): slices are non-contiguous
        q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    else:
        if case.layout == "packed_qkv":
            raise NotApplicable("layout packed_qkv needs heads_q == heads_kv, d == dv and seqlen_q == seqlen_k")
        q, k, v = (_layout(t.to(dt).to(device), case.layout, g) for t in (q, k, v))
    kw = {"causal": case.causal, "window_size": tuple(case.window), "softcap": case.softcap}
    if case.sink:
        kw["learnable_sink"] = _sink(q, k, case, g).to(device)
    if case.score_mod or case.mask_mod or case.block_sparse:
        kw.update(_mods(case, v, device))
    return {"q": q, "k": k, "v": v, "kw": kw}


def _mods(case, v: torch.Tensor, device) -> dict:
    """The call's mod keywords for ``case`` (``fa4.mods.build_mods``: score_mod, mask_mod,
    aux_tensors, block_sparse_tensors), deterministic from the case's seed, or
    :class:`NotApplicable` where a mod breaks the family's precondition:

    - ``relbias`` reads a bucket table covering distances up to ``RELBIAS_SPAN``
      (``numerics.mod_library``): longer sequences have no bias to read;
    - ``nan_inf_visible`` puts inf in V at a key every query sees under the flags
      (:func:`_seen_by_all`); a mask_mod (or block sparsity) that hides it from some query makes a
      correct tiled kernel's 0 * inf in P V a NaN the reference does not have — the family would
      then fail correct kernels, so it is not applicable there."""

    if case.score_mod == "relbias" and max(case.seqlen_q, case.seqlen_k) > RELBIAS_SPAN:
        raise NotApplicable(
            f"score_mod relbias covers sequences up to {RELBIAS_SPAN} tokens (its bucket table); the case has "
            f"{case.seqlen_q}x{case.seqlen_k}"
        )
    recipe = dict(
        score_mod=case.score_mod,
        mask_mod=case.mask_mod,
        block_sparse=tuple(case.block_sparse),
        batch=case.batch,
        heads_q=case.heads_q,
        seqlen_q=case.seqlen_q,
        seqlen_k=case.seqlen_k,
        seed=case.seed,
    )
    mods = build_mods(**recipe, device=device)
    for key in ("score_mod", "mask_mod"):
        if key in mods:
            _RECIPES[mods[key]] = (key, recipe)
    if case.family == "nan_inf_visible" and (case.mask_mod or case.block_sparse):
        _inf_key_seen_by_all(case, v, mods)
    return mods


#: how each library mod :func:`_mods` built can be built again: mod -> (its keyword in
#: ``fa4.mods.build_mods``'s result, the build's arguments).  Weak: a mod no call holds goes.
_RECIPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rebuild_mod(key: str, recipe: dict):
    """The library mod ``key`` ("score_mod" / "mask_mod") of ``fa4.mods.build_mods(**recipe)``,
    on the CPU (a mod holds no tensor: it reads the call's aux tensors, which travel apart).
    Public: what a pickled library mod unpickles by (:func:`_reduce_mod`)."""

    return build_mods(**recipe, device="cpu")[key]


def _reduce_mod(mod):
    """Pickle a library mod by its recipe: its reference form is a closure, which pickle cannot
    write, and the kernel worker (``audits.engine.worker``: ``run``'s isolated kernel process) receives
    the call's keywords pickled.  A mod built elsewhere (a user's own) pickles as before."""
    got = _RECIPES.get(mod)
    return (rebuild_mod, got) if got is not None else mod.__reduce_ex__(pickle.DEFAULT_PROTOCOL)


def _register_reducers() -> None:

    for cls in (ScoreMod, MaskMod):
        copyreg.pickle(cls, _reduce_mod)


_register_reducers()


def _inf_key_seen_by_all(case, v: torch.Tensor, mods: dict) -> None:
    """:class:`NotApplicable` unless every query row that sees some key under the flags and the
    mods sees the key ``nan_inf_visible`` put inf in V at (a row seeing no key has no P V)."""

    keys = torch.isinf(v).flatten(2).any(-1).any(0).nonzero().flatten().cpu()
    flags = visible_mask(case.seqlen_q, case.seqlen_k, causal=case.causal, window_size=tuple(case.window))
    aux = [t.cpu() for t in mods.get("aux_tensors") or []]
    vis = visibility(
        batch=case.batch,
        heads=case.heads_q,
        seqlen_q=case.seqlen_q,
        seqlen_k=case.seqlen_k,
        mask_mod=mods.get("mask_mod"),
        block_sparse=_cpu_blocks(mods.get("block_sparse_tensors")),
        aux=aux,
    )
    vis = vis.expand(case.batch, case.heads_q, case.seqlen_q, case.seqlen_k) & flags
    rows = vis.any(-1)
    for j in keys.tolist():
        blind = rows & ~vis[..., j]
        if bool(blind.any()):
            b, h, i = (int(x) for x in blind.nonzero()[0])
            raise NotApplicable(
                f"family nan_inf_visible puts inf in V at key {j}, which the mods ({case.mask_mod}"
                f"{', block-sparse' if case.block_sparse else ''}) hide from query {i} (batch {b}, head {h}): a "
                "correct tiled kernel's 0 * inf there is a NaN the reference does not have"
            )


def _cpu_blocks(bs):
    """A ``numerics.mods.BlockSparse`` with its block masks on the CPU (None stays None)."""
    if bs is None:
        return None

    return replace(bs, full=bs.full.cpu(), partial=bs.partial.cpu())


def saveable_kw(kw: dict) -> dict:
    """The call's keywords in a form ``torch.save`` writes without pickling code: a mod object
    (its reference form is a closure) by its name, block sparsity as its block masks and size,
    tensors as they are.  The case (``Case.as_dict``, saved beside) rebuilds the mods themselves."""

    out = {}
    for key, val in kw.items():
        if isinstance(val, (ScoreMod, MaskMod)):
            out[key] = val.name
        elif isinstance(val, BlockSparse):
            out[key] = {"full": val.full, "partial": val.partial, "block_size": tuple(val.block_size)}
        else:
            out[key] = val
    return out


#: the learnable sink's place against its head's largest logit, head h taking SINK_PLACES[h % 3]:
#: (low, high) of a uniform draw, natural-log units above the max
SINK_PLACES = ((2.0, 4.0), (-0.5, 0.5), (-4.0, -3.0))


def _head_max_logits(q: torch.Tensor, k: torch.Tensor, case) -> torch.Tensor:
    """Per query head: the largest finite visible logit over the batch and every query row, in
    float64 from the rounded inputs, with the audited call's scale (1/sqrt(d)) and softcap;
    -inf for a head with no finite visible logit.  Chunked over queries so that the score
    tensor stays small at 32k keys.

    With mods the logit is the one the softmax sees: the score mod's reference form in float64
    on the scaled score (production's ``softmax.py`` ``apply_score_mod_inner``: scale, then the
    mod) and "visible" is the flags intersected with the mask_mod and block sparsity
    (``numerics.reference.call_visibility``), the mods built as the call's are
    (``fa4.mods.build_mods`` from the case's seed, its ``aux_scalars`` bound by
    ``numerics.mods.bind_aux_scalars``), so that the sink sits where ``SINK_PLACES``
    says against what the kernel sees — against the flag-masked raw logits, a mask_mod hiding
    the largest key or a bias shifting every logit would move it off its place."""

    b, sq, hq, d = q.shape
    sk = k.shape[1]
    mods: dict = {}
    if case.score_mod or case.mask_mod or case.block_sparse:
        if case.score_mod == "relbias" and max(sq, sk) > RELBIAS_SPAN:  # _mods refuses it too, after the sink
            raise NotApplicable(
                f"score_mod relbias covers sequences up to {RELBIAS_SPAN} tokens (its bucket table); the case has "
                f"{sq}x{sk}"
            )
        mods = build_mods(
            score_mod=case.score_mod,
            mask_mod=case.mask_mod,
            block_sparse=tuple(case.block_sparse),
            batch=b,
            heads_q=hq,
            seqlen_q=sq,
            seqlen_k=sk,
            seed=case.seed,
            device=q.device,
        )
    aux = mods.get("aux_tensors")
    score_mod, mask_mod, blocks = bind_aux_scalars(  # the call's runtime scalars, when it has any
        mods.get("aux_scalars"),
        score_mod=mods.get("score_mod"),
        mask_mod=mods.get("mask_mod"),
        block_sparse=mods.get("block_sparse_tensors"),
    )
    call = AttentionCall(
        causal=case.causal,
        window_size=tuple(case.window),
        mask_mod=mask_mod,
        block_sparse_tensors=blocks,
        aux_tensors=aux,
    )
    kd = k.double().repeat_interleave(hq // k.shape[2], dim=2)
    best = torch.full((hq,), -math.inf, dtype=torch.float64, device=q.device)
    rows = max(1, (1 << 24) // max(1, b * hq * sk))
    for i0 in range(0, sq, rows):
        idx = torch.arange(i0, min(i0 + rows, sq), device=q.device)
        s = torch.einsum("bihd,bjhd->bhij", q[:, i0 : i0 + rows].double() / math.sqrt(d), kd)
        if case.softcap and case.softcap > 0:
            s = case.softcap * torch.tanh(s / case.softcap)
        if score_mod is not None:
            s = apply_score_mod(s, score_mod, aux, rows=idx)
        vis = call_visibility(batch=b, heads=hq, seqlen_q=sq, seqlen_k=sk, call=call, rows=idx, device=q.device)
        s = s.masked_fill(~(vis & torch.isfinite(s)), -math.inf)
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best.cpu()


def _sink(q: torch.Tensor, k: torch.Tensor, case, g: torch.Generator) -> torch.Tensor:
    """The learnable sink (heads_q,), float32: per head, placed against the head's largest
    visible logit (``SINK_PLACES``: 2-4 nats above it, so the sink dominates; within +-0.5 of it;
    3-4 nats below it, e**-3..e**-4 of the top key's weight).

    Why relative: a sink drawn independently of the logits (e.g. N(0,1) beside logits reaching
    40) carries a weight of e**-40 — a kernel that ignores the sink entirely then meets every
    tolerance (LSE error 5e-6 on the smoke suite's drift case) and the feature goes untested.
    The head's max is rounded to a 2**-8 grid before the offset is added, so a last-bit
    difference between the CPU's and a GPU's float64 dot products cannot move the sink (a
    reproducer saved from CPU inputs rebuilds the sink the kernel saw)."""
    top = _head_max_logits(q, k, case)
    top = torch.where(torch.isfinite(top), torch.round(top * 256) / 256, torch.zeros_like(top))
    u = torch.rand(case.heads_q, generator=g, dtype=torch.float64)
    lo = torch.tensor([SINK_PLACES[h % len(SINK_PLACES)][0] for h in range(case.heads_q)], dtype=torch.float64)
    hi = torch.tensor([SINK_PLACES[h % len(SINK_PLACES)][1] for h in range(case.heads_q)], dtype=torch.float64)
    return (top + lo + (hi - lo) * u).float()


#: dO families (``fa4-audit run --backward``): what the incoming gradient hunts
DO_FAMILIES = {
    "normal": "N(0, 1): FA's own test gradient",
    "outliers": "a few dO channels 10-100x plus FA3's N(0,1)+N(0,100)Bernoulli(0.001): dP = dO V^T from few terms",
    "large": "dO x 64 (exact power of two): large dP and D, cancellation in dP - D at scale",
    "tiny": "dO x 2**-12 (exact): small dS, near the 16-bit formats' subnormal range in dK / dQ sums",
}
#: the input families whose purpose fixes the dO family; the others take one by name (below)
_DO_FOR = {"outliers": "outliers", "subnormal": "tiny", "near_max": "normal"}


def grad_output_family(case) -> str:
    """The dO family of a case: fixed for a few input families (``_DO_FOR``), else chosen by a
    stable hash of the input family's name, so that a suite covering every input family covers
    every dO family too."""

    return _DO_FOR.get(case.family) or list(DO_FAMILIES)[zlib.crc32(case.family.encode()) % len(DO_FAMILIES)]


def make_grad_output(case, *, device: str | torch.device = "cpu") -> tuple[torch.Tensor, str]:
    """(dO, its family) for ``case``: (batch, seqlen_q, heads_q, dv) in the output's dtype (bf16
    for fp8 inputs), deterministic from the case's seed, drawn in float64 and rounded once."""
    fam = grad_output_family(case)
    g = torch.Generator().manual_seed(case.seed + 7919)
    shape = (case.batch, case.seqlen_q, case.heads_q, case.dv)
    do = torch.randn(shape, generator=g, dtype=torch.float64)
    if fam == "outliers":
        ch = torch.randperm(case.dv, generator=g)[: max(1, case.dv // 32)]
        do[..., ch] *= 10 ** (1 + torch.rand(len(ch), generator=g, dtype=torch.float64))
        do += torch.randn(shape, generator=g, dtype=torch.float64) * 10 * (torch.rand(shape, generator=g) < 1e-3)
    elif fam == "large":
        do *= 64.0
    elif fam == "tiny":
        do *= 2.0**-12
    dt = getattr(torch, case.dtype)
    dt = torch.bfloat16 if dt.itemsize == 1 else dt
    return do.to(dt).to(device), fam


def _varlen_mods(case, device) -> dict:
    """A varlen case's mod keywords: the library mods built as for a fixed-length batch of one
    row per sequence at the call's largest lengths (:func:`_mods` on the case, whose ``batch``,
    ``seqlen_q`` and ``seqlen_k`` are the sequence count and the largest lengths).  So a per-batch
    aux tensor has one row per sequence, padded to the largest length (``document``: (sequences,
    max_seqlen_q) and (sequences, max_seqlen_k) ids; ``prefix_lm``: one prefix per sequence), which
    production indexes with the sequence as ``batch_idx`` and positions within it
    (``fa4.varlen.sequence_mods``); a mod's offsets (``causal``, ``sliding_window``,
    ``prefix_lm``: ``seqlen_k - seqlen_q``) are those largest lengths', one function for every
    sequence, as one compiled mod is.  ``nan_inf_visible`` with a mask_mod is not applicable (its
    inf key is placed per sequence without the mods).  ``block_sparse``: per sequence the mask
    mod's blocks over its rows and used keys, as sequence i sees the mod
    (``numerics.mods.block_sparse_from_mask`` of ``fa4.varlen.sequence_mods(i)``'s mask; None for a
    sequence without queries or keys), each holding the call's mask mod (``fa4.varlen.varlen_block_sparse``)."""

    if case.family == "nan_inf_visible" and (case.mask_mod or case.block_sparse):
        raise NotApplicable(
            "nan_inf_visible with a mask_mod on a varlen case: the inf key is drawn per sequence without the mods, "
            "and a mask hiding it from some query makes a correct tiled kernel's 0 * inf a NaN"
        )
    mods = _mods(replace(case, block_sparse=()), None, device)
    if case.block_sparse:
        from fa4.varlen import sequence_mods  # lazy: fa4.varlen loads fa4.model (numba)

        mm, bq, bk, per = mods["mask_mod"], *case.block_sparse, []
        for i, (sq, _) in enumerate(case.seqlens):
            sk = case.seqused_k[i] if case.seqused_k else case.seqlens[i][1]
            if sq == 0 or sk == 0:
                per.append(None)
                continue
            own = sequence_mods(i, mask_mod=mm)["mask_mod"]
            bs = block_sparse_from_mask(
                own,
                batch=1,
                heads=case.heads_q,
                seqlen_q=sq,
                seqlen_k=sk,
                block_size=(bq, bk),
                aux=mods.get("aux_tensors"),
                device=device,
            )
            per.append(replace(bs, mask_mod=mm))
        mods["block_sparse_tensors"] = per
    return mods


def sequence_case(case, i: int, sq: int, sk: int):
    """Sequence ``i`` of a varlen case as a batch-1 fixed-length case (its own seed), at least
    one row and key long so that every family can draw (sliced back to the length after)."""

    return replace(
        case,
        batch=1,
        seqlen_q=max(sq, 1),
        seqlen_k=max(sk, 1),
        seed=case.seed * 7919 + i,
        layout="contiguous",
        sink=False,
        seqlens=(),
        seqused_k=(),
        page_size=0,
        num_splits=1,
        pack_gqa=None,
        score_mod="",
        mask_mod="",
        block_sparse=(),
    )


def page_table(lengths: list[int], page: int, g: torch.Generator) -> torch.Tensor:
    """(b, width) int32: sequence i's tokens in consecutive pages of row i, the pages a seeded
    permutation of the pool (width: the longest sequence's page count)."""
    width = max(1, max(-(-n // page) for n in lengths))
    return torch.randperm(len(lengths) * width, generator=g).view(len(lengths), width).to(torch.int32)


def paged(ts: list[torch.Tensor], table: torch.Tensor, page: int) -> torch.Tensor:
    """The pool (num_pages, page, h, d) holding the sequences' tokens ``ts`` (each (n, h, d))
    where ``table`` puts them; slots past a sequence's tokens are zero."""
    width = table.shape[1]
    pool = torch.zeros(table.numel(), page, *ts[0].shape[1:], dtype=ts[0].dtype)
    for i, t in enumerate(ts):
        pad = torch.zeros(width * page, *t.shape[1:], dtype=t.dtype)
        pad[: t.shape[0]] = t
        pool[table[i].long()] = pad.view(width, page, *t.shape[1:])
    return pool


def make_varlen_inputs(case, *, device: str | torch.device = "cpu") -> dict:
    """Inputs of a varlen case (``Case.seqlens``, ``docs/varlen.md``): each sequence drawn as a
    batch-1 case of the family (its own seed), packed along the tokens: q (total_q, hq, d) with
    ``cu_seqlens_q``; k, v packed with ``cu_seqlens_k``, or in a shuffled paged cache with
    ``page_table`` (``page_size``); ``seqused_k`` when the case uses fewer keys than allocated
    (the allocated tail holds the family's values: finite, never visible).  The learnable sink
    is drawn against sequence 0.  A case's mods are built once for the call (:func:`_varlen_mods`:
    per-batch aux tensors have a row per sequence).  Returns q, k, v, kw (the call's keywords) and
    ``parts``: per sequence (q_i, k_i, v_i) with the used keys only, batch 1 — what the sequence
    computes (its mods: ``fa4.varlen.sequence_mods``)."""
    dt = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(case.seed)
    qs, ks, vs, parts, sink = [], [], [], [], None
    for i, (sq, sk) in enumerate(case.seqlens):
        sub = sequence_case(case, i, sq, sk)
        x = make_inputs(sub, device="cpu")
        q, k, v = x["q"][0, :sq], x["k"][0, :sk], x["v"][0, :sk]
        used = case.seqused_k[i] if case.seqused_k else sk
        qs.append(q), ks.append(k), vs.append(v)
        parts.append(tuple(t.unsqueeze(0).to(device) for t in (q, k[:used], v[:used])))
        if case.sink and sink is None:
            sink = _sink(x["q"], x["k"], replace(sub, sink=True), g)
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0).tolist()), dtype=torch.int32)
    kw = {"causal": case.causal, "window_size": tuple(case.window), "softcap": case.softcap}
    if sink is not None:
        kw["learnable_sink"] = sink.to(device)
    kw["cu_seqlens_q"] = cu([a for a, _ in case.seqlens]).to(device)
    kw["max_seqlen_q"] = max(a for a, _ in case.seqlens)
    used = [case.seqused_k[i] if case.seqused_k else b for i, (_, b) in enumerate(case.seqlens)]
    if case.page_size:
        table = page_table([t.shape[0] for t in ks], case.page_size, g)
        k, v = paged(ks, table, case.page_size), paged(vs, table, case.page_size)
        kw["page_table"] = table.to(device)
        kw["seqused_k"] = torch.tensor(used, dtype=torch.int32, device=device)
    else:
        k, v = torch.cat(ks), torch.cat(vs)
        kw["cu_seqlens_k"] = cu([b for _, b in case.seqlens]).to(device)
        if case.seqused_k:
            kw["seqused_k"] = torch.tensor(used, dtype=torch.int32, device=device)
    kw["max_seqlen_k"] = max(b for _, b in case.seqlens)
    kw["num_splits"] = case.num_splits
    if case.pack_gqa is not None:
        kw["pack_gqa"] = case.pack_gqa
    if case.score_mod or case.mask_mod or case.block_sparse:
        kw.update(_varlen_mods(case, device))
    q = torch.cat(qs)
    return {"q": q.to(device), "k": k.to(dt).to(device), "v": v.to(dt).to(device), "kw": kw, "parts": parts}
