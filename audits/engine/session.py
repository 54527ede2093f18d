"""One kernel opened for auditing, case by case: what ``run_suites`` keeps per kernel and what a
search (``fa4-audit fuzz``) drives one case at a time.

A :class:`Session` holds the kernel's calls (in this process or in a worker, as
``RunOptions.isolation`` says: ``audits.engine.worker``) and its declared domain, resolved once;
:meth:`Session.evaluate` gives a case's record and verdict under the run's options (device,
thresholds, backward, per_sequence).  Journals, reproducers and report files are the run's
(``audits.engine.evaluate.run_suites``), not the session's."""

from __future__ import annotations

from dataclasses import dataclass

from audits.engine.evaluate import evaluate_case
from audits.engine.options import RunOptions
from audits.engine.worker import KernelCalls, open_kernel
from audits.kernels import kernel_domain
from audits.suites.case import Case
from audits.suites.domain import Domain

__all__ = ["Session", "open_session"]


@dataclass
class Session:
    """Kernel ``kernel`` open under ``options``: ``calls`` (``audits.engine.worker.KernelCalls``)
    and ``domain``, the domain a case is judged inside (outside it: ``skipped``, never called)."""

    kernel: str
    options: RunOptions
    domain: Domain
    calls: KernelCalls

    def evaluate(self, case: Case, *, error_map: dict | None = None, tensors: dict | None = None) -> dict:
        """The record of ``case`` (``audits.engine.evaluate.evaluate_case``); a failing case's
        error-map data into ``error_map["map"]``, and the kernel's results into
        ``tensors["keep"]``, when given."""
        o = self.options
        return evaluate_case(
            self.kernel,
            self.calls,
            case,
            o.torch_device,
            o.thresholds,
            o.backward,
            self.domain,
            o.per_sequence,
            error_map=error_map,
            tensors=tensors,
            poison=o.poison,
            time_calls=o.time_calls,
        )

    def kill(self) -> None:
        """End a call in flight now (a worker's): Ctrl-C reaches the audit, not the worker."""
        self.calls.kill()

    def close(self) -> None:
        self.calls.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_session(kernel: str, options: RunOptions, *, domain: Domain | None = None) -> Session:
    """Open ``kernel`` under ``options``: in a worker or in this process (``options.isolation()``),
    judged inside ``domain`` (None: the kernel's declared one, ``audits.kernels.kernel_domain``;
    a run passes the domain its case selection resolved, narrowed by ``--domain``, so that the
    domain is looked up once per run)."""
    isolate = options.isolation()
    iso = isolate(kernel) if callable(isolate) else isolate
    domain = kernel_domain(kernel) if domain is None else domain
    return Session(
        kernel, options, domain, open_kernel(kernel, options.torch_device, isolated=iso, timeout=options.timeout)
    )
