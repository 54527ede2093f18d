"""The case-selection options every subcommand that takes cases shares (``run``, ``invariance``,
``static``, ``fidelity``): :func:`add_case_arguments` adds them to a subcommand's parser, with
that subcommand's default suite; :func:`selection_from_args` reads them back into
``audits.suites.selection.select_cases`` (the rules are documented there)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from audits.suites.cases import SUITES
from audits.suites.selection import Selection, select_cases

__all__ = ["CASE_OPTIONS", "add_case_arguments", "selection_from_args"]

#: the options :func:`add_case_arguments` adds; every subcommand that takes cases has them all
CASE_OPTIONS = ("--suite", "--config", "--case-file", "--case", "--domain", "--seed")


def add_case_arguments(parser: argparse.ArgumentParser, *, default_suite: str = "smoke") -> None:
    """Add :data:`CASE_OPTIONS` to a subcommand's ``parser``, ``default_suite`` being what it
    audits when no case is given: every subcommand then accepts the same selection."""
    g = parser.add_argument_group("case selection (the same for run, invariance, static and fidelity)")
    g.add_argument(
        "--suite",
        default=None,
        metavar="NAME|FILE.toml",
        help=f"a named suite ({', '.join(SUITES)}; default {default_suite}) or a suite file FILE.toml "
        "(docs/runner.md, 'Suite files'); not with --config or --case-file",
    )
    g.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="JSON",
        help='a case as JSON (audits.suites.cases.Case fields, absent = default), e.g. \'{"d": 64, "causal": true}\'; '
        "repeatable",
    )
    g.add_argument(
        "--case-file",
        action="append",
        default=None,
        metavar="FILE",
        help="a file of cases: a JSON list, JSON lines, or a report.json (its cases); repeatable",
    )
    g.add_argument(
        "--case",
        default=None,
        metavar="GLOB",
        help="keep the cases whose name (or fidelity label, e.g. d128_softcap) matches GLOB, e.g. '*causal*'",
    )
    g.add_argument(
        "--domain",
        default=None,
        metavar="FILE.toml",
        help="a TOML file of domain keys (audits/suites/domain.py) narrowing what the kernels declare: suites are "
        "built within it, given cases outside it are not run",
    )
    g.add_argument("--seed", type=int, default=0, metavar="N", help="added to every case's seed (default 0)")
    parser.set_defaults(default_suite=default_suite)


def selection_from_args(args: argparse.Namespace, *, kernels: Sequence[str] = ()) -> Selection:
    """The cases the options of :func:`add_case_arguments` select, the suites built within
    ``kernels``' declared domains (``audits.suites.selection.select_cases``); an attribute absent
    from ``args`` counts as not given."""
    get = lambda name: getattr(args, name, None)  # noqa: E731
    return select_cases(
        suite=get("suite"),
        default_suite=get("default_suite") or "smoke",
        configs=get("config") or (),
        case_files=get("case_file") or (),
        case_glob=get("case"),
        domain=get("domain") or None,
        seed=get("seed") or 0,
        kernels=kernels,
    )
