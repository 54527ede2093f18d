"""Hypothesis strategies over audit cases, and the search behind ``fa4-audit fuzz``.

``cases()`` draws a whole :class:`audits.suites.cases.Case` (dtype, head dims, GQA grouping,
sequence lengths, mask, softcap, sink, layout, input family, seed) inside a kernel's domain
(``audits.suites.domain``: what it declares, narrowed by ``--domain``, as ``run`` builds its suites);
shrinking moves toward small shapes, no mask and the ``normal`` family, so a failure shrinks to a
minimal reproducer.
``fuzz`` climbs toward the largest error relative to the per-element bound with
``hypothesis.target`` and keeps Hypothesis' example database between runs.

With ``mods`` (``fuzz --mods``) a case also draws the programmable surface the kernel's domain
declares (``audits.suites.domain`` key ``mods``): a library score_mod and mask_mod
(``numerics.mod_library``) and block sparsity built from the mask_mod (:func:`draw_mods`).
Without it the draws are exactly those of before (the mod fields stay unset).
"""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings, target
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from audits.engine.options import RunOptions
from audits.engine.session import open_session
from audits.kernels import kernel_domain
from audits.report.repro import reproducer
from audits.report.schema import FAILING
from audits.suites.cases import MOD_BLOCK, MOD_BLOCK_SM100, Case
from audits.suites.domain import Domain
from audits.suites.inputs import FAMILIES
from numerics.mod_library import MASK_MODS, SCALAR_SCORE_MODS, SCORE_MODS

__all__ = ["cases", "fuzz", "draw_mods", "MOD_BLOCKS"]


#: head-dim pairs drawn where the domain does not restrict them: d = dv at the common head dims,
#: and d != dv (issue 33: a kernel taking the scale from dv, or from a padded d, is caught only
#: where they differ and the scale matters), production SM100's (192, 128) among them and pairs
#: off every multiple of 32
_HEAD_PAIRS = ((64, 64), (128, 128), (96, 96), (256, 256), (192, 128), (72, 80), (128, 64), (40, 96))
_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


#: block sparsity's (block_q, block_k) drawn by ``--mods``: the blocks the mods suite uses
#: (``audits.suites.cases.MOD_BLOCK``, ``MOD_BLOCK_SM100``), drawn only at d <= 128 where both archs'
#: forward tile_n is 128 (``interface._tile_size_fwd_sm90``; SM90's ``normalize_block_sparse_config``
#: wants block_k == tile_n, and tile_n is 112 / 80 above d = 128)
MOD_BLOCKS = (MOD_BLOCK, MOD_BLOCK_SM100)


def draw_mods(draw, dom: Domain, d: int) -> dict:
    """The mod fields of a case inside ``dom`` (its ``mods`` kinds): a score_mod of
    ``numerics.mod_library.SCORE_MODS`` or none (one reading runtime scalars, ``SCALAR_SCORE_MODS``,
    only when the kind ``aux_scalars`` is declared too), a mask_mod of ``MASK_MODS`` or none, block
    sparsity (:data:`MOD_BLOCKS`) only with a mask_mod, the kind declared and d <= 128.  Each
    shrinks toward none."""
    out = {"score_mod": "", "mask_mod": "", "block_sparse": ()}
    if "score_mod" in dom.mods:
        scalars = "aux_scalars" in dom.mods
        out["score_mod"] = draw(
            st.sampled_from(("",) + tuple(s for s in SCORE_MODS if scalars or s not in SCALAR_SCORE_MODS))
        )
    if "mask_mod" in dom.mods:
        out["mask_mod"] = draw(st.sampled_from(("",) + MASK_MODS))
    if out["mask_mod"] and "block_sparse" in dom.mods and d <= 128:
        out["block_sparse"] = draw(st.sampled_from(((),) + MOD_BLOCKS))
    return out


def _length(draw, m: int, lo: int, hi: int) -> int:
    """A multiple of ``m`` in [lo, hi] (the smallest multiple at least ``lo`` when none is at
    most ``hi``: inside the domain, past ``--max-seqlen``), shrinking toward the smallest."""
    first = -(-lo // m)
    return m * draw(st.integers(first, max(first, hi // m)))


@st.composite
def cases(
    draw, *, max_seqlen: int = 512, dtypes: tuple[str, ...] = _DTYPES, domain: Domain | None = None, mods: bool = False
) -> Case:
    """Any audit case with sequence lengths up to ``max_seqlen``, drawn inside ``domain`` (an
    ``audits.suites.domain.Domain``; None: unrestricted): its dtypes, its accepted (d, dv) pairs
    (``Domain.head_dim_pairs``), lengths as multiples of ``seqlen_q_multiple`` /
    ``seqlen_k_multiple`` within its bounds (equal when it wants them), the masks and features it
    supports, its layouts; an input family only where the domain can hold it (``nan_inf_masked``
    needs a left window and more keys than queries).  ``Domain.refusal`` stays the judge:
    :func:`fuzz` counts a draw it refuses (none expected) as ``outside_domain``.

    ``mods``: draw the mods too (:func:`draw_mods`), drawn before the flags they exclude: a
    mask_mod comes without the causal / window flags (production drops them beside a mask_mod,
    ``interface._resolve_causal_local_window``: every such draw would fail on that one known
    trap, which the catalogue's own case reports) and without the nan_inf families (their
    infinities sit at keys chosen under the flags; ``audits.suites.inputs`` refuses them beside a mask
    it would break); a score_mod comes without softcap (production asserts the two are not used
    together, ``interface._flash_attn_fwd``)."""
    dom = domain or Domain()
    kinds = [t for t in dtypes if dom.dtypes is None or t in dom.dtypes] or list(dom.dtypes or dtypes)
    dtype = draw(st.sampled_from(kinds))
    pairs = dom.head_dim_pairs()
    d, dv = draw(st.sampled_from(list(pairs) if pairs is not None else list(_HEAD_PAIRS)))
    hk = draw(st.sampled_from([1, 2]))
    hq = hk * draw(st.sampled_from([1, 2, 4] if dom.gqa else [1]))
    lo, hi = dom.min_seqlen, min(max_seqlen, dom.max_seqlen or max_seqlen)
    qm, km = dom.seqlen_q_multiple, dom.seqlen_k_multiple
    if dom.equal_seqlens:
        sq = sk = _length(draw, qm * km // math.gcd(qm, km), lo, hi)
    else:
        sq, sk = _length(draw, qm, lo, hi), _length(draw, km, lo, hi)
    mod = draw_mods(draw, dom, d) if mods else {}
    masking = not mod.get("mask_mod")
    mask = draw(st.sampled_from(["none"] + ["causal"] * (dom.causal and masking) + ["local"] * (dom.local and masking)))
    fams = [f for f in FAMILIES if f != "nan_inf_masked" and (masking or not f.startswith("nan_inf"))]
    # nan_inf_masked: keys no query sees, a left window short of them
    masked = dom.local and not dom.equal_seqlens and masking
    family = draw(st.sampled_from(fams + ["nan_inf_masked"] * masked))
    window = (None, None)
    if mask == "local":
        window = (
            draw(st.one_of(st.none(), st.integers(0, max_seqlen))),
            draw(st.one_of(st.none(), st.integers(0, max_seqlen))),
        )
    if family == "nan_inf_masked":  # needs keys that no query sees
        mask, window = "local", (draw(st.integers(0, 32)), 0)
        sk = max(sk, -(-(sq + window[0] + 2) // km) * km)
    layouts = [x for x in ("contiguous", "strided") if dom.layouts is None or x in dom.layouts] or list(dom.layouts)
    layout = draw(st.sampled_from(layouts))
    return Case(
        dtype,
        d,
        dv,
        draw(st.integers(1, 2)),
        hq,
        hk,
        sq,
        sk,
        causal=mask == "causal",
        window=window,
        softcap=draw(st.sampled_from([0.0, 30.0, 5.0] if dom.softcap and not mod.get("score_mod") else [0.0])),
        sink=draw(st.booleans()) if dom.sink else False,
        layout=layout,
        family=family,
        seed=draw(st.integers(0, 2**16)),
        **mod,
    )


def fuzz(
    kernel: str,
    *,
    options: RunOptions,
    budget: int,
    database: str | Path,
    max_seqlen: int = 512,
    seed: int | None = None,
    narrow: Domain | None = None,
    mods: bool = False,
) -> dict:
    """Search for a failing case; returns {examples, best_tightness, best_case, failure}.  A
    failure is the minimal case Hypothesis shrank to, with its verdict's reasons.  Each example is
    one case evaluated as ``run`` evaluates it, under ``options`` (``audits.engine.options.
    RunOptions``: device, thresholds, backward, timeout), through one kernel session
    (``audits.engine.session``).  ``options.backward``: audit the gradients too, and climb toward
    the largest error/bound over the output and the gradients.  Cases are drawn inside the kernel's
    declared domain (:func:`cases`), which ``narrow`` (an ``audits.suites.domain.Domain``, ``fuzz --domain
    FILE``) narrows; ``Domain.refusal`` judges each draw, one outside it is the kernel's ``skipped``
    case and counted (``outside_domain``).  With a
    time limit asked for (``options.timeout`` and ``timeout_given``: ``fuzz --timeout``) the kernel
    runs in a worker process (``audits.engine.worker``) and a call past the limit is the example's
    ``timeout`` verdict, a failure.  ``mods`` (``fuzz --mods``): draw the library mods the domain declares
    (:func:`cases`); ValueError when it declares none (a search that cannot draw what it was
    asked to)."""
    domain = kernel_domain(kernel)
    if narrow is not None:
        domain = domain.narrow(narrow)
    if mods and not domain.mods:
        raise ValueError(
            f"fuzz --mods: kernel {kernel!r} declares no mod kinds (domain key 'mods'); nothing to draw. A kernel "
            "taking them declares mods = ['score_mod', 'mask_mod', 'block_sparse'] or the kinds it takes"
        )
    # drawn inside the kernel's domain, as run builds suites
    draw = {"max_seqlen": max_seqlen, "domain": domain, "mods": mods}
    state = {"examples": 0, "outside": 0, "best": (-1.0, None), "fail": None}
    session = open_session(kernel, options, domain=domain)

    @settings(
        max_examples=budget,
        database=DirectoryBasedExampleDatabase(str(database)),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    )
    @given(cases(**draw))
    def prop(case: Case) -> None:
        rec = session.evaluate(case)  # outside the domain: skipped, not called
        state["examples"] += 1
        state["outside"] += domain.refusal(case) is not None  # the judge: the strategy draws inside, so 0
        grads = ((rec.get("backward") or {}).get("grads") or {}).values()
        tights = [(rec.get("bound") or {}).get("tightness")] + [(g.get("bound") or {}).get("tightness") for g in grads]
        tight = max((t for t in tights if t is not None), default=None)
        if tight is not None:
            target(tight, label="error / bound")
            if tight > state["best"][0]:
                state["best"] = (tight, case)
        if rec["verdict"] in FAILING:
            state["fail"] = (case, rec)  # the last failing call is the shrunk, minimal one
            raise AssertionError(f"{rec['verdict']}: {'; '.join(rec['reasons'])}")

    if seed is not None:
        prop = hypothesis_seed(seed)(prop)
    failure = None
    try:
        prop()
    except AssertionError:
        pass
    finally:
        session.close()
    if state["fail"] is not None:
        case, rec = state["fail"]
        failure = {
            "case": case.as_dict(),
            "name": case.name,
            "verdict": rec["verdict"],
            "reasons": rec["reasons"],
            "repro": reproducer(
                kernel,
                case,
                device=options.torch_device.type,
                thresholds_path=options.thresholds.get("path"),
                backward=options.backward,
            ),
        }
    best_t, best_c = state["best"]
    return {
        "kernel": kernel,
        "examples": state["examples"],
        "domain": domain.as_dict(),
        **({"mods": True} if mods else {}),
        "outside_domain": state["outside"],
        "best_tightness": best_t if best_c else None,
        "best_case": best_c.name if best_c else None,
        "failure": failure,
    }
