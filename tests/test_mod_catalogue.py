"""The seeded mod bugs (tests/bugged_mods.py, ``BUGS``) through the audit itself: ``fa4-audit run
--backward`` (``run_suites`` with ``BackwardOptions``, default thresholds: a file kernel is a
peer, held to the peer bound and FA's criterion) on smoke's mod cases (``audits.suites.cases.smoke_mods``).

Each bug must fail exactly on the cases of its axis, with the reasons that name the tensor it
breaks and none of the others (a backward bug leaves the forward clean, a dQ bug dK and dV), and
pass the rest; the clean kernel (the same model, no bug) passes every case.  What each case is
(``smoke_mods``): ALiBi + prefix-LM, block-sparse (256, 128), GQA; relbias + document, dense,
fp16; softcap + sliding window, block-sparse (128, 128); causal as a mask_mod beside causal=True.

Measured (CPU, 2 threads): every verdict below; 25 s for the six kernels (4.6 min on a shared CPU).  Two passes are
part of the catalogue, not gaps: ``mask_ignored_in_bwd`` passes the causal-mask_mod case because
production's backward (and the model's) keeps ``causal=True`` (``_flash_attn_bwd`` resolves the
flags without the mask_mod) — there the flag alone gives the mask; ``aux_wrong_head`` passes the
softcap case, whose mod reads no aux tensor.
"""

import re

import pytest
import torch

import tests.bugged_mods as bm
from audits.engine.backward import BackwardOptions
from audits.suites.cases import smoke_mods

#: the slow tier: six kernels forward and backward over four cases (~3 min CPU)
pytestmark = pytest.mark.slow

CASES = smoke_mods()
FWD = r"exceed the forward-pass bound|FA criterion: max\|out|LSE max \|err\|"


def grad(*names: str) -> str:
    return "|".join(rf"FA criterion: max\|{n} - ref\|" for n in names)


def _per_head_aux(c) -> bool:
    """A score_mod reading a per-head aux tensor (ALiBi's slopes, the relative bias's table)."""
    return c.score_mod in ("alibi", "relbias")


def _mask_not_given_by_flags(c) -> bool:
    """A mask_mod the call's flags do not already impose (the backward keeps the flags)."""
    return bool(c.mask_mod) and not (c.mask_mod == "causal" and c.causal)


#: bug -> (the cases it must fail: a predicate on Case; reasons every failing case gives some of
#: (regex); reasons no case may give (regex))
EXPECT = {
    "mask_ignored_in_bwd": (_mask_not_given_by_flags, grad("dq", "dk", "dv"), FWD),
    "partial_block_as_full": (lambda c: bool(c.block_sparse), FWD, r"^$"),
    "score_mod_bwd_wrong": (lambda c: bool(c.score_mod), grad("dq", "dk"), rf"{FWD}|{grad('dv')}"),
    "aux_wrong_head": (_per_head_aux, FWD, r"^$"),
    "bs_bwd_drops_dq_block": (lambda c: bool(c.block_sparse), grad("dq"), rf"{FWD}|{grad('dk', 'dv')}"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One ``run_suites`` over smoke's mod cases for the clean kernel and every bugged one (they
    share the inputs and the FP64 references), --backward with one backward run."""
    from audits.engine.options import RunOptions
    from audits.engine.run import run_suites
    from audits.verdict.gate import load_thresholds

    torch.set_num_threads(min(2, torch.get_num_threads()))
    names = ["clean"] + [f"bug_{b}" for b in bm.BUGS]
    spec = {k: f"{bm.__file__}:{k}" for k in names}
    out = tmp_path_factory.mktemp("mod_catalogue")
    bwd = BackwardOptions(repeat=1)
    options = RunOptions(out=out, thresholds=load_thresholds(), label="smoke", isolate=False, backward=bwd)
    recs = run_suites(list(spec.values()), CASES, options)
    return {k: {r["case"]: r for r in recs[s]} for k, s in spec.items()}


def test_every_bug_is_catalogued_and_documented():
    assert set(EXPECT) == set(bm.BUGS)
    for bug, doc in bm.BUGS.items():
        assert getattr(bm, f"bug_{bug}").__doc__ == doc
    for bug, (axis, _, _) in EXPECT.items():
        assert any(axis(c) for c in CASES), f"smoke has no case on {bug}'s axis"
        assert not all(axis(c) for c in CASES), f"{bug}: every case on its axis, nothing shows it passes elsewhere"


def test_clean_kernel_passes_every_mod_case(runs):
    assert set(runs["clean"]) == {c.name for c in CASES}
    for name, r in runs["clean"].items():
        assert r["verdict"] == "pass", (name, r["verdict"], r["reasons"])
        assert r["backward"]["status"] == "ran", (name, r["backward"])  # the gradients were compared


@pytest.mark.parametrize("bug", list(EXPECT))
def test_bug_fails_on_its_axis_with_its_reason(runs, bug):
    axis, want, never = EXPECT[bug]
    recs = runs[f"bug_{bug}"]
    for c in CASES:
        r = recs[c.name]
        if not axis(c):
            assert r["verdict"] == "pass", (bug, c.name, r["reasons"])
            continue
        assert r["verdict"] == "fail", (bug, c.name, r["verdict"], r["reasons"])
        assert any(re.search(want, why) for why in r["reasons"]), (bug, c.name, r["reasons"])
        assert not any(re.search(never, why) for why in r["reasons"]), (bug, c.name, r["reasons"])
