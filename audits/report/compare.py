"""What changed between a baseline kernel and each candidate run on the same inputs in one run
(``fa4-audit compare``, docs/compare.md): read from the kernels' records (each candidate's record
holds ``compare``, its results against the baseline's bit for bit: ``audits.engine.compare``),
one :class:`Comparison` per candidate, rendered once to the console lines, Markdown, HTML and
JSON.

A **regression** is what the command exits 1 on: a verdict worse than the baseline's on the same
case (passing -> warn or failing, warn -> failing, known -> failing, ran -> refused), a bound
tightness (error / per-element bound, forward and each gradient) worse than the baseline's by
more than ``[compare] tightness_ratio`` where it reaches ``[compare] tightness_floor`` (the
thresholds file says why), or a non-finite value where the baseline's is finite.  A case whose
results could not be compared is counted apart, never as identical.

A case whose gradients differ is split by each kernel's own run-to-run variation (the backward's
runs on one graph): it differs **only run to run** when every differing gradient also differs
between two runs of one of the kernels (atomics: the difference need not be the change), it
**changed** when a gradient differs that both kernels reproduce bit for bit, and it is unknown
where a side's variation was not measured (one backward run, or a record from before it was
kept).  This splits the counts only: regressions stay verdict, tightness and non-finite based."""

from __future__ import annotations

import copy
import html
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from audits.common import atomic_write
from audits.engine.compare import COMPARED, FORWARD_TENSORS, label_run_to_run
from audits.report.records import FAILING
from audits.verdict.gate import fa_allowed
from audits.verdict.separators import CauseTally, cause_groups, cause_text, likely_cause
from numerics.metrics import ULP_BUCKETS

__all__ = [
    "Comparison",
    "Regression",
    "compare_reports",
    "summary_lines",
    "render_md",
    "render_html",
    "write_comparison",
]

#: how bad a verdict is, for "worse" and "better" (a refusal is judged apart: ran -> skipped)
_RANK = {"pass": 0, "out-of-domain": 0, "warn": 1, "known": 2, **{v: 3 for v in FAILING}}
#: differing cases listed in full in report.md / html (all are in compare.json)
LISTED = 40


@dataclass
class Regression:
    """One regression: the case, what got worse (``kind``: verdict | refused | tightness |
    nonfinite) and how, in words."""

    case: str
    kind: str
    detail: str


@dataclass
class Comparison:
    """A candidate against the baseline over the cases both ran: counts, the ULP histogram summed
    over differing elements, the cases that differ, verdict changes and the regressions."""

    baseline: str
    candidate: str
    versions: dict
    cases: int = 0
    compared: int = 0
    not_compared: list = field(default_factory=list)
    forward: dict = field(default_factory=lambda: {"compared": 0, "identical": 0, "run_to_run_only": 0})
    backward: dict = field(
        default_factory=lambda: {
            "compared": 0,
            "identical": 0,
            "run_to_run_only": 0,
            "changed": 0,
            "unknown": 0,
            "run_to_run_tensors": {},
            "run_to_run_sides": {"baseline": 0, "candidate": 0},
            "run_to_run_deterministic": 0,
        }
    )
    ulp_histogram: dict = field(default_factory=lambda: {label: 0 for label, _, _ in ULP_BUCKETS})
    max_ulp: int = 0
    max_row_ulp: float = 0.0
    nan_payload: int = 0
    signed_zero: int = 0
    nonfinite_changed: int = 0
    lost_nonfinite: int = 0
    #: each side's kernel time over the compared cases ({"baseline"|"candidate": ``call_times``})
    seconds: dict = field(default_factory=dict)
    differing: list = field(default_factory=list)
    verdicts: dict = field(default_factory=dict)
    better: list = field(default_factory=list)
    regressions: list = field(default_factory=list)
    tightness: dict = field(
        default_factory=lambda: {"judged": 0, "worst_ratio": None, "worst_case": None, "other_bound": 0}
    )
    #: the tested causes over the candidate's cases whose verdict got worse (``cause_groups``)
    causes: CauseTally | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _tightness(rec: dict) -> dict[str, tuple[str | None, float]]:
    """A record's bound tightness per quantity (error / per-element bound: out, lse, each
    gradient), each with the kind of bound it was measured against ("fa4" or a peer's)."""
    got = {}
    b = rec.get("bound") or {}
    for name, key in (("out", "tightness"), ("lse", "lse_tightness")):
        if isinstance(b.get(key), (int, float)):
            got[name] = (b.get("kind"), float(b[key]))
    bwd = rec.get("backward") or {}
    for g, gr in (bwd.get("grads") or {}).items():
        t = (gr.get("bound") or {}).get("tightness")
        if isinstance(t, (int, float)):
            got[g] = (bwd.get("bound_kind"), float(t))
    return got


def _fa_margin(rec: dict, th: dict) -> float | None:
    """|out - ref| over what FA's criterion allows (None where it does not gate the case)."""
    allowed = fa_allowed(m=rec, th=th) if rec.get("status") == "ran" else None
    if not allowed:
        return None
    return float(rec["fa_criterion"]["max_abs"]) / allowed


def _verdict_change(base: dict, cand: dict) -> str | None:
    """ "worse", "better", "refused" (the baseline ran it, the candidate refused it) or None."""
    vb, vc = base["verdict"], cand["verdict"]
    if vb == vc:
        return None
    if vc == "skipped" and base.get("status") == "ran":
        return "refused"
    if vb not in _RANK or vc not in _RANK:
        return None
    return "worse" if _RANK[vc] > _RANK[vb] else "better" if _RANK[vc] < _RANK[vb] else None


def _differing_entry(rec: dict, cmp: dict, base: dict, th: dict) -> dict:
    """One differing case as the report lists it: per tensor its counts, ULPs and where; each
    side's verdict, bound tightness per quantity and FA-criterion margin (|err| / allowed)."""
    tensors = {}
    for name, d in cmp["tensors"].items():
        if not d.get("differ"):
            continue
        tensors[name] = {
            "differ": d["differ"],
            "elements": d["elements"],
            "max_ulp": d.get("max_ulp"),
            "max_row_ulp": d.get("max_row_ulp"),
            "new_nonfinite": d.get("new_nonfinite", 0),
            "where": ((d.get("where") or {}).get("summary")) or d.get("layout_changed"),
            "run_to_run": d.get("run_to_run"),
            "attributable": d.get("attributable"),
        }
    cand_t = _tightness(rec)
    return {
        "case": rec["case"],
        "case_id": rec.get("case_id"),
        "verdicts": [base["verdict"], rec["verdict"]],
        "tightness": {q: [t[1], (cand_t.get(q) or (None, None))[1]] for q, t in _tightness(base).items()},
        "fa_margin": [_fa_margin(base, th), _fa_margin(rec, th)],
        "backward_changed": cmp.get("backward_changed"),
        "tensors": tensors,
    }


def _judge_case(c: Comparison, base: dict, rec: dict, th: dict) -> None:
    """One case of candidate ``rec`` against ``base``: counts, verdict change, tightness, regressions."""
    name = rec["case"]
    change = _verdict_change(base, rec)
    c.verdicts[f"{base['verdict']} -> {rec['verdict']}"] = (
        c.verdicts.get(f"{base['verdict']} -> {rec['verdict']}", 0) + 1
    )
    if change == "worse":  # the candidate's best tested cause first (docs/diagnosis.md, "Causes"), then its reasons
        why = "; ".join(x for x in (likely_cause(rec), *(rec.get("reasons") or [])) if x)
        c.regressions.append(Regression(name, "verdict", f"{base['verdict']} -> {rec['verdict']}: {why}"))
    elif change == "refused":
        c.regressions.append(
            Regression(name, "refused", f"the baseline ran it; the candidate refused it: {rec.get('reason')}")
        )
    elif change == "better":
        c.better.append(name)
    ratio, floor = th["compare"]["tightness_ratio"], th["compare"]["tightness_floor"]
    tb, tc = _tightness(base), _tightness(rec)
    for q in sorted(set(tb) & set(tc)):
        (kb, b), (kc, t) = tb[q], tc[q]
        if kb != kc:  # held to different analyses (FA4's, a peer's): their ratios do not compare
            c.tightness["other_bound"] += 1
            continue
        if t < floor:
            continue
        c.tightness["judged"] += 1
        r = t / max(b, floor)
        if c.tightness["worst_ratio"] is None or r > c.tightness["worst_ratio"]:
            c.tightness["worst_ratio"], c.tightness["worst_case"] = r, f"{name} ({q})"
        if r > ratio:
            c.regressions.append(
                Regression(name, "tightness", f"{q}: error/bound {b:.3g} -> {t:.3g} ({r:.3g}x > {ratio:g}x)")
            )


def _add_compared(c: Comparison, base: dict, rec: dict, cmp: dict, th: dict) -> None:
    """Bit-level counts of one compared case."""
    c.compared += 1
    fwd = [n for n in cmp["tensors"] if n in FORWARD_TENSORS]
    bwd = [n for n in cmp["tensors"] if n not in FORWARD_TENSORS]
    if fwd:
        c.forward["compared"] += 1
        c.forward["identical"] += bool(cmp["forward_identical"])
        moved = [cmp["tensors"][n] for n in fwd if cmp["tensors"][n].get("differ")]
        if moved and not any(d.get("attributable", True) for d in moved):  # each side's second call tells
            c.forward["run_to_run_only"] += 1
    if cmp.get("backward_identical") is not None:
        c.backward["compared"] += 1
        c.backward["identical"] += bool(cmp["backward_identical"])
        if cmp["backward_identical"] is False:
            _add_run_to_run(c, cmp, base, rec)
    new_nf = []
    for n in fwd + bwd:
        d = cmp["tensors"][n]
        for label, count in (d.get("ulp_histogram") or {}).items():
            c.ulp_histogram[label] = c.ulp_histogram.get(label, 0) + count
        c.max_ulp = max(c.max_ulp, int(d.get("max_ulp") or 0))
        c.max_row_ulp = max(c.max_row_ulp, float(d.get("max_row_ulp") or 0.0))
        c.nan_payload += int(d.get("nan_payload") or 0)
        c.signed_zero += int(d.get("signed_zero") or 0)
        c.nonfinite_changed += int(d.get("nonfinite_changed") or 0)
        c.lost_nonfinite += int(d.get("lost_nonfinite") or 0)
        if d.get("new_nonfinite"):
            new_nf.append(f"{n}: {d['new_nonfinite']} of {d['elements']}")
    if new_nf:
        c.regressions.append(
            Regression(rec["case"], "nonfinite", "NaN/inf where the baseline is finite: " + ", ".join(new_nf))
        )
    if not cmp["identical"] or cmp.get("missing"):
        c.differing.append(_differing_entry(rec, cmp, base, th))


def _add_run_to_run(c: Comparison, cmp: dict, base: dict, rec: dict) -> None:
    """One case whose gradients differ, counted as run-to-run only, changed or unknown
    (``backward_changed`` None: a side did not measure its run-to-run variation); for run-to-run
    only, which side's own runs differed and whether both ran with deterministic=True (the
    baseline's and candidate's case records ``base`` and ``rec``: then the variation is itself a
    defect of the side it shows on, and the verdicts say so)."""
    changed = cmp.get("backward_changed")
    if changed is None:
        c.backward["unknown"] += 1
        return
    if changed:
        c.backward["changed"] += 1
        return
    c.backward["run_to_run_only"] += 1
    seen = c.backward["run_to_run_tensors"]
    sides = c.backward["run_to_run_sides"]
    noisy = set()
    for n, d in cmp["tensors"].items():
        if n not in FORWARD_TENSORS and d.get("differ"):
            seen[n] = seen.get(n, 0) + 1
            noisy |= {side for side, k in (d.get("run_to_run") or {}).items() if k}
    for side in noisy:
        sides[side] += 1
    deterministic = all(((r or {}).get("backward") or {}).get("deterministic") is True for r in (base, rec))
    c.backward["run_to_run_deterministic"] += deterministic


def compare_reports(
    reports: dict[str, dict], *, baseline: str, thresholds: dict, versions: dict | None = None
) -> list[Comparison]:
    """Each candidate of ``reports`` (kernel -> report, as ``audits.api.audit`` returns them)
    against ``baseline``, case by case (matched by name: one run, one case list)."""
    base_cases = {r["case"]: r for r in reports[baseline]["cases"]}
    out = []
    for kern, rep in reports.items():
        if kern == baseline:
            continue
        c = Comparison(baseline=baseline, candidate=kern, versions=(versions or {}).get(kern, {}))
        for rec in rep["cases"]:
            base = base_cases.get(rec["case"])
            if base is None:
                continue
            c.cases += 1
            cmp = rec.get("compare") or {}
            if cmp.get("status") == COMPARED:
                if "backward_changed" not in cmp:  # journalled before it was kept: both records hold the spreads
                    cmp = label_run_to_run(copy.deepcopy(cmp), base_rec=base, cand_rec=rec)
                _add_compared(c, base, rec, cmp, thresholds)
            elif base.get("status") == "ran" and rec.get("status") == "ran":
                c.not_compared.append(
                    {"case": rec["case"], "why": cmp.get("why") or "no comparison recorded (resumed)"}
                )
            _judge_case(c, base, rec, thresholds)
        worse = {r.case for r in c.regressions if r.kind == "verdict"}  # the verdicts _judge_case found worse
        c.causes = cause_groups([r for r in rep["cases"] if r["case"] in worse])
        c.seconds = {"baseline": call_times(reports[baseline]["cases"]), "candidate": call_times(rep["cases"])}
        c.differing.sort(
            key=lambda e: -max((t.get("max_ulp") or 0) for t in e["tensors"].values()) if e["tensors"] else 0
        )
        out.append(c)
    return out


def call_times(records: list[dict]) -> dict:
    """A kernel's time over its case records: ``cases`` timed, ``first`` and ``second`` (the
    sums of the first and, over the cases that have one, second forward calls: ``--time-calls``),
    ``timed_twice``, ``second_differs`` (cases whose second call's bits differ), and the backward's
    ``bwd_cases``, ``bwd_first`` and ``bwd_second`` (its first and second runs on one graph)."""
    t = dict.fromkeys(("cases", "timed_twice", "second_differs", "bwd_cases"), 0)
    t.update(dict.fromkeys(("first", "second", "first_of_twice", "bwd_first", "bwd_second"), 0.0))
    for rec in records:
        calls = rec.get("call_seconds") or []
        if calls:
            t["cases"] += 1
            t["first"] += calls[0]
        if len(calls) > 1:
            t["timed_twice"] += 1
            t["first_of_twice"] += calls[0]
            t["second"] += calls[1]
            t["second_differs"] += rec.get("second_call_identical") is False
        runs = (rec.get("backward") or {}).get("seconds") or []
        if len(runs) > 2:  # the forward with its graph, then two backward runs at least
            t["bwd_cases"] += 1
            t["bwd_first"] += runs[1]
            t["bwd_second"] += runs[2]
    return t


def _time_line(side: str, kernel: str, t: dict) -> str | None:
    """One side's time in words; None when its records carry none."""
    if not t.get("cases"):
        return None
    s = lambda x: f"{x:.3g} s"  # noqa: E731
    said = f"  time, {side} {kernel}: forward first calls {s(t['first'])} over {t['cases']:,} cases"
    if t["timed_twice"]:
        extra = t["first_of_twice"] - t["second"]
        said += (
            f"; called twice on {t['timed_twice']:,}: first {s(t['first_of_twice'])}, second {s(t['second'])} "
            f"(the difference, {s(extra)}, is compilation and first use)"
        )
        said += f", {t['second_differs']:,} second calls with other bits" if t["second_differs"] else ""
    if t["bwd_cases"]:
        said += f"; backward run 1 {s(t['bwd_first'])}, run 2 {s(t['bwd_second'])} over {t['bwd_cases']:,} cases"
    return said


def _share(k: int, n: int) -> str:
    return f"{k:,} of {n:,}"


def _backward_split(b: dict) -> str:
    """The cases whose gradients differ, split by the kernels' own run-to-run variation, in words
    (a comparison without the counts, written before they were kept, says unknown)."""
    differ = b["compared"] - b["identical"]
    noise, changed = b.get("run_to_run_only"), b.get("changed")
    if noise is None or changed is None:
        return f"{differ:,} differ, run-to-run variation unknown"
    unknown = differ - noise - changed
    parts = []
    if noise:
        seen = sorted((b.get("run_to_run_tensors") or {}).items(), key=lambda kv: -kv[1])
        names = ", ".join(n if len(seen) == 1 else f"{n} {k:,}" for n, k in seen)
        sides = b.get("run_to_run_sides")
        who = ""
        if sides:
            who = f"; the baseline's runs on {sides['baseline']:,}, the candidate's on {sides['candidate']:,}"
        if b.get("run_to_run_deterministic") == noise:  # --deterministic was asked: no hint to ask for it
            how = "under deterministic=True, which should make them agree"
        else:
            how = "compare with --deterministic to tell"
        parts.append(
            f"{noise:,} differ only in gradients that also differ between two runs of the same kernel "
            f"(run-to-run: {names}{who}; {how}), {changed:,} differ beyond that"
        )
    elif changed:
        parts.append(f"{changed:,} differ where both kernels' own runs are bit-identical")
    if unknown:
        parts.append(f"{unknown:,} differ with run-to-run variation unknown (one backward run, or an older record)")
    return ", ".join(parts)


def summary_lines(c: Comparison) -> list[str]:
    """The ten-second summary of one candidate (console, report heads)."""
    lines = []
    f, b = c.forward, c.backward
    head = f"{c.candidate} vs {c.baseline}: "
    if not c.compared:
        return [head + f"nothing compared ({c.cases} cases; {len(c.not_compared)} without results on one side)"]
    fwd_diff = f["compared"] - f["identical"]
    parts = [f"forward bit-identical on {_share(f['identical'], f['compared'])} cases"]
    if f.get("run_to_run_only"):
        parts[0] += (
            f" ({f['run_to_run_only']:,} of the others differ only where a kernel's second call on the same inputs "
            "moved its own bits too)"
        )
    if b["compared"]:
        parts.append(f"backward bit-identical on {_share(b['identical'], b['compared'])}")
        if b["compared"] - b["identical"]:
            parts.append(_backward_split(b))
    lines.append(head + "; ".join(parts))
    if fwd_diff or b["compared"] - b["identical"]:
        within1 = c.ulp_histogram.get("1", 0)
        total = sum(c.ulp_histogram.values())
        row = f", at most {c.max_row_ulp:.3g} ULP of the row's largest value" if c.max_row_ulp else ""
        said = (
            [f"{total:,} finite elements apart ({within1:,} by 1 ULP), at most {c.max_ulp:,} ULP{row}"] if total else []
        )
        said += [f"{c.nan_payload:,} NaN payloads differ"] if c.nan_payload else []
        said += [f"{c.signed_zero:,} zeros changed sign"] if c.signed_zero else []
        # both sides non-finite, not the same value: NaN against inf, or an inf's sign (a leak's form)
        said += [f"{c.nonfinite_changed:,} non-finite elements changed (NaN against inf, or an inf's sign)"] * bool(
            c.nonfinite_changed
        )
        said += [f"{c.lost_nonfinite:,} elements finite where the baseline is NaN/inf"] if c.lost_nonfinite else []
        lines.append(f"  differs on {len(c.differing)} cases: " + "; ".join(said or ["no element counted"]))
    worse = sum(r.kind == "verdict" for r in c.regressions)
    refused = sum(r.kind == "refused" for r in c.regressions)
    lines.append(
        f"  verdicts: {f'{worse} worse' if worse else 'none worse'}"
        + (f", {refused} newly refused" if refused else "")
        + (f", {len(c.better)} better" if c.better else "")
        + (
            f"; tightness worst ratio {c.tightness['worst_ratio']:.3g} ({c.tightness['worst_case']})"
            if c.tightness["worst_ratio"]
            else ""
        )
    )
    if c.tightness["other_bound"]:
        lines.append(
            f"  tightness not compared on {c.tightness['other_bound']} quantities: the two sides are held to "
            "different bounds (FA4's numerics and a peer's)"
        )
    if c.not_compared:
        lines.append(f"  {len(c.not_compared)} cases not compared (a side has no result): not counted as identical")
    if any((t or {}).get("timed_twice") for t in c.seconds.values()):  # asked for (--time-calls): said
        for side, kernel in (("baseline", c.baseline), ("candidate", c.candidate)):
            line = _time_line(side, kernel, c.seconds.get(side) or {})
            lines += [line] if line else []
    if c.regressions:
        kinds = ", ".join(f"{k} {n}" for k, n in Counter(r.kind for r in c.regressions).items())
        cases = regressed_cases(c)
        lines.append(f"  REGRESSION on {len(cases)} cases ({kinds})")
        for name, found in list(cases.items())[:SHOWN]:
            lines.append(f"    {name}: " + "; ".join(f"{r.kind}: {_short(r.detail)}" for r in found))
        if len(cases) > SHOWN:
            lines.append(f"    ... and {len(cases) - SHOWN} more cases (compare.md lists every one)")
        if tally := cause_text(c.causes, lead="Likely causes of the worse verdicts, over the"):
            lines.append(f"  {tally}")
    return lines


#: regressed cases the console lists (compare.md and compare.json list every one)
SHOWN = 10


def regressed_cases(c: Comparison) -> dict[str, list[Regression]]:
    """The candidate's regressions grouped by case, in the order found."""
    cases: dict[str, list[Regression]] = {}
    for r in c.regressions:
        cases.setdefault(r.case, []).append(r)
    return cases


def _short(text: str, limit: int = 160) -> str:
    """A reason cut at ``limit`` characters (the console's; compare.md keeps it whole)."""
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _hist_row(h: dict) -> str:
    return " | ".join(f"{h.get(label, 0):,}" for label, _, _ in ULP_BUCKETS)


def _run_to_run_cell(name: str, t: dict) -> str:
    """A differing tensor's run-to-run column: "12/9", the elements that differed between the
    baseline's own backward runs (for out and LSE: its two forward calls, ``--time-calls``) and the
    candidate's ("?" where a side did not measure it); "—" for a forward called once by both;
    "unknown" in a record from before the counts were kept."""
    r = t.get("run_to_run")
    if name in FORWARD_TENSORS and (not r or all(n is None for n in r.values())):
        return "—"
    if not r:
        return "unknown"
    side = lambda n: "?" if n is None else f"{n:,}"
    return f"{side(r.get('baseline'))}/{side(r.get('candidate'))}"


def render_md(comparisons: list[Comparison], *, header: dict) -> str:
    """compare.md: the summaries, then per candidate its histogram, regressions and differing cases."""
    out = ["# fa4-audit compare", ""]
    out += [f"- created: {header.get('created')}", f"- command: `{header.get('command')}`", ""]
    for c in comparisons:
        out += [f"## {c.candidate} against {c.baseline}", ""]
        if c.versions:
            out += ["Versions: " + "; ".join(f"{k}: {v}" for k, v in c.versions.items()), ""]
        out += [f"    {line}" for line in summary_lines(c)] + [""]
        out += ["ULP distance of differing finite elements (all tensors):", ""]
        out += ["| " + " | ".join(label for label, _, _ in ULP_BUCKETS) + " |", "|" + "---|" * len(ULP_BUCKETS)]
        out += ["| " + _hist_row(c.ulp_histogram) + " |", ""]
        if c.verdicts:
            out += ["Verdicts (baseline -> candidate):", ""]
            out += [f"- {k}: {n}" for k, n in sorted(c.verdicts.items(), key=lambda kv: -kv[1])] + [""]
        if c.regressions:
            out += ["### Regressions", "", "| case | kind | what |", "|---|---|---|"]
            out += [f"| {r.case} | {r.kind} | {r.detail} |" for r in c.regressions] + [""]
        if c.differing:
            out += [
                f"### Cases that differ ({len(c.differing)}; the first {min(LISTED, len(c.differing))} by max ULP)",
                "",
            ]
            out += [
                "| case | verdicts | tensor | differ | max ULP | max ULP of row max | run-to-run | where |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for e in c.differing[:LISTED]:
                for name, t in e["tensors"].items():
                    row_ulp = f"{t['max_row_ulp']:.3g}" if t.get("max_row_ulp") is not None else "—"
                    ulp = t["max_ulp"] if t["max_ulp"] is not None else "—"
                    out.append(
                        f"| {e['case']} | {' -> '.join(e['verdicts'])} | {name} | "
                        f"{t['differ']:,} of {t['elements']:,} | {ulp} | {row_ulp} | {_run_to_run_cell(name, t)} | "
                        f"{t['where'] or '—'} |"
                    )
            out.append("")
        if c.not_compared:
            out += [f"### Not compared ({len(c.not_compared)})", ""]
            out += [f"- {e['case']}: {e['why']}" for e in c.not_compared[:LISTED]] + [""]
    return "\n".join(out)


def render_html(comparisons: list[Comparison], *, header: dict) -> str:
    """compare.html: the same content as compare.md, self-contained."""
    body = [f"<h1>fa4-audit compare</h1><p>{html.escape(str(header.get('command')))}</p>"]
    for c in comparisons:
        body.append(f"<h2>{html.escape(c.candidate)} against {html.escape(c.baseline)}</h2>")
        body.append("<pre>" + html.escape("\n".join(summary_lines(c))) + "</pre>")
        cells = "".join(f"<th>{html.escape(label)}</th>" for label, _, _ in ULP_BUCKETS)
        vals = "".join(f"<td>{c.ulp_histogram.get(label, 0):,}</td>" for label, _, _ in ULP_BUCKETS)
        body.append(f"<table><tr>{cells}</tr><tr>{vals}</tr></table>")
        if c.regressions:
            rows = "".join(
                f"<tr><td>{html.escape(r.case)}</td><td>{r.kind}</td><td>{html.escape(r.detail)}</td></tr>"
                for r in c.regressions
            )
            body.append(f"<h3>Regressions</h3><table><tr><th>case</th><th>kind</th><th>what</th></tr>{rows}</table>")
        if c.differing:
            rows = "".join(
                f"<tr><td>{html.escape(e['case'])}</td><td>{name}</td><td>{t['differ']:,} of {t['elements']:,}</td>"
                f"<td>{t['max_ulp']}</td><td>{_run_to_run_cell(name, t)}</td>"
                f"<td>{html.escape(str(t['where'] or '—'))}</td></tr>"
                for e in c.differing[:LISTED]
                for name, t in e["tensors"].items()
            )
            body.append(
                "<h3>Cases that differ</h3><table><tr><th>case</th><th>tensor</th><th>differ</th><th>max ULP</th>"
                f"<th>run-to-run</th><th>where</th></tr>{rows}</table>"
            )
    css = (
        "body{font:14px/1.4 system-ui,sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px}"
    )
    head = f"<!doctype html><html><head><meta charset='utf-8'><style>{css}</style></head>"
    return f"{head}<body>{''.join(body)}</body></html>\n"


def write_comparison(out_dir: str | Path, comparisons: list[Comparison], *, header: dict) -> dict[str, Path]:
    """compare.json, compare.md and compare.html in ``out_dir`` (each written atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {**header, "comparisons": [c.as_dict() for c in comparisons]}
    texts = {
        "json": json.dumps(doc, indent=1, default=str) + "\n",
        "md": render_md(comparisons, header=header),
        "html": render_html(comparisons, header=header),
    }
    paths = {}
    for ext, text in texts.items():
        paths[ext] = out / f"compare.{ext}"
        atomic_write(paths[ext], text)
    return paths
