"""Shard reports (``run --shard I/N``, the pytest fixture under xdist) into the report of the
unsharded run: its cases in its order, its summary and coverage; refused for reports that are not
slices of one run.  ``fa4-audit merge`` and the pytest plugin call it."""

from __future__ import annotations

from pathlib import Path

from audits.common import read_json
from audits.engine.journal import thresholds_digest
from audits.report.build import build_report, run_counts, write_report
from audits.report.schema import coverage_basis, validate_report

__all__ = ["SAME_RUN", "MergeError", "policy_text", "check_shards", "summarize", "merge_reports", "merge_files"]


class MergeError(ValueError):
    """Shard reports that do not make one run (the message says how)."""


def policy_text(th: dict) -> str:
    """A thresholds policy as a report records it: its content's digest (and where it was read)."""
    return f"policy {thresholds_digest(th)} ({th.get('path', 'no path')})"


#: what every shard of one run shares; a merge refuses shards that differ in any (name, value of a report)
SAME_RUN = (
    ("kernel", lambda r: r["kernel"]),
    ("suite", lambda r: r["suite"]),
    ("seed", lambda r: r["seed"]),
    ("thresholds", lambda r: policy_text(r["thresholds"])),
    ("fa4-audit version", lambda r: r["environment"].get("fa4_audit", "not recorded")),
    ("shard count", lambda r: (r.get("shard") or "?/unsharded").split("/")[-1]),
)


def check_shards(reps: list[dict], paths: list[str]) -> list[str]:
    """:class:`MergeError` for shard reports that are not slices of one run: any field of
    :data:`SAME_RUN` differing (the field, each value and a report holding it), a case in two
    shards, or a shard twice; the shards ("I/N") missing from the count."""
    for name, get in SAME_RUN:
        if name == "thresholds":  # the same policy read from another path is the same policy
            vals = {thresholds_digest(r["thresholds"]): (get(r), p) for r, p in zip(reps, paths, strict=True)}
        else:
            vals = {}
            for r, p in zip(reps, paths, strict=True):
                vals.setdefault(get(r), (get(r), p))
        if len(vals) > 1:
            shown = "; ".join(f"{v!r} in {p}" for v, p in vals.values())
            raise MergeError(f"shard reports of different runs: they differ in {name}: {shown}")
    where: dict[str, str] = {}
    for r, p in zip(reps, paths, strict=True):
        for c in r["cases"]:
            if c["case"] in where:
                raise MergeError(f"case {c['case']} is in two shard reports: {where[c['case']]} and {p}")
            where[c["case"]] = p
    shards = [r["shard"] for r in reps if r.get("shard")]
    if len(set(shards)) < len(shards):
        twice = sorted({s for s in shards if shards.count(s) > 1})
        raise MergeError(f"shard {', '.join(twice)} given twice")
    if not shards:
        return []
    n = int(shards[0].split("/")[1])
    return [f"{i}/{n}" for i in range(n) if f"{i}/{n}" not in shards]


def summarize(rep: dict, *, selected: int | None = None) -> dict:
    """``rep`` with its summary recomputed from its cases; a partial report stays partial
    (its selected count, or ``selected``, and why it stopped)."""
    keys = ("kernel", "suite", "seed", "device", "environment", "thresholds", "command", "created")
    sel = run_counts(rep)[0] if selected is None else selected
    cov = rep["coverage"]
    bwd = "backward" in cov["directions"] if "directions" in cov else None
    return build_report(
        **{k: rep[k] for k in keys},
        records=rep["cases"],
        shard=rep.get("shard"),
        selected=sel,
        stopped=rep["summary"].get("stopped"),
        coverage_basis=coverage_basis(rep),  # the coverage recomputed over these cases, same basis
        backward=bwd,
    )


def merge_reports(reps: list[dict], *, command: str) -> dict:
    """The report of the unsharded run of shard reports ``reps`` (checked: :func:`check_shards`):
    its cases, in its order (each shard's ``shard_order``; else in the order given), its summary,
    partial when a shard is (the shards' selected cases, the first partial shard's reason)."""
    cases = [c for r in reps for c in r["cases"]]
    order = {}
    for r in reps:
        order.update(r.get("shard_order") or {})
    if all(c["case"] in order for c in cases):
        cases.sort(key=lambda c: order[c["case"]])
    stopped = next((r["summary"].get("stopped") for r in reps if run_counts(r)[2]), None)
    base = {**reps[0], "cases": cases, "shard": None, "command": command}
    base["summary"] = {**base["summary"], "stopped": stopped}
    return summarize(base, selected=sum(run_counts(r)[0] for r in reps))


def merge_files(paths: list[str | Path], out: str | Path, *, command: str) -> tuple[dict, dict[str, Path]]:
    """Shard ``report.json`` files merged (:func:`check_shards`, :func:`merge_reports`) and written
    to ``out``: the merged report and the paths written (``write_report``'s)."""
    names = [str(p) for p in paths]
    reps = [validate_report(read_json(p, what="report"), p) for p in names]
    check_shards(reps, names)
    merged = merge_reports(reps, command=command)
    return merged, write_report(merged, out)
