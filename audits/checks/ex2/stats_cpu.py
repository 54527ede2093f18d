"""Fused CPU loop (numba) for the per-chunk statistics of ``audits.checks.ex2.sweep``.

Computes exactly what ``audits.checks.ex2.sweep._chunk_stats_torch`` computes — |relative error| against
``exp2`` in float64, its maximum, argmax and sum, the ULP error in float32 units at the exact
value (``numerics.fp.ulp_error``'s convention: ``2**(max(floor(log2 e), -126) - 23)``), its
histogram over ``ULP_BIN_EDGES`` and the min/max signed relative error per bin of the
fractional part — in one pass per element instead of ~20 memory-bound torch ops.  The tests
check both give the same numbers.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

__all__ = ["chunk_stats"]


@numba.njit(parallel=True, fastmath=False, cache=True, nogil=True)
def _kernel(
    x, y, nblk, envelope, frac_bins, n_hist, bmax, barg, bsum, bulp, bhist, benv_lo, benv_hi
):  # pragma: no cover
    n = x.shape[0]
    bs = (n + nblk - 1) // nblk
    for b in numba.prange(nblk):
        lo = b * bs
        hi = min(n, lo + bs)
        mx = -1.0
        arg = lo
        sm = 0.0
        um = 0.0
        for i in range(lo, hi):
            xd = np.float64(x[i])
            e = math.exp2(xd)
            yd = np.float64(y[i])
            rel = (yd - e) / e
            a = abs(rel)
            if a > mx:
                mx = a
                arg = i
            sm += a
            _, ex = math.frexp(e)
            ulp = math.ldexp(1.0, max(ex - 1, -126) - 23)
            u = abs(yd - e) / ulp
            if u > um:
                um = u
            if u < 0.5:
                k = 0
            elif u < 1.0:
                k = 1
            else:
                _, eu = math.frexp(u)  # u in [2**(eu-1), 2**eu)
                k = min(eu + 1, n_hist - 1)
            bhist[b, k] += 1
            if envelope:
                fb = min(int((xd - math.floor(xd)) * frac_bins), frac_bins - 1)
                if rel < benv_lo[b, fb]:
                    benv_lo[b, fb] = rel
                if rel > benv_hi[b, fb]:
                    benv_hi[b, fb] = rel
        bmax[b] = mx
        barg[b] = arg
        bsum[b] = sm
        bulp[b] = um


def chunk_stats(x: np.ndarray, y: np.ndarray, *, envelope: bool, frac_bins: int, n_hist: int) -> dict:
    """Statistics of one chunk (float32 arrays x, y of equal length); see the module doc."""
    nblk = max(1, min(64, x.shape[0] // 4096))
    bmax = np.empty(nblk)
    barg = np.empty(nblk, dtype=np.int64)
    bsum = np.empty(nblk)
    bulp = np.empty(nblk)
    bhist = np.zeros((nblk, n_hist), dtype=np.int64)
    benv_lo = np.full((nblk, frac_bins), np.inf)
    benv_hi = np.full((nblk, frac_bins), -np.inf)
    _kernel(x, y, nblk, envelope, frac_bins, n_hist, bmax, barg, bsum, bulp, bhist, benv_lo, benv_hi)
    j = int(np.argmax(bmax))
    out = {
        "max_rel": float(bmax[j]),
        "argmax": int(barg[j]),
        "sum_rel": float(bsum.sum()),
        "max_ulp": float(bulp.max()),
        "hist": bhist.sum(axis=0).tolist(),
    }
    if envelope:
        out["env_lo"] = torch.from_numpy(benv_lo.min(axis=0))
        out["env_hi"] = torch.from_numpy(benv_hi.max(axis=0))
    return out
