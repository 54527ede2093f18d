"""Hypothesis strategies over audit cases, and the search behind ``fa4-audit fuzz``.

``cases()`` draws a whole :class:`audits.cases.Case` (dtype, head dims, GQA grouping,
sequence lengths, mask, softcap, sink, layout, input family, seed); shrinking moves toward
small shapes, no mask and the ``normal`` family, so a failure shrinks to a minimal reproducer.
``fuzz`` climbs toward the largest error relative to the per-element bound with
``hypothesis.target`` and keeps Hypothesis' example database between runs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, given, settings, target
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from audits.cases import Case
from audits.inputs import FAMILIES
from audits.runner.repro import reproducer
from audits.runner.schema import FAILING

__all__ = ["cases", "fuzz"]


@st.composite
def cases(
    draw, *, max_seqlen: int = 512, dtypes: tuple[str, ...] = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
) -> Case:
    """Any audit case with sequence lengths up to ``max_seqlen``."""
    dtype = draw(st.sampled_from(dtypes))
    d = draw(st.sampled_from([64, 128, 96, 256]))
    hk = draw(st.sampled_from([1, 2]))
    hq = hk * draw(st.sampled_from([1, 2, 4]))
    sq = draw(st.integers(1, max_seqlen))
    sk = draw(st.integers(1, max_seqlen))
    mask = draw(st.sampled_from(["none", "causal", "local"]))
    fams = [f for f in FAMILIES if f != "nan_inf_masked"]
    family = draw(st.sampled_from(fams + ["nan_inf_masked"]))
    window = (None, None)
    if mask == "local":
        window = (
            draw(st.one_of(st.none(), st.integers(0, max_seqlen))),
            draw(st.one_of(st.none(), st.integers(0, max_seqlen))),
        )
    if family == "nan_inf_masked":  # needs keys that no query sees
        mask, window = "local", (draw(st.integers(0, 32)), 0)
        sk = max(sk, sq + window[0] + 2)
    layout = draw(st.sampled_from(["contiguous", "strided"]))
    return Case(
        dtype,
        d,
        d,
        draw(st.integers(1, 2)),
        hq,
        hk,
        sq,
        sk,
        causal=mask == "causal",
        window=window,
        softcap=draw(st.sampled_from([0.0, 30.0, 5.0])),
        sink=draw(st.booleans()),
        layout=layout,
        family=family,
        seed=draw(st.integers(0, 2**16)),
    )


def fuzz(
    kernel: str,
    *,
    budget: int,
    device: torch.device,
    thresholds: dict,
    database: str | Path,
    max_seqlen: int = 512,
    seed: int | None = None,
    backward=None,
    narrow=None,
    timeout: float | None = None,
) -> dict:
    """Search for a failing case; returns {examples, best_tightness, best_case, failure}.  A
    failure is the minimal case Hypothesis shrank to, with its verdict's reasons.  ``backward``
    (``audits.runner.backward.BackwardOptions``): audit the gradients too, and climb toward the
    largest error/bound over the output and the gradients.  ``narrow`` (an ``audits.domain.Domain``,
    ``fuzz --domain FILE``) narrows the kernel's declared domain: dtypes and lengths are drawn
    inside it, and a draw outside it otherwise is the kernel's ``skipped`` case.  ``timeout``
    (seconds, ``fuzz --timeout``): the kernel runs in a worker process (``audits.worker``)
    and a call past the limit is the example's ``timeout`` verdict, a failure; None: in this
    process, no limit."""
    from audits.kernels import get_kernel, kernel_domain
    from audits.runner.engine import evaluate_case
    from audits.worker import Isolated

    fn = Isolated(kernel, device, timeout=timeout) if timeout else get_kernel(kernel)
    domain = kernel_domain(kernel)
    draw = {"max_seqlen": max_seqlen}
    if narrow is not None:
        domain = domain.narrow(narrow)
        draw["max_seqlen"] = min(max_seqlen, narrow.max_seqlen or max_seqlen)
        draw.update({"dtypes": narrow.dtypes} if narrow.dtypes else {})
    state = {"examples": 0, "best": (-1.0, None), "fail": None}

    @settings(
        max_examples=budget,
        database=DirectoryBasedExampleDatabase(str(database)),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    )
    @given(cases(**draw))
    def prop(case: Case) -> None:
        rec = evaluate_case(kernel, fn, case, device, thresholds, backward, domain)  # outside it: skipped
        state["examples"] += 1
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
        if isinstance(fn, Isolated):
            fn.close()
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
                device=torch.device(device).type,
                thresholds_path=thresholds.get("path"),
                backward=backward,
            ),  # fmt: skip
        }
    best_t, best_c = state["best"]
    return {
        "kernel": kernel,
        "examples": state["examples"],
        "best_tightness": best_t if best_c else None,
        "best_case": best_c.name if best_c else None,
        "failure": failure,
    }
