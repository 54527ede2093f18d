"""Kernels for tests/test_coverage.py: the SM90 model behind a declared domain of two head dims
(bf16, d = dv in {64, 96}) and an architecture, as a kernel author would declare them."""

from audits.kernels import KERNELS


def two_head_dims(q, k, v, **kw):
    """The SM90 model, declared for head dims 64 and 96 only."""
    return KERNELS["fa4-model-sm90"](q, k, v, **kw)


two_head_dims.fa4_audit_domain = {"dtypes": ["bfloat16"], "head_dims": [[64, 64], [96, 96]]}
two_head_dims.fa4_audit_arch = "sm90"


def bad_arch(q, k, v, **kw):
    """A kernel declaring an architecture fa4-audit knows no classes of."""
    return KERNELS["fa4-model-sm90"](q, k, v, **kw)


bad_arch.fa4_audit_arch = "sm75"
