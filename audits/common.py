"""Plumbing every audit shares: exit codes, the usage error, the run environment, the device,
atomic file writes, reading (compressed) JSON and the progress bar.  Nothing here knows an audit.

Exit codes (the CLI contract): 0 every check passed; 1 a check failed (a bound violated, a bit
mismatch with production, nothing evaluated); 2 a usage or environment error (bad arguments,
CUDA or the production package missing where required, a malformed input file), with a message
naming what was wrong and what is accepted; 3 incomplete: a run stopped by its ``--budget`` (or a
partial report read back) with nothing failed among the cases it ran, so not a pass; 130 a run
stopped by Ctrl-C with nothing failed (the shell's convention for SIGINT).  A partial run with a
failure exits 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

__all__ = [
    "read_toml",
    "EXIT_OK",
    "EXIT_FAIL",
    "EXIT_USAGE",
    "EXIT_INCOMPLETE",
    "EXIT_INTERRUPTED",
    "UsageError",
    "PtxFormatError",
    "environment",
    "device",
    "atomic_write",
    "read_bytes",
    "read_json",
    "progress",
    "LineProgress",
]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
EXIT_INCOMPLETE, EXIT_INTERRUPTED = 3, 130


class PtxFormatError(ValueError):
    """A PTX text is not what an extractor understands (no kernel, no float instruction): the
    extractor must be updated, never trusted (exit 2)."""


class UsageError(Exception):
    """A problem with the command line, an input file or the environment: exit 2 with this message."""


def environment(device: torch.device) -> dict:
    import numba  # a dependency (the compiled CPU loops), imported here only to report its version

    env = {"python": platform.python_version(), "torch": torch.__version__, "numba": numba.__version__}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["compute_capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability(device))
        try:
            from importlib.metadata import version

            env["flash-attn-4"] = version("flash-attn-4")
            env["nvidia-cutlass-dsl"] = version("nvidia-cutlass-dsl")
        except Exception:  # metadata absent when staged without dist-info
            pass
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
        env.update(cpu_numerics())
    return env


#: the x86 feature flags (/proc/cpuinfo) that choose a CPU kernel's arithmetic: bf16/fp16 dot-product
#: and tile instructions, which PyTorch's and oneDNN's kernels use where present, treat subnormal
#: inputs as zero where the float32 path keeps them (PyTorch's CPU flash SDPA flushed subnormals on
#: the machines of earlier sessions and not on an AMD EPYC with avx512_bf16 and no AMX, 2026-12-04:
#: docs/peers.md, "SDPA on the CPU")
CPU_NUMERIC_FLAGS = ("avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile")


def cpu_numerics() -> dict:
    """What of this CPU decides a CPU kernel's arithmetic, for a report's environment: its model
    (``cpu_model``, /proc/cpuinfo's "model name"), the vector ISA torch dispatches to
    (``cpu_capability``) and which of :data:`CPU_NUMERIC_FLAGS` it has (``cpu_flags``).  A known
    CPU defect reproduces on some CPUs and not others; the report says on which it ran."""
    out = {"cpu_capability": torch.backends.cpu.get_cpu_capability()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the model and flags are not read
        return out
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), None)
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    if model:
        out["cpu_model"] = model
    out["cpu_flags"] = [f for f in CPU_NUMERIC_FLAGS if f in flags]
    return out


def device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError(
            "--device cuda was requested but torch sees no CUDA device "
            f"(torch {torch.__version__}); run on a GPU machine or use --device cpu"
        )
    return torch.device("cuda")


def atomic_write(path: str | Path, text: str | bytes) -> None:
    """Write ``text`` (str, or bytes: an image) to ``path`` through a temporary file and a rename:
    a crash leaves either the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_bytes(path: str | Path) -> bytes:
    """The contents of ``path``, ``.gz`` and ``.xz`` decompressed (committed reports are kept
    compressed).  Raises what reading or decompressing raises (OSError, EOFError, LZMAError)."""
    raw = Path(path).read_bytes()
    if str(path).endswith(".gz"):
        import gzip

        return gzip.decompress(raw)
    if str(path).endswith(".xz"):
        import lzma

        return lzma.decompress(raw)
    return raw


def read_json(path: str | Path, *, what: str = "file"):
    """A JSON document from ``path`` (:func:`read_bytes`); :class:`UsageError` naming the file
    when it is missing or not JSON."""
    path = str(path)
    try:
        return json.loads(read_bytes(path))
    except FileNotFoundError as exc:
        raise UsageError(f"{path}: no such {what}") from exc
    except (OSError, EOFError, ValueError) as exc:  # JSONDecodeError, gzip/lzma errors, undecodable bytes
        raise UsageError(f"{path}: not a readable JSON {what} ({type(exc).__name__}: {exc})") from exc


def read_toml(path: str | Path, *, what: str, error: type[Exception]) -> dict:
    """A TOML document from ``path``; ``error`` (the caller's exception class) naming the file
    when it is missing or not TOML (with TOML's line and column)."""
    import tomllib

    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError as exc:
        raise error(f"{p}: no such {what} file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{p}: not valid TOML: {exc}") from exc


def progress(console, *, quiet: bool, every: float = 30.0):
    """The progress every audit shows on stderr: on a terminal a rich bar (description, bar,
    done/total, elapsed); otherwise (CI logs, ``2> log``, ``nohup``) :class:`LineProgress`, a
    line every ``every`` seconds and at each tenth of the work, so that a long run is never
    silent; nothing with ``--quiet``.  Both take ``update(task, ..., failing=N)``: failures so far."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not quiet and not console.is_terminal:
        return LineProgress(console.file, every=every)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
    )


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class LineProgress:
    """Progress as plain lines (the subset of ``rich.progress.Progress`` the audits use:
    ``add_task``, ``advance``, ``update``, a context manager): "DESCRIPTION: done/total (p%),
    N failing, elapsed E, ETA T", written when a task crosses a tenth of its total, when
    ``every`` seconds passed since its last line, and when it completes."""

    def __init__(self, file, *, every: float = 30.0):
        import sys
        import time

        self.file, self.every, self.clock = file or sys.stderr, every, time.monotonic
        self.tasks: dict[int, dict] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, *, total: float | None = None, **fields) -> int:
        now = self.clock()
        t = {"description": description, "total": total, "completed": 0, "start": now, "last": now, "tenth": 0}
        t.update(fields)
        self.tasks[len(self.tasks)] = t
        return len(self.tasks) - 1

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, advance=advance)

    def update(self, task: int, *, completed=None, advance=None, total=None, description=None, **fields) -> None:
        t = self.tasks[task]
        t["completed"] = completed if completed is not None else t["completed"] + (advance or 0)
        t["total"] = total if total is not None else t["total"]
        t["description"] = description or t["description"]
        t.update({k: v for k, v in fields.items() if k != "refresh"})
        now, done, total = self.clock(), t["completed"], t["total"]
        tenth = int(10 * done / total) if total else 0
        if tenth > t["tenth"] or now - t["last"] >= self.every:
            t["tenth"], t["last"] = max(tenth, t["tenth"]), now
            self.file.write(self.line(t, now) + "\n")
            self.file.flush()

    def line(self, t: dict, now: float) -> str:
        done, total, spent = t["completed"], t["total"], now - t["start"]
        parts = [f"{t['description']}: {done:g}/{total:g}" + (f" ({100 * done / total:.0f}%)" if total else "")]
        if t.get("failing") is not None:
            parts.append(f"{t['failing']} failing")
        parts.append(f"elapsed {_duration(spent)}")
        if total and 0 < done < total:
            parts.append(f"ETA {_duration(spent / done * (total - done))}")
        return ", ".join(parts)


def print_table(console, title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A results table on stdout that shortens no cell: on a terminal a rich table whose cells
    wrap (fold) instead of ending in an ellipsis; otherwise (a pipe, a file, CI) plain text,
    one aligned line per row, at whatever width the cells need."""
    from rich.table import Table

    if not console.is_terminal:
        widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows)]
        print(title)
        for line in (columns, *rows):
            print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)).rstrip())
        return
    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="right", overflow="fold")
    for r in rows:
        t.add_row(*map(str, r))
    console.print(t, crop=False)


def gpu_list(spec: str | None) -> list[str]:
    """The GPUs parallel jobs are spread over: ``--gpus 0,1,...`` when given (ids as
    ``CUDA_VISIBLE_DEVICES`` takes them), else those this process sees (the entries of its own
    ``CUDA_VISIBLE_DEVICES``, or 0..count-1); empty without CUDA.  ``UsageError`` for a
    malformed ``--gpus``."""
    import os

    if spec is not None:
        ids = [x.strip() for x in spec.split(",")]
        if not ids or not all(x.isdigit() for x in ids) or len(set(ids)) != len(ids):
            raise UsageError(f"--gpus {spec!r}: expected distinct GPU indices separated by commas, e.g. 0,1")
        return ids
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if seen is not None:
        return [x.strip() for x in seen.split(",") if x.strip()]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def pinned_env(env: dict, gpus: list[str], job: int) -> dict:
    """``env`` with job ``job`` pinned to GPU ``gpus[job % len(gpus)]`` (unchanged without GPUs)."""
    return {**env, "CUDA_VISIBLE_DEVICES": gpus[job % len(gpus)]} if gpus else dict(env)


@contextlib.contextmanager
def finishing(what: str):
    """Run the block with a first Ctrl-C deferred: it is noted on stderr and the block goes on,
    so that a report whose cases all finished is written whole (a ``--jobs`` job interrupted
    once by its parent while it writes its report would otherwise leave none, and the parent
    would report its finished cases as not run).  A second Ctrl-C raises ``KeyboardInterrupt``
    as usual.  Outside the main thread (where Python delivers signals) the block runs unchanged.
    Yields a dict whose ``"interrupted"`` says whether a Ctrl-C was deferred."""
    import signal
    import sys
    import threading

    state = {"interrupted": False}
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    def defer(signum, frame):
        if state["interrupted"]:
            raise KeyboardInterrupt
        state["interrupted"] = True
        print(f"Ctrl-C: finishing {what} first (Ctrl-C again abandons it)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, defer)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous)
