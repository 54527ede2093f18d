"""The commands that read run reports: ``gate``, ``show``, ``diff``, ``merge``, ``summary``; and
``list`` and ``fuzz``.  A report that is missing, unreadable or not a valid report is a usage
error (exit 2), never a failed check."""

from __future__ import annotations

import argparse
import fnmatch
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from audits.cli.run_options import (
    IN_PROCESS_NOTE,
    add_known_arguments,
    add_timeout_argument,
    given_timeout,
    known_from_args,
)
from audits.common import EXIT_FAIL, EXIT_OK, UsageError, atomic_write, read_json
from audits.common import device as _device
from audits.engine.backward import BackwardOptions
from audits.engine.journal import SCHEMA as JOURNAL_SCHEMA
from audits.engine.options import RunOptions
from audits.kernels import KERNELS, MODELS, VARIANT_KNOBS, usable_kernels
from audits.report.build import (
    collapse_reasons,
    exit_code,
    partial_line,
    report_from_journal,
    summary_line,
    write_report,
)
from audits.report.header import command_line, versions_line
from audits.report.html import case_cells, max_text
from audits.report.maps import render
from audits.report.merge import MergeError, check_shards, merge_reports, summarize
from audits.report.schema import FAILING, ReportError, validate_report
from audits.report.summary import GROUP_FIELDS, plot_errors, summary_markdown
from audits.suites.case import identity_of
from audits.suites.cases import SUITES
from audits.suites.inputs import FAMILIES
from audits.suites.selection import read_domain
from audits.verdict.coverage import coverage_lines, coverage_summary
from audits.verdict.gate import ThresholdsError, load_thresholds, rejudge, require_backward
from audits.verdict.known import KnownError, apply_known, known_lines, strict_failed
from audits.verdict.separators import cause_groups, cause_lines, cause_text, likely_cause, separator_text, where_lines


def _is_journal(path: str) -> bool:
    """Whether ``path`` is a run's journal (JSON lines, a journal header first), not a report."""
    if str(path).endswith(".jsonl"):
        return True
    try:
        with open(path, "rb") as fh:
            first = json.loads(fh.readline() or b"null")
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and first.get("journal") == JOURNAL_SCHEMA


def run_reports(path: str) -> list[str]:
    """The report files ``path`` names: itself when it is a file; for a run directory its
    ``report.json`` (else its ``journal.jsonl``: a run stopped or still going), or with several
    kernels each ``<kernel>/report.json`` (or journal) below it.  A missing path, or a directory
    holding none of them, is a :class:`UsageError` naming it."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{path}: no such report, journal or run directory")
    if not p.is_dir():
        return [path]

    def one(d: Path) -> str | None:
        return next((str(d / f) for f in ("report.json", "journal.jsonl") if (d / f).is_file()), None)

    if found := one(p):
        return [found]
    below = [
        f for d in sorted(x for x in p.iterdir() if x.is_dir() and x.name not in ("jobs", "repro")) if (f := one(d))
    ]
    if not below:
        raise UsageError(
            f"{path}: a directory without report.json or journal.jsonl (nor a per-kernel folder holding one)"
        )
    return below


def load_report(path: str) -> dict:
    """A report file (``.json``, ``.json.gz``, ``.json.xz``), validated field by field; or a run's
    ``journal.jsonl`` read as the report the run would write from it (``report_from_journal``:
    partial while cases are missing), so that a killed or running run can be read; or a run
    directory of one kernel (:func:`run_reports`).  Either is upgraded to this version's shape
    (``audits.report.schema.validate_report``), which the readers below assume."""
    found = run_reports(path)
    if len(found) > 1:
        raise UsageError(f"{path}: a run of several kernels ({', '.join(found)}): name one of them")
    path = found[0]
    try:
        if _is_journal(path):
            try:
                return validate_report(report_from_journal(path), path)
            except OSError as exc:
                raise UsageError(f"{path}: not a readable journal ({type(exc).__name__}: {exc})") from exc
        return validate_report(read_json(path, what="report"), path)
    except ReportError as exc:
        raise UsageError(str(exc)) from exc


def _say_partial(rep: dict, path: str) -> None:
    """A line on stderr when a report read is partial: its unrun cases were not checked."""
    if part := partial_line(rep):
        print(f"{path}: {part}", file=sys.stderr)


def case_key(case: dict, *, ignore_seed: bool) -> str:
    """What matches a case across two reports: its identity, from its configuration alone
    (``audits.suites.case.canonical_identity``: shape, dtype, flags, mods, input family, seed),
    never its name or its place in a suite; with ``ignore_seed`` the identity without the seed (the
    same configuration drawn from another seed)."""
    return identity_of(case["config"], ignore_seed=ignore_seed, where=f"case {case['case']}")


#: the least share of the smaller report's cases that must have a match in the other report for a
#: comparison (``diff``, ``gate --baseline``) to judge: half.  Why: below it the two reports hold
#: mostly different cases (another suite, other seeds, a changed suite), and a verdict such as "0
#: got worse" would speak for a minority of them while the rest went unseen; the smaller side,
#: because comparing a shard or a partial run with the whole run matches all of the smaller and is
#: sound.  No match at all never judges.
MIN_MATCHED_SHARE = 0.5


@dataclass(frozen=True)
class CaseMatch:
    """Two reports' cases matched by identity (:func:`case_key`): each side's records by key (the
    first of a key's records, ``duplicates`` counting the others), and how they were matched."""

    base: dict[str, dict]
    cand: dict[str, dict]
    ignore_seed: bool
    duplicates: tuple[int, int]

    @property
    def matched(self) -> list[str]:
        """The keys in both, in the candidate's order."""
        return [k for k in self.cand if k in self.base]

    @property
    def how(self) -> str:
        return "by configuration, seeds ignored" if self.ignore_seed else "by configuration (case identity)"

    def line(self) -> str:
        """How many cases matched on each side, and how."""
        m, (db, dc) = len(self.matched), self.duplicates
        line = f"{m} of {len(self.base)} baseline cases and {m} of {len(self.cand)} candidate cases matched {self.how}"
        if db or dc:  # a configuration twice in one report (a case file listing it twice): its first record
            line += f" ({db} baseline and {dc} candidate records repeat a configuration: their first is compared)"
        return line

    def too_little(self, base_path: str, cand_path: str) -> str | None:
        """Why too little matched to judge (:data:`MIN_MATCHED_SHARE` of the smaller side, or
        none), with what did match and what tells the rest apart; None when enough matched."""
        m, smaller = len(self.matched), min(len(self.base), len(self.cand))
        if m and m >= MIN_MATCHED_SHARE * smaller:
            return None
        why = (
            "no case matched"
            if not m
            else f"fewer than half of the smaller report's {smaller} cases have a match ({m / smaller:.0%})"
        )
        text = (
            f"{base_path} and {cand_path}: {self.line()}; {why}, too few to judge: the two reports hold mostly "
            "different cases, and a comparison would speak for a minority of them (rule: at least half of the "
            "smaller report's cases must match, audits.cli.reports.MIN_MATCHED_SHARE)."
        )
        return text + self._why_unmatched()

    def _why_unmatched(self) -> str:
        """What tells the unmatched cases apart: cases of one name in both reports whose
        configurations differ (and in which fields), and how many more --ignore-seed would match."""
        rest_b = {c["case"]: c for k, c in self.base.items() if k not in self.cand}
        rest_c = {c["case"]: c for k, c in self.cand.items() if k not in self.base}
        named = [(rest_b[n], rest_c[n]) for n in rest_c if n in rest_b]
        out = ""
        if named:
            diff: dict[str, int] = {}
            for x, y in named:
                cx, cy = x["config"], y["config"]
                for f in sorted(set(cx) | set(cy)):
                    if cx.get(f) != cy.get(f):
                        diff[f] = diff.get(f, 0) + 1
            fields_ = ", ".join(f"{f} ({n})" for f, n in sorted(diff.items(), key=lambda t: -t[1]))
            out += f" {len(named)} unmatched cases share a name across the reports but differ in {fields_}."
        elif rest_b and rest_c:
            out += " No unmatched case shares a name either: the reports hold other cases (another suite?)."
        if not self.ignore_seed:
            unseeded = match_cases(list(self.base.values()), list(self.cand.values()), ignore_seed=True)
            more = len(unseeded.matched) - len(self.matched)
            if more > 0:
                out += f" Matched with seeds ignored (--ignore-seed), {more} more would match."
        return out


def match_cases(base: list[dict], cand: list[dict], *, ignore_seed: bool) -> CaseMatch:
    """The records of two reports matched by identity (:func:`case_key`)."""
    sides, dups = [], []
    for cases in (base, cand):
        keyed: dict[str, dict] = {}
        for c in cases:
            keyed.setdefault(case_key(c, ignore_seed=ignore_seed), c)
        sides.append(keyed)
        dups.append(len(cases) - len(keyed))
    return CaseMatch(base=sides[0], cand=sides[1], ignore_seed=ignore_seed, duplicates=(dups[0], dups[1]))


def _match_or_refuse(base: dict, cand: dict, *, ignore_seed: bool, paths: tuple[str, str]) -> CaseMatch:
    """:func:`match_cases` of two reports, or :class:`UsageError` (exit 2) when too little matched
    to judge (:meth:`CaseMatch.too_little`)."""
    match = match_cases(base["cases"], cand["cases"], ignore_seed=ignore_seed)
    if why := match.too_little(*paths):
        raise UsageError(why)
    return match


def _thresholds(path):
    try:
        return load_thresholds(path)
    except ThresholdsError as exc:
        raise UsageError(str(exc)) from exc


def _baseline(args, rep: dict) -> tuple[dict | None, str]:
    """The baseline's cases keyed by identity (:func:`case_key`) and a line saying how many
    matched on each side; (None, "") without a baseline.  :class:`UsageError` (exit 2) when too
    little matches to judge (:data:`MIN_MATCHED_SHARE`)."""
    if not args.baseline:
        return None, ""
    base = load_report(args.baseline)
    match = _match_or_refuse(base, rep, ignore_seed=args.ignore_seed, paths=(args.baseline, args.report))
    return match.base, f"baseline {args.baseline}: {match.line()}"


def cmd_gate(args: argparse.Namespace) -> int:
    rep = load_report(args.report)
    th = _thresholds(args.thresholds)
    base, overlap = _baseline(args, rep)
    key = lambda c: case_key(c, ignore_seed=args.ignore_seed)
    new = _known(args, summarize(rejudge(rep, th, base, key=key)), strict=args.strict_known)
    failing = collapse_reasons([c for c in new["cases"] if c["verdict"] in FAILING])
    for c, n in failing:  # each with its best tested cause first, then its reasons
        also = f" (x{n} cases)" if n > 1 else ""
        why = "; ".join(x for x in (likely_cause(c), *c["reasons"]) if x)
        print(f"{c['verdict'].upper():7s} {c['case']}: {why}{also}")
    if sum(n for _, n in failing) > 1 and (tally := cause_text(cause_groups(new["cases"]))):
        print(tally)  # over the re-judged verdicts
    for line in known_lines(new):  # --known: the known defects, apart from the failures
        print(line)
    print(f"{summary_line(new)} under {th['path']}")
    code = exit_code(new)
    if base is not None:
        print(overlap)
    if args.out:
        new["command"] = f"{new['command']}; re-judged: fa4-audit " + " ".join(shlex.quote(a) for a in args.argv)
        print(f"re-judged report: {write_report(new, args.out)['md']}")
    return code


def _known(args: argparse.Namespace, rep: dict, *, strict: bool) -> dict:
    """``rep`` with the ``--known`` file applied (``audits.verdict.known``); without ``--known``, a
    report a known file was applied to loses it (its failures are judged again, all of them)."""
    known = known_from_args(args)
    if known is None and "known" not in rep and not any("known_id" in c for c in rep["cases"]):
        return rep
    try:
        return apply_known(report=rep, known=known, strict=strict)
    except KnownError as exc:
        raise UsageError(str(exc)) from exc


def _named_cases(args: argparse.Namespace, rep: dict, *, one: bool) -> list[dict]:
    """The records ``--case GLOB`` matches (as every subcommand's ``--case``: fnmatch on the full
    name, which matches itself); ``one``: exactly one, as ``--plot`` draws one case."""
    got = [r for r in rep["cases"] if fnmatch.fnmatchcase(r["case"], args.case)]
    if not got:
        raise UsageError(f"{args.report}: no case matches {args.case!r}; `fa4-audit show {args.report}` lists them")
    if one and len(got) > 1:
        names = ", ".join(r["case"] for r in got[:3]) + (", ..." if len(got) > 3 else "")
        raise UsageError(f"--case {args.case!r} matches {len(got)} cases ({names}): --plot draws one; name it")
    return got


def _show_plot(args: argparse.Namespace, rep: dict) -> int:
    """``show --case NAME --plot``: render the case's error map (``audits.report.maps``)
    to ``--out`` (default ``<case>.png`` or ``.svg`` here) and print the path; exit 2 with the
    reason when the case has none."""
    if args.case is None:
        raise UsageError("--plot needs --case NAME: the case whose error map to render")
    (rec,) = _named_cases(args, rep, one=True)
    rel = rec.get("error_map")
    if not rel:
        why = (
            f"it did not fail (verdict {rec['verdict']})"
            if rec["verdict"] not in FAILING
            else f"its failure ({rec['verdict']}) has no element past the bound to map: a kernel error, crash or "
            "timeout, a failure that is not per element, or a report written before error maps existed"
        )
        raise UsageError(f"case {args.case} has no error map: {why}")
    npz = Path(run_reports(args.report)[0]).parent / rel
    if not npz.is_file():
        raise UsageError(
            f"case {args.case}: its error map {npz} is missing (copy the run's maps/ folder with the report)"
        )
    try:
        data = render(npz, fmt=args.format, tensor=args.tensor)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    out = Path(args.out or f"{args.case}{'-' + args.tensor if args.tensor else ''}.{args.format}")
    if out.parent != Path():
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    print(out)
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    """A report as a table on a terminal, as plain lines otherwise; case names never cut."""
    rep = load_report(args.report)
    if args.plot:
        return _show_plot(args, rep)
    console = Console()
    head = f"{rep['kernel']} / {rep['suite']} ({rep['created']}): {summary_line(rep)}"
    head += f"\n{versions_line(rep.get('environment'))}"  # what was audited: the packages' versions
    cov = f"coverage: {coverage_summary(rep.get('coverage'))}"  # all of it: fa4-audit coverage
    # which case fields tell failing from passing cases (the whole report's; not with --case)
    seps = _separator_lines(rep.get("diagnosis")) if args.case is None else []
    seps += known_lines(rep) if args.case is None else []  # a --known file's entries, apart from the failures
    if args.case is not None:
        rep = {**rep, "cases": _named_cases(args, rep, one=False)}
    if args.failing:  # only the cases that fail a run, each with its reasons (and where: its diagnosis)
        bad = [r for r in rep["cases"] if r["verdict"] in FAILING]
        head += f"; failing cases ({', '.join(FAILING)}): {len(bad)} of {len(rep['cases'])}"
        rep = {**rep, "cases": bad}
    if not console.is_terminal:
        print(head)
        print(cov)
        for line in seps:
            print(line)
        for r in rep["cases"]:
            c = case_cells(r, thresholds=rep.get("thresholds"))  # figures not gated say so
            print(f"{r['verdict']:13s} {r['case']}")
            if r["verdict"] == "known":
                print(f"{'':13s} known defect {r['known_id']} (was {r['known_from']})")
            print(f"{'':13s} max abs err {c['max_abs']}, LSE err {c['lse']}, err/bound {c['tightness']}")
            if r.get("backward"):
                print(f"{'':13s} gradients {c['grads']}, err/bound {c['grad_tightness']}, run to run {c['spread']}")
            for w in cause_lines(r):  # the case's tested causes, best first: before its reasons
                print(f"{'':13s} {w}")
            if c["reasons"]:
                print(f"{'':13s} {c['reasons']}")
            for w in where_lines(r):  # the case's diagnosis: where its violations concentrate
                print(f"{'':13s} where: {w}")
        return EXIT_OK
    t = Table(title=head, caption=cov)
    t.add_column(
        "case", no_wrap=True, overflow="ignore", min_width=max((len(r["case"]) for r in rep["cases"]), default=4)
    )
    bwd = any(r.get("backward") for r in rep["cases"])
    cols = ("verdict", "max abs err", "LSE err", "err/bound") + (("gradients", "grad err/bound") if bwd else ())
    for col in (*cols, "reasons"):
        t.add_column(col, overflow="fold")
    for r in rep["cases"]:
        c = case_cells(r, thresholds=rep.get("thresholds"))  # figures not gated say so
        grads = (c["grads"], c["grad_tightness"]) if bwd else ()
        why = "\n".join([*cause_lines(r), c["reasons"], *(f"where: {w}" for w in where_lines(r))]).strip("\n")
        verdict = f"known ({r['known_id']})" if r["verdict"] == "known" else r["verdict"]
        t.add_row(r["case"], verdict, c["max_abs"], c["lse"], c["tightness"], *grads, why)
    console.print(t, crop=False)
    for line in seps:
        console.print(line, markup=False, highlight=False, crop=False)
    return EXIT_OK


def _separator_lines(diag: dict | None) -> list[str]:
    """``show``'s lines of a report's separators (``audits.verdict.separators.separator_text``)."""
    head, rules = separator_text(diag)
    if not head:
        return []
    lines = [f"  {rule}" + (f": {detail}" if detail else "") for rule, detail in rules]
    return [f"separators: {head}" + (":" if lines else ".")] + lines


def cmd_coverage(args: argparse.Namespace) -> int:
    """A report's coverage (``audits.verdict.coverage``), per kernel of a run directory: the head dims
    accepted, covered and missed in each direction, each code-path class with its case."""
    for path in run_reports(args.report):
        rep = load_report(path)
        _say_partial(rep, path)
        print(f"{rep['kernel']} / {rep['suite']} ({path}): coverage")
        for line in coverage_lines(rep.get("coverage")):
            print(f"  {line}")
    return EXIT_OK


#: the order ``diff`` ranks verdicts in: a case whose verdict moves to a higher rank got worse.
#: Not checked (skipped, out-of-domain) is worse than checked and passing; any failing verdict
#: is worse than any other; failing verdicts rank alike (fail -> crash is listed, not a new regression)
#: (known, a failure a --known entry describes, as warn: judged, accepted with a note; a move into
#: it is listed but not counted worse: the known file says the team accepts it)
VERDICT_RANK = {"pass": 0, "warn": 1, "known": 1, "skipped": 2, "out-of-domain": 2} | dict.fromkeys(FAILING, 3)


#: the gradients a case's backward record may hold, in the order ``diff`` lists their moves
GRADIENTS = ("dq", "dk", "dv", "dsink")


def _errors(case: dict, key: str) -> dict | None:
    """A case record's error record ``key``: "out", "lse" or a gradient of :data:`GRADIENTS`."""
    if key in ("out", "lse"):
        return case.get(key)
    return ((case.get("backward") or {}).get("grads") or {}).get(key)


def _moved(ex: dict | None, ey: dict | None) -> str | None:
    """``"A -> B"`` when two error records' max |err| differ, else None.  NaN-aware
    (``audits.report.html.max_text``): a case whose output turned NaN moves to "nan (N of M
    non-finite)", never to the 0 of its finite elements; the non-finite counts are compared too."""
    if not (isinstance(ex, dict) and isinstance(ey, dict) and "max_abs" in ex and "max_abs" in ey):
        return None
    raw = lambda e: (e["max_abs"], e.get("nonfinite_where_ref_finite") or 0)
    if raw(ex) == raw(ey):
        return None
    tx, ty = max_text(ex), max_text(ey)
    return f"{tx} -> {ty}" if tx != ty else f"{ex['max_abs']:.6g} -> {ey['max_abs']:.6g}"


def cmd_diff(args: argparse.Namespace) -> int:
    """Cases whose verdict or maximum error moved between two reports; exit 1 when a case got
    worse (:data:`VERDICT_RANK`) unless ``--exit-zero``."""
    a, b = load_report(args.base), load_report(args.cand)
    if args.known or args.strict_known:  # both judged by the file; --strict-known judges the candidate's entries
        a, b = _known(args, a, strict=False), _known(args, b, strict=args.strict_known)
    _say_partial(a, args.base)
    _say_partial(b, args.cand)
    worse = []
    match = _match_or_refuse(a, b, ignore_seed=args.ignore_seed, paths=(args.base, args.cand))
    ca, cb = match.base, match.cand
    changed = 0
    for key in sorted(set(ca) | set(cb), key=lambda k: (ca.get(k) or cb[k])["case"]):
        x, y = ca.get(key), cb.get(key)
        if x is None or y is None:
            print(f"{'only in cand' if x is None else 'only in base'}: {(x or y)['case']}")
            changed += 1
            continue
        moves = []
        for label, key in (("max |err|", "out"), ("LSE max |err|", "lse"), *((n, n) for n in GRADIENTS)):
            if move := _moved(_errors(x, key), _errors(y, key)):
                moves.append(f"{label} {move}")
        got_worse = VERDICT_RANK.get(y["verdict"], 3) > VERDICT_RANK.get(x["verdict"], 3) and y["verdict"] != "known"
        if x["verdict"] != y["verdict"] or moves:
            changed += 1
            mark = " (worse)" if got_worse else ""
            mark += f" (known: {y['known_id']})" if y["verdict"] == "known" else ""
            print(f"{y['case']}: {x['verdict']} -> {y['verdict']}{mark} {', '.join(moves)}".rstrip())
        if got_worse:
            worse.append(y["case"])
    print(f"{changed} of {len(set(ca) | set(cb))} cases differ; {match.line()}; {len(worse)} got worse")
    for line in known_lines(b):  # --known: the candidate's known defects
        print(line)
    if (worse or strict_failed(b)) and not args.exit_zero:
        return EXIT_FAIL
    return EXIT_OK


def cmd_merge(args: argparse.Namespace) -> int:
    """Shard reports into the report of the unsharded run (``audits.report.merge``); refused (exit 2)
    for shards of different runs, the shards missing from the count said on stderr."""
    reps = [load_report(p) for p in args.reports]
    try:
        missing = check_shards(reps, args.reports)
    except MergeError as exc:
        raise UsageError(str(exc)) from exc
    if missing:
        print(f"merge: shard {', '.join(missing)} not given: the merged report lacks its cases", file=sys.stderr)
    for r, p in zip(reps, args.reports, strict=True):
        _say_partial(r, p)
    merged = merge_reports(reps, command=command_line(args.argv))
    paths = write_report(merged, args.out)
    print(f"merged {len(reps)} reports, {len(merged['cases'])} cases: {paths['md']}")
    return exit_code(merged)


def cmd_summary(args: argparse.Namespace) -> int:
    reps = [load_report(p) for p in args.reports]
    by = tuple(b.strip() for b in args.by.split(",") if b.strip())
    if not by or set(by) - set(GROUP_FIELDS):
        raise UsageError(f"--by {args.by!r}: expected a comma-separated list of {', '.join(GROUP_FIELDS)}")
    labels = [r["kernel"] for r in reps]
    labels = [f"{k} ({p})" if labels.count(k) > 1 else k for k, p in zip(labels, args.reports, strict=True)]
    text = summary_markdown(reps, by, labels=labels)
    notes = [f"- {lab}: **{part}**" for r, lab in zip(reps, labels, strict=True) if (part := partial_line(r))]
    if notes:  # before the tables: their cells hold only the cases that ran
        text = "Partial reports (their cases not run are not in the tables):\n\n" + "\n".join(notes) + "\n\n" + text
    print(text, end="")
    if args.out:
        out = Path(args.out)
        atomic_write(out / "summary.md", text)
        plot_errors(reps, out / "summary.svg", labels=labels)
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    print("kernels: " + ", ".join(KERNELS) + ", module:attr or path/to/file.py:fn")
    models = ", ".join(MODELS)
    print(f"  model variants: MODEL:knob=value[,knob=value...], MODEL one of {models}; e.g. fa4-model:poly_degree=5")
    for name, (_, accepted) in VARIANT_KNOBS.items():
        print(f"    {name:18s} {accepted}")
    print("  fa4@DIR: production FA4 from DIR, a release installed there with:")
    print("    pip install --no-deps --target DIR flash-attn-4==VERSION")
    print("suites:")
    for name, make in SUITES.items():
        cases = make()
        print(f"  {name:8s} {len(cases):5d} cases, {len({c.compile_key for c in cases}):3d} compile keys")
    print("input families:")
    for name, fam in FAMILIES.items():
        print(f"  {name:18s} {fam.hunts}")
    return EXIT_OK


def cmd_fuzz(args: argparse.Namespace) -> int:
    from audits.checks.fuzz import fuzz  # lazy: see audits.cli

    usable_kernels([args.kernel])
    narrow = read_domain(args.domain) if args.domain else None  # as run's --domain (audits.suites.selection)
    th = _thresholds(args.thresholds)
    if args.budget <= 0 or args.max_seqlen <= 0:
        raise UsageError(f"--budget and --max-seqlen must be positive, got {args.budget}, {args.max_seqlen}")
    device = _device(args.device)
    backward = None
    if args.backward:
        try:
            require_backward(th)
        except ThresholdsError as exc:
            raise UsageError(str(exc)) from exc
        backward = BackwardOptions(repeat=2)
    timeout = given_timeout(args)  # none asked for: the kernel runs in this process, no limit
    options = RunOptions(
        device=device,
        thresholds=th,
        backward=backward,
        timeout=timeout,
        timeout_given=timeout is not None,
        isolate=None if timeout is not None else False,
    )
    try:
        res = fuzz(
            args.kernel,
            options=options,
            budget=args.budget,
            database=args.database,
            max_seqlen=args.max_seqlen,
            seed=args.seed,
            narrow=narrow,
            mods=args.mods,
        )
    except ValueError as exc:  # --mods on a kernel whose domain declares no mod kind
        if not args.mods:
            raise
        raise UsageError(str(exc)) from exc
    atomic_write(Path(args.out) / "fuzz.json", json.dumps(res, indent=1) + "\n")
    print(f"{res['examples']} examples; largest error/bound {res['best_tightness']} ({res['best_case']})")
    if res["failure"]:
        f = res["failure"]
        print(f"FAILING (shrunk): {f['name']}: {f['verdict']}: {'; '.join(f['reasons'])}\nreproduce: {f['repro']}")
        return EXIT_FAIL
    return EXIT_OK


def _register_fuzz(sub) -> None:
    """The ``fuzz`` subcommand's arguments."""
    fz = sub.add_parser("fuzz", help="Hypothesis search for a failing case, climbing toward the largest error/bound")
    fz.add_argument(
        "--kernel", required=True, help="a kernel name (fa4-model, sdpa-math, ...), module:attr or path/to/file.py:fn"
    )
    fz.add_argument("--budget", type=int, default=200, help="examples to try (default 200)")
    fz.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the kernel runs (default cpu)")
    fz.add_argument("--max-seqlen", type=int, default=512, help="longest seqlen_q / seqlen_k drawn (default 512)")
    fz.add_argument("--database", default=".hypothesis/fa4-audit", help="Hypothesis example database")
    fz.add_argument("--thresholds", default=None, help="thresholds TOML (default: audits/verdict/thresholds.toml)")
    fz.add_argument("--backward", action="store_true", help="audit the gradients too (as run --backward, 2 repeats)")
    fz.add_argument("--seed", type=int, default=None, help="a fixed search (the database is then not used)")
    fz.add_argument(
        "--domain",
        default=None,
        metavar="FILE.toml",
        help="a TOML file of domain keys (audits/suites/domain.py) narrowing what the kernel declares: dtypes "
        "and lengths are drawn inside it, other draws outside it are skipped",
    )
    fz.add_argument(
        "--mods",
        action="store_true",
        help="draw the library mods (score_mod, mask_mod, block sparsity) the kernel's domain declares (docs/mods.md)",
    )
    fz.add_argument("--out", default="reports/fuzz-latest", help="writes OUT/fuzz.json (default reports/fuzz-latest)")
    add_timeout_argument(fz, note=IN_PROCESS_NOTE)
    fz.set_defaults(func=cmd_fuzz)


def register(sub) -> None:
    """Add the report commands, ``list`` and ``fuzz`` to the ``fa4-audit`` parser."""

    g = sub.add_parser("gate", help="re-judge a report under thresholds (and against a baseline report)")
    g.add_argument("report", help="the report.json (or .json.gz / .json.xz) to re-judge")
    g.add_argument("--thresholds", default=None, help="thresholds TOML (default: audits/verdict/thresholds.toml)")
    g.add_argument(
        "--baseline",
        default=None,
        help="BASE.json: fail cases worse than the baseline by more than [baseline] max_ratio; cases are "
        "matched by configuration (their identity, not their names); exit 2 when fewer than half of the "
        "smaller report's cases match",
    )
    g.add_argument("--ignore-seed", action="store_true", help="match baseline cases by configuration without the seed")
    g.add_argument("--out", default=None, help="also write the re-judged report (json, md, html, junit) here")
    add_known_arguments(g)
    g.set_defaults(func=cmd_gate)
    sh = sub.add_parser("show", help="print a report: a table on a terminal, plain lines otherwise")
    sh.add_argument("report", help="a report.json (or .json.gz / .json.xz)")
    sh.add_argument(
        "--case", default=None, metavar="GLOB", help="show the cases whose name matches GLOB (a full name: that case)"
    )
    sh.add_argument(
        "--failing",
        action="store_true",
        help=f"only the failing cases ({', '.join(FAILING)}), each with its reasons and where it fails",
    )
    sh.add_argument(
        "--plot",
        action="store_true",
        help="render the --case's error map (|error|/bound per element, tiles, mask) and print the file's path; "
        "exit 2 when the case has none",
    )
    sh.add_argument("--format", default="png", choices=["png", "svg"], help="--plot's format (default png)")
    sh.add_argument(
        "--tensor", default=None, choices=["out", "lse", "dq", "dk", "dv"], help="--plot only this tensor's panels"
    )
    sh.add_argument("--out", default=None, metavar="FILE", help="--plot's file (default: CASE.png or .svg here)")
    sh.set_defaults(func=cmd_show)
    cv = sub.add_parser(
        "coverage",
        help="what a run covered of what the kernel accepts: head dims and code-path classes, forward and backward",
        description="Print a report's coverage (docs/runner.md, 'Coverage'): the head dims the kernel's domain "
        "accepts, those the run compared in the forward and in the backward, those it missed, and each code-path "
        "class of the kernel's architecture with one case that covered it.  Exit 0; 2 for a bad path.",
    )
    cv.add_argument(
        "report", help="a report.json (or .json.gz / .json.xz), a run's journal.jsonl, or a run directory (--out DIR)"
    )
    cv.set_defaults(func=cmd_coverage)
    df = sub.add_parser("diff", help="where two reports differ (verdicts, max errors)")
    df.add_argument("base", help="the baseline report.json")
    df.add_argument("cand", help="the candidate report.json, compared case by case with the baseline")
    df.add_argument(
        "--ignore-seed",
        action="store_true",
        help="match cases by configuration without the seed (default: by configuration, the seed included; "
        "exit 2 when fewer than half of the smaller report's cases match)",
    )
    df.add_argument(
        "--exit-zero",
        action="store_true",
        help="exit 0 even when a case got worse (report only; default: exit 1 when a verdict got worse in the order "
        "pass < warn < skipped, out-of-domain < fail, error, crash, timeout)",
    )
    add_known_arguments(df)
    df.set_defaults(func=cmd_diff)
    mg = sub.add_parser("merge", help="combine shard reports (run --shard I/N) into one")
    mg.add_argument("reports", nargs="+", help="the shard reports (report.json of each run --shard I/N)")
    mg.add_argument("--out", required=True, help="directory of the merged report (json, md, html, junit)")
    mg.set_defaults(func=cmd_merge)
    _register_fuzz(sub)
    ls = sub.add_parser("list", help="kernels, suites (case and compile-key counts) and input families")
    ls.set_defaults(func=cmd_list)
    sm = sub.add_parser("summary", help="several reports side by side (one column each), per configuration group")
    sm.add_argument("reports", nargs="+", help="report.json (or .json.gz / .json.xz) files")
    sm.add_argument("--by", default="dtype,mask", help="grouping: comma-separated Case fields, mask or heads")
    sm.add_argument("--out", default=None, help="also write OUT/summary.md and OUT/summary.svg")
    sm.set_defaults(func=cmd_summary)
