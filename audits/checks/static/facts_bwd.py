"""Numerics facts of production's compiled SM100 *backward*, read from its PTX text.

One backward call compiles several kernels (``fa4.sm100_compile --backward`` writes them into
one text, each after a ``// fa4-audit kernel: CLASS`` line): the preprocess
(``flash_bwd_preprocess.py`` ``FlashAttentionBackwardPreprocess``), the main kernel
(``flash_bwd_sm100.py`` ``FlashAttentionBackwardSm100``; for head dims (256, 256)
``sm100_hd256_2cta_fmha_backward.py`` ``BlackwellFusedMultiHeadAttentionBackward``, whose module
holds two ``.entry`` kernels, dQ and dK/dV) and the postprocesses (``flash_bwd_postprocess.py``
``FlashAttentionBackwardPostprocess``: dQ; dK and dV with GQA).  What is extracted
(``backward_facts``), and how — each rule checked against the sm_100a PTX of flash-attn-4
4.0.0b36, cutlass-dsl 4.8.1:

* ``exp2.hardware``: the ``ex2`` instructions of every kernel, with modifiers.  The main kernel's
  P = exp2(S * scale_log2 - lse_log2) is ``cute.math.exp2(..., fastmath=True)``
  (``FlashAttentionBackwardSm100.compute_loop``; hd256: ``..._dqkernel.py`` /
  ``..._dkdvkernel.py``), which is ``ex2.approx.ftz.f32``.
* ``exp2.emulated`` / ``exp2.poly_degree``: the polynomial exp2's signature (``utils
  .ex2_emulation(_2)``): its round-down adds (``add.rm`` / ``sub.rm``, f32 or f32x2) and a full set
  of ``POLY_EX2`` coefficients among the float immediates (``facts.poly_degree``).
* ``p_convert`` / ``ds_convert``: the 16-bit ``cvt`` instructions of the main kernel(s),
  classified by data flow (``_Dataflow``): a conversion whose operands are ``ex2`` results is P's
  (``utils.cvt_f16(tSrS_cur, ...)`` after the exp2); one whose operands are a float32 multiply
  or fma with a P or dS operand is dS's (``dS = P * (dP - D)``, ``sub_packed_f32x2`` then
  ``mul_packed_f32x2``; softcap's ``* (1 - t*t)``; hd256's dQ kernel's ``* scale``).  Moves
  (packing two f32 into a 64-bit register and back) are looked through.
* ``out_convert``: the main kernel's other 16-bit conversions, the gradients it writes in the
  input dtype (dK / dV, ``epilogue_dKV``; absent when GQA sends them to the float32 accumulators;
  hd256 also writes dQ).  ``main.entries``: per ``.entry`` (named by the class in its name) the
  ``ex2`` count and the P and dS elements converted (two per ``x2``): one dS per exp2, and one P
  per exp2 where dV = P^T dO is computed.
* ``reduce`` / ``reduce.targets``: the global reductions of the main kernel(s)
  (``cp.reduce.async.bulk...``, ``red.global...``, ``atom.global...``) with their counts, and how
  many distinct kernel parameters their addresses come from (the address's base pointer, traced
  through the ``add``/``mov`` chain to its ``ld.param``): dQaccum (``dQacc_reduce``,
  ``copy_utils.cpasync_reduce_bulk_add_f32``), plus dK_accum and dV_accum with GQA
  (``epilogue_dKV``'s reduce-add).  ``reduce.flush``: those of them that flush subnormal inputs
  and results to zero by the PTX ISA's definition (``_flushes_subnormals``: every ``.add.f32`` to
  global memory; PTX ISA, ``cp.reduce.async.bulk``: "The current implementation of
  cp.reduce.async.bulk.add.f32 flushes subnormal inputs and results to sign-preserving zero").
* ``tanh``: ``tanh.approx`` count in the main kernel (softcap, ``utils.create_softcap_scoremod``).
* ``postprocess.convert`` / ``postprocess.convert_reads``: the postprocesses' 16-bit conversions
  and the float32 operation feeding them (``FlashAttentionBackwardPostprocess``: ``acc * scale``
  then the cast).
* ``preprocess.fold``: the order in which a preprocess thread folds its products for D =
  rowsum(O * dO) — each distinct order of its FFMA chains (``fma.rn.f32`` from 0), as the
  column offsets from the thread's first column, traced from the 128-bit loads (``[ptr+bytes]``,
  word, low/high half) through the ``mov.b32 {lo, hi}`` unpacking and the ``cvt.f32`` to each
  FFMA operand.  Production's is element-major across a thread's 8-column chunks (0, 128, 1,
  129, ... at head dim 256), which ``fa4.model_bwd.row_dot`` models.
* ``arith.nonstandard``: every float32 add/sub/mul/fma/div (packed and mixed-precision forms
  included) of any kernel with a rounding other than ``.rn`` (no modifier means ``.rn``), with
  ``.ftz`` or ``.sat``, or an approximate division (``div.approx`` / ``div.full``).  Unlike the
  forward, nothing is exempt: the backward has no emulated exp2.

A text these rules do not understand raises :class:`PtxFormatError`; no fact is defaulted.
"""

from __future__ import annotations

import re
from collections import Counter

from audits.checks.static.facts import PtxFormatError, instructions, nonstandard_arith, poly_degree
from fa4.sm100_compile import AUX_KERNELS, KERNEL_MARK

__all__ = ["backward_facts", "split_kernels", "KERNEL_MARK"]

_REG = re.compile(r"%[a-z]+\d+")
_CVT16 = re.compile(r"cvt\.[a-z.]*(bf16|f16)(x2)?\.f32$")
_ARITH = ("add", "sub", "mul", "fma", "div")
_REDUCE = re.compile(r"(cp\.reduce\.async\.bulk|red|atom)\.")
_FLOAT = {"f32", "f64", "f16", "bf16", "f16x2", "bf16x2"}  # integer atomics (semaphores) are no gradient


def split_kernels(text: str) -> list[tuple[str, str]]:
    """``[(class, module PTX)]`` of a backward OUT.ptx, in compile order."""
    parts = re.split(r"^" + re.escape(KERNEL_MARK) + r"(\S+)\n", text, flags=re.M)
    if len(parts) < 3 or parts[0].strip():
        raise PtxFormatError(f"no '{KERNEL_MARK}CLASS' line before the first kernel: not a backward compile")
    return list(zip(parts[1::2], parts[2::2]))


def _entries(ptx: str) -> list[str]:
    """The body of each ``.entry`` of a module (PTX text up to the next one)."""
    starts = [m.start() for m in re.finditer(r"^\s*(?:\.visible\s+)?\.entry\s", ptx, re.M)]
    if not starts:
        raise PtxFormatError("no .entry (kernel) in the PTX")
    return [ptx[a:b] for a, b in zip(starts, starts[1:] + [len(ptx)])]


class _Dataflow:
    """Last definition of every register of one ``.entry``: ``reg -> (op, source registers)``.
    A destination in braces (``mov.b64 {%r1, %r2}, %rd3``, ``tcgen05.ld {...}``) defines each
    register; an instruction whose first operand is an address (``st``, ``red``, ``cp``) none."""

    def __init__(self, ins: list[tuple[str, str]]):
        self.defs: dict[str, tuple[str, tuple[str, ...]]] = {}
        for op, args in ins:
            args = args.strip()
            if args.startswith("["):
                continue
            cut = args.find("}") + 1 if args.startswith("{") else args.find(",") + 1 or len(args)
            dst, src = args[:cut], args[cut:]
            for r in _REG.findall(dst):
                self.defs[r] = (op, tuple(_REG.findall(src)))

    def values(self, reg: str) -> list[tuple[str, tuple[str, ...]]]:
        """The value-producing definitions ``reg`` comes from, looking through ``mov`` and ``selp``."""
        out, todo, seen = [], [reg], set()
        while todo:
            r = todo.pop()
            if r in seen or r not in self.defs:
                continue
            seen.add(r)
            op, srcs = self.defs[r]
            if op.startswith(("mov.", "selp.")):  # selp: a masked value or the constant it is replaced by
                todo += [x for x in srcs if not x.startswith("%p")]  # a predicate is no value
            else:
                out.append((op, srcs))
        return out

    def kind(self, reg: str, depth: int = 4) -> str:
        """``"P"`` (an ``ex2`` result), ``"dS"`` (a float32 mul/fma of a P or dS value) or ``"other"``."""
        vals = self.values(reg)
        if vals and all(op.startswith("ex2.") for op, _ in vals):
            return "P"
        if depth and vals and all(_is_f32_arith(op, ("mul", "fma")) for op, _ in vals):
            if any(self.kind(s, depth - 1) in ("P", "dS") for _, srcs in vals for s in srcs):
                return "dS"
        return "other"


def _is_f32_arith(op: str, kinds=_ARITH) -> bool:
    parts = op.split(".")
    return parts[0] in kinds and any(p in ("f32", "f32x2") for p in parts[1:])


def _params(ptx: str) -> dict[str, str]:
    """``%rdN -> parameter symbol`` of every ``ld.param`` (so that base pointers can be named)."""
    return {m.group(1): m.group(2) for m in re.finditer(r"ld\.param\.\w+\s+(%rd\d+),\s*\[([^\]]+)\]", ptx)}


def _conversions(ins: list[tuple[str, str]], flow: _Dataflow) -> dict[str, Counter]:
    """An entry's 16-bit conversions by what they convert: ``{"P", "dS", "other"} -> Counter``."""
    out = {"P": Counter(), "dS": Counter(), "other": Counter()}
    for op, args in ins:
        if _CVT16.search(op):
            srcs = _REG.findall(args.partition(",")[2])
            kinds = {flow.kind(s) for s in srcs}
            out[kinds.pop() if len(kinds) == 1 else "other"][op] += 1
    return out


def _reductions(ins: list[tuple[str, str]], flow: _Dataflow, params: dict[str, str]) -> tuple[Counter, set[str]]:
    """An entry's reductions to global memory ``{op: n}`` and the parameters their addresses come
    from (the base pointer: the first operand of each ``add`` / ``mov`` / ``cvta``, back to an
    ``ld.param``).  Integer atomics and reductions into shared memory are skipped."""
    ops, targets = Counter(), set()
    for op, args in ins:
        if _REDUCE.match(op) and ".shared" not in op.split(".global")[0] and _FLOAT.intersection(op.split(".")):
            ops[op] += 1
            addr = re.search(r"\[(%rd\d+)", args)
            reg = addr.group(1) if addr else None
            while reg is not None and reg not in params:
                reg = _first_source(flow, reg)
            if reg is None:
                raise PtxFormatError(f"the address of '{op} {args}' does not trace to a kernel parameter")
            targets.add(params[reg])
    return ops, targets


def _first_source(flow: _Dataflow, reg: str) -> str | None:
    op, srcs = flow.defs.get(reg, ("", ()))
    return srcs[0] if srcs and op.startswith(("add.", "mov.", "cvta.")) else None


def _elements(cvt: Counter) -> int:
    return sum(n * (2 if op.split(".")[-2].endswith("x2") else 1) for op, n in cvt.items())


def _entry_class(entry: str) -> str:
    """The kernel class an ``.entry`` name carries (``..._dqkernelBlackwell...DQKernel_object_at_...``)."""
    m = re.search(r"\.entry\s+\S*?([A-Z]\w*?)_object_at_", entry)
    if not m:
        raise PtxFormatError(f"no kernel class in the entry name {entry.split('(')[0].strip()[:120]!r}")
    return m.group(1)


def _flushes_subnormals(op: str) -> bool:
    """A float32 add reduction to global memory: the PTX ISA says its current implementation
    flushes subnormal inputs and results to sign-preserving zero (``red``: "red.add.f32 on global
    memory"; ``cp.reduce.async.bulk``: "cp.reduce.async.bulk.add.f32"); the f16 / bf16 forms take
    ``.noftz`` and keep subnormals."""
    parts = op.split(".")
    return "add" in parts and "f32" in parts and "noftz" not in parts


def _main_facts(modules: list[tuple[str, str]]) -> dict:
    """P / dS / output conversions, reductions and tanh of the main kernel(s), and per entry the
    ``ex2`` count against the P and dS elements converted."""
    conv = {"P": Counter(), "dS": Counter(), "other": Counter()}
    reduce, targets, tanh, per_entry = Counter(), set(), 0, {}
    for _, ptx in modules:
        for entry in _entries(ptx):
            ins = instructions(entry)
            flow = _Dataflow(ins)
            c = _conversions(ins, flow)
            for k in conv:
                conv[k] += c[k]
            r, t = _reductions(ins, flow, _params(entry))
            reduce, targets = reduce + r, targets | t
            ops = Counter(op for op, _ in ins)
            tanh += sum(n for op, n in ops.items() if op.startswith("tanh."))
            ex2 = sum(n for op, n in ops.items() if op.startswith("ex2."))
            per_entry[_entry_class(entry)] = {"ex2": ex2, "P": _elements(c["P"]), "dS": _elements(c["dS"])}
    return {
        "p_convert": dict(sorted(conv["P"].items())),
        "ds_convert": dict(sorted(conv["dS"].items())),
        "out_convert": dict(sorted(conv["other"].items())),
        "main.entries": per_entry,
        "reduce": dict(sorted(reduce.items())),
        "reduce.targets": len(targets),
        "reduce.flush": sorted(op for op in reduce if _flushes_subnormals(op)),
        "tanh": tanh,
        "main.ex2": sum(e["ex2"] for e in per_entry.values()),
    }


_LOAD4 = re.compile(r"ld\.global[.\w]*\.v4\.b32\s+\{(%r\d+), (%r\d+), (%r\d+), (%r\d+)\}, \[%rd\d+(?:\+(\d+))?\]")
_UNPACK = re.compile(r"mov\.b32\s+\{(%rs\d+), (%rs\d+)\}, (%r\d+)")
_WIDEN = re.compile(r"cvt\.f32\.b?f16\s+(%r\d+), (%rs\d+)")
_ZERO = re.compile(r"mov\.[bf]32\s+(%r\d+), 0f00000000;")


def _fold_orders(ptx: str) -> list[list[int]]:
    """The preprocess's accumulation chains, each as the column offsets of its products in order
    (16-bit elements: a load's byte offset / 2, two per 32-bit word, low half first).  A chain
    starts from 0 (an immediate, or a register moved from one) and takes a product per step,
    either fused (``fma.rn.f32.bf16`` on the 16-bit halves, or ``fma.rn.f32`` on their
    ``cvt.f32`` widenings) or as ``mul.f32`` then ``add.f32`` (the same sum: a product of two
    16-bit values is exact in float32)."""
    word = {}
    for m in _LOAD4.finditer(ptx):
        for w in range(4):
            word[m.group(w + 1)] = int(m.group(5) or 0) // 2 + 2 * w
    col = {}
    for m in _UNPACK.finditer(ptx):
        if m.group(3) in word:
            col[m.group(1)], col[m.group(2)] = word[m.group(3)], word[m.group(3)] + 1
    col.update({m.group(1): col[m.group(2)] for m in _WIDEN.finditer(ptx) if m.group(2) in col})
    zero = {"0f00000000"} | {m.group(1) for m in _ZERO.finditer(ptx)}
    prod, chains = {}, {}
    for op, args in instructions(ptx):
        regs = [x.strip() for x in args.rstrip(";").split(",")]
        kind = op.split(".")[0]
        if kind == "mul" and "f32" in op and len(regs) == 3 and regs[1] in col:
            prod[regs[0]] = col[regs[1]]
        elif kind in ("fma", "add") and "f32" in op.split("."):
            d, terms, acc = regs[0], regs[1:-1] if kind == "fma" else regs[1:], regs[-1]
            if kind == "fma":
                step = col.get(terms[0])
            else:
                acc, step = (terms[1], prod.get(terms[0])) if terms[0] in prod else (terms[0], prod.get(terms[1]))
            if step is None:
                continue
            if acc in chains:
                chains[d] = chains.pop(acc) + [step]
            elif acc in zero:
                chains[d] = [step]
    orders = sorted({tuple(v) for v in chains.values()})
    if not orders:
        raise PtxFormatError(
            "no accumulation chain over loaded O * dO products in the preprocess: a form the extractor lacks"
        )
    return [list(o) for o in orders]


def _postprocess_facts(modules: list[tuple[str, str]]) -> dict:
    """The postprocesses' conversions and the operations whose results they convert."""
    conv, reads = Counter(), set()
    for _, ptx in modules:
        for entry in _entries(ptx):
            ins = instructions(entry)
            flow = _Dataflow(ins)
            for op, args in ins:
                if _CVT16.search(op):
                    conv[op] += 1
                    reads |= {v for s in _REG.findall(args.partition(",")[2]) for v, _ in flow.values(s)}
    return {"postprocess.convert": dict(sorted(conv.items())), "postprocess.convert_reads": sorted(reads)}


def backward_facts(text: str) -> dict:
    """The facts of the module doc for one backward call's kernels (``fa4.sm100_compile
    --backward`` output).  Values are JSON-able."""
    kernels = split_kernels(text)
    main = [(c, p) for c, p in kernels if c not in AUX_KERNELS]
    post = [(c, p) for c, p in kernels if c == AUX_KERNELS[1]]
    pre = [p for c, p in kernels if c == AUX_KERNELS[0]]
    if len(pre) != 1:
        raise PtxFormatError(f"expected one {AUX_KERNELS[0]}, got {len(pre)}")
    if len(main) != 1:
        raise PtxFormatError(f"expected one main backward kernel, got {[c for c, _ in main]}")
    ops = Counter(op for _, p in kernels for op, _ in instructions(p))
    arch = {re.search(r"^\.target\s+(\S+)", p, re.M) for _, p in kernels}
    facts = {
        "kernels": [c for c, _ in kernels],
        "entries": [len(_entries(p)) for _, p in kernels],
        "target": sorted({t.group(1) if t else None for t in arch}, key=str),
        "exp2.hardware": dict(sorted((op, n) for op, n in ops.items() if op.startswith("ex2."))),
        "exp2.emulated": sum(n for op, n in ops.items() if re.fullmatch(r"(add|sub)\.rm(\.ftz)?\.f32(x2)?", op)),
        "exp2.poly_degree": poly_degree(text),
        "arith.nonstandard": dict(sorted(nonstandard_arith(ops, exempt=None, kinds=_ARITH).items())),
        **_main_facts(main),
        **_postprocess_facts(post),
        "preprocess.fold": _fold_orders(pre[0]),
    }
    if not facts["main.ex2"]:
        raise PtxFormatError(f"no ex2 in {main[0][0]}: not an attention backward, or a form the extractor lacks")
    return facts
