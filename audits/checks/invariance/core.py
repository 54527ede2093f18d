"""Invariance properties of a kernel, case by case (docs/invariance.md).

A kernel with a varlen entry (``audits.kernels.get_varlen_kernel``) is audited through it on
every property (``audits.checks.invariance.varlen``): ``batch``, ``decode``, ``paged`` and ``pack_gqa``
bitwise, ``split`` within the forward bound.  A fixed-length kernel is audited on ``batch`` and
``decode`` (``audits.checks.invariance.fixed``); the varlen features are not applicable to it.

A property of a case is ``holds``, ``differs`` (how many elements, the largest distance in steps
of the output's format, each variant's largest |x - FP64| and, for FA4 numerics, whether both
stay within ``numerics.forward_bound``), ``not applicable`` (with the reason), ``skipped`` (the
kernel raised NotImplementedError, or the case lies outside its declared domain), ``error`` or
``timeout`` (a call passed ``--timeout`` in the kernel's worker: :func:`in_worker`).

Prediction: the same properties run on a model's kernel (``--predict``) with the same inputs;
its result sits beside the measured one (``predicted``), and the summary counts agreements.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from audits import kernels
from audits.checks.invariance import fixed, mods, varlen
from audits.checks.invariance.compare import RESULTS, Broken, Refused, TimedOut, compare
from audits.checks.invariance.properties import ALL_PROPERTIES, MOD_PROPERTIES, PROPERTIES, VARLEN_ONLY
from audits.engine.worker import Isolated
from audits.kernels import fa4_arch, fa4_numerics, get_kernel, get_varlen_kernel, kernel_domain
from audits.suites.inputs import NotApplicable
from fa4.model import FA4Numerics

__all__ = [
    "PROPERTIES",
    "MOD_PROPERTIES",
    "ALL_PROPERTIES",
    "DECODE_ROWS",
    "RESULTS",
    "Target",
    "target",
    "default_model",
    "run_case",
    "summarize",
    "compare",
    "in_worker",
    "uncompared",
    "SCHEMA",
    "audit_kernel",
]

#: the schema of an invariance report (one kernel's; :func:`audit_kernel`)
SCHEMA = "fa4-audit/invariance/2"

#: the properties this audit checks, with what each compares
DECODE_ROWS = fixed.DECODE_ROWS


@dataclasses.dataclass(frozen=True)
class Target:
    """A kernel as the audit runs it: its fixed-length callable, its varlen entry (None: none),
    declared domain, and the FA4 numerics family its bound takes (``nmf`` for fixed-length
    calls, ``arch`` for varlen ones; None: no bound)."""

    name: str
    fn: Callable
    varlen: Callable | None
    domain: object
    nmf: Callable | None
    arch: str | None


def target(spec: str) -> Target:
    """The :class:`Target` of kernel ``spec``.  A user kernel may declare the FA4 numerics it
    implements as ``fn.fa4_audit_numerics = "sm100" | "sm90"`` (held to that bound); ValueError
    for another value."""
    fn = get_kernel(spec)
    arch = fa4_arch(spec)
    nmf = fa4_numerics(spec)
    vfn = get_varlen_kernel(spec)
    declared = getattr(vfn or fn, "fa4_audit_numerics", None)
    if arch is None and declared is not None:
        if declared not in ("sm100", "sm90"):
            raise ValueError(f"kernel {spec!r}: fa4_audit_numerics = {declared!r}; accepted: sm100, sm90")
        arch = declared
        nmf = _numerics_of(declared)
    return Target(spec, fn, vfn, kernel_domain(spec), nmf, arch)


def in_worker(t: Target, device, timeout: float | None):
    """(``t`` with its calls, fixed-length and varlen, made in a worker process under
    ``timeout`` seconds per call, the ``audits.engine.worker.Isolated`` to close afterwards): a
    call past the limit kills the worker and the property's result is ``timeout``."""
    iso = Isolated(t.name, device, timeout=timeout)
    return dataclasses.replace(t, fn=iso.entry(None), varlen=None if t.varlen is None else iso.entry("varlen")), iso


def _numerics_of(arch: str) -> Callable:
    return lambda q, k, v, causal, window: FA4Numerics.for_inputs(arch, q, k, v, causal, window)


def default_model(spec: str) -> str | None:
    """The model that predicts kernel ``spec``'s invariance when ``--predict`` is not given:
    production's (``fa4``) is the model of this machine's production arch; the others have none."""
    if spec != "fa4":
        return None
    return "fa4-model-sm90" if kernels.production_arch() == "sm90" else "fa4-model"


class _Shared:
    """One case's inputs for every kernel run on it: built once, when first asked."""

    def __init__(self, case, device):
        self.case, self.device = case, device
        self._made: dict = {}

    def get(self, kind: str, case=None):
        """The inputs of ``kind`` for the shared case, or for ``case`` (a variant of it that a
        property places inside the kernel's domain: ``fixed.decode_variant``)."""
        key = (kind, case)
        if key not in self._made:
            case = case or self.case
            if kind == "varlen":
                self._made[key] = varlen.VarlenInputs(case, self.device)
            elif kind == "mods":
                self._made[key] = mods.ModInputs(case, self.device)
            elif kind == "fixed-batch":  # a batch-1 case widened to a batch of 2
                self._made[key] = fixed.FixedInputs(dataclasses.replace(case, batch=max(2, case.batch)), self.device)
            else:
                self._made[key] = fixed.FixedInputs(case, self.device)
        return self._made[key]


def _not_applicable(prop: str, case, t: Target) -> str | None:
    if prop in MOD_PROPERTIES:
        return "a varlen case: the mods apply to fixed-length calls" if case.varlen else None
    if getattr(case, "mods", ()):
        # a sliced, restricted or repacked call would reuse the mods of the whole call: aux tensors
        # indexed by batch (prefix_lm, document), positions by query row (every mask mod, ALiBi)
        return (
            f"a case with mods ({', '.join(case.mods)}): this property slices or repacks the call, and the "
            "mods' aux tensors and query positions are built for the whole call"
        )
    if t.varlen is None and prop in VARLEN_ONLY:
        return "the kernel has no varlen entry (fixed-length): split-KV, paged KV and pack_gqa are varlen features"
    if t.varlen is None and case.varlen:
        return "a varlen case: the kernel has no varlen entry"
    return None


def _property(prop: str, shared: _Shared, t: Target) -> dict:
    if prop in MOD_PROPERTIES:  # on the fixed-length entry, whatever other entries the kernel has
        return getattr(mods, prop)(shared.get("mods"), t)
    if t.varlen is not None:
        return getattr(varlen, prop)(shared.get("varlen"), t)
    if prop == "decode":
        res = fixed.decode(shared.get("fixed"), t)
        if res["result"] == "not applicable" and (v := fixed.decode_variant(shared.case, t.domain)) is not None:
            res = fixed.decode(shared.get("fixed", v), t)
            note = (
                f"compared on the case with seqlen_q {v.seqlen_q} (its own {shared.case.seqlen_q} rows leave "
                f"no last rows inside the kernel's declared domain)"
            )
            res["note"] = "; ".join(x for x in (note, res.get("note")) if x)
        return res
    note = None
    if shared.case.batch < 2:
        note = "a batch-1 case: compared inside a batch of 2 built from the case's family and seed"
    return fixed.batch(shared.get("fixed-batch" if note else "fixed"), t, note)


def _measure(shared: _Shared, t: Target, properties=PROPERTIES) -> dict:
    """The ``properties`` of the shared case for target ``t``."""
    case = shared.case
    no = t.domain.refusal(case) if t.domain is not None else None
    res = {}
    for prop in properties:
        why = _not_applicable(prop, case, t)
        if why:
            res[prop] = {"result": "not applicable", "reason": why}
            continue
        if no:
            res[prop] = {"result": "skipped", "reason": f"outside the kernel's declared domain: {no}"}
            continue
        try:
            res[prop] = _property(prop, shared, t)
        except NotApplicable as exc:
            res[prop] = {"result": "not applicable", "reason": f"inputs: {exc}"}
        except Refused as exc:
            res[prop] = {"result": "skipped", "reason": str(exc)}
        except Broken as exc:
            res[prop] = {"result": "error", "reason": str(exc)}
        except TimedOut as exc:
            res[prop] = {"result": "timeout", "reason": str(exc)}
    return res


def agreement(measured: dict, predicted: dict) -> str | None:
    """``agree`` / ``disagree`` when both the measurement and the prediction reached a verdict
    (holds or differs), None otherwise."""
    a, b = measured["result"], predicted["result"]
    if a not in ("holds", "differs") or b not in ("holds", "differs"):
        return None
    return "agree" if a == b else "disagree"


def run_case(case, t: Target, *, device, model: Target | None = None, properties=None) -> dict:
    """The case's record: the ``properties`` (names of :data:`ALL_PROPERTIES`; default the five
    of :data:`PROPERTIES`) for ``t`` and, with ``model``, its prediction on the same inputs
    (``predicted``, each with ``agreement``)."""
    t0 = time.perf_counter()
    props = list(PROPERTIES if properties is None else properties)
    bad = [p for p in props if p not in ALL_PROPERTIES]
    if bad:
        raise ValueError(f"unknown invariance property {', '.join(bad)}; accepted: {', '.join(ALL_PROPERTIES)}")
    shared = _Shared(case, device)
    rec = {"case": case.name, "config": case.as_dict(), "properties": _measure(shared, t, props)}
    if model is not None:
        pred = _measure(shared, model, props)
        for p, r in pred.items():
            r["agreement"] = agreement(rec["properties"][p], r)
        rec["predicted"] = pred
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    return rec


def _run(records: list[dict]) -> list[str]:
    """The properties the records hold, in :data:`ALL_PROPERTIES`' order (the default five when none)."""
    seen = {p for r in records for p in r["properties"]}
    return [p for p in ALL_PROPERTIES if p in seen] or list(PROPERTIES)


def _prediction_summary(records: list[dict]) -> dict:
    per = {p: {"agree": 0, "disagree": 0, "not compared": 0} for p in _run(records)}
    disagreements = []
    for r in records:
        for p, res in r["predicted"].items():
            a = res["agreement"]
            per[p][a or "not compared"] += 1
            if a == "disagree":
                disagreements.append(
                    {
                        "case": r["case"],
                        "property": p,
                        "measured": r["properties"][p]["result"],
                        "predicted": res["result"],
                    }
                )
    agree = sum(n["agree"] for n in per.values())
    return {"agree": agree, "disagree": len(disagreements), "per_property": per, "disagreements": disagreements}


def uncompared(prop: str, records: list[dict]) -> str:
    """Why property ``prop`` made no comparison over ``records``: its results counted, with the
    commonest reasons (a required property that compared nothing fails the run, and says this)."""
    if not records:
        return "0 comparisons: no case was run"
    by: dict[tuple, int] = {}
    for r in records:
        res = r["properties"].get(prop, {"result": "not run", "reason": "the property was not asked for"})
        key = (res["result"], res.get("reason", ""))
        by[key] = by.get(key, 0) + 1
    top = sorted(by.items(), key=lambda kv: -kv[1])
    said = "; ".join(f"{res} on {n} of {len(records)} case(s): {why}" for (res, why), n in top[:2])
    more = f"; {len(top) - 2} other reason(s) in the report" if len(top) > 2 else ""
    return f"0 comparisons: {said}{more}"


def summarize(records: list[dict], required: list[str], model: str | None = None) -> dict:
    """Counts per property and result; whether the required properties hold.  A required
    property fails when it differs, errs or timed out anywhere, and when it made no comparison
    at all (``uncompared``: property -> why, :func:`uncompared`): a gate that compared nothing
    passes nothing.  With a model, how many of its predictions agree with the measurement."""
    run = _run(records)
    counts = {p: dict.fromkeys(RESULTS, 0) for p in run + [p for p in required if p not in run]}
    for r in records:
        for p, res in r["properties"].items():
            counts[p][res["result"]] += 1
    compared = sum(counts[p]["holds"] + counts[p]["differs"] for p in counts)
    none = {p: uncompared(p, records) for p in required if not counts[p]["holds"] + counts[p]["differs"]}
    failing = [p for p in required if counts[p]["differs"] or counts[p]["error"] or counts[p]["timeout"] or p in none]
    s = {
        "counts": counts,
        "required": required,
        "compared": compared,
        "failing": failing,
        "uncompared": none,
        "passed": compared > 0 and not failing,
    }
    if model is not None:
        s["prediction"] = {"model": model, **_prediction_summary(records)}
    return s


def audit_kernel(
    t: Target,
    cases: list,
    *,
    device,
    model: Target | None,
    properties: dict,
    required: list[str],
    suite: str,
    meta: dict,
    advance: Callable[[], None] = lambda: None,
) -> dict:
    """The invariance report of kernel ``t`` (predicted by ``model``, when given): each case's
    :func:`run_case` over ``properties`` (name -> what it compares), calling ``advance`` after
    each, and their :func:`summarize` under the ``required`` properties; ``meta`` (the report's
    header: command, created, environment, domain) placed after its suite."""
    t0 = time.perf_counter()
    records = []
    for c in cases:
        records.append(run_case(c, t, device=device, model=model, properties=list(properties)))
        advance()
    mname = None if model is None else model.name
    return {
        "schema": SCHEMA,
        "kernel": t.name,
        "predict": mname,
        "suite": suite,
        **meta,
        "device": str(device),
        "seconds": round(time.perf_counter() - t0, 2),
        "properties": properties,
        "summary": summarize(records, required, mname),
        "cases": records,
    }
