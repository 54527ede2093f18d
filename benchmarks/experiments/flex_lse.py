"""Why flex_attention's LSE exceeds the peer bound (issue 33, item 3; not a test).

    python benchmarks/experiments/flex_lse.py --out FILE.json [--report REPORT.json] [--device cpu|cuda]
        [--case GLOB] [--max-cases N]

For each case (the cases of ``--report``, a ``fa4-audit run --kernel flex`` report, else the smoke
suite inside flex's domain; ``--case`` keeps those whose name matches) it builds the audit's inputs,
calls the ``flex`` kernel (``audits.kernels``: compiled by torch.compile on CUDA, eager on the CPU)
and measures its LSE against the FP64 reference and against the peer bound
(``numerics.forward_bound.forward_error_bound`` with generic flash-attention numerics, as
``audits/engine/evaluate.py`` holds peers), beside independent float32 recomputations of flex's LSE:

* ``compiled``: the arithmetic of flex's Triton template, step by step (torch 2.13
  ``torch/_inductor/kernel/flex/templates/common.py.jinja`` ``forward_block_mn`` and
  ``flex_attention.py.jinja``): ``qk = fl32(q.k)``; ``qk = fl(qk * SM_SCALE)``; the score_mod on
  it (natural units); ``y = fl(score * RCP_LN2)`` with ``RCP_LN2 = 1.44269504`` (its float32 value
  is fl32(log2 e)); per block of ``BLOCK_N`` keys ``m' = max(m, max y)``,
  ``l = fl(l * exp2(m - m') + sum exp2(fl(y - m')))``; ``lse2 = fl(m + log2 l)``; and
  ``torch/nn/attention/flex_attention.py`` ``_finalize_outputs`` returns ``fl(lse2 * ln 2)``.
  exp2 and log2 are correctly rounded stand-ins (the GPU's MUFU differs by the bound's EX2/LG2
  allowances), and the dot is one float32 rounding of the exact dot (the tensor cores' order
  differs within the bound's E_dot);
* ``eager``: flex's CPU path (``torch/_higher_order_ops/flex_attention.py`` ``_math_attention_inner``
  and ``math_attention``): float32 scores, ``fl(scores * scale)``, the score_mod,
  ``logsumexp`` in float32, then ``/ ln 2`` there and ``* ln 2`` in ``_finalize_outputs``.

Each model runs with the score_mod as flex evaluates it (``traced``): flex traces a score_mod on an
example score of the query's dtype, so a form's ``.to(s.dtype)`` becomes a cast to bf16/fp16 in
the traced graph while the score itself stays float32; the library's bias mods (``alibi``,
``relbias``: ``s + bias``, ``numerics/mod_library.py``) then add a bias computed in the query's
dtype: ``fl32(s + fn(0 in the query's dtype))``.  And with the form's own float32 meaning
(``intended``: ``fn`` on the float32 score).  The kernel itself is also called with the score_mod
wrapped to see a float32 example (``flex_f32_mod``: ``fn(s.to(float32), ...)``, a no-op at run
time), which is the fix for the traced cast.

The bound is computed as the audit does and with the generic-exponent term this investigation
proposes (docs/peers.md): per element, ``kappa_k (E_dot sl2 + |q.k| sl2)`` (no mod) or
``kappa_1 (e_post sl2 + |f| sl2)`` (a score_mod) added to the score's error in log2 units, for the
``k = 2`` float32 products flex forms its base-2 score with (``kappa_k = (1+u)^k / (1-u)^(k-1) - 1``).
Where ``forward_error_bound`` does not yet take ``score_products``, that term is applied here by
wrapping ``numerics.forward_bound.step1_score`` for the call (the same formula).

Results: docs/peers.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import inspect
import json
import math
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numerics.forward_bound as fb  # noqa: E402
from audits.kernels import KERNELS  # noqa: E402
from audits.suites.case import case_from_dict  # noqa: E402
from audits.suites.inputs import NotApplicable, make_inputs  # noqa: E402
from audits.suites.selection import select_cases  # noqa: E402
from fa4.model import FA4Numerics  # noqa: E402
from numerics.call import AttentionCall  # noqa: E402
from numerics.reference import attention_reference, call_visibility  # noqa: E402

U = 2.0**-24
#: flex's constant (``forward_inner``: ``RCP_LN2: tl.constexpr = 1.44269504``) in float32: equal to
#: fl32(log2 e) (checked in :func:`main`)
RCP_LN2_F32 = float(torch.tensor(1.44269504, dtype=torch.float32))
LN2_F32 = float(torch.tensor(math.log(2.0), dtype=torch.float32))
#: BLOCK_N of flex's forward on the H200 for these head dims (its default configs hold 64 or 128;
#: the LSE depends on the blocking only through the float32 sum's order, within the bound's gamma)
BLOCK_N = 64
#: the mods whose library form is ``s + bias`` with the bias cast by ``.to(s.dtype)``
BIAS_MODS = ("alibi", "relbias")


def kappa(k: int) -> float:
    """The relative error of ``k`` chained float32 products forming the base-2 score, against the
    bound's rounded constant ``sl2`` (docs/peers.md): ``(1+u)^k / (1-u)^(k-1) - 1``; 0 for k = 0."""
    return 0.0 if k <= 0 else (1 + U) ** k / (1 - U) ** (k - 1) - 1


def peer_numerics(q: torch.Tensor) -> FA4Numerics:
    """Generic flash-attention numerics, as ``audits/engine/evaluate.py`` (``_peer_numerics``)
    builds them for peer kernels."""
    return FA4Numerics(
        arch="sm90", tile_m=128, tile_n=128, exp2="hardware", rescale_threshold=0.0, max_offset=0, p_dtype=q.dtype
    )


@contextlib.contextmanager
def generic_exponent(products: int):
    """The proposed bound: ``forward_error_bound`` with the generic-exponent term for ``products``
    float32 products (its own ``score_products`` parameter when it has one; else by wrapping
    ``step1_score`` for the duration)."""
    if "score_products" in inspect.signature(fb.forward_error_bound).parameters:
        yield {"score_products": products}
        return
    inner = fb.step1_score

    def wrapped(*args, call: AttentionCall, **kw):
        sl2, d_sl2, base, e_score = inner(*args, call=call, **kw)
        natural = call.softcap > 0 or call.score_mod is not None  # the scale's product is in mod_score's e_pre
        return sl2, d_sl2, base, e_score + kappa(products - 1 if natural else products) * (e_score + base.abs() * sl2)

    fb.step1_score = wrapped
    try:
        yield {}
    finally:
        fb.step1_score = inner


def _float32_mod(score_mod):
    """The score_mod with its forms given a float32 score: under flex's trace the example score
    then has the working dtype, at run time (a float32 score already) nothing changes."""
    fn = score_mod.fn

    def f32(s, *rest, **kw):
        return fn(s.to(torch.float32), *rest, **kw)

    return dataclasses.replace(score_mod, fn=f32)


def _grid(b, h, sq, sk, device):
    return (
        torch.arange(b, device=device).view(b, 1, 1, 1),
        torch.arange(h, device=device).view(1, h, 1, 1),
        torch.arange(sq, device=device).view(1, 1, sq, 1),
        torch.arange(sk, device=device).view(1, 1, 1, sk),
    )


def scores32(q, k, kw, *, traced: bool):
    """flex's float32 post-mod scores (natural units), masked keys -inf, (b, hq, sq, sk): the dot
    rounded once, ``fl(dot * fl32(scale))``, the score_mod as flex evaluates it (``traced``: the
    bias of a bias mod in the query's dtype) or in float32."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(hq // hk, dim=2)
    dot = torch.einsum("bihd,bjhd->bhij", q.double(), kk).float()  # one rounding of the exact dot
    s = dot * torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)  # SM_SCALE: a float32 constant
    sm = kw.get("score_mod")
    if kw.get("softcap"):
        c = float(kw["softcap"])
        s = c * torch.tanh(s / c)
    elif sm is not None:
        bi, hi, qi, ki = _grid(b, hq, sq, sk, q.device)
        aux = list(kw.get("aux_tensors") or [])
        if traced and sm.name in BIAS_MODS:
            zero = torch.zeros((), dtype=q.dtype, device=q.device)
            s = s + sm.fn(zero, bi, hi, qi, ki, aux).float()  # bias in the query's dtype, added in float32
        else:
            s = sm.fn(s, bi, hi, qi, ki, aux)
    vis = call_visibility(
        batch=b,
        heads=hq,
        seqlen_q=sq,
        seqlen_k=sk,
        call=AttentionCall.from_kwargs(**kw),
        device=q.device,
    )
    return torch.where(vis, s, torch.tensor(-math.inf, device=q.device))


def _exp2_32(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(x.double()).float()


def lse_compiled(s: torch.Tensor) -> torch.Tensor:
    """flex's Triton template on the float32 scores ``s`` (module doc, ``compiled``): natural-log LSE."""
    y = s * torch.tensor(RCP_LN2_F32, dtype=torch.float32)  # post_mod_scores *= RCP_LN2
    shape = y.shape[:-1]
    m = torch.full(shape, -math.inf, dtype=torch.float32, device=y.device)
    lsum = torch.zeros(shape, dtype=torch.float32, device=y.device)
    for j0 in range(0, y.shape[-1], BLOCK_N):
        blk = y[..., j0 : j0 + BLOCK_N]
        m_new = torch.maximum(m, blk.amax(-1))
        m_safe = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
        alpha = _exp2_32(m - m_safe)
        p = _exp2_32(blk - m_safe.unsqueeze(-1))
        lsum = lsum * alpha + p.sum(-1)
        m = m_new
    lsum = torch.where(lsum == 0, torch.ones_like(lsum), lsum)
    lse2 = m + torch.log2(lsum.double()).float()
    return lse2 * torch.tensor(LN2_F32, dtype=torch.float32)


def lse_eager(s: torch.Tensor) -> torch.Tensor:
    """flex's eager path on the float32 scores ``s`` (module doc, ``eager``)."""
    lse = s.logsumexp(-1)
    ln2 = torch.tensor(LN2_F32, dtype=torch.float32)
    return (lse / ln2) * ln2


def _worst(err: torch.Tensor, bound: torch.Tensor) -> dict:
    fin = torch.isfinite(bound) & torch.isfinite(err)
    r = torch.where(fin, err / bound.clamp(min=1e-300), torch.zeros_like(err))
    i = int(r.flatten().argmax())
    return {
        "max_abs": float(err[fin].max()) if fin.any() else 0.0,
        "violations": int((r > 1).sum()),
        "worst_ratio": float(r.flatten()[i]),
    }


def measure(case, device: str) -> dict:
    """One case: flex's LSE, the models', each against the FP64 reference and both bounds."""
    x = make_inputs(case, device=device)
    q, k, v, kw = x["q"], x["k"], x["v"], x["kw"]
    flex = KERNELS["flex"]
    rec = {"case": case.name}
    try:
        _out, lse = flex(q, k, v, return_lse=True, **kw)
    except NotImplementedError as exc:
        return {**rec, "skipped": str(exc)[:200]}
    call = AttentionCall.from_kwargs(**kw)
    ref, rl = attention_reference(q, k, v, call=call, return_lse=True)
    nm = peer_numerics(q)
    _ob, lb = fb.forward_error_bound(q, k, v, nm, call=call, reference=(ref, rl))
    with generic_exponent(2) as extra:
        _ob2, lb2 = fb.forward_error_bound(q, k, v, nm, call=call, reference=(ref, rl), **extra)
    fin = torch.isfinite(rl)
    errs = {"flex": (lse.double() - rl).abs()}
    if kw.get("score_mod") is not None:
        _o, lse_fixed = flex(q, k, v, return_lse=True, **{**kw, "score_mod": _float32_mod(kw["score_mod"])})
        errs["flex_f32_mod"] = (lse_fixed.double() - rl).abs()
    model = lse_compiled if q.is_cuda else lse_eager
    for traced in (True, False):
        s = scores32(q, k, kw, traced=traced)
        errs[f"model_{'traced' if traced else 'intended'}"] = (model(s).double() - rl).abs()
        if q.is_cuda or not traced:
            continue
        errs["model_compiled_intended_cpu"] = (lse_compiled(scores32(q, k, kw, traced=False)).double() - rl).abs()
    errs = {n: torch.where(fin, e, torch.zeros_like(e)) for n, e in errs.items()}
    rec["lse_ref_max_abs"] = float(rl[fin].abs().max()) if fin.any() else 0.0
    rec["bound"] = {n: _worst(e, lb) for n, e in errs.items()}
    rec["bound_generic"] = {n: _worst(e, lb2) for n, e in errs.items()}
    rec["flex_vs_model"] = float((errs["flex"] - errs["model_traced"]).abs().max())
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file of the measurements")
    ap.add_argument("--report", help="a flex run's report.json: its cases (default: the smoke suite)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--case", help="keep the cases whose name matches this glob")
    ap.add_argument("--max-cases", type=int, default=0, help="at most this many cases (0: all)")
    ap.add_argument(
        "--suspects",
        type=float,
        default=0.0,
        help="with --report: only the cases whose LSE error reached this share of their bound there (0: all)",
    )
    a = ap.parse_args(argv)
    if RCP_LN2_F32 != float(torch.tensor(math.log2(math.e), dtype=torch.float32)):
        raise SystemExit("flex's RCP_LN2 = 1.44269504 is not fl32(log2 e) here: the models' constant is wrong")
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    if a.report:
        recs = json.loads(Path(a.report).read_text())["cases"]
        near = lambda r: ((r.get("bound") or {}).get("lse_tightness") or 0.0) >= a.suspects  # noqa: E731
        cases = [case_from_dict(r["config"], where=a.report) for r in recs if near(r)]
    else:
        cases = list(select_cases(suite="smoke", kernels=["flex"]).cases)
    if a.case:
        cases = [c for c in cases if fnmatch.fnmatch(c.name, a.case)]
    if a.max_cases:
        cases = cases[: a.max_cases]
    recs, t0 = [], time.time()
    for c in cases:
        if c.varlen:
            continue
        try:
            rec = measure(c, a.device)
        except NotApplicable as exc:
            rec = {"case": c.name, "skipped": str(exc)[:200]}
        recs.append(rec)
        _write(a.out, recs, a.device, t0)  # after every case: a time limit loses only the running one
        if "bound" in rec:
            b = rec["bound"]
            print(
                f"{c.name}: flex LSE {b['flex']['max_abs']:.3g} (x{b['flex']['worst_ratio']:.2f} of the bound, "
                f"{b['flex']['violations']} over), model {b['model_traced']['max_abs']:.3g}; with the generic "
                f"term x{rec['bound_generic']['flex']['worst_ratio']:.2f}",
                flush=True,
            )
    _write(a.out, recs, a.device, t0)
    print(f"wrote {a.out}: {len(recs)} cases")
    return 0


def _write(path: str, recs: list, device: str, t0: float) -> None:
    meta = {"torch": torch.__version__, "device": device, "seconds": round(time.time() - t0, 1)}
    if device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    Path(path).write_text(json.dumps({"meta": meta, "cases": recs}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
