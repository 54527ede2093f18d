"""Reasons a reader understands (issue 25, item 6): non-finite mismatches said by what each side
holds, how many and why the reference holds it; figures the thresholds do not gate marked as
informational in the tables; the summary line counting gradients when --backward ran."""

import json
import math
from pathlib import Path

import torch

from audits import cli
from audits.report.build import _markdown, summary_line
from audits.report.html import case_cells, grad_cells, render_html
from audits.verdict.gate import backward_verdict, judge, load_thresholds, ungated_figures
from numerics.call import AttentionCall
from numerics.metrics import lse_errors, nonfinite_mismatches, output_errors
from numerics.reference import attention_reference

ROOT = Path(__file__).parents[1]
TH = load_thresholds()
INF, NAN = math.inf, math.nan


def test_breakdown_counts_each_pair_of_classes_most_frequent_first():
    got = torch.tensor([NAN, NAN, 1.0, INF, -INF, INF, NAN, 2.0, -INF])
    ref = torch.tensor([INF, INF, NAN, 3.0, 1.0, INF, NAN, 2.0, NAN], dtype=torch.float64)
    # equal infinities, NaN against NaN and finite against finite are no mismatch
    assert nonfinite_mismatches(got, ref) == {"NaN|+inf": 2, "+inf|finite": 1, "-inf|NaN": 1, "-inf|finite": 1,
                                              "finite|NaN": 1}  # fmt: skip
    assert list(nonfinite_mismatches(got, ref))[0] == "NaN|+inf"
    assert nonfinite_mismatches(torch.tensor([1.0, INF]), torch.tensor([1.5, INF])) == {}


def test_breakdown_partitions_the_counts_the_verdict_reads():
    """The breakdown sums to the counts the severity logic reads, so the reasons and the verdict
    can never disagree: per reference class, output (finite | non-finite) and LSE (finite | NaN,
    +inf | -inf)."""
    g = torch.Generator().manual_seed(0)
    pick = torch.tensor([0.0, NAN, INF, -INF], dtype=torch.float64)
    a = torch.where(torch.rand(400, generator=g) < 0.5, torch.randn(400, generator=g, dtype=torch.float64),
                    pick[torch.randint(0, 4, (400,), generator=g)])  # fmt: skip
    b = torch.where(torch.rand(400, generator=g) < 0.5, torch.randn(400, generator=g, dtype=torch.float64),
                    pick[torch.randint(0, 4, (400,), generator=g)])  # fmt: skip
    e, le = output_errors(a.float(), b), lse_errors(a.float(), b)
    by_ref = lambda d, refs: sum(c for k, c in d["nonfinite_mismatches"].items() if k.split("|")[1] in refs)
    assert by_ref(e, {"finite"}) == e["nonfinite_where_ref_finite"] > 0
    assert by_ref(e, {"NaN", "+inf", "-inf"}) == e["nan_swallowed"] > 0
    assert by_ref(le, {"finite"}) == le["nonfinite_where_ref_finite"]
    assert by_ref(le, {"NaN", "+inf"}) == le["nan_swallowed"] > 0
    assert by_ref(le, {"-inf"}) == le["mismatched_nonfinite"] > 0


def _record(out, ref, lse=None, ref_lse=None, dtype="bfloat16") -> dict:
    """A forward case record as the engine writes it, from tensors (the bound and FA criterion
    at zero error: only the non-finite values can give a reason)."""
    rec = {"case": "c", "status": "ran", "config": {"dtype": dtype, "d": 8}, "out": output_errors(out, ref),
           "bound": {"kind": "fa4", "violations": 0, "lse_violations": 0, "tightness": 0.5, "lse_tightness": 0.0},
           "fa_criterion": {"max_abs": 0.0, "lowprec_max_abs": 0.0, "rounding": 0.0}, "out_of_domain": None,
           "out_of_domain_kind": None}  # fmt: skip
    if lse is not None:
        rec["lse"] = lse_errors(lse, ref_lse)
    return rec


def _causal_inputs():
    """q, k, v (bf16-exact float64, 1 x 4 x 1 x 8, causal): key 3 is seen by query 3 only."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 1, 8, generator=g, dtype=torch.float64).bfloat16().double() for _ in range(3))
    return q, k, v


def test_lse_reasons_say_what_each_side_holds_and_why_the_reference_is_non_finite():
    """An inf in K that meets a negative q makes a visible score +inf: the FP64 LSE is +inf there,
    and a kernel returning -inf (FA4's convention for a NaN row sum) is a semantics deviation,
    said so; a NaN in K makes the score, and the LSE, NaN."""
    q, k, v = _causal_inputs()
    q[0, 3, 0, 0], k[0, 3, 0, 0] = -1.0, -INF  # score (3, 3) = +inf: query 3 alone sees key 3
    ref, rl = attention_reference(q, k, v, call=AttentionCall(causal=True), return_lse=True)
    assert rl[0, 0, 3] == INF and torch.isfinite(rl[0, 0, :3]).all()
    lse = rl.float().clone()
    lse[0, 0, 3] = -INF
    verdict, reasons = judge(_record(ref.float().nan_to_num(0.0), ref, lse, rl), TH)
    want = ("1 LSE value: the kernel returns -inf where the FP64 reference is +inf (a visible score is +inf: "
            "an inf in q or k) — a semantics deviation")  # fmt: skip
    assert verdict == "warn" and want in reasons, reasons
    # the output of that row (8 columns) is NaN in FP64 (inf / inf): the kernel's 0 there, said as such
    assert "8 outputs: the kernel returns a finite value where the FP64 reference is NaN (NaN or inf inputs " \
           "reach the row) — a semantics deviation" in reasons, reasons  # fmt: skip
    # the severity is the policy's, unchanged: nan_swallowed = "fail" fails the same reasons
    assert judge(_record(ref.float().nan_to_num(0.0), ref, lse, rl), {**TH, "policy": {
        **TH["policy"], "nan_swallowed": "fail"}}) == ("fail", reasons)  # fmt: skip

    k[0, 3, 0, 0] = NAN
    ref, rl = attention_reference(q, k, v, call=AttentionCall(causal=True), return_lse=True)
    lse = rl.float().nan_to_num(nan=-INF)
    _, reasons = judge(_record(ref.float(), ref, lse, rl), TH)
    assert reasons == ["1 LSE value: the kernel returns -inf where the FP64 reference is NaN (a visible score is "
                       "NaN: a NaN or inf in q or k) — a semantics deviation"]  # fmt: skip


def test_output_reasons_name_an_inf_in_v_and_a_nan_where_the_reference_is_finite():
    q, k, v = _causal_inputs()
    v[0, 0, 0, 1] = INF  # key 0 is seen by every query: column 1 of every row +inf
    ref = attention_reference(q, k, v, call=AttentionCall(causal=True))
    assert (ref[0, :, 0, 1] == INF).all()
    out = ref.float().clone()
    out[0, :, 0, 1] = NAN
    out[0, 2, 0, 5] = NAN  # a NaN the inputs do not explain: fails
    verdict, reasons = judge(_record(out, ref), TH)
    assert verdict == "fail"
    assert reasons == [
        "1 output: the kernel returns NaN where the FP64 reference is finite",
        "4 outputs: the kernel returns NaN where the FP64 reference is +inf (an inf in V at a visible key) — a "
        "semantics deviation",
    ]


def test_several_kernel_classes_against_one_reference_class_make_one_reason():
    ref = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    out = torch.tensor([NAN, NAN, INF, -INF, 5.0])
    _, reasons = judge(_record(out, ref), TH)
    assert reasons == ["4 outputs: the kernel returns NaN (2), +inf (1) or -inf (1) where the FP64 reference is finite"]


def test_an_lse_other_than_minus_inf_on_an_empty_row_fails_and_says_why():
    rl = torch.tensor([1.0, -INF, -INF], dtype=torch.float64)
    verdict, reasons = judge(_record(torch.zeros(3), torch.zeros(3, dtype=torch.float64), torch.tensor(
        [1.0, 0.0, -INF]), rl), TH)  # fmt: skip
    assert verdict == "fail"
    assert reasons == ["1 LSE value: the kernel returns a finite value where the FP64 reference is -inf (the row sees "
                       "no key, or only -inf scores)"]  # fmt: skip


def test_a_record_without_the_breakdown_reads_in_plain_words():
    """Reports written before the breakdown keep their counts; the reasons say them in words, with
    the same verdict."""
    rl = torch.tensor([1.0, -INF, NAN, 2.0], dtype=torch.float64)
    rec = _record(torch.tensor([NAN, 1.0]), torch.tensor([1.0, NAN], dtype=torch.float64),
                  torch.tensor([1.0, 0.0, -INF, INF]), rl)  # fmt: skip
    for part in ("out", "lse"):
        del rec[part]["nonfinite_mismatches"]
    verdict, reasons = judge(rec, TH)
    assert verdict == "fail"
    assert reasons == [
        "1 output: the kernel returns NaN or inf where the FP64 reference is finite",
        "1 output: the kernel's value differs where NaN or inf inputs make the FP64 reference NaN or inf — a "
        "semantics deviation",
        "1 LSE value: the kernel returns NaN or inf where the FP64 reference is finite",
        "1 LSE value: the kernel's value differs where NaN or inf inputs make the FP64 reference NaN or inf — a "
        "semantics deviation",
        "1 LSE value: the kernel returns other than -inf where the FP64 reference is -inf (the row sees no key, or "
        "only -inf scores)",
    ]
    assert "nan_swallowed" not in " ".join(reasons) and "NaN/inf" not in " ".join(reasons)
    # a breakdown that does not add up to the counts (hand-edited, malformed) is not trusted
    rec["out"]["nonfinite_mismatches"] = {"NaN|finite": "1", "finite|NaN": 5, "odd": 1}
    assert judge(rec, TH) == (verdict, reasons)


def _backward(grads: dict, *, kind: str = "peer", tightness: float = 3.63) -> dict:
    """A --backward record: ``grads`` {name: (got, ref)} measured by output_errors, each with a
    bound of ``tightness`` and no violation (the err/bound a kernel author saw on passing cases)."""
    return {
        "status": "ran", "bound_kind": kind, "missing": [], "contract": [],
        "grads": {n: {**output_errors(a, b), "bound": {"violations": 0, "tightness": tightness}}
                  for n, (a, b) in grads.items()},
        "zeros": {"dq_empty_nonzero": 0, "dk_unseen_nonzero": 0, "dv_unseen_nonzero": 0, "empty_rows": 0,
                  "unseen_keys": 0},
        "spread": {}, "certified": {},
    }  # fmt: skip


def test_gradient_reasons_come_from_the_same_breakdown():
    ref = torch.tensor([NAN, NAN, NAN, 1.0], dtype=torch.float64)
    rec = _record(torch.zeros(1), torch.zeros(1, dtype=torch.float64), dtype="float32")
    rec["backward"] = _backward({"dv": (torch.tensor([0.5, 0.25, -INF, INF]), ref)})
    verdict, reasons = judge(rec, TH)
    assert verdict == "fail" and reasons == [
        "1 dv element: the kernel returns +inf where the FP64 gradient is finite",
        "3 dv elements: the kernel returns a finite value (2) or -inf (1) where the FP64 gradient is NaN (from NaN or "
        "inf inputs) — a semantics deviation",
    ]


def _peer_record(verdict: str = "pass") -> dict:
    z = torch.zeros(4, dtype=torch.float64)
    rec = _record(z.float(), z, dtype="float32")
    rec["bound"]["kind"] = "peer"
    rec["backward"] = _backward({"dq": (z.float(), z), "dk": (z.float(), z)})
    return {**rec, "case": "peer-case", "verdict": verdict, "reasons": [], "seconds": 0.1}


def test_an_ungated_backward_bound_is_marked_informational_in_the_tables():
    """The shipped thresholds gate a peer's forward bound (peer_bound = true) but not its backward
    bound ([backward] peer_bound = false): err/bound 3.63 on a passing case says why it passes."""
    rec = _peer_record()
    assert judge(rec, TH)[0] == "pass"
    assert ungated_figures(case=rec, thresholds=TH) == {"grad_bound": "not gated for peer kernels"}
    assert grad_cells(rec, thresholds=TH)["grad_tightness"] == "3.63 (informational: not gated for peer kernels)"
    assert case_cells(rec, thresholds=TH)["tightness"] == "0.5"  # gated: no mark
    assert grad_cells(rec)["grad_tightness"] == "3.63"  # no thresholds known: no claim either way
    # an FA4 kernel's backward bound gates: no mark; the forward bound off by policy is marked
    fa4 = {**rec, "bound": {**rec["bound"], "kind": "fa4"}, "backward": {**rec["backward"], "bound_kind": "fa4"}}
    assert grad_cells(fa4, thresholds=TH)["grad_tightness"] == "3.63"
    off = {**TH, "policy": {**TH["policy"], "bound": False}}
    assert case_cells(fa4, thresholds=off)["tightness"] == "0.5 (informational: not gated: [policy] bound = false)"
    # thresholds without their tables (a report read from a journal keeps a digest): nothing marked
    assert ungated_figures(case=rec, thresholds={"digest": "x"}) == {}

    rep = {"kernel": "k", "suite": "s", "shard": None, "command": "cmd", "created": "now", "device": "cpu",
           "thresholds": TH, "cases": [rec], "coverage": {"absent": "test"},
           "summary": {"cases": 1, "verdicts": {"pass": 1, "warn": 0, "fail": 0, "error": 0, "crash": 0,
                                                "timeout": 0, "skipped": 0, "out-of-domain": 0},
                       "worst": {}}}  # fmt: skip
    md = _markdown(rep)
    assert "| peer-case | pass | dq 0 · dk 0 | 3.63 (informational: not gated for peer kernels) | — |" in md, md
    assert "<td>3.63 (informational: not gated for peer kernels)</td>" in render_html(rep, summary_line(rep))


def test_show_marks_the_ungated_figure_too(tmp_path, capsys):
    """``fa4-audit show`` reads the report's thresholds and marks the same figure."""
    import json

    from audits import cli
    from audits.report.build import build_report
    from audits.suites.cases import Case
    from audits.suites.domain import Domain

    rec = _peer_record()
    rec["config"] = Case(d=8, dv=8).as_dict()  # a report holds every Case field (bf16: zero errors pass FA too)
    basis = {"domain": Domain(), "arch": None}
    rep = build_report(kernel="k", suite="s", seed=0, device="cpu", environment={}, thresholds=TH, records=[rec],
                       command="cmd", created="now", shard=None, coverage_basis=basis)  # fmt: skip
    (tmp_path / "report.json").write_text(json.dumps(rep, default=str))
    assert cli.main(["show", str(tmp_path / "report.json")]) == 0
    assert "err/bound 3.63 (informational: not gated for peer kernels)" in capsys.readouterr().out


def _report(cases: list[dict], thresholds: dict = TH) -> dict:
    counts = {v: sum(c["verdict"] == v for c in cases) for v in ("pass", "warn", "fail", "error", "crash",
                                                                 "timeout", "skipped", "out-of-domain")}  # fmt: skip
    return {"summary": {"cases": len(cases), "verdicts": counts}, "cases": cases, "thresholds": thresholds}


def test_summary_line_counts_gradients_by_their_own_verdict():
    """A case failing on its forward alone still counts its gradients as passing, and the other
    way round: the case verdict alone cannot tell (the issue's "console ... counts gradients")."""
    ok = _peer_record()
    bad = _peer_record("fail")
    bad["backward"] = _backward({"dq": (torch.tensor([NAN]), torch.tensor([1.0], dtype=torch.float64))})
    skipped = {**_peer_record("pass"), "backward": {"status": "skipped", "reason": "no autograd graph"}}
    fwd_only = {**_peer_record("skipped"), "status": "skipped"}
    del fwd_only["backward"]
    assert backward_verdict(case=bad, thresholds=TH) == "fail"
    assert backward_verdict(case=fwd_only, thresholds=TH) is None
    rep = _report([ok, bad, skipped, fwd_only])
    assert summary_line(rep) == ("3 of 4 cases evaluated (pass 2, fail 1, skipped 1); gradients: 2 of 4 cases "
                                 "audited (pass 1, fail 1, skipped 1, not run 1)")  # fmt: skip
    assert summary_line(_report([ok, bad], {"digest": "x"})).endswith("; gradients: ran in 2 of 2 cases")
    assert "gradients" not in summary_line(_report([fwd_only]))


def test_run_prints_the_reasons_and_the_gradient_count(tmp_path, capsys, monkeypatch):
    """End to end on the model: a visible +inf score (smoke's nan_inf_visible family, scaled down as
    in tests/test_inf_scores.py) reaches the console, report.md and report.json in words, with the
    gradients counted.  About 6 s CPU."""
    monkeypatch.chdir(ROOT)
    cfg = {"dtype": "bfloat16", "d": 64, "dv": 64, "heads_q": 2, "heads_kv": 2, "seqlen_q": 16, "seqlen_k": 256,
           "window": [112, 4], "family": "nan_inf_visible"}  # fmt: skip
    rc = cli.main(["run", "--kernel", "fa4-model", "--config", json.dumps(cfg), "--backward", "--device", "cpu",
                   "--out", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    (c,) = json.loads((tmp_path / "report.json").read_text())["cases"]
    assert rc == 0 and c["verdict"] == "warn", c["reasons"]
    assert "1 of 1 cases evaluated (warn 1); gradients: 1 of 1 cases audited (warn 1)" in out, out
    assert c["lse"]["nonfinite_mismatches"], c["lse"]
    assert any("the kernel returns -inf where the FP64 reference is" in r for r in c["reasons"]), c["reasons"]
    assert not any("nan_swallowed" in r or "differ where" in r for r in c["reasons"]), c["reasons"]
    assert c["reasons"][0] in (tmp_path / "report.md").read_text()


def test_gradients_of_inputs_outside_the_kernels_domain_are_out_of_domain_not_failing():
    """SDPA claims no semantics for NaN/inf inputs: a case whose forward shows them is out-of-domain,
    and its gradients with it (the CPU smoke --backward of sdpa-math counted 5 such cases' gradients
    as "fail 5" beside no failing case, 2026-12-04)."""
    ood = _peer_record("out-of-domain")
    ood["out_of_domain"], ood["out_of_domain_kind"] = "inputs contain NaN/inf", "nonfinite-inputs"
    ood["out"] = {**ood["out"], "nonfinite_where_ref_finite": 3}
    ood["backward"] = _backward({"dq": (torch.tensor([NAN]), torch.tensor([1.0], dtype=torch.float64))})
    assert judge(ood, TH)[0] == "out-of-domain"
    assert backward_verdict(case=ood, thresholds=TH) == "out-of-domain"
    assert summary_line(_report([ood])) == (
        "0 of 1 cases evaluated (out-of-domain 1); gradients: 0 of 1 cases audited (out-of-domain 1)"
    )
