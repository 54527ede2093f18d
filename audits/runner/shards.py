"""``run --shard auto``: the shard index and count from a batch scheduler's environment, so that
one command line serves every task of a Slurm job array or a Kubernetes Indexed Job.

- Slurm arrays: index ``SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN`` (divided by
  ``SLURM_ARRAY_TASK_STEP`` for ``--array=0-30:10``), count ``SLURM_ARRAY_TASK_COUNT`` or else
  ``(SLURM_ARRAY_TASK_MAX - SLURM_ARRAY_TASK_MIN) / step + 1``.
- Kubernetes Indexed Jobs: index ``JOB_COMPLETION_INDEX``, count ``--shards N`` or the
  environment variable ``FA4_AUDIT_SHARDS`` (the Job's ``completions``).

Hosts share nothing but report files: every host builds the same case list and the same
deterministic plan (``audits.runner.engine.shard_cases``) and runs its own slice of it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["SLURM", "K8S_INDEX", "SHARDS_ENV", "ShardEnvError", "parse_shard", "shard_from_env"]

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
