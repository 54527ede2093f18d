"""Verdicts: a case's measurements judged against the thresholds (TOML).

Rules (docs/design.md, "Numerical conventions"): output and LSE are both checked, elementwise; a NaN
or inf where the reference is finite fails; a finite value where the reference is NaN is a
semantics deviation (warning or failure by policy); FA4 kernels must stay within the per-element
forward-pass bound; FA's test criterion is a floor for every kernel.
"""

from __future__ import annotations

from pathlib import Path

from audits.common import read_toml

__all__ = [
    "DEFAULT_THRESHOLDS", "load_thresholds", "require_backward", "judge", "judge_against_baseline", "rejudge",
    "ThresholdsError",
]  # fmt: skip

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
_GRAD_KEYS = {"dq": {"fa_multiplier": float}, "dk": {"fa_multiplier": float}, "dv": {"fa_multiplier": float},
              "dsink": {"fa_multiplier": float, "ulps": float}}  # fmt: skip


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


def require_backward(th: dict) -> None:
    """ThresholdsError unless ``th`` has the [backward] tables a --backward run judges by."""
    if "backward" not in th:
        raise ThresholdsError(
            f"{th.get('path', 'thresholds')}: no [backward] table, which --backward needs; copy [backward] and "
            f"[backward.dq/dk/dv/dsink] from the shipped {DEFAULT_THRESHOLDS}"
        )


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
_RANK = {"pass": 0, "warn": 1, "skipped": 2, "out-of-domain": 3, "fail": 4, "error": 5, "timeout": 6, "crash": 7}


def _grad_values(b: dict, th: dict) -> list[tuple[str, str]]:
    """Each gradient against its FP64 reference: non-finite values, the per-element backward
    bound (FA4 numerics; peers by policy), and what autograd failed to return."""
    bt, found = th["backward"], []
    found += [("error", f"gradient contract: {why}") for why in b.get("contract", [])]
    found += [("fail", f"autograd returned no {n}: the output does not depend on that input") for n in b["missing"]]
    for n, g in b["grads"].items():
        if g["nonfinite_where_ref_finite"]:
            bad = g["nonfinite_where_ref_finite"]
            found.append(("fail", f"{bad} {n} elements are NaN/inf where the FP64 gradient is finite"))
        if g["nan_swallowed"]:
            found.append((th["policy"]["nan_swallowed"], f"semantics deviation: {g['nan_swallowed']} {n} elements "
                          "differ where non-finite inputs make the FP64 gradient NaN/inf"))  # fmt: skip
        bd = g.get("bound")
        applies = bt["bound"] if b.get("bound_kind") == "fa4" else bt["peer_bound"]
        if bd and applies and bd["violations"]:
            found.append(("fail", f"{bd['violations']} {n} elements exceed the backward bound (worst error/bound "
                          f"{bd['tightness']:.3g}) — a bug in the kernel or in the analysis"))  # fmt: skip
    return found


def _grad_fa_criterion(b: dict, m: dict, th: dict) -> list[tuple[str, str]]:
    """FlashAttention's backward criterion per gradient, a floor for bf16 / fp16."""
    bt, cfg, found = th["backward"], m["config"], []
    if not bt["fa_criterion"] or cfg["dtype"] not in th["policy"]["fa_criterion_dtypes"]:
        return []
    cap = bool(cfg.get("softcap"))
    for n, g in b["grads"].items():
        fa = g.get("fa_criterion")
        if fa is None:
            continue
        mult = bt["softcap_multiplier"] if cap else bt[n]["fa_multiplier"]
        extra = bt["softcap_abs"] if cap else 0.0
        if n == "dsink":  # elementwise, 2 ULP of |ref| per head
            allowed = [mult * fa["lowprec_max_abs"] + bt["dsink"]["ulps"] * u + extra for u in fa["ulps_at_ref"]]
            bad = [i for i, (e, a) in enumerate(zip(fa["errors"], allowed)) if e > a]
            if bad:
                i = bad[0]
                found.append(("fail", f"FA criterion: dsink of {len(bad)} head(s) off, head {i}: "
                              f"|err| {fa['errors'][i]:.3g} > allowed {allowed[i]:.3g}"))  # fmt: skip
            continue
        allowed = mult * fa["lowprec_max_abs"] + 2 * fa["rounding"] + extra
        if fa["max_abs"] > allowed:
            found.append(("fail", f"FA criterion: max|{n} - ref| {fa['max_abs']:.3g} > allowed {allowed:.3g}"))
    return found


def _grad_semantics(b: dict, th: dict) -> list[tuple[str, str]]:
    """Exact zeros, determinism under --deterministic, the FP64 gradients' certification."""
    z, found = b["zeros"], []
    for key, what in (("dk_unseen_nonzero", "dK"), ("dv_unseen_nonzero", "dV")):
        if z[key]:
            found.append(("fail", f"{z[key]} {what} elements of the {z['unseen_keys']} unseen keys are not zero"))
    if z["dq_empty_nonzero"]:
        bad = z["dq_empty_nonzero"]
        found.append(("fail", f"{bad} dQ elements of the {z['empty_rows']} rows that see no key are not zero"))
    if b.get("deterministic"):
        for n, sp in b.get("spread", {}).items():
            if sp["differing"]:
                found.append(("fail", f"deterministic=True: {sp['differing']} {n} elements differ between "
                              f"backward runs (up to {sp['max_ulp']} ULP)"))  # fmt: skip
    for n, rel in b.get("certified", {}).items():
        if rel > th["backward"]["mpmath_max_rel"]:
            found.append(("fail", f"FP64 {n} not certified: differs from the exact elements by {rel:.3g} relative "
                          f"(allowed {th['backward']['mpmath_max_rel']:g})"))  # fmt: skip
    return found


def _backward(m: dict, th: dict) -> list[tuple[str, str]]:
    """The case's backward half (``audits.runner.backward``), when the run asked for it."""
    b = m.get("backward")
    if b is None:
        return []
    if b["status"] != "ran":
        return [(b["status"], f"backward: {b.get('reason', '')}")]
    require_backward(th)
    if b.get("out_of_domain") and not th["policy"]["claim_float32_overflow"]:
        return [("out-of-domain", f"backward: {b['out_of_domain']}")]
    return _grad_values(b, th) + _grad_fa_criterion(b, m, th) + _grad_semantics(b, th)


def judge(m: dict, th: dict) -> tuple[str, list[str]]:
    """(verdict, reasons) for one case's measurements ``m`` (see ``audits.runner.engine``): the
    worst severity any check gives, with every check's reasons."""
    if m.get("status") in ("error", "skipped", "crash", "timeout"):
        return m["status"], [m.get("reason", "")]
    # decided by the record's fields only (old records: audits.runner.schema.upgrade_case)
    ood, kind, lse = m.get("out_of_domain"), m.get("out_of_domain_kind"), m.get("lse") or {}
    nonfinite_claim = kind == "nonfinite-inputs"  # the kernel's own domain (audits.kernels)
    overflowed = m["out"]["nonfinite_where_ref_finite"] or lse.get("nonfinite_where_ref_finite")
    if kind is not None and (nonfinite_claim or not th["policy"]["claim_float32_overflow"]) and overflowed:
        return "out-of-domain", [f"inputs outside the kernel design's float32 range: {ood}"]
    found = [f for check in _CHECKS for f in check(m, th)] + _backward(m, th)
    verdict = max((sev for sev, _ in found), key=_RANK.__getitem__, default="pass")
    return verdict, [why for _, why in found]


def judge_against_baseline(m: dict, base: dict, th: dict) -> list[str]:
    """Reasons a candidate case record is worse than its baseline record (empty: not worse)."""
    if m.get("status") != "ran" or base.get("status") != "ran":
        return []
    r = th["baseline"]["max_ratio"]
    out = []
    grads = lambda c: (c.get("backward") or {}).get("grads") or {}
    pairs = [((m.get(key) or {}).get("max_abs"), (base.get(key) or {}).get("max_abs"), label)
             for key, label in (("out", "max |out - ref|"), ("lse", "LSE max |err|"))]  # fmt: skip
    pairs += [((grads(m).get(n) or {}).get("max_abs"), (grads(base).get(n) or {}).get("max_abs"), f"max |{n} - ref|")
              for n in ("dq", "dk", "dv", "dsink")]  # fmt: skip
    for a, b, label in pairs:
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
