"""Production FA4's programmable surface on the H200 (issue 26; not a test): every library mod,
forward and backward, against float64, and the cross-checks the issue names.

    . benchmarks/device/h200_env.sh && python benchmarks/experiments/h200_mods.py --out $OUT --budget 480 \
        --phases production-bf16,cross-bf16
    . benchmarks/device/h200_env.sh && python benchmarks/experiments/h200_mods.py --out $OUT --budget 480 \
        --phases model-bf16,production-fp16,cross-fp16,flex-bf16

Shape: batch 2, 4 query heads on 2 KV heads, seqlen 256 x 384, d 128, scale 1/sqrt(128); block
sparsity at (128, 128) (SM90's forward tile at d 128, a whole number of its backward's 64-row
tiles: flash_attn/cute/interface.py ``_tile_size_fwd_sm90`` / ``_tile_size_bwd_sm90``).
Phases, in order (``--phases`` picks some; the budget stops between configurations):

* ``production-bf16``: no mod (the baseline), each score mod, each mask mod, block sparsity
  from each mask mod; production (``fa4.production.flash_attn``, i.e. ``flash_attn_func`` with
  ``fa4.mods.production_kwargs``) forward + backward; max |error| and max |error| / max |ref|
  of out, lse, dq, dk, dv against the float64 reference (the audit's semantics: the score mod
  on the scaled score, the flags intersected with the mods);
* ``cross-bf16``: softcap as a score_mod vs ``softcap=15`` (bitwise?), the causal mask_mod vs
  ``causal=True`` (bitwise?), block-sparse vs dense for each mask mod (bitwise?), and a mask_mod
  with ``causal=True`` (production's forward drops ``causal``, ``_resolve_causal_local_window``;
  its backward resolves the flags without the mask_mod and masks causally, ``mask.apply_mask``
  ignoring the mask_mod when ``mask_causal``): the gradients against the mask-only, the
  intersection and the causal-only references, and against the float64 prediction of that mixed
  backward (causal P from the mask-only forward's out and LSE);
* ``model-bf16``: the SM90 model (``fa4-model-sm90``) with the same mods: its errors, and the
  share of bit-identical elements with production per tensor (production run again when this
  process has not run it: cheap on a warm machine, whose compile cache has it);
* ``production-fp16``, ``cross-fp16``: as for bf16;
* ``flex-bf16``: PyTorch's compiled flex_attention (kernel ``flex``) with the same mods, its
  errors against float64.

Expect some 30 s of compiling per production configuration (forward and backward) on an empty cache:
``production-bf16`` and ``cross-bf16`` fill one 10-minute call; the rest another.

Each configuration prints its outcome (compiled or the full exception) and is appended to
``$OUT/h200_mods.json`` as it completes (so a timeout loses only the running one).  A sticky
CUDA error stops the run (the context is lost); ``--config-timeout`` dumps the stacks of a hung
configuration and exits.  ``--stand-in`` runs it all on the CPU with the SM90 model in
production's place (to try the script without a GPU; flex is then eager and forward-only).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fa4.mods import build_mods  # noqa: E402
from numerics.mod_library import MASK_MODS, SCORE_MODS, SOFTCAP_CAP  # noqa: E402
from numerics.mods import index_grid, visibility  # noqa: E402
from numerics.reference import visible_mask  # noqa: E402

B, HQ, HK, SQ, SK, D = 2, 4, 2, 256, 384, 128
SCALE = 1.0 / math.sqrt(D)
BLOCK = (128, 128)
SEED = 1
SHAPE = dict(batch=B, heads_q=HQ, seqlen_q=SQ, seqlen_k=SK)
NAMES = ("out", "lse", "dq", "dk", "dv")
PHASES = ("production-bf16", "cross-bf16", "model-bf16", "production-fp16", "cross-fp16", "flex-bf16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: where everything runs: "cuda"; "cpu" with --stand-in (the SM90 model in production's place)
DEVICE = "cuda"
STAND_IN = False


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def production_kernel():
    """Production's adapter, or with --stand-in the SM90 model (to try this script on a CPU)."""
    if STAND_IN:
        from audits.kernels import get_kernel

        return get_kernel("fa4-model-sm90")
    from fa4.production import flash_attn

    return flash_attn


# ---- inputs, reference, runs ---------------------------------------------------------------------


def inputs(dtype: torch.dtype) -> tuple:
    g = torch.Generator(device=DEVICE).manual_seed(1234)
    mk = lambda n, h: torch.randn(B, n, h, D, device=DEVICE, generator=g).to(dtype)  # noqa: E731
    return mk(SQ, HQ), mk(SK, HK), mk(SK, HK), mk(SQ, HQ)


def _expand(t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(HQ // HK, dim=2)


def reference(q, k, v, do, *, causal=False, window_size=(None, None), softcap=0.0, **mods) -> dict:
    """float64 out, lse and (autograd) dq, dk, dv of the audit's semantics."""
    qq, kk, vv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    aux = mods.get("aux_tensors")
    s = torch.einsum("bihd,bjhd->bhij", qq, _expand(kk)) * SCALE
    bi, hi, qi, ki = index_grid(B, HQ, SQ, SK, device=DEVICE)
    if mods.get("score_mod") is not None:
        s = mods["score_mod"].fn(s, bi, hi, qi, ki, aux)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    vis = visible_mask(SQ, SK, causal=causal, window_size=window_size, device=DEVICE).view(1, 1, SQ, SK)
    mv = visibility(
        batch=B, heads=HQ, seqlen_q=SQ, seqlen_k=SK, mask_mod=mods.get("mask_mod"),
        block_sparse=mods.get("block_sparse_tensors"), aux=aux, device=DEVICE,
    )  # fmt: skip
    if mv is not None:
        vis = vis & mv
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.einsum("bhij,bjhd->bihd", p, _expand(vv))
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), do.double())
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def mixed_backward_prediction(q, k, v, do, out_fwd: torch.Tensor, lse_fwd: torch.Tensor) -> dict:
    """float64 gradients of production's backward as read from its source for a mask_mod with
    causal=True and no score mod: P recomputed from the forward's LSE (the mask-only one) on
    the causally visible keys, D = rowsum(dO * O) of the forward's O, the usual chain."""
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
    s = torch.einsum("bihd,bjhd->bhij", q64, _expand(k64)) * SCALE
    vis = visible_mask(SQ, SK, causal=True, device=DEVICE).view(1, 1, SQ, SK)
    p = torch.exp(s - lse_fwd.double().unsqueeze(-1)).masked_fill(~vis, 0.0)
    dp = torch.einsum("bihd,bjhd->bhij", do64, _expand(v64))
    delta = (do64 * out_fwd.double()).sum(-1).permute(0, 2, 1).unsqueeze(-1)  # (b, h, i, 1)
    ds = p * (dp - delta)
    dq = torch.einsum("bhij,bjhd->bihd", ds, _expand(k64)) * SCALE
    dk_h = torch.einsum("bhij,bihd->bjhd", ds, q64) * SCALE
    dv_h = torch.einsum("bhij,bihd->bjhd", p, do64)
    fold = lambda t: t.view(B, SK, HK, HQ // HK, D).sum(3)  # noqa: E731  (GQA: the group's heads)
    return {"dq": dq, "dk": fold(dk_h), "dv": fold(dv_h)}


def run(fn, q, k, v, do, **kw) -> dict:
    """Forward (with LSE) and backward of ``fn``; seconds of each (the first includes compiling)."""
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    t0 = time.perf_counter()
    out, lse = fn(qq, kk, vv, softmax_scale=SCALE, return_lse=True, **kw)
    _sync()
    t1 = time.perf_counter()
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), do)
    _sync()
    t2 = time.perf_counter()
    res = {"out": out.detach(), "lse": None if lse is None else lse.detach(), "dq": dq, "dk": dk, "dv": dv}
    return {**res, "fwd_s": round(t1 - t0, 3), "bwd_s": round(t2 - t1, 3)}


def errors(got: dict, ref: dict) -> dict:
    res = {}
    for n in NAMES:
        if got.get(n) is None or n not in ref:
            continue
        g, r = got[n].double(), ref[n]
        fin = torch.isfinite(r)
        d = (g - r).abs()
        bad = int((torch.isfinite(g) != fin).sum()) + int((g[~fin] != r[~fin]).sum())
        mx = float(d[fin].max()) if bool(fin.any()) else 0.0
        res[n] = {"max_abs": mx, "rel": mx / max(float(r[fin].abs().max()), 1e-30), "nonfinite_mismatch": bad}
    return res


def bitwise(a: dict, b: dict) -> dict:
    res = {}
    for n in NAMES:
        if a.get(n) is None or b.get(n) is None:
            continue
        x, y = a[n], b[n]
        same = (x == y) | (torch.isnan(x) & torch.isnan(y))
        diff = (x.double() - y.double()).abs().nan_to_num(0.0)
        res[n] = {
            "equal": bool(same.all()),
            "identical_share": float(same.double().mean()),
            "max_abs_diff": float(diff.max()),
        }
    return res


# ---- the run -------------------------------------------------------------------------------------


class Runner:
    def __init__(self, out_dir: Path, budget: float, config_timeout: float):
        self.path = out_dir / "h200_mods.json"
        self.t0 = time.monotonic()
        self.budget = budget
        self.config_timeout = config_timeout
        self.summary = {"env": env_info(), "shape": dict(SHAPE, heads_kv=HK, d=D, scale=SCALE, block=BLOCK),
                        "configs": [], "cross_checks": [], "stopped": None}  # fmt: skip
        self.results: dict = {}  # (dtype, name) -> production results (cross-checks reuse them)
        self.stop = None
        self.depth = 0
        self.x: dict = {}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.summary, indent=1, default=str))
        os.replace(tmp, self.path)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def guard(self, label: str) -> bool:
        """False (and the run stops) when the budget is spent or the CUDA context is lost."""
        if self.stop is None and self.left() <= 0:
            self.stop = f"budget of {self.budget:.0f} s spent before {label}"
        if self.stop is not None:
            return False
        return True

    def attempt(self, record: dict, body) -> dict | None:
        """Run ``body()`` for one configuration: record its outcome, print it, save."""
        label = f"{record['phase']} {record['name']}"
        if not self.guard(label):
            record["status"] = "not run"  # the budget or a lost context stopped the run (summary "stopped")
            return None
        print(f"\n=== {label} ({self.left():.0f} s of budget left)", flush=True)
        record["status"] = "started"  # what a hang or a kill leaves in the file
        self.save()
        self.depth += 1
        if self.depth == 1:  # one watchdog per top-level configuration (cross-checks nest runs)
            faulthandler.dump_traceback_later(self.config_timeout, exit=True)
        t = time.perf_counter()
        value = None
        try:
            value = body(record)
            record["status"] = "ok"
        except NotImplementedError as exc:
            record.update(status="refused", exception=f"{type(exc).__name__}: {exc}")
            record["traceback"] = traceback.format_exc()
        except Exception as exc:  # every failure is recorded, the run goes on
            record.update(status="error", exception=f"{type(exc).__name__}: {exc}")
            record["traceback"] = traceback.format_exc()
        finally:
            self.depth -= 1
            if self.depth == 0:
                faulthandler.cancel_dump_traceback_later()
        record["seconds"] = round(time.perf_counter() - t, 2)
        if record["status"] != "ok":
            print(record["traceback"], flush=True)
            try:
                _sync()
            except Exception as exc:  # a sticky error: nothing after it can be trusted
                self.stop = f"CUDA context lost after {label}: {exc}"
        print(f"--- {label}: {record['status']} in {record['seconds']} s", flush=True)
        for key in ("errors", "bitwise", "verdict"):
            if key in record:
                print(f"    {key}: {json.dumps(record[key], default=str)}", flush=True)
        return value

    def production(self, tag: str, dtype, cfg: dict, flags: dict | None = None, name: str | None = None):
        flash_attn = production_kernel()
        q, k, v, do = self.x[tag]
        flags = flags or {}
        name = name or _cfg_name(cfg, flags)
        record = {"phase": f"production-{tag}", "name": name, "dtype": tag, "mods": cfg, "flags": flags}

        def body(rec):
            kw = build_mods(**cfg, seed=SEED, device=DEVICE, **SHAPE)
            got = run(flash_attn, q, k, v, do, **flags, **kw)
            ref = reference(q, k, v, do, **flags, **kw)
            rec.update(fwd_s=got["fwd_s"], bwd_s=got["bwd_s"], errors=errors(got, ref))
            self.results[(tag, name)] = got
            return got

        self.summary["configs"].append(record)
        out = self.attempt(record, body)
        self.save()
        return out


def _cfg_name(cfg: dict, flags: dict) -> str:
    parts = [f"{k}={v}" for k, v in cfg.items()] + [f"{k}={v}" for k, v in flags.items()]
    return ",".join(parts) or "no-mods"


def library_configs() -> list[dict]:
    return [
        {},
        *[{"score_mod": s} for s in SCORE_MODS],
        *[{"mask_mod": m} for m in MASK_MODS],
        *[{"mask_mod": m, "block_sparse": BLOCK} for m in MASK_MODS],
    ]


def phase_production(r: Runner, tag: str) -> None:
    for cfg in library_configs():
        r.production(tag, DTYPES[tag], cfg)


def phase_cross(r: Runner, tag: str) -> None:
    flash_attn = production_kernel()
    q, k, v, do = r.x[tag]
    get = lambda cfg, flags=None: r.results.get((tag, _cfg_name(cfg, flags or {})))  # noqa: E731

    def pair(name, a_cfg, b_flags, note):
        rec = {"phase": f"cross-{tag}", "name": name, "dtype": tag, "note": note}

        def body(rec):
            a = get(a_cfg) or r.production(tag, DTYPES[tag], a_cfg)
            if a is None:
                raise RuntimeError(f"the {a_cfg} run failed (see its record)")
            b = run(flash_attn, q, k, v, do, **b_flags)
            ref = reference(q, k, v, do, **b_flags)
            rec.update(bitwise=bitwise(a, b), errors={"mod": errors(a, ref), "flag": errors(b, ref)})
            rec["verdict"] = "bitwise equal" if all(x["equal"] for x in rec["bitwise"].values()) else "differ"

        r.summary["cross_checks"].append(rec)
        r.attempt(rec, body)
        r.save()

    pair("softcap score_mod vs softcap flag", {"score_mod": "softcap"}, {"softcap": SOFTCAP_CAP},
         "production's softcap flag builds utils.create_softcap_scoremod: the same code")  # fmt: skip
    pair("causal mask_mod vs causal=True", {"mask_mod": "causal"}, {"causal": True},
         "mask_mod path (every key block visited, mask_mod per element) vs the causal path")  # fmt: skip

    for m in MASK_MODS:
        rec = {"phase": f"cross-{tag}", "name": f"block-sparse vs dense: {m}", "dtype": tag}

        def body(rec, m=m):
            dense = get({"mask_mod": m}) or r.production(tag, DTYPES[tag], {"mask_mod": m})
            sparse = get({"mask_mod": m, "block_sparse": BLOCK}) or r.production(
                tag, DTYPES[tag], {"mask_mod": m, "block_sparse": BLOCK}
            )
            if dense is None or sparse is None:
                raise RuntimeError("the dense or the block-sparse run failed (see their records)")
            rec["bitwise"] = bitwise(sparse, dense)
            rec["verdict"] = "bitwise equal" if all(x["equal"] for x in rec["bitwise"].values()) else "differ"

        r.summary["cross_checks"].append(rec)
        r.attempt(rec, body)
        r.save()

    for m in ("document", "prefix_lm"):
        rec = {"phase": f"cross-{tag}", "name": f"mask_mod {m} with causal=True", "dtype": tag}

        def body(rec, m=m):
            kw = build_mods(mask_mod=m, seed=SEED, device=DEVICE, **SHAPE)
            got = run(flash_attn, q, k, v, do, causal=True, **kw)
            mask_only = get({"mask_mod": m}) or r.production(tag, DTYPES[tag], {"mask_mod": m})
            refs = {
                "mask_only": reference(q, k, v, do, **kw),
                "intersection": reference(q, k, v, do, causal=True, **kw),
                "causal_only": reference(q, k, v, do, causal=True),
            }
            refs["mixed_prediction"] = mixed_backward_prediction(
                q, k, v, do, refs["mask_only"]["out"], refs["mask_only"]["lse"]
            )
            rec["errors"] = {name: errors(got, ref) for name, ref in refs.items()}
            if mask_only is not None:
                rec["bitwise_vs_mask_only_call"] = bitwise(got, mask_only)
            verdict = {}
            for n in NAMES:
                cand = {name: e[n]["rel"] for name, e in rec["errors"].items() if n in e}
                verdict[n] = min(cand, key=cand.get) if cand else None
            rec["verdict"] = {"closest reference per tensor": verdict}

        r.summary["cross_checks"].append(rec)
        r.attempt(rec, body)
        r.save()


def _phase_kernel(r: Runner, tag: str, kernel: str, phase: str, against_production: bool) -> None:
    """``kernel`` with each library configuration against float64 (and, ``against_production``,
    its bits against production's run of the same configuration)."""
    from audits.kernels import get_kernel

    q, k, v, do = r.x[tag]
    fn = get_kernel(kernel)
    for cfg in library_configs():
        name = _cfg_name(cfg, {})
        rec = {"phase": f"{phase}-{tag}", "name": name, "dtype": tag, "mods": cfg}

        def body(rec, cfg=cfg, name=name):
            kw = build_mods(**cfg, seed=SEED, device=DEVICE, **SHAPE)
            got = run(fn, q, k, v, do, **kw)
            rec.update(fwd_s=got["fwd_s"], bwd_s=got["bwd_s"], errors=errors(got, reference(q, k, v, do, **kw)))
            if against_production:
                # production's run of this configuration: this process's, or run now (a warm
                # machine has it in production's compile cache from an earlier call)
                prod = r.results.get((tag, name)) or r.production(tag, DTYPES[tag], cfg)
                if prod is not None:
                    rec["bitwise_vs_production"] = bitwise(got, prod)

        r.summary["configs"].append(rec)
        r.attempt(rec, body)
        r.save()


def phase_model(r: Runner, tag: str) -> None:
    _phase_kernel(r, tag, "fa4-model-sm90", "model", against_production=True)


def phase_flex(r: Runner, tag: str) -> None:
    _phase_kernel(r, tag, "flex", "flex", against_production=False)


def env_info() -> dict:
    from importlib import metadata

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    for dist in ("flash-attn-4", "flash_attn_4", "nvidia-cutlass-dsl", "triton", "quack-kernels"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    for var in ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "PYTHONPATH"):
        info[var] = os.environ.get(var)
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "h200_mods_out"), help="output directory (default $OUT)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds; no configuration starts after it")
    ap.add_argument("--config-timeout", type=float, default=300.0, help="seconds one configuration may hang")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated among {', '.join(PHASES)}")
    ap.add_argument("--stand-in", action="store_true", help="on the CPU, the SM90 model in production's place")
    args = ap.parse_args()
    global DEVICE, STAND_IN
    if args.stand_in:
        DEVICE, STAND_IN = "cpu", True
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    phases = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        ap.error(f"unknown phase(s) {unknown}; accepted: {', '.join(PHASES)}")

    r = Runner(out_dir, args.budget, args.config_timeout)
    print(json.dumps(r.summary["env"], indent=1), flush=True)
    try:
        if not STAND_IN:
            from fa4.production import require_production

            require_production()
    except Exception as exc:
        r.summary["stopped"] = f"production unavailable: {type(exc).__name__}: {exc}"
        r.save()
        print(r.summary["stopped"], flush=True)
        return 1
    r.x = {tag: inputs(dt) for tag, dt in DTYPES.items()}
    run_phase = {"production": phase_production, "cross": phase_cross, "model": phase_model, "flex": phase_flex}
    for p in phases:
        kind, tag = p.rsplit("-", 1)
        if not r.guard(p):
            break
        run_phase[kind](r, tag)
    r.summary["stopped"] = r.stop or "all phases done"
    r.summary["elapsed_s"] = round(time.monotonic() - r.t0, 1)
    r.save()
    counts: dict = {}
    for rec in r.summary["configs"] + r.summary["cross_checks"]:
        counts[rec.get("status", "?")] = counts.get(rec.get("status", "?"), 0) + 1
    print(f"\n{r.summary['stopped']}; {counts}; written {r.path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
