"""What a kernel call's failure means, in the words of a case's verdict: memory exhaustion named as
such, an exception from a worker process (``audits.engine.worker``) read as the original one."""

from __future__ import annotations

import traceback

import torch

__all__ = ["RemoteError", "RemoteRefusal", "error_kind", "failure_reason", "traceback_of"]


class RemoteError(Exception):
    """An exception the kernel raised in the worker that could not be sent back as itself (it
    does not pickle): its type's name, message and formatted traceback, as the worker saw them."""

    def __init__(self, info: dict):
        super().__init__(info["message"])
        self.type_name, self.qualified_type = info["name"], info["type"]
        self.message, self.worker_traceback, self.kind = info["message"], info["traceback"], info["kind"]

    def __reduce__(self):
        return (type(self), (self._info(),))

    def _info(self) -> dict:
        return {
            "name": self.type_name,
            "type": self.qualified_type,
            "message": self.message,
            "traceback": self.worker_traceback,
            "kind": self.kind,
        }


class RemoteRefusal(RemoteError, NotImplementedError):
    """A :class:`RemoteError` whose exception was a ``NotImplementedError`` (a refusal)."""


def error_kind(exc: BaseException) -> str | None:
    """What a kernel's exception means beyond its message: "gpu-oom", "host-oom", "refusal"."""
    if isinstance(exc, RemoteError):
        return exc.kind
    if isinstance(exc, torch.OutOfMemoryError):  # torch.cuda.OutOfMemoryError is the same class
        return "gpu-oom"
    if isinstance(exc, MemoryError):
        return "host-oom"
    return "refusal" if isinstance(exc, NotImplementedError) else None


def failure_reason(exc: BaseException, what: str = "kernel") -> tuple[str, str]:
    """(cause, reason) of an exception a kernel call raised: cause "out-of-memory" with a reason
    that says so for ``torch.OutOfMemoryError`` (also ``torch.cuda.OutOfMemoryError``) and
    ``MemoryError``, else "exception" with "``what`` raised Type: message"; an exception that
    came back from a worker as a :class:`RemoteError` reads as the original type."""
    name = exc.type_name if isinstance(exc, RemoteError) else type(exc).__name__
    msg = str(exc)
    kind = error_kind(exc)
    if kind == "gpu-oom":
        first = msg.strip().splitlines()[0] if msg.strip() else ""
        return "out-of-memory", f"{what} ran out of GPU memory ({name}): {first}"
    if kind == "host-oom":
        return "out-of-memory", f"{what} ran out of host memory ({name}): {msg or 'no message'}"
    return "exception", f"{what} raised {name}: {msg}"


def traceback_of(exc: BaseException, limit: int = 3) -> str:
    """The formatted traceback of ``exc``: the worker's, for an exception raised there (the
    parent's frames say only that the pipe delivered it)."""
    return getattr(exc, "worker_traceback", None) or "".join(traceback.format_exception(exc, limit=limit))
