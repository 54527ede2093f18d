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

__all__ = [
    "DEFAULT_THRESHOLDS",
    "load_thresholds",
    "require_backward",
    "judge",
    "judge_against_baseline",
    "rejudge",
    "ThresholdsError",
    "backward_verdict",
    "ungated_figures",
    "fa_allowed",
    "grad_fa_allowed",
    "lse_allowed",
    "bound_gated",
    "findings",
    "against_baseline",
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
    """The per-element forward bound (FA4 numerics, or generic flash-attention numerics for peers)."""
    b = m.get("bound")
    applies = _bound_gated((b or {}).get("kind"), th["policy"])
    if b is None or not applies or not (b["violations"] or b["lse_violations"]):
        return []
    detail = {"lse_violations": b["lse_violations"]}
    return [Finding("fail", "bound", "out", b["violations"], b["tightness"], 1.0, detail)]


def fa_allowed(*, m: CaseRecord, th: dict) -> float | None:
    """The largest |out - ref| FlashAttention's criterion allows case record ``m`` under ``th``
    (``fa_multiplier`` x PyTorch's error in the input dtype + 2 x the output's rounding), or None
    where the criterion does not gate the case (off, a dtype PyTorch does not compute in, not
    measured).  Public: the verdict here and the per-element localization
    (``audits.verdict.diagnosis``) read the one rule."""
    fa, pol = m.get("fa_criterion"), th["policy"]
    if fa is None or not pol["fa_criterion"] or m["config"]["dtype"] not in pol["fa_criterion_dtypes"]:
        return None
    return pol["fa_multiplier"] * fa["lowprec_max_abs"] + 2 * fa["rounding"]


def _fa_criterion(m: CaseRecord, th: dict) -> list[Finding]:
    """FlashAttention's own test criterion, a floor for the dtypes PyTorch computes in."""
    fa, allowed = m.get("fa_criterion"), fa_allowed(m=m, th=th)
    if allowed is None or fa["max_abs"] <= allowed:
        return []
    return [Finding("fail", "fa-criterion", "out", worst=fa["max_abs"], allowed=allowed)]


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


def _certified(m: CaseRecord, th: dict) -> list[Finding]:
    """The FP64 reference itself, against the exact row."""
    cert, allowed = m.get("mpmath_max_abs"), th["reference"]["mpmath_max_abs"]
    if cert is None or cert <= allowed:
        return []
    return [Finding("fail", "uncertified", "reference", worst=cert, allowed=allowed)]


_CHECKS = (_semantics, _bound, _fa_criterion, _lse, _certified)
_RANK = {"pass": 0, "warn": 1, "skipped": 2, "out-of-domain": 3, "fail": 4, "error": 5, "timeout": 6, "crash": 7}


def _grad_values(b: dict, th: dict) -> list[Finding]:
    """Each gradient against its FP64 reference: non-finite values, the per-element backward
    bound (FA4 numerics; peers by policy), and what autograd failed to return."""
    bt, found = th["backward"], []
    found += [Finding("error", "grad-contract", detail={"note": why}) for why in b.get("contract", [])]
    found += [Finding("fail", "grad-missing", n) for n in b["missing"]]
    for n, g in b["grads"].items():
        found += _nonfinite(g, (f"{n} element", f"{n} elements"), "grad", th, ref="FP64 gradient", quantity=n)
        bd = g.get("bound")
        applies = _bound_gated(b.get("bound_kind"), bt)
        if bd and applies and bd["violations"]:
            found.append(Finding("fail", "grad-bound", n, bd["violations"], bd["tightness"], 1.0))
    return found


def grad_fa_allowed(*, m: CaseRecord, grad: str, th: dict) -> float | list[float] | None:
    """The largest |g - ref| FlashAttention's backward criterion allows gradient ``grad`` of case
    record ``m`` under ``th``: ``multiplier`` x PyTorch's error in the input dtype + 2 x rounding
    (+ ``softcap_abs`` with a softcap); for dsink, which FA checks per head, one value per head
    with ``ulps`` ULPs of |ref| in place of the rounding term.  None where the criterion does not
    gate it (off, fp8, not measured).  Public: the verdict and ``audits.verdict.diagnosis`` read
    the one rule."""
    bt, cfg = th["backward"], m["config"]
    fa = ((((m.get("backward") or {}).get("grads") or {}).get(grad)) or {}).get("fa_criterion")
    if fa is None or not bt["fa_criterion"] or cfg["dtype"] not in th["policy"]["fa_criterion_dtypes"]:
        return None
    cap = bool(cfg.get("softcap"))
    mult = bt["softcap_multiplier"] if cap else bt[grad]["fa_multiplier"]
    extra = bt["softcap_abs"] if cap else 0.0
    if grad == "dsink":  # elementwise, 2 ULP of |ref| per head
        return [mult * fa["lowprec_max_abs"] + bt["dsink"]["ulps"] * u + extra for u in fa["ulps_at_ref"]]
    return mult * fa["lowprec_max_abs"] + 2 * fa["rounding"] + extra


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
                found.append(Finding("fail", "fa-criterion", n, len(bad), fa["errors"][i], allowed[i], {"head": i}))
            continue
        if fa["max_abs"] > allowed:
            found.append(Finding("fail", "fa-criterion", n, worst=fa["max_abs"], allowed=allowed))
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
    return _grad_values(b, th) + _grad_fa_criterion(b, m, th) + _grad_semantics(b, th)


def findings(m: CaseRecord, th: dict) -> list[Finding]:
    """What the checks find in one case's measurements ``m`` (see ``audits.engine.evaluate``)
    under the thresholds ``th``, in the order of its ``reasons``; none: it passes."""
    if m.get("status") in ("error", "skipped", "crash", "timeout"):
        return [Finding(m["status"], "status", detail={"note": m.get("reason", "")})]
    # decided by the record's fields only (old records: audits.report.schema.upgrade_case)
    ood, kind, lse = m.get("out_of_domain"), m.get("out_of_domain_kind"), m.get("lse") or {}
    nonfinite_claim = kind == "nonfinite-inputs"  # the kernel's own domain (audits.kernels)
    overflowed = m["out"]["nonfinite_where_ref_finite"] or lse.get("nonfinite_where_ref_finite")
    if kind is not None and (nonfinite_claim or not th["policy"]["claim_float32_overflow"]) and overflowed:
        return [Finding("out-of-domain", "out-of-domain", detail={"note": ood})]
    return [f for check in _CHECKS for f in check(m, th)] + _backward(m, th)


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


def against_baseline(m: CaseRecord, base: CaseRecord, th: dict) -> list[Finding]:
    """Findings of a candidate case record worse than its baseline record by more than
    ``[baseline] max_ratio`` (empty: not worse)."""
    if m.get("status") != "ran" or base.get("status") != "ran":
        return []
    r = th["baseline"]["max_ratio"]
    out = []
    grads = lambda c: (c.get("backward") or {}).get("grads") or {}
    pairs = [
        ((m.get(key) or {}).get("max_abs"), (base.get(key) or {}).get("max_abs"), label)
        for key, label in (("out", "max |out - ref|"), ("lse", "LSE max |err|"))
    ]
    pairs += [
        ((grads(m).get(n) or {}).get("max_abs"), (grads(base).get(n) or {}).get("max_abs"), f"max |{n} - ref|")
        for n in ("dq", "dk", "dv", "dsink")
    ]
    for a, b, label in pairs:
        if a is not None and b is not None and a > r * b and a > 0:
            out.append(Finding("fail", "baseline", label, worst=a, allowed=r, detail={"baseline": b}))
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
