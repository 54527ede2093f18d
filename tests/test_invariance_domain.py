"""Every audit inside the kernel's domain (issue 24 item 5): ``invariance`` builds its cases and
each property's derived calls inside a restricted kernel's declared domain (narrowed by
``--domain``) and catches its batch bug (tests/restricted_kernels.py); a required property that
compared nothing fails and says why; ``fuzz`` draws and ``fidelity`` selects inside the domain."""

import argparse
import json

import pytest
from hypothesis import HealthCheck, given, settings

from audits import cli
from audits.checks.invariance import varlen
from audits.suites.domain import Domain
from tests.restricted_kernels import DOMAIN

BUG = "tests.restricted_kernels:batch_offset"
GOOD = "tests.restricted_kernels:attention"
#: smoke built inside the restricted domain holds one `normal` case: fp16, d64, a batch of 2, 128x128
ONE = ("--suite", "smoke", "--case", "*-normal-*")


def run(*argv):
    return cli.main(list(argv))


def _report(path):
    return json.loads((path / "invariance.json").read_text())


def _domain(**kw) -> Domain:
    return Domain.from_dict(kw, where="test")


def test_restricted_batch_bug_is_caught_inside_its_domain(tmp_path, capsys):
    rc = run("invariance", "--kernel", BUG, *ONE, "--require", "batch", "--out", str(tmp_path), "--quiet")
    assert rc == 1
    rep = _report(tmp_path)
    assert rep["summary"]["failing"] == ["batch"] and rep["domain"]["rule"] == "single"
    (case,) = rep["cases"]
    cfg = case["config"]
    assert cfg["dtype"] == "float16" and cfg["seqlen_q"] == cfg["seqlen_k"] == 128 and cfg["batch"] == 2
    res = case["properties"]["batch"]
    assert res["result"] == "differs"
    # batch index 1 reads the wrong rows inside the batch; index 0 is right where it sits first
    assert "sequence 1: alone vs inside the batch" in res["differing"]
    assert "sequence 0: alone vs inside the batch" not in res["differing"]
    alone, inside = res["out"]["max_err_fp64"]
    assert alone < 1e-2 < inside  # not a rounding: the batch variant attends over other keys
    out = capsys.readouterr().out
    assert "batch (required): 0 hold, 1 differ" in out and "FAIL (batch)" in out


def test_the_restricted_kernel_without_the_bug_passes_batch(tmp_path, capsys):
    rc = run("invariance", "--kernel", GOOD, *ONE, "--require", "batch", "--out", str(tmp_path), "--quiet")
    assert rc == 0
    rep = _report(tmp_path)
    assert rep["summary"]["counts"]["batch"]["holds"] == 1 and rep["summary"]["uncompared"] == {}


def test_a_required_property_compared_nowhere_fails_naming_it(tmp_path, capsys):
    """decode on an equal-lengths domain: the last rows alone against every key never lie in
    it, so decode compares nothing; required, it fails the run, and says why."""
    rc = run("invariance", "--kernel", GOOD, *ONE, "--require", "batch,decode", "--out", str(tmp_path), "--quiet")
    assert rc == 1
    rep = _report(tmp_path)
    s = rep["summary"]
    assert s["failing"] == ["decode"] and s["counts"]["batch"]["holds"] == 1
    why = s["uncompared"]["decode"]
    assert why == (
        "0 comparisons: not applicable on 1 of 1 case(s): no row count r < seqlen_q 128 gives a call inside the "
        "kernel's declared domain; a call's query rows must be a multiple of 128, and seqlen_q 128 has none below it"
    )
    out = capsys.readouterr().out
    assert f"FAIL decode: {why}" in out and "FAIL (decode: 0 comparisons)" in out
    assert f"**decode** (required) fails: {why}" in (tmp_path / "invariance.md").read_text()


def test_decode_on_an_equal_lengths_domain_says_the_lengths_are_why(tmp_path, capsys):
    two_blocks = '{"dtype": "float16", "seqlen_q": 256, "seqlen_k": 256, "d": 64, "dv": 64}'
    rc = run("invariance", "--kernel", GOOD, "--config", two_blocks, "--require", "decode", "--out", str(tmp_path),
             "--quiet")  # fmt: skip
    assert rc == 1
    assert _report(tmp_path)["cases"][0]["properties"]["decode"] == {
        "result": "not applicable",
        "reason": "no row count r < seqlen_q 256 gives a call inside the kernel's declared domain; r=128: seqlen_q "
        "!= seqlen_k (the last rows alone against all 256 keys)",
    }


def test_decode_rows_are_placed_at_the_domains_length_multiple(tmp_path, capsys):
    """A --domain file of lengths in multiples of 128 (unequal allowed): decode compares the
    last 128 rows (r = 1 and 4 lie outside), and a 128-row case on a 256-row variant."""
    dom = tmp_path / "d.toml"
    dom.write_text("seqlen_multiple = 128\n")
    one_block = '{"seqlen_q": 128, "seqlen_k": 128, "d": 64, "dv": 64, "causal": true}'
    longer = '{"seqlen_q": 256, "seqlen_k": 384, "d": 64, "dv": 64}'
    rc = run("invariance", "--kernel", "tests/bugged_invariance.py:plain", "--config", one_block, "--config", longer,
             "--domain", str(dom), "--require", "batch,decode", "--out", str(tmp_path), "--quiet")  # fmt: skip
    assert rc == 0
    first, second = (c["properties"]["decode"] for c in _report(tmp_path)["cases"])
    assert first["result"] == "holds" and first["note"].startswith(
        "compared on the case with seqlen_q 256 (its own 128 rows leave no last rows inside the kernel's "
        "declared domain)"
    )
    assert second["result"] == "holds" and second["comparisons"] == 1 and second["out"]["compared"] == 128 * 2 * 64
    assert "r=1: seqlen_q 1 is outside the kernel's declared domain" in second["note"]


def test_varlen_batch_cuts_shorter_sequences_inside_the_domain():
    import torch

    from audits.suites.cases import varlen_case

    def seq(sq, sk):
        return torch.zeros(1, sq, 1, 8), torch.zeros(1, sk, 1, 8), torch.zeros(1, sk, 1, 8)

    case = varlen_case(seqlens=((256, 256),), d=8, dv=8, heads_q=1, heads_kv=1)
    shape = lambda p: (p[0].shape[1], p[1].shape[1])
    assert shape(varlen._short(seq(300, 260), case, None)) == (150, 130)  # unrestricted: half
    eq128 = _domain(seqlen_multiple=128, equal_seqlens=True)
    assert shape(varlen._short(seq(512, 512), case, eq128)) == (256, 256)
    assert shape(varlen._short(seq(384, 384), case, eq128)) == (128, 128)
    assert shape(varlen._short(seq(128, 128), case, eq128)) == (128, 128)  # no cut fits: a whole copy


def test_fuzz_draws_inside_the_domain():
    from audits.checks.fuzz import cases

    d = Domain.from_dict(DOMAIN, where="tests.restricted_kernels.DOMAIN")
    drawn = []

    @settings(max_examples=150, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(cases(max_seqlen=512, domain=d))
    def draw(c):
        drawn.append(c)

    draw()
    assert len(drawn) == 150 and all(d.refusal(c) is None for c in drawn)
    assert {c.seqlen_q for c in drawn} == {128, 256, 384, 512} and {c.d for c in drawn} == {64, 128}
    # a domain of key multiples only, unequal lengths allowed, a left window: the masked family fits
    free = _domain(seqlen_k_multiple=64, dtypes=["bfloat16"])
    got = []

    @settings(max_examples=150, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(cases(max_seqlen=512, domain=free))
    def draw_free(c):
        got.append(c)

    draw_free()
    assert all(free.refusal(c) is None for c in got) and any(c.seqlen_q % 64 for c in got)
    assert any(c.family == "nan_inf_masked" for c in got)


def test_fuzz_runs_a_restricted_kernel_inside_its_domain(tmp_path):
    from audits.checks.fuzz import fuzz
    from audits.engine.options import RunOptions

    res = fuzz(GOOD, options=RunOptions(isolate=False), budget=3, database=tmp_path / "db", max_seqlen=128, seed=1)
    assert res["examples"] == 3 and res["outside_domain"] == 0 and res["failure"] is None
    assert res["domain"]["dtypes"] == ["float16"]


def _fidelity_args(domain_file) -> argparse.Namespace:
    return argparse.Namespace(suite=None, default_suite="fidelity", config=None, case_file=None, case=None,
                              domain=str(domain_file), seed=0)  # fmt: skip


def test_fidelity_selection_lies_inside_the_domain(tmp_path, capsys):
    from audits.cli.options import selection_from_args

    dom = tmp_path / "d.toml"
    dom.write_text('dtypes = ["float16"]\n')
    sel = selection_from_args(_fidelity_args(dom), kernels=["fa4-model-sm90"])
    assert [c.dtype for c in sel.cases] == ["float16", "float16"]
    assert sel.domain_info["cases_outside"] == 31
    assert "fidelity: 31 of 33 cases lie outside the kernels' domain" in capsys.readouterr().err


@pytest.mark.slow  # the FA4 model against a stand-in on a 256x1024 fp16 case: ~10 s CPU
def test_fidelity_says_how_many_cases_lay_outside(tmp_path, capsys):
    dom = tmp_path / "d.toml"
    dom.write_text('dtypes = ["float16"]\n')
    rc = run("fidelity", "--device", "cpu", "--production", "fa4-model-sm90", "--domain", str(dom),
             "--case", "d128_fp16", "--out", str(tmp_path / "f"), "--quiet")  # fmt: skip
    assert rc == 0
    rep = json.loads((tmp_path / "f" / "fidelity.json").read_text())
    assert rep["domain"]["cases_outside"] == 31 and rep["domain"]["domain"]["dtypes"] == ["float16"]
    assert "31 case(s) of 'fidelity' lie outside the kernels' domain" in capsys.readouterr().out


@pytest.mark.slow  # the whole in-domain smoke suite, twice: ~50 s CPU
def test_smoke_inside_the_domain_catches_the_batch_bug(tmp_path, capsys):
    rc = run("invariance", "--kernel", BUG, "--suite", "smoke", "--require", "batch", "--out", str(tmp_path / "b"),
             "--quiet")  # fmt: skip
    assert rc == 1
    rep = _report(tmp_path / "b")
    d = Domain.from_dict(DOMAIN, where="DOMAIN")
    assert rep["cases"] and all(d.refusal(_case(c)) is None for c in rep["cases"])
    n = rep["summary"]["counts"]["batch"]
    assert n["skipped"] == 0 and n["not applicable"] == 0 and n["differs"] >= len(rep["cases"]) - 2
    assert rep["summary"]["failing"] == ["batch"]
    rc = run("invariance", "--kernel", GOOD, "--suite", "smoke", "--require", "batch", "--out", str(tmp_path / "g"),
             "--quiet")  # fmt: skip
    assert rc == 0
    assert _report(tmp_path / "g")["summary"]["counts"]["batch"]["holds"] == len(rep["cases"])


def _case(rec: dict):
    from audits.suites.cases import case_from_json

    return case_from_json(json.dumps(rec["config"]), where=rec["case"])
