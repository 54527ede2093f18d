"""Kernel calls in a worker process, with a time limit: what lets an audit survive the kernels it
audits (docs/runner.md, "Time limits and worker deaths").

:class:`Isolated` keeps one spawned worker process per kernel that runs only the kernel calls
(inputs in, out and LSE or the backward's gradients back, on the CPU); references and verdicts
stay in the parent.  What can go wrong in a call, and what the caller sees:

* the kernel raises: the exception comes back and is raised in the parent, the worker keeps
  running.  One that cannot cross the pipe (it holds a module, a lock, a CUDA stream: torch
  inductor's ``InductorError``) comes back as a ``RemoteError`` holding its type name,
  message and formatted traceback.  ``failure_reason`` (``audits.engine.failures``) words
  either, with memory exhaustion (``torch.OutOfMemoryError``, ``MemoryError``) named as such.
* the call passes its time limit: the worker's process group is killed (a kernel busy in C or
  in Python, and any process it started, dies with it) and :class:`KernelTimeout` is raised.
* the worker dies (a segfault, an abort, a CUDA error that poisons the context, the host's
  out-of-memory killer): :class:`WorkerCrashed`, its message naming the exit code or signal.

After a death or a kill the next call gets a fresh worker; after the first death a spare is kept
warming up (started while the current one works), so a kernel that hangs on every case costs
about one time limit per case, not a time limit plus a torch import, once a spawn takes less than
the limit.

:class:`InProcess` is the same interface (:class:`KernelCalls`) for a kernel called in the audit's own
process, so that the engine calls either alike (:func:`open_kernel`, :func:`as_calls`).

A poisoned run (``audits.engine.poison``: fresh memory filled with NaN, then a pattern) must
poison the process that runs the kernel: its fill travels with the call as the keyword
``audits.engine.poison.POISON_KW``, which :func:`serve` removes and applies around the kernel call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import traceback
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from audits.common import UsageError
from audits.engine.backward import grad_call
from audits.engine.failures import RemoteError, RemoteRefusal, error_kind
from audits.engine.poison import POISON_KW, poisoned
from audits.kernels import (
    KERNELS,
    VARLEN_KERNELS,
    base_kernel,
    enter_worker_process,
    get_kernel,
    get_varlen_kernel,
    per_sequence,
    release_dir,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "STARTUP_LIMIT_S",
    "KernelCalls",
    "Isolated",
    "InProcess",
    "open_kernel",
    "as_calls",
    "KernelTimeout",
    "WorkerCrashed",
    "isolation",
    "isolated_by_default",
    "death_reason",
    "to_device",
    "serve",
]

#: the default limit of one kernel call (forward, or the backward half), in seconds.  A call may
#: include JIT compilation: a CuTe-DSL compile of one production variant took 5.3-20.2 s on the
#: H200 (median 6.9 s, docs/static.md), and the issue that asked for the limit saw a fresh worker
#: cost 13-50 s there (torch import, recompilation); 300 s is 15x the slowest compile measured,
#: and still bounds a hung run.  (A fresh worker imports the kernel before its first call, under
#: :data:`STARTUP_LIMIT_S`, not under this limit.)
DEFAULT_TIMEOUT_S = 300.0
#: how long a fresh worker may take to start (import torch and the audit) before it counts as
#: dead, when a time limit applies: not part of any call's limit (a spawn here takes seconds)
STARTUP_LIMIT_S = 300.0


class WorkerCrashed(RuntimeError):
    """The kernel's worker process died during a call (or did not start)."""


class KernelTimeout(RuntimeError):
    """A kernel call did not return within its time limit; its worker was killed."""


def isolated_by_default(kernel: str) -> bool:
    """Whether ``run`` puts ``kernel`` in a worker without being asked: production (``fa4``, and
    ``fa4@DIR``, which runs nowhere else) and user kernels (``module:attr``, ``file.py:fn``),
    whose crashes and hangs are the ones to expect; the built-in models (their variants too) and
    SDPA run in the audit's process unless ``--timeout`` is given."""
    base = base_kernel(kernel)
    return base == "fa4" or (base == kernel and ":" in kernel)


def isolation(
    isolate: bool | None,
    timeout: float | None,
    explicit: bool,
    *,
    default: Callable[[str], bool] = isolated_by_default,
    kernels: Sequence[str] = (),
) -> bool | Callable[[str], bool]:
    """Which kernels run in a worker: every one when a limit was given explicitly (``explicit``
    with ``timeout`` not None: a call in the audit's own process cannot be stopped), else
    ``isolate`` (``--isolate`` / ``--no-isolate``) when given, else ``default`` per kernel.
    ValueError for ``--no-isolate`` with an explicit limit, or beside an ``fa4@DIR`` among
    ``kernels`` (its release is imported in a worker only)."""
    if isolate is False and (pinned := [k for k in kernels if release_dir(k) is not None]):
        raise ValueError(
            f"--no-isolate runs the kernels in this process, and {', '.join(pinned)} runs only in a worker process "
            "(it imports flash_attn from its directory, which the audit's own process must not): drop --no-isolate"
        )
    if explicit and timeout is not None:
        if isolate is False:
            raise ValueError(
                f"--timeout {timeout:g} stops a kernel call by killing its worker process, and --no-isolate runs "
                "the kernel in this process: drop --no-isolate, or pass --timeout 0 (no limit)"
            )
        return True
    return isolate if isolate is not None else default


def to_device(x, device):
    """Tensors inside tuples, lists and dicts moved to ``device``; anything else as it is."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(t, device) for t in x)
    if isinstance(x, dict):
        return {n: to_device(t, device) for n, t in x.items()}
    return x


def _entry_of(kernel: str, entry: str | None) -> Callable:
    """The kernel's callable for ``entry``: None the fixed-length one, "varlen" its varlen
    entry, "per-sequence" the fixed-length one once per sequence."""
    if entry == "varlen":
        return get_varlen_kernel(kernel)
    return per_sequence(get_kernel(kernel)) if entry == "per-sequence" else get_kernel(kernel)


def _exception_reply(exc: BaseException) -> tuple:
    """("raise", the exception or None, its description): the exception itself only when it
    survives a pickle round trip (so that ``NotImplementedError`` and ``torch.OutOfMemoryError``
    stay themselves in the parent); its description always (the traceback is the worker's)."""
    try:
        msg = str(exc)
    except Exception as e:  # a broken __str__ must not kill the worker either
        msg = f"<str() of the exception raised {type(e).__name__}>"
    info = {
        "name": type(exc).__name__,
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": msg,
        "traceback": "".join(traceback.format_exception(exc)),
        "kind": error_kind(exc),
    }
    try:
        pickle.loads(pickle.dumps(exc))
        return ("raise", exc, info)
    except Exception:
        return ("raise", None, info)


def _reply(conn, reply: tuple) -> None:
    """Send ``reply``; if it cannot be sent (an unpicklable result or exception), its
    description instead: the worker never dies of what the kernel returned or raised."""
    try:
        conn.send(reply)
    except (BrokenPipeError, ConnectionError):
        raise
    except Exception as exc:
        if reply[0] != "raise":
            reply = _exception_reply(TypeError(f"the kernel's result could not be sent back from its worker: {exc}"))
        conn.send(("raise", None, reply[2]))


def serve(conn, kernel: str) -> None:  # pragma: no cover - runs in the child process
    """The worker: its own process group (so that a kill reaches whatever the kernel started),
    the kernel loaded, then ("ready", pid, process group), then kernel calls on inputs sent over
    ``conn`` until None arrives.  Replies ("ok", result) or ("raise", exception or None, its
    description)."""
    try:
        os.setsid()
    except OSError:
        pass
    enter_worker_process()  # an fa4@DIR kernel imports its release here, never in the audit's process
    fns = {}
    try:  # the kernel's module imported here, under the startup limit, not the first call's
        fns[None] = _entry_of(kernel, None)
    except Exception:
        pass  # the first call resolves it again, and its error is that call's
    conn.send(("ready", os.getpid(), os.getpgid(0)))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, ConnectionError):
            return
        if msg is None:
            return
        (q, k, v, kw), device, bwd, entry = msg
        fill = kw.pop(POISON_KW, None)  # a poisoned run (audits.engine.poison): the poisoning happens here
        try:
            if entry not in fns:
                fns[entry] = _entry_of(kernel, entry)
            fn = fns[entry]
            dev = torch.device(device)
            q, k, v, kw = to_device((q, k, v, kw), dev)
            with poisoned(fill, device=dev):
                if bwd is not None:  # the backward half: the caller's grad_call here, tensors sent back on the CPU
                    do, opts, grad_call = bwd  # (a function pickles by name: imported here when it arrives)
                    res = grad_call(fn, {"q": q, "k": k, "v": v, "kw": kw}, do.to(dev), opts)
                else:
                    res = fn(q, k, v, return_lse=True, **kw)
            reply = ("ok", to_device(res, "cpu"))
        except Exception as exc:  # sent back and raised in the parent; this worker goes on
            reply = _exception_reply(exc)
        _reply(conn, reply)


def death_reason(code: int | None) -> str:
    """Why a worker process ended, from its exit code (negative: the signal that killed it)."""
    if code == -signal.SIGKILL:
        return (
            "the kernel's worker process was killed (SIGKILL, exit code -9) on this case: most likely by "
            "the host's out-of-memory killer (see dmesg)"
        )
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the kernel's worker process died of {name} (exit code {code}) on this case"
    return f"the kernel's worker process died (exit code {code}) on this case"


class _Proc:
    """One spawned worker: its process and the parent's end of its pipe."""

    def __init__(self, ctx, kernel: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, kernel), daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.proc.pid
        self.ready = self.own_group = False

    def wait_ready(self, limit: float | None) -> None:
        """Wait for the worker's "ready" (None: as long as it takes); WorkerCrashed if it dies
        or (a limit) does not start in time."""
        if self.ready:
            return
        try:
            if not self.conn.poll(limit):
                self.kill()
                raise WorkerCrashed(f"the kernel's worker process did not start within {limit:g} s")
            _, pid, pgid = self.conn.recv()
        except (EOFError, ConnectionError, BrokenPipeError):
            raise WorkerCrashed(death_reason(self.reap())) from None
        self.ready, self.own_group = True, pid == pgid

    def kill(self) -> int | None:
        """SIGKILL to the worker's process group (its own, made by :func:`serve`: whatever the
        kernel started dies too; only the worker itself when it has none), then reap it; its
        exit code."""
        if self.own_group:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc.is_alive():
            self.proc.kill()
        return self.reap()

    def reap(self) -> int | None:
        self.proc.join(timeout=5)
        try:
            self.conn.close()
        except OSError:
            pass
        return self.proc.exitcode

    def close(self) -> None:
        """Ask the worker to end; kill it (and its group) if it has not within 10 s."""
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, ConnectionError, OSError):
                pass
            self.proc.join(timeout=10)
        self.kill()


class Isolated:
    """A kernel run in a worker process, called as the kernel is (``iso(q, k, v, **kw)``), with
    ``timeout`` seconds per call (None: no limit).  A kernel that kills its process costs one
    case (:class:`WorkerCrashed`), one that passes the limit too (:class:`KernelTimeout`), and a
    fresh worker takes the next case; an exception the kernel raises leaves the worker running.
    Only the kernel call crosses the process boundary; references and verdicts stay in the
    parent (and its caches)."""

    #: a poisoned run (``audits.engine.poison``) poisons the worker's memory: the fill goes with the call
    poisons_in_worker = True

    def __init__(self, kernel: str, device: torch.device | str, *, timeout: float | None = None):
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout {timeout!r}: expected seconds > 0, or None for no limit")
        self.ctx = mp.get_context("spawn")
        self.kernel, self.device, self.timeout = kernel, str(device), timeout
        self.current: _Proc | None = None
        self.spare: _Proc | None = None
        self.deaths = 0

    @property
    def pid(self) -> int | None:
        """The current worker's process id (None before the first call or after a death)."""
        return None if self.current is None else self.current.pid

    def _worker(self) -> _Proc:
        if self.current is None or not self.current.proc.is_alive():
            if self.current is not None:  # it died between calls
                self.current.reap()
            self.current, self.spare = self.spare or _Proc(self.ctx, self.kernel), None
            if self.deaths:  # this kernel has killed or hung a worker: keep the next one warming up
                self.spare = _Proc(self.ctx, self.kernel)
        try:
            self.current.wait_ready(None if self.timeout is None else max(self.timeout, STARTUP_LIMIT_S))
        except WorkerCrashed:
            self._lost()
            raise
        return self.current

    def _lost(self) -> None:
        """The current worker is gone (died, or killed past the limit): the next call takes the
        spare or a fresh one, and from now on a spare is kept warming up."""
        self.current, self.deaths = None, self.deaths + 1

    def _ask(self, q, k, v, kw, bwd, entry=None):
        w = self._worker()
        try:
            w.conn.send(
                (
                    (to_device(q, "cpu"), to_device(k, "cpu"), to_device(v, "cpu"), to_device(kw, "cpu")),
                    self.device,
                    bwd,
                    entry,
                )
            )
            if not w.conn.poll(self.timeout):
                w.kill()
                self._lost()
                what = "forward" if bwd is None else "backward"
                raise KernelTimeout(
                    f"the kernel's {what} call did not return within {self.timeout:g} s (--timeout); its worker "
                    "process was killed and a fresh one takes the next case"
                )
            reply = w.conn.recv()
        except (EOFError, ConnectionError, BrokenPipeError):
            code = w.reap()  # its own exit code, before the kill below could set one
            w.kill()  # whatever it started goes with it
            self._lost()
            raise WorkerCrashed(death_reason(code)) from None
        if reply[0] == "raise":
            _, exc, info = reply
            if exc is None:
                exc = (RemoteRefusal if info["kind"] == "refusal" else RemoteError)(info)
            else:
                exc.worker_traceback = info["traceback"]
            raise exc
        return to_device(reply[1], q.device)

    def __call__(self, q, k, v, *, return_lse=True, **kw):
        return self._ask(q, k, v, kw, None)

    def entry(self, name: str | None) -> Callable:
        """A callable for the kernel's entry ``name`` run in the worker: None the fixed-length
        one, "varlen" its varlen entry, "per-sequence" the fixed-length one per sequence."""

        def call(q, k, v, *, return_lse=True, **kw):
            return self._ask(q, k, v, kw, None, name)

        call.poisons_in_worker = True  # as the forward call: audits.engine.poison's fill goes with the call
        return call

    def varlen_entry(self, per_seq: bool) -> tuple[Callable | None, str | None]:
        """``audits.engine.evaluate``'s varlen entry in the worker: the kernel's varlen entry,
        else (``per_seq``) the fixed-length kernel once per sequence, else (None, None)."""
        entry = "varlen" if get_varlen_kernel(self.kernel) is not None else "per-sequence" if per_seq else None
        if entry is None:
            return None, None
        return self.entry(entry), entry

    def grad(self, x: dict, do: torch.Tensor, opts, *, fill: str | None = None) -> tuple[dict, tuple | None]:
        """The backward half in the worker (``audits.engine.backward.grad_call``, which returns a
        status and never raises); a crash or a timeout there is the case's backward status.
        ``fill``: fresh memory poisoned in the worker meanwhile (``audits.engine.poison``)."""
        kw = x["kw"] if fill is None else {**x["kw"], POISON_KW: fill}
        try:
            return self._ask(x["q"], x["k"], x["v"], kw, (do.cpu(), opts, grad_call))
        except WorkerCrashed as exc:
            return {"status": "crash", "reason": str(exc)}, None
        except KernelTimeout as exc:
            return {"status": "timeout", "reason": str(exc)}, None

    def kill(self) -> None:
        """End the workers now, mid-call or not (Ctrl-C: the run stops and waits for no call)."""
        for w in (self.current, self.spare):
            if w is not None:
                w.kill()
        self.current = self.spare = None

    def close(self) -> None:
        """End the workers (the current one and the spare)."""
        for w in (self.current, self.spare):
            if w is not None:
                w.close()
        self.current = self.spare = None


@runtime_checkable
class KernelCalls(Protocol):
    """What the engine calls a kernel through, wherever it runs (:class:`InProcess`, :class:`Isolated`):
    the forward call, the backward half (``audits.engine.backward.grad_call``'s status and result),
    the entry for varlen cases, and the end of the kernel's process (nothing for one in this process)."""

    def __call__(self, q, k, v, *, return_lse=True, **kw): ...

    def grad(self, x: dict, do: torch.Tensor, opts, *, fill: str | None = None) -> tuple[dict, tuple | None]: ...

    def varlen_entry(self, per_seq: bool) -> tuple[Callable | None, str | None]: ...

    def kill(self) -> None: ...

    def close(self) -> None: ...


class InProcess:
    """A kernel called in the audit's own process, through :class:`KernelCalls`."""

    def __init__(self, kernel: str, fn: Callable):
        self.kernel, self.fn = kernel, fn

    def __call__(self, q, k, v, *, return_lse=True, **kw):
        return self.fn(q, k, v, return_lse=return_lse, **kw)

    def grad(self, x: dict, do: torch.Tensor, opts, *, fill: str | None = None) -> tuple[dict, tuple | None]:
        with poisoned(fill, device=do.device):
            return grad_call(self.fn, x, do, opts)

    def varlen_entry(self, per_seq: bool) -> tuple[Callable | None, str | None]:
        """(the callable that runs a varlen case, "varlen" | "per-sequence"), or (None, None): the
        kernel's varlen entry (a built-in's, or the kernel itself when it declares the varlen
        contract), else with ``per_seq`` the fixed-length kernel once per sequence."""
        fn = self.fn
        entry = fn if getattr(fn, "fa4_audit_contract", None) == "varlen" else None
        if entry is None and self.kernel in VARLEN_KERNELS and KERNELS.get(self.kernel) is fn:
            entry = VARLEN_KERNELS[self.kernel]
        elif entry is None and base_kernel(self.kernel) in VARLEN_KERNELS and get_kernel(self.kernel) is fn:
            entry = get_varlen_kernel(self.kernel)  # a model variant's (one object per spec)
        if entry is not None:
            return entry, "varlen"
        return (per_sequence(fn), "per-sequence") if per_seq else (None, None)

    def kill(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_kernel(kernel: str, device: torch.device | str, *, isolated: bool, timeout: float | None) -> KernelCalls:
    """Kernel ``kernel`` in a worker process with ``timeout`` seconds per call (``isolated``), else
    in this process; :class:`UsageError` for ``fa4@DIR`` in this process (it runs only in a worker)."""
    if not isolated and release_dir(kernel) is not None:
        raise UsageError(
            f"kernel {kernel} runs only in a worker process (it imports flash_attn from its directory, which the "
            "audit's own process must not): drop --no-isolate (run), or give --timeout SECONDS"
        )
    return Isolated(kernel, device, timeout=timeout) if isolated else InProcess(kernel, get_kernel(kernel))


def as_calls(kernel: str, fn: Callable | KernelCalls) -> KernelCalls:
    """``fn`` as :class:`KernelCalls`: itself when it is one, else the plain callable called in this process."""
    return fn if isinstance(fn, KernelCalls) else InProcess(kernel, fn)
