"""A self-contained HTML page for an audit report: opens offline (no scripts, no external
files; plots are inline SVG).  Sections: summary, the worst cases, tables per configuration
group (dtype x head dim), a histogram of log10 max errors, and max error against seqlen_k."""

from __future__ import annotations

import html
import io
import math
from collections import defaultdict

__all__ = ["render_html", "case_cells"]

_CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}td:first-child,th:first-child{text-align:left}
.pass{background:#e6f4ea}.warn{background:#fff4d6}.fail,.error,.crash{background:#fde2e1}.skipped,.out-of-domain{background:#eee}
h2{margin-top:1.5em}code{background:#f4f4f4;padding:0 3px}"""


def case_cells(r: dict) -> dict[str, str]:
    """The per-case figures every view shows (Markdown, HTML, ``fa4-audit show``), formatted."""
    o, l, b = r.get("out") or {}, r.get("lse") or {}, r.get("bound") or {}
    f = lambda d, k: f"{d[k]:.3g}" if k in d else "—"  # noqa: E731
    return {
        "max_abs": f(o, "max_abs"),
        "rel_l2": f(o, "rel_l2"),
        "lse": f(l, "max_abs"),
        "tightness": f(b, "tightness"),
        "reasons": "; ".join(x for x in r["reasons"] if x),
    }


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _plots(cases: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"
    errs = [
        c["out"]["max_abs"]
        for c in cases
        if c.get("out") and c["out"]["max_abs"] > 0 and math.isfinite(c["out"]["max_abs"])
    ]
    if not errs:
        return ""
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3))
    a.hist([math.log10(e) for e in errs], bins=20, color="tab:blue")
    a.set_xlabel("log10 max |out - ref|")
    a.set_ylabel("cases")
    pts = [
        (c["config"]["seqlen_k"], c["out"]["max_abs"], c["config"]["dtype"])
        for c in cases
        if c.get("out") and c["out"]["max_abs"] > 0
    ]
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
    return svg


def _row(r: dict) -> str:
    c = case_cells(r)
    return (
        f"<tr class='{r['verdict']}'><td>{html.escape(r['case'])}</td><td>{r['verdict']}</td><td>{c['max_abs']}</td>"
        f"<td>{c['rel_l2']}</td><td>{c['lse']}</td><td>{c['tightness']}</td><td style='text-align:left'>{html.escape(c['reasons'])}</td></tr>"
    )


_HEAD = "<tr><th>case</th><th>verdict</th><th>max abs err</th><th>rel L2</th><th>LSE err</th><th>err/bound</th><th>reasons</th></tr>"


def render_html(rep: dict) -> str:
    s = rep["summary"]
    cases = rep["cases"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>fa4-audit: {html.escape(rep['kernel'])} / {html.escape(rep['suite'])}</title><style>{_CSS}</style></head><body>",
        f"<h1>fa4-audit: {html.escape(rep['kernel'])} on suite {html.escape(rep['suite'])}</h1>",
        f"<p><code>{html.escape(rep['command'])}</code> — {html.escape(rep['created'])}, device {html.escape(rep['device'])}</p>",
        "<p>"
        + ", ".join(f"<span class='{k}'>{k} {v}</span>" for k, v in s["verdicts"].items() if v)
        + f" of {s['cases']} cases</p>",
        "<h2>Worst cases</h2><table>"
        + _HEAD
        + "".join(_row(c) for c in sorted((c for c in cases if c.get("out")), key=lambda c: -c["out"]["max_abs"])[:10])
        + "</table>",
        "<h2>Errors</h2>" + _plots(cases),
    ]
    groups = defaultdict(list)
    for c in cases:
        groups[(c["config"]["dtype"], c["config"]["d"])].append(c)
    for (dt, d), cs in sorted(groups.items()):
        parts.append(f"<h2>{html.escape(dt)}, head dim {d}</h2><table>{_HEAD}{''.join(_row(c) for c in cs)}</table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
