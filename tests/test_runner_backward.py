"""``fa4-audit run --backward``: the gradients in the case records and every report view, the
verdicts a missing or wrong backward gets, the options' usage errors, resume safety, the
reproducer of a failing gradient, the baseline gate on gradients, and report schema 1 still read."""

import json
import xml.etree.ElementTree as ET

import pytest

from audits import cli
from audits.report.build import ReportError, validate_report
from audits.verdict.gate import judge_against_baseline, load_thresholds
from tests.test_repro import execute

CFG = {"dtype": "bfloat16", "d": 64, "dv": 64, "heads_q": 4, "heads_kv": 2, "seqlen_q": 96, "seqlen_k": 160}
CASES = [
    json.dumps({**CFG, "causal": True}),
    json.dumps({**CFG, "dtype": "float16", "sink": True, "family": "tile_step_4"}),  # dO outliers
]
FAKE = "tests/fake_kernels.py"


def _run(tmp_path, *argv, name="out"):
    out = tmp_path / name
    args = ["run", *argv, "--device", "cpu", "--out", str(out), "--quiet"]
    return cli.main(args), out


def _cfgs(cases=CASES):
    return [a for c in cases for a in ("--config", c)]


@pytest.mark.slow  # 10 s CPU
def test_model_gradients_in_records_and_every_report_view(tmp_path, capsys):
    rc, out = _run(tmp_path, "--kernel", "fa4-model", *_cfgs(), "--backward")
    assert rc == 0, capsys.readouterr()
    rep = validate_report(json.loads((out / "report.json").read_text()), "report")
    assert rep["schema"] == "fa4-audit/report/2"
    for c in rep["cases"]:
        b = c["backward"]
        assert c["verdict"] == "pass" and b["status"] == "ran" and b["repeat"] == 2 and not b["deterministic"]
        want = {"dq", "dk", "dv"} | ({"dsink"} if c["config"]["sink"] else set())
        assert set(b["grads"]) == want and b["missing"] == [] and b["bound_kind"] == "fa4"
        for g in b["grads"].values():
            assert g["bound"]["violations"] == 0 and 0 < g["bound"]["tightness"] < 1
            assert g["fa_criterion"]["max_abs"] == g["max_abs"]
        assert b["zeros"]["dk_unseen_nonzero"] == b["zeros"]["dq_empty_nonzero"] == 0
        assert all(s["differing"] == 0 for s in b["spread"].values())  # the model is deterministic
        assert 0 <= b["certified"]["dq"] < 1e-12
    assert rep["summary"]["backward"]["ran"] == 2 and set(rep["summary"]["backward"]["grads"]) >= {"dq", "dsink"}
    md = (out / "report.md").read_text()
    assert "## Gradients (--backward)" in md and "dq " in md.split("## Gradients")[1]
    assert "Gradients (--backward)" in (out / "report.html").read_text()
    ET.parse(out / "report.junit.xml")
    assert cli.main(["show", str(out / "report.json")]) == 0
    assert "gradients dq" in capsys.readouterr().out


def test_kernel_without_autograd_is_skipped_and_a_run_checking_nothing_fails(tmp_path, capsys):
    rc, out = _run(tmp_path, "--kernel", f"{FAKE}:forward_only", *_cfgs(CASES[:1]), "--backward")
    assert rc == 1
    (c,) = json.loads((out / "report.json").read_text())["cases"]
    assert c["verdict"] == "skipped" and "carries no autograd graph" in c["reasons"][-1]
    assert c["out"]["max_abs"] < 0.01  # the forward was still measured
    assert "nothing was audited" in capsys.readouterr().err


@pytest.mark.slow  # 23 s CPU
def test_wrong_dq_fails_for_that_gradient_and_its_reproducer_runs(tmp_path, capsys):
    rc, out = _run(tmp_path, "--kernel", f"{FAKE}:dq_doubled", *_cfgs(CASES[:1]), "--backward", "--repeat", "3")
    assert rc == 1
    (c,) = json.loads((out / "report.json").read_text())["cases"]
    why = " ".join(c["reasons"])
    assert c["verdict"] == "fail" and "FA criterion: max|dq - ref|" in why and "dk" not in why and "dv" not in why
    assert c["backward"]["repeat"] == 3 and "--backward --repeat 3" in c["repro"]
    assert f"reproduce: {c['repro']}" in capsys.readouterr().out
    p = execute(c["repro"], tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    (again,) = json.loads((tmp_path / "fa4-audit-repro" / "report.json").read_text())["cases"]
    assert again["case"] == c["case"] and "FA criterion: max|dq - ref|" in " ".join(again["reasons"])


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--repeat", "3"], "--repeat and --deterministic apply to gradients: add --backward"),
        (["--deterministic"], "--repeat and --deterministic apply to gradients: add --backward"),
        (["--backward", "--repeat", "0"], "expected a number of backward runs >= 1"),
        (["--backward", "--deterministic", "--repeat", "1"], "--deterministic compares backward runs"),
    ],
)
def test_backward_options_usage_errors(tmp_path, capsys, extra, message):
    rc, _ = _run(tmp_path, "--kernel", "fa4-model", *_cfgs(CASES[:1]), *extra)
    assert rc == 2 and message in capsys.readouterr().err


def test_backward_needs_backward_thresholds(tmp_path, capsys):
    text = (load_thresholds()["path"] and open(load_thresholds()["path"]).read()).split("# ---- The backward")[0]
    th = tmp_path / "forward_only.toml"
    th.write_text(text)
    rc, _ = _run(tmp_path, "--kernel", "fa4-model", *_cfgs(CASES[:1]), "--thresholds", str(th))
    assert rc == 0  # a forward run does not need them
    rc, _ = _run(tmp_path, "--kernel", "fa4-model", *_cfgs(CASES[:1]), "--thresholds", str(th), "--backward", name="b")
    assert rc == 2 and "no [backward] table, which --backward needs" in capsys.readouterr().err


def test_resume_does_not_mix_forward_and_backward_runs(tmp_path, capsys):
    rc, out = _run(tmp_path, "--kernel", "fa4-model", *_cfgs(CASES[:1]))
    assert rc == 0
    rc = cli.main(["run", "--kernel", "fa4-model", *_cfgs(CASES[:1]), "--device", "cpu", "--out", str(out),
                   "--quiet", "--resume", "--backward"])  # fmt: skip
    assert rc == 2 and "--resume refused" in capsys.readouterr().err


def test_baseline_gate_covers_each_gradient():
    th = load_thresholds()
    base = {"status": "ran", "out": {"max_abs": 1e-3}, "backward": {"grads": {"dq": {"max_abs": 1e-3}}}}
    same = {"status": "ran", "out": {"max_abs": 1e-3}, "backward": {"grads": {"dq": {"max_abs": 1.2e-3}}}}
    worse = {"status": "ran", "out": {"max_abs": 1e-3}, "backward": {"grads": {"dq": {"max_abs": 2e-3}}}}
    assert judge_against_baseline(same, base, th) == []
    assert judge_against_baseline(worse, base, th) == ["max |dq - ref| 0.002 > 1.25 x baseline 0.001"]


def test_schema_1_reports_are_still_read(tmp_path):
    rc, out = _run(tmp_path, "--kernel", "fa4-model", *_cfgs(CASES[:1]))
    rep = json.loads((out / "report.json").read_text())
    validate_report({**rep, "schema": "fa4-audit/report/1"}, "old")
    with pytest.raises(ReportError, match="is not one of fa4-audit/report/2, fa4-audit/report/1"):
        validate_report({**rep, "schema": "fa4-audit/report/3"}, "new")


@pytest.mark.parametrize(
    "cfg,verdict,reason",
    [
        # fp16 V near 65504: dS = P (dP - D) beyond fp16's range, which the kernel rounds dS to by design
        ({"dtype": "float16", "seqlen_q": 100, "seqlen_k": 100, "family": "near_max"}, "out-of-domain",
         "overflow where the backward bound is infinite"),
        # NaN/inf at keys no query sees, inside a tile FA4 computes: dS = 0 * inf and 0 * NaN in the
        # dQ MMA leak into every row (production does it too, H200 release).  Their infinite bound
        # is that propagation, not overflow: the semantics rules fail it, nothing is out of domain.
        ({"heads_q": 2, "heads_kv": 1, "seqlen_q": 48, "seqlen_k": 128, "window": [64, 0],
          "family": "nan_inf_masked"}, "fail",
         "6,144 dq elements: the kernel returns NaN where the FP64 gradient is finite"),
    ],
)  # fmt: skip
def test_design_overflow_is_out_of_domain_but_nan_propagation_is_not(tmp_path, cfg, verdict, reason):
    rc, out = _run(tmp_path, "--kernel", "fa4-model", "--config", json.dumps({**CFG, **cfg}), "--backward")
    (c,) = json.loads((out / "report.json").read_text())["cases"]
    assert c["verdict"] == verdict and reason in " ".join(c["reasons"]), c["reasons"]
    assert ("out_of_domain" in c["backward"]) == (verdict == "out-of-domain")


def test_resume_redoes_the_audits_own_failures(tmp_path):
    """A record the audit itself failed (its FP64 work ran out of GPU memory: ``audit_error``,
    or the reason of a journal written before the flag) is evaluated again by --resume; the
    kernel's own verdicts are kept."""
    rc, out = _run(tmp_path, "--kernel", "fa4-model", *_cfgs())
    lines = (out / "journal.jsonl").read_text().splitlines()
    first, second = json.loads(lines[1]), json.loads(lines[2])
    first.update(status="error", verdict="error", audit_error=True)
    why = "the audit's FP64 reference or bound ran out of GPU memory: x"
    second.update(status="error", verdict="error", reasons=[why])
    (out / "journal.jsonl").write_text("\n".join([lines[0], json.dumps(first), json.dumps(second)]) + "\n")
    rc, _ = _run(tmp_path, "--kernel", "fa4-model", *_cfgs(), "--resume")
    assert rc == 0
    cases = json.loads((out / "report.json").read_text())["cases"]
    assert [c["verdict"] for c in cases] == ["pass", "pass"] and not any(c.get("resumed") for c in cases)


@pytest.mark.slow  # 12 s CPU
def test_fp8_gradients_of_a_user_kernel_are_measured(tmp_path):
    """A user kernel differentiable in fp8 (the README's float32 reference kernel: autograd casts
    its gradients to the e4m3 leaves) is measured, not crashed on (torch has no isfinite or
    comparisons for fp8)."""
    cfg = json.dumps({**CFG, "dtype": "float8_e4m3fn", "heads_q": 2, "heads_kv": 2})
    rc, out = _run(tmp_path, "--kernel", "examples/reference_kernel.py:attention", "--config", cfg, "--backward")
    (c,) = json.loads((out / "report.json").read_text())["cases"]
    assert c["backward"]["status"] == "ran" and set(c["backward"]["grads"]) == {"dq", "dk", "dv"}
    assert c["backward"]["zeros"]["dk_unseen_nonzero"] == 0 and c["verdict"] == "pass"


def test_the_fp64_gradients_are_certified_at_their_scale_not_at_their_size():
    """Smoke's s3x3 ``outliers`` case of SDPA's domain: P is one-hot on every row, so dk is ~1e-11 of
    its terms and max |dk| no scale for the FP64 sum's rounding (it failed "FP64 dk not certified"
    at 2.3e-7 of max |dk|, 2026-12-04).  At each element's scale S it is certified; an error of
    1e-9 S seeded into the FP64 dk at the sampled element is not."""
    from audits.engine.backward import _certify, case_references
    from audits.kernels import kernel_domain
    from audits.suites.cases import suite
    from audits.suites.inputs import make_grad_output, make_inputs

    case = next(
        c
        for c in suite("smoke", kernel_domain("sdpa-math"))
        if c.name == "f16-d192-b2h4k4-s3x3-win128_32-outliers-seed0"
    )
    ref, _, cert = case_references(case, "cpu")
    assert float(ref["dk"].abs().max() / ref["dk_scale"].max()) < 1e-10  # the premise: dk cancels
    assert cert["dk"] < 1e-15 and cert["dq"] < 1e-15 and cert["dv"] < 1e-15
    x, (do, _) = make_inputs(case, device="cpu"), make_grad_output(case, device="cpu")
    seeded = dict(ref)
    seeded["dk"] = ref["dk"] + 1e-9 * ref["dk_scale"]  # every element, the sampled one among them
    assert _certify(x, do, seeded, case)["dk"] > 1e-10
