"""A self-contained HTML page for an audit report: opens offline (no scripts, no external
files; plots are inline SVG).  Sections: summary, the worst cases, tables per configuration
group (dtype x head dim), a histogram of log10 max errors, and max error against seqlen_k."""

from __future__ import annotations

import html
import io
import math
from collections import defaultdict

from audits.report.records import FAILING, CaseRecord
from audits.verdict.coverage import DIRECTIONS, coverage_lines, missed_text, pairs_text
from audits.verdict.gate import ungated_figures
from audits.verdict.separators import cause_lines, separator_text, where_lines
from numerics.metrics import nan_aware_max

__all__ = ["render_html", "case_cells", "grad_cells", "max_text", "worst_key"]

_CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}td:first-child,th:first-child{text-align:left}
.pass{background:#e6f4ea}.warn{background:#fff4d6}.fail,.error,.crash,.timeout{background:#fde2e1}
.skipped,.out-of-domain{background:#eee}
h2{margin-top:1.5em}code{background:#f4f4f4;padding:0 3px}"""


def _informational(cell: str, why: str | None) -> str:
    """A figure the verdict does not gate, marked so with why (``audits.verdict.gate.ungated_figures``)."""
    return cell if why is None or cell == "—" else f"{cell} (informational: {why})"


def _nonfinite(errors: dict | None) -> int:
    """How many elements of an error record (``numerics.metrics.output_errors`` / ``lse_errors``)
    are NaN or inf where the reference is finite (0 for none, or no record)."""
    return int((errors or {}).get("nonfinite_where_ref_finite") or 0)


def max_text(errors: dict | None) -> str:
    """An error record's max |err| as every view prints it: the NaN-aware maximum
    (``numerics.metrics.nan_aware_max``), never the finite-only ``max_abs`` alone, so that a kernel
    returning NaN is not shown as exact: ``nan (640 of 640 non-finite)``, ``inf (2 of 640
    non-finite; 0.0031 over the rest)``, ``0.0031``; "—" without a record.  "of N": the elements
    where the reference is finite (``checked``; a record written before it says the count alone)."""
    if not errors or "max_abs" not in errors:
        return "—"
    n = _nonfinite(errors)
    if not n:
        return f"{errors['max_abs']:.3g}"
    of = errors.get("checked")
    counts = f"{n:,} of {of:,} non-finite" if isinstance(of, int) else f"{n:,} non-finite"
    rest = f"; {errors['max_abs']:.3g} over the rest" if not isinstance(of, int) or n < of else ""
    return f"{nan_aware_max(errors):g} ({counts}{rest})"


def worst_key(errors: dict | None) -> tuple[int, float]:
    """A sort key ranking error records by their NaN-aware max |err| (:func:`max_text`): any NaN
    above any inf above any number, more non-finite elements above fewer; no record lowest.  For
    the views' "worst cases"."""
    if not errors or "max_abs" not in errors:
        return (-1, 0.0)
    v = nan_aware_max(errors)
    if math.isfinite(v):
        return (0, v)
    return (2 if math.isnan(v) else 1, float(_nonfinite(errors)))


def case_cells(r: CaseRecord, *, thresholds: dict | None = None) -> dict[str, str]:
    """The per-case figures every view shows (Markdown, HTML, ``fa4-audit show``), formatted;
    with the report's ``thresholds``, a figure they do not gate says so (an err/bound of 3.63 on a
    passing case is otherwise read as a missed failure).  Figures are NaN-aware (:func:`max_text`):
    where the kernel returned NaN or inf at elements whose reference is finite, the output's max
    |err|, rel L2 and err/bound say so with the count, never the 0 of the finite elements."""
    o, lse, b = r.get("out") or {}, r.get("lse") or {}, r.get("bound") or {}
    f = lambda d, k: f"{d[k]:.3g}" if k in d else "—"
    ungated = ungated_figures(case=r, thresholds=thresholds) if thresholds else {}
    n_out = _nonfinite(o)
    # the bound's tightness is the largest err/bound over finite errors (numerics.metrics.bound_check):
    # a non-finite error at a finite reference is a violation with no finite ratio
    tight = f"{nan_aware_max(o):g} ({n_out:,} non-finite)" if n_out and "tightness" in b else f(b, "tightness")
    return {
        "max_abs": max_text(o),
        "rel_l2": "nan" if n_out and "rel_l2" in o else f(o, "rel_l2"),
        "lse": max_text(lse),
        "tightness": _informational(tight, ungated.get("bound")),
        "reasons": "; ".join(x for x in r["reasons"] if x),
        **grad_cells(r, thresholds=thresholds),
    }


def grad_cells(r: CaseRecord, *, thresholds: dict | None = None) -> dict[str, str]:
    """The backward figures (``run --backward``): per gradient max |err| against FP64, the worst
    error/bound over the gradients (marked informational where ``thresholds`` do not gate it), and
    the run-to-run spread (elements differing, worst ULPs); "—" where the case had no backward
    audited."""
    b = r.get("backward") or {}
    grads = b.get("grads") or {}
    if not grads:
        return {"grads": "—" if not b else b.get("status", "—"), "grad_tightness": "—", "spread": "—"}
    tight = [g["bound"]["tightness"] for g in grads.values() if g.get("bound")]
    # NaN-aware as case_cells: a gradient non-finite where its reference is finite has no finite err/bound
    bad = [(n, g) for n, g in grads.items() if _nonfinite(g) and g.get("bound")]
    tight_text = f"{max(tight):.3g}" if tight else "—"
    if bad:
        tight_text = ", ".join(f"{n} {nan_aware_max(g):g} ({_nonfinite(g):,} non-finite)" for n, g in bad)
    spread = [
        f"{n} {s['differing']} ({s['max_ulp']} ULP)" for n, s in (b.get("spread") or {}).items() if s["differing"]
    ]
    return {
        "grads": " · ".join(f"{n} {max_text(g)}" for n, g in grads.items()),
        "grad_tightness": _informational(
            tight_text,
            (ungated_figures(case=r, thresholds=thresholds) if thresholds else {}).get("grad_bound"),
        ),
        "spread": ", ".join(spread) if spread else ("0" if b.get("spread") else "—"),
    }


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _plots(cases: list[dict]) -> str:
    # lazy: matplotlib takes a quarter second to import, paid only where a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"
    # NaN-aware (numerics.metrics.nan_aware_max): a case with NaN or inf where the reference is
    # finite has no point on a log axis; it is counted under the plot, not drawn at its finite part
    true_max = [(c, nan_aware_max(c["out"])) for c in cases if c.get("out")]
    unplotted = sum(not math.isfinite(e) for _, e in true_max)
    note = (
        f"<p>{unplotted} case(s) with NaN or inf outputs where the reference is finite: not plotted.</p>"
        if unplotted
        else ""
    )
    errs = [e for _, e in true_max if e > 0 and math.isfinite(e)]
    if not errs:
        return note
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3))
    a.hist([math.log10(e) for e in errs], bins=20, color="tab:blue")
    a.set_xlabel("log10 max |out - ref|")
    a.set_ylabel("cases")
    pts = [(c["config"]["seqlen_k"], e, c["config"]["dtype"]) for c, e in true_max if e > 0 and math.isfinite(e)]
    for dt in sorted({p[2] for p in pts}):
        xs = [p[0] for p in pts if p[2] == dt]
        ys = [p[1] for p in pts if p[2] == dt]
        b.scatter(xs, ys, s=10, label=dt)
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("seqlen_k")
    b.set_ylabel("max |out - ref|")
    b.legend(fontsize=7)
    fig.tight_layout()
    svg = _svg(fig)
    plt.close(fig)
    return svg + note


def _row(r: CaseRecord, thresholds: dict | None = None) -> str:
    c = case_cells(r, thresholds=thresholds)
    cells = "".join(
        f"<td>{x}</td>" for x in (html.escape(r["case"]), r["verdict"], c["max_abs"], c["rel_l2"], c["lse"])
    )
    why = html.escape(c["reasons"])
    return f"<tr class='{r['verdict']}'>{cells}<td>{c['tightness']}</td><td style='text-align:left'>{why}</td></tr>"


_COLUMNS = ("case", "verdict", "max abs err", "rel L2", "LSE err", "err/bound", "reasons")
_HEAD = "<tr>" + "".join(f"<th>{c}</th>" for c in _COLUMNS) + "</tr>"


def _reproduce(cases: list[dict]) -> str:
    """The failing cases with their reasons and the command that reproduces each."""
    bad = [c for c in cases if c["verdict"] in FAILING]
    if not bad:
        return ""
    items = "".join(
        f"<li><b>{html.escape(c['verdict'])}</b> {html.escape(c['case'])}: "
        + "".join(f"<b>{html.escape(w)}</b><br>" for w in cause_lines(c))  # its tested causes, first
        + f"{html.escape('; '.join(x for x in c['reasons'] if x))}"
        + "".join(f"<br>where: {html.escape(w)}" for w in where_lines(c))  # its diagnosis, per tensor
        + f"<br><code>{html.escape(c.get('repro', ''))}</code></li>"
        for c in bad
    )
    return f"<h2>Failing cases and how to reproduce them</h2><ul>{items}</ul>"


def _separators(diag: dict | None) -> str:
    """The separators section (``audits.verdict.separators``): which case fields tell the failing
    cases from the passing ones; empty for a report without a diagnosis."""
    head, rules = separator_text(diag)
    if not head:
        return ""
    items = "".join(
        f"<li><code>{html.escape(rule)}</code>" + (f": {html.escape(detail)}" if detail else "") + "</li>"
        for rule, detail in rules
    )
    listed = f":</p><ul>{items}</ul>" if items else ".</p>"
    return f"<h2>Separators</h2><p>{html.escape(head)}{listed}"


def _coverage(cov: dict | None) -> str:
    """The coverage section (``audits.verdict.coverage``): head dims accepted, covered and missed per
    direction, then each code-path class with the case that covered it in each direction."""
    if not isinstance(cov, dict) or "absent" in cov:
        return f"<h2>Coverage</h2><p>{html.escape(coverage_lines(cov)[0])}</p>"
    h, judged = cov["head_dims"], cov["directions"]
    of = None if h["accepted"] is None else len(h["accepted"])
    rows = [("accepted", "unrestricted" if of is None else pairs_text(pairs=h["accepted"]))]
    for d in DIRECTIONS:  # bounded as the text's lines are (audits.verdict.coverage.pairs_text)
        rows.append((f"{d} covered", pairs_text(pairs=h[d], of=of) if d in judged else "not judged"))
        if h.get(f"missed_{d}") is not None:
            rows.append((f"{d} missed", missed_text(heads=h, direction=d)))
    body = "".join(f"<tr><td>{k}</td><td style='text-align:left'>{html.escape(v)}</td></tr>" for k, v in rows)
    arch = html.escape(str(cov["arch"] or "none declared"))
    parts = [
        f"<h2>Coverage</h2><p>architecture {arch}; directions judged: {', '.join(judged)}</p>"
        f"<table><tr><th>head dims</th><th>(d, dv)</th></tr>{body}</table>"
    ]
    if cov["classes"] is not None:
        head = "<tr><th>class</th><th>forward</th><th>backward</th><th>what selects it</th></tr>"

        def cell(e: dict, d: str) -> str:
            if d in (e.get("outside_domain") or {}) or d in (e.get("not_auditable") or {}):
                return f"<td>{'outside the domain' if d in (e.get('outside_domain') or {}) else 'not auditable'}</td>"
            if d not in e["directions"]:
                return "<td>—</td>"
            if e[d]:
                return f"<td class='pass' style='text-align:left'>{html.escape(e[d])}</td>"
            return "<td class='fail'>missed</td>" if d in judged else "<td>not judged</td>"

        rows = "".join(
            f"<tr><td>{html.escape(n)}</td>{cell(e, 'forward')}{cell(e, 'backward')}"
            f"<td style='text-align:left'>{html.escape(e['description'])} ({html.escape(e['source'])})</td></tr>"
            for n, e in cov["classes"].items()
        )
        parts.append(f"<table>{head}{rows}</table>")
    if cov.get("required"):
        r = cov["required"]
        parts.append(
            f"<p>required ({html.escape(r['require'])}): {'met' if r['met'] else '<b>NOT met</b>'}"
            + "".join(f"<br>missed: {html.escape(m)}" for m in r["missed"])
            + "</p>"
        )
    parts.append("".join(f"<p>note: {html.escape(n)}</p>" for n in cov["notes"]))
    return "".join(parts)


def render_html(rep: dict, summary_line: str, *, figures: str = "") -> str:
    """The page; ``figures``: the error maps' section (``audits.report.maps.html_figures``),
    placed right after the failing cases it pictures."""
    cases, th = rep["cases"], rep.get("thresholds")
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>fa4-audit: {html.escape(rep['kernel'])} / {html.escape(rep['suite'])}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>fa4-audit: {html.escape(rep['kernel'])} on suite {html.escape(rep['suite'])}</h1>",
        f"<p><code>{html.escape(rep['command'])}</code> — {html.escape(rep['created'])}, "
        f"device {html.escape(rep['device'])}</p>",
        f"<p>{html.escape(summary_line)}</p>",
        _separators(rep.get("diagnosis")),
        _reproduce(cases),
        figures,
        "<h2>Worst cases</h2><table>"
        + _HEAD
        + "".join(
            _row(c, th)  # NaN-aware: a case returning NaN is the worst, not the best (worst_key)
            for c in sorted((c for c in cases if c.get("out")), key=lambda c: worst_key(c["out"]), reverse=True)[:10]
        )
        + "</table>",
        "<h2>Errors</h2>" + _plots(cases),
    ]
    if any(c.get("backward") for c in cases):
        head = "".join(f"<th>{x}</th>" for x in ("case", "verdict", "max |grad - ref|", "err/bound", "run to run"))
        rows = "".join(
            f"<tr class='{c['verdict']}'><td>{html.escape(c['case'])}</td><td>{c['verdict']}</td>"
            + "".join(f"<td>{html.escape(g[k])}</td>" for k in ("grads", "grad_tightness", "spread"))
            + "</tr>"
            for c, g in ((c, grad_cells(c, thresholds=th)) for c in cases)
        )
        parts.append(f"<h2>Gradients (--backward)</h2><table><tr>{head}</tr>{rows}</table>")
    parts.append(_coverage(rep.get("coverage")))
    groups = defaultdict(list)
    for c in cases:
        groups[(c["config"]["dtype"], c["config"]["d"])].append(c)
    for (dt, d), cs in sorted(groups.items()):
        rows = "".join(_row(c, th) for c in cs)
        parts.append(f"<h2>{html.escape(dt)}, head dim {d}</h2><table>{_HEAD}{rows}</table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
