"""The README's reference kernel (``examples/reference_kernel.py``) takes the mods as the contract
gives them (docs/mods.md): score_mod, mask_mod, aux_tensors, aux_scalars and block sparsity, the
same keywords ``audits.suites.inputs.make_inputs`` builds for the run, and computes what the FP64
reference computes with them.  (Its smoke run, mod cases included, is ``tests/test_readme.py``'s
slow test; the runtime scalars of ``temperature`` are in no smoke case, hence this one.)"""

import pytest
import torch

from audits.suites.cases import Case
from audits.suites.domain import domain_of
from audits.suites.inputs import make_inputs
from examples.reference_kernel import attention
from numerics.call import AttentionCall
from numerics.reference import attention_reference

SHAPE = dict(dtype="bfloat16", d=64, dv=64, batch=2, heads_q=4, heads_kv=2, seqlen_q=200, seqlen_k=300)
CASES = {
    # a runtime scalar (aux_scalars) with a block-sparse document mask (aux tensors, partial blocks)
    "aux_scalars": Case(**SHAPE, score_mod="temperature", mask_mod="document", block_sparse=(128, 128), seed=1),
    # a per-head aux tensor (ALiBi's slopes) with prefix-LM beside causal=True, and a learnable sink
    "aux_tensors": Case(**SHAPE, score_mod="alibi", mask_mod="prefix_lm", causal=True, sink=True, seed=2),
}
#: the kernel's float32 result rounded to bf16, against the float64 reference: the rounding of the
#: output (2**-8 relative) and float32's error, far below; the LSE is not rounded
OUT_TOL, LSE_TOL = 2**-7, 1e-4


def test_the_reference_kernel_declares_every_mod_kind():
    assert domain_of(attention).mods == ("score_mod", "mask_mod", "block_sparse", "aux_scalars")


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_reference_kernel_computes_the_mods(name):
    x = make_inputs(CASES[name])
    q, k, v, kw = x["q"], x["k"], x["v"], x["kw"]
    mods = {n for n in ("score_mod", "mask_mod", "aux_tensors", "aux_scalars", "block_sparse_tensors") if n in kw}
    assert mods >= {"score_mod", "mask_mod", "aux_tensors"}, mods
    ref, ref_lse = attention_reference(q, k, v, call=AttentionCall.from_kwargs(**kw), return_lse=True)
    out, lse = attention(q, k, v, return_lse=True, **kw)
    scale = float(ref.abs().max())
    err = float((out.double() - ref).abs().max())
    fin = torch.isfinite(ref_lse)
    assert err <= OUT_TOL * scale, f"{name}: out is {err:.3g} from the FP64 reference (outputs up to {scale:.3g})"
    assert torch.equal(fin, torch.isfinite(lse)) and float((lse.double() - ref_lse)[fin].abs().max()) <= LSE_TOL
    # the case discriminates: the kernel without the mods is far from the reference
    plain = attention(q, k, v, **{n: val for n, val in kw.items() if n not in mods})
    assert float((plain.double() - ref).abs().max()) > 10 * OUT_TOL * scale, f"{name}: the mods change nothing here"
