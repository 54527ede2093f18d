"""The exp2 audit's rules: one polynomial degree swept (the model, and on CUDA production's
scalar and packed exp2) beside its proven bound, production's PTX compiled and checked, and the
verdict lines both give (``ok`` / ``FAIL`` / ``note``, each with whether it failed)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch

from audits.checks.ex2.ptx import check_ptx, compile_ptx
from audits.common import UsageError
from fa4.ex2 import POLY_EX2
from fa4.production import INSTALL_HINT, ex2_kernel
from numerics import bounds

__all__ = ["sweep_degree", "degree_verdicts", "ptx_checks", "ptx_verdicts"]


def sweep_degree(deg: int, device: torch.device, sweep: Callable[..., dict]) -> dict:
    """Sweep the model of degree ``deg`` (and production's scalar and packed exp2 on cuda) beside
    the proven bound; ``sweep(label, **kw)`` runs one ``audits.checks.ex2.sweep.sweep_ex2``."""
    entry = {"degree": deg}
    details = bounds.ex2_bound_details(POLY_EX2[deg])
    entry["bound"] = details["bound"]
    entry["bound_details"] = details
    prod_entry = {}
    if device.type == "cuda":
        entry["sweep"] = sweep(
            f"degree {deg}: model vs production scalar", degree=deg, production=ex2_kernel("scalar", deg)
        )
        prod_entry["scalar"] = entry["sweep"].pop("production")
        try:
            packed = ex2_kernel("packed", deg)
            packed(torch.zeros(512, device=device))  # compile now: fails before sm_100
        except NotImplementedError as exc:
            prod_entry["packed"] = {"skipped": str(exc)}
        else:
            ps = sweep(f"degree {deg}: packed model vs production packed", degree=deg, packed=True, production=packed)
            prod_entry["packed"] = ps["production"]
    else:
        entry["sweep"] = sweep(f"degree {deg}: model", degree=deg)
    entry["production"] = prod_entry
    return entry


def degree_verdicts(entry: dict) -> tuple[list[str], bool]:
    """Verdict lines for one degree's entry (model vs bound, production vs model) and whether any failed."""
    deg, prod_entry = entry["degree"], entry["production"]
    verdicts, failed = [], False
    n = entry["sweep"]["classes"]["normal"]
    if n["max_rel_error"] > entry["bound"]:
        failed = True
        verdicts.append(
            f"FAIL degree {deg}: measured max relative error {n['max_rel_error']:.6e} at x = "
            f"{n['argmax_x']!r} exceeds the proven bound {entry['bound']:.6e} "
            "— the model or the analysis is wrong"
        )
    else:
        verdicts.append(
            f"ok degree {deg}: measured max {n['max_rel_error']:.6e} <= proven bound {entry['bound']:.6e} "
            f"(bound/measured = {entry['bound'] / n['max_rel_error']:.4f})"
        )
    for variant, p in prod_entry.items():
        if "mismatches" in p:
            ok = p["mismatches"] == 0
            failed |= not ok
            verdicts.append(
                f"{'ok' if ok else 'FAIL'} degree {deg}: production {variant} vs model: "
                f"{p['mismatches']:,} bit mismatches in {p['compared']:,} inputs"
            )
        else:
            verdicts.append(f"note degree {deg}: production {variant} not compared: {p['skipped']}")
    return verdicts, failed


def ptx_checks(degrees: list[int], arch: str, out: str | Path, *, advance: Callable[[], None]) -> list[dict]:
    """Compile production's scalar and packed exp2 for ``arch`` and check them
    (``audits.checks.ex2.ptx``), calling ``advance`` after each compile; a missing production
    package or a failed compile is a usage error."""
    missing = [m for m in ("cutlass", "flash_attn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(
            f"--ptx needs the production package to compile (missing: {', '.join(missing)}); {INSTALL_HINT}"
        )
    rows = []
    for deg in degrees:
        for variant in ("scalar", "packed"):
            try:
                text = compile_ptx(variant, deg, arch=arch, dump_dir=Path(out) / "ptx-dump")
            except RuntimeError as exc:
                raise UsageError(str(exc)) from exc
            rows.append(
                {"degree": deg, "variant": variant, "differences": check_ptx(text, variant=variant, degree=deg)}
            )
            advance()
    return rows


def ptx_verdicts(ptx: list[dict], arch: str) -> tuple[list[str], bool]:
    """Verdict lines for the ``--ptx`` checks and whether any failed."""
    verdicts, failed = [], False
    for row in ptx:
        ok = not row["differences"]
        failed |= not ok
        verdicts.append(
            f"{'ok' if ok else 'FAIL'} degree {row['degree']}: production {row['variant']} PTX for {arch} "
            + ("matches the model's instructions" if ok else "differs from the model: " + "; ".join(row["differences"]))
        )
    return verdicts, failed
