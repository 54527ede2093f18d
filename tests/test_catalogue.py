"""The catalogue of seeded bugs (tests/bugged_kernels.BUGS): the smoke suite fails every one.

Each bugged kernel runs the whole smoke suite and must be *judged*: exit code 1, at least one
case with verdict exactly "fail", none with "error" or "crash" (a kernel that raises would fail
the suite too, without showing that the suite sees the bug).  Every failing case must carry the
reason the bug should cause, and among the failures must be a case of the bug's feature axis
(the sink bug fails a sink case, the fp16 range bug an fp16 case with a drifting maximum, ...):
a bug caught only by accident elsewhere means its axis is untested.
"""

import json
import re
from pathlib import Path

import pytest

from audits import cli
from numerics.call import AttentionCall
from tests.bugged_kernels import BUGS

ROOT = Path(__file__).parents[1]

BOUND = r"exceed the forward-pass bound"
NONFINITE = r": the kernel returns .* where the FP64 reference is finite"  # outputs or LSE values (gate._nonfinite)
LSE = (
    r"LSE max \|err\||LSE: [\d,]+ values? exceed|LSE values?: the kernel returns .* where the FP64 reference is finite"
)
OUTPUT = rf"{BOUND}|FA criterion|{NONFINITE}"

DRIFTING = ("drift", "tile_step_")


def _drifting(c: dict) -> bool:
    return c["family"].startswith(DRIFTING)


#: bug -> (regex every failing case's reasons must match, what the axis case is, predicate on
#: a failing case's config)
EXPECT = {
    "no_causal": (OUTPUT, "a causal case", lambda c: c["causal"]),
    "window_off_by_one": (
        OUTPUT,
        "a local-window case with a right edge",
        lambda c: not c["causal"] and c["window"][1] is not None,
    ),
    "gqa_tile": (OUTPUT, "a GQA case (heads_kv >= 2, heads_q > heads_kv)", lambda c: 2 <= c["heads_kv"] < c["heads_q"]),
    "no_o_rescale": (OUTPUT, "a case with a drifting maximum", _drifting),
    "stale_sum": (OUTPUT, "a case with a drifting maximum", _drifting),
    "flush_p": (BOUND, "the 16-bit long-tail case", lambda c: c["family"] == "long_tail" and c["dtype"] == "bfloat16"),
    "saturate_p": (NONFINITE, "any case", lambda c: True),
    "nan_leak": (NONFINITE, "the masked-NaN case", lambda c: c["family"] == "nan_inf_masked"),
    "lse_log2": (LSE, "any case", lambda c: True),
    "layout": (OUTPUT, "a non-contiguous case", lambda c: c["layout"] != "contiguous"),
    "bf16_accum": (BOUND, "a float16 case", lambda c: c["dtype"] == "float16"),
    "sink_ignored": (rf"{LSE}|{OUTPUT}", "a sink case", lambda c: c["sink"]),
    "softcap_no_div": (rf"{LSE}|{OUTPUT}", "a softcap case", lambda c: c["softcap"] > 0),
    "fp16_lagging_max": (
        NONFINITE,
        "a float16 case with a drifting maximum",
        lambda c: c["dtype"] == "float16" and _drifting(c),
    ),
    "fp8_p_saturates": (
        BOUND,
        "an e4m3 case with a drifting maximum",
        lambda c: c["dtype"] == "float8_e4m3fn" and _drifting(c),
    ),
    "e5m2_p_saturates": (
        BOUND,
        "an e5m2 case with a drifting maximum",
        lambda c: c["dtype"] == "float8_e5m2" and _drifting(c),
    ),
}


def test_every_bug_has_an_expectation():
    assert set(EXPECT) == set(BUGS)
    from tests import bugged_kernels

    for bug in BUGS:
        assert getattr(bugged_kernels, f"bug_{bug}").__doc__ == BUGS[bug]  # what it breaks


#: bugs the fast tier runs end to end; each is a whole smoke run (14-38 s CPU), the rest are in the slow tier
FAST_BUGS = {"gqa_tile"}


@pytest.mark.parametrize("bug", [b if b in FAST_BUGS else pytest.param(b, marks=pytest.mark.slow) for b in BUGS])
def test_smoke_suite_judges_and_fails_every_catalogued_bug(tmp_path, monkeypatch, bug):
    monkeypatch.chdir(ROOT)  # tests.bugged_kernels resolves as module:attr
    rc = cli.main(
        ["run", "--quiet", "--kernel", f"tests.bugged_kernels:bug_{bug}", "--suite", "smoke", "--out", str(tmp_path)]
    )
    cases = json.loads((tmp_path / "report.json").read_text())["cases"]
    verdicts = {c["case"]: c["verdict"] for c in cases}
    assert rc == 1, f"{bug} ({BUGS[bug]}) passes the smoke suite"
    broken = {n: v for n, v in verdicts.items() if v in ("error", "crash")}
    assert not broken, f"{bug}: cases not judged: {broken}"
    failed = [c for c in cases if c["verdict"] == "fail"]
    assert failed, f"{bug}: no case fails: {verdicts}"
    pattern, axis, on_axis = EXPECT[bug]
    for c in failed:
        assert any(re.search(pattern, r) for r in c["reasons"]), f"{bug}: {c['case']} fails for {c['reasons']}"
    assert any(on_axis(c["config"]) for c in failed), (
        f"{bug}: none of the failing cases is {axis}: {[c['case'] for c in failed]}"
    )


def test_the_smoke_suites_sinks_carry_weight():
    """The learnable sink is placed against each head's largest visible logit (above, near,
    below: ``audits.suites.inputs.SINK_PLACES``), so dropping it moves the FP64 LSE far beyond the
    LSE tolerance on every sink case — drawn independently of the logits (N(0,1) beside logits
    up to 40) it carried e**-40 of the mass and a kernel ignoring it passed."""
    import math

    import torch

    from audits.suites.cases import smoke_suite
    from audits.suites.inputs import SINK_PLACES, make_inputs
    from numerics.reference import attention_reference, visible_mask

    sinks = [c for c in smoke_suite() if c.sink]
    assert sinks and max(c.heads_q for c in sinks) >= len(SINK_PLACES)  # every place is tested
    for c in sinks:
        x = make_inputs(c)
        q, k, kw = x["q"].double(), x["k"].double(), x["kw"]
        kk = k.repeat_interleave(c.heads_q // c.heads_kv, dim=2)
        s = torch.einsum("bihd,bjhd->bhij", q, kk) / math.sqrt(c.d)
        if c.softcap:
            s = c.softcap * torch.tanh(s / c.softcap)
        vis = visible_mask(c.seqlen_q, c.seqlen_k, causal=c.causal, window_size=c.window)
        top = s.masked_fill(~vis, -math.inf).amax(dim=(0, 2, 3))
        for h in range(c.heads_q):
            lo, hi = SINK_PLACES[h % len(SINK_PLACES)]
            assert lo - 0.01 <= float(kw["learnable_sink"][h]) - float(top[h]) <= hi + 0.01, (c.name, h)
        _, with_sink = attention_reference(
            x["q"], x["k"], x["v"], call=AttentionCall.from_kwargs(**kw), return_lse=True
        )
        _, without = attention_reference(
            x["q"], x["k"], x["v"], call=AttentionCall.from_kwargs(**{**kw, "learnable_sink": None}), return_lse=True
        )
        fin = torch.isfinite(without)
        assert (with_sink - without)[fin].amax() > 0.1, c.name
        assert make_inputs(c)["kw"]["learnable_sink"].equal(kw["learnable_sink"])  # deterministic
