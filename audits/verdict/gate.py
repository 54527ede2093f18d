"""Verdicts: a case's measurements judged against the thresholds (TOML).

Rules (docs/design.md, "Numerical conventions"): output and LSE are both checked, elementwise; a NaN
or inf where the reference is finite fails; a finite value where the reference is NaN is a
semantics deviation (warning or failure by policy); FA4 kernels must stay within the per-element
forward-pass bound; FA's test criterion is a floor for every kernel.  Each check returns what it
found as typed records (:func:`findings`, ``audits.verdict.findings.Finding``); :func:`judge` gives
the verdict, the worst of their severities, and the case's reasons, the findings in words.
"""

from __future__ import annotations

from pathlib import Path

from audits.common import read_toml
from audits.report.records import CaseRecord
from audits.verdict.findings import Finding, render
from numerics.fp import format_of
from numerics.metrics import nan_aware_max

__all__ = [
    "DEFAULT_THRESHOLDS",
    "load_thresholds",
    "require_backward",
    "require_compare",
    "judge",
    "judge_against_baseline",
    "rejudge",
    "ThresholdsError",
    "backward_verdict",
    "ungated_figures",
    "fa_allowed",
    "FA_FLOOR",
    "DSINK_ROUNDED_OUT",
    "DSINK_TAIL",
    "grad_fa_allowed",
    "lse_allowed",
    "certified_allowed",
    "bound_gated",
    "findings",
    "against_baseline",
    "bias_findings",
]

DEFAULT_THRESHOLDS = Path(__file__).with_name("thresholds.toml")
_KEYS = {
    "policy": {
        "nan_swallowed": str,
        "lse_missing": str,
        "bound": bool,
        "peer_bound": bool,
        "claim_float32_overflow": bool,
        "fa_criterion": bool,
        "fa_multiplier": float,
        "fa_criterion_dtypes": list,
    },
    "lse": {"max_abs": float, "rel": float},
    "reference": {"mpmath_max_abs": float},
    "baseline": {"max_ratio": float},
}
#: [backward] (optional: required by runs with --backward, ``require_backward``)
_BACKWARD_KEYS = {
    "bound": bool, "peer_bound": bool, "fa_criterion": bool, "softcap_multiplier": float, "softcap_abs": float,
    "mpmath_max_rel": float,
}  # fmt: skip
_GRAD_KEYS = {
    "dq": {"fa_multiplier": float},
    "dk": {"fa_multiplier": float},
    "dv": {"fa_multiplier": float},
    "dsink": {"fa_multiplier": float, "ulps": float},
}


class ThresholdsError(ValueError):
    """A malformed thresholds file; the message names the file, the line (when TOML says it)
    and the key."""


def load_thresholds(path: str | Path | None = None) -> dict:
    """Parse and validate a thresholds file (default: the shipped one)."""
    p = Path(path) if path is not None else DEFAULT_THRESHOLDS
    data = read_toml(p, what="thresholds", error=ThresholdsError)
    for section, keys in _KEYS.items():
        _table(p, data, section, keys)
    if "backward" in data:
        bwd = data["backward"]
        _table(p, data, "backward", {**_BACKWARD_KEYS, **{g: dict for g in _GRAD_KEYS}})
        for g, keys in _GRAD_KEYS.items():
            _table(p, bwd, g, keys, name=f"backward.{g}")
    if "compare" in data:  # fa4-audit compare's regression rule; optional like [backward]
        _table(p, data, "compare", _COMPARE_KEYS)
    if "bias" in data:  # the rounding-bias warning; optional: without it, no bias finding
        _table(p, data, "bias", _BIAS_KEYS)
    for key in ("nan_swallowed", "lse_missing"):
        if data["policy"][key] not in ("warn", "fail"):
            raise ThresholdsError(f"{p}: [policy] {key} must be 'warn' or 'fail', got {data['policy'][key]!r}")
    data["path"] = str(p)
    return data


def _table(p: Path, data: dict, section: str, keys: dict, *, name: str | None = None) -> None:
    """Check one table of a thresholds file: present, every key there with its type (an integer
    accepted for a float), no unknown key."""
    name = name or section
    if section not in data or not isinstance(data[section], dict):
        raise ThresholdsError(f"{p}: missing table [{name}] (keys {', '.join(keys)})")
    for key, typ in keys.items():
        if key not in data[section]:
            raise ThresholdsError(f"{p}: [{name}] lacks the key {key!r}")
        val = data[section][key]
        if typ is float and isinstance(val, int) and not isinstance(val, bool):
            val = data[section][key] = float(val)
        if not isinstance(val, typ):
            raise ThresholdsError(f"{p}: [{name}] {key} = {val!r} must be a {typ.__name__}")
    unknown = set(data[section]) - set(keys)
    if unknown:
        bad = ", ".join(sorted(unknown))
        raise ThresholdsError(f"{p}: [{name}] has unknown key(s) {bad}; accepted: {', '.join(keys)}")


#: [compare]: what ``fa4-audit compare`` calls a tightness regression (``audits.report.compare``)
_COMPARE_KEYS = {"tightness_ratio": float, "tightness_floor": float}


#: [bias]: when a case's signed bias is a finding (:func:`bias_findings`; thresholds.toml says why)
_BIAS_KEYS = {"z_max": float, "min_ulps": float, "lse_min_ulps": float}


def require_compare(th: dict) -> None:
    """ThresholdsError unless ``th`` has the [compare] table ``fa4-audit compare`` judges by."""
    if "compare" not in th:
        raise ThresholdsError(
            f"{th.get('path', 'thresholds')}: no [compare] table, which compare needs; copy [compare] from the "
            f"shipped {DEFAULT_THRESHOLDS}"
        )


def require_backward(th: dict) -> None:
    """ThresholdsError unless ``th`` has the [backward] tables a --backward run judges by."""
    if "backward" not in th:
        raise ThresholdsError(
            f"{th.get('path', 'thresholds')}: no [backward] table, which --backward needs; copy [backward] and "
            f"[backward.dq/dk/dv/dsink] from the shipped {DEFAULT_THRESHOLDS}"
        )


#: a value class of ``numerics.metrics.VALUE_CLASSES`` in words
_HOLDS = {"finite": "a finite value", "NaN": "NaN", "+inf": "+inf", "-inf": "-inf"}
#: why the FP64 reference holds a non-finite class, where the class alone makes it certain
#: (``numerics.reference``: the inputs are exact in float64, whose products and sums of float32-range
#: values cannot overflow, and learnable sinks are finite, audits.suites.inputs.SINK_PLACES): an LSE is NaN
#: only when a visible score is NaN, +inf only when one is +inf, -inf only when the row has no
#: visible key (or only -inf scores) and no sink; an output is NaN only when non-finite inputs reach
#: the row, +-inf only when V holds an infinity at a key the row gives positive weight.  Gradients:
#: NaN/inf only from non-finite inputs (``numerics.grad_reference``)
_CAUSES = {
    "LSE": {
        "NaN": "a visible score is NaN: a NaN or inf in q or k",
        "+inf": "a visible score is +inf: an inf in q or k",
        "-inf": "the row sees no key, or only -inf scores",
    },
    "out": {"NaN": "NaN or inf inputs reach the row", "+inf": "an inf in V at a visible key",
            "-inf": "an inf in V at a visible key"},
    "grad": dict.fromkeys(("NaN", "+inf", "-inf"), "from NaN or inf inputs"),
    # a gradient record with beyond_range: its exact value past the dtype's range, rounded to the
    # infinity (numerics.metrics.rounded_overflow); with finite inputs nothing else makes it infinite
    "grad-range": {"NaN": "from NaN or inf inputs",
                   "+inf": "the exact gradient is beyond the dtype's range: it rounds to +inf",
                   "-inf": "the exact gradient is beyond the dtype's range: it rounds to -inf"},
}  # fmt: skip


def _nonfinite(r: dict, noun: tuple[str, str], kind: str, th: dict, *, ref: str, quantity: str = "") -> list[Finding]:
    """Findings of a tensor's non-finite mismatches (``numerics.metrics.output_errors`` /
    ``lse_errors``: ``r``): how many elements, what the kernel returns and what the FP64 reference
    (``ref``, e.g. "FP64 reference") holds there, and why the reference is non-finite where its
    class says so (:data:`_CAUSES` of ``kind``: "out", "LSE", "grad").  Severity: a non-finite
    value where the reference is finite fails; a differing value where non-finite inputs make the
    reference NaN/inf is a semantics deviation (policy ``nan_swallowed``); an LSE other than -inf
    where the reference is -inf fails.  A record without the breakdown gets the counts alone.
    ``quantity``: the tensor (default ``kind``)."""
    quantity = quantity or kind
    groups = [("fail", r["nonfinite_where_ref_finite"], {"finite"})]
    if kind == "LSE":  # -inf is the empty row's convention, its own check
        groups += [
            (th["policy"]["nan_swallowed"], r["nan_swallowed"], {"NaN", "+inf"}),
            ("fail", r.get("mismatched_nonfinite", 0), {"-inf"}),
        ]
    else:
        groups.append((th["policy"]["nan_swallowed"], r["nan_swallowed"], {"NaN", "+inf", "-inf"}))
    pairs = r.get("nonfinite_mismatches")
    pairs = pairs if isinstance(pairs, dict) else {}
    found = []
    for i, (sev, n, refs) in enumerate(groups):
        if not n:
            continue
        base = {"noun": noun, "ref": ref, "group": i}
        mine = [
            (k.split("|"), c)
            for k, c in pairs.items()
            if isinstance(c, int) and k.count("|") == 1 and k.split("|")[1] in refs
        ]
        if sum(c for _, c in mine) != n or any(g not in _HOLDS or v not in _HOLDS for (g, v), _ in mine):
            cause = _CAUSES["LSE"]["-inf"] if i == 2 else None
            found.append(Finding(sev, "nonfinite", quantity, n, detail={**base, "holds": None, "cause": cause}))
            continue
        for want in dict.fromkeys(v for (_, v), _ in mine):  # one finding per reference class, most first
            got = tuple((_HOLDS[g], c) for (g, v), c in mine if v == want)
            detail = {**base, "holds": got, "ref_class": want, "cause": _CAUSES[kind].get(want)}
            found.append(Finding(sev, "nonfinite", quantity, sum(c for _, c in got), detail=detail))
    return found


def _semantics(m: CaseRecord, th: dict) -> list[Finding]:
    """Non-finite values against the reference: NaN/inf where it is finite fails; a finite
    value where non-finite inputs make it NaN/inf is a semantics deviation (policy); an LSE other
    than -inf on a row with no visible key fails (:func:`_nonfinite`)."""
    found = _nonfinite(m["out"], ("output", "outputs"), "out", th, ref="FP64 reference")
    if m.get("lse") is not None:
        found += _nonfinite(m["lse"], ("LSE value", "LSE values"), "LSE", th, ref="FP64 reference")
    return found


def _bound_gated(kind: str | None, table: dict) -> bool:
    """Whether a per-element bound of ``kind`` ("fa4": the kernel implements FA4's numerics; else
    a peer's generic flash-attention numerics) gates, under the [policy] or [backward] ``table``."""
    return table["bound"] if kind == "fa4" else table["peer_bound"]


def bound_gated(*, m: CaseRecord, th: dict, backward: bool = False) -> bool:
    """Whether case record ``m``'s per-element bound gates it under ``th``: the forward's (its
    ``bound.kind``) or, with ``backward``, the gradients' (``backward.bound_kind``).  Public: the
    per-element localization (``audits.verdict.diagnosis``) counts a criterion only where it gates."""
    if backward:
        return _bound_gated((m.get("backward") or {}).get("bound_kind"), th["backward"])
    return _bound_gated((m.get("bound") or {}).get("kind"), th["policy"])


def _bound(m: CaseRecord, th: dict) -> list[Finding]:
    """The per-element forward bound (FA4 numerics, or generic flash-attention numerics for peers):
    one finding per quantity that exceeds it (out, LSE), each with its own count and worst
    error/bound, and the evidence the record holds on what the excess means (:func:`_evidence`)."""
    b = m.get("bound")
    applies = _bound_gated((b or {}).get("kind"), th["policy"])
    if b is None or not applies:
        return []
    found = []
    # NaN/inf results where the reference is finite are the non-finite finding's (_semantics), said
    # once there: here only the finite violations, whose worst ratio is the tightness (a record
    # from before the split counts them all)
    if n := b["violations"] - b.get("nonfinite", 0):
        found.append(Finding("fail", "bound", "out", n, b["tightness"], 1.0, _evidence(m, th, "out")))
    if n := b["lse_violations"] - b.get("lse_nonfinite", 0):  # a record from before lse_tightness: no ratio
        worst = b.get("lse_tightness")
        found.append(Finding("fail", "bound", "LSE", n, worst, 1.0, _evidence(m, th, "LSE")))
    return found


def _evidence(m: CaseRecord, th: dict, quantity: str) -> dict:
    """What case record ``m`` says about a bound violation of ``quantity`` ("out", "LSE", or a
    gradient), for its words (``audits.verdict.findings``): ``fa`` whether FA's criterion passes
    the quantity (for the LSE: the output; None where it does not gate the case), ``lse_ceiling``
    whether the LSE is within the [lse] ceiling (for the LSE), and ``certified`` whether the exact
    (mpmath) evaluation agrees with the FP64 reference on the sampled row or elements (None: not
    evaluated on this case), and ``model`` (where the record has ``model_check``): whether the FA4
    model of the arithmetic the bound analyses stays within it on the same inputs.  Where both
    references agree, the excess is the kernel's, not the reference's; with FA's criterion
    passing, the kernel is close to the exact result but outside the arithmetic the bound
    analyses; with the model beyond the bound too, the analysis misses a step of it."""
    if quantity in ("out", "LSE"):
        fa, allowed = m.get("fa_criterion"), fa_allowed(m=m, th=th)
        passes = None if allowed is None else fa["max_abs"] <= allowed
        cert, limit = m.get("mpmath_max_abs"), certified_allowed(m=m, th=th)
    else:
        b = m.get("backward") or {}
        fa, allowed = b["grads"][quantity].get("fa_criterion"), grad_fa_allowed(m=m, grad=quantity, th=th)
        if allowed is None:
            passes = None
        elif isinstance(allowed, list):  # dsink, per head
            passes = all(e <= a for e, a in zip(fa["errors"], allowed))
        else:
            passes = fa["max_abs"] <= allowed
        cert, limit = (b.get("certified") or {}).get(quantity), th["backward"]["mpmath_max_rel"]
    out = {"fa": passes, "certified": None if cert is None else cert <= limit}
    mc = m.get("model_check")  # the FA4 model on the same inputs, same bound (audits.engine.evaluate)
    if mc is not None and quantity in ("out", "LSE"):
        pre = "" if quantity == "out" else "lse_"
        n, worst = mc[pre + "violations"], mc[pre + "tightness"]
        out["model"] = {"numerics": mc["numerics"], "within": n == 0, "worst": worst}
    if quantity == "LSE":
        lse, ceiling = m.get("lse"), lse_allowed(m=m, th=th)
        # NaN-aware: an LSE with NaN/inf where the reference is finite is not within any ceiling
        out["lse_ceiling"] = None if ceiling is None else nan_aware_max(lse) <= ceiling
    return out


def fa_allowed(*, m: CaseRecord, th: dict) -> float | None:
    """The largest |out - ref| FlashAttention's criterion allows case record ``m`` under ``th``
    (``fa_multiplier`` x PyTorch's error in the input dtype + 2 x the output's rounding), or None
    where the criterion does not gate the case (off, a dtype PyTorch does not compute in, not
    measured).  Public: the verdict here and the per-element localization
    (``audits.verdict.diagnosis``) read the one rule."""
    fa, pol = m.get("fa_criterion"), th["policy"]
    if fa is None or not pol["fa_criterion"] or m["config"]["dtype"] not in pol["fa_criterion_dtypes"]:
        return None
    # never below the float32 rounding at the output's scale (FA_FLOOR); a record from before the
    # scale was measured keeps FA's allowance alone
    return max(pol["fa_multiplier"] * fa["lowprec_max_abs"] + 2 * fa["rounding"], _floor(fa.get("scale")))


#: FA's criterion's floor, relative to the quantity's scale S (``numerics.metrics.fa_floor``: the
#: same sum over absolute values, dS's terms before they cancel): the allowance is never below
#: FA_FLOOR * S (thresholds.toml, [policy] fa_criterion, states the rule and its derivation).
#: 2**-16 = 256 float32 unit roundoffs (2**-24): where PyTorch's low-precision result is exact
#: (one key per row: dq = dk = 0 exactly) a correct kernel still errs by its float32 arithmetic,
#: dot products of length <= 256 (FA4's largest head dim) whose error is at most ~length * 2**-24
#: of their magnitudes (first order, all roundings aligned).  Loose there (measured: 7.4e-7 of a
#: floor 2.5e-4, the worst of fa4-model and a float32 FA-style backward at seqlen 3x1), and far
#: below any 16-bit rounding (bf16 2**-8, fp16 2**-11), so it never lets a seeded bug pass where
#: FA's allowance failed it.
FA_FLOOR = 2.0**-16


def _floor(scale) -> float:
    """The floor of FA's criterion at ``scale`` (None: a record without it, no floor)."""
    return 0.0 if scale is None else FA_FLOOR * scale


#: dsink's allowance adds DSINK_ROUNDED_OUT * DSINK_TAIL * u * R per head, u the input dtype's unit
#: roundoff and R = sqrt(sum_{batch, i, c} (P_sink,i dO_ic O_ic)^2) (the record's ``head_out_rss``,
#: from ``numerics.grad_reference.attention_grad_reference(scales=True)``): what forming D from the
#: output rounded to the input dtype moves dsink by, legitimate flash-attention arithmetic that
#: PyTorch's reference does not do.  FlashAttention's backward preprocessing takes D_i = rowsum(dO_i
#: * O_i) from the stored 16-bit O (flash_attn/cute/flash_bwd_preprocess.py,
#: ``FlashAttentionBackwardPreprocess``; FA2: csrc/flash_attn/src/flash_bwd_preprocess_kernel.h,
#: ``dot_do_o``), while autograd forms D as sum_j P_ij dP_ij and never rounds O, so FA's criterion,
#: built from PyTorch's error, has no room for it.
#: Derivation: dsink = -sum_i P_sink,i D_i; the kernel's stored O_hat = fl(O~), O~ its float32
#: output, so |O_hat - O| <= u |O| + |O~ - O| (1 + u), at most ~2u |O| per element for a kernel whose
#: float32 output errs at the 16-bit scale (DSINK_ROUNDED_OUT = 2); the float32 dot product over
#: dv <= 256 adds at most dv * 2**-24 <= u/32 (fp16) of the same terms.  The first-order worst case,
#: 2u sum_i P_sink,i sum_c |dO_ic| |O_ic|, is vacuous: measured on the 17 H200 release-backward
#: cases it exceeds |dsink| itself on 12 (down to 1e-3 |dsink|), so a missing dsink would pass.  The
#: roundings of different elements are independent, zero-mean in the standard probabilistic model
#: (Higham and Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput.
#: 2019): by Hoeffding's inequality |sum_k delta_k a_k| <= lambda * 2u sqrt(sum a_k^2) with
#: probability >= 1 - 2 exp(-lambda^2 / 2); DSINK_TAIL = lambda = 4: 1 - 6.7e-4 per head.  Measured
#: (thresholds.toml, [backward.dsink]): production's dsink errs at most 1.7 u R (0.21 of the term),
#: while a missing or wrongly signed dsink stays >= 30x the allowance on every one of those cases.
DSINK_ROUNDED_OUT = 2.0
DSINK_TAIL = 4.0


def _rounded_out(out_rss, dtype: str) -> float:
    """dsink's share of rounding the output to ``dtype`` at one head's ``out_rss`` (None: a record
    without it, nothing added): :data:`DSINK_ROUNDED_OUT` * :data:`DSINK_TAIL` * u * out_rss."""
    return 0.0 if out_rss is None else DSINK_ROUNDED_OUT * DSINK_TAIL * format_of(dtype).unit_roundoff * out_rss


def _floor_detail(scale, allowed: float) -> dict:
    """A FA-criterion finding's ``detail`` when the floor at ``scale`` is the allowance:
    ``scale``, for its words."""
    floor = _floor(scale)
    return {"scale": scale} if floor > 0 and allowed == floor else {}


def _fa_criterion(m: CaseRecord, th: dict) -> list[Finding]:
    """FlashAttention's own test criterion, a floor for the dtypes PyTorch computes in."""
    fa, allowed = m.get("fa_criterion"), fa_allowed(m=m, th=th)
    if allowed is None or fa["max_abs"] <= allowed:
        return []
    detail = _floor_detail(fa.get("scale"), allowed)
    return [Finding("fail", "fa-criterion", "out", worst=fa["max_abs"], allowed=allowed, detail=detail)]


def lse_allowed(*, m: CaseRecord, th: dict) -> float | None:
    """The largest |lse - lse_fp64| the [lse] ceiling allows case record ``m`` (``max_abs`` + ``rel``
    x its largest finite |reference LSE|), or None when the record has no measured LSE.  Public:
    the verdict and ``audits.verdict.diagnosis`` read the one rule."""
    lse = m.get("lse")
    if lse is None:
        return None
    return th["lse"]["max_abs"] + th["lse"]["rel"] * lse.get("ref_max_abs", 0.0)


def _lse(m: CaseRecord, th: dict) -> list[Finding]:
    """The LSE: returned at all (policy ``lse_missing``), -inf on empty rows, within the ceiling."""
    lse = m.get("lse")
    if lse is None:
        return [Finding(th["policy"]["lse_missing"], "lse-missing", "LSE")] if m.get("lse_returned") is False else []
    # an LSE other than -inf where the reference is -inf: _semantics
    ref_max, allowed = lse.get("ref_max_abs", 0.0), lse_allowed(m=m, th=th)
    if lse["max_abs"] <= allowed:
        return []
    detail = {"max_abs": th["lse"]["max_abs"], "rel": th["lse"]["rel"], "ref_max": ref_max}
    return [Finding("fail", "lse-ceiling", "LSE", worst=lse["max_abs"], allowed=allowed, detail=detail)]


def certified_allowed(*, m: CaseRecord, th: dict) -> float:
    """The largest |FP64 - exact| the certification allows case record ``m``: ``[reference]
    mpmath_max_abs`` times its certified row's scale where that exceeds 1 (``mpmath_scale``; a
    record without it: the threshold alone).  The FP64 evaluation errs in proportion to the scale
    (its sums' terms' magnitudes): bf16 near_max rows, |V| ~ 3e38, differ from the exact row by
    ~1e23, 1e-16 of their scale, which an absolute threshold would call an uncertified reference
    (39 H200 release cases: out-of-domain there, so not yet gated; thresholds.toml)."""
    return th["reference"]["mpmath_max_abs"] * max(1.0, m.get("mpmath_scale") or 1.0)


def _certified(m: CaseRecord, th: dict) -> list[Finding]:
    """The FP64 reference itself, against the exact row, at the row's scale (:func:`certified_allowed`)."""
    cert, allowed = m.get("mpmath_max_abs"), certified_allowed(m=m, th=th)
    if cert is None or cert <= allowed:
        return []
    return [Finding("fail", "uncertified", "reference", worst=cert, allowed=allowed)]


def bias_findings(*, m: CaseRecord, th: dict) -> list[Finding]:
    """Rounding bias (a warning, inside any bound): per tensor of case record ``m``'s ``bias``
    (``numerics.metrics.bias_record``: out, LSE), a finding when its clustered z
    (``z_cluster``) exceeds ``[bias] z_max`` in magnitude and its mean signed error exceeds
    ``min_ulps`` ULPs of the output dtype (``lse_min_ulps`` float32 ULPs for the LSE): a mean
    the standard error cannot explain, and large enough to be the rounding's, not the last bits
    of a sum.  None without a [bias] table (older thresholds files) or a record without ``bias``.
    Public: ``audits.verdict.bias`` names the cause from the same rule."""
    bt, rec = th.get("bias"), m.get("bias")
    if not isinstance(bt, dict) or not isinstance(rec, dict):
        return []
    found = []
    for key, quantity, floor in (("out", "out", bt["min_ulps"]), ("lse", "LSE", bt["lse_min_ulps"])):
        b = rec.get(key)
        if not isinstance(b, dict) or not b.get("n"):
            continue
        z, mean = b.get("z_cluster", b.get("z_ulp", 0.0)), b.get("mean_ulp", 0.0)
        if abs(z) > bt["z_max"] and abs(mean) > floor:
            detail = {"mean_ulp": mean, "z_max": bt["z_max"], "min_ulps": floor, "dtype": b.get("dtype", "")}
            found.append(Finding("warn", "rounding-bias", quantity, b["n"], z, bt["z_max"], detail))
    return found


def _bias(m: CaseRecord, th: dict) -> list[Finding]:
    return bias_findings(m=m, th=th)


def _written_findings(w, what: str) -> list[Finding]:
    """Findings of a ``written`` record (``audits.engine.evaluate._judged_written``): the poisoned
    re-runs of a half the other checks accepted (``what``: "result", the forward's out and LSE;
    "gradients", dq, dk, dv).  Elements that took both fills were never written, elements that
    changed with them read such memory; either fails, whatever the values matched, since they
    were memory's."""
    if not isinstance(w, dict):
        return []
    found = []
    for key, kind in (("unwritten", "unwritten"), ("read", "memory-read")):
        if w.get(key):
            detail = {"where": w.get(f"{key}_where", ""), "memory_like": w.get("memory_like"), "what": what}
            found.append(Finding("fail", kind, "", w[key], detail=detail))  # no tensor: the half's together
    return found


def _written(m: CaseRecord, th: dict) -> list[Finding]:
    """The forward's result (out, LSE) against memory the kernel never wrote (:func:`_written_findings`)."""
    return _written_findings(m.get("written"), "result")


# _written first: where a result was never written, the other findings are about memory's values
_CHECKS = (_written, _semantics, _bound, _fa_criterion, _lse, _certified)
_RANK = {"pass": 0, "warn": 1, "skipped": 2, "out-of-domain": 3, "fail": 4, "error": 5, "timeout": 6, "crash": 7}


def _grad_values(b: dict, m: CaseRecord, th: dict) -> list[Finding]:
    """Each gradient against its FP64 reference: non-finite values, the per-element backward
    bound (FA4 numerics; peers by policy), and what autograd failed to return."""
    bt, found = th["backward"], []
    # a ContractRecord per gradient (audits.report.records); a string before they were typed
    found += [
        Finding("error", "grad-contract", c["tensor"], detail={"note": c["reason"]})
        if isinstance(c, dict)
        else Finding("error", "grad-contract", detail={"note": c})
        for c in b.get("contract", [])
    ]
    found += [Finding("fail", "grad-missing", n) for n in b["missing"]]
    for n, g in b["grads"].items():
        kind = "grad-range" if g.get("beyond_range") else "grad"
        found += _nonfinite(g, (f"{n} element", f"{n} elements"), kind, th, ref="FP64 gradient", quantity=n)
        bd = g.get("bound")
        applies = _bound_gated(b.get("bound_kind"), bt)
        if bd and applies and (count := bd["violations"] - bd.get("nonfinite", 0)):  # non-finite: said above
            evidence = _evidence(m, th, n)
            found.append(Finding("fail", "grad-bound", n, count, bd["tightness"], 1.0, evidence))
    return found


def grad_fa_allowed(*, m: CaseRecord, grad: str, th: dict) -> float | list[float] | None:
    """The largest |g - ref| FlashAttention's backward criterion allows gradient ``grad`` of case
    record ``m`` under ``th``: ``multiplier`` x PyTorch's error in the input dtype + 2 x rounding
    (+ ``softcap_abs`` with a softcap); for dsink, which FA checks per head, one value per head
    with ``ulps`` ULPs of |ref| in place of the rounding term, plus the term rounding the output to
    the input dtype before D = rowsum(dO * O) contributes (:data:`DSINK_ROUNDED_OUT`, where the
    record has ``head_out_rss``).  Never below :data:`FA_FLOOR` times
    the gradient's scale (per head for dsink) where the record has it.
    None where the criterion does not gate it (off, fp8, not measured).  Public: the verdict and
    ``audits.verdict.diagnosis`` read the one rule."""
    bt, cfg = th["backward"], m["config"]
    fa = ((((m.get("backward") or {}).get("grads") or {}).get(grad)) or {}).get("fa_criterion")
    if fa is None or not bt["fa_criterion"] or cfg["dtype"] not in th["policy"]["fa_criterion_dtypes"]:
        return None
    cap = bool(cfg.get("softcap"))
    mult = bt["softcap_multiplier"] if cap else bt[grad]["fa_multiplier"]
    extra = bt["softcap_abs"] if cap else 0.0
    if grad == "dsink":  # elementwise, 2 ULP of |ref| per head, + the rounded output's share of D
        n = len(fa["ulps_at_ref"])
        scales = fa.get("head_scales") or [None] * n
        rounded = [_rounded_out(r, cfg["dtype"]) for r in fa.get("head_out_rss") or [None] * n]
        return [
            max(mult * fa["lowprec_max_abs"] + bt["dsink"]["ulps"] * u + extra + r, _floor(s))
            for u, s, r in zip(fa["ulps_at_ref"], scales, rounded, strict=True)
        ]
    return max(mult * fa["lowprec_max_abs"] + 2 * fa["rounding"] + extra, _floor(fa.get("scale")))


def _grad_fa_criterion(b: dict, m: CaseRecord, th: dict) -> list[Finding]:
    """FlashAttention's backward criterion per gradient, a floor for bf16 / fp16."""
    found = []
    for n, g in b["grads"].items():
        fa, allowed = g.get("fa_criterion"), grad_fa_allowed(m=m, grad=n, th=th)
        if allowed is None:
            continue
        if n == "dsink":  # elementwise, 2 ULP of |ref| per head: the first head off
            bad = [i for i, (e, a) in enumerate(zip(fa["errors"], allowed)) if e > a]
            if bad:
                i = bad[0]
                scale = (fa.get("head_scales") or [None] * len(allowed))[i]
                detail = {"head": i, **_floor_detail(scale, allowed[i])}
                found.append(Finding("fail", "fa-criterion", n, len(bad), fa["errors"][i], allowed[i], detail))
            continue
        if fa["max_abs"] > allowed:
            detail = _floor_detail(fa.get("scale"), allowed)
            found.append(Finding("fail", "fa-criterion", n, worst=fa["max_abs"], allowed=allowed, detail=detail))
    return found


def _grad_semantics(b: dict, th: dict) -> list[Finding]:
    """Exact zeros, determinism under --deterministic, the FP64 gradients' certification."""
    z, found = b["zeros"], []
    for key, what in (("dk_unseen_nonzero", "dK"), ("dv_unseen_nonzero", "dV")):
        if z[key]:
            found.append(Finding("fail", "unseen-nonzero", what, z[key], detail={"unseen": z["unseen_keys"]}))
    if z["dq_empty_nonzero"]:
        rows = {"rows": z["empty_rows"]}
        found.append(Finding("fail", "empty-row-nonzero", "dQ", z["dq_empty_nonzero"], detail=rows))
    if b.get("deterministic"):
        for n, sp in b.get("spread", {}).items():
            if sp["differing"]:
                found.append(Finding("fail", "nondeterministic", n, sp["differing"], sp["max_ulp"], 0))
    for n, rel in b.get("certified", {}).items():
        if rel > th["backward"]["mpmath_max_rel"]:
            found.append(Finding("fail", "grad-uncertified", n, worst=rel, allowed=th["backward"]["mpmath_max_rel"]))
    return found


def _backward(m: CaseRecord, th: dict) -> list[Finding]:
    """The case's backward half (``audits.engine.backward``), when the run asked for it."""
    b = m.get("backward")
    if b is None:
        return []
    if b["status"] != "ran":
        return [Finding(b["status"], "backward", detail={"note": b.get("reason", "")})]
    require_backward(th)
    if b.get("out_of_domain") and not th["policy"]["claim_float32_overflow"]:
        return [Finding("out-of-domain", "backward", detail={"note": b["out_of_domain"]})]
    found = _grad_values(b, m, th) + _grad_fa_criterion(b, m, th) + _grad_semantics(b, th)
    return _written_findings(b.get("written"), "gradients") + found


def findings(m: CaseRecord, th: dict) -> list[Finding]:
    """What the checks find in one case's measurements ``m`` (see ``audits.engine.evaluate``)
    under the thresholds ``th``, in the order of its ``reasons``; none: it passes."""
    if m.get("status") in ("error", "skipped", "crash", "timeout"):
        return [Finding(m["status"], "status", detail={"note": m.get("reason", "")})]
    if _out_of_domain(m, th):
        return [Finding("out-of-domain", "out-of-domain", detail={"note": m.get("out_of_domain")})]
    found = [f for check in _CHECKS for f in check(m, th)] + _backward(m, th)
    # a rounding bias is a finding inside the bounds; past them the error is no rounding's
    return found + ([] if any(f.severity != "warn" for f in found) else _bias(m, th))


def _out_of_domain(m: CaseRecord, th: dict) -> bool:
    """Whether the case's inputs are outside the kernel's domain and its result shows it: the whole
    case is out-of-domain then, its gradients with it (the same inputs).  Decided by the record's
    fields only (old records: audits.report.schema.upgrade_case)."""
    kind, lse = m.get("out_of_domain_kind"), m.get("lse") or {}
    nonfinite_claim = kind == "nonfinite-inputs"  # the kernel's own domain (audits.kernels)
    overflowed = (m.get("out") or {}).get("nonfinite_where_ref_finite") or lse.get("nonfinite_where_ref_finite")
    return bool(kind is not None and (nonfinite_claim or not th["policy"]["claim_float32_overflow"]) and overflowed)


def _worst(found: list[Finding]) -> str:
    """The verdict of a list of findings: the worst severity, pass for none."""
    return max((f.severity for f in found), key=_RANK.__getitem__, default="pass")


def judge(m: CaseRecord, th: dict) -> tuple[str, list[str]]:
    """(verdict, reasons) for one case's measurements ``m``: the worst severity of its
    :func:`findings`, and each of them in words (``audits.verdict.findings.render``)."""
    found = findings(m, th)
    return _worst(found), [render(f) for f in found]


def backward_verdict(*, case: CaseRecord, thresholds: dict) -> str | None:
    """The verdict of a case record's backward half alone (None: the case has no backward), under
    ``thresholds`` (which must have the [backward] tables): a case's verdict is the worst of both
    halves, so a summary that counts gradients (``audits.report.build.summary_line``) needs this
    half on its own to say how many cases' gradients passed."""
    if not case.get("backward"):
        return None
    if case.get("status") == "ran" and _out_of_domain(case, thresholds):  # the inputs, not the gradients
        return "out-of-domain"
    return _worst(_backward(case, thresholds))


def ungated_figures(*, case: CaseRecord, thresholds: dict) -> dict[str, str]:
    """The error/bound figures a case record shows that its verdict does not gate, each with why
    in words: ``"bound"`` (the forward bound's tightness), ``"grad_bound"`` (the gradients').  A
    table that shows such a figure says so: a kernel author who sees err/bound 3.63 on a passing
    case must learn that the bound is informational for the kernel (a peer kernel does not claim
    FA4's numerics; thresholds ``peer_bound``), not that the audit overlooked it.  Empty when
    ``thresholds`` lack the tables (a report read from a journal keeps only their digest)."""
    out = {}
    pol, bt = thresholds.get("policy"), thresholds.get("backward")
    kind = (case.get("bound") or {}).get("kind")
    if isinstance(pol, dict) and case.get("bound") and not _bound_gated(kind, pol):
        out["bound"] = "not gated: [policy] bound = false" if kind == "fa4" else "not gated for peer kernels"
    b = case.get("backward") or {}
    has = any((g or {}).get("bound") for g in (b.get("grads") or {}).values())
    if isinstance(bt, dict) and has and not _bound_gated(b.get("bound_kind"), bt):
        fa4 = b.get("bound_kind") == "fa4"
        out["grad_bound"] = "not gated: [backward] bound = false" if fa4 else "not gated for peer kernels"
    return out


def judge_against_baseline(m: CaseRecord, base: CaseRecord, th: dict) -> list[str]:
    """Reasons a candidate case record is worse than its baseline record (empty: not worse):
    :func:`against_baseline` in words."""
    return [render(f) for f in against_baseline(m, base, th)]


def _worse_than_baseline(a: dict, b: dict, r: float) -> bool:
    """Whether error record ``a`` (``numerics.metrics.output_errors`` / ``lse_errors``) is worse
    than baseline record ``b``, NaN-aware (``numerics.metrics.nan_aware_max``): NaN or inf where
    the reference is finite is worse than any finite error; against a baseline that had them too,
    worse when at more elements (a count, no ratio: a NaN is not a rounding error that may grow);
    finite against finite, when ``a``'s max |err| exceeds ``r`` x ``b``'s."""
    na, nb = (int(e.get("nonfinite_where_ref_finite") or 0) for e in (a, b))
    if na or nb:
        return na > nb
    return a["max_abs"] > r * b["max_abs"] and a["max_abs"] > 0


def against_baseline(m: CaseRecord, base: CaseRecord, th: dict) -> list[Finding]:
    """Findings of a candidate case record worse than its baseline record (empty: not worse): per
    error record (out, LSE, each gradient) its max |err| beyond ``[baseline] max_ratio`` x the
    baseline's, or NaN/inf where the reference is finite at more elements than the baseline's
    (:func:`_worse_than_baseline`; ``worst`` and the baseline's figure NaN-aware, and ``detail``
    ``nonfinite`` / ``baseline_nonfinite`` their counts)."""
    if m.get("status") != "ran" or base.get("status") != "ran":
        return []
    r = th["baseline"]["max_ratio"]
    out = []
    grads = lambda c: (c.get("backward") or {}).get("grads") or {}
    pairs = [
        (m.get(key), base.get(key), label) for key, label in (("out", "max |out - ref|"), ("lse", "LSE max |err|"))
    ]
    pairs += [(grads(m).get(n), grads(base).get(n), f"max |{n} - ref|") for n in ("dq", "dk", "dv", "dsink")]
    for a, b, label in pairs:
        if not (isinstance(a, dict) and isinstance(b, dict) and "max_abs" in a and "max_abs" in b):
            continue
        if _worse_than_baseline(a, b, r):
            detail = {
                "baseline": nan_aware_max(b),
                "nonfinite": int(a.get("nonfinite_where_ref_finite") or 0),
                "baseline_nonfinite": int(b.get("nonfinite_where_ref_finite") or 0),
            }
            out.append(Finding("fail", "baseline", label, worst=nan_aware_max(a), allowed=r, detail=detail))
    return out


def rejudge(report: dict, th: dict, baseline: dict | None = None, *, key=lambda c: c["case"]) -> dict:
    """The report's cases judged again under ``th``, and against ``baseline`` (its cases keyed
    by ``key``, as the candidate's are matched)."""
    cases = []
    for c in report["cases"]:
        verdict, reasons = judge(c, th)
        base = (baseline or {}).get(key(c))
        worse = judge_against_baseline(c, base, th) if base is not None else []
        if worse:
            verdict, reasons = "fail", reasons + worse
        cases.append({**c, "verdict": verdict, "reasons": reasons})
    return {**report, "cases": cases, "thresholds": th}
