"""Measure FA4's polynomial exp2 over float32 inputs: exhaustively (all 2**32) or by sample.

Inputs are enumerated by *class of input*, each a contiguous range of bit patterns (float32
order is integer order within one sign), so the sweep needs no masking:

==========  ==========================  ===================================================
class       inputs                      what production does there
==========  ==========================  ===================================================
normal      x in [-126, 127]            2**fl * p(f): the bounded domain (``ex2_error_bound``)
subnormal   x in (-127, -126)           exponent splice underflows: wrongly scaled subnormal
clamped     x <= -127, -inf             max(x, -127) -> 2**-127 spliced to 0.0
overflow    x in (127, FLT_MAX]         exponent field carries into the sign: garbage
inf         +inf                        NaN (inf - inf in the fraction)
nan         every NaN pattern           max() returns -127: 0.0
==========  ==========================  ===================================================

Relative error is (y - 2**x) / 2**x against ``torch.exp2`` in float64 (error < 2**-52, far below
anything measured here); ULP error follows ``numerics.fp.ulp_error`` (float32 spacing at the
exact value).  With a ``production`` callable, every input is also run through production and
compared bit for bit with the model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from fa4.ex2 import ex2_emulation, ex2_emulation_2
from numerics.fp import f32_bits, f32_from_bits, ulp_error

__all__ = ["CLASSES", "ULP_BIN_EDGES", "FRAC_BINS", "class_ranges", "planned_inputs", "sweep_ex2", "special_inputs"]

CLASSES = ("normal", "subnormal", "clamped", "overflow", "inf", "nan")
#: ULP histogram bin edges: [0, 0.5), [0.5, 1), [1, 2), [2, 4) ... [2**14, inf).
ULP_BIN_EDGES = (0.0, 0.5) + tuple(float(2**k) for k in range(15)) + (math.inf,)
FRAC_BINS = 128  # bins of the fractional part for the error envelope (the plot)


def _b(v: float) -> int:
    """uint32 bit pattern of a float32 value."""
    return int(torch.tensor([v], dtype=torch.float32).view(torch.int32).item()) & 0xFFFFFFFF


def class_ranges() -> dict[str, list[tuple[int, int]]]:
    """Half-open uint32 bit-pattern ranges [lo, hi) of each input class; together all 2**32."""
    return {
        "normal": [(0, _b(127.0) + 1), (0x80000000, _b(-126.0) + 1)],
        "subnormal": [(_b(-126.0) + 1, _b(-127.0))],
        "clamped": [(_b(-127.0), 0xFF800001)],
        "overflow": [(_b(127.0) + 1, 0x7F800000)],
        "inf": [(0x7F800000, 0x7F800001)],
        "nan": [(0x7F800001, 0x80000000), (0xFF800001, 0x100000000)],
    }


def _bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    """int64 tensor of uint32 patterns -> float32 (wrap to int32, then view)."""
    return f32_from_bits(bits.to(torch.int32))


@dataclass
class ClassStats:
    """Running statistics of one input class (float64 accumulators, on the sweep's device)."""

    count: int = 0
    max_rel: float = 0.0
    argmax_bits: int | None = None
    sum_rel: float = 0.0
    max_ulp: float = 0.0
    ulp_hist: list[int] = field(default_factory=lambda: [0] * (len(ULP_BIN_EDGES) - 1))
    results: dict[str, int] = field(default_factory=dict)  # result kind -> count (non-normal classes)

    def as_dict(self) -> dict:
        d = {"count": self.count, "results": self.results}
        if self.argmax_bits is not None:
            x = _bits_to_f32(torch.tensor([self.argmax_bits])).item()
            d.update(
                max_rel_error=self.max_rel,
                argmax_x=x,
                argmax_bits=f"0x{self.argmax_bits:08X}",
                mean_rel_error=self.sum_rel / max(self.count, 1),
                max_ulp_error=self.max_ulp,
            )
        if any(self.ulp_hist):
            d["ulp_histogram"] = {
                f"[{ULP_BIN_EDGES[i]:g}, {ULP_BIN_EDGES[i + 1]:g})": n for i, n in enumerate(self.ulp_hist) if n
            }
        return d


def _result_kinds(y: torch.Tensor) -> dict[str, int]:
    yb = f32_bits(y)
    kinds = {
        "+0.0": yb == 0,
        "-0.0": yb == -0x80000000,
        "nan": torch.isnan(y),
        "inf": torch.isinf(y),
        "subnormal": (y != 0) & (y.abs() < 2.0**-126),
    }
    out = {k: int(m.sum()) for k, m in kinds.items()}
    out["normal"] = y.numel() - sum(out.values())
    return {k: v for k, v in out.items() if v}


def planned_inputs(*, exhaustive: bool, sample: int) -> int:
    """How many inputs :func:`sweep_ex2` will evaluate (for progress bars)."""
    total = 0
    for ranges in class_ranges().values():
        size = sum(hi - lo for lo, hi in ranges)
        if exhaustive:
            total += size
        else:
            total += sum(min(hi - lo, max(1, round(sample * (hi - lo) / size))) for lo, hi in ranges)
    return total


def _chunks(ranges, chunk: int, exhaustive: bool, sample: int, gen: torch.Generator, device) -> Iterator[torch.Tensor]:
    """Yield int64 tensors of bit patterns: every pattern, or about ``sample`` random ones per
    class (split over the class's ranges in proportion to their sizes)."""
    if exhaustive:
        for lo, hi in ranges:
            for s in range(lo, hi, chunk):
                yield torch.arange(s, min(s + chunk, hi), dtype=torch.int64, device=device)
    else:
        sizes = [hi - lo for lo, hi in ranges]
        total = sum(sizes)
        for (lo, hi), size in zip(ranges, sizes):
            n = min(size, max(1, round(sample * size / total)))
            if n == size:
                yield torch.arange(lo, hi, dtype=torch.int64, device=device)
            else:
                r = torch.randint(0, size, (n,), generator=gen, dtype=torch.int64)
                yield (r + lo).to(device)


def special_inputs() -> list[tuple[str, float]]:
    """Named special inputs for the behaviour table."""
    nan_pos = f32_from_bits(torch.tensor([0x7FC00000], dtype=torch.int32)).item()
    return [
        ("NaN (0x7FC00000)", nan_pos),
        ("NaN (0xFFC00000)", f32_from_bits(torch.tensor([-0x400000], dtype=torch.int32)).item()),
        ("+inf", math.inf),
        ("-inf", -math.inf),
        ("+0", 0.0),
        ("-0", -0.0),
        ("+min subnormal", 2.0**-149),
        ("-min subnormal", -(2.0**-149)),
        ("-1e-30", -1e-30),
        ("-126", -126.0),
        ("-126.5", -126.5),
        ("-127", -127.0),
        ("-127.5", -127.5),
        ("-1000", -1000.0),
        ("1", 1.0),
        ("127", 127.0),
        ("127.5", 127.5),
        ("128", 128.0),
        ("200", 200.0),
        ("2^23", 2.0**23),
        ("FLT_MAX", float(torch.finfo(torch.float32).max)),
    ]


def _special_table(fn: Callable[[torch.Tensor], torch.Tensor], device) -> list[dict]:
    names, vals = zip(*special_inputs())
    x = torch.tensor(vals, dtype=torch.float32, device=device)
    # keep the exact NaN payloads (torch.tensor of Python NaN would canonicalize them)
    x[0], x[1] = _bits_to_f32(torch.tensor([0x7FC00000, 0xFFC00000], device=device))
    y = fn(x).cpu()
    exact = torch.exp2(x.double().cpu())
    rows = []
    for i, name in enumerate(names):
        yb = int(f32_bits(y[i : i + 1]).item()) & 0xFFFFFFFF
        rows.append(
            {
                "input": name,
                "x_bits": f"0x{int(f32_bits(x[i : i + 1].cpu()).item()) & 0xFFFFFFFF:08X}",
                "result": repr(float(y[i])),
                "result_bits": f"0x{yb:08X}",
                "exact": repr(float(exact[i])),
            }
        )
    return rows


def _chunk_stats_torch(x: torch.Tensor, y: torch.Tensor, *, envelope: bool) -> dict:
    """Error statistics of one chunk (any device): relative error against exp2 in float64."""
    x64 = x.double()
    exact = torch.exp2(x64)
    rel = (y.double() - exact) / exact
    arel = rel.abs()
    i = int(arel.argmax())
    ulp = ulp_error(y, exact, dtype=torch.float32)
    edges = torch.tensor(ULP_BIN_EDGES[1:-1], dtype=torch.float64, device=x.device)
    hist = torch.bincount(torch.bucketize(ulp, edges, right=True), minlength=len(edges) + 1)
    out = {
        "max_rel": float(arel[i]),
        "argmax": i,
        "sum_rel": float(arel.sum()),
        "max_ulp": float(ulp.max()),
        "hist": hist.tolist(),
    }
    if envelope:
        b = ((x64 - torch.floor(x64)) * FRAC_BINS).long().clamp_(0, FRAC_BINS - 1)
        lo = torch.full((FRAC_BINS,), math.inf, dtype=torch.float64, device=x.device)
        hi = torch.full((FRAC_BINS,), -math.inf, dtype=torch.float64, device=x.device)
        out["env_lo"] = lo.scatter_reduce_(0, b, rel, reduce="amin")
        out["env_hi"] = hi.scatter_reduce_(0, b, rel, reduce="amax")
    return out


def _chunk_stats(x: torch.Tensor, y: torch.Tensor, *, envelope: bool) -> dict:
    """Same as :func:`_chunk_stats_torch`; on CPU through the fused numba loop."""
    if x.device.type == "cpu":
        # lazy: numba (about 0.15 s to import), which `fa4-audit` pays for no command but a CPU sweep
        from audits.checks.ex2 import stats_cpu

        return stats_cpu.chunk_stats(
            x.numpy(), y.numpy(), envelope=envelope, frac_bins=FRAC_BINS, n_hist=len(ULP_BIN_EDGES) - 1
        )
    return _chunk_stats_torch(x, y, envelope=envelope)


@dataclass
class _Totals:
    """What :func:`_run_chunks` accumulates over all chunks of all classes."""

    stats: dict[str, ClassStats]
    env_lo: torch.Tensor  # per fractional-part bin: min relative error (normal class)
    env_hi: torch.Tensor  # per fractional-part bin: max relative error (normal class)
    mism: dict = field(default_factory=lambda: {"count": 0, "examples": []})
    t_model: float = 0.0
    t_prod: float = 0.0


def _timed_call(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, device: torch.device):
    """``(f(x), seconds)``; on cuda the time includes the kernel (synchronized)."""
    ts = time.perf_counter()
    y = f(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return y, time.perf_counter() - ts


def _record_mismatches(mism: dict, bits: torch.Tensor, y: torch.Tensor, yp: torch.Tensor) -> None:
    """Count the inputs where production's bits differ from the model's; keep the first examples."""
    bad = f32_bits(yp) != f32_bits(y)
    nbad = int(bad.sum())
    if nbad:
        mism["count"] += nbad
        for i in bad.nonzero()[:5, 0].tolist():
            if len(mism["examples"]) < 20:
                mism["examples"].append(
                    {
                        "x_bits": f"0x{int(bits[i]) & 0xFFFFFFFF:08X}",
                        "model_bits": f"0x{int(f32_bits(y[i : i + 1]).item()) & 0xFFFFFFFF:08X}",
                        "production_bits": f"0x{int(f32_bits(yp[i : i + 1]).item()) & 0xFFFFFFFF:08X}",
                    }
                )


def _accumulate(tot: _Totals, cls: str, bits: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """Fold one chunk of class ``cls`` into the class's statistics (and the envelope, for normal)."""
    st = tot.stats[cls]
    st.count += x.numel()
    if cls in ("normal", "subnormal"):
        part = _chunk_stats(x, y, envelope=cls == "normal")
        if part["max_rel"] > st.max_rel or st.argmax_bits is None:
            st.max_rel, st.argmax_bits = part["max_rel"], int(bits[part["argmax"]]) & 0xFFFFFFFF
        st.sum_rel += part["sum_rel"]
        st.max_ulp = max(st.max_ulp, part["max_ulp"])
        st.ulp_hist = [a + b for a, b in zip(st.ulp_hist, part["hist"])]
        if cls == "normal":
            torch.minimum(tot.env_lo, part["env_lo"].to(tot.env_lo.device), out=tot.env_lo)
            torch.maximum(tot.env_hi, part["env_hi"].to(tot.env_hi.device), out=tot.env_hi)
    if cls != "normal":
        for k, v in _result_kinds(y).items():
            st.results[k] = st.results.get(k, 0) + v


def _run_chunks(fn, production, device: torch.device, *, exhaustive, chunk, sample, seed, progress) -> _Totals:
    """Run ``fn`` (and ``production``, if given) over every class's chunks of inputs."""
    gen = torch.Generator().manual_seed(seed)
    tot = _Totals(
        stats={c: ClassStats() for c in CLASSES},
        env_lo=torch.full((FRAC_BINS,), math.inf, dtype=torch.float64, device=device),
        env_hi=torch.full((FRAC_BINS,), -math.inf, dtype=torch.float64, device=device),
    )
    for cls, ranges in class_ranges().items():
        for bits in _chunks(ranges, chunk, exhaustive, sample, gen, device):
            x = _bits_to_f32(bits)
            y, dt = _timed_call(fn, x, device)
            tot.t_model += dt
            if production is not None:
                yp, dt = _timed_call(production, x, device)
                tot.t_prod += dt
                _record_mismatches(tot.mism, bits, y, yp)
            _accumulate(tot, cls, bits, x, y)
            if progress is not None:
                progress(x.numel())
    return tot


def sweep_ex2(
    *,
    degree: int,
    exhaustive: bool = False,
    device: str | torch.device = "cpu",
    packed: bool = False,
    chunk: int = 1 << 22,
    sample: int = 1 << 20,
    seed: int = 0,
    production: Callable[[torch.Tensor], torch.Tensor] | None = None,
    function: Callable[[torch.Tensor], torch.Tensor] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Measure the model of ``ex2_emulation`` (``packed``: ``ex2_emulation_2``) of one degree.

    ``exhaustive``: every float32 bit pattern; else about ``sample`` random patterns per input
    class (all of a class smaller than that), deterministic from ``seed``.  ``production``:
    optional callable (float32 tensor -> float32 tensor, same device) compared bit for bit with
    the model on every input.
    ``function``: measure this exp2 implementation instead of the model (e.g. the hardware
    MUFU.EX2 kernel); ``degree`` is then only a label.
    ``progress(n)`` is called with the number of inputs done after each chunk.
    Returns a JSON-able dict (see ``audits.checks.ex2.report``).
    """
    device = torch.device(device)
    model = ex2_emulation_2 if packed else ex2_emulation
    fn = function if function is not None else (lambda x: model(x, degree))
    t0 = time.perf_counter()
    tot = _run_chunks(
        fn, production, device, exhaustive=exhaustive, chunk=chunk, sample=sample, seed=seed, progress=progress
    )
    elapsed = time.perf_counter() - t0
    out = {
        "degree": degree,
        "variant": "ex2_emulation_2 (packed)" if packed else "ex2_emulation (scalar)",
        "mode": "exhaustive" if exhaustive else f"sample ({sample} patterns, seed {seed})",
        "device": str(device),
        "inputs": sum(s.count for s in tot.stats.values()),
        "seconds": elapsed,
        "model_seconds": tot.t_model,
        "classes": {c: s.as_dict() for c, s in tot.stats.items()},
        "envelope": {
            "bins": FRAC_BINS,
            "min_rel": [v if math.isfinite(v) else None for v in tot.env_lo.cpu().tolist()],
            "max_rel": [v if math.isfinite(v) else None for v in tot.env_hi.cpu().tolist()],
        },
        "special": _special_table(fn, device),
    }
    if production is not None:
        out["production"] = {
            "compared": out["inputs"],
            "mismatches": tot.mism["count"],
            "examples": tot.mism["examples"],
            "production_seconds": tot.t_prod,
        }
    return out
