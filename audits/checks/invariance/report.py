"""The invariance report's Markdown and its one-line cells (docs/invariance.md)."""

from __future__ import annotations

from audits.checks.invariance.compare import RESULTS

__all__ = ["cell", "short", "markdown"]


def _diffs(res: dict) -> list[str]:
    parts = []
    for t in ("out", "lse"):
        m = res.get(t)
        if m and m["differ"]:
            e = m["max_err_fp64"]
            wb = {True: ", within bound", False: ", BEYOND bound"}.get(m.get("within_bound"), "")
            # the non-finite mismatches by kind (compare.compare), so that a NaN against a number
            # is never read as a rounding difference
            kinds = [
                f"{m[k]} {what}"
                for k, what in (("nan_mismatch", "NaN against a number"), ("inf_sign_mismatch", "+inf against -inf"))
                if m.get(k)
            ]
            steps = f"max {m['max_steps']} steps " if m["max_steps"] >= 0 else ""
            parts.append(
                f"{t}: {m['differ']}/{m['compared']} differ"
                + (f" ({', '.join(kinds)})" if kinds else "")
                + f", {steps}({m['max_ulp']:.3g} ULP at FP64), "
                f"max err vs FP64 {e[0]:.3g} / {e[1]:.3g}{wb}"
            )
    return parts


def _n(res: dict) -> str:
    n = res["comparisons"]
    return f"{n} comparison" + ("" if n == 1 else "s")


def cell(res: dict) -> str:
    """One property's result in a line: holds (how many comparisons; split: within the bound
    and by how much the bits moved), differs (per tensor), or the reason."""
    r = res["result"]
    if r == "holds":
        if res.get("bitwise") is False:
            return f"holds within bound ({_n(res)}; " + "; ".join(_diffs(res)) + ")"
        return f"holds ({_n(res)})"
    if r != "differs":
        return f"{r}: {res.get('reason', '')}"
    return "differs: " + "; ".join(_diffs(res))


def short(res: dict) -> str:
    """The result in a word or two (split: ``holds (bound)`` when not bitwise)."""
    r = res["result"]
    return "holds (bound)" if r == "holds" and res.get("bitwise") is False else r


def _prediction(report: dict) -> list[str]:
    s = report["summary"]["prediction"]
    props = report["properties"]
    lines = [
        "",
        f"## Prediction: {s['model']}",
        "",
        f"{s['agree']} agree, {s['disagree']} disagree (where both reached holds or differs).",
        "",
        "| case | " + " | ".join(props) + " |",
        "|---|" + "---|" * len(props),
    ]
    mark = {"agree": "", "disagree": " **DISAGREE**", None: ""}
    for r in report["cases"]:
        cells = [
            f"{short(r['properties'][p])} / {short(r['predicted'][p])}{mark[r['predicted'][p]['agreement']]}"
            for p in props
        ]
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: measured / predicted.", ""]
    for d in s["disagreements"]:
        r = next(c for c in report["cases"] if c["case"] == d["case"])
        lines.append(
            f"* {d['case']}, {d['property']}: measured {cell(r['properties'][d['property']])}; "
            f"predicted {cell(r['predicted'][d['property']])}"
        )
    return lines


def markdown(report: dict) -> str:
    s = report["summary"]
    props = report["properties"]
    pred = f"; predicted by {report['predict']}" if report.get("predict") else ""
    lines = [
        f"# Invariance: {report['kernel']} on {report['suite']}",
        "",
        f"`{report['command']}` ({report['created']}, {report['environment']}; {report['seconds']:.1f} s{pred})",
        "",
        f"Required: {', '.join(s['required']) or 'none'}; "
        + ("**pass**" if s["passed"] else f"**fail** ({', '.join(s['failing']) or 'nothing compared'})"),
        "",
    ]
    for p, why in s.get("uncompared", {}).items():  # required, compared nowhere
        lines += [f"* **{p}** (required) fails: {why}"]
    if s.get("uncompared"):
        lines.append("")
    lines += ["| property | " + " | ".join(RESULTS) + " |", "|---|" + "---|" * len(RESULTS)]
    for p in props:
        lines.append(f"| {p} | " + " | ".join(str(s["counts"][p][r]) for r in RESULTS) + " |")
    lines += ["", "## Measured", "", "| case | " + " | ".join(props) + " |", "|---|" + "---|" * len(props)]
    for r in report["cases"]:
        lines.append(f"| {r['case']} | " + " | ".join(cell(r["properties"][p]) for p in props) + " |")
    if "prediction" in s:
        lines += _prediction(report)
    return "\n".join(lines) + "\n"
