"""Verdicts: a case's measurements judged against the thresholds (TOML).

Rules (docs/design.md, "Numerical conventions"): output and LSE are both checked, elementwise; a NaN
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
    for key in ("nan_swallowed", "lse_missing"):
        if data["policy"][key] not in ("warn", "fail"):
            raise ThresholdsError(f"{p}: [policy] {key} must be 'warn' or 'fail', got {data['policy'][key]!r}")
    data["path"] = str(p)
    return data


def _semantics(m: dict, th: dict) -> list[tuple[str, str]]:
    """Non-finite values against the reference: NaN/inf where it is finite fails; a finite
    value where non-finite inputs make it NaN/inf is a semantics deviation (policy)."""
    found = []
    for what, r in (("outputs", m["out"]), ("LSE values", m.get("lse"))):
        if r is None:
            continue
        if r["nonfinite_where_ref_finite"]:
            found.append(
                ("fail", f"{r['nonfinite_where_ref_finite']} {what} are NaN/inf where the FP64 reference is finite")
            )
        if r["nan_swallowed"]:
            found.append((th["policy"]["nan_swallowed"], f"semantics deviation: {r['nan_swallowed']} {what} differ "
                          "where non-finite inputs make the reference NaN/inf"))  # fmt: skip
    return found


def _bound(m: dict, th: dict) -> list[tuple[str, str]]:
    """The per-element forward bound (FA4 numerics, or generic flash-attention numerics for peers)."""
    b = m.get("bound")
    applies = th["policy"]["bound"] if (b or {}).get("kind") == "fa4" else th["policy"]["peer_bound"]
    if b is None or not applies or not (b["violations"] or b["lse_violations"]):
        return []
    return [("fail", f"{b['violations']} outputs and {b['lse_violations']} LSE values exceed the forward-pass bound "
             f"(worst error/bound {b['tightness']:.3g}) — a bug in the kernel or in the analysis")]  # fmt: skip


def _fa_criterion(m: dict, th: dict) -> list[tuple[str, str]]:
    """FlashAttention's own test criterion, a floor for the dtypes PyTorch computes in."""
    fa, pol = m.get("fa_criterion"), th["policy"]
    if fa is None or not pol["fa_criterion"] or m["config"]["dtype"] not in pol["fa_criterion_dtypes"]:
        return []
    allowed = pol["fa_multiplier"] * fa["lowprec_max_abs"] + 2 * fa["rounding"]
    if fa["max_abs"] <= allowed:
        return []
    return [("fail", f"FA criterion: max|out - ref| {fa['max_abs']:.3g} > allowed {allowed:.3g}")]


def _lse(m: dict, th: dict) -> list[tuple[str, str]]:
    """The LSE: returned at all (policy ``lse_missing``), -inf on empty rows, within the ceiling."""
    lse = m.get("lse")
    if lse is None:
        return (
            [(th["policy"]["lse_missing"], "LSE not returned: not audited")] if m.get("lse_returned") is False else []
        )
    found = []
    if lse["mismatched_nonfinite"]:
        found.append(("fail", f"{lse['mismatched_nonfinite']} rows with no visible key have an LSE other than -inf"))
    ref_max = lse.get("ref_max_abs", 0.0)
    allowed = th["lse"]["max_abs"] + th["lse"]["rel"] * ref_max
    if lse["max_abs"] > allowed:
        found.append(("fail", f"LSE max |err| {lse['max_abs']:.3g} > allowed {allowed:.3g} (max_abs "
                      f"{th['lse']['max_abs']:g} + rel {th['lse']['rel']:g} * max|lse| {ref_max:.3g})"))  # fmt: skip
    return found


def _certified(m: dict, th: dict) -> list[tuple[str, str]]:
    """The FP64 reference itself, against the exact row."""
    cert, allowed = m.get("mpmath_max_abs"), th["reference"]["mpmath_max_abs"]
    if cert is None or cert <= allowed:
        return []
    return [("fail", f"FP64 reference not certified: differs from the exact row by {cert:.3g} (allowed {allowed:g})")]


_CHECKS = (_semantics, _bound, _fa_criterion, _lse, _certified)
_RANK = {"pass": 0, "warn": 1, "fail": 2}


def judge(m: dict, th: dict) -> tuple[str, list[str]]:
    """(verdict, reasons) for one case's measurements ``m`` (see ``audits.runner.engine``): the
    worst severity any check gives, with every check's reasons."""
    if m.get("status") in ("error", "skipped", "crash"):
        return m["status"], [m.get("reason", "")]
    ood, lse = m.get("out_of_domain"), m.get("lse") or {}
    nonfinite_claim = ood and "claims no semantics" in ood  # the kernel's own domain (audits.kernels)
    overflowed = m["out"]["nonfinite_where_ref_finite"] or lse.get("nonfinite_where_ref_finite")
    if ood and (nonfinite_claim or not th["policy"]["claim_float32_overflow"]) and overflowed:
        return "out-of-domain", [f"inputs outside the kernel design's float32 range: {ood}"]
    found = [f for check in _CHECKS for f in check(m, th)]
    verdict = max((sev for sev, _ in found), key=_RANK.__getitem__, default="pass")
    return verdict, [why for _, why in found]


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
