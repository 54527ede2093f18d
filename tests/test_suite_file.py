"""Suite files (``run --suite FILE.toml``, audits/suites/suite_file.py): explicit cases, axes through
release's own generator (every pair of given values covered, families and seeds crossed),
errors, ``--jobs``, ``--resume``, ``--shard``, declared domains, reproducers, and the example
that docs/runner.md shows."""

import dataclasses
import itertools
import json
import re
from pathlib import Path

import pytest

from audits import cli
from audits.suites.cases import RELEASE_AXES, Case, release_suite
from audits.suites.suite_file import build, load
from tests.test_repro import assert_reproduces

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "suite.toml"

#: explicit cases and axes, small enough for sdpa-math on CPU (inside its declared domain)
SMALL = """name = "small"

[[case]]
dtype = "float16"
seqlen_q = 64
seqlen_k = 96
family = "uniform"

[axes]
dtype = ["bfloat16", "float16"]
head_dims = [[64, 64], [64, 72]]
seqlens = [[64, 128], [100, 60]]
mask = ["none", "causal"]
families = ["normal", "flat"]
"""

#: a case's value on each axis of a suite file
AXIS_OF = {
    "dtype": lambda c: c.dtype,
    "head_dims": lambda c: (c.d, c.dv),
    "mask": lambda c: "causal" if c.causal else c.window if c.local else "none",
    "softcap": lambda c: c.softcap,
    "sink": lambda c: c.sink,
    "heads": lambda c: (c.heads_q, c.heads_kv),
    "seqlens": lambda c: (c.seqlen_q, c.seqlen_k),
    "layout": lambda c: c.layout,
}


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.bugged_kernels resolves as module:attr


def run(*argv):
    return cli.main(["run", "--quiet", *argv])


def report(out) -> dict:
    return json.loads((Path(out) / "report.json").read_text())


def names(out) -> list[str]:
    return [c["case"] for c in report(out)["cases"]]


def write(tmp_path, text: str, name: str = "s.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_explicit_cases_run_as_given_under_the_files_name(tmp_path):
    f = write(tmp_path, 'name = "two"\n[[case]]\nseqlen_q = 64\nseqlen_k = 64\n\n[[case]]\ndtype = "float16"\n'
              "d = 64\ndv = 64\nheads_q = 4\nheads_kv = 1\nseqlen_q = 100\nseqlen_k = 160\ncausal = true\n"
              'family = "uniform"\nseed = 3\n')  # fmt: skip
    want = [
        Case(seqlen_q=64, seqlen_k=64),  # absent keys: the defaults
        Case("float16", 64, 64, 1, 4, 1, 100, 160, causal=True, family="uniform", seed=3),
    ]
    assert list(load(f).cases) == want and load(f).axes is None
    assert run("--kernel", "sdpa-math", "--suite", str(f), "--out", str(tmp_path / "o")) == 0
    rep = report(tmp_path / "o")
    assert [c["case"] for c in rep["cases"]] == [c.name for c in want] and rep["suite"] == "two"


def test_axes_cover_every_pair_of_given_values_for_each_family_and_seed(tmp_path):
    f = write(tmp_path, """[axes]
dtype = ["bfloat16", "float16", "float8_e4m3fn"]
head_dims = [[64, 64], [128, 128], [64, 72]]
seqlens = [[64, 128], [113, 203], [256, 256]]
mask = ["none", "causal", [32, 0], "local"]
softcap = [0, 15.0]
sink = [false, true]
heads = [[2, 2], [4, 1]]
layout = ["contiguous", "strided"]
families = ["normal", "drift"]
seeds = [0, 2]
""")  # fmt: skip
    given = {
        "dtype": ["bfloat16", "float16", "float8_e4m3fn"], "head_dims": [(64, 64), (128, 128), (64, 72)],
        "seqlens": [(64, 128), (113, 203), (256, 256)], "mask": ["none", "causal", (32, 0), (128, 32)],
        "softcap": [0.0, 15.0], "sink": [False, True], "heads": [(2, 2), (4, 1)], "layout": ["contiguous", "strided"],
    }  # fmt: skip
    cases = build(load(f))["cases"]
    rows = {}
    for fam, seed in itertools.product(["normal", "drift"], [0, 2]):
        group = [c for c in cases if (c.family, c.seed) == (fam, seed)]
        for a, b in itertools.combinations(given, 2):  # every pair, and only given values
            assert {(AXIS_OF[a](c), AXIS_OF[b](c)) for c in group} == set(itertools.product(given[a], given[b]))
        rows[fam, seed] = {dataclasses.replace(c, family="normal", seed=0) for c in group}
    # the families and seeds are crossed with one covering array
    assert len(rows) == 4 and len(set(map(frozenset, rows.values()))) == 1
    assert len(cases) == 4 * len(rows["normal", 0]) and {c.family for c in cases} == {"normal", "drift"}


def test_the_release_axes_in_a_file_give_release_itself(tmp_path):
    """The same generator: a file listing ``RELEASE_AXES`` (all families, seed 0) is ``release``
    (its covering-array cases: the varlen ones come from ``VARLEN_AXES``, the code-path ones
    from ``class_cases`` and the mod ones from ``mods_suite``, no suite-file axis)."""
    from audits.suites.cases import class_cases, mods_suite

    ax = RELEASE_AXES
    lines = [f"{k} = {json.dumps(ax[k])}" for k in ("dtype", "mask", "softcap", "heads", "seqlens", "layout")]
    lines += [f"head_dims = {json.dumps([[d, d] for d in ax['d']])}", "sink = [false, true]"]
    f = write(tmp_path, "[axes]\n" + "\n".join(lines) + "\n")
    classes = set(class_cases()) | set(mods_suite())  # and the mods suite's (docs/mods.md): no axis either
    assert build(load(f))["cases"] == [c for c in release_suite() if not c.varlen and c not in classes]


@pytest.mark.parametrize(
    "text,message",
    [
        ('nmae = "x"\n[axes]\n', "unknown key(s) nmae; accepted: name, [[case]], [axes]"),
        ('[axes]\ndtypes = ["float16"]\n', "[axes] unknown key(s) dtypes; accepted: dtype, head_dims, mask,"),
        ('[axes]\ndtype = ["float32"]\n', "[axes] dtype value 'float32' is not accepted; accepted: bfloat16, float16,"),
        ("[axes]\nseqlens = [[128, 128], [64]]\n", "[axes] seqlens value [64] is not accepted; accepted: [seqlen_q,"),
        ("[axes]\nheads = [[4, 3]]\n", "[axes] heads value [4, 3] is not accepted; accepted: [heads_q, heads_kv]"),
        ('[axes]\nmask = ["sliding"]\n', "[axes] mask value 'sliding' is not accepted; accepted: \"none\""),
        ('[axes]\nfamilies = ["gauss"]\n', "[axes] families value 'gauss' is not accepted; accepted: normal,"),
        ("[axes]\nsink = []\n", "[axes] sink = []: expected a non-empty list of true, false"),
        ('[[case]]\ndtype = "fp16"\n', "[[case]] #1: dtype = 'fp16' is not accepted; accepted: bfloat16,"),
        ("[[case]]\nseqlen_q = 64\n[[case]]\nseqlen = 64\n", "[[case]] #2: unknown key(s) seqlen; accepted: dtype,"),
        ('name = "empty"\n', "no [[case]] tables and no [axes] table"),
        ("[axes\n", "not valid TOML"),
    ],
)
def test_errors_name_the_file_the_key_the_value_and_what_is_accepted(text, message, tmp_path, capsys):
    f = write(tmp_path, text)
    assert run("--kernel", "sdpa-math", "--suite", str(f), "--out", str(tmp_path / "o")) == 2
    err = capsys.readouterr().err
    assert str(f) in err and message in err, err
    assert run("--kernel", "sdpa-math", "--suite", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "o")) == 2
    assert "missing.toml: no such suite file" in capsys.readouterr().err


@pytest.mark.slow  # job processes: 21 s CPU
def test_jobs_and_resume(tmp_path):
    """``--jobs 2`` runs the file's cases (the children get them as a case file); ``--resume``
    with the same file redoes none."""
    f = write(tmp_path, SMALL)
    want = [c.name for c in build(load(f))["cases"]]
    out = tmp_path / "o"
    argv = ("--kernel", "sdpa-math", "--suite", str(f), "--out", str(out))
    assert run(*argv, "--jobs", "2") == 0
    assert names(out) == want and report(out)["suite"] == "small"
    assert not any(c.get("resumed") for c in report(out)["cases"])
    journals = [(out / "jobs" / str(i) / "journal.jsonl").read_text() for i in range(2)]
    assert all(j.count("\n") > 1 for j in journals)  # a header and cases in each job's journal
    assert run(*argv, "--jobs", "2", "--resume") == 0
    assert names(out) == want
    # each job resumed its cases (its report's records say so) and redid none (its journal as it was)
    assert all(c.get("resumed") for i in range(2) for c in report(out / "jobs" / str(i))["cases"])
    assert [(out / "jobs" / str(i) / "journal.jsonl").read_text() for i in range(2)] == journals


def test_resume_in_one_process_and_a_changed_file_refused_by_the_case_list(tmp_path, capsys):
    f = write(tmp_path, SMALL.replace('families = ["normal", "flat"]', 'families = ["normal"]'))
    out = tmp_path / "o"
    assert run("--kernel", "sdpa-math", "--suite", str(f), "--out", str(out)) == 0
    assert run("--kernel", "sdpa-math", "--suite", str(f), "--out", str(out), "--resume") == 0
    assert all(c.get("resumed") for c in report(out)["cases"])
    f.write_text(f.read_text().replace("[100, 60]", "[100, 64]"))
    assert run("--kernel", "sdpa-math", "--suite", str(f), "--out", str(out), "--resume") == 2
    err = capsys.readouterr().err
    assert "--resume refused" in err and "cases: journal" in err


def test_shards_together_run_the_files_cases(tmp_path):
    f = write(tmp_path, SMALL.replace('name = "small"\n', ""), name="mine.toml")
    want = {c.name for c in build(load(f))["cases"]}
    got = []
    for i in range(2):
        out = tmp_path / str(i)
        assert run("--kernel", "sdpa-math", "--suite", str(f), "--shard", f"{i}/2", "--out", str(out)) == 0
        assert report(out)["suite"] == "mine"  # no name: the file's stem
        got.append(set(names(out)))
    assert got[0] and got[1] and not got[0] & got[1] and got[0] | got[1] == want


def test_within_a_declared_domain(tmp_path, capsys):
    """sdpa-math declares bf16/fp16, no softcap, no sink: the axes are built inside that (the
    values outside dropped, reported); an explicit case outside is that kernel's skipped case
    with the reason; one outside the --domain file is not run, and is listed."""
    f = write(tmp_path, """[[case]]
seqlen_q = 64
seqlen_k = 64
softcap = 15.0

[[case]]
dtype = "float16"
seqlen_q = 64
seqlen_k = 96

[axes]
dtype = ["bfloat16", "float8_e4m3fn"]
head_dims = [[64, 64]]
seqlens = [[64, 128], [96, 96]]
sink = [false, true]
families = ["normal"]
""")  # fmt: skip
    out = tmp_path / "o"
    assert run("--kernel", "sdpa-math", "--suite", str(f), "--out", str(out)) == 0
    err = capsys.readouterr().err
    assert "axis dtype: dropped, outside the kernels' domain" in err and "axis sink: dropped" in err
    rep = report(out)
    verdicts = {c["case"]: (c["verdict"], c["reasons"]) for c in rep["cases"]}
    capped = "bf16-d128-b1h2k2-s64x64-cap15-normal-seed0"
    assert verdicts[capped] == ("skipped", ["outside the kernel's declared domain: softcap unsupported"])
    generated = [c for c in rep["cases"] if c["family"] == "normal" and c["config"]["d"] == 64]
    assert len(generated) == 2 and all(c["config"]["dtype"] == "bfloat16" for c in generated)
    assert not any(c["config"]["sink"] for c in generated)
    assert set(rep["domain"]["axes_restricted"]) == {"dtype", "sink"}
    dom = write(tmp_path, "seqlen_multiple = 32\n", name="domain.toml")  # 64x96 fits; 64x128 and 96x96 too
    assert run("--kernel", "sdpa-math", "--suite", str(f), "--domain", str(dom), "--out", str(out), "--overwrite") == 0
    dom.write_text("seqlen_multiple = 64\n")  # 64x96 does not: listed, not run; 96x96 dropped
    assert run("--kernel", "sdpa-math", "--suite", str(f), "--domain", str(dom), "--out", str(out), "--overwrite") == 0
    err = capsys.readouterr().err
    assert "[[case]] f16-d128-b1h2k2-s64x96-normal-seed0 not run: outside the --domain file: seqlens 64x96" in err
    rep = report(out)
    assert rep["domain"]["skipped"] == [{"case": "f16-d128-b1h2k2-s64x96-normal-seed0",
                                         "reason": "seqlens 64x96 not multiples of 64"}]  # fmt: skip
    assert "f16-d128-b1h2k2-s64x96-normal-seed0" not in names(out) and capped in names(out)


@pytest.mark.slow  # the reproducer in a subprocess: 22 s CPU
def test_a_failing_cases_reproducer_from_a_suite_file_run_executes(tmp_path, capsys):
    f = write(tmp_path, """[[case]]
dtype = "float16"
heads_q = 4
heads_kv = 1
seqlen_q = 160
seqlen_k = 160
family = "uniform"

[[case]]
d = 64
dv = 64
seqlen_q = 64
seqlen_k = 96
causal = true
""")  # fmt: skip
    argv = ("--kernel", "tests.bugged_kernels:bug_lse_log2", "--suite", str(f), "--out", str(tmp_path / "o"))
    assert run(*argv) == 1
    cmds = re.findall(r"reproduce: (.*)", capsys.readouterr().out)
    assert len(cmds) == 2 and all("--suite" not in c for c in cmds)
    assert_reproduces(cmds[0], tmp_path, case="f16-d128-b1h4k1-s160x160-uniform-seed0", why="LSE")


@pytest.mark.slow  # 15 s CPU
def test_the_example_the_docs_show_runs(tmp_path):
    """examples/suite.toml is the block docs/runner.md shows, and fa4-model passes it."""
    text = (ROOT / "docs" / "runner.md").read_text()
    blocks = re.findall(r"^```toml\n(.*?)^```", text, re.M | re.S)
    assert EXAMPLE.read_text() in blocks
    sf = load(EXAMPLE)
    assert sf.name == "example" and len(sf.cases) == 2 and sf.families == ("normal", "drift")
    out = tmp_path / "o"
    assert run("--kernel", "fa4-model", "--suite", str(EXAMPLE.relative_to(ROOT)), "--out", str(out)) == 0
    assert names(out) == [c.name for c in build(sf)["cases"]]
