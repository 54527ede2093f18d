"""Several kernels' reports on one suite, side by side: per configuration group, the worst
errors against FP64 and the bound tightness over the cases with finite inputs in each kernel's
domain, and the verdicts of all cases (``fa4-audit summary``); a plot of the worst output error
against sequence length per kernel (SVG); and per report its separators, the case fields that
tell its failing cases from its passing ones (``audits.verdict.separators``)."""

from __future__ import annotations

import math
from pathlib import Path

from audits.verdict.separators import separator_text, separators
from numerics.metrics import nan_aware_max

#: what ``--by`` accepts: Case fields, plus mask (none / causal / local) and heads (MHA / GQA / MQA)
GROUP_FIELDS = ("mask", "heads", "dtype", "d", "dv", "softcap", "sink", "layout", "family", "seqlen_q", "seqlen_k")

__all__ = ["GROUP_FIELDS", "group_key", "summary_rows", "summary_markdown", "separators_markdown", "plot_errors"]

_DT = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def group_key(config: dict, by: tuple[str, ...]) -> str:
    """A case's configuration group: ``by`` names Case fields, or ``mask`` (none / causal /
    local), ``heads`` (MHA / GQA / MQA)."""
    parts = []
    for b in by:
        if b == "mask":
            parts.append(
                "causal"
                if config["causal"]
                else ("local" if any(w is not None for w in config["window"]) else "no mask")
            )
        elif b == "heads":
            hq, hk = config["heads_q"], config["heads_kv"]
            parts.append("MHA" if hq == hk else ("MQA" if hk == 1 else "GQA"))
        elif b == "dtype":
            parts.append(_DT.get(config["dtype"], config["dtype"]))
        else:
            parts.append(f"{b}={config[b]}")
    return " ".join(parts)


def _max(xs):
    """The largest of ``xs`` (None ignored; None for none), NaN-aware: NaN if one is NaN, else the
    usual maximum (inf included).  Python's ``max`` is not: it may return a number past a NaN."""
    xs = [x for x in xs if x is not None]
    if any(x != x for x in xs):
        return math.nan
    return max(xs) if xs else None


def _true_max(records) -> float | None:
    """The NaN-aware max |err| of error records (``numerics.metrics.nan_aware_max``): NaN or inf
    when a kernel returned them where the reference is finite, which the finite ``max_abs`` hides."""
    return _max(nan_aware_max(e) for e in records if isinstance(e, dict) and "max_abs" in e)


def _nonfinite(records) -> int:
    """Elements NaN or inf where the reference is finite, summed over error records."""
    return sum(int(e.get("nonfinite_where_ref_finite") or 0) for e in records if isinstance(e, dict))


def _grads(cases: list[dict]):
    """Every gradient record of the cases whose backward ran within the kernel's domain."""
    for c in cases:
        b = c.get("backward") or {}
        if not b.get("out_of_domain"):
            yield from (b.get("grads") or {}).values()


def summary_rows(reports: list[dict], by: tuple[str, ...], labels: list[str] | None = None) -> list[dict]:
    """One row per (group, report), groups in first-seen order, reports in the given order:
    each report keeps its own rows even when two audit the same kernel (``labels`` tell them
    apart; default the kernel names)."""
    labels = labels or [rep["kernel"] for rep in reports]
    groups: dict[str, dict[int, list]] = {}
    for i, rep in enumerate(reports):
        for c in rep["cases"]:
            groups.setdefault(group_key(c["config"], by), {}).setdefault(i, []).append(c)
    rows = []
    for g, per in groups.items():
        for i in range(len(reports)):
            cs = per.get(i, [])
            # error figures over finite inputs in the kernel's domain; the NaN/inf families are
            # judged by the semantics rules, and their verdicts are in the last column
            ran = [
                c
                for c in cs
                if c.get("status") == "ran" and not c.get("out_of_domain") and not c["family"].startswith("nan_inf")
            ]
            verdicts = {}
            for c in cs:
                verdicts[c["verdict"]] = verdicts.get(c["verdict"], 0) + 1
            rows.append(
                {
                    "group": g,
                    "kernel": labels[i],
                    "cases": len(cs),
                    "judged": len(ran),
                    # NaN-aware (numerics.metrics.nan_aware_max): a kernel's NaN is never a 0 here
                    "out_max_abs": _true_max(c.get("out") for c in ran),
                    "out_nonfinite": _nonfinite(c.get("out") for c in ran),
                    "rel_l2": _max(
                        math.nan if (c.get("out") or {}).get("nonfinite_where_ref_finite") else c["out"].get("rel_l2")
                        for c in ran
                        if c.get("out")
                    ),
                    "lse_max_abs": _true_max(c.get("lse") for c in ran),
                    "lse_nonfinite": _nonfinite(c.get("lse") for c in ran),
                    # a non-finite output at a finite reference is a bound violation without a finite ratio
                    "tightness": _max(
                        nan_aware_max(c["out"])
                        if c.get("out") and c["out"].get("nonfinite_where_ref_finite") and c.get("bound")
                        else (c.get("bound") or {}).get("tightness")
                        for c in ran
                    ),
                    "vs_lowprec": _max(
                        (c["fa_criterion"]["max_abs"] / c["fa_criterion"]["lowprec_max_abs"])
                        if c.get("fa_criterion", {}).get("lowprec_max_abs")
                        else None
                        for c in ran
                    ),
                    "grad_max_abs": _true_max(_grads(ran)),
                    "grad_nonfinite": _nonfinite(_grads(ran)),
                    "grad_tightness": _max(
                        nan_aware_max(g)
                        if g.get("nonfinite_where_ref_finite")
                        else (g.get("bound") or {}).get("tightness")
                        for g in _grads(ran)
                        if g.get("bound")
                    ),
                    "verdicts": verdicts,
                }
            )
    return rows


def summary_markdown(reports: list[dict], by: tuple[str, ...], labels: list[str] | None = None) -> str:
    f = lambda x: "—" if x is None else f"{x:.3g}"

    def figure(r: dict, key: str) -> str:
        """A cell; a max |err| over elements some of which the kernel returned as NaN or inf (where
        the reference is finite) says how many."""
        count = {"out_max_abs": "out_nonfinite", "lse_max_abs": "lse_nonfinite", "grad_max_abs": "grad_nonfinite"}
        n = r.get(count.get(key, ""), 0)
        return f(r[key]) + (f" ({n:,} non-finite)" if n else "")

    bwd = any(c.get("backward") for rep in reports for c in rep["cases"])
    head = (
        " / ".join(by),
        "kernel",
        "cases",
        "finite, in domain",
        "worst \\|out-ref\\|",
        "worst rel L2",
        "worst \\|LSE-ref\\|",
        "max err/bound",
        "max err / PyTorch low-prec err",
    )
    head += ("worst \\|grad-ref\\|", "max grad err/bound") if bwd else ()
    keys = ("out_max_abs", "rel_l2", "lse_max_abs", "tightness", "vs_lowprec")
    keys += ("grad_max_abs", "grad_tightness") if bwd else ()
    L = ["| " + " | ".join((*head, "verdicts")) + " |", "|" + "---|" * (len(head) + 1)]
    for r in summary_rows(reports, by, labels):
        v = ", ".join(f"{k} {n}" for k, n in sorted(r["verdicts"].items()))
        figures = [figure(r, k) for k in keys]
        L.append("| " + " | ".join([r["group"], r["kernel"], str(r["cases"]), str(r["judged"]), *figures, v]) + " |")
    return "\n".join(L) + "\n" + separators_markdown(reports, labels=labels)


def separators_markdown(reports: list[dict], *, labels: list[str] | None = None) -> str:
    """The section "Separators": per report (``labels``, default the kernel names) the case fields
    that tell its failing cases from its passing ones, so that reports of several kernels on one
    suite show whether they fail on the same cases; the report's ``diagnosis``, computed from its
    cases when it has none (a report dict not read through the schema)."""
    labels = labels or [rep["kernel"] for rep in reports]
    L = ["", "## Separators", ""]
    for rep, label in zip(reports, labels, strict=True):
        diag = rep.get("diagnosis")
        if not isinstance(diag, dict):
            diag = separators(rep["cases"], arch=(rep.get("coverage") or {}).get("arch"))
        head, rules = separator_text(diag)
        L.append(f"- {label}: {head}" + (":" if rules else ""))
        L += [f"  - `{rule}`" + (f": {detail}" if detail else "") for rule, detail in rules]
    return "\n".join(L) + "\n"


def plot_errors(
    reports: list[dict], path: str | Path, *, dtype: str = "bfloat16", labels: list[str] | None = None
) -> None:
    """Worst max |out - ref| per seqlen_k for each kernel, on ``dtype`` cases with finite
    inputs in the kernel's domain (SVG)."""
    # lazy: matplotlib takes a quarter second to import, paid only where a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for rep, label in zip(reports, labels or [r["kernel"] for r in reports], strict=True):
        worst: dict[int, float] = {}
        for c in rep["cases"]:
            if (
                c["config"]["dtype"] != dtype
                or c.get("status") != "ran"
                or c.get("out_of_domain")
                or c["family"].startswith("nan_inf")
            ):
                continue
            e = (c.get("out") or {}).get("max_abs")
            if e is not None and e == e and e != float("inf"):
                sk = c["config"]["seqlen_k"]
                worst[sk] = max(worst.get(sk, 0.0), e)
        if worst:
            xs = sorted(worst)
            ax.plot(xs, [max(worst[x], 1e-12) for x in xs], marker="o", ms=3, lw=1, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("seqlen_k")
    ax.set_ylabel(f"worst max |out - FP64| ({_DT.get(dtype, dtype)})")
    ax.grid(True, which="both", lw=0.3)
    if ax.get_legend_handles_labels()[0]:  # no finite errors of this dtype: no legend
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
