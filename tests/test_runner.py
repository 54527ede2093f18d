"""fa4-audit run: verdicts, journal and --resume, -x, shards, reports, bad input."""

import dataclasses
import fnmatch
import json
from pathlib import Path

import pytest

from audits import cli
from audits.engine.journal import read_records as read_journal
from audits.engine.shards import shard_cases
from audits.suites.cases import smoke_suite
from audits.verdict.gate import ThresholdsError, load_thresholds

ROOT = Path(__file__).parents[1]


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.bugged_kernels resolves as module:attr


def run(*argv):
    return cli.main(["run", "--quiet", *argv])


def report(out):
    return json.loads((Path(out) / "report.json").read_text())


@pytest.mark.slow  # the whole smoke suite forward and backward: 146 s CPU
def test_fa4_model_passes_smoke_forward_and_backward(tmp_path):
    """The issue's acceptance run, ``run --kernel fa4-model --suite smoke --backward --device
    cpu`` (30 s on a 2-core machine, docs/backward.md): no failure; every output and every
    gradient within its bound; only fp8 (no backward) and the varlen cases (forward only,
    docs/varlen.md: their outputs measured and within the bound) skipped; the one out-of-domain
    case is fp16 V near its max, where dS overflows fp16."""
    assert run("--kernel", "fa4-model", "--suite", "smoke", "--backward", "--out", str(tmp_path)) == 0
    rep = report(tmp_path)
    assert rep["schema"] == "fa4-audit/report/2" and rep["summary"]["cases"] == len(smoke_suite())
    v = rep["summary"]["verdicts"]
    assert v["fail"] == v["error"] == v["crash"] == 0
    assert all(c["bound"]["violations"] == 0 for c in rep["cases"] if "bound" in c)
    fp8 = {c.name for c in smoke_suite() if c.dtype.startswith("float8")}
    varlen = {c.name for c in smoke_suite() if c.varlen}
    assert {c["case"] for c in rep["cases"] if c["verdict"] == "skipped"} == fp8 | varlen
    for c in rep["cases"]:
        if c["case"] in varlen:  # the forward half measured and passed; the backward not audited
            assert c["status"] == "ran" and c["bound"]["violations"] == 0 and c["varlen"]["entry"] == "varlen"
            assert c["reasons"] == ["backward: " + c["backward"]["reason"]] and "forward pass only" in c["reasons"][0]
    assert [c["family"] for c in rep["cases"] if c["verdict"] == "out-of-domain"] == ["near_max"]
    ran = [c["backward"] for c in rep["cases"] if c["backward"]["status"] == "ran"]
    assert len(ran) == len(smoke_suite()) - len(fp8) - len(varlen)
    assert all(g["bound"]["violations"] == 0 for b in ran for g in b["grads"].values() if "bound" in g)
    assert (tmp_path / "report.md").read_text().startswith("# fa4-audit: fa4-model on suite smoke")


@pytest.mark.parametrize(
    "kernel,pattern,expect",
    [
        ("tests.bugged_kernels:exact", "*normal*", 0),
        ("tests.bugged_kernels:no_causal_mask", "*causal-normal*", 1),
        ("tests.bugged_kernels:wrong_lse", "*uniform*", 1),
        ("tests.bugged_kernels:wrong_shape", "*uniform*", 1),
        ("tests.bugged_kernels:raises", "*uniform*", 1),
    ],
)
def test_verdicts(tmp_path, kernel, pattern, expect):
    assert run("--kernel", kernel, "--case", pattern, "--out", str(tmp_path)) == expect
    rep = report(tmp_path)
    if expect:
        bad = [c for c in rep["cases"] if c["verdict"] in ("fail", "error")]
        assert (
            bad and all(c["reasons"] for c in bad) and all(c["repro"].startswith("fa4-audit run --kernel") for c in bad)
        )
        assert all((tmp_path / c["repro_inputs"]).exists() for c in bad)


def test_journal_resume_and_exitfirst(tmp_path):
    assert run("--kernel", "tests.bugged_kernels:raises", "--case", "bf16*", "-x", "--out", str(tmp_path)) == 1
    assert report(tmp_path)["summary"]["cases"] == 1  # stopped at the first error
    out = tmp_path / "r"
    assert run("--kernel", "fa4-model", "--case", "*tile_step*", "--out", str(out)) == 0
    first = read_journal(out / "journal.jsonl")
    assert len(first) == 8
    with open(out / "journal.jsonl", "a") as fh:
        fh.write('{"case": "torn')  # a kill mid-write leaves a torn line
    assert run("--kernel", "fa4-model", "--case", "*tile_step*", "--out", str(out), "--resume") == 0
    rep = report(out)
    assert all(c.get("resumed") for c in rep["cases"])


@pytest.mark.slow  # 10 s CPU
def test_several_kernels_share_inputs_and_references(tmp_path, monkeypatch):
    """Repeated --kernel: one report per kernel under OUT/<kernel>/, the FP64 reference computed
    once per case for all of them, and the exit code of the worst kernel."""
    from audits.engine import evaluate as runner

    calls = []
    real = runner.attention_reference
    monkeypatch.setattr(runner, "attention_reference", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    runner._reference.cache_clear()
    rc = run(
        "--kernel",
        "tests.bugged_kernels:exact",
        "--kernel",
        "tests.bugged_kernels:wrong_lse",
        "--case",
        "*uniform*",
        "--out",
        str(tmp_path),
    )
    assert rc == 1
    good, bad = report(tmp_path / "tests.bugged_kernels.exact"), report(tmp_path / "tests.bugged_kernels.wrong_lse")
    assert good["kernel"] == "tests.bugged_kernels:exact" and good["summary"]["verdicts"]["pass"] == 1
    assert bad["summary"]["verdicts"]["fail"] == 1
    assert len(calls) == 1  # one case, two kernels, one reference
    assert "tests/bugged_kernels.py:wrong_lse --config" in bad["cases"][0]["repro"]


def test_shards_partition_the_suite_and_balance_cost():
    cases = smoke_suite()
    shards = [shard_cases(cases, i, 3) for i in range(3)]
    assert sorted(c.name for s in shards for c in s) == sorted(c.name for c in cases)
    costs = [sum(c.cost for c in s) for s in shards]
    assert max(costs) <= 2 * min(costs)
    assert shard_cases(cases, 1, 3) == shards[1]  # deterministic


def test_key_shards_keep_compile_keys_whole():
    from audits.suites.cases import release_suite

    cases = release_suite()
    shards = [shard_cases(cases, i, 8, by="key") for i in range(8)]
    assert sorted(c.name for s in shards for c in s) == sorted(c.name for c in cases)
    keys = [{c.compile_key for c in s} for s in shards]
    assert sum(len(k) for k in keys) == len({c.compile_key for c in cases})  # no key compiled twice
    assert max(len(s) for s in shards) <= 1.5 * min(len(s) for s in shards)


@pytest.mark.slow  # two job processes: 17 s CPU
def test_jobs_run_key_shards_in_parallel_and_report_as_one(tmp_path):
    out = tmp_path / "j"
    assert run("--kernel", "fa4-model", "--case", "bf16-d64-b1h2k2-s64x*", "--jobs", "2", "--out", str(out)) == 0
    rep = report(out)
    names = {c["case"] for c in rep["cases"]}
    assert len(names) == rep["summary"]["cases"] >= 3
    per_job = [set(read_journal(out / "jobs" / str(i) / "journal.jsonl")) for i in range(2)]
    assert per_job[0] and per_job[1] and not per_job[0] & per_job[1] and per_job[0] | per_job[1] == names


def test_thresholds_file_errors(tmp_path):
    bad = tmp_path / "t.toml"
    bad.write_text("[policy]\nnan_swallowed = 'maybe'\nlse_missing = 'warn'\n")
    with pytest.raises(ThresholdsError, match=r"t.toml: \[policy\] lacks the key .bound."):
        load_thresholds(bad)
    bad.write_text("[policy\n")
    with pytest.raises(ThresholdsError, match=r"t.toml: not valid TOML.*line 1"):
        load_thresholds(bad)
    good = load_thresholds()
    assert good["policy"]["fa_criterion_dtypes"] == ["bfloat16", "float16"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kernel", "flash9"], "unknown kernel 'flash9'; accepted: fa4, fa4-model"),
        (["--kernel", "fa4-model", "--suite", "weekly"], "unknown suite 'weekly'; accepted: smoke"),
        (["--kernel", "fa4-model", "--shard", "3/2"], "expected I/N with 0 <= I < N"),
        (["--kernel", "fa4-model", "--shard", "0/2", "--jobs", "2"], "--jobs and --shard cannot be combined"),
        (["--kernel", "fa4-model", "--jobs", "0"], "--jobs 0: expected a positive"),
        (["--kernel", "fa4-model", "--case", "nothing*"], "matches no case"),
        (["--kernel", "fa4-model", "--thresholds", "/nonexistent.toml"], "no such thresholds file"),
    ],
)
def test_usage_errors(argv, message, capsys, tmp_path):
    assert run(*argv, "--out", str(tmp_path)) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # 13 s CPU
def test_gate_show_diff_merge(tmp_path, capsys):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert run("--kernel", "fa4-model", "--case", "*uniform*", "--out", str(a)) == 0
    # re-judged under the default thresholds: same verdict
    assert cli.main(["gate", str(a / "report.json")]) == 0
    # a stricter policy file fails it
    strict = tmp_path / "strict.toml"
    strict.write_text(Path(load_thresholds()["path"]).read_text().replace("max_abs = 1e-3", "max_abs = 1e-9"))
    assert (
        cli.main(["gate", str(a / "report.json"), "--thresholds", str(strict), "--out", str(tmp_path / "strict")]) == 1
    )
    assert "LSE max |err|" in capsys.readouterr().out
    assert report(tmp_path / "strict")["summary"]["verdicts"]["fail"] == 1  # the re-judged report, written
    # a candidate worse than its baseline fails the baseline gate
    assert run("--kernel", "tests.bugged_kernels:wrong_lse", "--case", "*uniform*", "--out", str(b)) == 1
    rep = json.loads((a / "report.json").read_text())
    rep["cases"][0]["out"]["max_abs"] *= 3
    (c / "report.json").parent.mkdir()
    (c / "report.json").write_text(json.dumps(rep))
    assert cli.main(["gate", str(c / "report.json"), "--baseline", str(a / "report.json")]) == 1
    assert "x baseline" in capsys.readouterr().out
    assert cli.main(["diff", str(a / "report.json"), str(b / "report.json")]) == 1  # a case got worse
    assert "pass -> fail (worse)" in capsys.readouterr().out
    assert cli.main(["show", str(a / "report.json")]) == 0
    # shards merge back into the whole
    s0, s1, m = tmp_path / "s0", tmp_path / "s1", tmp_path / "m"
    assert run("--kernel", "fa4-model", "--case", "*tile_step_[14]*", "--shard", "0/2", "--out", str(s0)) == 0
    assert run("--kernel", "fa4-model", "--case", "*tile_step_[14]*", "--shard", "1/2", "--out", str(s1)) == 0
    assert cli.main(["merge", str(s0 / "report.json"), str(s1 / "report.json"), "--out", str(m)]) == 0
    n0, n1 = (json.loads((d / "report.json").read_text())["summary"]["cases"] for d in (s0, s1))
    assert n0 and n1 and json.loads((m / "report.json").read_text())["summary"]["cases"] == n0 + n1 == 5
    assert cli.main(["gate", str(tmp_path / "nope.json")]) == 2


@pytest.mark.slow  # the whole smoke suite: 41 s CPU
def test_correct_blockwise_kernel_passes_smoke(tmp_path):
    """The seeded bugs' base kernel, without a bug (the catalogue: tests/test_catalogue.py)."""
    assert run("--kernel", "tests.bugged_kernels:online", "--suite", "smoke", "--out", str(tmp_path)) == 0


@pytest.mark.slow  # worker spawns: 34 s CPU
def test_a_crashing_kernel_is_isolated(tmp_path):
    assert run("--kernel", "tests.bugged_kernels:crashes_on_fp16", "--case", "*d64*", "--out", str(tmp_path)) == 1
    rep = report(tmp_path)
    v = {c["case"]: c["verdict"] for c in rep["cases"]}
    crashed = [n for n, x in v.items() if x == "crash"]
    assert crashed and all(n.startswith("f16") for n in crashed)
    assert any(x == "pass" for x in v.values())  # the audit went on after the crash
    assert "exit code 134" in next(c for c in rep["cases"] if c["verdict"] == "crash")["reasons"][0]


def test_junit_xml(tmp_path):
    import xml.etree.ElementTree as ET

    assert (
        run(
            "--kernel",
            "tests.bugged_kernels:bug_lse_log2",
            "--case",
            "*uniform*",
            "--no-isolate",
            "--out",
            str(tmp_path),
        )
        == 1
    )
    root = ET.parse(tmp_path / "report.junit.xml").getroot()
    assert root.tag == "testsuite" and root.get("failures") == "1"
    (tc,) = root.findall("testcase")
    assert "LSE" in tc.find("failure").get("message")


def test_fuzz_finds_and_shrinks_a_bug_and_passes_an_exact_kernel(tmp_path, capsys):
    db = tmp_path / "db"
    rc = cli.main(
        [
            "fuzz",
            "--kernel",
            "tests.bugged_kernels:bug_lse_log2",
            "--budget",
            "10",
            "--max-seqlen",
            "64",
            "--database",
            str(db),
            "--seed",
            "1",
            "--out",
            str(tmp_path / "a"),
        ]
    )
    assert rc == 1
    res = json.loads((tmp_path / "a" / "fuzz.json").read_text())
    f = res["failure"]
    assert "LSE" in " ".join(f["reasons"]) and f["case"]["seqlen_q"] <= 64
    assert f["case"]["family"] == "normal" and f["case"]["window"] == [
        None,
        None,
    ]  # shrunk to the simplest family and mask
    rc = cli.main(
        [
            "fuzz",
            "--kernel",
            "tests.bugged_kernels:exact",
            "--budget",
            "8",
            "--max-seqlen",
            "48",
            "--database",
            str(db / "x"),
            "--seed",
            "1",
            "--out",
            str(tmp_path / "b"),
        ]
    )
    assert rc == 0
    assert json.loads((tmp_path / "b" / "fuzz.json").read_text())["failure"] is None


def test_out_of_domain_inputs_are_reported_not_failed(tmp_path, monkeypatch):
    import audits.suites.cases as cfg
    from audits.suites.cases import Case

    big = Case("bfloat16", 64, 64, 1, 1, 1, 16, 300, family="near_max")  # V ~ 3.4e38: P.V overflows float32
    monkeypatch.setitem(cfg.SUITES, "tiny", lambda: [big])
    assert run("--kernel", "fa4-model", "--suite", "tiny", "--out", str(tmp_path)) == 1  # nothing passed...
    rep = report(tmp_path)
    (c,) = rep["cases"]
    assert c["verdict"] == "out-of-domain" and "P.V sums can reach" in c["reasons"][0]
    assert rep["summary"]["verdicts"]["out-of-domain"] == 1


def test_html_report_is_self_contained(tmp_path):
    import re

    assert run("--kernel", "fa4-model", "--case", "*uniform*", "--out", str(tmp_path)) == 0
    page = (tmp_path / "report.html").read_text()
    assert (
        page.startswith("<!doctype html>")
        and "<svg" in page
        and "Worst cases" in page
        and "float16, head dim 128" in page
    )
    assert "<script" not in page and not re.search(r"(src|href)=['\"]https?:", page)  # opens offline


@pytest.mark.slow  # the whole smoke suite twice: 91 s CPU
def test_sdpa_math_and_an_exact_kernel_pass_smoke(tmp_path):
    assert run("--kernel", "sdpa-math", "--out", str(tmp_path / "s")) == 0
    rep = report(tmp_path / "s")
    v = rep["summary"]["verdicts"]
    # smoke built within sdpa-math's declared domain (no softcap, sink or fp8 case); out of
    # domain: the NaN/inf families only, where SDPA claims nothing
    assert rep["domain"]["rule"] == "single" and not any(c["config"]["softcap"] or c["config"]["sink"]
                                                          for c in rep["cases"])  # fmt: skip
    assert v["out-of-domain"] >= 2 and {c["family"] for c in rep["cases"] if c["verdict"] == "out-of-domain"} == {
        "nan_inf_visible", "nan_inf_masked"}  # fmt: skip
    # SDPA returns no LSE: every evaluated case says so (a warning under the shipped policy)
    assert v["pass"] == 0 and v["warn"] >= 16
    assert rep["summary"]["lse_not_audited"] == rep["summary"]["cases"] - v["skipped"]
    assert all("LSE not returned: not audited" in c["reasons"] for c in rep["cases"] if c["verdict"] == "warn")
    assert run("--kernel", "tests.bugged_kernels:exact", "--no-isolate", "--out", str(tmp_path / "e")) == 0


@pytest.mark.slow  # 11 s CPU
def test_summary_groups_reports_side_by_side(tmp_path, capsys):
    out = tmp_path / "two"
    run(
        "--kernel",
        "tests.bugged_kernels:exact",
        "--kernel",
        "tests.bugged_kernels:wrong_lse",
        "--case",
        "*uniform*",
        "--out",
        str(out),
    )
    import gzip
    import lzma

    a = out / "tests.bugged_kernels.exact" / "report.json.xz"
    a.write_bytes(lzma.compress((out / "tests.bugged_kernels.exact" / "report.json").read_bytes()))
    b = out / "tests.bugged_kernels.wrong_lse" / "report.json.gz"  # committed reports are compressed
    b.write_bytes(gzip.compress((out / "tests.bugged_kernels.wrong_lse" / "report.json").read_bytes()))
    assert cli.main(["summary", str(a), str(b), "--by", "dtype,mask,heads", "--out", str(tmp_path)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| fp16 no mask MQA")]
    assert len(lines) == 2 and "pass 1" in lines[0] and "fail 1" in lines[1]
    assert (tmp_path / "summary.svg").read_text().lstrip().startswith("<?xml")
    assert cli.main(["summary", str(a), "--by", "colour"]) == 2


def test_lse_allowance_grows_with_the_lse_magnitude(tmp_path):
    """float32 LSE rounding scales with |lse| ([lse] rel): 2e-3 is fine at |lse| ~ 4e3 (the
    outliers family), not at |lse| ~ 10."""
    from audits.verdict.gate import judge

    run("--kernel", "tests.bugged_kernels:exact", "--case", "*uniform*", "--out", str(tmp_path))
    rec = report(tmp_path)["cases"][0]
    th = load_thresholds()
    rec["lse"].update(max_abs=2e-3, ref_max_abs=4000.0)
    assert judge(rec, th)[0] == "pass"
    rec["lse"].update(ref_max_abs=10.0)
    verdict, reasons = judge(rec, th)
    assert verdict == "fail" and any("LSE max |err| 0.002 > allowed" in r for r in reasons)


@pytest.mark.slow  # 11 s CPU
def test_markdown_of_a_large_suite_lists_what_needs_attention(tmp_path, monkeypatch):
    from audits.report import build as report_mod

    monkeypatch.setattr(report_mod, "MD_ALL_CASES", 2)
    run("--kernel", "tests.bugged_kernels:wrong_lse", "--case", "*tile_step*", "--out", str(tmp_path))
    md = (tmp_path / "report.md").read_text()
    assert "8 cases: below, every case not passing and the 20 closest to their bound" in md
    assert md.count("| fail |") == 8


@pytest.mark.slow  # job processes: 24 s CPU
def test_jobs_resume_after_a_job_died(tmp_path):
    """A device call cut short: the jobs' journals keep what finished and --resume completes the
    rest without redoing it (the release audit on the H200 spans calls this way)."""
    out = tmp_path / "j"
    glob = "bf16-d64*-b1h2k2-s64x*"
    argv = ("--kernel", "fa4-model", "--case", glob, "--jobs", "2", "--out", str(out))
    selected = [c for c in smoke_suite() if fnmatch.fnmatchcase(c.name, glob)]
    assert len(selected) >= 4  # both jobs get cases
    assert run(*argv) == 0
    j = next(p for p in (out / "jobs").glob("*/journal.jsonl") if len(p.read_text().splitlines()) > 2)
    kept = j.read_text().splitlines()[:2]  # the header and one finished case
    j.write_text("\n".join(kept) + '\n{"case": "torn')  # the job was killed mid-write
    assert run(*argv, "--resume") == 0
    rep = report(out)
    assert rep["summary"]["cases"] == len(selected)
    first = json.loads(kept[1])
    again = next(c for c in rep["cases"] if c["case"] == first["case"])
    assert again["seconds"] == first["seconds"]  # not redone


def test_a_family_whose_precondition_fails_is_a_skipped_case_not_the_end_of_the_run(tmp_path, capsys):
    """``nan_inf_masked`` needs keys no query sees (a left window): on a case without one it is
    reported ``skipped`` with the reason, and the other cases run (it used to raise out of the run)."""
    bad = json.dumps({"d": 64, "dv": 64, "seqlen_q": 64, "seqlen_k": 96, "family": "nan_inf_masked"})
    good = json.dumps({"d": 64, "dv": 64, "seqlen_q": 64, "seqlen_k": 96})
    assert run("--kernel", "fa4-model", "--config", bad, "--config", good, "--out", str(tmp_path)) == 0
    cases = report(tmp_path)["cases"]
    assert [c["verdict"] for c in cases] == ["skipped", "pass"]
    assert cases[0]["reasons"] == [
        "input family not applicable here: family nan_inf_masked needs a case with a left window, got (None, None)"
    ]


# ---- the audit API and the --jobs children's options ---------------------------------------------

TILE_STEPS = [c for c in smoke_suite() if "tile_step" in c.name][:2]
#: the two cheapest compile keys of smoke: one per job of --jobs 2
TWO_KEYS = [c for c in smoke_suite() if c.name.startswith(("bf16-d64v72-b1h2k2-s64x96-", "f16-d64-b1h3k1-s96x64-"))]


def test_audit_api_used_directly_without_the_command_line(tmp_path):
    """``audits.api.audit``: a typed Report (records and report per kernel, the stop reason),
    nothing written but the journal; -x's stop reason as the enum; --resume through the options."""
    from audits.api import Report, RunOptions, StopReason, audit
    from audits.report.schema import validate_report

    options = RunOptions(out=tmp_path / "a", label="two-steps", isolate=False)
    got = audit("fa4-model", TILE_STEPS, options)
    assert isinstance(got, Report) and got.stopped is None and got.exit_code == 0 and got.selected == 2
    rep = got.reports["fa4-model"]
    assert rep["suite"] == "two-steps" and rep["command"] == "audits.api.audit" and rep["partial"] is False
    assert [r["case"] for r in got.records["fa4-model"]] == [c.name for c in TILE_STEPS]
    validate_report(json.loads(json.dumps(rep)), "api")
    assert (tmp_path / "a" / "journal.jsonl").exists() and not (tmp_path / "a" / "report.json").exists()
    again = audit(["fa4-model"], TILE_STEPS, options.replace(resume=True))
    assert all(r.get("resumed") for r in again.records["fa4-model"])

    bad = audit("tests.bugged_kernels:wrong_lse", TILE_STEPS, options.replace(out=str(tmp_path / "x"), exitfirst=True))
    assert bad.stopped == StopReason.EXITFIRST and bad.exit_code == 1
    assert bad.reports["tests.bugged_kernels:wrong_lse"]["summary"]["stopped"] == "exitfirst"


def test_run_options_survive_the_job_file_field_for_field(tmp_path):
    """What a --jobs child reads (OUT/jobs/I/job.json) is the parent's RunOptions, every field
    given a value other than its default, bar what the job changes: its folder, shard, one process."""
    from audits.engine.backward import BackwardOptions
    from audits.engine.jobs import write_jobs
    from audits.engine.options import RunOptions
    from audits.verdict.known import load_known

    given = dict(device="cpu", out=str(tmp_path), thresholds=load_thresholds(), seed=7, label="lbl", resume=True)
    given |= dict(exitfirst=True, isolate=True, timeout=12.5, timeout_given=True, per_sequence=True, budget=2.5)
    given |= dict(backward=BackwardOptions(repeat=3, deterministic=True), jobs=2, gpus="0,1", quiet=False, maps=1)
    given |= dict(known=load_known("fa4"), strict_known=True, baseline="fa4-model", poison=False)
    given |= dict(time_calls=True)
    options = RunOptions(**given)
    assert set(given) | {"shard"} == {f.name for f in dataclasses.fields(RunOptions)}  # every field but shard
    files = write_jobs(["fa4-model"], TILE_STEPS, options, header={}, coverage={})
    got = RunOptions.from_json(json.dumps(json.loads(files[1].read_text())["options"]))
    assert got == options.replace(out=str(tmp_path / "jobs" / "1"), jobs=1, gpus=None, quiet=True, shard="1/2")
    with pytest.raises(ValueError, match="unknown field"):
        RunOptions.from_dict({**got.as_dict(), "colour": "blue"})


def test_a_jobs_child_runs_under_the_options_of_its_file(tmp_path):
    """``python -m audits.engine.child JOB.json`` (run here in-process): its shard of the parent's
    cases, its report labelled, seeded and headed as the file says."""
    from audits.engine import child
    from audits.engine.jobs import write_jobs
    from audits.engine.options import RunOptions

    options = RunOptions(out=tmp_path, label="from-the-file", seed=5, isolate=False, jobs=2, maps=0)
    head = {"command": "fa4-audit run (parent)", "created": "then", "environment": {}}
    files = write_jobs(["fa4-model"], TWO_KEYS, options, header=head, coverage={})
    reps = []
    for f in files:
        assert child.run_job(f) == 0
        reps.append(json.loads((f.parent / "report.json").read_text()))
    assert [r["shard"] for r in reps] == ["0/2", "1/2"]
    heads = {(r["suite"], r["seed"], r["command"], r["created"]) for r in reps}
    assert heads == {("from-the-file", 5, "fa4-audit run (parent)", "then")}
    assert sorted(c["case"] for r in reps for c in r["cases"]) == sorted(c.name for c in TWO_KEYS)
    assert all(len(r["cases"]) == 1 for r in reps) and len(TWO_KEYS) == 2
