"""A run's loop: every case for every kernel, journalled as it goes (``audits.engine.audit`` drives it
in this process; each ``--jobs`` child drives it over its shard).

Each kernel is opened once as a :class:`~audits.engine.session.Session` (its calls, its domain);
the kernels take turns case by case, so that a case's inputs and FP64 reference are computed
once for all of them.  A record is journalled (``audits.engine.journal``) before the next case
starts, a failing case's inputs saved for its reproducer, its error map written beside the
report."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from audits.engine import journal
from audits.engine.compare import compare_case
from audits.engine.options import RunOptions
from audits.engine.session import open_session
from audits.engine.shards import run_order
from audits.engine.stop import StopReason
from audits.report.repro import reproducer
from audits.report.schema import FAILING, upgrade_case
from audits.suites.case import Case
from audits.suites.domain import Domain
from audits.suites.inputs import make_inputs, make_varlen_inputs, saveable_kw
from audits.verdict.diagnosis import save_map

__all__ = ["run_suites", "run_suite", "kernel_dir", "Runs", "is_audit_error"]


def run_suite(kernel: str, cases: list[Case], options: RunOptions, **kw) -> list[dict]:
    """:func:`run_suites` for one kernel: its records in suite order."""
    return run_suites([kernel], cases, options, **kw)[kernel]


def kernel_dir(out_dir: str | Path, kernel: str, several: bool) -> Path:
    """Where a kernel's journal and report go: ``out_dir`` itself for a single kernel, else a
    subdirectory named after the kernel (``module:attr`` -> ``module.attr``, a variant
    ``fa4-model:poly_degree=5`` -> ``fa4-model.poly_degree=5``; ``fa4@DIR`` -> ``fa4@`` and DIR's
    last component, e.g. ``fa4@b36``: ``audits.kernels.usable_kernels`` refuses two of one name)."""
    if several and kernel.startswith("fa4@"):
        return Path(out_dir) / f"fa4@{Path(kernel[4:]).resolve().name}"
    return Path(out_dir) / kernel.replace(":", ".").replace("/", "_") if several else Path(out_dir)


class Runs(dict):
    """Each kernel's records in suite order (a dict, kernel -> records), and ``stopped``: why the
    run ended before its last case (a :class:`StopReason`), None when it did not."""

    def __init__(self, records: dict, stopped: StopReason | None = None):
        super().__init__(records)
        self.stopped = stopped


def run_suites(
    kernels: list[str],
    cases: list[Case],
    options: RunOptions,
    *,
    progress: Callable[[str, dict], None] | None = None,
    deadline: float | None = None,
    journal_extra: dict | None = None,
    catch_interrupt: bool = False,
    domains: dict[str, Domain] | None = None,
) -> Runs:
    """Evaluate ``cases`` (in :func:`audits.engine.shards.run_order`) for every kernel under
    ``options`` (``audits.engine.options.RunOptions``); journal each record under :func:`kernel_dir`
    of ``options.out``; return each kernel's records in suite order.  The kernels take turns case
    by case, so a case's inputs and FP64 reference are computed once for all of them; a case
    outside a kernel's domain is skipped for that kernel without a call: ``domains[kernel]`` (the
    domain the case selection resolved for the run, narrowed by ``--domain``), else its declared
    one (``audits.kernels.kernel_domain``), looked up once per run (:func:`~audits.engine.session.
    open_session`).
    ``options.resume``: keep the finished records of a journal written by this same run (kernel,
    label, seed, thresholds, cases: ``journal.JournalMismatch`` otherwise).  Kernels run in a
    worker process as ``options.isolation()`` says (``audits.engine.worker``), where a crash
    becomes the case's verdict, and a call past ``options.timeout`` seconds the verdict
    ``timeout``.  ``options.backward``: audit the gradients too (``audits.engine.backward``).
    ``options.per_sequence``: a fixed-length kernel runs varlen cases one sequence at a time (else
    they are skipped for it); a resumed record made otherwise is redone.
    ``progress(kernel, record)`` is called after each record.  ``deadline`` (a ``time.monotonic()``
    value, ``run --budget``): no case starts after it.  The result's ``stopped`` says why the run
    ended early (budget, exitfirst; interrupted: Ctrl-C with ``catch_interrupt``, the workers
    killed and the records so far returned; without it, KeyboardInterrupt propagates after the
    journals hold what finished).  ``journal_extra``: fields added to a new journal's header (the
    command, the environment: what a report built from the journal shows)."""
    state = {}
    for kern in kernels:
        state[kern] = _kernel_state(kern, cases, options, len(kernels) > 1, journal_extra or {})
        state[kern]["session"] = open_session(kern, options, domain=(domains or {}).get(kern))
    order = run_order(cases)
    why = None
    try:
        why = _loop(order, cases, state, options, progress, deadline)
    except KeyboardInterrupt:
        why = StopReason.INTERRUPTED
        _quiet_fd_handover()
        for st in state.values():  # a worker is out of the terminal's reach (its own session): end its call now
            st["session"].kill()
        if not catch_interrupt:
            raise
    finally:
        for st in state.values():
            st["session"].close()
    return Runs({kern: [st["records"][i] for i in sorted(st["records"])] for kern, st in state.items()}, why)


def _quiet_fd_handover() -> None:
    """Keep the console clean after Ctrl-C: a worker killed while it fetched a tensor's shared
    memory from this process (``multiprocessing.resource_sharer``, how torch passes tensors
    through a pipe) makes that helper thread print a ``ConnectionResetError`` traceback.  The
    worker was killed on purpose; that traceback, and only it, is dropped from then on."""
    hook = sys.excepthook

    def quiet(kind, value, tb):
        if not _is_handover_reset(kind, tb):
            hook(kind, value, tb)

    sys.excepthook = quiet


def _is_handover_reset(kind: type[BaseException], tb) -> bool:
    """Whether an uncaught exception is a killed worker's connection dropped inside
    ``multiprocessing/resource_sharer.py`` (``traceback.walk_tb`` yields frames, whose file is
    ``f_code.co_filename``)."""
    return issubclass(kind, (ConnectionError, EOFError)) and any(
        Path(f.f_code.co_filename).name == "resource_sharer.py" for f, _ in traceback.walk_tb(tb)
    )


def _kernel_state(kern: str, cases: list[Case], options: RunOptions, several: bool, extra: dict) -> dict:
    """A kernel's output directory and journal: resumed (its header checked) or started afresh."""
    out = kernel_dir(options.out, kern, several)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "journal.jsonl"
    bwd, th = options.backward, options.thresholds
    ident = journal.run_identity(
        kernel=kern, suite=options.label, seed=options.seed, thresholds=th, cases=cases, backward=bwd
    )
    if options.resume:
        journal.check_header(path, ident)
    elif path.exists():
        path.unlink()
    if not path.exists():
        journal.append(path, {**ident, **extra})  # extras are not identity: check_header ignores them
    done = journal.read_records(path) if options.resume else {}
    per_seq = options.per_sequence
    # the audit's own failures are redone, and varlen records of a run with another --per-sequence
    done = {n: r for n, r in done.items() if not is_audit_error(r) and _same_entry(r, per_seq)}

    def repro(c: Case) -> str:
        cmd = reproducer(
            kern,
            c,
            device=options.torch_device.type,
            thresholds_path=th.get("path"),
            backward=bwd,
            timeout=options.timeout,
        )
        return cmd + " --per-sequence" if per_seq and c.varlen else cmd

    return {"out": out, "journal": path, "done": done, "records": {}, "repro": repro, "per_sequence": per_seq}


def _same_entry(rec: dict, per_seq: bool) -> bool:
    """Whether a journal record stands for a run with ``--per-sequence`` = ``per_seq`` (a
    fixed-length case always does)."""
    return rec.get("varlen") is None or rec["varlen"].get("per_sequence") == per_seq


def is_audit_error(rec: dict) -> bool:
    """Whether a journal record failed on the audit's side (its FP64 work ran out of GPU
    memory), not the kernel's; records written before the flag existed get it from
    ``audits.report.schema.upgrade_case`` (the one reader of old message text).
    Public: ``benchmarks/maintenance/release_state_from_reports.py`` leaves such records out as ``--resume`` does."""
    return bool(upgrade_case(dict(rec)).get("audit_error"))


def _save_inputs(st: dict, c: Case) -> str:
    """The failing case's inputs as a torch file beside the report (``repro/<case>.pt``)."""
    rdir = st["out"] / "repro"
    rdir.mkdir(exist_ok=True)
    x = make_varlen_inputs(c, device="cpu") if c.varlen else make_inputs(c, device="cpu")
    tensors = {n: x[n].contiguous() for n in ("q", "k", "v")}
    # the mods' reference forms are closures: saved by name (the case rebuilds them), their tensors as they are
    torch.save({**tensors, "kw": saveable_kw(x["kw"]), "case": c.as_dict()}, rdir / f"{c.name}.pt")
    return f"repro/{c.name}.pt"


def _record(st: dict, i: int, rec: dict) -> None:
    """Case ``i``'s record into the kernel's records, then its journal (first: a Ctrl-C during
    the journal's fsync keeps it in the report)."""
    st["records"][i] = rec
    journal.append(st["journal"], {**rec, journal.AT: i})


def _loop(order, cases, state, options: RunOptions, progress, deadline) -> StopReason | None:
    """Run the cases in ``order``; why it stopped early (budget, exitfirst), or None.  With
    ``options.baseline``, every kernel runs a case before any is journalled, and each other
    kernel's record gets ``compare``: its results against the baseline's, bit for bit
    (``audits.engine.compare``)."""
    device, backward, base = options.torch_device, options.backward, options.baseline
    for n, i in enumerate(order):
        c = cases[i]
        fresh = any(c.name not in st["done"] for st in state.values())
        if fresh and deadline is not None and time.monotonic() >= deadline:
            return StopReason.BUDGET  # resumed records cost nothing: the budget stops only new work
        kept, made = {}, {}
        for kern, st in state.items():
            if c.name in st["done"]:
                continue
            emap, held = {}, {} if base is not None else None
            rec = st["session"].evaluate(c, error_map=emap, tensors=held)
            rec["repro"] = st["repro"](c)
            if rec["verdict"] in FAILING:
                rec["repro_inputs"] = _save_inputs(st, c)
            if "map" in emap:  # the error map beside the report, named in the record (kept by --resume)
                rec["error_map"] = f"maps/{c.name}.npz"
                save_map(st["out"] / rec["error_map"], error_map=emap.pop("map"))
            made[kern], kept[kern] = rec, (held or {}).get("keep")
            if base is None:  # journalled now; compared records once every kernel has run the case
                _record(st, i, rec)
        if base is not None:
            for kern, rec in made.items():
                if kern != base:
                    got = compare_case(
                        case=c, base=kept.get(base), cand=kept[kern], base_rec=made.get(base), cand_rec=rec
                    )
                    rec["compare"] = {"baseline": base, **got}
                _record(state[kern], i, rec)
        kept.clear()
        stop = False
        for kern, st in state.items():
            if kern in made:
                rec = made[kern]
            else:
                rec = {**st["done"][c.name], "resumed": True}
            st["records"][i] = rec
            if progress is not None:
                progress(kern, rec)
            stop |= options.exitfirst and rec["verdict"] in FAILING
        if device.type == "cuda" and c.cost > (1 << 28 if backward is not None else 1 << 32):
            torch.cuda.empty_cache()  # give the FP64 intermediates back: parallel jobs share the GPU
        if stop:
            return StopReason.EXITFIRST if n + 1 < len(order) else None
    return None
