"""The audit report: JSON (schema ``fa4-audit/report/2``, docs/design.md), Markdown, JUnit XML
(HTML: ``audits.report.html``); a report read back is checked and upgraded by ``audits.report.schema``."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from audits.common import EXIT_INCOMPLETE, atomic_write
from audits.engine import journal
from audits.engine.stop import StopReason
from audits.report.header import kernel_environment, versions_line
from audits.report.html import case_cells, grad_cells, render_html, worst_key
from audits.report.maps import DEFAULT_MAPS, html_figures, write_maps
from audits.report.records import FAILING, VERDICTS, CaseRecord
from audits.report.schema import SCHEMA, ReportError, journal_basis, validate_report
from audits.suites.case import identity_of
from audits.suites.domain import Domain
from audits.verdict.coverage import basis_of, coverage_from_basis, coverage_lines
from audits.verdict.gate import backward_verdict
from audits.verdict.known import KNOWN, known_lines, strict_failed
from audits.verdict.separators import cause_lines, reasons_by_fault, separator_text, separators, where_lines
from numerics.metrics import nan_aware_max

__all__ = [
    "SCHEMA",
    "build_report",
    "write_report",
    "exit_code",
    "summary_line",
    "validate_report",
    "ReportError",
    "partial_line",
    "run_counts",
    "collapse_reasons",
    "report_from_journal",
    "STOPPED",
    "worst_text",
]

MD_ALL_CASES = 200  # report.md lists every case up to this many
#: why a run ended before its last selected case (the summary's ``stopped``), in words
STOPPED = {reason: reason.words for reason in StopReason}


def _worst_error(records: list[CaseRecord], quantity: str) -> dict | None:
    """The summary's worst case of an error record (``out``, ``lse``), NaN-aware: ``value`` is
    ``numerics.metrics.nan_aware_max`` (NaN or inf where the kernel returned them at elements whose
    reference is finite, so that an all-NaN case is the worst and not a 0), ranked by
    ``audits.report.html.worst_key``; with such elements ``nonfinite`` (their count) and ``of``
    (the elements checked, when the record has it)."""
    have = [r for r in records if isinstance(r.get(quantity), dict) and "max_abs" in r[quantity]]
    if not have:
        return None
    r = max(have, key=lambda r: worst_key(r[quantity]))
    e = r[quantity]
    out = {"value": nan_aware_max(e), "case": r["case"]}
    if n := e.get("nonfinite_where_ref_finite"):
        out["nonfinite"] = n
        if isinstance(e.get("checked"), int):
            out["of"] = e["checked"]
    return out


def _worst_tightness(records: list[CaseRecord]) -> dict | None:
    """The summary's worst forward err/bound: the largest ``bound.tightness``, except that a case
    whose output is NaN or inf where the reference is finite (violations without a finite ratio,
    ``numerics.metrics.bound_check``) ranks above any number, its value NaN or inf."""
    have = [r for r in records if (r.get("bound") or {}).get("tightness") is not None]
    if not have:
        return None

    def key(r: CaseRecord) -> tuple[int, float]:
        out = r.get("out") or {}
        return worst_key(out) if out.get("nonfinite_where_ref_finite") else (0, r["bound"]["tightness"])

    r = max(have, key=key)
    out = r.get("out") or {}
    if n := out.get("nonfinite_where_ref_finite"):
        return {"value": nan_aware_max(out), "case": r["case"], "nonfinite": n}
    return {"value": r["bound"]["tightness"], "case": r["case"]}


def _nonfinite(errors: dict) -> int:
    return int(errors.get("nonfinite_where_ref_finite") or 0)


def worst_text(w: dict) -> str:
    """A summary ``worst`` entry in words: its value (NaN-aware) with its non-finite count."""
    counts = ""
    if w.get("nonfinite"):
        of = f" of {w['of']:,}" if isinstance(w.get("of"), int) else ""
        counts = f" ({w['nonfinite']:,}{of} non-finite)"
    return f"{w['value']:.3g}{counts} ({w['case']})"


def build_report(
    *,
    kernel: str,
    suite: str,
    seed: int,
    device: str,
    environment: dict,
    thresholds: dict,
    records: list[CaseRecord],
    command: str,
    created: str,
    shard: str | None,
    selected: int | None = None,
    stopped: str | None = None,
    coverage_basis: dict | None = None,
    backward: bool | None = None,
) -> dict:
    """The report of ``records``.  ``selected``: how many cases the run was given (default: as
    many as there are records); fewer records make it a partial report (``"partial": true``, the
    summary's ``selected`` / ``run`` / ``not_run`` and ``stopped``: why, a key of :data:`STOPPED`),
    which never passes (:func:`exit_code`).  Each record gets its ``case_id`` (its identity,
    ``audits.suites.case.canonical_identity``) when it has none.
    ``coverage``: :func:`audits.verdict.coverage.coverage` of the records on ``coverage_basis``
    (the kernel's domain and architecture; None: read from the kernel ``kernel`` now,
    ``audits.verdict.coverage.basis_of``) judging the backward when ``backward`` (None: when a
    record has one)."""
    counts = {v: sum(r["verdict"] == v for r in records) for v in VERDICTS}
    selected = len(records) if selected is None else max(selected, len(records))
    for r in records:  # its identity, what comparisons match it by (audits.suites.case.canonical_identity)
        if "case_id" not in r:
            r["case_id"] = identity_of(r["config"], where=f"case {r['case']}")
    rep = {
        "schema": SCHEMA,
        "kernel": kernel,
        "suite": suite,
        "shard": shard,
        "seed": seed,
        "device": device,
        "environment": kernel_environment(environment=environment, kernel=kernel),  # its own release (fa4@DIR)
        "command": command,
        "created": created,
        "thresholds": {k: v for k, v in thresholds.items()},
        "partial": selected > len(records),
        "summary": {
            "cases": len(records),
            "selected": selected,
            "run": len(records),
            "not_run": selected - len(records),
            "stopped": stopped if selected > len(records) else None,
            "verdicts": counts,
            # compared with the FP64 reference and judged; skipped and out-of-domain were not
            # (a known case that failed its comparison was compared too: audits.verdict.known)
            "evaluated": counts["pass"] + counts["warn"] + counts["fail"] + _known_compared(records),
            "lse_not_audited": sum(r.get("lse_returned") is False for r in records),
            "worst": {
                "out_max_abs": _worst_error(records, "out"),
                "lse_max_abs": _worst_error(records, "lse"),
                "bound_tightness": _worst_tightness(records),
            },
            "backward": _backward_summary(records),
        },
        "cases": records,
    }
    rep["coverage"] = _coverage(kernel, records, coverage_basis, backward)
    # which case fields tell the failing cases from the passing ones (docs/diagnosis.md), over
    # these records: a merge, a re-judged report and a journal read back get it recomputed
    rep["diagnosis"] = separators(records, arch=rep["coverage"].get("arch"))
    return rep


def _coverage(kernel: str, records: list[CaseRecord], basis: dict | None, backward: bool | None) -> dict:
    """The report's ``coverage`` (``audits.verdict.coverage``); ``{"absent": why}`` when the basis cannot
    be had (a kernel that does not load here, a malformed declaration)."""
    if basis is None:
        try:
            basis = basis_of(kernel)
        except Exception as exc:  # noqa: BLE001 - any failure to load the kernel: coverage says why it is absent
            basis = {"absent": f"the kernel {kernel} could not be read here ({type(exc).__name__}: {exc})"}
    return coverage_from_basis(basis, records=records, backward=backward)


def _backward_summary(records: list[CaseRecord]) -> dict | None:
    """What ``run --backward`` adds to the summary (None without it): cases whose gradients ran,
    per gradient the worst max |err| and err/bound, and the run-to-run spread over all cases
    (elements differing between backward runs on the same inputs, worst ULP distance)."""
    bs = [(r["case"], r["backward"]) for r in records if r.get("backward")]
    if not bs:
        return None
    out = {"cases": len(bs), "ran": sum(b["status"] == "ran" for _, b in bs), "grads": {}}
    for n in ("dq", "dk", "dv", "dsink"):
        have = [(c, b["grads"][n]) for c, b in bs if n in (b.get("grads") or {})]
        if not have:
            continue
        worst = max(have, key=lambda t: worst_key(t[1]))  # NaN-aware, as the forward's
        tight = [(c, g["bound"]["tightness"]) for c, g in have if g.get("bound")]
        sp = [b["spread"][n] for _, b in bs if n in (b.get("spread") or {})]
        out["grads"][n] = {
            "max_abs": {"value": nan_aware_max(worst[1]), "case": worst[0]}
            | ({"nonfinite": worst[1]["nonfinite_where_ref_finite"]} if _nonfinite(worst[1]) else {}),
            "bound_tightness": None if not tight else dict(zip(("case", "value"), max(tight, key=lambda t: t[1]))),
            "spread_elements": sum(x["differing"] for x in sp),
            "spread_max_ulp": max((x["max_ulp"] for x in sp), default=0),
        }
    return out


def run_counts(report: dict) -> tuple[int, int, int]:
    """(selected, run, not run) cases of a report; a summary without the partial counts ran
    what it selected (a report read is given them: ``audits.report.schema.upgrade_report``)."""
    s = report["summary"]
    run = s.get("run", s["cases"])
    selected = s.get("selected", run)
    return selected, run, selected - run


def _known_compared(records: list[CaseRecord]) -> int:
    """Known cases (``audits.verdict.known``) whose failing verdict was ``fail``: compared and judged."""
    return sum(r["verdict"] == KNOWN and r.get("known_from") == "fail" for r in records)


def _evaluated(report: dict) -> int:
    """Cases compared with the reference and judged: pass, warn, fail, and known cases whose
    failing verdict was fail (:func:`_known_compared`)."""
    c = report["summary"]["verdicts"]
    known = _known_compared(report.get("cases") or []) if c.get(KNOWN) else 0
    return c["pass"] + c["warn"] + c["fail"] + known


def exit_code(report: dict) -> int:
    """1 when a case failed, errored, crashed (or timed out); else 3 (``EXIT_INCOMPLETE``) for a
    partial report, whose unrun cases were not checked; else 1 when no case was evaluated (a run
    that compared nothing checked nothing); else 0.  Never 0 for what was not checked."""
    c = report["summary"]["verdicts"]
    evaluated = _evaluated(report)
    if sum(c.get(v, 0) for v in FAILING) or strict_failed(report):  # --strict-known: an entry gone
        return 1
    if run_counts(report)[2] > 0:
        return EXIT_INCOMPLETE
    return 0 if evaluated else 1


def partial_line(report: dict) -> str | None:
    """The line "PARTIAL: R of S selected cases run, N not run (why)" of a partial report, else None."""
    selected, run, not_run = run_counts(report)
    if not_run <= 0:
        return None
    why = report["summary"].get("stopped")
    why = f" ({STOPPED.get(why, why)})" if why else ""
    return f"PARTIAL: {run} of {selected} selected cases run, {not_run} not run{why}"


def report_from_journal(path) -> dict:
    """The report a run's ``journal.jsonl`` stands for, as the run would have written it at this
    point (its header keeps the run's command, environment and thresholds; cases in suite
    order): partial (``stopped`` "journal") while cases are missing, so that a run that was
    killed, or is still going, can be read; :class:`ReportError` when ``path`` is no journal."""
    head = journal.read_header(Path(path))
    if head is None:
        raise ReportError(f"{path}: not a journal of fa4-audit run (no {journal.SCHEMA} header line)")
    extra = head.get("report") or {}
    records = journal.read_ordered(Path(path))
    return build_report(
        kernel=head["kernel"],
        suite=head["suite"],
        seed=head["seed"],
        device=extra.get("device", "unknown"),
        environment=extra.get("environment", {"fa4_audit": head.get("fa4_audit", "unknown")}),
        thresholds=extra.get("thresholds", {"digest": head["thresholds"]}),
        records=records,
        command=extra.get("command", f"(read from the journal {path})"),
        created=extra.get("created", "unknown"),
        shard=extra.get("shard"),
        selected=head.get("n_cases"),
        stopped=StopReason.JOURNAL,
        coverage_basis=journal_basis(head),
        backward=head.get("backward") is not None,
    )


def collapse_reasons(records: list[CaseRecord]) -> list[tuple[CaseRecord, int]]:
    """Records grouped by (verdict, reasons): the first record of each group and the group's
    size, in order of first appearance, so that a console shows a reason repeated over many
    cases once, with its count.  A contract breach counts by its tensor and fault, not its sizes
    (``audits.verdict.separators.reasons_by_fault``): a transposed output is one group."""
    groups: dict[tuple, list] = {}
    for r in records:
        key = (r["verdict"], tuple(x for x in reasons_by_fault(r) if x))
        groups.setdefault(key, [r, 0])[1] += 1
    return [(r, n) for r, n in groups.values()]


def summary_line(report: dict) -> str:
    """One line of counts: evaluated, then every verdict present, LSE not audited, the gradients
    when ``--backward`` ran (:func:`_gradients_part`), total."""
    s = report["summary"]
    v = ", ".join(f"{k} {n}" for k, n in s["verdicts"].items() if n)
    evaluated = _evaluated(report)
    lse = f"; LSE not audited in {s['lse_not_audited']}" if s.get("lse_not_audited") else ""
    part = partial_line(report)
    line = f"{evaluated} of {s['cases']} cases evaluated ({v}){lse}" + _gradients_part(report)
    return line + (f"; {part}" if part else "")


def _gradients_part(report: dict) -> str:
    """The summary's "; gradients: A of N cases audited (pass P, fail F, ...)" when a case has a
    backward record: a case's verdict is the worst of its forward and its gradients, so without
    this a reader of the counts cannot tell whether the gradients of passing cases passed.  Each case's
    gradients counted by their own verdict (``audits.verdict.gate.backward_verdict``; "not run":
    no backward record, its forward did not run).  A report whose thresholds lack the [backward]
    tables (one read from a journal keeps their digest) counts the gradients that ran."""
    cases = report["cases"]
    if not any(c.get("backward") for c in cases):
        return ""
    th = report.get("thresholds") or {}
    if not (isinstance(th.get("backward"), dict) and isinstance(th.get("policy"), dict)):
        ran = sum((c.get("backward") or {}).get("status") == "ran" for c in cases)
        return f"; gradients: ran in {ran} of {len(cases)} cases"
    got = [_gradients_verdict(c, th) for c in cases]
    counts = ", ".join(f"{v} {got.count(v)}" for v in (*VERDICTS, "not run") if got.count(v))
    audited = sum(got.count(v) for v in ("pass", "warn", "fail", "known"))
    return f"; gradients: {audited} of {len(cases)} cases audited ({counts})"


def _gradients_verdict(case: dict, th: dict) -> str:
    """A case's gradients' verdict for the summary: ``known`` where a ``--known`` entry describes
    the case's failure (``audits.verdict.known``: it covers every failing finding, the gradients'
    included), else their own (``audits.verdict.gate.backward_verdict``; "not run": none)."""
    got = backward_verdict(case=case, thresholds=th) or "not run"
    return "known" if case.get("verdict") == "known" and got in FAILING else got


#: the unrestricted domain, against which a report's declared one is shown
_UNRESTRICTED = Domain()


def _domain_lines(info: dict | None) -> list[str]:
    """What the suite was built within (a declared domain), for the Markdown report."""
    if not info:
        return []
    kept = {k: v for k, v in info["domain"].items() if v != getattr(_UNRESTRICTED, k)}
    decl = ", ".join(f"{k} {v}" for k, v in kept.items()) or "no restriction"
    L = [f"Suite built within the declared domain ({info.get('rule', 'single')}): {decl}."]
    if info.get("pairs_covered") is not None:
        L[-1] += f" Pairs of supported axis values covered: {info['pairs_covered']}."
    L += [f"- family {f} not applicable: {why}" for f, why in (info.get("not_applicable") or {}).items()]
    L += [
        f"- {k} skips {x['cases_outside']} cases outside its domain"
        for k, x in (info.get("kernels") or {}).items()
        if x.get("cases_outside")
    ]
    return L + [""]


def _memory_lines(cases: list) -> list[str]:
    """What the poisoned re-runs of accepted cases checked (``written``, the forward's and the
    backward's: ``audits.engine.evaluate._judged_written``), for the Markdown report: how many
    cases were re-run because their results held values fresh memory could have supplied, and how
    many of them depend on memory the kernel never wrote (those fail, and are listed with the
    failing cases).  Nothing when no case was re-run so."""
    halves = {
        "result": [c["written"] for c in cases if isinstance(c.get("written"), dict)],
        "gradients": [b["written"] for c in cases if isinstance((b := c.get("backward") or {}).get("written"), dict)],
    }
    said = []
    for what, ws in halves.items():
        if not ws:
            continue
        bad = sum(bool(w.get("unwritten") or w.get("read")) for w in ws)
        unchecked = sum("note" in w for w in ws)
        n = f"{len(ws)} case{'' if len(ws) == 1 else 's'}"
        found = f"{bad} depend{'s' if bad == 1 else ''} on it, and fail" if bad else "none depends on it"
        text = f"{n} whose {what} held NaN, inf or 0 (or a non-finite reference) re-run with poisoned memory: {found}"
        if unchecked:
            text += f" ({unchecked} not checked: every poisoned run failed)"
        said.append(text)
    if not said:
        return []
    head = 'Memory the kernel never wrote (docs/diagnosis.md, "A pass that rests on memory"): '
    return [head + "; ".join(said) + ".", ""]


def _markdown(rep: dict) -> str:
    s = rep["summary"]
    L = [
        f"# fa4-audit: {rep['kernel']} on suite {rep['suite']}" + (f" (shard {rep['shard']})" if rep["shard"] else ""),
        "",
        f"`{rep['command']}` on {rep['created']}; device {rep['device']}; "
        f"thresholds `{rep['thresholds'].get('path', '')}`.",
        "",
        versions_line(rep.get("environment")) + ".",
        "",
        summary_line(rep) + ".",
        "",
    ]
    if part := partial_line(rep):
        L += [f"**{part}**: the cases not run were not checked; `fa4-audit run ... --resume` continues the run.", ""]
    L += _domain_lines(rep.get("domain"))
    L += _memory_lines(rep["cases"])
    for k, w in s["worst"].items():
        if w:
            L.append(f"- worst {k}: {worst_text(w)}")
    rows = rep["cases"]
    if len(rows) > MD_ALL_CASES:  # a table of thousands of rows is read by no one: what needs attention
        tight = sorted(
            (r for r in rows if (r.get("bound") or {}).get("tightness") is not None),
            key=lambda r: -r["bound"]["tightness"],
        )[:20]
        keep = {r["case"] for r in rows if r["verdict"] not in ("pass", "skipped", "out-of-domain")} | {
            r["case"] for r in tight
        }
        rows = [r for r in rows if r["case"] in keep]
        L += [
            "",
            f"{s['cases']} cases: below, every case not passing and the 20 closest to their bound; "
            "all of them in report.json (`fa4-audit show`).",
        ]
    L += [
        "",
        "| case | verdict | max abs err | rel L2 | LSE err | err/bound | seconds | reasons |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = case_cells(r, thresholds=rep["thresholds"])
        verdict = f"known ({r['known_id']})" if r["verdict"] == KNOWN else r["verdict"]
        cells = (r["case"], verdict, c["max_abs"], c["rel_l2"], c["lse"], c["tightness"], f"{r['seconds']:.2f}")
        L.append("| " + " | ".join((*cells, c["reasons"])) + " |")
    if any(r.get("backward") for r in rows):
        L += [
            "",
            "## Gradients (--backward)",
            "",
            "| case | verdict | max \\|grad - ref\\| | err/bound | run to run |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            g = grad_cells(r, thresholds=rep["thresholds"])
            L.append(f"| {r['case']} | {r['verdict']} | {g['grads']} | {g['grad_tightness']} | {g['spread']} |")
    if known := known_lines(rep):  # the --known file's entries, apart from the failures (audits.verdict.known)
        L += ["", "## Known defects", "", "```", *known, "```"]
    L += _diagnosis_markdown(rep)
    L += ["", "## Coverage", "", "```", *coverage_lines(rep.get("coverage")), "```"]
    fails = [r for r in rep["cases"] if r["verdict"] in FAILING]
    if fails:
        L += ["", "## Reproduce", ""]
        L += [
            f"- `{r.get('repro', '')}`" + (f" (inputs: `{r['repro_inputs']}`)" if r.get("repro_inputs") else "")
            for r in fails
        ]
    return "\n".join(L) + "\n"


def _diagnosis_markdown(rep: dict) -> list[str]:
    """The sections "Separators" (which case fields tell failing from passing cases,
    ``audits.verdict.separators``) and "Where the failing cases fail" (each failing case's
    diagnosis, one line per tensor); none for a report without them."""
    L = []
    head, rules = separator_text(rep.get("diagnosis"))
    if head:
        L += ["", "## Separators", "", head + ("." if not rules else ":"), ""]
        L += [f"- `{rule}`" + (f": {detail}" if detail else "") for rule, detail in rules]
    where = [
        (r, lines) for r in rep["cases"] if (lines := [*cause_lines(r), *where_lines(r)]) and r["verdict"] != "pass"
    ]
    if where:
        L += ["", "## Where the failing cases fail, and why", ""]
        for r, lines in where:
            L += [f"- {r['case']} ({r['verdict']})", *(f"  - {x}" for x in lines)]
    return L


def _junit(rep: dict) -> str:
    """JUnit XML for CI systems: one testcase per case; fail as a failure, error/crash/timeout as
    errors (their ``type`` the verdict), skipped as skipped, warnings in system-out."""
    c = rep["summary"]["verdicts"]
    suite = ET.Element(
        "testsuite",
        name=f"fa4-audit {rep['kernel']} {rep['suite']}",
        tests=str(rep["summary"]["cases"]),
        failures=str(c["fail"]),
        errors=str(c["error"] + c["crash"] + c["timeout"]),
        skipped=str(c["skipped"]),
        time=f"{sum(r.get('seconds', 0.0) for r in rep['cases']):.3f}",
    )
    if part := partial_line(rep):  # the cases not run are not in the file: say so where CI looks
        props = ET.SubElement(suite, "properties")
        selected, run, not_run = run_counts(rep)
        for name, value in (
            ("partial", "true"),
            ("selected", selected),
            ("run", run),
            ("not_run", not_run),
            ("stopped", rep["summary"].get("stopped") or ""),
        ):
            ET.SubElement(props, "property", name=name, value=str(value))
    for r in rep["cases"]:
        tc = ET.SubElement(
            suite,
            "testcase",
            classname=f"{rep['kernel']}.{rep['suite']}",
            name=r["case"],
            time=f"{r.get('seconds', 0.0):.3f}",
        )
        msg = "; ".join(x for x in r["reasons"] if x)
        if r["verdict"] == "fail":
            ET.SubElement(tc, "failure", message=msg).text = r.get("repro", "")
        elif r["verdict"] in ("error", "crash", "timeout"):
            ET.SubElement(tc, "error", message=msg, type=r["verdict"]).text = r.get("repro", "")
        elif r["verdict"] == KNOWN:  # not a failure of the run: shown apart, as CI shows a skip
            ET.SubElement(tc, "skipped", message=f"known defect {r['known_id']}: {msg}")
        elif r["verdict"] == "skipped":
            ET.SubElement(tc, "skipped", message=msg)
        elif r["verdict"] == "warn":
            ET.SubElement(tc, "system-out").text = msg
    if part:
        ET.SubElement(suite, "system-out").text = part
    return ET.tostring(ET.ElementTree(suite).getroot(), encoding="unicode", xml_declaration=True) + "\n"


def write_report(rep: dict, out_dir: str | Path, *, maps: int = DEFAULT_MAPS) -> dict[str, Path]:
    """Write report.json, report.md, report.html and report.junit.xml into ``out_dir``; first the
    error maps of the ``maps`` worst failing cases whose map data the run saved in ``out_dir``
    (``audits.report.maps.write_maps``: ``maps/<case>.png`` and ``.svg``, inlined in
    report.html; ``run --maps N``, 0 renders none)."""
    out = Path(out_dir)
    paths = {
        "json": out / "report.json",
        "md": out / "report.md",
        "html": out / "report.html",
        "junit": out / "report.junit.xml",
    }
    write_maps(rep, out, worst=maps)
    atomic_write(paths["html"], render_html(rep, summary_line(rep), figures=html_figures(rep, out)))
    atomic_write(paths["json"], json.dumps(rep, separators=(",", ":"), default=str) + "\n")
    atomic_write(paths["md"], _markdown(rep))
    atomic_write(paths["junit"], _junit(rep))
    return paths
