"""Where production's SM90 backward goes wrong with the bias score mods (H200, not a test).

benchmarks/experiments/h200_mods.py found production's gradients non-finite with ALiBi and relbias (both read
aux tensors) and right with softcap (no aux tensor).  This probe separates the suspects, each a
score mod whose backward passes the gradient through (``return grad_out_SSA``):

* ``const``: ``s + 0.25 * (kv - q)``, no aux tensor;
* ``aux_head``: ``s + aux[0][h]``, an aux read indexed by the head only;
* ``aux_dist``: ``s + aux[0][kv - q + 512]``, an aux read indexed by the distance;
* ``alibi``: the library's (aux read by head, times the distance).

Each: production forward + backward (``flash_attn_func``, b2 h4/2 256x384 d128 bf16) against the
float64 reference of the same function: non-finite count and max relative error per tensor.

    . benchmarks/device/h200_env.sh && python benchmarks/experiments/h200_mods_bwd_probe.py --out $OUT
"""

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fa4.mods import build_mods  # noqa: E402
from numerics.call import AttentionCall  # noqa: E402
from numerics.grad_reference import attention_grad_reference  # noqa: E402
from numerics.mods import ScoreMod  # noqa: E402


def _forms():
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def const_mod(acc_S_SSA, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return acc_S_SSA + (kv_idx - q_idx).to(cutlass.Float32) * 0.25

    @cute.jit
    def aux_head_mod(acc_S_SSA, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        t = aux_tensors[0]
        h = cute.make_rmem_tensor(1, cutlass.Int32)
        h.store(head_idx)
        v = cute.make_rmem_tensor(1, cutlass.Float32)
        v[0] = t[h[0]]
        return acc_S_SSA + v.load()

    @cute.jit
    def aux_dist_mod(acc_S_SSA, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        t = aux_tensors[0]
        r = cute.make_rmem_tensor(1, cutlass.Int32)
        r.store(kv_idx - q_idx + 512)
        v = cute.make_rmem_tensor(1, cutlass.Float32)
        v[0] = t[r[0]]
        return acc_S_SSA + v.load()

    @cute.jit
    def passthrough_bwd(grad_out_SSA, score_SSA, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad_out_SSA

    return const_mod, aux_head_mod, aux_dist_mod, passthrough_bwd


def _variants(dev):
    const_mod, aux_head_mod, aux_dist_mod, bwd = _forms()
    g = torch.Generator().manual_seed(7)
    head_bias = torch.randn(4, generator=g).float().to(dev)
    dist_bias = torch.randn(1024, generator=g).float().to(dev)
    one = lambda g_, s, *a: g_ * torch.ones_like(s)  # noqa: E731
    out = {
        "const": (ScoreMod("const", lambda s, b, h, q, kv, aux: s + (kv - q).to(s.dtype) * 0.25, one), [], const_mod),
        "aux_head": (ScoreMod("aux_head", lambda s, b, h, q, kv, aux: s + aux[0][h].to(s.dtype), one), [head_bias],
                     aux_head_mod),
        "aux_dist": (ScoreMod("aux_dist", lambda s, b, h, q, kv, aux: s + aux[0][kv - q + 512].to(s.dtype), one),
                     [dist_bias], aux_dist_mod),
    }  # fmt: skip
    return out, bwd


def _compare(got: dict, ref: dict) -> dict:
    res = {}
    for n in ("out", "dq", "dk", "dv"):
        x, r = got[n].double(), ref[n].double()
        res[n] = {
            "nonfinite": int((~torch.isfinite(x)).sum()),
            "rel": float((x - r).abs().nan_to_num(math.inf).max() / r.abs().max()),
        }
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--heads-kv", type=int, default=2, help="KV heads (4 query heads): 4 = MHA, 2 = GQA 2:1")
    ap.add_argument("--d", type=int, default=128, help="head dim")
    ap.add_argument("--tag", default="", help="suffix of the JSON written (bwd_probe{tag}.json)")
    args = ap.parse_args()
    from flash_attn.cute import flash_attn_func

    dev = "cuda"
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 256, 4, args.d, generator=g).to(torch.bfloat16).to(dev)
    k = torch.randn(2, 384, args.heads_kv, args.d, generator=g).to(torch.bfloat16).to(dev)
    v = torch.randn(2, 384, args.heads_kv, args.d, generator=g).to(torch.bfloat16).to(dev)
    do = torch.randn(2, 256, 4, args.d, generator=g).to(torch.bfloat16).to(dev)
    variants, bwd = _variants(dev)
    lib = build_mods(score_mod="alibi", batch=2, heads_q=4, seqlen_q=256, seqlen_k=384, seed=0, device=dev)
    variants["alibi"] = (lib["score_mod"], lib["aux_tensors"], None)
    report = {}
    for name, (mod, aux, form) in variants.items():
        try:
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            kw = {"score_mod": form or mod.forms["cute"], "score_mod_bwd": bwd if form else mod.forms["cute_bwd"]}
            if aux:
                kw["aux_tensors"] = aux
            o = flash_attn_func(qq, kk, vv, **kw)
            o = o[0] if isinstance(o, tuple) else o
            dq, dk, dv = torch.autograd.grad(o, (qq, kk, vv), do)
            torch.cuda.synchronize()
            ref = attention_grad_reference(q, k, v, do, call=AttentionCall(score_mod=mod, aux_tensors=aux))
            o = o.detach()
            report[name] = _compare({"out": o, "dq": dq, "dk": dk, "dv": dv}, ref)
        except Exception as exc:  # each variant on its own: report and go on
            report[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-3000:]}
        print(f"hk{args.heads_kv} d{args.d}", name, json.dumps(report[name])[:600], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"bwd_probe{args.tag}.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
