"""The audited callable's contract on what a kernel returns (README, "Audit your kernel";
``docs/varlen.md`` for the varlen entry): the output and LSE shapes and dtypes, and a
:class:`ContractBreach` per tensor that breaks them, named by the Case fields that size its axes,
with the fault it shows (axes swapped, a wrong size, another rank or dtype) so that a run's
breaches group by fault (``audits.verdict.separators``)."""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "OUT_AXES",
    "LSE_AXES",
    "ContractBreach",
    "breach_of",
    "contract_breaches",
    "contract_error",
    "varlen_contract_breaches",
    "varlen_contract_error",
]


#: the axes of the audited callable's output and LSE (README, "Audit your kernel"), named by the
#: Case fields that size them (``audits.suites.cases.Case``), as a shape error names them
OUT_AXES = ("batch", "seqlen_q", "heads_q", "dv")
LSE_AXES = ("batch", "heads_q", "seqlen_q")


@dataclasses.dataclass(frozen=True)
class ContractBreach:
    """One returned tensor that breaks the audited callable's contract: ``tensor`` ("out", "lse",
    "dq", "dk", "dv", "dsink"), what the contract expects (``expected`` shape with its ``axes``
    named, ``expected_dtype`` and the rule it follows, ``dtype_rule``) and what the kernel returned
    (``got`` shape and ``got_dtype``, both None when it is no tensor; ``got_type``, the type's
    name).  Its :attr:`reason` says the case's shapes; its :attr:`fault` the same breach without
    them, so that every case a kernel breaks the same way (a transposed output at any size) is one
    fault (``audits.verdict.separators.fault_groups``).  The record a report keeps: :meth:`as_record`
    (``audits.report.records.ContractRecord``)."""

    tensor: str
    axes: tuple[str, ...]
    expected: tuple[int, ...]
    expected_dtype: str
    dtype_rule: str
    got: tuple[int, ...] | None
    got_dtype: str | None
    got_type: str

    @property
    def shape_wrong(self) -> bool:
        return self.got is not None and self.got != self.expected

    @property
    def dtype_wrong(self) -> bool:
        return self.got_dtype is not None and self.got_dtype != self.expected_dtype

    def _shape_fault(self) -> str:
        """The shape's fault in axis names only: another number of axes; the axes whose sizes
        differ, "swapped" (two) or "permuted" (more) when their sizes are the expected ones in
        another order (a transposed tensor), else "wrong"."""
        got, want = self.got or (), self.expected
        if len(got) != len(want):
            return f"{len(got)} axes returned, {len(want)} expected ({', '.join(self.axes)})"
        off = [i for i in range(len(want)) if got[i] != want[i]]
        names = [self.axes[i] for i in off]
        if len(off) >= 2 and sorted(got[i] for i in off) == sorted(want[i] for i in off):
            return f"{' and '.join(names)} swapped" if len(off) == 2 else f"{', '.join(names)} permuted"
        return f"wrong {' and '.join(names)}"

    @property
    def fault(self) -> str:
        """The breach without the case's sizes: "seqlen_q and heads_q swapped", "wrong dv", "3 axes
        returned, 4 expected (...)", "dtype float32 returned (expected the input dtype, bfloat16 for
        fp8 inputs)", "a tuple returned, not a tensor"."""
        if self.got is None:
            return f"a {self.got_type} returned, not a tensor"
        parts = [self._shape_fault()] if self.shape_wrong else []
        if self.dtype_wrong:
            parts.append(f"dtype {self.got_dtype} returned (expected {self.dtype_rule})")
        return "; ".join(parts)

    @property
    def reason(self) -> str:
        """The breach with the case's sizes, after the tensor's name: "out: shape (1, 2, 17, 32)
        returned, (1, 17, 2, 32) expected (batch, seqlen_q, heads_q, dv): seqlen_q and heads_q swapped"."""
        want = f"{self.expected} ({', '.join(self.axes)}) and dtype {self.expected_dtype}"
        if self.got is None:
            return f"{self.tensor}: a {self.got_type} returned, a tensor of shape {want} expected"
        parts = []
        if self.shape_wrong:
            parts.append(
                f"shape {self.got} returned, {self.expected} expected ({', '.join(self.axes)}): {self._shape_fault()}"
            )
        if self.dtype_wrong:
            parts.append(f"dtype {self.got_dtype} returned, {self.expected_dtype} expected ({self.dtype_rule})")
        return f"{self.tensor}: {'; '.join(parts)}"

    def as_record(self) -> dict:
        """The JSON record (``audits.report.records.ContractRecord``): the fields, shapes as lists,
        with the :attr:`fault` and :attr:`reason` they say."""
        rec = dataclasses.asdict(self)
        rec["axes"], rec["expected"] = list(self.axes), list(self.expected)
        rec["got"] = None if self.got is None else list(self.got)
        return {**rec, "fault": self.fault, "reason": self.reason}


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def breach_of(
    *, tensor: str, got, expected: tuple[int, ...], axes: tuple[str, ...], dtype: torch.dtype, dtype_rule: str
) -> ContractBreach | None:
    """The :class:`ContractBreach` of returned ``got`` against the ``expected`` shape (its ``axes``
    named) and ``dtype`` (``dtype_rule``: that dtype's rule in words), or None when it keeps both."""
    is_tensor = isinstance(got, torch.Tensor)
    shape = tuple(got.shape) if is_tensor else None
    if is_tensor and shape == tuple(expected) and got.dtype == dtype:
        return None
    return ContractBreach(
        tensor=tensor,
        axes=tuple(axes),
        expected=tuple(int(n) for n in expected),
        expected_dtype=_dtype_name(dtype),
        dtype_rule=dtype_rule,
        got=shape,
        got_dtype=_dtype_name(got.dtype) if is_tensor else None,
        got_type=type(got).__name__,
    )


#: the output's dtype rule (README): the input dtype, bfloat16 for the 1-byte fp8 inputs
_OUT_DTYPE_RULE = "the input dtype, bfloat16 for fp8 inputs"


def _out_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if q.dtype.itemsize == 1 else q.dtype


def contract_breaches(*, q: torch.Tensor, v: torch.Tensor, out, lse) -> list[ContractBreach]:
    """How a kernel's returned ``out``/``lse`` break the audited-callable contract (README): out
    ``(batch, seqlen_q, heads_q, dv)`` (:data:`OUT_AXES`) in the input dtype (bfloat16 for fp8
    inputs), lse ``(batch, heads_q, seqlen_q)`` (:data:`LSE_AXES`) float32 when returned; each
    tensor's breach, empty when they keep it."""
    b, sq, hq, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]
    found = [
        breach_of(
            tensor="out",
            got=out,
            expected=(b, sq, hq, dv),
            axes=OUT_AXES,
            dtype=_out_dtype(q),
            dtype_rule=_OUT_DTYPE_RULE,
        )
    ]
    if lse is not None:
        found.append(
            breach_of(
                tensor="lse", got=lse, expected=(b, hq, sq), axes=LSE_AXES, dtype=torch.float32, dtype_rule="float32"
            )
        )
    return [x for x in found if x is not None]


def contract_error(q: torch.Tensor, v: torch.Tensor, out, lse) -> str | None:
    """Why a kernel's returned ``out``/``lse`` break the audited-callable contract
    (:func:`contract_breaches`, their reasons joined), None when they keep it."""
    found = contract_breaches(q=q, v=v, out=out, lse=lse)
    return "; ".join(x.reason for x in found) if found else None


def varlen_contract_breaches(*, q: torch.Tensor, v: torch.Tensor, out, lse, packed: bool) -> list[ContractBreach]:
    """How a varlen kernel's ``out``/``lse`` break the varlen contract (docs/varlen.md): out shaped
    as q with v's head dim, in the input dtype (bf16 for fp8); lse (heads_q, total_q) when q is
    packed, else (batch, heads_q, seqlen_q), float32.  Empty when they keep it."""
    axes = ("total_q", "heads_q", "dv") if packed else OUT_AXES
    want = (*q.shape[:-1], v.shape[-1])
    found = [
        breach_of(tensor="out", got=out, expected=want, axes=axes, dtype=_out_dtype(q), dtype_rule=_OUT_DTYPE_RULE)
    ]
    if lse is not None:
        want_lse, lse_axes = ((q.shape[-2], q.shape[0]), ("heads_q", "total_q")) if packed else (
            (q.shape[0], q.shape[2], q.shape[1]), LSE_AXES)  # fmt: skip
        found.append(
            breach_of(
                tensor="lse", got=lse, expected=want_lse, axes=lse_axes, dtype=torch.float32, dtype_rule="float32"
            )
        )
    return [x for x in found if x is not None]


def varlen_contract_error(q: torch.Tensor, v: torch.Tensor, out, lse, *, packed: bool) -> str | None:
    """Why a varlen kernel's ``out``/``lse`` break the varlen contract
    (:func:`varlen_contract_breaches`, their reasons joined), None when they keep it."""
    found = varlen_contract_breaches(q=q, v=v, out=out, lse=lse, packed=packed)
    return "; ".join(x.reason for x in found) if found else None
