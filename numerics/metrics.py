"""Error metrics of an attention output (and LSE) against a reference, and of one kernel's
output against another's.

* :func:`output_errors` — against the FP64 reference: max |err| (value, index, reference value
  there), relative L2, max ULP error in the output dtype (``numerics.fp.ulp_error``'s
  convention), non-finite mismatches (counted, and broken down by what each side holds).
* :func:`lse_errors` — max |lse - ref| over rows where both are finite, and rows where one is
  -inf/NaN and the other is not (counted, and broken down as the output's).
* :func:`nan_aware_max` — a max |err| of either as it truly is: NaN (or inf) when an element is
  NaN (or inf) where the reference is finite, which the finite-only ``max_abs`` beside it cannot
  show (an all-NaN output has ``max_abs`` 0); every view prints it (``audits.report.html.max_text``).
* :func:`nonfinite_mismatches` — that breakdown: elements where the two sides differ and one of
  them is NaN or infinite, counted per (kernel's class, reference's class).
* :func:`ulp_diff_histogram` — integer ULP distance between two tensors of the same 16- or
  8-bit float dtype (model vs production): counts of 0, 1, 2 and > 2 steps apart.
* :func:`row_scaled_ulp_diff` — the same in ULPs at each row's largest reference magnitude.
* :func:`bit_diff` — one kernel's tensor against another's of the same dtype, bit for bit: how
  many elements differ, their ULP distances (a histogram, the largest and where), and how the
  NaN/inf pattern changed (``fa4-audit compare``).
* :func:`fa_criterion` — FlashAttention's own test: max|out - ref| <= 2 max|out_lp - ref| + 2
  * rounding error of the output dtype at the reference's max magnitude.
* :func:`fa_floor` — the terms of that test as the audit records them, with the rounding at the
  quantity's own scale (the floor the verdict keeps where PyTorch's error is 0).
* :func:`signed_bias` — whether errors lean one way: the mean signed error, raw and in ULPs, over
  its standard error, per element and clustered by row (:func:`bias_record`: a case's out and LSE).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from numerics.fp import bit_view, format_of, ordered_bits, step_distance, ulp_error, ulp_of

__all__ = [
    "output_errors",
    "lse_errors",
    "nonfinite_mismatches",
    "nan_aware_max",
    "VALUE_CLASSES",
    "ulp_diff_histogram",
    "row_scaled_ulp_diff",
    "bit_diff",
    "ULP_BUCKETS",
    "fa_criterion",
    "fa_floor",
    "bound_check",
    "signed_bias",
    "bias_record",
]


def _index(flat_idx: int, shape) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(flat_idx % n)
        flat_idx //= n
    return tuple(reversed(out))


#: the classes :func:`nonfinite_mismatches` sorts a value into, in the order of its codes
VALUE_CLASSES = ("finite", "NaN", "+inf", "-inf")


def _classes(t: torch.Tensor) -> torch.Tensor:
    """Each element's index in :data:`VALUE_CLASSES` (int64; ``t`` float64)."""
    c = torch.isnan(t).long()
    c += 2 * (t == math.inf).long()
    c += 3 * (t == -math.inf).long()
    return c


def nonfinite_mismatches(got: torch.Tensor, ref: torch.Tensor) -> dict[str, int]:
    """How many elements differ where at least one side is NaN or infinite, keyed
    ``"<kernel's class>|<reference's class>"`` (classes :data:`VALUE_CLASSES`), most frequent
    first, e.g. ``{"NaN|+inf": 240, "finite|NaN": 12}``.  Why: a count alone ("3 values are
    NaN/inf") does not say whether the kernel turned a finite row into NaN, an empty row into a
    number, or a NaN row into -inf; these differ in cause (a kernel bug, a masking convention, a
    NaN-handling convention) and a reader needs the pair to tell which.  Equal infinities and NaN
    against NaN are no mismatch.  ``got`` and ``ref``: the same shape, any float dtypes."""
    g, r = got.double(), ref.double()
    same = (g == r) | (torch.isnan(g) & torch.isnan(r))
    bad = ~same & ~(torch.isfinite(g) & torch.isfinite(r))
    if not bool(bad.any()):
        return {}
    n = len(VALUE_CLASSES)
    codes = _classes(g[bad]) * n + _classes(r[bad])
    counts = torch.bincount(codes, minlength=n * n).tolist()
    pairs = {f"{VALUE_CLASSES[i // n]}|{VALUE_CLASSES[i % n]}": int(c) for i, c in enumerate(counts) if c}
    return dict(sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0])))


def overflow_threshold(dtype: torch.dtype | str) -> float | None:
    """The smallest magnitude that rounds to infinity in ``dtype`` under round-to-nearest-even: its
    largest finite value plus half an ULP there (float16: 65504 + 16 = 65520, where the tie goes
    to infinity, 65504's significand being odd); None for a format without infinities
    (float8_e4m3fn saturates to NaN)."""
    f = format_of(dtype)
    if f.name == "float8_e4m3fn":
        return None
    return f.max + 2.0 ** (math.floor(math.log2(f.max)) - f.p)


def rounded_overflow(ref: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The reference a result ``got`` is compared with where the exact value is beyond ``got``'s
    dtype's range (at least :func:`overflow_threshold`), and how many such elements ``ref``
    (float64) has.  There the dtype holds nothing closer than the infinity the value rounds to, so
    the comparison takes that infinity where ``got`` is it (correctly rounded: no error) or finite
    (a saturated value: a deviation from the rounded reference, which the semantics rules judge,
    not a bound), and keeps the finite exact value where ``got`` is NaN or the other infinity (a
    non-finite result where the reference is finite: it fails).  SDPA's fp16 backward on smoke's
    near_max cases (2026-12-04) returned exactly the rounded infinities and failed "the kernel
    returns +inf where the FP64 gradient is finite" before the comparison rounded the range."""
    r = ref.double()
    thr = overflow_threshold(got.dtype)
    if thr is None:
        return r, 0
    beyond = torch.isfinite(r) & (r.abs() >= thr)
    n = int(beyond.sum())
    if not n:
        return r, 0
    rounded = torch.copysign(torch.full_like(r, math.inf), r)
    g = got.double()
    return torch.where(beyond & (torch.isfinite(g) | (g == rounded)), rounded, r), n


def output_errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Errors of ``out`` (any float dtype) against the float64 reference ``ref`` (same shape).

    Elements where the reference is finite but ``out`` is not are counted in
    ``nonfinite_where_ref_finite`` (they always fail); where the reference is NaN or infinite
    (non-finite inputs) and ``out`` differs from it, in ``nan_swallowed`` (a semantics
    deviation: e.g. FA4's polynomial exp2 maps a NaN score to 0).  ``nonfinite_mismatches``:
    both counts broken down by what each side holds (:func:`nonfinite_mismatches`), so that a
    report can say "NaN where the reference is finite" rather than a field name.  ``checked``: the
    elements where the reference is finite (what ``nonfinite_where_ref_finite`` is out of).  Error
    statistics (``max_abs``, ``argmax``, ``rel_l2``, ``max_ulp``) use the elements where both are
    finite: read ``max_abs`` through :func:`nan_aware_max`, which is NaN or inf when the kernel
    returned NaN or inf where the reference is finite.
    """
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: out {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    o, r = out.double(), ref.double()
    fin_o, fin_r = torch.isfinite(o), torch.isfinite(r)
    both = fin_o & fin_r
    err = torch.where(both, (o - r).abs(), torch.zeros_like(o))
    i = int(err.argmax()) if err.numel() else 0
    num = torch.linalg.vector_norm(torch.where(both, o - r, torch.zeros_like(o)))
    den = torch.linalg.vector_norm(torch.where(both, r, torch.zeros_like(r)))
    res = {
        "max_abs": float(err.max()) if err.numel() else 0.0,
        "argmax": _index(i, out.shape),
        "ref_at_argmax": float(r.reshape(-1)[i]) if err.numel() else 0.0,
        "rel_l2": float(num / den) if den > 0 else float(num),
        "nonfinite_where_ref_finite": int((fin_r & ~fin_o).sum()),
        "checked": int(fin_r.sum()),
        "nan_swallowed": int((~fin_r & ~((o == r) | (torch.isnan(o) & torch.isnan(r)))).sum()),
        "nonfinite_mismatches": nonfinite_mismatches(o, r),
        "elements": out.numel(),
    }
    if out.dtype in (torch.bfloat16, torch.float16, torch.float32):
        u = ulp_error(o, r, dtype=out.dtype)
        res["max_ulp"] = float(torch.where(both, u, torch.zeros_like(u)).max()) if u.numel() else 0.0
    return res


def lse_errors(lse: torch.Tensor, ref: torch.Tensor) -> dict:
    """LSE (natural log) against the float64 reference lse: max |err| where both are finite;
    rows NaN/inf where the reference is finite (``nonfinite_where_ref_finite``); rows that
    differ where the reference is NaN or +inf, which only non-finite inputs cause
    (``nan_swallowed``, a semantics deviation: FA4 reports -inf for a NaN row sum); and rows
    with no visible key (reference -inf) where the kernel is not -inf (``mismatched_nonfinite``);
    ``nonfinite_mismatches``: the three broken down by what each side holds
    (:func:`nonfinite_mismatches`); ``ref_max_abs``: the largest finite |reference lse| (the
    scale of float32 LSE rounding); ``checked``: rows where the reference is finite.  ``max_abs``
    is finite-only as the output's: :func:`nan_aware_max` reads it truly."""
    a, r = lse.double(), ref.double()
    both = torch.isfinite(a) & torch.isfinite(r)
    err = torch.where(both, (a - r).abs(), torch.zeros_like(a))
    same = (a == r) | (torch.isnan(a) & torch.isnan(r))
    nan_swallowed = (torch.isnan(r) | (r == math.inf)) & ~same
    bad_where_finite = torch.isfinite(r) & ~torch.isfinite(a)
    other = (r == -math.inf) & ~same
    return {
        "max_abs": float(err.max()) if err.numel() else 0.0,
        "ref_max_abs": float(torch.where(torch.isfinite(r), r.abs(), torch.zeros_like(r)).max()) if r.numel() else 0.0,
        "nonfinite_where_ref_finite": int(bad_where_finite.sum()),
        "checked": int(torch.isfinite(r).sum()),
        "nan_swallowed": int(nan_swallowed.sum()),
        "mismatched_nonfinite": int(other.sum()),
        "nonfinite_mismatches": nonfinite_mismatches(a, r),
    }


def nan_aware_max(errors: Mapping[str, Any]) -> float:
    """The max |err| of an :func:`output_errors` / :func:`lse_errors` record (or a gradient's,
    which is an :func:`output_errors` record) over the elements where the reference is finite, as
    it is: NaN when the kernel returned NaN at one of them, else inf when it returned +-inf at one,
    else the finite ``max_abs``.  Why: ``max_abs`` is taken over the elements where both sides are
    finite (so that the error statistics stay numbers), and a kernel returning all NaN has
    ``max_abs`` 0; a view that prints ``max_abs`` alone calls the worst kernel perfect.  Which
    non-finite value the kernel returned is read from ``nonfinite_mismatches`` (pairs
    ``"<kernel's>|finite"``); a record written before that breakdown, or whose breakdown does
    not account for every such element, gives NaN (unknown which, and NaN never passes)."""
    n = errors.get("nonfinite_where_ref_finite") or 0
    if not n:
        return float(errors.get("max_abs", 0.0))
    pairs = errors.get("nonfinite_mismatches")
    pairs = pairs if isinstance(pairs, Mapping) else {}
    infs = sum(c for k, c in pairs.items() if k in ("+inf|finite", "-inf|finite") and isinstance(c, int))
    return math.inf if infs == n else math.nan


def ulp_diff_histogram(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How many elements of two same-dtype low-precision tensors are 0, 1, 2, >2 ULP steps
    apart (integer steps of the format; NaN vs NaN counts as 0, NaN vs a number as >2)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"need equal dtype and shape, got {a.dtype}{tuple(a.shape)} and {b.dtype}{tuple(b.shape)}")
    if a.element_size() not in (1, 2):
        raise ValueError(f"ulp_diff_histogram takes 16- or 8-bit floats, got {a.dtype}")
    d = (ordered_bits(a) - ordered_bits(b)).abs()
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    d = torch.where(na & nb, torch.zeros_like(d), d)
    d = torch.where(na ^ nb, torch.full_like(d, 1 << 20), d)
    n = d.numel()
    counts = {"0": int((d == 0).sum()), "1": int((d == 1).sum()), "2": int((d == 2).sum()), ">2": int((d > 2).sum())}
    counts["total"] = n
    counts["max"] = int(d.max()) if n else 0
    counts["fraction_within_1"] = (counts["0"] + counts["1"]) / n if n else 1.0
    return counts


def row_scaled_ulp_diff(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> dict:
    """|a - b| in ULPs of a's dtype at the *row's* largest reference magnitude (the last dim is
    the row: an attention output row is a convex combination of V rows, so its rounding scale
    is set by its largest entries).  Integer ULP steps overstate differences of entries near 0,
    where the format's spacing is tiny; this measure does not.  Counts of <= 1, <= 2, > 2."""
    fmt = format_of(a.dtype)
    scale = ulp_of(ref.double().abs().amax(dim=-1, keepdim=True), fmt)
    d = (a.double() - b.double()).abs() / scale
    both_nan = torch.isnan(a.double()) & torch.isnan(b.double())
    d = torch.where(both_nan, torch.zeros_like(d), d)
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    n = d.numel()
    return {
        "le_1": int((d <= 1).sum()),
        "le_2": int((d <= 2).sum()),
        "gt_2": int((d > 2).sum()),
        "max": float(d.max()) if n else 0.0,
        "total": n,
    }


#: the ULP-distance buckets of :func:`bit_diff`'s histogram: (label, lowest, highest distance)
ULP_BUCKETS = (("1", 1, 1), ("2", 2, 2), ("3-4", 3, 4), ("5-16", 5, 16), ("17-256", 17, 256), (">256", 257, None))


def bit_diff(base: torch.Tensor, cand: torch.Tensor) -> dict:
    """``cand`` against ``base`` (same shape and dtype: two kernels' results on the same inputs),
    bit for bit.  ``differ``: elements whose bit patterns differ (a NaN's payload and a zero's
    sign count: bit-identical means every bit); of those, ``ulp_histogram`` (:data:`ULP_BUCKETS`)
    and ``max_ulp`` over pairs where both are finite, ``max_ulp_at`` its index and the two values
    there, ``max_abs_change`` the largest |cand - base| there; ``nan_payload`` (both NaN, other
    bits), ``signed_zero`` (+0 against -0), ``new_nonfinite`` (finite in ``base``, NaN or inf in
    ``cand``), ``lost_nonfinite`` (the reverse) and ``nonfinite_changed`` (both non-finite, not
    the same value: NaN against inf, or the sign of an inf).  All counts are exact integers."""
    if base.shape != cand.shape or base.dtype != cand.dtype:
        raise ValueError(
            f"bit_diff needs tensors of one shape and dtype (the same call's results), got "
            f"{base.dtype}{tuple(base.shape)} and {cand.dtype}{tuple(cand.shape)}"
        )
    n = base.numel()
    diff = bit_view(base) != bit_view(cand)
    rec = {"elements": n, "differ": int(diff.sum())}
    fa, fb = torch.isfinite(base.float()), torch.isfinite(cand.float())  # .float(): fp8 has no isfinite kernel
    nan_a, nan_b = torch.isnan(base.float()), torch.isnan(cand.float())
    both = fa & fb & diff
    zero = both & (base.float() == 0) & (cand.float() == 0)
    rec["signed_zero"] = int(zero.sum())
    rec["nan_payload"] = int((nan_a & nan_b & diff).sum())
    rec["new_nonfinite"] = int((fa & ~fb).sum())
    rec["lost_nonfinite"] = int((~fa & fb).sum())
    rec["nonfinite_changed"] = int((~fa & ~fb & diff & ~(nan_a & nan_b)).sum())
    steps = torch.where(both, step_distance(base, cand), torch.zeros((), dtype=torch.int64, device=base.device))
    hist = {}
    for label, lo, hi in ULP_BUCKETS:
        sel = steps >= lo if hi is None else (steps >= lo) & (steps <= hi)
        hist[label] = int(sel.sum())
    rec["ulp_histogram"] = hist
    rec["max_ulp"] = int(steps.max()) if n else 0
    rec["max_ulp_at"] = None
    rec["max_abs_change"] = 0.0
    if rec["max_ulp"] > 0:
        flat = int(steps.flatten().argmax())
        idx = _index(flat, base.shape)
        rec["max_ulp_at"] = {"index": list(idx), "base": float(base[idx]), "cand": float(cand[idx])}
        change = (cand.double() - base.double()).abs()
        rec["max_abs_change"] = float(torch.where(both, change, torch.zeros_like(change)).max())
    return rec


def fa_criterion(out: torch.Tensor, ref: torch.Tensor, out_lowprec: torch.Tensor) -> dict:
    """FlashAttention's test criterion (flash-attention/tests/cute/test_flash_attn.py): pass iff
    max|out - ref| <= 2 * max|out_lowprec - ref| + 2 * rounding, where rounding is the output
    dtype's unit roundoff times max|ref| (its ``(ref + 0.3 - 0.3 - ref).abs().max()``)."""
    fmt = format_of(out.dtype)
    r = ref.double()
    err = float((out.double() - r).abs().max())
    base = float((out_lowprec.double() - r).abs().max())
    rounding = fmt.unit_roundoff * float(r.abs().max()) if r.numel() else 0.0
    allowed = 2 * base + 2 * rounding
    return {
        "max_abs": err,
        "lowprec_max_abs": base,
        "allowed": allowed,
        "passed": err <= allowed and math.isfinite(err),
    }


def fa_floor(
    out: torch.Tensor,
    ref: torch.Tensor,
    out_lowprec: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
) -> dict:
    """The terms of FA's criterion as the audit records them, over the elements where the FP64
    reference is finite: ``max_abs`` (NaN/inf in ``out`` there counts as inf), ``lowprec_max_abs``
    (PyTorch's error in the input dtype) and ``rounding`` (``out``'s unit roundoff times max|ref|);
    the verdict combines them under the thresholds (``audits.verdict.gate``).

    ``scale`` (float64, ``ref``'s shape): each element's *scale*, the same sum as the FP64
    reference taken over the absolute values of its terms (e.g. sum_j P_ij |V_jc| for the output;
    ``numerics.grad_reference.attention_grad_reference(scales=True)`` for the gradients).  With it
    the record gains ``scale``, its largest finite value where the reference is finite: the
    magnitude the quantity's float32 arithmetic rounds at, which is not 0 where the reference
    itself is 0 or cancels; the verdict floors the criterion's allowance with it
    (``audits.verdict.gate``)."""
    fin = torch.isfinite(ref)
    r = torch.where(fin, ref, 0.0)
    err = torch.where(fin, (out.double() - ref).abs(), 0.0).nan_to_num(float("inf"))
    low = torch.where(fin, (out_lowprec.double() - ref).abs(), 0.0).nan_to_num(0.0)
    res = {
        "max_abs": float(err.max()) if err.numel() else 0.0,
        "lowprec_max_abs": float(low.max()) if low.numel() else 0.0,
        "rounding": format_of(out.dtype).unit_roundoff * float(r.abs().max()) if r.numel() else 0.0,
    }
    if scale is not None:
        s = scale.double().abs()
        s = torch.where(fin & torch.isfinite(s), s, 0.0)
        res["scale"] = float(s.max()) if s.numel() else 0.0
    return res


def _against(err: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> tuple[int, float, int]:
    """(violations, tightness, nonfinite) of absolute errors ``err`` against a per-element ``bound``.
    Checked where the reference and the bound are finite (a non-finite bound means the inputs
    leave the analysis' domain); there a NaN or inf error is a violation, and ``nonfinite`` counts
    those.  Tightness: the largest err / bound over finite errors (0 / 0 counts as 0), so it says
    nothing of the non-finite ones: a reader of ``tightness`` reads ``nonfinite`` beside it."""
    checked = torch.isfinite(ref) & torch.isfinite(bound)
    violations = int((checked & ~(err <= bound)).sum())
    nonfinite = int((checked & ~torch.isfinite(err)).sum())
    fin = checked & torch.isfinite(err)
    ratio = torch.where(fin & (err > 0), err / bound.clamp(min=1e-300), torch.zeros_like(err))
    return violations, float(ratio.max()) if ratio.numel() else 0.0, nonfinite


def bound_check(out, ref, out_bound, lse=None, ref_lse=None, lse_bound=None) -> dict:
    """The one per-element bound check (the runner and fidelity use it): violations and
    tightness of the output against ``out_bound`` and, when given, of the LSE against
    ``lse_bound``; ``nonfinite`` / ``lse_nonfinite``: how many of the violations are NaN or inf
    errors (a non-finite result where the reference is finite: no ratio to the bound; the
    tightness is over the finite ones); ``max_bound`` is the largest finite output bound."""
    err = (out.double() - ref.double()).abs()
    v, t, nf = _against(err, ref, out_bound)
    res = {"violations": v, "tightness": t, "nonfinite": nf, "lse_violations": 0, "lse_tightness": 0.0}
    fb = out_bound[torch.isfinite(out_bound)]
    res["max_bound"] = float(fb.max()) if fb.numel() else 0.0
    if lse is not None:
        lerr = (lse.double() - ref_lse.double()).abs()
        lerr = torch.where(torch.isinf(ref_lse) & (lse.double() == ref_lse), torch.zeros_like(lerr), lerr)
        res["lse_violations"], res["lse_tightness"], res["lse_nonfinite"] = _against(lerr, ref_lse, lse_bound)
    return res


def _z(mean: float, stderr: float) -> float:
    """mean / stderr; 0 for a zero mean, +-inf for a nonzero mean without spread (every error the
    same nonzero value: a bias no sampling explains)."""
    if mean == 0:
        return 0.0
    return mean / stderr if stderr > 0 else math.copysign(math.inf, mean)


def _clustered_z(e: torch.Tensor, both: torch.Tensor, mean: float, n: int, dim: int) -> tuple[int, float]:
    """(clusters, z) of the mean ``mean`` of ``e`` over ``both``'s ``n`` elements with the
    cluster-robust standard error, a cluster being the elements that differ only along ``dim``:
    sqrt(sum_c (sum_{i in c} (e_i - mean))**2) / n, times sqrt(G / (G - 1)) for G clusters."""
    sums = torch.where(both, e - mean, torch.zeros_like(e)).sum(dim=dim)
    g = int(both.any(dim=dim).sum())
    stderr = math.sqrt(float((sums**2).sum())) / n * math.sqrt(g / max(g - 1, 1))
    return g, _z(mean, stderr)


def signed_bias(
    got: torch.Tensor,
    ref: torch.Tensor,
    *,
    row_dim: int | None = -1,
    col_dim: int | None = None,
    ulp_floor: float = 0.0,
) -> dict:
    """Whether ``got``'s errors against the float64 reference ``ref`` (same shape) lean one way,
    over the elements where both are finite: ``n``; ``mean`` the mean signed error (got - ref),
    ``stderr`` its standard error (std / sqrt(n)) and ``z`` = mean / stderr; ``mean_ulp``,
    ``stderr_ulp``, ``z_ulp`` the same with each error in ULPs of ``got``'s dtype (float32 for a
    dtype without a format) at its reference; ``z_rows`` / ``z_cols`` (with ``rows`` / ``cols``
    clusters) and ``z_cluster``, the smaller of them in magnitude: ``z_ulp`` with the standard error
    clustered (below).  Error bounds bound magnitudes; a kernel that rounds toward zero instead
    of to nearest stays inside them while every output leans the same way, and a bias
    accumulates where an unbiased error averages out (Qiu & Yao, arXiv 2510.04212: biased bf16
    rounding in P V, where rows hold several tied maxima, derails training).

    Why ULPs: raw errors scale with the values, so a mean over elements of different magnitudes
    is dominated by the largest and says nothing of the rounding; in ULPs every element's error
    is on the rounding's own scale and a rounding toward zero reads about -0.5 whatever the
    magnitudes.  The ULP is taken at the row's largest |reference| (``row_dim``: the dimension a
    row runs along, e.g. -1 for an output's head-dim columns; None: each element's own), not at
    the element's: an attention output row is a weighted sum of V rows, its P and its sums round
    at the row's scale, and an element near 0 measured in its own tiny ULP would swamp the mean.
    ``ulp_floor``: the ULP is never taken below that magnitude (an LSE near 0 still carries the
    absolute rounding of log(l) at 1: pass 1.0).

    Caveat: the elements are not independent, so std / sqrt(n) understates the standard error and
    ``z`` overstates significance.  A row's elements share its P and its normaliser; the elements
    of one column (``col_dim``: the dimension a column runs along, the query rows of an output)
    share V, and where the rows' weights are alike their outputs are alike and round alike (on
    the tied_max family with 1,024 keys the FP64 reference rounded to nearest has z_ulp -8 on a
    mean of -0.02 ULP).  ``z_rows`` and ``z_cols`` are the cluster-robust z over rows and over
    columns (a cluster's deviations summed before squaring, :func:`_clustered_z`), and
    ``z_cluster`` keeps the more conservative.  Correlation across both remains; the verdict's
    threshold (thresholds.toml ``[bias]``) is therefore set from the largest |z_cluster| measured
    on correct kernels, with margin, not from a normal tail, and it also requires a mean of at
    least ``[bias] min_ulps`` ULPs."""
    if got.shape != ref.shape:
        raise ValueError(f"shapes differ: got {tuple(got.shape)} vs reference {tuple(ref.shape)}")
    try:
        fmt = format_of(got.dtype)
    except ValueError:
        fmt = format_of(torch.float32)
    g, r = got.double(), ref.double()
    both = torch.isfinite(g) & torch.isfinite(r)
    mag = torch.where(both, r.abs(), torch.zeros_like(r))
    if row_dim is not None and mag.dim():
        mag = mag.amax(dim=row_dim, keepdim=True).expand_as(r)
    err = torch.where(both, g - r, torch.zeros_like(r))
    e_ulp = err / ulp_of(mag.clamp(min=ulp_floor), fmt)
    n = int(both.sum())
    res = {"n": n, "dtype": fmt.name, "mean": 0.0, "stderr": 0.0, "z": 0.0, "mean_ulp": 0.0, "stderr_ulp": 0.0}
    res.update(z_ulp=0.0, rows=n, z_rows=0.0, cols=n, z_cols=0.0, z_cluster=0.0)
    if n == 0:
        return res
    for key, e in (("", err), ("_ulp", e_ulp)):
        mean = float(e.sum()) / n
        dev = torch.where(both, e - mean, torch.zeros_like(e))
        stderr = math.sqrt(float((dev**2).sum()) / max(n - 1, 1) / n)
        res["mean" + key], res["stderr" + key], res["z" + key] = mean, stderr, _z(mean, stderr)
    res["z_rows"] = res["z_cols"] = res["z_ulp"]
    for name, dim in (("rows", row_dim), ("cols", col_dim)):
        if dim is not None and e_ulp.dim():
            res[name], res["z_" + name] = _clustered_z(e_ulp, both, res["mean_ulp"], n, dim)
    res["z_cluster"] = min(res["z_rows"], res["z_cols"], key=abs)
    return res


def bias_record(*, out: torch.Tensor, ref: torch.Tensor, lse: torch.Tensor | None, ref_lse: torch.Tensor) -> dict:
    """A case's signed-bias statistics (:func:`signed_bias`) as its record keeps them
    (``rec["bias"]``): ``out`` in ULPs of the output dtype at each row's largest |reference| (the
    head-dim columns are the row), clustered by row and by column (a batch, head and head-dim
    column over the query rows); ``lse`` (None when the kernel returned none) in float32 ULPs at
    its own |reference|, never below 1 (the log of a row sum >= 1 rounds at that scale).  Out:
    (b, s_q, h_q, dv), lse (b, h_q, s_q), as the audited call returns them (a varlen result with a
    leading batch of 1)."""
    return {
        "out": signed_bias(out, ref, row_dim=-1, col_dim=1),
        "lse": None if lse is None else signed_bias(lse, ref_lse, row_dim=None, ulp_floor=1.0),
    }
