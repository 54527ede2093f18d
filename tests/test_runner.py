"""fa4-audit run: verdicts, journal and --resume, -x, shards, reports, bad input."""

import json
from pathlib import Path

import pytest
import torch

from audits import cli
from audits.configs import smoke_suite
from audits.gate import ThresholdsError, load_thresholds
from audits.runner import read_journal, shard_cases

ROOT = Path(__file__).parents[1]


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.bugged_kernels resolves as module:attr


def run(*argv):
    return cli.main(["run", "--quiet", *argv])


def report(out):
    return json.loads((Path(out) / "report.json").read_text())


def test_fa4_model_passes_smoke(tmp_path):
    assert run("--kernel", "fa4-model", "--suite", "smoke", "--out", str(tmp_path)) == 0
    rep = report(tmp_path)
    assert rep["schema"] == "fa4-audit/report/1" and rep["summary"]["cases"] == len(smoke_suite())
    assert rep["summary"]["verdicts"]["fail"] == 0 and rep["summary"]["verdicts"]["error"] == 0
    assert all(c["bound"]["violations"] == 0 for c in rep["cases"] if "bound" in c)
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
        assert bad and all(c["reasons"] for c in bad) and all(c["repro"].startswith("fa4-audit run --kernel") for c in bad)
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


def test_shards_partition_the_suite_and_balance_cost():
    cases = smoke_suite()
    shards = [shard_cases(cases, i, 3) for i in range(3)]
    assert sorted(c.name for s in shards for c in s) == sorted(c.name for c in cases)
    costs = [sum(c.cost for c in s) for s in shards]
    assert max(costs) <= 2 * min(costs)
    assert shard_cases(cases, 1, 3) == shards[1]  # deterministic


def test_thresholds_file_errors(tmp_path):
    bad = tmp_path / "t.toml"
    bad.write_text("[policy]\nnan_swallowed = 'maybe'\n")
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
        (["--kernel", "fa4-model", "--case", "nothing*"], "matches no case"),
        (["--kernel", "fa4-model", "--thresholds", "/nonexistent.toml"], "no such thresholds file"),
    ],
)
def test_usage_errors(argv, message, capsys, tmp_path):
    assert run(*argv, "--out", str(tmp_path)) == 2
    assert message in capsys.readouterr().err
