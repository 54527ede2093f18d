"""A visible score of +inf (a -inf in K meeting a negative q) under a left window.

Production FA4 (flash-attn-4 4.0.0b36) gives such a row a NaN row sum (row max +inf, so
``Softmax.online_softmax`` computes exp2(inf - inf) = NaN at that key), ``Softmax.finalize``
reports LSE -inf for a NaN row sum, and ``FlashAttentionBackwardPreprocess`` maps LSE -inf to
``lse_log2 = 0``: the backward recomputes the row's P as the unnormalised exp2(S * scale_log2), so
dV of every key the row sees gets a finite but arbitrary term.  The row's softmax is inf/inf,
indeterminate: the FP64 reference makes its P NaN at every key the row sees
(``numerics.grad_reference``), so the audit judges those dV elements a semantics deviation
(policy ``nan_swallowed``), not an accuracy failure.  Before that rule the reference put P = 0 at
the row's finite keys and the FA criterion failed the model on dV (the smoke suite's local
``nan_inf_visible`` case, commit 0c1063b).
"""

import json
import math
import re

import torch

from audits import cli
from fa4.model import FA4Numerics, attention
from numerics.call import AttentionCall
from numerics.grad_reference import attention_grad_reference

# query i sees keys i + 2 .. i + 5 (seqlen_q 4, seqlen_k 8, window (2, 1)): key 2 only by query 0
SQ, SK, WINDOW = 4, 8, (2, 1)


def _inputs(dtype=torch.float64, d=16):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, SQ, 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, SK, 1, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, SK, 1, d, generator=g, dtype=torch.float64)
    do = torch.randn(1, SQ, 1, d, generator=g, dtype=torch.float64)
    q[0, 0, 0, 0] = -1.0
    k[0, 2, 0, 0] = -math.inf  # score (0, 2) = +inf; every other score finite
    return tuple(t.to(dtype) for t in (q, k, v, do))


def test_reference_row_with_a_plus_inf_score_has_nan_p_at_every_key_it_sees():
    q, k, v, do = _inputs()
    r = attention_grad_reference(q, k, v, do, call=AttentionCall(window_size=WINDOW))
    assert r["lse"][0, 0, 0] == math.inf and torch.isnan(r["out"][0, 0]).all()
    assert torch.isfinite(r["lse"][0, 0, 1:]).all() and torch.isfinite(r["out"][0, 1:]).all()
    # dV of keys 2..5 (query 0 sees them) is NaN; keys 6, 7 (queries 1..3 only) stay finite
    assert torch.isnan(r["dv"][0, 2:6]).all(), r["dv"][0, :, 0, 0]
    assert torch.isfinite(r["dv"][0, 6:]).all() and (r["dv"][0, :2] == 0).all()
    # dQ of query 0, dK of the keys it sees: NaN (D of the row is NaN), as before
    assert torch.isnan(r["dq"][0, 0]).all() and torch.isnan(r["dk"][0, 2:6]).all()
    assert torch.isfinite(r["dq"][0, 1:]).all() and torch.isfinite(r["dk"][0, 6:]).all()


def test_model_follows_production_lse_minus_inf_and_unnormalised_backward_p():
    """The model's behaviour on that row is production's (module doc): LSE -inf, and with dO
    zero on every other row, dV of each finite key the row sees is exp2(S * scale_log2) * dO_0
    (P in bf16, the dV MMA in float32, dV rounded to bf16), not 0."""
    q, k, v, do = _inputs(torch.bfloat16, d=64)
    do[:, 1:] = 0
    nm = FA4Numerics.sm90(torch.bfloat16, 64, local=True)
    q_, k_, v_ = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = attention(q_, k_, v_, window_size=WINDOW, return_lse=True, numerics=nm)
    assert lse[0, 0, 0] == -math.inf and torch.isfinite(lse[0, 0, 1:]).all()
    (dv,) = torch.autograd.grad(out, (v_,), do)
    s = (q[0, 0, 0].double() @ k[0, 3:6, 0].double().T).float()
    p = torch.exp2(s * torch.tensor(math.log2(math.e) / 8, dtype=torch.float32)).to(torch.bfloat16).double()
    want = p[:, None] * do[0, 0, 0].double()[None]
    assert torch.allclose(dv[0, 3:6, 0].double(), want, rtol=2**-7, atol=1e-6), (dv[0, 3:6, 0, :4], want[:, :4])
    assert (dv[0, 3:6, 0] != 0).any()


def test_smoke_local_nan_inf_visible_case_is_a_semantics_deviation_not_a_failure(tmp_path, capsys):
    """The reported case, scaled down: seqlen 16 x 256, window (112, 4): query 0 alone sees the
    +inf score at key 128; of the keys its dV term reaches, 129..138 are otherwise seen only by
    finite rows (1..10; rows 11.. see the NaN key 255).  Keys 0..127, unseen, fill the first KV
    tile, which neither pass visits (no 0 * NaN leak into dK there)."""
    cfg = {"dtype": "bfloat16", "d": 64, "dv": 64, "heads_q": 2, "heads_kv": 2, "seqlen_q": 16, "seqlen_k": 256,
           "window": [112, 4], "family": "nan_inf_visible"}  # fmt: skip
    for kernel in ("fa4-model-sm90", "fa4-model"):
        out = tmp_path / kernel
        argv = ["run", "--kernel", kernel, "--config", json.dumps(cfg), "--backward", "--device", "cpu"]
        rc = cli.main([*argv, "--out", str(out), "--quiet"])
        (c,) = json.loads((out / "report.json").read_text())["cases"]
        why = " ".join(c["reasons"])
        assert rc == 0 and c["verdict"] == "warn", (kernel, c["verdict"], why, capsys.readouterr())
        assert "FA criterion" not in why, (kernel, why)
        # the deviation in words: what the kernel returns where the FP64 dV is NaN, and why it is NaN
        dev = r"dv elements: the kernel returns a finite value.* where the FP64 gradient is NaN \(from NaN or inf"
        assert re.search(dev + r" inputs\) — a semantics deviation", why), (kernel, why)
