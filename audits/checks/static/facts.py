"""Numerics facts of a compiled FA4 forward kernel, read from its PTX text.

What is extracted (``kernel_facts``), and how — every rule was checked against the sm_100a PTX
of ``FlashAttentionForwardSm100`` (flash-attn-4 4.0.0b36, cutlass-dsl 4.8.1, tests/data/ptx):

* ``exp2.hardware``: the ``ex2`` instructions with their modifiers (MUFU.EX2; ``.ftz`` decides
  whether subnormal results flush).
* ``exp2.emulated_pairs`` / ``exp2.emulated_scalar``: the polynomial exp2's signature, its
  round-down add ``add.rm.f32x2`` (one per packed pair, ``utils.ex2_emulation_2``) and
  ``add.rm(.ftz).f32`` (scalar ``utils.ex2_emulation``).
* Softmax steps: production inlines the per-block softmax (``SoftmaxSm100.apply_exp2_convert``)
  in a few places (masked / unmasked blocks...).  Each place computes exp2 of one row tile of
  ``tile_n`` scores, so with E emulated and H hardware elements, ``steps = round((E + H) /
  tile_n)`` and the remainder ``E + H - steps * tile_n`` (0 <= r < steps + 2) is the rescale
  factors' ``ex2``.  ``exp2.emulated_per_step = E / steps`` — the emulated fraction.
* ``exp2.poly_degree``: the degree whose ``POLY_EX2`` coefficients all occur as float
  immediates (each degree's minimax coefficients are distinct numbers); cross-checked by the
  packed fma count, ``fma.rn.f32x2 = steps * tile_n / 2`` (scale-and-subtract, one per pair)
  ``+ pairs * degree`` (Horner) — ``exp2.fma_per_pair``.
* ``rescale.threshold``: the lazy rescale compares ``(m_old - m_new) * scale_log2`` with
  ``-threshold`` (``setp.ge.f32 %p, %r, 0f<-threshold>``, ``SoftmaxSm100.update_row_max``);
  no such comparison means threshold 0 (the max moves at every block).
* ``max_offset``: the bias ``max_offset - max * scale_log2`` is ``mov.b32 %r, 0f<offset>``
  then ``sub.f32 %s, %r, ...``; absent means 0.
* ``arith.nonstandard``: f32 add/sub/mul/fma/div with a rounding other than ``.rn`` or with
  ``.ftz``, and approximate divisions (``div.approx`` / ``div.full``), other than the
  emulation's round-down adds (the model assumes IEEE round to nearest and no flush everywhere
  else on the softmax path).
* ``division``: the floating-point ``div`` instructions with their counts (integer ``div.s32``,
  block-index arithmetic of the block-sparse forward, is left out).  Softcap's ``acc_S / softcap`` is
  ``div.rn.f32``, one per score (``fa4.primitives.div_rn``); the learnable sink adds one or
  two (``LOG2_E / scale_log2``).  A division by a constant is not turned into a multiply by
  its reciprocal (the form torch's CUDA division takes, which the model once had).
* ``p_convert``: float32 -> P-dtype conversions (``cvt.rn.bf16x2.f32``, ``cvt.rn.satfinite
  .e4m3x2.f32``...), with counts.
* ``reciprocal``: ``rcp`` variants (the epilogue's 1/row_sum).  ``tanh``: ``tanh.approx``
  count (softcap).

A PTX text these rules do not understand raises :class:`PtxFormatError` naming what was not
recognised; a fact is never silently defaulted.
"""

from __future__ import annotations

import re
import struct
from collections import Counter

from audits.common import PtxFormatError  # one error type for every PTX reader
from fa4.ex2 import POLY_EX2

__all__ = ["PtxFormatError", "kernel_facts", "f32_hex"]


def f32_hex(v: float) -> str:
    """PTX spelling of a float32 immediate: ``0f3F800000`` for 1.0."""
    return f"0f{struct.unpack('<I', struct.pack('<f', v))[0]:08X}"


def _hex_f32(h: str) -> float:
    return struct.unpack("<f", struct.pack("<I", int(h[2:], 16)))[0]


_INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_:]+)*)\s*(.*?);", re.M)
_IMM = re.compile(r"0f[0-9A-Fa-f]{8}")


def instructions(ptx: str) -> list[tuple[str, str]]:
    """Every instruction of ``ptx`` as (opcode with modifiers, operands), in order.  Public, as
    are :func:`poly_degree` and :func:`nonstandard_arith`: the backward's facts
    (``audits.checks.static.facts_bwd``) read their kernels with the same parser and rules."""
    return [(op, args) for op, args in _INSTR.findall(ptx)]


def _exp2_split(ops: Counter, tile_n: int) -> dict:
    """``exp2.hardware``, the emulated counts and the softmax steps of the module doc (checked)."""
    ex2 = {op: n for op, n in ops.items() if op.startswith("ex2.")}
    if not ex2:
        raise PtxFormatError(
            "no ex2 instruction: not an attention forward kernel, or a form the extractor does not know"
        )
    pairs = ops.get("add.rm.f32x2", 0)
    scalar = sum(n for op, n in ops.items() if re.fullmatch(r"(add|sub)\.rm(\.ftz)?\.f32", op))
    e, h = 2 * pairs + scalar, sum(ex2.values())
    steps = round((e + h) / tile_n)
    extra = e + h - steps * tile_n
    if steps < 1 or not (0 <= extra < steps + 2):
        raise PtxFormatError(
            f"{e} emulated + {h} hardware exp2 do not split into softmax steps of {tile_n} elements "
            f"(remainder {extra}): the softmax loop has a structure the extractor does not know"
        )
    return {"ex2": ex2, "pairs": pairs, "scalar": scalar, "e": e, "steps": steps, "extra": extra}


def poly_degree(ptx: str) -> int | None:
    """The highest degree whose ``POLY_EX2`` coefficients (other than 1) all occur as immediates."""
    imm = {m.upper().replace("0F", "0f") for m in _IMM.findall(ptx)}
    degrees = [d for d, cs in POLY_EX2.items() if all(f32_hex(c) in imm for c in cs if c != 1.0)]
    return max(degrees) if degrees else None


def _rescale_thresholds(ins: list[tuple[str, str]]) -> list[float]:
    """Every ``threshold`` of a ``setp.ge.f32 %p, %r, 0f<-threshold>`` comparison, sorted."""
    return sorted(
        {
            -_hex_f32(a.split(",")[-1].strip())
            for op, a in ins
            if op == "setp.ge.f32"
            and _IMM.fullmatch(a.split(",")[-1].strip())
            and _hex_f32(a.split(",")[-1].strip()) < 0
        }
    )


def _max_offsets(ptx: str) -> list[float]:
    """Every ``offset`` of ``mov.b32 %r, 0f<offset>`` then ``sub.f32 %s, %r, ...``, sorted, where
    every definition of that register is such a mov of that one constant: a loop-carried register
    set to a constant once and to computed values elsewhere is no constant (the block-sparse
    forward's running row max, reset to -inf per block list, then ``sub.f32 %s, %row_max_old,
    %row_max_new`` in the rescale)."""
    const = {}  # register -> its immediates (None once anything else defines it)
    for m in re.finditer(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)\s+(%r\d+)\s*,\s*([^;]*);", ptx, re.M):
        op, reg, src = m.groups()
        imm = src.strip() if op == "mov.b32" and _IMM.fullmatch(src.strip()) else None
        seen = const.get(reg, set())
        const[reg] = None if imm is None or seen is None else seen | {imm}
    return sorted(
        {
            _hex_f32(next(iter(const[m.group(1)])))
            for m in re.finditer(r"sub\.f32\s+%r\d+,\s*(%r\d+),\s*%r\d+;", ptx)
            if const.get(m.group(1)) and len(const[m.group(1)]) == 1
        }
    )


def _is_float_op(op: str) -> bool:
    """An instruction on a floating-point type (``div.rn.f32``, ``div.full.f32``; not ``div.s32``)."""
    return any(p in ("f16", "bf16", "f32", "f64", "f32x2", "f16x2", "bf16x2") for p in op.split(".")[1:])


def _is_emulation_add(op: str) -> bool:
    """The polynomial exp2's round-down add (``add.rm.f32x2`` packed, ``add.rm(.ftz).f32`` scalar)."""
    return op == "add.rm.f32x2" or re.fullmatch(r"(add|sub)\.rm(\.ftz)?\.f32", op) is not None


def nonstandard_arith(ops: Counter, *, exempt=_is_emulation_add, kinds=("add", "sub", "mul", "fma")) -> Counter:
    """f32 ``kinds`` instructions (packed and mixed-precision forms included) not rounding to
    nearest, flushing or saturating — and approximate divisions — other than those ``exempt``
    says (default: the emulation's round-down adds, counted in their own fact)."""
    nonstd = Counter()
    for op, n in ops.items():
        parts = op.split(".")
        if parts[0] in kinds and any(p in ("f32", "f32x2") for p in parts[1:]):
            if exempt and exempt(op):
                continue
            rnd = next((p for p in parts if p in ("rn", "rz", "rm", "rp")), "rn")
            if rnd != "rn" or "ftz" in parts or "sat" in parts or "approx" in parts or "full" in parts:
                nonstd[op] += n
    return nonstd


def _p_conversions(ops: Counter) -> dict[str, int]:
    """The float32 -> P-dtype ``cvt`` instructions with their counts (at least one)."""
    cvt = {
        op: n for op, n in ops.items() if op.startswith("cvt.") and re.search(r"\.(bf16|f16|e4m3|e5m2)(x2)?\.f32$", op)
    }
    if not cvt:
        raise PtxFormatError("no float32 -> 16/8-bit conversion (cvt...f32): the P conversion was not found")
    return cvt


def kernel_facts(ptx: str, *, tile_n: int) -> dict:
    """The facts of the module doc for the forward kernel in ``ptx`` (``tile_n`` keys per
    softmax row tile, production's ``n_block_size``).  Values are JSON-able."""
    if ".entry" not in ptx:
        raise PtxFormatError("no .entry (kernel) in the PTX")
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    ins = instructions(ptx)
    ops = Counter(op for op, _ in ins)
    exp2 = _exp2_split(ops, tile_n)
    pairs, steps = exp2["pairs"], exp2["steps"]
    degree = poly_degree(ptx)
    fma2 = ops.get("fma.rn.f32x2", 0)
    thresholds = _rescale_thresholds(ins)
    offsets = _max_offsets(ptx)
    nonstd = nonstandard_arith(ops, kinds=("add", "sub", "mul", "fma", "div"))
    cvt = _p_conversions(ops)
    return {
        "target": target.group(1) if target else None,
        "lines": ptx.count("\n"),
        "exp2.hardware": dict(sorted(exp2["ex2"].items())),
        "exp2.emulated_pairs": pairs,
        "exp2.emulated_scalar": exp2["scalar"],
        "softmax.steps": steps,
        "softmax.rescale_ex2": exp2["extra"],
        "exp2.emulated_per_step": exp2["e"] / steps,
        "exp2.poly_degree": degree,
        "exp2.poly_coefficients": [float(c) for c in POLY_EX2[degree]] if degree else [],
        "exp2.fma_per_pair": (fma2 - steps * tile_n / 2) / pairs if pairs else None,
        "rescale.threshold": thresholds[0] if len(thresholds) == 1 else (0.0 if not thresholds else thresholds),
        "max_offset": offsets[0] if len(offsets) == 1 else (0.0 if not offsets else offsets),
        "arith.nonstandard": dict(sorted(nonstd.items())),
        "p_convert": dict(sorted(cvt.items())),
        "reciprocal": dict(sorted((op, n) for op, n in ops.items() if op.startswith("rcp."))),
        "tanh": sum(n for op, n in ops.items() if op.startswith("tanh.")),
        # float divisions only: the block-sparse forward's integer div.s32 (block indices) is no numerics
        "division": dict(sorted((op, n) for op, n in ops.items() if op.startswith("div.") and _is_float_op(op))),
    }
