"""Sharding across hosts: ``run --shard auto`` under simulated Slurm array and Kubernetes Indexed
Job environments, ``merge`` of shard reports equal case for case to the unsharded run and its
refusals, and the scale-out examples in ``examples/scaleout/`` (their commands parse, their
shards cover the suite)."""

import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from audits import cli
from audits.engine.shards import K8S_INDEX, SHARDS_ENV, SLURM, ShardEnvError, parse_shard, shard_cases, shard_from_env
from audits.report.records import without_timing
from audits.suites.cases import suite

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples" / "scaleout"
ALL_VARS = (*SLURM, "SLURM_ARRAY_TASK_STEP", K8S_INDEX, SHARDS_ENV)
GLOB = "*tile_step*"  # 8 cases of the smoke suite, a second each on the CPU model
TIMING = ("resumed",)  # beside the wall-clock fields (audits.report.records.without_timing)


@pytest.fixture
def env(monkeypatch):
    """A clean scheduler environment; returns a setter of variables."""
    for v in ALL_VARS:
        monkeypatch.delenv(v, raising=False)

    def set_(**kw):
        for k, v in kw.items():
            monkeypatch.setenv(k, str(v))

    return set_


# --- the environment -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variables, shards, expected",
    [
        (dict(SLURM_ARRAY_TASK_ID=5, SLURM_ARRAY_TASK_MIN=4, SLURM_ARRAY_TASK_MAX=6), None, (1, 3)),
        (dict(SLURM_ARRAY_TASK_ID=0, SLURM_ARRAY_TASK_MIN=0, SLURM_ARRAY_TASK_COUNT=3), None, (0, 3)),
        (dict(SLURM_ARRAY_TASK_ID=3, SLURM_ARRAY_TASK_MIN=0, SLURM_ARRAY_TASK_MAX=3, SLURM_ARRAY_TASK_COUNT=4), 4,
         (3, 4)),
        (dict(SLURM_ARRAY_TASK_ID=30, SLURM_ARRAY_TASK_MIN=10, SLURM_ARRAY_TASK_MAX=40, SLURM_ARRAY_TASK_STEP=10), None,
         (2, 4)),
        (dict(JOB_COMPLETION_INDEX=2, FA4_AUDIT_SHARDS=4), None, (2, 4)),
        (dict(JOB_COMPLETION_INDEX=2), 4, (2, 4)),
        (dict(JOB_COMPLETION_INDEX=0, FA4_AUDIT_SHARDS=1), 1, (0, 1)),
    ],
)  # fmt: skip
def test_shard_from_the_environment(env, variables, shards, expected):
    env(**variables)
    i, n, src = shard_from_env(shards=shards)
    assert (i, n) == expected
    assert ("Slurm" if "SLURM_ARRAY_TASK_ID" in variables else "Kubernetes") in src


@pytest.mark.parametrize(
    "variables, shards, says",
    [
        ({}, None, ["no shard in the environment", "SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX", "FA4_AUDIT_SHARDS"]),
        (dict(SLURM_ARRAY_TASK_ID="x", SLURM_ARRAY_TASK_MIN=0, SLURM_ARRAY_TASK_COUNT=2), None,
         ["SLURM_ARRAY_TASK_ID='x' is not an integer"]),
        (dict(SLURM_ARRAY_TASK_ID=1), None, ["SLURM_ARRAY_TASK_MIN"]),
        (dict(SLURM_ARRAY_TASK_ID=1, SLURM_ARRAY_TASK_MIN=0), None,
         ["neither SLURM_ARRAY_TASK_COUNT nor SLURM_ARRAY_TASK_MAX"]),
        (dict(SLURM_ARRAY_TASK_ID=3, SLURM_ARRAY_TASK_MIN=0, SLURM_ARRAY_TASK_COUNT=3), None, ["outside 0..2"]),
        (dict(SLURM_ARRAY_TASK_ID=3, SLURM_ARRAY_TASK_MIN=1, SLURM_ARRAY_TASK_MAX=7, SLURM_ARRAY_TASK_COUNT=3), None,
         ["SLURM_ARRAY_TASK_COUNT=3", "cannot be sharded"]),
        (dict(SLURM_ARRAY_TASK_ID=15, SLURM_ARRAY_TASK_MIN=10, SLURM_ARRAY_TASK_MAX=40, SLURM_ARRAY_TASK_STEP=10),
         None, ["not on the array's grid"]),
        (dict(SLURM_ARRAY_TASK_ID=1, SLURM_ARRAY_TASK_MIN=0, SLURM_ARRAY_TASK_COUNT=4), 5, ["--shards 5", "4 tasks"]),
        (dict(JOB_COMPLETION_INDEX=1), None, ["JOB_COMPLETION_INDEX=1", "--shards N", "FA4_AUDIT_SHARDS"]),
        (dict(JOB_COMPLETION_INDEX=4, FA4_AUDIT_SHARDS=4), None, ["outside 0..3"]),
        (dict(JOB_COMPLETION_INDEX=0, FA4_AUDIT_SHARDS="four"), None, ["FA4_AUDIT_SHARDS='four' is not an integer"]),
        (dict(JOB_COMPLETION_INDEX="1.5", FA4_AUDIT_SHARDS=4), None, ["JOB_COMPLETION_INDEX='1.5'"]),
        (dict(JOB_COMPLETION_INDEX=0, FA4_AUDIT_SHARDS=4), 3, ["--shards 3 but FA4_AUDIT_SHARDS=4"]),
        (dict(JOB_COMPLETION_INDEX=0, FA4_AUDIT_SHARDS=0), None, ["need at least 1"]),
        (dict(JOB_COMPLETION_INDEX=0, SLURM_ARRAY_TASK_ID=0), 2, ["both SLURM_ARRAY_TASK_ID and JOB_COMPLETION_INDEX"]),
    ],
)  # fmt: skip
def test_unusable_environments_are_named(env, variables, shards, says):
    env(**variables)
    with pytest.raises(ShardEnvError) as exc:
        shard_from_env(shards=shards)
    for s in says:
        assert s in str(exc.value)


@pytest.mark.parametrize(
    "argv, variables, says",
    [
        (["--shard", "auto"], {}, "--shard auto: no shard in the environment"),
        (["--shard", "auto"], dict(JOB_COMPLETION_INDEX=5, FA4_AUDIT_SHARDS=3), "outside 0..2"),
        (["--shard", "auto"], dict(JOB_COMPLETION_INDEX=0), "--shards N or set FA4_AUDIT_SHARDS"),
        (["--shards", "3"], {}, "--shards N gives the shard count to --shard auto"),
        (["--shard", "1of3"], {}, "expected I/N with 0 <= I < N, or auto"),
    ],
)
def test_run_refuses_an_unusable_shard(env, capsys, tmp_path, argv, variables, says):
    env(**variables)
    assert cli.main(["run", "--quiet", "--kernel", "fa4-model", "--case", GLOB, *argv, "--out", str(tmp_path)]) == 2
    assert says in capsys.readouterr().err


def test_the_plan_is_the_same_on_every_host():
    """Each host plans alone: the cost-balanced slices are a function of the case list only
    (not of hash randomization, process or order of calls), partition it, and balance cost."""
    cases = suite("release")
    plan = [[c.name for c in shard_cases(cases, i, 4)] for i in range(4)]
    code = (
        "import json; from audits.suites.cases import suite; from audits.engine.shards import shard_cases; "
        "cs = suite('release'); print(json.dumps([[c.name for c in shard_cases(cs, i, 4)] for i in range(4)]))"
    )
    for seed in ("1", "2"):
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed})  # fmt: skip
        assert json.loads(p.stdout) == plan
    assert sorted(n for s in plan for n in s) == sorted(c.name for c in cases)
    cost = {c.name: c.cost for c in cases}
    loads = [sum(cost[n] for n in s) for s in plan]
    assert max(loads) <= 1.05 * min(loads)


# --- merge -------------------------------------------------------------------------------------


def _run(out: Path, *argv: str) -> int:
    return cli.main(["run", "--quiet", "--kernel", "fa4-model", "--case", GLOB, *argv, "--out", str(out)])


def _merge(out: Path, *reports: Path) -> int:
    return cli.main(["merge", *(str(r / "report.json") for r in reports), "--out", str(out)])


def _report(d: Path) -> dict:
    return json.loads((d / "report.json").read_text())


def _cases(rep: dict) -> list[dict]:
    """The case records without their timing."""
    return [{k: v for k, v in without_timing(c).items() if k not in TIMING} for c in rep["cases"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The unsharded run and three shardings of it into 3: --shard I/3, and --shard auto under a
    Slurm array (tasks 10..12) and a Kubernetes Indexed Job (the count by --shards and by
    FA4_AUDIT_SHARDS)."""
    base = tmp_path_factory.mktemp("shards")
    assert _run(base / "whole") == 0
    out = {"whole": base / "whole"}
    slurm = dict(SLURM_ARRAY_TASK_MIN="10", SLURM_ARRAY_TASK_MAX="12")
    for how in ("explicit", "slurm", "k8s"):
        for i in range(3):
            d = out[f"{how}{i}"] = base / f"{how}{i}"
            with pytest.MonkeyPatch.context() as mp:
                for v in ALL_VARS:
                    mp.delenv(v, raising=False)
                if how == "explicit":
                    assert _run(d, "--shard", f"{i}/3") == 0
                elif how == "slurm":
                    for k, v in {**slurm, "SLURM_ARRAY_TASK_ID": str(10 + i)}.items():
                        mp.setenv(k, v)
                    assert _run(d, "--shard", "auto") == 0
                else:
                    mp.setenv("JOB_COMPLETION_INDEX", str(i))
                    if i == 0:
                        assert _run(d, "--shard", "auto", "--shards", "3") == 0
                    else:
                        mp.setenv("FA4_AUDIT_SHARDS", "3")
                        assert _run(d, "--shard", "auto") == 0
    return out


@pytest.mark.parametrize("how", ["explicit", "slurm", "k8s"])
def test_merged_shards_are_the_unsharded_run(runs, tmp_path, how):
    shards = [runs[f"{how}{i}"] for i in range(3)]
    for i, d in enumerate(shards):
        assert _report(d)["shard"] == f"{i}/3"  # --shard auto records the shard it resolved
        assert _report(d)["cases"]
    assert _merge(tmp_path / "m", *reversed(shards)) == 0  # in any order
    whole, merged = _report(runs["whole"]), _report(tmp_path / "m")
    assert [c["case"] for c in merged["cases"]] == [c["case"] for c in whole["cases"]]
    assert _cases(merged) == _cases(whole)
    for k in ("kernel", "suite", "seed", "thresholds"):
        assert merged[k] == whole[k]
    assert merged["shard"] is None
    assert {k: v for k, v in merged["summary"].items()} == whole["summary"]


def test_all_shardings_agree(runs):
    for i in range(3):
        assert _cases(_report(runs[f"slurm{i}"])) == _cases(_report(runs[f"explicit{i}"]))
        assert _cases(_report(runs[f"k8s{i}"])) == _cases(_report(runs[f"explicit{i}"]))


def _edit(src: Path, dst: Path, change) -> Path:
    rep = _report(src)
    change(rep)
    dst.mkdir(parents=True)
    (dst / "report.json").write_text(json.dumps(rep))
    return dst


def _thresholds(rep, value):
    rep["thresholds"]["policy"]["fa_multiplier"] = value


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda r: r.update(seed=7), ["differ in seed", "0 in", "7 in"]),
        (lambda r: r.update(suite="release"), ["differ in suite", "'smoke'", "'release'"]),
        (lambda r: r.update(kernel="sdpa-math"), ["differ in kernel", "'fa4-model'", "'sdpa-math'"]),
        (lambda r: _thresholds(r, 0.5), ["differ in thresholds", "policy "]),
        (lambda r: r["environment"].update(fa4_audit="0.0.1"), ["differ in fa4-audit version", "'0.0.1'"]),
        (lambda r: r["environment"].pop("fa4_audit"), ["differ in fa4-audit version", "'not recorded'"]),
        (lambda r: r.update(shard="1/4"), ["differ in shard count", "'3'", "'4'"]),
    ],
)
def test_merge_refuses_shards_of_different_runs(runs, tmp_path, capsys, change, says):
    other = _edit(runs["explicit1"], tmp_path / "other", change)
    assert _merge(tmp_path / "m", runs["explicit0"], other, runs["explicit2"]) == 2
    err = capsys.readouterr().err
    assert "shard reports of different runs" in err and str(other / "report.json") in err
    for s in says:
        assert s in err
    assert not (tmp_path / "m").exists()


def test_merge_accepts_the_same_thresholds_read_elsewhere(runs, tmp_path):
    moved = _edit(runs["explicit1"], tmp_path / "moved", lambda r: r["thresholds"].update(path="/elsewhere/th.toml"))
    assert _merge(tmp_path / "m", runs["explicit0"], moved, runs["explicit2"]) == 0


def test_merge_refuses_a_case_in_two_shards(runs, tmp_path, capsys):
    assert _merge(tmp_path / "m", runs["explicit0"], runs["slurm0"]) == 2
    err = capsys.readouterr().err
    first = _report(runs["explicit0"])["cases"][0]["case"]
    assert f"case {first} is in two shard reports" in err
    assert str(runs["explicit0"] / "report.json") in err and str(runs["slurm0"] / "report.json") in err


def test_merge_says_which_shards_are_missing(runs, tmp_path, capsys):
    assert _merge(tmp_path / "m", runs["explicit0"], runs["explicit2"]) == 0
    assert "shard 1/3 not given" in capsys.readouterr().err


# --- the examples ------------------------------------------------------------------------------

VARIABLE = re.compile(r"\$\{\{[^}]*\}\}|\$\{\w+\}|\$\w+")


def _commands(path: Path) -> list[str]:
    """The fa4-audit command lines of an example (comments included), up to a shell operator."""
    found = []
    for line in path.read_text().splitlines():
        m = re.search(r"(?:^|[\s#:\-])(fa4-audit (?:run|merge) .*)$", line)
        if m:
            found.append(re.split(r"\s(?:\|\||&&|;)\s|\s#\s", m.group(1))[0].strip())
    return found


def _argv(cmd: str, **values: str) -> list[str]:
    """``cmd`` with its variables substituted (``${{ matrix.index }}`` as ``index``), as argv."""

    def sub(m):
        name = re.sub(r"[${}\s]|matrix\.", "", m.group(0))
        return values.get(name, "0")

    argv = shlex.split(VARIABLE.sub(sub, cmd))
    assert argv[0] == "fa4-audit"
    return argv[1:]


def _parses(argv: list[str], where: str):
    try:
        return cli.build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{where}: fa4-audit rejects {argv}: exit {exc.code}") from None


def _check_merge_reads_runs(runs: list, merges: list, where: str) -> None:
    """Every merge command's report globs match every run's report."""
    assert merges, f"{where}: no fa4-audit merge"
    for m in merges:
        for r in runs:
            assert any(fnmatch.fnmatch(f"{r.out}/report.json", g) for g in m.reports), (where, r.out, m.reports)


def _shards_cover(pairs: list[tuple[int, int]], n: int) -> None:
    assert sorted(pairs) == [(i, n) for i in range(n)]


def test_slurm_example(env):
    array, merge = EXAMPLES / "slurm_array.sbatch", EXAMPLES / "slurm_merge.sbatch"
    lo, hi = map(int, re.search(r"^#SBATCH --array=(\d+)-(\d+)$", array.read_text(), re.M).groups())
    (cmd,) = [c for c in _commands(array) if c.startswith("fa4-audit run")]
    got, runs = [], []
    for task in range(lo, hi + 1):  # each array task, as Slurm sets its variables
        a = _parses(_argv(cmd, SLURM_ARRAY_TASK_ID=str(task)), str(array))
        assert a.shard == "auto"
        env(SLURM_ARRAY_TASK_ID=task, SLURM_ARRAY_TASK_MIN=lo, SLURM_ARRAY_TASK_MAX=hi,
            SLURM_ARRAY_TASK_COUNT=hi - lo + 1)  # fmt: skip
        got.append(shard_from_env(shards=a.shards)[:2])
        runs.append(a)
    _shards_cover(got, hi - lo + 1)
    assert len({a.out for a in runs}) == len(runs)  # each task its own report directory
    merges = [_parses(_argv(c), str(merge)) for c in _commands(merge) if c.startswith("fa4-audit merge")]
    _check_merge_reads_runs(runs, merges, str(merge))
    assert "slurm_merge.sbatch" in array.read_text()


def test_kubernetes_example(env):
    path = EXAMPLES / "k8s_indexed_job.yaml"
    text = path.read_text()
    n = int(re.search(r"^\s+completions: (\d+)$", text, re.M).group(1))
    assert re.search(r"^\s+completionMode: Indexed$", text, re.M)
    count = re.search(r"- name: FA4_AUDIT_SHARDS\n\s+value: \"(\d+)\"", text).group(1)
    assert int(count) == n, "FA4_AUDIT_SHARDS must equal completions"
    (cmd,) = [c for c in _commands(path) if c.startswith("fa4-audit run")]
    got, runs = [], []
    for i in range(n):  # each pod, as the Job controller sets its index
        a = _parses(_argv(cmd, JOB_COMPLETION_INDEX=str(i)), str(path))
        assert a.shard == "auto"
        env(JOB_COMPLETION_INDEX=i, FA4_AUDIT_SHARDS=count)
        got.append(shard_from_env(shards=a.shards)[:2])
        runs.append(a)
    _shards_cover(got, n)
    merges = [_parses(_argv(c), str(path)) for c in _commands(path) if c.startswith("fa4-audit merge")]
    _check_merge_reads_runs(runs, merges, str(path))


def test_ci_matrix_example():
    path = EXAMPLES / "ci_matrix.yml"
    index = [int(x) for x in re.search(r"^\s+index: \[([\d, ]+)\]$", path.read_text(), re.M).group(1).split(",")]
    (cmd,) = [c for c in _commands(path) if c.startswith("fa4-audit run")]
    runs = [_parses(_argv(cmd, index=str(i)), str(path)) for i in index]
    _shards_cover([parse_shard(a.shard) for a in runs], len(index))
    merges = [_parses(_argv(c), str(path)) for c in _commands(path) if c.startswith("fa4-audit merge")]
    # the merge job reads the downloaded artifacts (shards/<artifact>/report.json), named like the runs' folders
    _check_merge_reads_runs(runs, merges, str(path))


def test_yaml_examples_are_yaml():
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load((EXAMPLES / "k8s_indexed_job.yaml").read_text())
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert int(env["FA4_AUDIT_SHARDS"]) == job["spec"]["completions"]
    wf = yaml.safe_load((EXAMPLES / "ci_matrix.yml").read_text())
    assert wf["jobs"]["merge"]["needs"] == "shard"
    assert wf["jobs"]["shard"]["strategy"]["matrix"]["index"] == list(range(4))
