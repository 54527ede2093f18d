"""A kernel that supports less than FA4, as most kernels under audit do: fp16 only, seqlen_q ==
seqlen_k in multiples of 128, head dims 64 and 128, causal or not, GQA, no window, softcap or
sink.  It declares that domain, so ``fa4-audit run --suite smoke|release`` builds its suite
inside it instead of skipping most cases:

    fa4-audit run --kernel examples/restricted_kernel.py:attention --suite smoke
"""

import math

import torch


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
              learnable_sink=None, return_lse=False):  # fmt: skip
    if q.dtype != torch.float16 or q.shape[1] != k.shape[1] or q.shape[1] % 128:
        raise NotImplementedError("fp16, seqlen_q == seqlen_k, multiples of 128 only")
    _, s, hq, d = q.shape
    g = hq // k.shape[2]
    # float64 throughout: this example is about the domain, not the arithmetic.  In float32, torch's
    # CPU logsumexp on 2 threads was measured 3.1e-5 off for one batch in about 1 run of 5 (CI;
    # ATEN_CPU_CAPABILITY=default here), 2.65x the bound; the audit then rightly fails the kernel.
    qf, kf, vf = q.double(), k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    scores = torch.einsum("bihd,bjhd->bhij", qf, kf) * (1 / math.sqrt(d) if softmax_scale is None else softmax_scale)
    if causal:  # equal lengths: key j visible to query i iff j <= i
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhij,bjhc->bihc", torch.exp(scores - lse.unsqueeze(-1)), vf).half()
    return (out, lse.float()) if return_lse else out


attention.fa4_audit_domain = {
    "dtypes": ["float16"], "head_dims": [[64, 64], [128, 128]], "seqlen_multiple": 128, "equal_seqlens": True,
    "max_seqlen": 8192, "causal": True, "local": False, "softcap": False, "sink": False, "gqa": True,
    "layouts": ["contiguous", "strided"], "backward": True, "deterministic": True,
}  # fmt: skip
