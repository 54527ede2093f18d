"""The backward half of a case (``fa4-audit run --backward``): a seeded dO, the kernel's
gradients by ``torch.autograd.grad`` (every kernel the same way), measured against the FP64
gradients; the verdict is ``audits.verdict.gate``'s.

A case record gains ``backward``::

    {"status": "ran" | "skipped" | "error" | "crash" | "timeout", "reason": ..., "do_family": "large",
     "repeat": 2, "deterministic": false,
     "grads": {"dq": {<numerics.metrics.output_errors>, "bound": {...}, "fa_criterion": {...}},
               "dk": ..., "dv": ..., "dsink": ...},          # dsink only with a learnable sink
     "missing": ["dsink"],                                  # gradients autograd did not return
     "contract": [<audits.report.records.ContractRecord>],  # gradients of another shape or dtype than
                                                            # their input's (with status "error" too:
                                                            # autograd refuses a wrongly shaped one)
     "zeros": {"dk_unseen_nonzero": 0, "dv_unseen_nonzero": 0, "dq_empty_nonzero": 0},
     "spread": {"dq": {"differing": 71, "max_ulp": 1}, ...},  # runs 2..N against run 1
     "certified": {"dq": 3e-19, "dv": 1e-18}}               # max |FP64 - exact| / max|exact|

Gradient semantics (docs/backward.md): keys no query sees get exactly zero dK and dV, rows with
no visible key add nothing (zero dQ); non-finite inputs follow the forward's visible/masked rules,
which the FP64 reference (``numerics.grad_reference``) implements: a NaN where the reference is
finite fails, a finite value where it is NaN is the ``nan_swallowed`` policy's.
"""

from __future__ import annotations

import functools
import inspect
import re
import time
import traceback
from dataclasses import dataclass

import torch

from audits.contract import ContractBreach, breach_of
from audits.engine.failures import failure_reason
from audits.suites.cases import Case
from audits.suites.inputs import make_grad_output, make_inputs
from fa4.refusals import ProductionRefusal, refusal_of
from numerics.backward_bound import backward_error_bound
from numerics.call import AttentionCall
from numerics.fp import bit_view, format_of, ulp_distance, ulp_of
from numerics.grad_reference import attention_grad_reference, attention_lowprec_grads, exact_grad_elements
from numerics.metrics import bound_check, fa_floor, output_errors, rounded_overflow, ulp_diff_histogram
from numerics.reference import call_visibility

__all__ = ["BackwardOptions", "GRADS", "GRAD_AXES", "grad_call", "analyse_backward", "accepts_deterministic"]

GRADS = ("dq", "dk", "dv", "dsink")


@dataclass(frozen=True)
class BackwardOptions:
    """``repeat``: backward runs on the same graph (run 1 is audited, the others measure the
    spread); ``deterministic``: pass ``deterministic=True`` to kernels that take it and fail any
    run-to-run difference."""

    repeat: int = 2
    deterministic: bool = False

    def __post_init__(self):
        if not isinstance(self.repeat, int) or self.repeat < 1:
            raise ValueError(f"repeat must be an integer >= 1, got {self.repeat!r}")


def accepts_deterministic(fn) -> bool:
    """Whether the kernel names a ``deterministic`` parameter (``**kwargs`` does not count: a
    kernel that swallows unknown keywords has not said it honours this one)."""
    try:
        return "deterministic" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _refused(exc: BaseException, fn, call: tuple) -> str | None:
    """The documented refusal ``exc`` is, or None (then it is an error).  A production adapter
    refuses only by its rules: its forward's refusals arrive as ``fa4.refusals.ProductionRefusal``;
    what the backward raises is decided by ``fn.fa4_audit_refusal`` (``fa4.refusals.refusal_in_call``:
    a rule predicted from the call's features, ``call`` = (q, k, v, kw)), or, for a kernel marked
    with rules only (``fn.fa4_audit_refusals``), by the rules' wording; any other kernel refuses by
    ``NotImplementedError``."""
    if isinstance(exc, ProductionRefusal):
        return str(exc)
    decide = getattr(fn, "fa4_audit_refusal", None)
    if decide is not None:
        q, k, v, kw = call
        match = decide(exc, q, k, v, backward=True, **kw)
        return None if match is None else match.reason(exc)
    rules = getattr(fn, "fa4_audit_refusals", None)
    if rules is None:
        return str(exc) if isinstance(exc, NotImplementedError) else None
    rule = refusal_of(exc, rules)
    return None if rule is None else f"production refuses this configuration ({rule.source}): {exc}"


def grad_call(fn, x: dict, do: torch.Tensor, opts: BackwardOptions) -> tuple[dict, tuple | None]:
    """Forward with gradient-tracking leaves, then ``opts.repeat`` backward runs of the same
    graph: ``({"status": "ran", "seconds": [forward, run 1, ...]}, (out, lse, [grads of run 1,
    run 2, ...]))`` with grads a dict of ``GRADS`` (None where autograd returned none), or the
    status and reason of why not."""
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")}
    kw = dict(x["kw"])
    if kw.get("learnable_sink") is not None:
        leaves["dsink"] = kw["learnable_sink"] = kw["learnable_sink"].detach().clone().requires_grad_(True)
    if opts.deterministic and accepts_deterministic(fn):
        kw["deterministic"] = True
    names = ["dq", "dk", "dv", "dsink"][: len(leaves)]
    seconds = []
    try:
        t0 = time.perf_counter()
        res = fn(leaves["q"], leaves["k"], leaves["v"], return_lse=True, **kw)
        seconds.append(time.perf_counter() - t0)
        out, lse = res if isinstance(res, tuple) else (res, None)
        if not isinstance(out, torch.Tensor) or out.grad_fn is None:
            return {"status": "skipped", "reason": "the kernel's output carries no autograd graph: no backward"}, None
        runs = []
        for r in range(opts.repeat):
            t0 = time.perf_counter()
            g = torch.autograd.grad(out, list(leaves.values()), do, retain_graph=r + 1 < opts.repeat, allow_unused=True)
            runs.append({n: (None if t is None else t.detach()) for n, t in zip(names, g)})
            seconds.append(time.perf_counter() - t0)
    except Exception as exc:  # a refusal is skipped; any other exception is the case's verdict
        why = _refused(exc, fn, (leaves["q"], leaves["k"], leaves["v"], kw))
        if why is not None:
            return {"status": "skipped", "reason": f"backward not supported: {why}"}, None
        bad = _autograd_breach(exc, leaves)  # a gradient of the wrong shape, which autograd refuses
        if bad is not None:
            return {"status": "error", "reason": bad.reason, "cause": "exception",
                    "contract": [bad.as_record()], "traceback": traceback.format_exc(limit=3)}, None  # fmt: skip
        cause, why = failure_reason(exc, "backward")  # out-of-memory said as such
        return {"status": "error", "reason": why, "cause": cause, "traceback": traceback.format_exc(limit=3)}, None
    lse = lse.detach() if isinstance(lse, torch.Tensor) else None
    # the forward with its graph, then each backward run: run 1's excess over run 2 is the
    # backward's compilation and first use (``fa4-audit compare`` sums them)
    return {"status": "ran", "seconds": seconds}, (out.detach(), lse, runs)


#: each gradient's axes: its input's (q, k, v: the layout of ``make_inputs``; the sink: one per head)
GRAD_AXES = {
    "dq": ("batch", "seqlen_q", "heads_q", "d"),
    "dk": ("batch", "seqlen_k", "heads_kv", "d"),
    "dv": ("batch", "seqlen_k", "heads_kv", "dv"),
    "dsink": ("heads_q",),
}


#: autograd's words when a backward returns a gradient of another shape than its input's
#: (torch/csrc/autograd/engine.cpp, ``validate_outputs``): the gradient never reaches the caller
_INVALID_GRADIENT = re.compile(
    r"returned an invalid gradient at index (\d+) - got \[([\d, ]*)\] but expected shape compatible with \[([\d, ]*)\]"
)


def _autograd_breach(exc: BaseException, leaves: dict) -> ContractBreach | None:
    """The gradient contract breach autograd refused (:data:`_INVALID_GRADIENT`), or None.  Autograd
    checks every gradient a ``torch.autograd.Function`` returns against its input's shape (and casts
    its dtype) before ``grad_call`` sees it, so a dq of the wrong shape arrives as this error.  The
    gradient is named by the shape autograd expected: the one input (q, k, v, the sink) of that
    shape; where several have it (q and k alike), the one at the Function's input index when that
    is the contract's order (q, k, v, sink); None when neither decides (the kernel reshaped its
    inputs before its Function: its own tensor, not the contract's)."""
    m = _INVALID_GRADIENT.search(str(exc))
    if m is None:
        return None
    index = int(m.group(1))
    got, want = (tuple(int(n) for n in g.split(",") if n.strip()) for g in (m.group(2), m.group(3)))
    names = ["dq", "dk", "dv", "dsink"][: len(leaves)]
    same = [n for n, leaf in zip(names, leaves.values()) if tuple(leaf.shape) == want]
    name = same[0] if len(same) == 1 else (names[index] if index < len(names) and names[index] in same else None)
    if name is None:
        return None
    leaf = dict(zip(names, leaves.values()))[name]
    return ContractBreach(
        tensor=name,
        axes=_grad_axes(name, leaf),
        expected=want,
        expected_dtype=str(leaf.dtype).removeprefix("torch."),
        dtype_rule="the input's dtype",
        got=got,
        got_dtype=None,  # autograd casts a gradient to its input's dtype: never a breach
        got_type="Tensor",
    )


def _grad_axes(name: str, leaf: torch.Tensor) -> tuple[str, ...]:
    """The gradient ``name``'s axes (:data:`GRAD_AXES`), numbered where its input has another rank."""
    return GRAD_AXES[name] if len(GRAD_AXES[name]) == leaf.dim() else tuple(f"axis {i}" for i in range(leaf.dim()))


def _contract(name: str, got: torch.Tensor, leaf: torch.Tensor) -> dict | None:
    """The gradient ``name``'s breach of the contract (shape and dtype of its input ``leaf``) as a
    record (``audits.contract.ContractBreach.as_record``), None when it keeps it."""
    bad = breach_of(
        tensor=name,
        got=got,
        expected=tuple(leaf.shape),
        axes=_grad_axes(name, leaf),
        dtype=leaf.dtype,
        dtype_rule="the input's dtype",
    )
    return None if bad is None else bad.as_record()


def _steps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in integer ULP steps of the dtype (NaN against a number: 2**20)."""
    if a.element_size() in (1, 2):
        return ulp_diff_histogram(a, b)["max"]
    d = ulp_distance(a.float(), b.float())
    return int(torch.where(d < 0, torch.full_like(d, 1 << 20), d).max()) if d.numel() else 0


def _spread(runs: list[dict]) -> dict:
    """Per gradient, against run 1: the elements whose bits differ in any later run, and the
    largest distance in integer ULP steps of the gradient's dtype."""
    out = {}
    for n, first in runs[0].items():
        if first is None:
            continue
        diff = torch.zeros(first.shape, dtype=torch.bool, device=first.device)
        worst = 0
        for other in runs[1:]:
            d = bit_view(first) != bit_view(other[n])
            diff |= d
            if bool(d.any()):
                worst = max(worst, _steps(first[d], other[n][d]))
        out[n] = {"differing": int(diff.sum()), "max_ulp": worst, "elements": first.numel()}
    return out


def _fa_floor(got, ref, low, scale, out_rss=None) -> dict:
    """FA's backward criterion's terms (``numerics.metrics.fa_floor``; ``low``: PyTorch's
    gradient in the input dtype; ``scale``: the gradient's scale from the FP64 reference, or None);
    for dsink, which FA checks per head against 2 ULP of |ref|, the per-head errors and ULPs too,
    and each head's scale (``head_scales``) and, given ``out_rss`` (the FP64 reference's
    ``dsink_out_rss``: sqrt(sum_{batch, i, c} (P_sink,i dO_ic out_ic)^2)), each head's
    ``head_out_rss``, at which rounding the output before D = rowsum(dO * O) moves dsink
    (``audits.verdict.gate.DSINK_ROUNDED_OUT``)."""
    res = fa_floor(got, ref, low, scale=scale)
    if got.dim() == 1:
        fin = torch.isfinite(ref)
        err = torch.where(fin, (got.double() - ref).abs(), 0.0).nan_to_num(float("inf"))
        res["errors"] = err.tolist()
        res["ulps_at_ref"] = ulp_of(torch.where(fin, ref, 0.0).abs(), format_of(got.dtype)).tolist()
        if scale is not None:
            s = torch.where(fin & torch.isfinite(scale), scale.double().abs(), 0.0)
            res["head_scales"] = s.tolist()
        if out_rss is not None:
            s = torch.where(fin & torch.isfinite(out_rss), out_rss.double().abs(), 0.0)
            res["head_out_rss"] = s.tolist()
    return res


def _call_vis(case: Case, kw: dict, device="cpu") -> torch.Tensor:
    """The keys the call keeps, bool (batch, heads_q, seqlen_q, seqlen_k): the flags and, when the
    call has them, the mods' mask (``numerics.reference.call_visibility``)."""
    mods = {k: kw[k] for k in ("mask_mod", "block_sparse_tensors", "aux_tensors", "aux_scalars") if k in kw}
    call = AttentionCall(causal=case.causal, window_size=tuple(case.window), **mods)
    vis = call_visibility(
        batch=case.batch, heads=case.heads_q, seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k, call=call, device=device
    )
    return vis.to(device).expand(case.batch, case.heads_q, case.seqlen_q, case.seqlen_k)


def _zeros(grads: dict, case: Case, kw: dict, device) -> dict:
    """Exact zeros the semantics demand: dK / dV of keys no query (of the kv head's group) sees,
    dQ of rows that see no key (non-zero elements counted; NaN counts as non-zero)."""
    vis = _call_vis(case, kw, device)
    g = case.heads_q // case.heads_kv
    # (b, sk, hk): no (head of the group, row) sees the key; (b, sq, hq): the row sees no key
    unseen = ~vis.reshape(case.batch, case.heads_kv, g, case.seqlen_q, case.seqlen_k).any(2).any(2).transpose(1, 2)
    empty = ~vis.any(3).transpose(1, 2)

    def nz(t, m):  # in float32: comparisons are not implemented for fp8
        if t is None:
            return 0
        sel = t.float()[m]
        return int((sel != 0).sum() + torch.isnan(sel).sum())

    return {
        "dk_unseen_nonzero": nz(grads.get("dk"), unseen),
        "dv_unseen_nonzero": nz(grads.get("dv"), unseen),
        "dq_empty_nonzero": nz(grads.get("dq"), empty),
        "unseen_keys": int(unseen.sum()),
        "empty_rows": int(empty.sum()),
    }


def _certify(x: dict, do: torch.Tensor, ref: dict, case: Case) -> dict:
    """The FP64 gradients against exact ones (``numerics.grad_reference.exact_grad_elements``)
    on sampled elements: the last query row's dQ always; the dK and dV row of the key the fewest
    (head, row) pairs see, when those rows hold at most 2**14 scores (the exact evaluation costs
    one mpmath softmax per row); dsink of the last head under the same cost limit (all its rows).  Value per
    gradient: the largest |FP64 - exact| / S over the sampled elements, S the element's scale
    (``numerics.grad_reference``, ``scales``: the sum over the absolute values of its terms, dS's
    two before they cancel).  S is what the FP64 sum's own rounding is proportional to (a sum's
    error is bounded by its length times float64's unit roundoff times the sum of its terms'
    absolute values), and the gate never allows a gradient less than ``FA_FLOOR`` (2**-16) times
    its scale (``audits.verdict.gate``), so an FP64 error below ``[backward] mpmath_max_rel`` times S
    cannot move a verdict.  Neither an element's own size nor the tensor's largest is a scale
    where dP - D cancels: on a row whose P is one-hot (smoke's s3x3 ``outliers`` case, 2026-12-04)
    every dk is ~1e-11 of its terms, and the FP64 dk, right to 2.7e-17 of its scale, differed from the
    exact one by 2.3e-7 of max |dk|, which failed the case "FP64 dk not certified".  Without the
    scales (a reference made without ``scales``), max |FP64 gradient| is the scale, as before."""
    b, hk, g = case.batch - 1, case.heads_kv - 1, case.heads_q // case.heads_kv
    seen = _call_vis(case, x["kw"])[b, hk * g : (hk + 1) * g].sum((0, 1))  # (head, row) pairs of kv head hk per key
    j = int(torch.where(seen > 0, seen, 1 << 30).argmin())
    want = {"dq_rows": [(b, case.seqlen_q - 1, case.heads_q - 1)]}
    if 0 < int(seen[j]) * case.seqlen_k <= 1 << 14:
        want["dk_rows"] = want["dv_rows"] = [(b, j, hk)]
    if case.sink and case.batch * case.seqlen_q * case.seqlen_k <= 1 << 14:
        want["dsink_heads"] = [case.heads_q - 1]
    got = exact_grad_elements(x["q"], x["k"], x["v"], do, call=AttentionCall.from_kwargs(**x["kw"]), **want)
    out = {}
    for name, items in got.items():
        for key, exact in items.items():
            if exact is None:
                continue
            exact = [float(e) for e in (exact if isinstance(exact, list) else [exact])]
            idx = key if name == "dsink" else (key[0], key[1], key[2])
            fp = ref[name][idx].reshape(-1).double().cpu().tolist()
            if f"{name}_scale" in ref:  # each element at its own scale (the docstring's why)
                scales = ref[f"{name}_scale"][idx].reshape(-1).double().cpu().tolist()
            else:
                r = ref[name].double()
                scales = [float(r[torch.isfinite(r)].abs().max()) if r.numel() else 0.0] * len(fp)
            worst = max(abs(a - e) / max(sc, 1e-300) for a, e, sc in zip(fp, exact, scales, strict=True))
            out[name] = max(out.get(name, 0.0), worst)
    return out


@functools.lru_cache(maxsize=4)  # kernels taking turns on one case share it
def case_references(case: Case, device: str) -> tuple:
    """The case's FP64 gradients, PyTorch's low-precision ones (16-bit dtypes) and the exact
    certification: they depend on the inputs and dO only (``make_inputs``,
    ``make_grad_output``), not on the kernel.  Public: the engine clears its cache when the
    audit's FP64 work runs out of GPU memory."""
    x = make_inputs(case, device=device)
    do, _ = make_grad_output(case, device=device)
    call = AttentionCall.from_kwargs(**x["kw"])
    ref = attention_grad_reference(x["q"], x["k"], x["v"], do, call=call, scales=True)
    sixteen = x["q"].dtype in (torch.bfloat16, torch.float16)
    low = attention_lowprec_grads(x["q"], x["k"], x["v"], do, call=call) if sixteen else None
    return ref, low, _certify(x, do, ref, case)


def analyse_backward(kernel_numerics, x: dict, do: torch.Tensor, result: tuple, case: Case, *, keep=None) -> dict:
    """Measurements of one case's gradients (module doc); ``x`` and ``do`` are the case's
    (``make_inputs``, ``make_grad_output``); ``kernel_numerics``: the FA4Numerics the kernel is
    held to (FA4's own, or generic flash-attention numerics for a peer) and its kind,
    ``(nm, "fa4" | "peer")``.  ``keep`` (an ``audits.verdict.diagnosis.CaseTensors``): receives
    the gradients, their FP64 references and bounds, which a failing verdict is localized with."""
    out, lse, runs = result
    q, k, v, kw = x["q"], x["k"], x["v"], x["kw"]
    ref, low, cert = case_references(case, str(q.device))
    nm, kind = kernel_numerics
    bound = None
    if lse is not None:
        bound = backward_error_bound(q, k, v, do, out, lse, nm, call=AttentionCall.from_kwargs(**kw), reference=ref)
    leaves = {"dq": q, "dk": k, "dv": v, "dsink": kw.get("learnable_sink")}
    if keep is not None:
        keep.grads, keep.grad_refs, keep.grad_bounds = runs[0], ref, bound
        keep.bwd_kind, keep.bwd_numerics = kind, nm
    # an infinite bound means overflow by design only where every input is finite; with NaN/inf
    # inputs it is their propagation, which the semantics rules judge
    finite = all(bool(torch.isfinite(t.float()).all()) for t in (q, k, v, do))
    rec = {"grads": {}, "missing": [], "contract": [], "bound_kind": kind if bound is not None else None}
    for n, got in runs[0].items():
        if got is None:
            rec["missing"].append(n)
            continue
        bad = _contract(n, got, leaves[n])
        if bad:
            rec["contract"].append(bad)
            continue
        # the reference as the gradient's dtype can hold it: an exact value beyond its range is
        # that infinity (numerics.metrics.rounded_overflow); beyond_range says how many, for the words
        r, beyond = rounded_overflow(ref[n], got)
        m = output_errors(got, r)
        if beyond:
            m["beyond_range"] = beyond
        if bound is not None and bound.get(n) is not None:
            m["bound"] = bound_check(got, r, bound[n])
            over = torch.isfinite(r) & ~torch.isfinite(got.float())  # fp8 has no isfinite
            if finite and bool(over.any()) and bool(torch.isinf(bound[n][over]).all()):
                rec.setdefault("overflow", []).append(f"{int(over.sum())} {n}")
        if low is not None:
            m["fa_criterion"] = _fa_floor(got, r, low[n], ref.get(f"{n}_scale"), ref.get(f"{n}_out_rss"))
        rec["grads"][n] = m
    if rec.get("overflow"):  # the analysis itself says these may overflow: the design's range, not a bug
        rec["out_of_domain"] = (
            f"{', '.join(rec['overflow'])} elements overflow where the backward bound is infinite: dS or the "
            f"gradient can exceed the range of {q.dtype} that the kernel rounds them to by design"
        )
    rec["zeros"] = _zeros(runs[0], case, kw, q.device)
    rec["spread"] = _spread(runs) if len(runs) > 1 else {}
    rec["certified"] = cert
    return rec
