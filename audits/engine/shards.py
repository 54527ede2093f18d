"""Which cases a process runs, and in what order.  :func:`shard_cases` is the deterministic slice I
of N (``run --shard I/N``, each ``--jobs`` child's share).  ``run --shard auto`` reads the shard
index and count from a batch scheduler's environment, so that one command line serves every task
of a Slurm job array or a Kubernetes Indexed Job:

- Slurm arrays: index ``SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN`` (divided by
  ``SLURM_ARRAY_TASK_STEP`` for ``--array=0-30:10``), count ``SLURM_ARRAY_TASK_COUNT`` or else
  ``(SLURM_ARRAY_TASK_MAX - SLURM_ARRAY_TASK_MIN) / step + 1``.
- Kubernetes Indexed Jobs: index ``JOB_COMPLETION_INDEX``, count ``--shards N`` or the
  environment variable ``FA4_AUDIT_SHARDS`` (the Job's ``completions``).

Hosts share nothing but report files: every host builds the same case list and the same
deterministic plan (:func:`shard_cases`) and runs its own slice of it.

Within a process the cases run in :func:`run_order`: stratified, so that any prefix of a run (a
time-boxed ``--budget`` run, a Ctrl-C) spans the suite's axes (:data:`STRATA`) instead of one
corner of it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping

import numpy as np

from audits.suites.case import Case

__all__ = [
    "shard_cases",
    "SLURM",
    "K8S_INDEX",
    "SHARDS_ENV",
    "ShardEnvError",
    "parse_shard",
    "shard_from_env",
    "STRATA",
    "run_order",
]

#: the Slurm array variables ``--shard auto`` reads
SLURM = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_COUNT")
#: a Kubernetes Indexed Job's index
K8S_INDEX = "JOB_COMPLETION_INDEX"
#: the shard count where the scheduler gives none (Kubernetes): ``--shards N`` or this variable
SHARDS_ENV = "FA4_AUDIT_SHARDS"


class ShardEnvError(ValueError):
    """No usable shard in the environment; the message names the variables and their values."""


def parse_shard(spec: str) -> tuple[int, int]:
    """``"I/N"`` as (I, N) with 0 <= I < N, else ``ValueError``."""
    i, n = (int(x) for x in spec.split("/"))
    if not 0 <= i < n:
        raise ValueError(f"shard {i}/{n}: need 0 <= I < N")
    return i, n


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ShardEnvError(f"{name}={raw!r} is not an integer") from None


def _slurm(env: Mapping[str, str]) -> tuple[int, int, str]:
    tid, lo, hi, count = (_int(env, v) for v in SLURM)
    step = _int(env, "SLURM_ARRAY_TASK_STEP") or 1
    if lo is None:
        raise ShardEnvError("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_MIN is not (is this a job array?)")
    if step < 1 or (tid - lo) % step:
        raise ShardEnvError(
            f"SLURM_ARRAY_TASK_ID={tid} is not on the array's grid (SLURM_ARRAY_TASK_MIN={lo}, "
            f"SLURM_ARRAY_TASK_STEP={step}): use a contiguous --array=0-N or --array=A-B:STEP"
        )
    by_range = None if hi is None else (hi - lo) // step + 1
    if count is None and by_range is None:
        raise ShardEnvError("SLURM_ARRAY_TASK_ID is set but neither SLURM_ARRAY_TASK_COUNT nor SLURM_ARRAY_TASK_MAX")
    if count is not None and by_range is not None and count != by_range:
        raise ShardEnvError(
            f"SLURM_ARRAY_TASK_COUNT={count} but SLURM_ARRAY_TASK_MIN..MAX={lo}..{hi} (step {step}) spans "
            f"{by_range} tasks: an array with gaps (--array=1,3,7) cannot be sharded; use --array=0-{count - 1}"
        )
    n = count if count is not None else by_range
    shown = ", ".join(f"{v}={env[v]}" for v in SLURM if env.get(v, "").strip())
    return (tid - lo) // step, n, f"Slurm array ({shown})"


def _k8s(env: Mapping[str, str], shards: int | None) -> tuple[int, int, str]:
    index, from_env = _int(env, K8S_INDEX), _int(env, SHARDS_ENV)
    if shards is not None and from_env is not None and shards != from_env:
        raise ShardEnvError(f"--shards {shards} but {SHARDS_ENV}={from_env}: give the count once")
    n = shards if shards is not None else from_env
    if n is None:
        raise ShardEnvError(
            f"{K8S_INDEX}={index} gives the index but not the count: pass --shards N or set {SHARDS_ENV}=N "
            "(the Job's completions)"
        )
    how = f"--shards {n}" if shards is not None else f"{SHARDS_ENV}={n}"
    return index, n, f"Kubernetes Indexed Job ({K8S_INDEX}={index}, {how})"


def shard_from_env(env: Mapping[str, str] | None = None, *, shards: int | None = None) -> tuple[int, int, str]:
    """(index, count, where they came from) for ``--shard auto``: a Slurm array task, else a
    Kubernetes Indexed Job's pod; :class:`ShardEnvError` naming the variables when neither is
    set, both are, or the values are not integers or put the index outside the count."""
    env = os.environ if env is None else env
    slurm, k8s = bool(env.get(SLURM[0], "").strip()), bool(env.get(K8S_INDEX, "").strip())
    if slurm and k8s:
        raise ShardEnvError(f"both {SLURM[0]} and {K8S_INDEX} are set: cannot tell which scheduler runs this task")
    if not slurm and not k8s:
        raise ShardEnvError(
            f"no shard in the environment: a Slurm array task sets {SLURM[0]} with SLURM_ARRAY_TASK_MIN and "
            f"SLURM_ARRAY_TASK_COUNT (or SLURM_ARRAY_TASK_MAX); a Kubernetes Indexed Job sets {K8S_INDEX}, with the "
            f"count from --shards N or {SHARDS_ENV}; elsewhere pass --shard I/N"
        )
    if slurm and shards is not None:
        # the array gives the count; --shards must agree with it
        i, n, src = _slurm(env)
        if n != shards:
            raise ShardEnvError(f"--shards {shards} but the {src} has {n} tasks")
    else:
        i, n, src = _slurm(env) if slurm else _k8s(env, shards)
    if n < 1:
        raise ShardEnvError(f"{src}: shard count {n}: need at least 1")
    if not 0 <= i < n:
        raise ShardEnvError(f"{src}: shard index {i} is outside 0..{n - 1}")
    return i, n, src


def _mask(c) -> str:
    return "causal" if c.causal else "local" if c.local else "none"


def _heads(c) -> str:
    return "MHA" if c.heads_q == c.heads_kv else "MQA" if c.heads_kv == 1 else "GQA"


def _lengths(c) -> str:
    """seqlen_q against seqlen_k (FA's bottom-right causal alignment differs between them)."""
    return "q<k" if c.seqlen_q < c.seqlen_k else "q=k" if c.seqlen_q == c.seqlen_k else "q>k"


def _size(c) -> str:
    """The longest side's size class (one tile, a few tiles, many tiles, long)."""
    n = max(c.seqlen_q, c.seqlen_k)
    return "<=256" if n <= 256 else "<=1024" if n <= 1024 else "<=4096" if n <= 4096 else ">4096"


def _entry(c) -> str:
    if not c.varlen:
        return "fixed"
    return "varlen" + ("-paged" if c.page_size else "") + ("-split" if c.num_splits > 1 else "")


#: the axes a run's every prefix should span: name -> the case's value on it
STRATA: dict[str, Callable] = {
    "dtype": lambda c: c.dtype,
    "head_dims": lambda c: (c.d, c.dv),
    "mask": _mask,
    "softcap": lambda c: c.softcap > 0,
    "sink": lambda c: c.sink,
    "heads": _heads,
    "layout": lambda c: c.layout,
    "family": lambda c: c.family,
    "lengths": _lengths,
    "size": _size,
    "entry": _entry,
}


def run_order(cases: list) -> list[int]:
    """The order (indices into ``cases``) in which a process runs its cases: stratified over
    :data:`STRATA`, deterministic (no hash seed, no process state), the same on every host.

    First a greedy cover: each next case is the one bringing the most axis values not yet run,
    until every value of every axis that ``cases`` hold has run once (for ``release`` that takes
    fewer cases than its largest axis has values plus a few; ``tests/test_run_stop.py``).  Then
    a proportional sample: each next case is the one whose values are furthest behind their
    share of the whole list (value v of an axis holding n_v of N cases is due k * n_v / N times
    in the first k cases), so that a longer prefix is a stratified sample of the suite, not one
    configuration group after another.  Ties go to a fixed digest of the case name.

    Interleaving configurations costs no compiles: JIT kernels are cached per compile key in the
    process, and each ``--jobs`` process still holds whole compile keys (``shard_cases``
    ``by="key"``); only the compiles move to the front of the run."""
    n = len(cases)
    if n <= 1:
        return list(range(n))
    # cases with one value on every axis score alike: one row per such group ("signature"), its
    # cases queued in a fixed pseudo-random order (a digest of the name), which breaks ties
    sigs: dict[tuple, list[int]] = {}
    for i in sorted(range(n), key=lambda i: (hashlib.sha256(cases[i].name.encode()).hexdigest(), i)):
        sigs.setdefault(tuple(get(cases[i]) for get in STRATA.values()), []).append(i)
    queues = list(sigs.values())
    cols, shares = [], []
    for a in range(len(STRATA)):
        index = {v: j for j, v in enumerate(dict.fromkeys(sig[a] for sig in sigs))}
        col = np.array([index[sig[a]] for sig in sigs])
        cols.append(col)
        shares.append(np.bincount(col, weights=[len(q) for q in queues], minlength=len(index)) / n)
    seen = [np.zeros(len(sh)) for sh in shares]
    left = np.array([len(q) for q in queues])
    head = [0] * len(queues)
    order = []
    covering = True
    for k in range(n):
        if covering:  # values not yet run, per group; ties by how far behind their share
            gain = sum((s[c] == 0).astype(float) for s, c in zip(seen, cols))
            covering = bool((gain[left > 0] > 0).any())
        due = sum(sh[c] * (k + 1) - s[c] for sh, s, c in zip(shares, seen, cols))
        score = (gain * (len(cols) * 2.0 + 2.0) + due) if covering else due
        j = int(np.argmax(np.where(left > 0, score, -np.inf)))
        left[j] -= 1
        for s, c in zip(seen, cols):
            s[c[j]] += 1
        order.append(queues[j][head[j]])
        head[j] += 1
    return order


def shard_cases(cases: list[Case], index: int, count: int, *, by: str = "cost") -> list[Case]:
    """Deterministic slice ``index`` of ``count``, back in suite order.  ``by="cost"``: greedy
    balancing of ``Case.cost`` (largest first onto the lightest shard).  ``by="key"``: whole
    compile-key groups per shard (each JIT variant compiled by one process only), balanced by
    group size plus cost, for parallel processes that each compile their own share."""
    if not (0 <= index < count):
        raise ValueError(f"shard {index}/{count}: need 0 <= I < N")
    if by not in ("cost", "key"):
        raise ValueError(f"shard by {by!r}: accepted 'cost' or 'key'")
    if by == "cost":
        units = {i: [i] for i in range(len(cases))}
    else:
        units = {}
        for i, c in enumerate(cases):
            units.setdefault(c.compile_key, []).append(i)
    total = sum(c.cost for c in cases) or 1
    weight = {
        u: sum(cases[i].cost for i in m) / total + (len(m) / len(cases) if by == "key" else 0.0)
        for u, m in units.items()
    }
    loads = [0.0] * count
    owner = {}
    for u in sorted(units, key=lambda u: (-weight[u], repr(u))):
        s = min(range(count), key=lambda j: (loads[j], j))
        loads[s] += weight[u]
        for i in units[u]:
            owner[i] = s
    return [c for i, c in enumerate(cases) if owner[i] == index]
