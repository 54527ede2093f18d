"""The forward model's fast CPU loop against its plain loop, bit for bit (``docs/performance.md``).

The fast loop (``fa4.forward_loop._FAST_CPU``: row windows, ``torch.matmul`` on head-major float64
copies, the compiled softmax step of ``fa4.ex2_cpu`` on torch's OpenMP team or in the calling
thread) must give the plain loop's bits — every row of every block through torch and the einsums
over all rows — out and LSE, NaN payloads included, on the machine the tests run on: the row
windows rely on MKL's float64 GEMM giving a row the same sum whatever rows share the call (checked
here on inputs whose float64 sums are inexact), and the compiled exp2 on torch's float64 exp2
being within 1 ulp (checked here on sampled inputs).  No timing:
``benchmarks/model_cpu.py``.
"""

from __future__ import annotations

import dataclasses

import numba
import numpy as np
import pytest
import torch

import fa4.forward_loop as loop
from fa4 import ex2_cpu
from fa4.ex2 import POLY_EX2, ex2_emulation_2
from fa4.model import FA4Numerics, attention
from fa4.primitives import hardware_exp2, visible_bounds
from numerics.fp import bit_view, fma_f32, format_of, round_to


@numba.njit
def _exp2_all(t, out, flag):
    for i in range(t.shape[0]):
        out[i], flag[i] = ex2_cpu._exp2_hw(t[i])


@numba.njit
def _ex2_all(t, out, flag, c5):
    for i in range(t.shape[0]):
        out[i], flag[i] = ex2_cpu._ex2_vec(t[i], c5, False)
        if flag[i]:  # what the softmax step does with a flagged element
            out[i], flag[i] = ex2_cpu.ex2_elem(t[i], c5, False)


@numba.njit
def _round_all(x, out, flag, lp, maxv):
    for i in range(x.shape[0]):
        if lp[0] == 0:
            out[i], flag[i] = ex2_cpu._round_bf16(x[i])
        else:
            out[i], flag[i] = ex2_cpu._round_lp(x[i], lp, maxv)


@numba.njit
def _fma_all(a, b, c, out):
    for i in range(a.shape[0]):
        out[i] = ex2_cpu._fma32(a[i], b[i], c[i])


def _wide(shape, dtype, g, spread=24):
    """Values of random sign, significand and exponent (2**-spread .. 2**spread): their float64
    dot products are inexact, so a GEMM that summed in another order would show."""
    m = torch.randn(shape, generator=g)
    e = torch.randint(-spread, spread, shape, generator=g).float()
    return (m * torch.exp2(e)).to(dtype)


def _inputs(dtype, b, sq, sk, hq, hk, d, dv, family, seed):
    g = torch.Generator().manual_seed(seed)
    if family == "wide":
        q, k = _wide((b, sq, hq, d), dtype, g, 3), _wide((b, sk, hk, d), dtype, g, 3)
        v = _wide((b, sk, hk, dv), dtype, g)
    else:
        q, k, v = (torch.randn(s, generator=g).to(dtype) for s in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv)))
    if family == "nan_inf":
        q, k, v = q.clone(), k.clone(), v.clone()
        k[0, sk // 3, 0, 1] = float("nan")
        k[0, sk - 1, -1, 0] = float("inf")
        v[0, sk // 2, 0, 2] = float("nan")
        q[0, sq // 2, 0, 3] = float("-inf")
    return q, k, v


CASES = [
    # dtype, b, sq, sk, hq, hk, d, dv, causal, window, softcap, sink, arch, knobs, family
    ("bfloat16", 1, 700, 700, 2, 2, 64, 64, True, (None, None), 0.0, False, "sm100", {}, "wide"),
    ("bfloat16", 2, 450, 517, 4, 2, 128, 128, False, (None, None), 0.0, False, "sm100", {}, "wide"),
    ("float16", 1, 601, 390, 2, 1, 96, 96, True, (None, None), 0.0, True, "sm90", {}, "wide"),
    ("bfloat16", 1, 500, 640, 2, 2, 64, 64, False, (100, 20), 0.0, False, "sm90", {}, "normal"),
    ("bfloat16", 1, 420, 420, 2, 2, 128, 128, False, (None, None), 12.0, False, "sm100", {}, "normal"),
    ("float8_e4m3fn", 1, 400, 520, 2, 2, 128, 128, True, (None, None), 0.0, False, "sm100", {}, "normal"),
    ("float8_e5m2", 1, 300, 200, 2, 2, 64, 64, False, (None, None), 0.0, True, "sm100", {}, "wide"),
    ("bfloat16", 1, 390, 600, 2, 2, 64, 72, True, (None, None), 0.0, False, "sm100", {"exp2": "emulated"}, "normal"),
    ("float16", 1, 390, 600, 2, 2, 64, 64, False, (None, None), 0.0, False, "sm100",
     {"masked_exp2": "hardware", "rescale_threshold": 0.3, "poly_degree": 5}, "normal"),
    ("bfloat16", 1, 333, 333, 2, 2, 64, 64, True, (None, None), 0.0, False, "sm100",
     {"p_dtype": torch.float8_e4m3fn, "tile_n": 96, "tile_m": 64, "max_offset": 8}, "normal"),
    ("bfloat16", 1, 260, 400, 2, 2, 64, 64, True, (None, None), 0.0, False, "sm100", {}, "nan_inf"),
    ("float16", 1, 260, 400, 2, 2, 64, 64, False, (30, 5), 0.0, False, "sm90", {}, "nan_inf"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[12]}-{c[14]}-s{c[2]}x{c[3]}")
def test_fast_loop_is_the_plain_loop_bit_for_bit(case, monkeypatch):
    _fast_against_plain(case, monkeypatch)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[9], CASES[10]], ids=lambda c: f"{c[0]}-{c[12]}-{c[14]}")
def test_fast_loop_without_torchs_thread_team(case, monkeypatch):
    """The compiled loops in the calling thread (no libgomp found in torch's folder)."""
    monkeypatch.setattr(ex2_cpu, "_team", lambda: None)
    _fast_against_plain(case, monkeypatch)


def _fast_against_plain(case, monkeypatch):
    dtype, b, sq, sk, hq, hk, d, dv, causal, window, softcap, sink, arch, knobs, family = case
    q, k, v = _inputs(getattr(torch, dtype), b, sq, sk, hq, hk, d, dv, family, seed=len(knobs) + sq)
    nm = dataclasses.replace(FA4Numerics.for_inputs(arch, q, k, v, causal, window), **knobs)
    kw = dict(causal=causal, window_size=window, softcap=softcap, return_lse=True, numerics=nm)
    if sink:
        kw["learnable_sink"] = torch.linspace(-2.0, 3.0, hq)
    fast = attention(q, k, v, **kw)
    monkeypatch.setattr(loop, "_FAST_CPU", False)
    plain = attention(q, k, v, **kw)
    for x, y in zip(fast, plain):
        assert torch.equal(bit_view(x), bit_view(y)), f"{(bit_view(x) != bit_view(y)).sum().item()} elements differ"


@pytest.mark.parametrize(
    "sq,sk,hq,hk,d,dv,causal,window",
    [(700, 640, 2, 1, 128, 128, True, (None, None)), (1000, 1100, 3, 3, 64, 96, False, (150, 10))],
)
def test_row_windows_keep_the_gemm_bits(sq, sk, hq, hk, d, dv, causal, window, monkeypatch):
    """S = Q K^T and P V of every block's row window, float64 bit for bit against the all-rows
    einsums of the plain loop, on inputs whose float64 sums are inexact (any change in MKL's
    summation order shows here long before it reaches a float32 output)."""
    g = torch.Generator().manual_seed(sq)
    q, k = _wide((1, sq, hq, d), torch.bfloat16, g), _wide((1, sk, hk, d), torch.bfloat16, g)
    v = _wide((1, sk, hk, dv), torch.bfloat16, g)
    nm = FA4Numerics.for_inputs("sm100", q, k, v, causal, window)
    n_min, n_max, nblk = loop.kv_block_ranges(sq, sk, nm, causal, window, "cpu", heads=hq)
    vis = visible_bounds(sq, sk, causal, window, "cpu")
    scales = (0.125, 0.0, 0.18)
    fast = loop._make_loop(q, k, v, nm, vis, (n_min, n_max, n_min, n_max), scales)
    monkeypatch.setattr(loop, "_FAST_CPU", False)
    plain = loop._make_loop(q, k, v, nm, vis, (n_min, n_max, n_min, n_max), scales)
    assert fast.fast and not plain.fast
    p_all = _wide((1, hq, sq, nm.tile_n), torch.bfloat16, g, 40).double().abs()
    windows = set()
    for n in range(nblk):
        active = (n >= n_min) & (n < n_max)
        if not bool(active.any()):
            continue
        r0, r1 = loop._row_window(active, sq, True)
        windows.add((r0, r1))
        j0, j1 = n * nm.tile_n, min((n + 1) * nm.tile_n, sk)
        s_fast, s_plain = fast.scores(j0, j1, r0, r1), plain.scores(j0, j1, 0, sq)[:, :, r0:r1]
        assert torch.equal(s_fast.view(torch.int64), s_plain.view(torch.int64)), (n, r0, r1)
        p_win = fast.buffer("p", (1, hq, r1 - r0, nm.tile_n))
        p_win.copy_(p_all[:, :, r0:r1])
        pv_fast, pv_plain = fast.pv(p_win, j0, j1), plain.pv(p_all, j0, j1)[:, :, r0:r1]
        assert torch.equal(pv_fast.view(torch.int64), pv_plain.view(torch.int64)), (n, r0, r1)
    assert len(windows) > 2  # windows were cut


def _sample_f32(n: int, seed: int) -> np.ndarray:
    """n random float32 bit patterns (every exponent, NaNs included) plus the specials."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 128.0, -126.0, -149.5, -150.0], np.float32)
    return np.concatenate([bits.view(np.float32), specials])


def test_compiled_hardware_exp2_matches_torch():
    rng = np.random.default_rng(1)
    t = np.concatenate([_sample_f32(1 << 20, 0), rng.uniform(-160, 130, 1 << 20).astype(np.float32)])
    out, flag = np.empty_like(t), np.empty(t.shape, np.int32)
    _exp2_all(t, out, flag)
    ref = hardware_exp2(torch.from_numpy(t)).numpy()
    ok = flag == 0
    assert np.array_equal(out.view(np.int32)[ok], ref.view(np.int32)[ok])
    assert (~ok & ~np.isnan(t)).sum() < 10  # the undecided window is 2 * 64 of 2**29 float64 ulps


@pytest.mark.parametrize("degree", sorted(POLY_EX2))
def test_compiled_emulation_matches_ex2_emulation_2(degree):
    rng = np.random.default_rng(degree)
    t = np.concatenate([_sample_f32(1 << 19, degree), rng.uniform(-140, 10, 1 << 19).astype(np.float32)])
    out, flag = np.empty_like(t), np.empty(t.shape, np.int32)
    _ex2_all(t, out, flag, ex2_cpu.padded(POLY_EX2[degree]))
    ref = ex2_emulation_2(torch.from_numpy(t), degree).numpy()
    ok = flag == 0
    assert np.array_equal(out.view(np.int32)[ok], ref.view(np.int32)[ok])
    assert (~ok).sum() < 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_compiled_rounding_matches_round_to(dtype):
    fmt = format_of(dtype)
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    # every value of the format's grid and its float32 neighbours (the ties), plus random patterns
    grid = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    if dtype != torch.float16:
        grid = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    grid = grid[torch.isfinite(grid)].numpy()
    near = np.concatenate([grid, np.nextafter(grid, np.inf), np.nextafter(grid, -np.inf), grid * 1.0000001])
    x = np.concatenate([_sample_f32(1 << 20, 7), near.astype(np.float32)])
    lp = np.array([dtype != torch.bfloat16, fmt.p, fmt.emin, fp8, dtype != torch.float8_e4m3fn], dtype=np.int64)
    out, flag = np.empty(x.shape, np.float64), np.empty(x.shape, np.int32)
    _round_all(x, out, flag, lp, float(fmt.max))
    ref = round_to(torch.from_numpy(x), dtype, saturate=fp8).double().numpy()
    ok = flag == 0
    assert np.array_equal(out.view(np.int64)[ok], ref.view(np.int64)[ok])
    assert np.array_equal(~ok, np.isnan(x))  # only NaN is left to torch


def test_compiled_fma_matches_fma_f32():
    rng = np.random.default_rng(3)
    n = 1 << 20

    def rnd(lo, hi):
        return (rng.standard_normal(n) * np.exp2(rng.integers(lo, hi, n))).astype(np.float32)

    for lo, hi in ((-10, 10), (-140, 100)):
        a, b, c = rnd(lo, hi), rnd(lo, hi), rnd(lo, hi)
        with np.errstate(over="ignore"):
            near = (-(a.astype(np.float64) * b)).astype(np.float32)
        for cc in (c, near):  # and near-cancellations
            out = np.empty_like(a)
            _fma_all(a, b, cc, out)
            ref = fma_f32(*(torch.from_numpy(x) for x in (a, b, cc))).numpy()
            ok = ~np.isnan(ref)
            assert np.array_equal(out.view(np.int32)[ok], ref.view(np.int32)[ok])
