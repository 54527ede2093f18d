"""Everything a run needs besides its kernels and cases, in one value: what ``fa4-audit run``'s flags,
the pytest fixture and ``audits.api.audit`` set, what the engine reads, and what a ``--jobs`` child
receives as JSON (``to_json`` / ``from_json``), never as command-line text."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from audits.engine.backward import BackwardOptions
from audits.engine.worker import DEFAULT_TIMEOUT_S, isolation
from audits.report.maps import DEFAULT_MAPS
from audits.verdict.gate import load_thresholds
from audits.verdict.known import KnownFile

__all__ = ["RunOptions"]


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """The options of one run (``fa4-audit run``'s flags of the same names).

    ``device``: "cpu" or "cuda" (a ``torch.device`` is kept as its text); ``out``: the report
    directory; ``thresholds``: the loaded policy (``audits.verdict.gate.load_thresholds``; default
    the shipped one); ``seed`` and ``label``: what the report and the journal record as the run's
    seed and suite; ``resume``: keep the finished cases of the journal in ``out``; ``exitfirst``:
    stop at the first failing case; ``isolate`` (None: per kernel, ``audits.engine.worker.
    isolation``), ``timeout`` (seconds per kernel call, None: no limit) and ``timeout_given``
    (the limit was asked for: every kernel then runs in a worker); ``backward``: audit the
    gradients too; ``per_sequence``: fixed-length kernels run varlen cases one sequence at a time;
    ``budget``: minutes after which no case starts; ``jobs``: processes (each a compile-key shard),
    pinned to ``gpus`` ("0,1"; None: all visible); ``quiet``: no progress; ``maps``: error maps
    rendered per report; ``shard``: "I/N" when this run is one slice of a sharded run; ``known``:
    the known defects (``audits.verdict.known.load_known``) applied to each kernel's report, and
    ``strict_known``: an entry no longer reproducing fails the run; ``baseline``: the kernel the
    others are compared with, bit for bit, case by case (``fa4-audit compare``: each other
    kernel's record gets ``compare``, ``audits.engine.compare``); ``poison``: re-run each failing
    case's kernel call with fresh memory poisoned (``audits.engine.poison``: NaN, then a pattern)
    to tell whether its result depends on memory the kernel never wrote; ``time_calls``: call
    the kernel a second time on each case and keep both calls' seconds (the first one's excess is
    compilation and first use: ``fa4-audit compare`` sums them per kernel) and whether the second
    result has the same bits."""

    device: str = "cpu"
    out: str = "reports/run-latest"
    thresholds: dict = field(default_factory=load_thresholds)
    seed: int = 0
    label: str = "cases"
    resume: bool = False
    exitfirst: bool = False
    isolate: bool | None = None
    timeout: float | None = DEFAULT_TIMEOUT_S
    timeout_given: bool = False
    backward: BackwardOptions | None = None
    per_sequence: bool = False
    budget: float | None = None
    jobs: int = 1
    gpus: str | None = None
    quiet: bool = False
    maps: int = DEFAULT_MAPS
    shard: str | None = None
    known: KnownFile | None = None
    strict_known: bool = False
    baseline: str | None = None
    poison: bool = True
    time_calls: bool = False

    def __post_init__(self):
        object.__setattr__(self, "device", str(self.device))
        object.__setattr__(self, "out", str(self.out))
        if isinstance(self.backward, dict):
            object.__setattr__(self, "backward", BackwardOptions(**self.backward))
        if isinstance(self.known, dict):  # as as_dict wrote it (a --jobs child's job file)
            object.__setattr__(self, "known", KnownFile.from_dict(self.known))

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def isolation(self, *, kernels: Sequence[str] = ()) -> bool | Callable[[str], bool]:
        """Which kernels run in a worker (``audits.engine.worker.isolation``): a bool, or a
        predicate on the kernel's name; ValueError for ``isolate=False`` with a limit asked for,
        or with an ``fa4@DIR`` among ``kernels``."""
        return isolation(self.isolate, self.timeout, self.timeout_given, kernels=kernels)

    def replace(self, **changes) -> RunOptions:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """The options as JSON-able values (the thresholds as a journal holds them: a TOML date as text)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["backward"] = None if self.backward is None else dataclasses.asdict(self.backward)
        d["known"] = None if self.known is None else self.known.as_dict()
        return json.loads(json.dumps(d, default=str))

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> RunOptions:
        """The options :meth:`as_dict` gave; an unknown field is a ValueError (another version wrote them)."""
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(d) - names):
            raise ValueError(f"run options: unknown field(s) {', '.join(unknown)}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> RunOptions:
        return cls.from_dict(json.loads(text))
