"""``fa4-audit compare`` (docs/compare.md): the bit-level diff, the per-case comparison, and the
command's summary and exit codes on candidates with known changes (tests/compare_kernels.py)."""

import json

import pytest
import torch

from audits import cli
from audits.engine.compare import COMPARED, NOT_COMPARED, compare_case
from audits.report.compare import compare_reports, render_html, render_md, summary_lines
from audits.suites.cases import suite
from audits.verdict.diagnosis import CaseTensors
from audits.verdict.gate import load_thresholds
from numerics.metrics import bit_diff

KERNELS = "tests/compare_kernels.py"
#: four smoke cases: causal and not, bf16 and fp16, one with a sink
CASES = ["bf16-d64-b2h4k2-s200x300-causal-normal-seed0", "f16-d128-b1h4k1-s160x160-uniform-seed0",
         "f16-d64-b1h3k1-s96x64-causal-sink-normal-seed0", "bf16-d96-b1h2k2-s130x70-causal-peaked-seed0"]  # fmt: skip


def _next(x: torch.Tensor, n: int = 1) -> torch.Tensor:
    """``x`` moved ``n`` representable values away from zero (bf16)."""
    return (x.view(torch.int16) + n).view(torch.bfloat16)


def test_bit_diff_counts_every_kind_of_change():
    a = torch.tensor([1.0, 2.0, 3.0, 0.0, float("nan"), 5.0, float("inf"), 7.0], dtype=torch.bfloat16)
    b = a.clone()
    b[1] = _next(a[1:2])[0]  # 1 ULP
    b[2] = _next(a[2:3], 3)[0]  # 3 ULP
    b[3] = -0.0  # the sign of a zero
    b[4] = (a[4:5].view(torch.int16) ^ 1).view(torch.bfloat16)[0]  # another NaN payload
    b[5] = float("inf")  # new non-finite
    b[6] = float("-inf")  # an inf changed sign
    d = bit_diff(a, b)
    assert d["elements"] == 8 and d["differ"] == 6
    assert d["ulp_histogram"]["1"] == 1 and d["ulp_histogram"]["3-4"] == 1 and sum(d["ulp_histogram"].values()) == 2
    assert d["max_ulp"] == 3 and d["max_ulp_at"]["index"] == [2]
    assert (d["signed_zero"], d["nan_payload"], d["new_nonfinite"], d["nonfinite_changed"]) == (1, 1, 1, 1)
    assert bit_diff(a, a.clone())["differ"] == 0


def test_bit_diff_refuses_tensors_of_different_calls():
    with pytest.raises(ValueError, match="one shape and dtype"):
        bit_diff(torch.zeros(2), torch.zeros(3))


def test_compare_case_without_a_result_is_not_compared():
    case = suite("smoke")[0]
    got = compare_case(case=case, base=CaseTensors(case), cand=None)
    assert got["status"] == NOT_COMPARED and "baseline returned no result" in got["why"]


def test_compare_case_names_the_tensor_that_differs_and_where():
    case = suite("smoke")[1]  # f16 d128 b1 h4 160x160
    out = torch.randn(1, 160, 4, 128).half()
    lse = torch.randn(1, 4, 160)
    base = CaseTensors(case, kind="peer", out=out, lse=lse, ref=out.double())
    moved = out.clone()
    moved[0, 5, 2, :] = (out[0, 5, 2, :].view(torch.int16) + 1).view(torch.float16)  # one row of head 2
    got = compare_case(case=case, base=base, cand=CaseTensors(case, kind="peer", out=moved, lse=lse.clone()))
    assert got["status"] == COMPARED and got["forward_identical"] is False and got["backward_identical"] is None
    assert got["tensors"]["lse"]["differ"] == 0
    o = got["tensors"]["out"]
    assert o["differ"] == 128 and o["max_ulp"] == 1 and o["max_row_ulp"] <= 1
    assert "head 2" in o["where"]["summary"] and "row" in o["where"]["summary"]


def _spread(**differing) -> dict:
    """A case record whose backward runs differed from run 1 on ``differing`` elements per gradient."""
    return {"backward": {"spread": {g: {"differing": n, "max_ulp": int(n > 0)} for g, n in differing.items()}}}


def test_compare_case_sets_differing_gradients_against_each_sides_run_to_run():
    case = suite("smoke")[1]  # f16 d128 b1 h4 160x160
    out, lse = torch.randn(1, 160, 4, 128).half(), torch.randn(1, 4, 160)
    g = {n: torch.randn(1, 160, 4, 128).half() for n in ("dq", "dk", "dv")}
    base = CaseTensors(case, kind="peer", out=out, lse=lse, ref=out.double(), grads=g, bwd_kind="peer")
    moved = {n: t.clone() for n, t in g.items()}
    moved["dq"][0, 3, 1, :] = (g["dq"][0, 3, 1, :].view(torch.int16) + 1).view(torch.float16)
    cand = CaseTensors(case, kind="peer", out=out.clone(), lse=lse.clone(), grads=moved, bwd_kind="peer")
    # the candidate's own dq differs from run to run: the difference is not the change's
    got = compare_case(case=case, base=base, cand=cand, base_rec=_spread(dq=0, dk=0), cand_rec=_spread(dq=7, dk=0))
    dq = got["tensors"]["dq"]
    assert dq["run_to_run"] == {"baseline": 0, "candidate": 7} and dq["attributable"] is False
    assert got["backward_identical"] is False and got["backward_changed"] is False
    assert "run_to_run" not in got["tensors"]["dk"]  # identical tensors carry no label
    # both sides reproduce dq bit for bit: the difference is the change
    got = compare_case(case=case, base=base, cand=cand, base_rec=_spread(dq=0), cand_rec=_spread(dq=0))
    assert got["tensors"]["dq"]["attributable"] is True and got["backward_changed"] is True
    # one side's dq is steady, the other's not measured (one backward run): unknown, not attributable
    got = compare_case(case=case, base=base, cand=cand, base_rec=_spread(dq=0), cand_rec={"backward": {"spread": {}}})
    assert got["tensors"]["dq"]["run_to_run"] == {"baseline": 0, "candidate": None}
    assert got["tensors"]["dq"]["attributable"] is False and got["backward_changed"] is None
    # a differing forward tensor called once per kernel is attributable (unmeasured: the assumption)
    cand.out = cand.out.clone()
    cand.out[0, 0, 0, 0] = -cand.out[0, 0, 0, 0] if cand.out[0, 0, 0, 0] != 0 else 1.0
    got = compare_case(case=case, base=base, cand=cand, base_rec=_spread(dq=3), cand_rec=_spread(dq=3))
    assert got["tensors"]["out"]["attributable"] is True
    assert got["tensors"]["out"]["run_to_run"] == {"baseline": None, "candidate": None}
    assert got["backward_changed"] is False  # the forward's change is not the backward's
    no_grads = CaseTensors(case, out=out, lse=lse)
    assert compare_case(case=case, base=no_grads, cand=no_grads)["backward_changed"] is None
    assert compare_case(case=case, base=base, cand=no_grads)["backward_changed"] is True  # gradients went missing


def _compare(tmp_path, *kernels, cases=CASES, extra=()):
    picked = [c.as_dict() for c in suite("smoke") if c.name in cases]
    (tmp_path / "cases.json").write_text(json.dumps(picked))
    argv = ["compare", *(a for k in kernels for a in ("--kernel", k)), "--case-file", str(tmp_path / "cases.json")]
    argv += ["--no-isolate", "--out", str(tmp_path / "c"), "--quiet", *extra]
    code = cli.main(argv)
    return code, json.loads((tmp_path / "c" / "compare.json").read_text())["comparisons"]


def test_identical_candidate_exits_0_and_says_so(tmp_path, capsys):
    code, (c,) = _compare(tmp_path, "fa4-model", f"{KERNELS}:same")
    assert code == 0
    assert c["compared"] == c["forward"]["compared"] == c["forward"]["identical"] == len(CASES)
    assert c["differing"] == [] and c["regressions"] == []
    assert f"forward bit-identical on {len(CASES)} of {len(CASES)} cases" in capsys.readouterr().out


def test_a_correct_variant_differs_in_the_last_bits_and_exits_0(tmp_path, capsys):
    """The exp2 polynomial of degree 5 against production's 3: the numerics change, nothing gets worse."""
    code, (c,) = _compare(tmp_path, "fa4-model", "fa4-model:poly_degree=5")
    assert code == 0 and c["regressions"] == []
    assert c["forward"]["identical"] < len(CASES) and len(c["differing"]) == len(CASES) - c["forward"]["identical"]
    assert 0 < c["max_row_ulp"] <= 2  # the changes are last-bit ones at each row's scale
    assert c["tightness"]["other_bound"] == 0  # a variant is held to its own FA4 bound, as the model
    assert "differs on" in capsys.readouterr().out


def test_one_ulp_past_the_rounding_is_a_tightness_regression_where_the_bound_is_tight(tmp_path):
    """last_bit adds 1 ULP to the model's rounded output (its last row): on the peaked case that
    moves error/bound from 0.48 to 0.85, past [compare] tightness_ratio; the outputs differ by
    1 ULP only, in that row."""
    code, (c,) = _compare(tmp_path, "fa4-model", f"{KERNELS}:last_bit")
    assert code == 1
    assert c["max_ulp"] == 1 and sum(c["ulp_histogram"].values()) == c["ulp_histogram"]["1"]
    (r,) = c["regressions"]
    assert (
        r["kind"] == "tightness" and r["case"] == CASES[3] and r["detail"].startswith("out: error/bound 0.482 -> 0.854")
    )
    where = {e["case"]: e["tensors"]["out"]["where"] for e in c["differing"]}
    assert where[CASES[0]].startswith("all 8 out elements in row 199 (of 0..199) and dim 0"), where


def test_seeded_regression_exits_1_and_names_the_cases(tmp_path, capsys):
    code, (c,) = _compare(tmp_path, "fa4-model", f"{KERNELS}:no_causal")
    assert code == 1
    causal = {n for n in CASES if "causal" in n}
    worse = {r["case"] for r in c["regressions"] if r["kind"] == "verdict"}
    assert worse == causal
    out = capsys.readouterr().out
    assert "REGRESSION" in out and all(n in out for n in causal)
    # each worse verdict leads with the candidate's tested cause, and the worse verdicts' causes are tallied
    details = [r["detail"] for r in c["regressions"] if r["kind"] == "verdict"]
    assert all(d.startswith("pass -> fail: likely cause: mask_edge (causal mask ignored); ") for d in details), details
    n = len(causal)
    top, *others = c["causes"]["groups"]  # others: hypotheses a case also fits, never first
    assert (top["cause"], top["cases"], top["best"], top["detail"]) == ("mask_edge", n, n, "causal mask ignored")
    assert all(g["best"] == 0 for g in others), others
    assert (
        f"  Likely causes of the worse verdicts, over the {n} failing cases: mask_edge first on {n} and named on {n} "
        f"(all {n}: causal mask ignored); "
    ) in out


def test_a_new_nan_is_a_regression(tmp_path):
    code, (c,) = _compare(tmp_path, "fa4-model", f"{KERNELS}:lse_nan", cases=CASES[:1])
    assert code == 1
    kinds = {r["kind"] for r in c["regressions"]}
    assert "nonfinite" in kinds and any("lse: " in r["detail"] for r in c["regressions"] if r["kind"] == "nonfinite")


def test_compare_needs_two_kernels(tmp_path, capsys):
    assert cli.main(["compare", "--kernel", "fa4-model", "--suite", "smoke", "--out", str(tmp_path / "x")]) == 2
    assert "needs a baseline and at least one candidate" in capsys.readouterr().err


def test_nothing_compared_fails(tmp_path, capsys):
    fp8 = ["f8_e4m3fn-d128-b1h2k2-s128x384-student_t-seed0"]  # outside both SM90 models' domain
    code, (c,) = _compare(tmp_path, "fa4-model-sm90", "fa4-model-sm90-tc", cases=fp8)
    assert code == 1 and c["compared"] == 0
    assert "nothing was compared" in capsys.readouterr().err


@pytest.mark.slow  # two --jobs children: about 9 s
def test_jobs_children_compare_and_resume_keeps_the_comparison(tmp_path, capsys):
    """Each --jobs child holds the baseline beside the candidate on its shard; --resume reads the
    comparison back from the journals (not re-run, not 'not compared')."""
    code, (c,) = _compare(tmp_path, "fa4-model", "fa4-model:poly_degree=5", extra=["--jobs", "2"])
    assert code == 0 and c["compared"] == len(CASES) and c["forward"]["identical"] < len(CASES)
    code, (again,) = _compare(tmp_path, "fa4-model", "fa4-model:poly_degree=5", extra=["--resume"])
    assert code == 0 and again["compared"] == len(CASES) and again["not_compared"] == []
    assert again["ulp_histogram"] == c["ulp_histogram"]


def test_a_nondeterministic_backward_differs_only_run_to_run(tmp_path, capsys):
    """jitter_dq moves dQ by 1 ULP on other elements at each backward call: it differs from the
    model in dQ, and so does it from itself; the summary says so rather than 'differs'."""
    code, (c,) = _compare(
        tmp_path, "fa4-model", f"{KERNELS}:jitter_dq", cases=[CASES[1], CASES[3]], extra=["--backward"]
    )
    assert code == 0 and c["forward"]["identical"] == 2
    assert c["backward"]["compared"] == 2 and c["backward"]["identical"] == 0
    assert (c["backward"]["run_to_run_only"], c["backward"]["changed"], c["backward"]["unknown"]) == (2, 0, 0)
    assert c["backward"]["run_to_run_tensors"] == {"dq": 2}
    for e in c["differing"]:
        assert e["backward_changed"] is False and list(e["tensors"]) == ["dq"]
        r = e["tensors"]["dq"]["run_to_run"]
        assert r["baseline"] == 0 and r["candidate"] > 0 and e["tensors"]["dq"]["attributable"] is False
    out = capsys.readouterr().out
    assert (
        "backward bit-identical on 0 of 2; 2 differ only in gradients that also differ between two runs of the same "
        "kernel (run-to-run: dq; the baseline's runs on 0, the candidate's on 2; compare with --deterministic to "
        "tell), 0 differ beyond that"
    ) in out
    md = (tmp_path / "c" / "compare.md").read_text()
    assert "| run-to-run |" in md and f"| 0/{c['differing'][0]['tensors']['dq']['run_to_run']['candidate']:,} |" in md


def test_run_to_run_variation_under_deterministic_is_said_as_such(tmp_path, capsys):
    """With --deterministic the hint to run it is not printed: a side whose deterministic=True runs
    differ is the finding (4.0.0b36's SM90 dQ on 106 of 124 head-dims cases, the H200, 2026-12-04),
    and its own verdict fails on it."""
    code, (c,) = _compare(
        tmp_path, "fa4-model", f"{KERNELS}:jitter_dq", cases=[CASES[1]], extra=["--backward", "--deterministic"]
    )
    assert code == 1  # the candidate's verdict is worse: its deterministic backward is not
    assert c["backward"]["run_to_run_deterministic"] == 1
    assert c["backward"]["run_to_run_sides"] == {"baseline": 0, "candidate": 1}
    out = capsys.readouterr().out
    assert (
        "1 differ only in gradients that also differ between two runs of the same kernel (run-to-run: dq; the "
        "baseline's runs on 0, the candidate's on 1; under deterministic=True, which should make them agree)"
    ) in out
    assert "compare with --deterministic" not in out
    assert "deterministic=True: " in out  # the candidate's own reason


def test_a_deterministic_backward_change_is_attributable(tmp_path, capsys):
    """The degree-5 exp2 moves the gradients; the model reproduces them bit for bit from run to
    run, so the difference is the change."""
    code, (c,) = _compare(tmp_path, "fa4-model", "fa4-model:poly_degree=5", cases=[CASES[2]], extra=["--backward"])
    assert code == 0 and (c["backward"]["changed"], c["backward"]["run_to_run_only"]) == (1, 0)
    (e,) = c["differing"]
    assert e["backward_changed"] is True
    assert all(t["attributable"] and t["run_to_run"] == {"baseline": 0, "candidate": 0} for g, t in e["tensors"].items()
               if g not in ("out", "lse"))  # fmt: skip
    assert "1 differ where both kernels' own runs are bit-identical" in capsys.readouterr().out
    assert "| 0/0 |" in (tmp_path / "c" / "compare.md").read_text()


def test_one_backward_run_leaves_the_run_to_run_variation_unknown(tmp_path, capsys):
    code, (c,) = _compare(
        tmp_path, "fa4-model", "fa4-model:poly_degree=5", cases=[CASES[2]], extra=["--backward", "--repeat", "1"]
    )
    assert code == 0 and (c["backward"]["unknown"], c["backward"]["changed"]) == (1, 0)
    (e,) = c["differing"]
    assert e["backward_changed"] is None and e["tensors"]["dq"]["run_to_run"] == {"baseline": None, "candidate": None}
    assert "1 differ with run-to-run variation unknown" in capsys.readouterr().out
    assert "| ?/? |" in (tmp_path / "c" / "compare.md").read_text()


def test_records_from_before_run_to_run_render_as_unknown(tmp_path):
    """Case records (journals, report.json) written before the run-to-run fields still compare and
    render: their differing gradients are labelled from both records' own spreads (the H200's
    b36/b40 reports of 2026-12-04), and are unknown where a record has none (one backward run)."""
    _compare(tmp_path, "fa4-model", "fa4-model:poly_degree=5", cases=[CASES[2]], extra=["--backward"])
    reports = {}
    for kern, d in (("fa4-model", "fa4-model"), ("fa4-model:poly_degree=5", "fa4-model.poly_degree=5")):
        reports[kern] = json.loads((tmp_path / "c" / d / "report.json").read_text())
        for rec in reports[kern]["cases"]:
            cmp = rec.get("compare") or {}
            cmp.pop("backward_changed", None)
            for t in (cmp.get("tensors") or {}).values():
                t.pop("run_to_run", None), t.pop("attributable", None)
    (c,) = compare_reports(reports, baseline="fa4-model", thresholds=load_thresholds())
    assert c.backward["changed"] == 1 and c.backward["unknown"] == 0  # both sides' two runs agreed
    for rep in reports.values():
        for rec in rep["cases"]:
            rec["backward"].pop("spread", None)
    (c,) = compare_reports(reports, baseline="fa4-model", thresholds=load_thresholds())
    assert c.backward["unknown"] == 1 and c.backward["changed"] == c.backward["run_to_run_only"] == 0
    assert "1 differ with run-to-run variation unknown" in summary_lines(c)[0]
    md, page = render_md([c], header={}), render_html([c], header={})
    assert "| ?/? |" in md and "<td>?/?</td>" in page  # neither side measured its spread
    # a comparison written before the counts (compare.json) has none of them
    for k in ("run_to_run_only", "changed", "unknown", "run_to_run_tensors"):
        del c.backward[k]
    assert summary_lines(c)[0].endswith("backward bit-identical on 0 of 1; 1 differ, run-to-run variation unknown")


def test_a_forward_that_differs_from_itself_is_not_taken_as_the_change(tmp_path, capsys):
    """``--time-calls``: the candidate's compared call differs from the model by one element, and
    its second call differs from its first by as many: run-to-run, not a change. Without
    ``--time-calls`` the same difference is taken as the change (unmeasured: the assumption)."""
    code, (c,) = _compare(tmp_path, "fa4-model", f"{KERNELS}:flaky_first", cases=CASES[:2], extra=["--time-calls"])
    assert c["forward"]["identical"] == 0 and c["forward"]["run_to_run_only"] == 2
    for e in c["differing"]:
        assert e["tensors"]["out"]["run_to_run"] == {"baseline": 0, "candidate": 1}
        assert e["tensors"]["out"]["attributable"] is False
    out = capsys.readouterr().out
    assert (
        "forward bit-identical on 0 of 2 cases (2 of the others differ only where a kernel's second call on the same "
        "inputs moved its own bits too)"
    ) in out
    assert "| 0/1 |" in (tmp_path / "c" / "compare.md").read_text()
    (tmp_path / "once").mkdir()
    code, (c,) = _compare(tmp_path / "once", "fa4-model", f"{KERNELS}:flaky_first", cases=CASES[:1])
    assert c["forward"]["identical"] == 0 and c["forward"]["run_to_run_only"] == 0
    (e,) = c["differing"]
    assert e["tensors"]["out"]["attributable"] is True and e["tensors"]["out"]["run_to_run"] == {
        "baseline": None,
        "candidate": None,
    }


def test_time_calls_times_two_calls_and_tells_a_forward_that_differs_from_itself(tmp_path, capsys):
    """``--time-calls``: each kernel called twice per case, both calls' seconds kept and summed per
    side (the first's excess: compilation and first use), and a second call whose bits differ
    counted (a forward that differs from itself); without it, one call and no time line."""
    code, (c,) = _compare(tmp_path, "fa4-model", f"{KERNELS}:flaky_forward", cases=CASES[:2], extra=["--time-calls"])
    out = capsys.readouterr().out
    base, cand = c["seconds"]["baseline"], c["seconds"]["candidate"]
    assert base["cases"] == base["timed_twice"] == 2 and base["second_differs"] == 0
    assert cand["timed_twice"] == 2 and cand["second_differs"] == 2  # every second call is the flaky one
    assert base["first_of_twice"] > 0 and base["second"] > 0
    assert "time, baseline fa4-model: forward first calls" in out and "called twice on 2" in out
    assert "2 second calls with other bits" in out
    rep = json.loads((tmp_path / "c" / "fa4-model" / "report.json").read_text())
    assert all(len(r["call_seconds"]) == 2 and r["second_call_identical"] is True for r in rep["cases"])
    (tmp_path / "once").mkdir()
    code, (c,) = _compare(tmp_path / "once", "fa4-model", f"{KERNELS}:same", cases=CASES[:1])
    assert c["seconds"]["baseline"]["cases"] == 1 and c["seconds"]["baseline"]["timed_twice"] == 0
    assert "time, baseline" not in capsys.readouterr().out
