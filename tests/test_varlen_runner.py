"""``fa4-audit run`` on varlen cases (docs/varlen.md): the kernel's varlen entry, or a fixed-length
kernel per sequence (``--per-sequence``) or skipped; per-sequence references and bounds; the
seeded varlen bugs (tests/bugged_varlen.py) caught for their reason; reproducers; bad case JSON."""

import json
import re
from pathlib import Path

import pytest
import torch

from audits import cli
from audits.engine import evaluate as engine
from audits.engine.options import RunOptions
from audits.engine.run import run_suites
from audits.engine.shards import run_order
from audits.suites.cases import smoke_suite, smoke_varlen, varlen_case
from audits.verdict.gate import load_thresholds
from tests.bugged_varlen import VARLEN_BUGS
from tests.test_repro import execute

ROOT = Path(__file__).parents[1]
VARLEN = "*-vl*"  # the glob of varlen case names (Case._varlen_parts)
BOUND = r"exceed the forward-pass bound"
OUTPUT = rf"{BOUND}|FA criterion|: the kernel returns .* where the FP64 reference is finite"
LSE = (
    r"LSE max \|err\||LSE: [\d,]+ values? exceed|LSE values?: the kernel returns .* where the FP64 reference is finite"
)


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.bugged_varlen resolves as module:attr


def run(*argv) -> int:
    return cli.main(["run", "--quiet", *argv])


def report(out) -> dict:
    return json.loads((Path(out) / "report.json").read_text())


def test_smoke_has_the_varlen_cases():
    """smoke carries the serving entry's axes: empty sequences (no query; no key), decode rows
    against ~1000 keys, seqused_k below the allocation, paged caches whose page size divides the
    128-key tile and one that does not, split-KV with pack_gqa, GQA/MQA, a window; all inside a
    16-bit peer's domain (no softcap, sink, fp8)."""
    vl = smoke_varlen()
    assert vl == [c for c in smoke_suite() if c.varlen and not c.mods] and len(vl) <= 8  # with mods: test_varlen_mods
    lens = [p for c in vl for p in c.seqlens]
    assert (0, 50) in lens and any(q and not k for q, k in lens) and (1, 1) in lens
    assert any(all(q <= 4 and k >= 777 for q, k in c.seqlens) for c in vl)  # decode
    assert any(c.seqused_k and not c.page_size for c in vl)
    assert {64, 48} <= {c.page_size for c in vl} and any(c.num_splits == 3 and c.pack_gqa for c in vl)
    assert any(c.local for c in vl) and any(c.heads_kv == 1 < c.heads_q for c in vl)
    assert any(1 < c.heads_kv < c.heads_q for c in vl)
    assert not any(c.softcap or c.sink or c.dtype.startswith("float8") for c in vl)


@pytest.mark.slow  # the smoke suite's varlen cases twice: 34 s CPU
def test_fa4_model_passes_and_equals_the_fixed_length_model_per_sequence(tmp_path, monkeypatch):
    """The model's varlen entry on smoke's varlen cases: every case passes, held to its own
    numerics' bound per sequence (fa4), certified by an exact row, the record naming the entry.
    Beside it, through the same run, the fixed-length model ``--per-sequence`` (one call per
    sequence, with the numerics the varlen entry gives packed queries) returns exactly the varlen
    entry's outputs and LSE on every unsplit case, empty sequences included, and is measured the
    same; a split case it computes unsplit."""
    got, real = [], engine._call

    def call(fn, x):
        status, res = real(fn, x)
        got.append(res)
        return status, res

    monkeypatch.setattr(engine, "_call", call)
    cases, fixed = smoke_varlen(), "tests.bugged_varlen:fixed_model"
    options = RunOptions(out=tmp_path, thresholds=load_thresholds(), isolate=False, per_sequence=True)
    recs = run_suites(["fa4-model", fixed], cases, options)
    for c, r in zip(cases, recs["fa4-model"], strict=True):
        assert r["verdict"] == "pass", (c.name, r["reasons"])
        assert r["bound"]["kind"] == "fa4" and r["bound"]["violations"] == r["bound"]["lse_violations"] == 0
        assert r["bound"]["tightness"] > 0.05  # the bound is not vacuous
        assert r["mpmath_max_abs"] is not None and r["mpmath_max_abs"] < 1e-12
        v = r["varlen"]
        assert v["entry"] == "varlen" and v["per_sequence"] and v["sequences"] == len(c.seqlens)
        assert r["out"]["elements"] == v["total_q"] * c.heads_q * c.dv
        assert ("splits" in v) == (c.num_splits > 1) and all(1 <= n <= c.num_splits for n in v.get("splits", []))
    assert [r["varlen"]["entry"] for r in recs[fixed]] == ["per-sequence"] * len(cases)
    assert len(got) == 2 * len(cases)  # the kernels take turns case by case, in the run order
    order = run_order(cases)
    assert any(c.num_splits > 1 for c in cases) and not all(c.num_splits > 1 for c in cases)
    for i, (a, la), (b, lb) in zip(order, got[::2], got[1::2], strict=True):
        c, ra, rb = cases[i], recs["fa4-model"][i], recs[fixed][i]
        assert a.shape[0] == sum(q for q, _ in c.seqlens)
        same = torch.equal(a.view(torch.int16), b.view(torch.int16)) and torch.equal(la, lb)
        assert same != (c.num_splits > 1), c.name
        if same:
            assert ra["out"] == rb["out"] and ra["lse"] == rb["lse"] and ra["fa_criterion"] == rb["fa_criterion"]


#: bug -> (regex every failing case's reasons must match, what must fail, predicate on its config)
EXPECT = {
    "ignores_seqused_k": (
        rf"{OUTPUT}|{LSE}", "the packed case with seqused_k", lambda c: c["seqused_k"] and not c["page_size"]
    ),
    "mixes_sequences": (
        rf"{OUTPUT}|{LSE}", "the packed GQA case with empty sequences",
        lambda c: not c["page_size"] and (5, 0) in map(tuple, c["seqlens"]),
    ),
    "page_table_ignored": (rf"{OUTPUT}|{LSE}", "a paged case with 48-key pages", lambda c: c["page_size"] == 48),
}  # fmt: skip


@pytest.fixture(scope="module")
def bug_runs(tmp_path_factory):
    """The clean varlen user kernel and every seeded bug on smoke's varlen cases, in one run
    (shared references; each in its worker process: the isolated varlen path)."""
    out = tmp_path_factory.mktemp("bugs")
    kernels = ["tests.bugged_varlen:clean"] + [f"tests.bugged_varlen:bug_{b}" for b in VARLEN_BUGS]
    argv = ["run", "--quiet", "--case", VARLEN, "--out", str(out)] + [a for k in kernels for a in ("--kernel", k)]
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = cli.main(argv)
    finally:
        os.chdir(cwd)
    return rc, {k: report(out / k.replace(":", ".")) for k in kernels}


def test_every_varlen_bug_has_an_expectation():
    assert set(EXPECT) == set(VARLEN_BUGS) and all(VARLEN_BUGS.values())


@pytest.mark.slow  # bug_runs: every varlen kernel over the smoke suite's varlen cases, 38 s CPU
def test_the_clean_varlen_kernel_passes(bug_runs):
    rc, reps = bug_runs
    assert rc == 1  # the bugs fail
    cases = reps["tests.bugged_varlen:clean"]["cases"]
    assert [c["verdict"] for c in cases] == ["pass"] * len(smoke_varlen())
    assert all(c["bound"]["kind"] == "peer" and c["varlen"]["entry"] == "varlen" for c in cases)


@pytest.mark.slow  # bug_runs (above)
@pytest.mark.parametrize("bug", list(EXPECT))
def test_smoke_catches_each_seeded_varlen_bug(bug_runs, bug):
    """Each bug is judged (fail, never error or crash) for its reason, on the case of its axis."""
    _, reps = bug_runs
    cases = reps[f"tests.bugged_varlen:bug_{bug}"]["cases"]
    assert not [c["case"] for c in cases if c["verdict"] in ("error", "crash")]
    failed = [c for c in cases if c["verdict"] == "fail"]
    pattern, axis, on_axis = EXPECT[bug]
    assert failed, f"{bug} ({VARLEN_BUGS[bug]}) passes smoke's varlen cases"
    for c in failed:
        assert all(re.search(pattern, r) for r in c["reasons"]), (bug, c["case"], c["reasons"])
        assert c["bound"]["violations"] > 0  # wrong keys: the outputs themselves are off
    assert any(on_axis(c["config"]) for c in failed), f"{bug}: {axis} does not fail: {[c['case'] for c in failed]}"


@pytest.mark.slow  # bug_runs (above), and the reproducer: 10 s CPU
def test_a_failing_varlen_case_reproduces_from_its_json(bug_runs, tmp_path):
    """The reproducer of a failing varlen case (``--config`` with the case's JSON, seqlens
    included) re-runs exactly that case, from another directory, failing for the same reason."""
    _, reps = bug_runs
    c = next(c for c in reps["tests.bugged_varlen:bug_page_table_ignored"]["cases"] if c["verdict"] == "fail")
    assert '"seqlens":[[' in c["repro"] and '"page_size":' in c["repro"]
    (tmp_path / "elsewhere").mkdir()
    p = execute(c["repro"], tmp_path / "elsewhere")
    assert p.returncode == 1, p.stdout + p.stderr
    rep = json.loads((tmp_path / "elsewhere" / "fa4-audit-repro" / "report.json").read_text())
    assert [(r["case"], r["verdict"], r["reasons"]) for r in rep["cases"]] == [(c["case"], "fail", c["reasons"])]


def test_a_fixed_length_kernel_skips_varlen_cases_without_per_sequence(tmp_path):
    """Without --per-sequence a fixed-length kernel (a user callable, or a peer) is never called
    on a varlen case: skipped, the reason naming the flag; smoke built in a peer's declared domain
    keeps the varlen cases inside it."""
    for kern in ("examples.reference_kernel:attention", "sdpa-math"):
        out = tmp_path / kern.replace(":", ".")
        assert run("--kernel", kern, "--case", VARLEN, "--out", str(out)) == 1  # nothing evaluated
        cases = report(out)["cases"]
        # smoke's varlen cases; for the reference kernel, which declares the mods, its varlen mod cases too
        assert {c["case"] for c in cases} >= {c.name for c in smoke_varlen()}
        for c in cases:
            why = c["reasons"][0]
            assert c["verdict"] == "skipped" and "--per-sequence" in why and "fixed-length" in why
            assert c["varlen"]["entry"] is None and "out" not in c


@pytest.mark.slow  # 19 s CPU
def test_per_sequence_audits_a_fixed_length_kernel(tmp_path):
    """With --per-sequence the README's reference kernel is called once per sequence and judged:
    it passes every varlen case whose sequences all have keys (it cannot run seqlen_k = 0: the
    one case with a keyless sequence is its error, the kernel's own exception); the reproducer
    carries the flag and re-runs the case the same way."""
    out = tmp_path / "r"
    run("--kernel", "examples.reference_kernel:attention", "--case", VARLEN, "--per-sequence", "--out", str(out))
    cases = report(out)["cases"]
    assert all(c["varlen"]["entry"] == "per-sequence" and c["varlen"]["per_sequence"] for c in cases)
    for c in cases:
        if c["config"].get("score_mod") or c["config"].get("mask_mod"):  # docs/varlen.md: a varlen entry's only
            assert c["verdict"] == "skipped" and "--per-sequence does not pass mods" in c["reasons"][0], c["case"]
            continue
        used = c["config"]["seqused_k"] or [k for _, k in c["config"]["seqlens"]]
        if any(q and not u for (q, _), u in zip(c["config"]["seqlens"], used, strict=True)):  # a keyless sequence
            assert c["verdict"] == "error" and "amax()" in c["reasons"][0]
        else:
            assert c["verdict"] == "pass" and c["bound"]["kind"] == "peer", (c["case"], c["reasons"])
    ok = next(c for c in cases if c["verdict"] == "pass")
    assert ok["repro"].endswith(" --per-sequence")
    (tmp_path / "x").mkdir()
    p = execute(ok["repro"], tmp_path / "x")
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads((tmp_path / "x" / "fa4-audit-repro" / "report.json").read_text())
    assert [(r["case"], r["verdict"], r["varlen"]["entry"]) for r in rep["cases"]] == [
        (ok["case"], "pass", "per-sequence")
    ]


def test_resume_redoes_varlen_records_of_the_other_mode(tmp_path):
    """A journal's varlen records made without --per-sequence are redone by a --resume with it
    (and fixed-length records kept)."""
    kern, out = "examples.reference_kernel:attention", tmp_path / "j"
    glob = "*-vl*-drift-*"  # the seqused and split-KV cases: every sequence has keys
    assert run("--kernel", kern, "--case", glob, "--out", str(out)) == 1  # skipped: nothing evaluated
    assert {c["verdict"] for c in report(out)["cases"]} == {"skipped"}
    assert run("--kernel", kern, "--case", glob, "--out", str(out), "--resume", "--per-sequence") == 0
    cases = report(out)["cases"]
    assert {c["verdict"] for c in cases} == {"pass"} and not any(c.get("resumed") for c in cases)


def test_zero_length_sequences_and_the_sink(tmp_path):
    """Sequences with no query, and with queries but no key, beside a learnable sink: the rows
    with no key give out 0 and LSE = the sink; the model passes, the bound holding there."""
    c = varlen_case(seqlens=((3, 0), (0, 7), (40, 90), (2, 0)), heads_q=3, heads_kv=1, d=64, dv=64, sink=True,
                    causal=True, dtype="float16")  # fmt: skip
    assert run("--kernel", "fa4-model", "--config", json.dumps(c.as_dict()), "--out", str(tmp_path)) == 0
    (rec,) = report(tmp_path)["cases"]
    assert rec["verdict"] == "pass" and rec["lse"]["mismatched_nonfinite"] == 0 and rec["bound"]["lse_violations"] == 0
    assert rec["varlen"] == {"sequences": 4, "total_q": 45, "total_k": 97, "per_sequence": False, "entry": "varlen",
                             "worst_sequence": 2}  # fmt: skip


@pytest.mark.parametrize(
    "cfg,say",
    [
        ({"seqlens": [[1, 2, 3]]}, "seqlens [[1, 2, 3]] must be a list of [seqlen_q, seqlen_k] pairs"),
        ({"seqlens": [[4, 10]], "seqused_k": [11]}, "seqused_k [11] must give one count per sequence, each <="),
        ({"page_size": 64}, "seqused_k, page_size, num_splits and pack_gqa need a varlen case (seqlens)"),
        ({"seqlens": [[4, 10]], "num_splits": 0}, "num_splits = 0 must be an integer >= 1"),
        ({"seqlens": [[4, 10]], "batch": 3}, "batch and lengths follow seqlens"),
    ],
)
def test_bad_varlen_case_json_is_a_usage_error(tmp_path, capsys, cfg, say):
    assert run("--kernel", "fa4-model", "--config", json.dumps(cfg), "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "--config #1" in err and say in err


def test_a_domain_judges_each_sequence():
    """A declared domain's length keys apply to each sequence's rows and used keys (a sequence
    without queries or keys is the varlen entry's own), naming the sequence."""
    from audits.suites.domain import Domain

    c = varlen_case(seqlens=((128, 256), (0, 5), (64, 0), (128, 384)), seqused_k=(256, 5, 0, 200))
    m64, m8 = (Domain(seqlen_q_multiple=m, seqlen_k_multiple=m) for m in (64, 8))
    assert m64.refusal(c) == "sequence 3: seqlens 128x200 not multiples of 64"
    assert m8.refusal(c) is None and Domain(max_seqlen=256).refusal(c) is None
    assert Domain(min_seqlen=100).refusal(c) is None and Domain(min_seqlen=129).refusal(c).startswith("sequence 0")


def test_jobs_children_get_per_sequence(tmp_path):
    import json

    from audits.cli import build_parser
    from audits.cli.run_options import run_options_from_args
    from audits.engine.jobs import write_jobs
    from audits.engine.options import RunOptions

    argv = ["run", "--kernel", "fa4-model", "--per-sequence", "--jobs", "2", "--out", str(tmp_path)]
    args = build_parser().parse_args(argv)  # the parser's own defaults
    options = run_options_from_args(args, thresholds=load_thresholds(), label="smoke")
    job = write_jobs(["fa4-model"], smoke_varlen()[:2], options, header={}, coverage={})[1]
    assert RunOptions.from_dict(json.loads(job.read_text())["options"]).per_sequence is True
