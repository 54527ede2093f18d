"""Kernels that hang, busy-loop, die or raise what cannot cross a pipe, for the worker tests
(tests/test_worker.py): what ``audits.engine.worker`` must survive."""

import os
import signal
import subprocess
import sys
import time

import torch

from tests.bugged_kernels import exact


def sleeps_forever(q, k, v, **kw):
    """Never returns, blocked in C (the GIL released): a deadlocked GPU kernel's wait."""
    time.sleep(10**6)


def busy_loop(q, k, v, **kw):
    """Never returns, busy in Python (the GIL held)."""
    while True:
        pass


def hangs_when_causal(q, k, v, *, causal=False, **kw):
    """Exact, except that a causal call never returns (a hang on some cases only)."""
    if causal:
        time.sleep(10**6)
    return exact(q, k, v, causal=causal, **kw)


def hangs_in_a_child(q, k, v, **kw):
    """Starts a process of its own (a compiler, a server) and waits for it forever; the child's
    pid goes into the file named by FA4_TEST_PIDFILE, so that a test sees it killed too."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(10**6)"])
    with open(os.environ["FA4_TEST_PIDFILE"], "w") as fh:
        fh.write(str(child.pid))
    child.wait()


class CompiledKernelError(Exception):
    """Like torch inductor's InductorError: it holds a module, so it does not pickle."""

    def __init__(self, message):
        super().__init__(message)
        self.module = torch


def raises_unpicklable(q, k, v, **kw):
    raise CompiledKernelError("backend compiler failed: simulated lowering error for flex_attention")


class NeedsKeyword(Exception):
    """Pickles, but does not unpickle (its __init__ wants a keyword that pickle does not pass)."""

    def __init__(self, *, detail):
        super().__init__(f"needs a keyword: {detail}")


def raises_unrestorable(q, k, v, **kw):
    raise NeedsKeyword(detail="tile 128x128")


def raises_gpu_oom(q, k, v, **kw):
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.7 GiB\nmore detail"
    )


def raises_host_oom(q, k, v, **kw):
    raise MemoryError("simulated: cannot allocate 64 GiB")


def killed(q, k, v, **kw):
    """Dies as the host's out-of-memory killer ends a process: SIGKILL."""
    os.kill(os.getpid(), signal.SIGKILL)


def segfaults(q, k, v, **kw):
    os.kill(os.getpid(), signal.SIGSEGV)


def raises_on_seqlen_7(q, k, v, **kw):
    """Exact, except that a query length of 7 raises an exception that does not pickle."""
    if q.shape[1] == 7:
        raise CompiledKernelError("unpicklable on seqlen 7")
    return exact(q, k, v, **kw)


def spins_on_gpu(q, k, v, **kw):
    """Never returns: a GPU kernel that spins (``torch.cuda._sleep``, about 2^40 clock cycles,
    minutes on any GPU) and a host that waits for it, as a deadlocked CUDA kernel leaves both.
    Needs CUDA (benchmarks/device/h200_harness.sh)."""
    torch.cuda._sleep(2**40)
    torch.cuda.synchronize()


def exhausts_gpu_memory(q, k, v, **kw):
    """Asks the GPU for 4 TiB: a real ``torch.OutOfMemoryError`` from the caching allocator.
    Needs CUDA (benchmarks/device/h200_harness.sh)."""
    torch.empty(2**42, dtype=torch.uint8, device="cuda")
