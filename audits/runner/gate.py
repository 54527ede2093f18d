"""Verdicts: a case's measurements judged against the thresholds (TOML).

Rules (DESIGN.md, "Numerical conventions"): output and LSE are both checked, elementwise; a NaN
or inf where the reference is finite fails; a finite value where the reference is NaN is a
semantics deviation (warning or failure by policy); FA4 kernels must stay within the per-element
forward-pass bound; FA's test criterion is a floor for every kernel.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

__all__ = ["DEFAULT_THRESHOLDS", "load_thresholds", "judge", "judge_against_baseline", "rejudge", "ThresholdsError"]

DEFAULT_THRESHOLDS = Path(__file__).with_name("thresholds.toml")
_KEYS = {
    "policy": {
        "nan_swallowed": str,
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


class ThresholdsError(ValueError):
    """A malformed thresholds file; the message names the file, the line (when TOML says it)
    and the key."""


def load_thresholds(path: str | Path | None = None) -> dict:
    """Parse and validate a thresholds file (default: the shipped one)."""
    p = Path(path) if path is not None else DEFAULT_THRESHOLDS
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError as exc:
        raise ThresholdsError(f"{p}: no such thresholds file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ThresholdsError(f"{p}: not valid TOML: {exc}") from exc
    for section, keys in _KEYS.items():
        if section not in data or not isinstance(data[section], dict):
            raise ThresholdsError(f"{p}: missing table [{section}] (keys {', '.join(keys)})")
        for key, typ in keys.items():
            if key not in data[section]:
                raise ThresholdsError(f"{p}: [{section}] lacks the key {key!r}")
            val = data[section][key]
            if typ is float and isinstance(val, int) and not isinstance(val, bool):
                val = data[section][key] = float(val)
            if not isinstance(val, typ):
                raise ThresholdsError(f"{p}: [{section}] {key} = {val!r} must be a {typ.__name__}")
        unknown = set(data[section]) - set(keys)
        if unknown:
            raise ThresholdsError(
                f"{p}: [{section}] has unknown key(s) {', '.join(sorted(unknown))}; accepted: {', '.join(keys)}"
            )
    if data["policy"]["nan_swallowed"] not in ("warn", "fail"):
        raise ThresholdsError(
            f"{p}: [policy] nan_swallowed must be 'warn' or 'fail', got {data['policy']['nan_swallowed']!r}"
        )
    data["path"] = str(p)
    return data


def judge(m: dict, th: dict) -> tuple[str, list[str]]:
    """(verdict, reasons) for one case's measurements ``m`` (see ``audits.runner.engine``)."""
    if m.get("status") in ("error", "skipped", "crash"):
        return m["status"], [m.get("reason", "")]
    reasons, verdict = [], "pass"
    out, lse = m["out"], m.get("lse")
    ood = m.get("out_of_domain")
    nonfinite_claim = ood and "claims no semantics" in ood  # the kernel's own domain (audits.kernels)
    if (
        ood
        and (nonfinite_claim or not th["policy"]["claim_float32_overflow"])
        and (out["nonfinite_where_ref_finite"] or (lse or {}).get("nonfinite_where_ref_finite"))
    ):
        return "out-of-domain", [f"inputs outside the kernel design's float32 range: {ood}"]
    for what, r in (("outputs", out), ("LSE values", lse)):
        if r is None:
            continue
        if r["nonfinite_where_ref_finite"]:
            reasons.append(f"{r['nonfinite_where_ref_finite']} {what} are NaN/inf where the FP64 reference is finite")
            verdict = "fail"
        if r["nan_swallowed"]:
            reasons.append(
                f"semantics deviation: {r['nan_swallowed']} {what} differ where non-finite inputs make the reference NaN/inf"
            )
            if th["policy"]["nan_swallowed"] == "fail":
                verdict = "fail"
            elif verdict == "pass":
                verdict = "warn"
    b = m.get("bound")
    applies = th["policy"]["bound"] if (b or {}).get("kind") == "fa4" else th["policy"]["peer_bound"]
    if b is not None and applies and (b["violations"] or b["lse_violations"]):
        reasons.append(
            f"{b['violations']} outputs and {b['lse_violations']} LSE values exceed the forward-pass bound "
            f"(worst error/bound {b['tightness']:.3g}) — a bug in the kernel or in the analysis"
        )
        verdict = "fail"
    fa = m.get("fa_criterion")
    if fa is not None and th["policy"]["fa_criterion"] and m["config"]["dtype"] in th["policy"]["fa_criterion_dtypes"]:
        allowed = th["policy"]["fa_multiplier"] * fa["lowprec_max_abs"] + 2 * fa["rounding"]
        if not fa["max_abs"] <= allowed:
            reasons.append(f"FA criterion: max|out - ref| {fa['max_abs']:.3g} > allowed {allowed:.3g}")
            verdict = "fail"
    if lse is not None:
        if lse["mismatched_nonfinite"]:
            reasons.append(f"{lse['mismatched_nonfinite']} rows with no visible key have an LSE other than -inf")
            verdict = "fail"
        allowed = th["lse"]["max_abs"] + th["lse"]["rel"] * lse.get("ref_max_abs", 0.0)
        if lse["max_abs"] > allowed:
            reasons.append(
                f"LSE max |err| {lse['max_abs']:.3g} > allowed {allowed:.3g} (max_abs {th['lse']['max_abs']:g} + rel {th['lse']['rel']:g} * max|lse| {lse.get('ref_max_abs', 0.0):.3g})"
            )
            verdict = "fail"
    cert = m.get("mpmath_max_abs")
    if cert is not None and cert > th["reference"]["mpmath_max_abs"]:
        reasons.append(
            f"FP64 reference not certified: differs from the exact row by {cert:.3g} (allowed {th['reference']['mpmath_max_abs']:g})"
        )
        verdict = "fail"
    return verdict, reasons


def judge_against_baseline(m: dict, base: dict, th: dict) -> list[str]:
    """Reasons a candidate case record is worse than its baseline record (empty: not worse)."""
    if m.get("status") != "ran" or base.get("status") != "ran":
        return []
    r = th["baseline"]["max_ratio"]
    out = []
    for key, label in (("out", "max |out - ref|"), ("lse", "LSE max |err|")):
        a, b = (m.get(key) or {}).get("max_abs"), (base.get(key) or {}).get("max_abs")
        if a is not None and b is not None and a > r * b and a > 0:
            out.append(f"{label} {a:.3g} > {r:g} x baseline {b:.3g}")
    return out


def rejudge(report: dict, th: dict, baseline: dict | None = None) -> dict:
    """The report's cases judged again under ``th`` (and against ``baseline``'s cases by name)."""
    base = {c["case"]: c for c in baseline["cases"]} if baseline else {}
    cases = []
    for c in report["cases"]:
        verdict, reasons = judge(c, th)
        if c["case"] in base:
            worse = judge_against_baseline(c, base[c["case"]], th)
            if worse:
                verdict, reasons = "fail", reasons + worse
        cases.append({**c, "verdict": verdict, "reasons": reasons})
    return {**report, "cases": cases, "thresholds": th}
