"""Varlen kernels for the runner's varlen tests (tests/test_varlen_runner.py): the model's varlen
entry (``fa4.varlen.varlen_attention``) declared as a user kernel, seeded bugs of the serving
entry around it (each a mistake a varlen kernel makes: the keys' bookkeeping, not the
arithmetic), and the fixed-length model without a varlen entry (``run --per-sequence``).

Each bugged kernel declares the varlen contract (``fn.fa4_audit_contract = "varlen"``) and
breaks one varlen keyword before calling the model; ``VARLEN_BUGS`` maps its name to what it
breaks (its docstring).  They run the model's SM90 numerics (hardware exp2, the max updated at
every block): a user kernel is held to the generic flash-attention bound (``peer``), which the
SM100 numerics' polynomial exp2 and lazy rescaling are not meant to meet."""

import torch

from fa4.model import FA4Numerics, attention
from fa4.varlen import varlen_attention


def _varlen(fn):
    fn.fa4_audit_contract = "varlen"
    return fn


@_varlen
def clean(q, k, v, **kw):
    """The model's varlen entry, unchanged, as a user kernel (held to the generic bound)."""
    return _model(q, k, v, **kw)


def _model(q, k, v, **kw):
    return varlen_attention(q, k, v, arch="sm90", **kw)


@_varlen
def bug_ignores_seqused_k(q, k, v, *, seqused_k=None, **kw):
    """seqused_k ignored: every allocated key is attended (packed: up to cu_seqlens_k; paged: the
    page-table row's every page, unused slots included)."""
    return _model(q, k, v, **kw)


@_varlen
def bug_mixes_sequences(q, k, v, *, cu_seqlens_k=None, **kw):
    """Sequence boundaries in the packed keys off by one (without seqused_k): each sequence but
    the last takes the next sequence's first key, and loses its own first key to the previous one."""
    if cu_seqlens_k is not None and kw.get("seqused_k") is None:
        cu_seqlens_k = cu_seqlens_k.clone()
        cu_seqlens_k[1:-1] = torch.clamp(cu_seqlens_k[1:-1] + 1, max=int(cu_seqlens_k[-1]))
    return _model(q, k, v, cu_seqlens_k=cu_seqlens_k, **kw)


@_varlen
def bug_page_table_ignored(q, k, v, *, page_table=None, **kw):
    """The page table read as the identity: sequence i's pages taken as pool pages i*width ..
    (i+1)*width - 1 in order, as if the cache were not shuffled."""
    if page_table is not None:
        b, width = page_table.shape
        page_table = torch.arange(b * width, dtype=page_table.dtype, device=page_table.device).view(b, width)
    return _model(q, k, v, page_table=page_table, **kw)


VARLEN_BUGS = {
    name[len("bug_") :]: fn.__doc__ for name, fn in dict(globals()).items() if name.startswith("bug_") and callable(fn)
}


def fixed_model(q, k, v, *, return_lse=False, **kw):
    """The fixed-length model (no varlen entry) with the numerics the varlen entry gives a
    sequence of packed queries (SM100: no 2-CTA, ``varlen_q``), so that ``run --per-sequence``
    computes each sequence as the varlen entry does, bit for bit (unsplit cases)."""
    local = not kw.get("causal", False) and any(w is not None for w in kw.get("window_size", (None, None)))
    nm = FA4Numerics.sm100(
        q.dtype, q.shape[-1], kw.get("causal", False), local, seqlen_q=q.shape[1],
        qhead_per_kvhead=q.shape[2] // k.shape[2], head_dim_v=v.shape[-1], use_2cta=False, varlen_q=True,
    )  # fmt: skip
    return attention(q, k, v, return_lse=return_lse, numerics=nm, **kw)
