"""Cases that carry signal (issue 33 item 6): the "carries signal" rule
(``audits.suites.signal.signal``), smoke having a case that carries it for every feature it has,
the seeded feature bugs (``tests/feature_bugs.py``) each failing smoke on a case of its feature,
coverage counting a feature or a head-dim pair only by such cases, and fuzz drawing d != dv."""

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from audits.checks.fuzz import cases as fuzz_cases
from audits.suites.case import Case
from audits.suites.cases import suite
from audits.suites.domain import Domain
from audits.suites.inputs import make_inputs
from audits.suites.signal import LOGIT_REACH, features_of, signal
from audits.verdict.coverage import coverage
from numerics.reference import visible_mask
from tests import feature_bugs as fb

SMOKE = suite("smoke")


def test_smoke_carries_signal_for_every_feature_it_has():
    """Every feature some smoke case has (dtypes, masks, softcap, sink, GQA, each mod kind), d != dv,
    and the varlen entry's features are carried by a case whose inputs make them matter."""
    had = set().union(*(features_of(c) for c in SMOKE)) | {"head_dims"}
    had |= {f for c in SMOKE if c.varlen for f in ("varlen", "seqused_k", "paged") if f in _varlen_features(c)}
    carried = set().union(*(signal(c) for c in SMOKE))
    assert had - carried == set()
    unequal = [c for c in SMOKE if c.d != c.dv and "head_dims" in signal(c)]
    assert unequal and any(c.d % 32 for c in unequal)  # the scale from dv, or from d padded, differs there
    assert set(fb.AXIS.values()) <= carried  # the catalogue's axes are smoke's


def _varlen_features(c: Case) -> set[str]:
    return {"varlen"} | ({"seqused_k"} if c.seqused_k else set()) | ({"paged"} if c.page_size else set())


def test_the_rule_drops_degenerate_inputs():
    """Subnormal keys carry no scale (logits ~2**-130), NaN-visible rows no arithmetic, MQA no
    head mapping, a window wider than the sequence no mask, a cap above the logits no softcap."""
    sub = Case("bfloat16", 64, 72, 1, 2, 2, 64, 96, family="subnormal")
    assert "head_dims" not in signal(sub) and "dtype=bfloat16" in signal(sub)
    assert "head_dims" in signal(dataclasses.replace(sub, family="normal"))
    nan = Case(family="nan_inf_visible", heads_q=4, heads_kv=2, causal=True, sink=True)
    assert signal(nan) == {"mask=causal"}
    assert "gqa" not in signal(Case(heads_q=4, heads_kv=1)) and "gqa" in signal(Case(heads_q=4, heads_kv=2))
    assert "mask=local" not in signal(Case(window=(500, 500)))
    assert "mask=local" in signal(Case(window=(500, 0))) and "mask=causal" in signal(Case(causal=True))
    assert "mask=causal" not in signal(Case(causal=True, seqlen_q=1, seqlen_k=1))
    assert "softcap" not in signal(Case(softcap=15.0)) and "softcap" in signal(Case(softcap=15.0, family="drift"))


def test_the_mask_rule_agrees_with_the_reference_mask():
    """The rule's O(seqlen_q) window arithmetic gives what ``numerics.reference.visible_mask``
    gives: some row that sees a key misses another."""
    for c in (c for c in SMOKE if not c.varlen):
        for w in ((None, None), (10, None), (None, 5), (3, 0), (64, 16), (0, 0), (500, None)):
            for causal in (False, True):
                cc = dataclasses.replace(c, window=w, causal=causal)
                vis = visible_mask(cc.seqlen_q, cc.seqlen_k, causal=causal, window_size=w)
                want = bool((vis.any(-1, keepdim=True) & ~vis).any())
                got = f"mask={'causal' if causal else 'local'}" in signal(cc)
                assert got == (want and (causal or any(x is not None for x in w))), (cc.name, w, causal)


@pytest.mark.parametrize("family", sorted(LOGIT_REACH))
def test_logit_reach_is_a_lower_bound(family):
    """:data:`audits.suites.signal.LOGIT_REACH` never claims more than the inputs reach: the
    largest finite |logit| of the family at the suites' smallest shapes (64 queries, d 64;
    256 keys, where drift reaches its top) is at least the table's."""
    for seed in range(3):
        window = (32, 0) if family == "nan_inf_masked" else (None, None)  # it needs keys no query sees
        c = Case("bfloat16", 64, 64, 1, 2, 2, 64, 256, window=window, family=family, seed=seed)
        x = make_inputs(c)
        s = torch.einsum("bihd,bjhd->bhij", x["q"].double(), x["k"].double()) / math.sqrt(c.d)
        top = s[torch.isfinite(s)].abs().max()
        assert float(top) >= LOGIT_REACH[family], (family, seed, float(top))


# ---- the seeded feature bugs -------------------------------------------------------------------


def test_every_feature_bug_is_documented_and_on_an_axis():
    assert set(fb.FEATURE_BUGS) == set(fb.AXIS) and all(fb.FEATURE_BUGS.values())


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """One audit of smoke for the exact kernel and every bugged one (they share inputs and
    references)."""
    from audits.api import RunOptions, audit
    from audits.verdict.gate import load_thresholds

    torch.set_num_threads(min(2, torch.get_num_threads()))
    names = ["exact"] + [f"bug_{b}" for b in fb.FEATURE_BUGS]
    spec = {n: f"{fb.__file__}:{n}" for n in names}
    out = tmp_path_factory.mktemp("feature_bugs")
    options = RunOptions(out=out, thresholds=load_thresholds(), label="smoke", isolate=False)
    rep = audit(list(spec.values()), SMOKE, options)
    return {n: rep.records[s] for n, s in spec.items()}


@pytest.mark.slow  # smoke for 17 kernels on the FP64 reference: 10-75 s CPU
def test_smoke_fails_every_feature_bug_on_a_case_of_its_feature(smoke_runs):
    bad = [r["case"] for r in smoke_runs["exact"] if r["verdict"] in ("fail", "error", "crash", "timeout")]
    assert bad == [], "the exact kernel fails smoke"
    by_name = {c.name: c for c in SMOKE}
    for bug, axis in fb.AXIS.items():
        recs = smoke_runs[f"bug_{bug}"]
        broken = [r["case"] for r in recs if r["verdict"] in ("error", "crash", "timeout")]
        assert not broken, f"{bug}: cases not judged: {broken}"
        failed = [r for r in recs if r["verdict"] == "fail"]
        on_axis = [r["case"] for r in failed if axis in signal(by_name[r["case"]])]
        assert on_axis, f"{bug} ({fb.FEATURE_BUGS[bug]}): no failing case carries {axis}: {[r['case'] for r in failed]}"


# ---- coverage counts only cases that carry signal -------------------------------------------


def _rec(case: Case) -> dict:
    return {"case": case.name, "config": case.as_dict(), "verdict": "pass", "status": "ran", "out": {"max_abs": 0.0}}


def test_coverage_counts_a_pair_and_a_feature_only_by_a_case_carrying_signal():
    dom = Domain.from_dict({"head_dims": [[64, 72], [64, 64]]}, where="test")
    sub = Case("bfloat16", 64, 72, 1, 2, 2, 64, 96, family="subnormal", softcap=15.0)
    cov = coverage(cases=[sub], records=[_rec(sub)], domain=dom, arch=None)
    assert cov["head_dims"]["forward"] == [] and cov["head_dims"]["missed_forward"] == [[64, 64], [64, 72]]
    assert cov["features"]["softcap"]["forward"] is None and cov["features"]["dtype=bfloat16"]["forward"]
    good = dataclasses.replace(sub, family="drift")
    cov = coverage(cases=[sub, good], records=[_rec(sub), _rec(good)], domain=dom, arch=None)
    assert cov["head_dims"]["forward"] == [[64, 72]] and cov["features"]["softcap"]["forward"] == good.name


# ---- fuzz draws d != dv ------------------------------------------------------------------------


def test_fuzz_draws_unequal_head_dims_where_the_domain_allows():
    seen = []

    @settings(max_examples=60, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(fuzz_cases())
    def draw(c):
        seen.append((c.d, c.dv))

    draw()
    assert any(d != dv for d, dv in seen)
    only = Domain.from_dict({"head_dims": [[128, 128]]}, where="test")
    seen.clear()

    @settings(max_examples=10, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(fuzz_cases(domain=only))
    def inside(c):
        seen.append((c.d, c.dv))

    inside()
    assert set(seen) == {(128, 128)}
