"""The command line's side of ``audits.engine.options.RunOptions``: ``--timeout`` as every subcommand
that calls kernels spells it (``run``, ``invariance``, ``fuzz``, ``fidelity``), and a parsed ``run``
turned into the options of its run."""

from __future__ import annotations

import argparse

from audits.common import UsageError
from audits.engine.backward import BackwardOptions
from audits.engine.options import RunOptions
from audits.engine.worker import DEFAULT_TIMEOUT_S

__all__ = [
    "RUN_DEFAULT_NOTE",
    "IN_PROCESS_NOTE",
    "add_timeout_argument",
    "timeout_setting",
    "given_timeout",
    "run_options_from_args",
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


def run_options_from_args(args: argparse.Namespace, *, thresholds: dict, label: str) -> RunOptions:
    """The options of a parsed ``run`` (its cases' ``label``, its loaded ``thresholds``); a
    ``--no-isolate`` beside a time limit is a :class:`UsageError`."""
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
    )
    try:
        options.isolation()
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return options
