"""The ``fa4-audit`` command line (also ``python -m audits``): one parser onto which each command
module of this package registers its subcommands (parsing and printing only; the work is the
library's, ``audits.api`` and below).  Exit codes: ``audits.common``.

The parser is built for every command, so a command module imports the check it runs (fidelity,
invariance, fuzz: the forward model, numba, Hypothesis) inside its command function, marked
"lazy: see audits.cli": importing every check up front made ``import audits.cli`` 1.5 s instead
of 1.0 s on the development machine (2026-12-04) and every command, ``run`` included, that
much slower."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from audits.cli import bounds as bounds_cli
from audits.cli import compare as compare_cli
from audits.cli import ex2 as ex2_cli
from audits.cli import fidelity as fidelity_cli
from audits.cli import invariance as invariance_cli
from audits.cli import reports as cli_reports
from audits.cli import run as runner_cli
from audits.cli import static as static_cli
from audits.common import EXIT_INTERRUPTED, EXIT_USAGE, UsageError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fa4-audit",
        description="Numerics audits of the FlashAttention-4 kernel (exit 0 pass, 1 fail, 2 usage error).",
    )
    p.add_argument(
        "--version", action="version", version=f"%(prog)s {_version()}", help="print the installed version and exit"
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in (runner_cli, compare_cli, cli_reports, ex2_cli, fidelity_cli, static_cli, bounds_cli, invariance_cli):
        mod.register(sub)
    return p


def _version() -> str:
    """The installed distribution's version (pyproject.toml's, one source of truth); a tree run
    without installing says so rather than guessing."""
    try:
        return version("fa4-audit")
    except PackageNotFoundError:
        return "(not installed: run from a source tree; pip install . gives the version)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    args.argv = argv
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"fa4-audit {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader left (``fa4-audit show R | head``): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return EXIT_USAGE
    except KeyboardInterrupt:  # ``run`` catches Ctrl-C during its cases and writes a partial report itself
        where = (
            f"; the finished cases are in {args.out}/journal.jsonl (fa4-audit show reads it), --resume continues"
            if args.command == "run"
            else ""
        )
        print(f"fa4-audit {args.command}: interrupted{where}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
