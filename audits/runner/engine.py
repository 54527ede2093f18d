"""Run a suite of cases for one or several kernels: inputs, the kernel, the FP64 reference
(certified on one row by an exact computation, ``numerics.reference.exact_attention_rows``),
metrics, the per-element bound, a verdict per case.

Every finished case is appended to ``OUT/journal.jsonl`` (flushed and fsynced) so that
``resume=True`` continues after a crash, a kill or Ctrl-C without redoing finished cases.
Cases run grouped by compile key, so a JIT kernel compiles each variant once.
:func:`shard_cases` cuts a deterministic 1/n slice balanced by expected cost.  Failing cases get a reproducer:
their inputs saved under ``OUT/repro/`` and a one-line command in the report.
"""

from __future__ import annotations

import functools
import math
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from audits.cases import Case
from audits.inputs import NotApplicable, make_grad_output, make_inputs
from audits.kernels import claims_nonfinite_inputs, contract_error, fa4_numerics, get_kernel, kernel_domain
from audits.runner import journal
from audits.runner.backward import BackwardOptions, _references, analyse_backward, grad_call
from audits.runner.gate import judge
from audits.runner.repro import reproducer
from numerics.forward_bound import forward_error_bound
from numerics.metrics import bound_check, fa_floor, lse_errors, output_errors
from numerics.reference import attention_lowprec, attention_reference, exact_attention_rows

__all__ = ["evaluate_case", "run_suite", "run_suites", "kernel_dir", "shard_cases", "FAILING"]

#: verdicts that fail a run (and get their inputs saved for reproduction)
FAILING = ("fail", "error", "crash")


def shard_cases(cases: list[Case], index: int, count: int, *, by: str = "cost") -> list[Case]:
    """Deterministic slice ``index`` of ``count``, back in suite order.  ``by="cost"``: greedy
    balancing of ``Case.cost`` (largest first onto the lightest shard).  ``by="key"``: whole
    compile-key groups per shard (each JIT variant compiled by one process only), balanced by
    group size plus cost, for parallel processes that each compile their own share."""
    if not (0 <= index < count):
        raise ValueError(f"shard {index}/{count}: need 0 <= I < N")
    if by not in ("cost", "key"):
        raise ValueError(f"shard by {by!r}: accepted 'cost' or 'key'")
    if by == "cost":
        units = {i: [i] for i in range(len(cases))}
    else:
        units = {}
        for i, c in enumerate(cases):
            units.setdefault(c.compile_key, []).append(i)
    total = sum(c.cost for c in cases) or 1
    weight = {
        u: sum(cases[i].cost for i in m) / total + (len(m) / len(cases) if by == "key" else 0.0)
        for u, m in units.items()
    }
    loads = [0.0] * count
    owner = {}
    for u in sorted(units, key=lambda u: (-weight[u], repr(u))):
        s = min(range(count), key=lambda j: (loads[j], j))
        loads[s] += weight[u]
        for i in units[u]:
            owner[i] = s
    return [c for i, c in enumerate(cases) if owner[i] == index]


def _certify(x: dict, ref: torch.Tensor, rl: torch.Tensor, case: Case) -> float | None:
    """Largest |FP64 reference - exact| over one deterministic row's outputs and LSE (the exact
    row from ``numerics.reference.exact_attention_rows``, ~1e-23 relative); None when the row
    is not certifiable (non-finite inputs reach it: the semantics rules judge it)."""
    row = (case.batch - 1, case.heads_q - 1, case.seqlen_q - 1)
    (got,) = exact_attention_rows(x["q"], x["k"], x["v"], [row], **x["kw"])
    if got is None:
        return None
    mo, ml = got
    r = ref[row[0], row[2], row[1]].double().cpu().tolist()
    lse = float(rl[row[0], row[1], row[2]])
    diffs = [abs(float(a) - b) for a, b in zip(mo, r)]
    if math.isfinite(float(ml)) or math.isfinite(lse):
        diffs.append(abs(float(ml) - lse))  # inf if only one of them is infinite
    return max(diffs)


@functools.lru_cache(maxsize=4)  # consecutive kernels on one case share it; GPU memory is better spent elsewhere
def _reference(case: Case, device: str) -> tuple:
    """FP64 reference, its LSE, the low-precision PyTorch result and the exact-row certification
    of one case: they depend on the inputs only, so a process auditing several kernels on the
    same suite computes them once."""
    x = make_inputs(case, device=device)
    ref, rl = attention_reference(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    low = attention_lowprec(x["q"], x["k"], x["v"], **x["kw"])
    return ref, rl, low, _certify(x, ref, rl, case)


@functools.lru_cache(maxsize=4)
def _bound(case: Case, device: str, nm) -> tuple:
    """Per-element forward bound of a case under numerics ``nm``: kernels sharing numerics
    (the three SDPA backends; production SM90 and its model) share it."""
    x = make_inputs(case, device=device)
    return forward_error_bound(x["q"], x["k"], x["v"], nm, reference=_reference(case, device)[:2], **x["kw"])


def _domain(q, k, v, case: Case, nm) -> str | None:
    """Why these inputs lie outside the float32 range the kernel's design covers (the headroom
    analysis of ``numerics.bounds``), or None: logits |q.k| beyond FLT_MAX, or P.V sums up to
    seqlen_k * P_max * max|V| beyond it, P_max = 2**(threshold + max_offset)."""
    import math

    fin = lambda t: t.double()[torch.isfinite(t.double())]
    qa, ka, va = (fin(t).abs().max().item() if fin(t).numel() else 0.0 for t in (q, k, v))
    flt = 3.4028234663852886e38
    if qa * ka * case.d >= flt:
        return f"logits can reach {qa * ka * case.d:.3g} > float32 max (max|q| {qa:.3g}, max|k| {ka:.3g}, d {case.d})"
    pmax = 2.0 ** (nm.rescale_threshold + nm.max_offset) if nm is not None else 1.0
    if va > 0 and math.log2(case.seqlen_k * pmax * va) >= 128:
        return f"P.V sums can reach seqlen_k * P_max * max|V| = {case.seqlen_k} * {pmax:g} * {va:.3g} > float32 max"
    return None


def _peer_numerics(q: torch.Tensor):
    """Generic flash-attention numerics for kernels that do not implement FA4's (thresholds
    ``peer_bound``): float32 softmax, hardware-class exp2, P rounded to the input dtype."""
    from fa4.model import FA4Numerics

    return FA4Numerics(
        arch="sm90", tile_m=128, tile_n=128, exp2="hardware", rescale_threshold=0.0, max_offset=0, p_dtype=q.dtype
    )


def _analyse(rec: dict, kernel: str, case: Case, x: dict, out: torch.Tensor, lse, device: torch.device) -> None:
    """Reference, metrics, bound and criteria of a kernel result, into ``rec``."""
    q, k, v = x["q"], x["k"], x["v"]
    ref, rl, low, cert = _reference(case, str(device))
    rec["out"] = output_errors(out, ref)
    if lse is not None:
        rec["lse"] = lse_errors(lse, rl)
    nmf = fa4_numerics(kernel)
    nm = nmf(q, k, v, case.causal, tuple(case.window)) if nmf is not None else _peer_numerics(q)
    if nm is not None:
        ob, lb = _bound(case, str(device), nm)
        rec["bound"] = {"kind": "fa4" if nmf is not None else "peer", **bound_check(out, ref, ob, lse, rl, lb)}
    rec["out_of_domain"] = _domain(q, k, v, case, nm)
    if (
        rec["out_of_domain"] is None
        and not claims_nonfinite_inputs(kernel)
        and not all(bool(torch.isfinite(t.float()).all()) for t in (q, k, v))
    ):
        rec["out_of_domain"] = f"inputs contain NaN/inf and {kernel} claims no semantics for them"
    rec["fa_criterion"] = fa_floor(out, ref, low)
    rec["mpmath_max_abs"] = cert


def _call(fn: Callable, x: dict) -> tuple[dict, tuple | None]:
    """Call the kernel: ({"status": "ran"}, (out, lse)) or the status and reason of why not.
    Only ``NotImplementedError`` is a refusal (skipped); production's adapter raises it only
    for its documented refusals (``fa4.production.REFUSALS``); any other exception is an error."""
    try:
        res = fn(x["q"], x["k"], x["v"], return_lse=True, **x["kw"])
    except WorkerCrashed as exc:
        return {"status": "crash", "reason": str(exc)}, None
    except NotImplementedError as exc:
        return {"status": "skipped", "reason": f"kernel does not support this configuration: {exc}"}, None
    except Exception as exc:  # any other exception is the case's verdict, never a pass
        tb = traceback.format_exc(limit=3)
        return {"status": "error", "reason": f"kernel raised {type(exc).__name__}: {exc}", "traceback": tb}, None
    return {"status": "ran"}, (res if isinstance(res, tuple) else (res, None))


def _analyse_or_oom(rec: dict, kernel: str, case: Case, x: dict, out, lse, device) -> None:
    """:func:`_analyse`; an OOM in the audit's own FP64 work (not the kernel's) frees the caches
    and retries once, then becomes the case's error."""
    try:
        _analyse(rec, kernel, case, x, out, lse, device)
    except torch.OutOfMemoryError:
        _reference.cache_clear()
        _bound.cache_clear()
        torch.cuda.empty_cache()
        try:
            _analyse(rec, kernel, case, x, out, lse, device)
        except torch.OutOfMemoryError as exc:
            why = str(exc).splitlines()[0]
            rec.update(status="error", reason=f"the audit's FP64 reference or bound ran out of GPU memory: {why}")
            rec["audit_error"] = True  # the audit's failure, not the kernel's: --resume redoes it


def _backward(kernel: str, fn: Callable, case: Case, x: dict, device: torch.device, opts: BackwardOptions) -> dict:
    """The case's backward half (``audits.runner.backward``): a seeded dO, the kernel's
    gradients, their measurements; an OOM in the audit's own FP64 work is the case's error."""
    do, fam = make_grad_output(case, device=device)
    status, res = fn.grad(x, do, opts) if isinstance(fn, _Isolated) else grad_call(fn, x, do, opts)
    b = {**status, "do_family": fam, "repeat": opts.repeat, "deterministic": opts.deterministic}
    if res is None:
        return b
    nmf = fa4_numerics(kernel)
    q, k, v = x["q"], x["k"], x["v"]
    nm = (nmf(q, k, v, case.causal, tuple(case.window)), "fa4") if nmf is not None else (_peer_numerics(q), "peer")
    try:
        b.update(analyse_backward(nm, x, do, res, case))
    except torch.OutOfMemoryError as exc:
        _references.cache_clear()
        torch.cuda.empty_cache()
        b.update(status="error", reason=f"the audit's FP64 gradients ran out of GPU memory: {str(exc).splitlines()[0]}")
        b["audit_error"] = True
    return b


def evaluate_case(
    kernel: str,
    fn: Callable,
    case: Case,
    device: torch.device,
    thresholds: dict,
    backward: BackwardOptions | None = None,
    domain=None,
) -> dict:
    """Measurements and verdict of one case (a JSON-able dict); with ``backward``, its gradients
    too (``rec["backward"]``).  ``domain`` (``audits.domain.Domain``, the kernel's declared one):
    a case outside it is ``skipped`` with the reason, decided before the kernel is called."""
    rec = {"case": case.name, "config": case.as_dict(), "family": case.family, "seed": case.seed}
    t0 = time.perf_counter()
    why = domain.refusal(case) if domain is not None else None
    if why is not None:  # never called: the kernel said up front it does not support this
        rec.update(status="skipped", reason=f"outside the kernel's declared domain: {why}", verdict="skipped")
        rec["reasons"], rec["seconds"] = [rec["reason"]], time.perf_counter() - t0
        return rec
    try:
        x = make_inputs(case, device=device)
    except NotApplicable as exc:  # a family's precondition: this case is reported, the run goes on
        rec.update(status="skipped", reason=f"input family not applicable here: {exc}", verdict="skipped")
        rec["reasons"], rec["seconds"] = [rec["reason"]], time.perf_counter() - t0
        return rec
    status, res = _call(fn, x)
    rec.update(status)
    if res is not None:
        out, lse = res
        rec["lse_returned"] = lse is not None  # judged by [policy] lse_missing: never silently unchecked
        bad = contract_error(x["q"], x["v"], out, lse)
        if bad:
            rec.update(status="error", reason=bad)
        else:
            _analyse_or_oom(rec, kernel, case, x, out, lse, device)
    if backward is not None and rec["status"] == "ran":
        rec["backward"] = _backward(kernel, fn, case, x, device, backward)
        if rec["backward"].get("audit_error"):
            rec["audit_error"] = True
    rec["verdict"], rec["reasons"] = judge(rec, thresholds)
    rec["seconds"] = time.perf_counter() - t0
    return rec


class WorkerCrashed(RuntimeError):
    """The kernel's worker process died during a call."""


def _worker(conn, kernel: str) -> None:  # pragma: no cover - runs in the child process
    """Call the kernel on inputs sent over ``conn`` until None arrives (see :class:`_Isolated`).
    Replies ("ok", result) or ("raise", exception)."""
    fn = get_kernel(kernel)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        (q, k, v, kw), device, bwd = msg
        dev = torch.device(device)
        kw = {n: (t.to(dev) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
        try:
            if bwd is not None:  # the backward half: grad_call here, its tensors sent back on the CPU
                do, opts = bwd
                x = {"q": q.to(dev), "k": k.to(dev), "v": v.to(dev), "kw": kw}
                conn.send(("ok", _to(grad_call(fn, x, do.to(dev), opts), "cpu")))
                continue
            res = fn(q.to(dev), k.to(dev), v.to(dev), return_lse=True, **kw)
            conn.send(("ok", _to(res, "cpu")))
        except Exception as exc:  # sent back and re-raised in the parent
            conn.send(("raise", exc))


def _to(x, device):
    """Tensors inside tuples, lists and dicts moved to ``device``; anything else as it is."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(t, device) for t in x)
    if isinstance(x, dict):
        return {n: _to(t, device) for n, t in x.items()}
    return x


class _Isolated:
    """A persistent worker process that runs the kernel: a kernel that kills its process (a
    segfault, an abort, a CUDA illegal address that poisons the context) costs one case — its
    verdict is ``crash`` — and a fresh worker takes the next case.  Only the kernel call crosses
    the process boundary; references and verdicts stay in the parent (and its caches)."""

    def __init__(self, kernel: str, device: torch.device):
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.kernel, self.device = kernel, str(device)
        self.proc = None

    def _start(self):
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child, self.kernel), daemon=True)
        self.proc.start()
        child.close()

    def _ask(self, q, k, v, kw, bwd):
        if self.proc is None or not self.proc.is_alive():
            self._start()
        try:
            self.conn.send(((_to(q, "cpu"), _to(k, "cpu"), _to(v, "cpu"), _to(kw, "cpu")), self.device, bwd))
            status, payload = self.conn.recv()
        except (EOFError, ConnectionError, BrokenPipeError):
            self.proc.join(timeout=5)
            code = self.proc.exitcode
            self.proc = None
            raise WorkerCrashed(f"the kernel's worker process died (exit code {code}) on this case") from None
        if status == "raise":
            raise payload
        return _to(payload, q.device)

    def __call__(self, q, k, v, *, return_lse=True, **kw):
        return self._ask(q, k, v, kw, None)

    def grad(self, x: dict, do: torch.Tensor, opts: BackwardOptions) -> tuple[dict, tuple | None]:
        """``audits.runner.backward.grad_call`` in the worker; a crash there is the case's."""
        try:
            return self._ask(x["q"], x["k"], x["v"], x["kw"], (do.cpu(), opts))
        except WorkerCrashed as exc:
            return {"status": "crash", "reason": str(exc)}, None

    def close(self):
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, ConnectionError):
                pass
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()


def run_suite(kernel: str, cases: list[Case], **kw) -> list[dict]:
    """:func:`run_suites` for one kernel: its records in suite order."""
    return run_suites([kernel], cases, **kw)[kernel]


def kernel_dir(out_dir: str | Path, kernel: str, several: bool) -> Path:
    """Where a kernel's journal and report go: ``out_dir`` itself for a single kernel, else a
    subdirectory named after the kernel (``module:attr`` -> ``module.attr``)."""
    return Path(out_dir) / kernel.replace(":", ".").replace("/", "_") if several else Path(out_dir)


def run_suites(
    kernels: list[str],
    cases: list[Case],
    *,
    device: torch.device,
    out_dir: str | Path,
    thresholds: dict,
    suite: str = "cases",
    seed: int = 0,
    resume: bool = False,
    exitfirst: bool = False,
    isolate: bool | Callable[[str], bool] = False,
    progress: Callable[[str, dict], None] | None = None,
    backward: BackwardOptions | None = None,
) -> dict[str, list[dict]]:
    """Evaluate ``cases`` (grouped by compile key) for every kernel; journal each record under
    :func:`kernel_dir`; return each kernel's records in suite order.  The kernels take turns
    case by case, so a case's inputs and FP64 reference are computed once for all of them; a
    case outside a kernel's declared domain (``audits.kernels.kernel_domain``) is skipped for
    that kernel without a call.
    ``resume``: keep the finished records of a journal written by this same run (kernel, suite,
    seed, thresholds, cases: ``journal.JournalMismatch`` otherwise).  ``isolate`` (a bool or a
    predicate on the kernel name): evaluate in a worker process, where a crash becomes the
    case's verdict.  ``backward``: audit the gradients too (``audits.runner.backward``).
    KeyboardInterrupt propagates after the journals hold what finished."""
    state = {}
    run = {"suite": suite, "seed": seed, "resume": resume, "several": len(kernels) > 1, "backward": backward}
    for kern in kernels:
        state[kern] = _kernel_state(kern, cases, device, out_dir, thresholds, run)
        iso = isolate(kern) if callable(isolate) else isolate
        state[kern]["iso"] = _Isolated(kern, device) if iso else None
        state[kern]["fn"] = state[kern]["iso"] or get_kernel(kern)
        state[kern]["domain"] = kernel_domain(kern)  # resolved once, here: --jobs children decide alike
    order = sorted(range(len(cases)), key=lambda i: (repr(cases[i].compile_key), i))
    try:
        _loop(order, cases, state, device, thresholds, progress, exitfirst, backward)
    finally:
        for st in state.values():
            if st["iso"] is not None:
                st["iso"].close()
    return {kern: [st["records"][i] for i in sorted(st["records"])] for kern, st in state.items()}


def _kernel_state(kern, cases, device, out_dir, thresholds, run: dict) -> dict:
    """A kernel's output directory and journal: resumed (its header checked) or started afresh."""
    out = kernel_dir(out_dir, kern, run["several"])
    out.mkdir(parents=True, exist_ok=True)
    path = out / "journal.jsonl"
    bwd = run["backward"]
    ident = journal.run_identity(
        kernel=kern, suite=run["suite"], seed=run["seed"], thresholds=thresholds, cases=cases, backward=bwd
    )
    if run["resume"]:
        journal.check_header(path, ident)
    elif path.exists():
        path.unlink()
    if not path.exists():
        journal.append(path, ident)
    done = journal.read_records(path) if run["resume"] else {}
    done = {n: r for n, r in done.items() if not _audit_error(r)}  # the audit's own failures are redone
    th_path = thresholds.get("path")
    repro = lambda c: reproducer(kern, c, device=device.type, thresholds_path=th_path, backward=bwd)
    return {"out": out, "journal": path, "done": done, "records": {}, "repro": repro}


def _audit_error(rec: dict) -> bool:
    """Whether a journal record failed on the audit's side (its FP64 work ran out of GPU
    memory), not the kernel's; records written before the flag existed are told by their reason."""
    why = " ".join(rec.get("reasons") or []) + (rec.get("backward") or {}).get("reason", "")
    return bool(rec.get("audit_error")) or ("the audit's FP64" in why and "ran out of GPU memory" in why)


def _save_inputs(st: dict, c: Case) -> str:
    """The failing case's inputs as a torch file beside the report (``repro/<case>.pt``)."""
    rdir = st["out"] / "repro"
    rdir.mkdir(exist_ok=True)
    x = make_inputs(c, device="cpu")
    tensors = {n: x[n].contiguous() for n in ("q", "k", "v")}
    torch.save({**tensors, "kw": x["kw"], "case": c.as_dict()}, rdir / f"{c.name}.pt")
    return f"repro/{c.name}.pt"


def _loop(order, cases, state, device, thresholds, progress, exitfirst, backward):
    for i in order:
        c = cases[i]
        stop = False
        for kern, st in state.items():
            if c.name in st["done"]:
                rec = {**st["done"][c.name], "resumed": True}
            else:
                rec = evaluate_case(kern, st["fn"], c, device, thresholds, backward, st["domain"])
                rec["repro"] = st["repro"](c)
                if rec["verdict"] in FAILING:
                    rec["repro_inputs"] = _save_inputs(st, c)
                journal.append(st["journal"], rec)
            st["records"][i] = rec
            if device.type == "cuda" and c.cost > (1 << 28 if backward is not None else 1 << 32):
                torch.cuda.empty_cache()  # give the FP64 intermediates back: parallel jobs share the GPU
            if progress is not None:
                progress(kern, rec)
            stop |= exitfirst and rec["verdict"] in FAILING
        if stop:
            break
