"""The command line's side of ``audits.engine.options.RunOptions``: ``--timeout`` as every subcommand
that calls kernels spells it (``run``, ``invariance``, ``fuzz``, ``fidelity``), ``--known`` /
``--strict-known`` as ``run``, ``gate`` and ``diff`` spell them, and a parsed ``run`` turned into the
options of its run."""

from __future__ import annotations

import argparse

from audits.common import UsageError
from audits.engine.backward import BackwardOptions
from audits.engine.options import RunOptions
from audits.engine.worker import DEFAULT_TIMEOUT_S
from audits.verdict.known import SHIPPED, KnownError, KnownFile, load_known

__all__ = [
    "RUN_DEFAULT_NOTE",
    "IN_PROCESS_NOTE",
    "add_timeout_argument",
    "timeout_setting",
    "given_timeout",
    "run_options_from_args",
    "add_known_arguments",
    "known_from_args",
]

#: ``--timeout``'s default, in the words of the subcommands whose kernels run in a worker without it
RUN_DEFAULT_NOTE = (
    f"Default {DEFAULT_TIMEOUT_S:g} s (room for a CuTe-DSL compile, docs/runner.md) for the kernels that run in a "
    "worker anyway (fa4 and user kernels, or all with --isolate); given, every kernel runs in a worker."
)
#: ... and of those whose kernels run in the audit's own process without it
IN_PROCESS_NOTE = "Given (above 0), the kernels run in a worker process; without it, in this process, with no limit."


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0: no limit)") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number of seconds >= 0 (0: no limit)")
    return v


def add_timeout_argument(parser: argparse.ArgumentParser, *, note: str) -> None:
    """``--timeout SECONDS`` on a subcommand, the same everywhere: ``note`` (:data:`RUN_DEFAULT_NOTE`
    or :data:`IN_PROCESS_NOTE`) says where its kernels run without it, and so what the default is."""
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="time limit of each kernel call, forward and backward separately (0: no limit): a call past it kills "
        f"the kernel's worker process, the case's verdict is timeout and the run goes on with a fresh worker. {note}",
    )


def timeout_setting(args: argparse.Namespace) -> tuple[float | None, bool]:
    """(the limit in seconds or None for no limit, whether ``--timeout`` was given): given and
    above 0, every kernel runs in a worker so that it can be stopped."""
    given = getattr(args, "timeout", None)
    if given is None:
        return DEFAULT_TIMEOUT_S, False
    return (given or None), True


def given_timeout(args: argparse.Namespace) -> float | None:
    """``--timeout`` when given above 0 (the kernels then run in a worker), else None (in this
    process, no limit): the subcommands whose kernels run in the audit's own process by default."""
    timeout, explicit = timeout_setting(args)
    return timeout if explicit else None


def add_known_arguments(parser: argparse.ArgumentParser) -> None:
    """``--known FILE.toml|NAME`` and ``--strict-known``, the same on ``run``, ``gate`` and ``diff``."""
    parser.add_argument(
        "--known",
        default=None,
        metavar="FILE.toml",
        help="known defects (docs/known.md): a failing case an entry describes gets the verdict known and does not "
        "fail the exit code; any other failure still does. A TOML file, or a shipped one by name "
        f"({', '.join(SHIPPED)}: production FA4's known defects and PyTorch's flex/SDPA peers', files to copy and "
        "edit); several joined by commas, e.g. fa4,torch",
    )
    parser.add_argument(
        "--strict-known",
        action="store_true",
        help="with --known: exit 1 when an entry no longer reproduces (its rule's configurations ran and none failed "
        "its way)",
    )


def known_from_args(args: argparse.Namespace) -> KnownFile | None:
    """The parsed ``--known`` file (None without it); a malformed one, or ``--strict-known`` without
    ``--known``, is a :class:`UsageError` (exit 2) naming the file, the entry and what is accepted."""
    if args.known is None:
        if args.strict_known:
            raise UsageError("--strict-known judges the entries of a --known file: add --known FILE.toml (or fa4)")
        return None
    try:
        return load_known(args.known)
    except KnownError as exc:
        raise UsageError(str(exc)) from exc


def run_options_from_args(args: argparse.Namespace, *, thresholds: dict, label: str) -> RunOptions:
    """The options of a parsed ``run`` (its cases' ``label``, its loaded ``thresholds``); a
    ``--no-isolate`` beside a time limit or an ``fa4@DIR`` kernel is a :class:`UsageError`."""
    timeout, explicit = timeout_setting(args)
    backward = BackwardOptions(repeat=args.repeat, deterministic=args.deterministic) if args.backward else None
    options = RunOptions(
        device=args.device,
        out=args.out,
        thresholds=thresholds,
        seed=args.seed,
        label=label,
        resume=args.resume,
        exitfirst=args.exitfirst,
        isolate=args.isolate,
        timeout=timeout,
        timeout_given=explicit,
        backward=backward,
        per_sequence=args.per_sequence,
        budget=args.budget,
        jobs=args.jobs,
        gpus=args.gpus,
        quiet=args.quiet,
        maps=args.maps,
        shard=args.shard,
        known=known_from_args(args),
        strict_known=args.strict_known,
        poison=args.poison,
        time_calls=args.time_calls,
    )
    try:
        options.isolation(kernels=args.kernel)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return options
