"""Coverage (issue 24): what a run compared of what the kernel accepts, in each direction;
``report["coverage"]``, ``fa4-audit coverage`` and ``run --require-coverage``."""

import json
import random
import re
import shlex
from pathlib import Path

import pytest
import torch

from audits import cli
from audits.cli.reports import load_report
from audits.kernels import KERNELS, VARLEN_KERNELS
from audits.report.build import report_from_journal
from audits.suites.cases import Case
from audits.suites.domain import Domain
from audits.verdict.coverage import (
    arch_of,
    compact_ints,
    coverage,
    coverage_lines,
    coverage_summary,
    format_pairs,
    missed,
    pair_pieces,
    unjudgeable,
)
from fa4.refusals import production_domain

ROOT = Path(__file__).parents[1]
#: tiny cases of the test kernel (tests/coverage_kernels.py): bf16, one head, 32 x 32
TINY = {"batch": 1, "heads_q": 1, "heads_kv": 1, "seqlen_q": 32, "seqlen_k": 32}
KERNEL = "tests.coverage_kernels:two_head_dims"


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.coverage_kernels resolves as module:attr


def config(**kw) -> str:
    return json.dumps({**TINY, **kw})


def run(*argv) -> int:
    return cli.main(["run", "--quiet", "--no-isolate", *argv])  # in this process: no worker to start


# ---- the rule, on synthetic records --------------------------------------------------------


def rec(case: Case, verdict: str, *, status: str = "ran", backward: str | None = None, det: bool = False) -> dict:
    """A report record of ``case`` as the engine writes it, reduced to what coverage reads."""
    r = {"case": case.name, "config": case.as_dict(), "verdict": verdict, "status": status}
    if status == "ran":
        r["out"] = {"max_abs": 0.0}
    if backward is not None:
        r["backward"] = {"status": backward, "deterministic": det}
        if backward == "ran":
            r["backward"]["grads"] = {"dq": {"max_abs": 0.0}}
    return r


A = Case(d=64, dv=64)  # forward and backward compared
B = Case(d=96, dv=96, causal=True)  # forward compared (and failed), backward errored
C = Case(d=128, dv=128)  # skipped
D = Case(d=128, dv=128, family="large")  # out-of-domain
E = Case(d=128, dv=128, seed=1)  # the kernel raised
DOMAIN = Domain.from_dict({"head_dims": [[64, 64], [96, 96], [128, 128]]}, where="test")


def records() -> list[dict]:
    return [
        rec(A, "pass", backward="ran"),
        rec(B, "fail", backward="error"),
        rec(C, "skipped", status="skipped"),
        rec(D, "out-of-domain", backward="ran"),
        rec(E, "error", status="error"),
    ]


def test_a_value_is_covered_only_in_a_direction_that_was_compared():
    cov = coverage(cases=[A, B, C, D, E], records=records(), domain=DOMAIN, arch="sm90", backward=True)
    h = cov["head_dims"]
    assert h["accepted"] == [[64, 64], [96, 96], [128, 128]]
    assert h["forward"] == [[64, 64], [96, 96]]  # a failing comparison covers; skipped/ood/error do not
    assert h["backward"] == [[64, 64]]  # B's backward errored: its forward only
    assert h["missed_forward"] == [[128, 128]]
    assert h["missed_backward"] == [[96, 96], [128, 128]]
    assert cov["directions"] == ["forward", "backward"] and cov["arch"] == "sm90"
    cls = cov["classes"]
    assert cls["sm90.fwd.tile192x128.hd64"]["forward"] == A.name
    assert cls["sm90.fwd.tile192x128.hd96"]["forward"] == B.name  # causal at d 96: tile 192x128
    assert cls["sm90.bwd.tile128x128.hd64"]["backward"] == A.name
    assert cls["sm90.fwd.tile128x128.hd128"]["forward"] is None  # only C, D, E had d 128
    assert cls["sm90.fwd.mask.causal"] == {**cls["sm90.fwd.mask.causal"], "forward": B.name, "directions": ["forward"]}
    assert cls["sm90.bwd.mask.causal"]["backward"] is None
    assert cov["features"]["mask=causal"] == {"forward": B.name, "backward": None}


def test_head_dims_are_judged_by_value_the_pairs_reported():
    dom = Domain.from_dict({"head_dims": [[64, 64], [128, 128], [64, 128]]}, where="test")
    c128 = Case(d=128, dv=128)
    cov = coverage(cases=[A, c128], records=[rec(A, "pass"), rec(c128, "pass")], domain=dom, arch=None)
    h = cov["head_dims"]
    assert h["missed_forward"] == [[64, 128]]  # the pair, reported
    assert h["values"]["missed_forward"] == {"d": [], "dv": []}  # every d and every dv was compared
    assert missed(cov, require="head_dims") == []
    cov = coverage(cases=[A], records=[rec(A, "pass")], domain=dom, arch=None)
    assert missed(cov, require="head_dims") == ["head dims forward: d 128; dv 128"]


def test_classes_of_the_arch_only_and_the_deterministic_backward_from_the_record():
    recs = [rec(A, "pass", backward="ran", det=True)]
    cov = coverage(cases=[A], records=recs, domain=DOMAIN, arch="sm90")
    assert all(n.startswith("sm90.") for n in cov["classes"])
    assert cov["classes"]["sm90.bwd.deterministic"]["backward"] == A.name
    cov = coverage(cases=[A], records=[rec(A, "pass", backward="ran")], domain=DOMAIN, arch="sm100")
    assert all(n.startswith("sm100.") for n in cov["classes"])
    assert cov["classes"]["sm100.bwd.deterministic"]["backward"] is None


def test_the_backward_is_judged_only_when_the_run_audited_it():
    recs = [rec(A, "pass")]
    cov = coverage(cases=[A], records=recs, domain=DOMAIN, arch="sm90")  # inferred: no record has a backward
    assert cov["directions"] == ["forward"]
    assert cov["head_dims"]["missed_backward"] is None and cov["head_dims"]["missed_forward"] == [[96, 96], [128, 128]]
    assert any("without --backward" in n for n in cov["notes"])
    assert not any("backward" in m for m in missed(cov, require="all"))
    no_bwd = Domain.from_dict({"head_dims": [[64, 64]], "backward": False}, where="test")
    cov = coverage(cases=[A], records=recs, domain=no_bwd, arch="sm90", backward=True)
    assert cov["directions"] == ["forward"] and not any(".bwd." in n for n in cov["classes"])
    assert any("declares no backward" in n for n in cov["notes"])


def test_unrestricted_head_dims_and_no_arch_judge_nothing_and_say_so():
    cov = coverage(cases=[A], records=[rec(A, "pass")], domain=Domain(), arch=None)
    assert cov["head_dims"]["accepted"] is None and cov["head_dims"]["missed_forward"] is None
    assert cov["head_dims"]["forward"] == [[64, 64]]
    assert cov["classes"] is None
    assert any("head dims unrestricted" in n for n in cov["notes"])
    assert any("no architecture declared" in n for n in cov["notes"])
    assert missed(cov, require="all") == [
        "head dims: not judged (unrestricted)",
        "classes: not judged (no architecture)",
    ]
    why = unjudgeable(domain=Domain(), arch=None, require="all")
    assert "--domain FILE.toml with head_dims" in why[0] and "fn.fa4_audit_arch" in why[1]
    assert unjudgeable(domain=DOMAIN, arch=None, require="head_dims") == []


def test_a_varlen_case_run_per_sequence_covers_no_class():
    v = Case(d=64, dv=64, batch=2, seqlen_q=64, seqlen_k=64, seqlens=((32, 32), (64, 64)))
    per_seq = {**rec(v, "pass"), "varlen": {"entry": "per-sequence"}}
    cov = coverage(cases=[v], records=[per_seq], domain=DOMAIN, arch="sm90")
    assert cov["head_dims"]["forward"] == [[64, 64]]
    assert not any(e["forward"] for e in cov["classes"].values())
    entry = {**rec(v, "pass"), "varlen": {"entry": "varlen"}}
    cov = coverage(cases=[v], records=[entry], domain=DOMAIN, arch="sm90")
    assert cov["classes"]["sm90.fwd.varlen"]["forward"] == v.name


def test_the_varlen_backward_is_listed_not_auditable_never_missed():
    cov = coverage(cases=[A], records=[rec(A, "pass", backward="ran")], domain=DOMAIN, arch="sm90")
    e = cov["classes"]["sm90.bwd.varlen"]
    assert e["directions"] == [] and "forward only" in e["not_auditable"]["backward"]
    gone = missed(cov, require="classes")
    assert "class sm90.fwd.varlen (forward)" in gone and not any("bwd.varlen" in m for m in gone)
    assert "class sm90.bwd.deterministic (backward): run --backward --deterministic covers it" in gone


def test_compact_head_dims():
    assert compact_ints(range(8, 257, 8)) == "8..256/8"
    assert compact_ints([64, 96]) == "64, 96"
    assert compact_ints([1, 2, 3, 10, 64, 128, 192, 256]) == "1..3, 10, 64..256/64"
    assert format_pairs([[64, 64], [128, 128], [192, 192], [192, 128], [64, 512]]) == (
        "d=dv 64..192/64; (192, 128), (64, 512)"
    )
    assert format_pairs([[96, 96]]) == "d=dv 96"  # the older form where it is shorter than "(96, 96)"
    assert format_pairs([[8, 128], [16, 128], [24, 128], [64, 512]]) == "d 8..24/8 x dv 128; (64, 512)"
    assert format_pairs([]) == "none"


# ---- the pairs, compactly and bounded -------------------------------------------------------


def parse_ints(text: str) -> set[int]:
    """The integers a compact_ints text names ("8..24/8, 64" -> {8, 16, 24, 64})."""
    out: set[int] = set()
    for part in text.split(", "):
        m = re.fullmatch(r"(\d+)\.\.(\d+)(?:/(\d+))?", part)
        if m:
            out |= set(range(int(m[1]), int(m[2]) + 1, int(m[3] or 1)))
        else:
            out.add(int(part))
    return out


def parse_pairs(text: str) -> set[tuple[int, int]]:
    """The (d, dv) pairs a format_pairs text names, read back piece by piece ("; "): a product,
    a diagonal, single pairs, or the older form's "dv X: d ..."; any other piece is an error."""
    out: set[tuple[int, int]] = set()
    for piece in text.split("; "):
        if m := re.fullmatch(r"d (.+) x dv (.+)", piece):
            out |= {(d, dv) for d in parse_ints(m[1]) for dv in parse_ints(m[2])}
        elif m := re.fullmatch(r"d=dv (.+)", piece):
            out |= {(x, x) for x in parse_ints(m[1])}
        elif m := re.fullmatch(r"dv (\d+): d (.+)", piece):
            out |= {(d, int(m[1])) for d in parse_ints(m[2])}
        elif re.fullmatch(r"\(\d+, \d+\)(, \(\d+, \d+\))*", piece):
            out |= {(int(a), int(b)) for a, b in re.findall(r"\((\d+), (\d+)\)", piece)}
        else:
            raise AssertionError(f"unreadable piece {piece!r} of {text!r}")
    return out


def pair_sets() -> list[set[tuple[int, int]]]:
    """Pair sets the formatter must describe exactly: production's domains, products with holes,
    diagonals, random subsets of every density (fixed seed)."""
    sm90 = set(production_domain_pairs(9))
    sm100 = set(production_domain_pairs(10))
    rng = random.Random(24)
    sets = [sm90, sm100, {(x, x) for x in range(8, 257, 8)}, sm90 - {(64, 64), (192, 128)}, {(64, 512)}]
    for p in (0.02, 0.1, 0.5, 0.9, 0.99):
        for base in (sm90, sm100):
            sets.append({q for q in sorted(base) if rng.random() < p} or {(8, 8)})
    return sets


def production_domain_pairs(major: int) -> tuple:
    return Domain.from_dict(production_domain(major), where=f"production_domain({major})").head_dim_pairs()


def test_format_pairs_describes_exactly_the_pairs_it_was_given():
    for pairs in pair_sets():
        text = format_pairs(sorted(pairs))
        assert parse_pairs(text) == pairs, text
        products, diagonal, singles = pair_pieces(pairs=pairs)  # a partition: no pair twice
        listed = [(d, dv) for ds, dvs in products for d in ds for dv in dvs] + [(x, x) for x in diagonal] + singles
        assert len(listed) == len(set(listed)) == len(pairs) and set(listed) == pairs
        assert all(len(ds) * len(dvs) >= 3 for ds, dvs in products)


def domain_coverage(major: int, covered) -> dict:
    """coverage of a forward run that compared ``covered`` (d, dv) pairs, on production's domain
    of compute capability ``major`` (no architecture: the head dims are what is tested)."""
    dom = Domain.from_dict(production_domain(major), where=f"production_domain({major})")
    cases = [Case(d=d, dv=dv) for d, dv in covered]
    return coverage(cases=cases, records=[rec(c, "pass") for c in cases], domain=dom, arch=None, backward=False)


def test_production_sm90_accepts_one_product_of_1024_pairs():
    lines = coverage_lines(domain_coverage(9, []))
    assert "head dims accepted: d 8..256/8 x dv 8..256/8 (1024 pairs)" in lines
    assert "  forward: none (0 of 1024 pairs)" in lines


def test_production_sm100_accepts_a_product_and_four_pairs():
    lines = coverage_lines(domain_coverage(10, [(64, 64)]))
    assert (
        "head dims accepted: d 8..128/8 x dv 8..128/8; (192, 128), (256, 256), (64, 512), (512, 512) (260 pairs)"
    ) in lines
    assert "  forward: d=dv 64 (1 of 260 pairs)" in lines


def test_a_run_missing_most_pairs_prints_a_bounded_missed_line_with_every_missed_value():
    rng = random.Random(7)
    sm90 = sorted(production_domain_pairs(9))
    got = rng.sample(sm90[:-96], 40)  # scattered, and no pair with d 232..256 (sorted by d): those d are missed
    cov = domain_coverage(9, got)
    h = cov["head_dims"]
    assert len(h["missed_forward"]) == 1024 - 40  # report.json keeps every missed pair
    gone_d = sorted({d for d, _ in sm90} - {d for d, _ in got})
    assert gone_d[-3:] == [240, 248, 256]
    lines = coverage_lines(cov)
    line = next(x for x in lines if x.startswith("  missed forward: "))
    assert len(line) < 400, line
    assert line.startswith(f"  missed forward: values d {compact_ints(gone_d)}; dv "), line
    assert line.endswith("; 984 of 1024 pairs (the gate judges d and dv values; pairs are listed in report.json)")
    assert "  forward: 40 of 1024 pairs (pairs are listed in report.json)" in lines
    # few missed pairs, or a short listing of many: listed, with the count
    few = coverage_lines(domain_coverage(9, [p for p in sm90 if p[1] != 8]))
    assert "  missed forward: values d none; dv 8; pairs d 8..256/8 x dv 8 (32 of 1024 pairs)" in few
    # five diagonal-ish pairs covered: the 1019 missed pairs are a few products, listed within bounds
    five = coverage_lines(domain_coverage(9, [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]))
    line = next(x for x in five if x.startswith("  missed forward: "))
    assert len(line) < 400 and line.endswith("(1019 of 1024 pairs)") and "d 8..256/8 x dv 8..56/8" in line


# ---- the kernels' architectures -------------------------------------------------------------


def test_built_in_kernels_declare_their_architecture(monkeypatch):
    assert arch_of(KERNELS["fa4-model"]) == "sm100"
    assert arch_of(KERNELS["fa4-model-sm90"]) == arch_of(KERNELS["fa4-model-sm90-tc"]) == "sm90"
    assert arch_of(VARLEN_KERNELS["fa4-model-sm90"]) == "sm90"
    assert arch_of(KERNELS["sdpa-math"]) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert arch_of(KERNELS["fa4"]) is None  # no GPU: production's architecture is unknown
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cap, arch in (((9, 0), "sm90"), ((10, 0), "sm100"), ((11, 0), "sm100"), ((12, 0), None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, cap=cap: cap)
        assert arch_of(KERNELS["fa4"]) == arch, cap


def test_an_unknown_architecture_is_refused_with_its_name(tmp_path, capsys):
    kern = "tests.coverage_kernels:bad_arch"
    assert run("--kernel", kern, "--config", config(d=64, dv=64), "--out", str(tmp_path)) == 2
    assert "fa4_audit_arch 'sm75' is not one of sm90, sm100" in capsys.readouterr().err


# ---- run --require-coverage, the report, fa4-audit coverage ---------------------------------


def test_require_head_dims_fails_a_run_that_missed_one(tmp_path, capsys):
    out = tmp_path / "run"
    code = run(
        "--kernel", KERNEL, "--config", config(d=64, dv=64), "--require-coverage", "head_dims", "--out", str(out)
    )
    assert code == 1  # the case passed; the requirement failed
    text = capsys.readouterr().out
    assert "--require-coverage head_dims: the run missed 1 item(s):\n  missed head dims forward: d 96; dv 96" in text
    rep = json.loads((out / "report.json").read_text())
    assert rep["summary"]["verdicts"]["pass"] == 1
    cov = rep["coverage"]
    assert cov["head_dims"]["accepted"] == [[64, 64], [96, 96]] and cov["head_dims"]["forward"] == [[64, 64]]
    assert cov["required"] == {"require": "head_dims", "missed": ["head dims forward: d 96; dv 96"], "met": False}
    assert "required (head_dims): NOT met" in (out / "report.md").read_text()
    assert "<h2>Coverage</h2>" in (out / "report.html").read_text()
    # the command the run printed for its coverage, run as printed
    line = next(x for x in text.splitlines() if "coverage:" in x)
    assert "head dims forward 1 of 2 d values (1 of 2 pairs); classes forward " in line
    cmd = shlex.split(line[line.rindex("(fa4-audit ") + 1 : -1])
    assert cmd[:2] == ["fa4-audit", "coverage"]
    assert cli.main(cmd[1:]) == 0
    shown = capsys.readouterr().out
    assert "head dims accepted: d=dv 64, 96 (2 pairs)" in shown
    assert "missed forward: values d 96; dv 96; pairs d=dv 96" in shown
    assert "sm90.fwd.tile192x128.hd64" in shown and "bf16-d64-b1h1k1-s32x32-normal-seed0" in shown


def test_require_head_dims_passes_a_run_that_covers_its_declared_domain(tmp_path, capsys):
    dom = tmp_path / "d.toml"
    dom.write_text("head_dims = [[64, 64]]\n")
    out = tmp_path / "run"
    argv = ["--kernel", KERNEL, "--config", config(d=64, dv=64), "--domain", str(dom), "--out", str(out)]
    assert run(*argv, "--require-coverage", "head_dims") == 0
    cov = json.loads((out / "report.json").read_text())["coverage"]
    assert cov["head_dims"]["accepted"] == [[64, 64]] and cov["head_dims"]["missed_forward"] == []
    assert cov["required"]["met"] is True
    # the same run required to cover the classes misses most of them
    capsys.readouterr()
    assert run(*argv, "--require-coverage", "classes", "--overwrite") == 1
    text = capsys.readouterr().out
    assert "missed class sm90.fwd.mask.causal (forward)" in text
    assert "sm90.fwd.tile192x128.hd64" not in text  # covered by the d64 case
    assert "tile128x128.hd128" not in text  # no call inside the domain (d = dv = 64) has that tile
    classes = json.loads((out / "report.json").read_text())["coverage"]["classes"]
    assert classes["sm90.fwd.tile128x128.hd128"]["outside_domain"] == {
        "forward": "no call the kernel's domain accepts falls in it"
    }
    assert classes["sm90.fwd.tile128x128.hd128"]["directions"] == []
    assert "directions" in classes["sm90.fwd.softcap"] and classes["sm90.fwd.softcap"]["directions"] == ["forward"]
    # the journal read as a report computes the same coverage on the basis it kept (the --domain file's)
    from_journal = report_from_journal(out / "journal.jsonl")["coverage"]
    from_report = json.loads((out / "report.json").read_text())["coverage"]
    assert from_journal == {k: v for k, v in from_report.items() if k != "required"}


@pytest.mark.parametrize(
    "kernel,require,message",
    [
        ("fa4-model-sm90", "head_dims", "fa4-model-sm90: head dims: the domain accepts any (d, dv)"),
        ("sdpa-math", "classes", "sdpa-math: classes: the kernel declares no architecture"),
        ("sdpa-math", "all", "declare fn.fa4_audit_arch = 'sm90' or 'sm100'"),
    ],
)
def test_require_what_cannot_be_judged_is_a_usage_error_before_any_case(kernel, require, message, tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        run("--kernel", kernel, "--config", config(d=64, dv=64), "--require-coverage", require, "--out", str(out)) == 2
    )
    err = capsys.readouterr().err
    assert f"--require-coverage {require} cannot be judged" in err and message in err
    assert not out.exists()  # refused before anything ran


def test_coverage_reads_run_directories_journals_and_says_which_path_is_bad(tmp_path, capsys):
    out = tmp_path / "run"
    assert run("--kernel", KERNEL, "--kernel", "sdpa-math", "--config", config(d=64, dv=64), "--out", str(out)) == 0
    capsys.readouterr()
    assert cli.main(["coverage", str(out)]) == 0  # two kernels: each its coverage
    text = capsys.readouterr().out
    assert "tests.coverage_kernels:two_head_dims / config" in text and "sdpa-math / config" in text
    assert "note: no architecture declared" in text  # sdpa-math's
    assert cli.main(["coverage", str(out / "sdpa-math" / "journal.jsonl")]) == 0
    assert "sdpa-math / config" in capsys.readouterr().out
    assert cli.main(["show", str(out / "sdpa-math")]) == 0  # a run directory of one kernel, for every reader
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("coverage: "))
    assert line.startswith(
        "coverage: head dims forward 1 d values (unrestricted); classes not judged (no architecture)"
    )
    assert cli.main(["coverage", str(tmp_path / "nowhere")]) == 2
    assert f"{tmp_path / 'nowhere'}: no such report, journal or run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["coverage", str(tmp_path / "empty")]) == 2
    assert "a directory without report.json or journal.jsonl" in capsys.readouterr().err
    assert cli.main(["show", str(out)]) == 2  # several kernels: show reads one report
    assert "a run of several kernels" in capsys.readouterr().err


def test_a_report_written_before_coverage_loads_with_it_computed(tmp_path, capsys):
    rep = load_report(str(ROOT / "reports/h200/fa4-smoke/report.json"))  # committed before coverage existed
    cov = rep["coverage"]
    assert cov["arch"] == "sm90"  # production, from the compute capability it ran on
    assert cov["notes"][0].startswith("computed when read: the report predates coverage")
    assert cov["head_dims"]["forward"]  # its passing cases cover
    old = json.loads((ROOT / "reports/h200/fa4-smoke/report.json").read_text())
    assert "coverage" not in old
    old["cases"] = []
    (tmp_path / "empty.json").write_text(json.dumps(old))
    assert load_report(str(tmp_path / "empty.json"))["coverage"] == {
        "absent": "the report predates coverage and holds no case"
    }
    assert cli.main(["coverage", str(ROOT / "reports/h200/fa4-smoke/report.json")]) == 0
    assert "architecture: sm90" in capsys.readouterr().out


def test_merged_shards_cover_what_their_cases_cover(tmp_path, capsys):
    shards = []
    for i in range(2):
        out = tmp_path / f"s{i}"
        argv = ["--config", config(d=64, dv=64), "--config", config(d=96, dv=96), "--shard", f"{i}/2"]
        assert run("--kernel", KERNEL, *argv, "--out", str(out)) == 0
        shards.append(json.loads((out / "report.json").read_text())["coverage"]["head_dims"]["forward"])
    assert sorted(shards) == [[[64, 64]], [[96, 96]]]
    assert cli.main(["merge", str(tmp_path / "s0/report.json"), str(tmp_path / "s1/report.json"), "--out",
                     str(tmp_path / "m")]) == 0  # fmt: skip
    merged = json.loads((tmp_path / "m/report.json").read_text())["coverage"]
    assert merged["head_dims"]["forward"] == [[64, 64], [96, 96]] and merged["head_dims"]["missed_forward"] == []
    assert coverage_summary(merged).startswith("head dims forward 2 of 2 d values (2 of 2 pairs); classes forward ")


def test_the_class_cases_meet_the_classes_requirement_on_both_archs():
    """``audits.suites.cases.class_cases`` (in ``release``), forward and backward compared (the backward
    with ``--deterministic``), covers every judged class: ``--require-coverage classes`` passes."""
    from audits.suites.cases import class_cases

    cases = class_cases()
    recs = [
        {**rec(c, "pass", backward="ran", det=True), "varlen": {"entry": "varlen"} if c.varlen else None} for c in cases
    ]
    for arch in ("sm90", "sm100"):
        cov = coverage(cases=cases, records=recs, domain=Domain(), arch=arch, backward=True)
        assert missed(cov, require="classes") == [], arch
        cov = coverage(cases=cases, records=recs[:-3], domain=Domain(), arch=arch, backward=True)
        assert missed(cov, require="classes"), arch  # the last cases are the only ones of some classes
