"""Check the PTX that production's exp2 emulation compiles to against what ``fa4.ex2`` models.

The bit-exact GPU comparison (``fa4-audit ex2 --device cuda``) can run the scalar
``ex2_emulation`` on an H200, but the packed ``ex2_emulation_2`` — the one the SM100 kernel
calls — uses f32x2 instructions that exist only from sm_100 on.  Its semantics are pinned here
instead, statically: the production function is compiled for ``sm_100a`` (no GPU needed: the
CuTe-DSL compiler runs on a CPU), and every floating-point instruction of the kernel body —
opcode, rounding mode, ``.ftz``, packing — and every float constant is compared with
``fa4.ex2.PTX_MODEL``.  A difference means production and the model have diverged.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

from audits.common import PtxFormatError
from fa4.ex2 import POLY_EX2, PTX_MODEL

__all__ = ["float_instructions", "check_ptx", "compile_ptx", "PtxFormatError"]

_FLOAT_OP = re.compile(r"^\s*(max|min|add|sub|mul|fma)((?:\.[a-z0-9]+)*)\s+(.*?);", re.M)
_F32_CONST = re.compile(r"0f([0-9A-Fa-f]{8})")


def float_instructions(ptx: str) -> Counter:
    """Multiset of the f32 arithmetic instructions of a PTX text, as
    ``(op, rounding, ftz, width)`` with rounding ``"rn"`` when implicit (PTX's default for
    add/sub/mul/fma on f32), ``sub`` counted as ``add``, and width 1 or 2 (``.f32x2``).  Integer and address arithmetic
    (``add.s64``...) is ignored."""
    if ".entry" not in ptx:
        raise PtxFormatError("no .entry (kernel) found: this is not a PTX module the extractor understands")
    facts: Counter = Counter()
    for op, mods, _ in _FLOAT_OP.findall(ptx):
        parts = mods.strip(".").split(".") if mods else []
        if "f32" not in parts and "f32x2" not in parts:
            continue
        rnd = next((p for p in parts if p in ("rn", "rz", "rm", "rp")), None)
        if op in ("max", "min"):
            rnd = None
        elif rnd is None:
            rnd = "rn"
        op = "add" if op == "sub" else op  # a - b == a + (-b) exactly: same rounding
        facts[(op, rnd, "ftz" in parts, 2 if "f32x2" in parts else 1)] += 1
    if not facts:
        raise PtxFormatError("no f32 arithmetic instruction found in the PTX")
    return facts


def _const_bits(ptx: str) -> set[int]:
    return {int(h, 16) for h in _F32_CONST.findall(ptx)}


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def check_ptx(ptx: str, *, variant: str, degree: int, elements: int = 2) -> list[str]:
    """Differences between a compiled kernel's PTX and the model of ``variant`` at ``degree``.

    ``elements``: how many elements the kernel evaluates (the ``fa4.production`` kernels do 2
    per thread: two scalar calls or one packed pair).  Returns a list of human-readable
    differences; empty means the PTX is exactly what the model assumes.
    """
    if variant not in PTX_MODEL:
        raise ValueError(f"variant must be one of {sorted(PTX_MODEL)}, got {variant!r}")
    got = float_instructions(ptx)
    want: Counter = Counter()
    per_call, calls = PTX_MODEL[variant], elements if variant == "scalar" else elements // 2
    for key, n in per_call.items():
        k = tuple(key)
        want[k] += (degree if k[0] == "fma" else 1) * n * calls
    diffs = []
    for k in sorted(set(got) | set(want), key=str):
        if got[k] != want[k]:
            op, rnd, ftz, w = k
            name = f"{op}{'.' + rnd if rnd else ''}{'.ftz' if ftz else ''}.f32{'x2' if w == 2 else ''}"
            diffs.append(f"{name}: PTX has {got[k]}, model expects {want[k]}")
    consts = _const_bits(ptx)
    need = {_f32_bits(c) for c in POLY_EX2[degree]} - {_f32_bits(1.0)} | {_f32_bits(-127.0)}
    missing = need - consts
    if missing:
        diffs.append(
            "float constants the model uses but the PTX lacks: " + ", ".join(f"0f{m:08X}" for m in sorted(missing))
        )
    if not ({_f32_bits(1.5 * 2**23), _f32_bits(-1.5 * 2**23)} & consts):
        diffs.append("the rounding constant 1.5*2^23 (0f4B400000) is absent")
    if "shl.b32" not in ptx or "add.s32" not in ptx:
        diffs.append("the integer exponent splice (shl.b32 by 23, add.s32) is absent")
    return diffs


def compile_ptx(variant: str, degree: int, *, arch: str = "sm_100a", dump_dir: str | os.PathLike) -> str:
    """Compile production's ``variant`` kernel for ``arch`` in a fresh Python process (the DSL
    reads its target from the environment at import) and return the PTX.  Needs the ``gpu``
    extra installed, not a GPU.  Raises ``RuntimeError`` with the compiler's message."""
    dump_dir = str(Path(dump_dir).resolve())
    os.makedirs(dump_dir, exist_ok=True)
    env = {**os.environ, "CUTE_DSL_ARCH": arch, "CUTE_DSL_KEEP_PTX": "1", "CUTE_DSL_DUMP_DIR": dump_dir}
    code = (
        "import sys; from fa4.production import compile_ex2_ptx; "
        f"sys.stdout.write(compile_ex2_ptx({variant!r}, {degree}, {dump_dir!r}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
        raise RuntimeError(f"compiling production {variant} ex2 (degree {degree}) for {arch} failed:\n{tail}")
    return proc.stdout
