"""The gate's findings: each check of ``audits.verdict.gate`` returns typed records of what it
found (:class:`Finding`), and :func:`render` puts one into words, the only place that does.  A
case record's ``reasons`` are its findings rendered; report.md, report.html, ``show`` and
``gate`` print those strings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "render", "count_of"]


@dataclass(frozen=True)
class Finding:
    """One thing a check found in a case record.

    ``severity``: the verdict it asks for ("fail", "warn", "error", "out-of-domain", ...);
    ``kind``: which check (a key of :data:`_RENDER`); ``quantity``: the tensor or figure it is about
    ("out", "LSE", "dq", ...); ``count``: how many elements (or heads) it concerns; ``worst`` and
    ``allowed``: the figure measured and the most the thresholds allow; ``detail``: what the
    words of its kind need besides (documented at each renderer)."""

    severity: str
    kind: str
    quantity: str = ""
    count: int | None = None
    worst: float | None = None
    allowed: float | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """``worst / allowed`` where both are numbers (and ``allowed`` is not 0)."""
        if isinstance(self.worst, int | float) and isinstance(self.allowed, int | float) and self.allowed:
            return self.worst / self.allowed
        return None

    @property
    def message(self) -> str:
        """The finding in words (:func:`render`)."""
        return render(self)


def count_of(n: int, noun: tuple[str, str]) -> str:
    """``1 output``, ``2,048 outputs``: ``noun`` is (singular, plural)."""
    return f"{n:,} {noun[0] if n == 1 else noun[1]}"


_DEVIATION = " — a semantics deviation"


def _nonfinite(f: Finding) -> str:
    """Non-finite mismatches of a tensor.  ``detail``: ``noun`` (singular, plural), ``ref`` (e.g.
    "FP64 reference"), ``group`` (0: the reference is finite, 1: NaN or inf inputs make it NaN or
    inf, a semantics deviation, 2: an LSE reference of -inf), and with the per-class breakdown
    ``holds`` ((class in words, count), ...), ``ref_class`` and ``cause`` (or None)."""
    d, n = f.detail, f.count
    deviation = _DEVIATION if d["group"] == 1 else ""
    if d.get("holds") is None:  # a record without the breakdown: the counts in plain words
        if d["group"] == 0:
            text = f"{count_of(n, d['noun'])}: the kernel returns NaN or inf where the {d['ref']} is finite"
        elif d["group"] == 2:
            text = (
                f"{count_of(n, d['noun'])}: the kernel returns other than -inf where the {d['ref']} is -inf "
                f"({d['cause']})"
            )
        else:
            text = (
                f"{count_of(n, d['noun'])}: the kernel's value differs where NaN or inf inputs make the {d['ref']} "
                "NaN or inf"
            )
        return text + deviation
    got = d["holds"]
    where = f"where the {d['ref']} is {d['ref_class']}" + (f" ({d['cause']})" if d["cause"] else "")
    # several classes: "15,552 dv elements: the kernel returns a finite value (15,488), -inf (35) or +inf (29)"
    each = [f"{h} ({c:,})" for h, c in got] if len(got) > 1 else [got[0][0]]
    holds = each[0] if len(each) == 1 else f"{', '.join(each[:-1])} or {each[-1]}"
    return f"{count_of(n, d['noun'])}: the kernel returns {holds} {where}" + deviation


def _fa_criterion(f: Finding) -> str:
    """``detail``: ``head`` for dsink, which FA checks per head (``count`` heads off); ``scale``
    where the allowance is the floor at the quantity's scale (``audits.verdict.gate.FA_FLOOR``)."""
    floor = f" (the floor at its scale {f.detail['scale']:.3g})" if f.detail.get("scale") is not None else ""
    if "head" in f.detail:
        return (
            f"FA criterion: dsink of {f.count} head(s) off, head {f.detail['head']}: "
            f"|err| {f.worst:.3g} > allowed {f.allowed:.3g}{floor}"
        )
    return f"FA criterion: max|{f.quantity} - ref| {f.worst:.3g} > allowed {f.allowed:.3g}{floor}"


def _evidence(f: Finding) -> str:
    """A bound finding's evidence in words (``audits.verdict.gate._evidence``: ``detail`` keys
    ``fa``, ``certified`` and for the LSE ``lse_ceiling``, each True, False or None for not
    measured; ``model``: the FA4 model of the analysed arithmetic on the same inputs, within the
    bound or not, where the record has it), ending in what together they mean.  A record from
    before they were kept: none."""
    d, q = f.detail, f.quantity
    if "certified" not in d:
        return ""
    parts, of = [], ("the output" if q in ("out", "LSE") else q)
    if d.get("fa") is not None:
        parts.append(f"FA's criterion {'passes' if d['fa'] else 'fails'} {of}")
    if d.get("lse_ceiling") is not None:
        parts.append(f"the LSE is {'within' if d['lse_ceiling'] else 'beyond'} its ceiling")
    ref = "the exact reference" if q in ("out", "LSE") else f"the exact {q}"
    model = d.get("model")
    if model is not None:
        what = "this kernel's FA4 arithmetic" if model["numerics"] == "fa4" else "generic flash-attention arithmetic"
        where = "stays within the bound" if model["within"] else f"exceeds it too, worst {model['worst']:.3g}x"
        parts.append(f"the FA4 model of {what} on the same inputs {where}")
    if model is not None and not model["within"] and d["certified"] is not False:
        parts.append("so the analysis misses a step of that arithmetic (or the model does)")
    elif d["certified"] is None:
        parts.append(f"{ref} was not evaluated on this case, so the FP64 one is unconfirmed")
    elif not d["certified"]:
        parts.append(f"{ref} disagrees with the FP64 one, so the reference is suspect")
    elif d.get("fa") is False or d.get("lse_ceiling") is False:
        parts.append(f"{ref} agrees, so the kernel errs beyond rounding, not the reference")
    elif model is not None:
        parts.append(f"{ref} agrees, so the kernel departs from the arithmetic the bound covers (not the reference)")
    else:
        parts.append(f"{ref} agrees, so the kernel's arithmetic is outside the analysed one, not the reference")
    return "; " + "; ".join(parts)


def _bound(f: Finding, noun: tuple[str, str], bound: str) -> str:
    """A bound finding: the quantity, its count, its own worst error/bound, the evidence."""
    worst = "worst unknown" if f.worst is None else f"worst {f.worst:.3g}x"
    return f"{f.quantity}: {count_of(f.count, noun)} exceed the {bound}, {worst}" + _evidence(f)


_NOUNS = {"out": ("output", "outputs"), "LSE": ("value", "values")}
#: each kind's words (``detail`` keys named where a kind reads them)
_RENDER = {
    "status": lambda f: f.detail["note"],
    "out-of-domain": lambda f: f"inputs outside the kernel design's float32 range: {f.detail['note']}",
    "nonfinite": _nonfinite,
    # one per quantity (out, LSE); detail: the evidence (_evidence)
    "bound": lambda f: _bound(f, _NOUNS[f.quantity], "forward-pass bound"),
    "fa-criterion": _fa_criterion,
    "lse-missing": lambda f: "LSE not returned: not audited",
    # detail: max_abs, rel (the [lse] thresholds), ref_max (the largest finite |reference LSE|)
    "lse-ceiling": lambda f: (
        f"LSE max |err| {f.worst:.3g} > allowed {f.allowed:.3g} (max_abs {f.detail['max_abs']:g} + rel "
        f"{f.detail['rel']:g} * max|lse| {f.detail['ref_max']:.3g})"
    ),
    "uncertified": lambda f: (
        f"FP64 reference not certified: differs from the exact row by {f.worst:.3g} (allowed {f.allowed:g})"
    ),
    "grad-contract": lambda f: f"gradient contract: {f.detail['note']}",
    "grad-missing": lambda f: f"autograd returned no {f.quantity}: the output does not depend on that input",
    # detail: the evidence (_evidence)
    "grad-bound": lambda f: _bound(f, ("element", "elements"), "backward bound"),
    # detail: unseen (keys no query sees)
    "unseen-nonzero": lambda f: f"{f.count} {f.quantity} elements of the {f.detail['unseen']} unseen keys are not zero",
    # detail: rows (rows that see no key)
    "empty-row-nonzero": lambda f: (
        f"{f.count} {f.quantity} elements of the {f.detail['rows']} rows that see no key are not zero"
    ),
    "nondeterministic": lambda f: (
        f"deterministic=True: {f.count} {f.quantity} elements differ between backward runs (up to {f.worst} ULP)"
    ),
    "grad-uncertified": lambda f: (
        f"FP64 {f.quantity} not certified: differs from the exact elements by {f.worst:.3g} relative "
        f"(allowed {f.allowed:g})"
    ),
    "backward": lambda f: f"backward: {f.detail['note']}",
    # worst: the clustered z of the mean signed error; allowed: [bias] z_max; detail: mean_ulp, min_ulps, dtype
    "rounding-bias": lambda f: (
        f"rounding bias: {f.quantity} biased {'low' if f.detail['mean_ulp'] < 0 else 'high'} by "
        f"{abs(f.detail['mean_ulp']):.3g} {f.detail['dtype']} ULP on average over {f.count:,} elements "
        f"(z = {f.worst:.3g}; |z| > {f.allowed:g} and > {f.detail['min_ulps']:g} ULP is a bias)"
    ),
    # detail: where (the elements' places, audits.engine.poison), memory_like (the values the other
    # checks accepted that fresh memory could have held: NaN, inf, 0, or a non-finite reference),
    # what ("result": out and LSE; "gradients": dq, dk, dv)
    "unwritten": lambda f: (
        f"{count_of(f.count, ('element', 'elements'))} of the {f.detail.get('what', 'result')} never written by the "
        f"kernel ({f.detail['where']}): re-run with fresh memory filled with NaN, then a finite pattern, they took the "
        "fill both times, so what the checks accepted there was memory's, not the kernel's"
    ),
    "memory-read": lambda f: (
        f"{count_of(f.count, ('element', 'elements'))} of the {f.detail.get('what', 'result')} read memory the kernel "
        f"never wrote ({f.detail['where']}): re-run with fresh memory filled with NaN, then a finite pattern, they "
        "changed without taking the fill, so what the checks accepted there depends on what that memory held"
    ),
    # allowed: the [baseline] max_ratio; detail: baseline (its figure), nonfinite / baseline_nonfinite
    # (elements NaN or inf where the reference is finite, each side; absent: none)
    "baseline": lambda f: (
        f"{f.quantity} {f.worst:.3g} > {f.allowed:g} x baseline {f.detail['baseline']:.3g}"
        if not f.detail.get("nonfinite")
        else f"{f.quantity} {f.worst:g} ({f.detail['nonfinite']:,} non-finite where the reference is finite) "
        f"against the baseline's {f.detail['baseline']:.3g} ({f.detail.get('baseline_nonfinite', 0):,} non-finite)"
    ),
}


def render(f: Finding) -> str:
    """A finding in words, as a case record's ``reasons`` hold it."""
    return _RENDER[f.kind](f)
