"""The catalogue of localizable bugs (issue 25, item 4; tests/localizable_kernels.py): for each
seeded kernel ``fa4-audit run`` fails the case of its bug and the case's diagnosis names the bug's
axis and values (and no other axis); the same run passes the bug's control case, which gets no
diagnosis.  The correct twins, audited in the same run on shared inputs and references, pass
every case (no diagnosis anywhere), and a kernel whose errors are scattered noise fails with a
diagnosis that names no axis.

Each entry runs two small cases (seconds on a CPU): the case the bug breaks and its control (the
same but for the bug's trigger).  Tiles are the SM90 choice the diagnosis uses for kernels
without FA4's numerics (tests/localizable_kernels.py, "Tiles"): at d 128 the forward tile is
128 x 128; at d 64 the backward tile is 128 x 128.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from audits import cli
from audits.suites.cases import case_from_dict
from audits.verdict.vocabulary import CAUSE_KEYS
from tests.localizable_kernels import CLEAN, LOCALIZABLE

ROOT = Path(__file__).parents[1]
MODULE = "tests.localizable_kernels"

#: axes whose values are single rows or keys: the diagnosis's 99 % rule (audits.verdict.diagnosis,
#: MIN_SHARE_OF_VIOLATIONS) may leave out the few rows where the bug moves the result least (the
#: first rows of a tile whose diagonal block holds one or two visible keys), so these are checked
#: as a subset holding at least this share of the expected values; the other axes exactly
FINE_AXES = ("row", "col")
FINE_COVER = 0.9


@dataclass(frozen=True)
class Entry:
    """One seeded bug: its failing case and control case (case-file dicts), the correct twin run
    beside it, ``--backward`` or not, the diagnosis it must get (tensor -> axis -> values; the
    tensors must be exactly these), axes allowed beside them (axis -> the values they may name),
    and a regex its summary must match."""

    fails: dict
    control: dict
    twin: str
    expect: dict
    summary: str
    allowed: dict = field(default_factory=dict)
    backward: bool = False


def _rows(a: int, b: int) -> list[int]:
    return list(range(a, b))


def _both(axes: dict) -> dict:
    return {"out": axes, "lse": axes}


D64 = {"dtype": "bfloat16", "d": 64, "dv": 64}
D128 = {"dtype": "bfloat16", "d": 128, "dv": 128}

CATALOGUE = {
    # batch 0 reads its own K/V; batches 1 and 2 read their predecessor's
    "batch_offset": Entry(
        fails={**D64, "batch": 3, "seqlen_q": 64, "seqlen_k": 64},
        control={**D64, "batch": 1, "seqlen_q": 64, "seqlen_k": 64},
        twin="online",
        expect=_both({"batch": [1, 2]}),
        summary=r"batches 1\.\.2 \(of 3\); batch 0 within",
    ),
    # 8 query heads in 4 groups of 2: the last group (heads 6, 7) reads kv head 0 instead of 3
    "gqa_last_group": Entry(
        fails={**D64, "heads_q": 8, "heads_kv": 4, "seqlen_q": 64, "seqlen_k": 64},
        control={**D64, "heads_q": 2, "heads_kv": 2, "seqlen_q": 64, "seqlen_k": 64},
        twin="gqa_correct",
        expect=_both({"head": [6, 7], "kv_head": [3]}),
        summary=r"kv head 3 \(heads 6\.\.7\b",
    ),
    # causal 256 x 300: keys 256..299 are the partial tile; row i sees keys <= i + 44, so rows
    # 212..255 (all in the full row tile 1) see them
    "last_key_tile_dropped": Entry(
        fails={**D128, "heads_q": 1, "heads_kv": 1, "seqlen_q": 256, "seqlen_k": 300, "causal": True},
        control={**D128, "heads_q": 1, "heads_kv": 1, "seqlen_q": 256, "seqlen_k": 256, "causal": True},
        twin="tiled",
        expect=_both({"row": _rows(212, 256)}),
        allowed=_both({"row_tile": [1]}),
        summary=r"rows 21\d\.\.255",
    ),
    # causal 384 x 384 in 128 x 128 tiles: row tiles 1 and 2 see their diagonal block twice
    "diagonal_tile_twice": Entry(
        fails={**D128, "heads_q": 1, "heads_kv": 1, "seqlen_q": 384, "seqlen_k": 384, "causal": True},
        control={**D128, "heads_q": 1, "heads_kv": 1, "seqlen_q": 384, "seqlen_k": 384},
        twin="tiled",
        expect=_both({"row_tile": [1, 2]}),
        allowed=_both({"row": _rows(128, 384)}),
        summary=r"row tiles 1\.\.2 \(.*\bof 3\b",
    ),
    # 16 x 160 at d 64 (backward tile_n 128): keys 128..159 are the partial tile
    "bwd_last_key_tile_dropped": Entry(
        fails={**D64, "heads_q": 1, "heads_kv": 1, "seqlen_q": 16, "seqlen_k": 160},
        control={**D64, "heads_q": 1, "heads_kv": 1, "seqlen_q": 16, "seqlen_k": 128},
        twin="backward_clean",
        expect={
            t: {"col": _rows(128, 160), "col_tile": [1], "mask_region": ["last partial key tile"]} for t in ("dk", "dv")
        },
        summary=r"last partial key tile \(keys 128\.\.159\)",
        backward=True,
    ),
    # d 80: dQ columns 64..79 doubled; d 64 (a multiple of 32) is right
    "dq_unaligned_dim": Entry(
        fails={**D64, "d": 80, "dv": 80, "heads_q": 1, "heads_kv": 1, "seqlen_q": 16, "seqlen_k": 16},
        control={**D64, "heads_q": 1, "heads_kv": 1, "seqlen_q": 16, "seqlen_k": 16},
        twin="backward_clean",
        expect={"dq": {"dim": _rows(64, 80)}},
        summary=r"dims 64\.\.79",
        backward=True,
    ),
    # 2 splits, causal: sequence 0 (4 blocks) drops keys 256..511, sequence 1 (3 blocks) keys
    # 256..383; the rows that see them are rows 256.. of each: row tiles 2 and 3
    "varlen_split_dropped": Entry(
        fails={
            **D128,
            "heads_q": 1,
            "heads_kv": 1,
            "seqlens": [[512, 512], [384, 384]],
            "causal": True,
            "num_splits": 2,
        },
        control={**D128, "heads_q": 1, "heads_kv": 1, "seqlens": [[512, 512], [384, 384]], "causal": True},
        twin="split_varlen",
        expect=_both({"row_tile": [2, 3]}),
        allowed=_both({"row": _rows(256, 512)}),
        summary=r"row tiles 2\.\.3 \(.*\bof 4\b",
    ),
    # three sequences of 200 rows (row tiles of 128): sequences 1 and 2 get wrong rows 0..127
    "varlen_first_tile_shifted": Entry(
        fails={**D128, "heads_q": 1, "heads_kv": 1, "seqlens": [[200, 200], [200, 200], [200, 200]]},
        control={**D128, "heads_q": 1, "heads_kv": 1, "seqlens": [[200, 200]]},
        twin="varlen_clean",
        expect=_both({"batch": [1, 2], "row_tile": [0]}),
        allowed=_both({"row": _rows(0, 128), "mask_region": ["full tiles"]}),
        summary=r"sequences 1\.\.2 \(of 3\)",
    ),
}

#: entries the fast tier runs (each a few seconds); the others are in the slow tier
FAST = {"batch_offset", "gqa_last_group", "diagonal_tile_twice", "dq_unaligned_dim"}


def _audit(tmp_path: Path, monkeypatch, cases: list[dict], kernels: list[str], *, backward: bool) -> dict[str, dict]:
    """``fa4-audit run`` of ``kernels`` (names in tests/localizable_kernels.py, or built-ins) on
    ``cases`` in one run (shared inputs and references): kernel -> its report."""
    monkeypatch.chdir(ROOT)  # tests.localizable_kernels resolves as module:attr
    path = tmp_path / "cases.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in cases))
    specs = [k if "-" in k else f"{MODULE}:{k}" for k in kernels]
    argv = ["run", "--quiet", "--no-isolate", "--case-file", str(path), "--out", str(tmp_path / "out")]
    argv += [a for s in specs for a in ("--kernel", s)] + (["--backward"] if backward else [])
    assert cli.main(argv) in (0, 1)  # judged: not a usage error
    if len(specs) == 1:
        return {kernels[0]: json.loads((tmp_path / "out" / "report.json").read_text())}
    return {
        k: json.loads((tmp_path / "out" / s.replace(":", ".") / "report.json").read_text())
        for k, s in zip(kernels, specs)
    }


def _check_axis(bug: str, tensor: str, axis: str, got: list, want: list) -> None:
    where = f"{bug}: {tensor} axis {axis}"
    if axis in FINE_AXES:
        assert set(got) <= set(want), f"{where} names {sorted(set(got) - set(want))} outside {want[0]}..{want[-1]}"
        assert len(got) >= FINE_COVER * len(want), f"{where} names {len(got)} of the {len(want)} expected values"
    else:
        assert got == want, f"{where}: {got}, expected {want}"


def test_every_localizable_bug_has_an_entry():
    from tests import localizable_kernels

    assert set(CATALOGUE) == set(LOCALIZABLE)
    for bug, (what, _where) in LOCALIZABLE.items():
        doc = " ".join(getattr(localizable_kernels, bug).__doc__.split())
        assert doc.lower().startswith(what.split(":")[0].lower()), (
            f"{bug}: the docstring does not say its bug: {doc[:80]}"
        )
        assert "Diagnosis:" in doc  # where its diagnosis must point
    assert {e.twin for e in CATALOGUE.values()} <= set(CLEAN)


@pytest.mark.parametrize("bug", [b if b in FAST else pytest.param(b, marks=pytest.mark.slow) for b in CATALOGUE])
def test_diagnosis_names_the_bugs_axis(tmp_path, monkeypatch, bug):
    """The bug's case fails with a diagnosis of exactly the expected tensors, each concentrated
    on the expected axes and values (and no other axis but those the values also sit on), its
    summary saying them; the control case and the correct twin pass with no diagnosis."""
    e = CATALOGUE[bug]
    reports = _audit(tmp_path, monkeypatch, [e.fails, e.control], [bug, e.twin], backward=e.backward)
    failing, control = reports[bug]["cases"]
    assert failing["verdict"] == "fail", f"{bug}: {failing['case']} is {failing['verdict']}"
    diag = {t: d for t, d in failing["diagnosis"].items() if t not in CAUSE_KEYS}  # its causes: tests/test_causes_*.py
    assert set(diag) == set(e.expect), f"{bug}: diagnosed tensors {sorted(diag)}, expected {sorted(e.expect)}"
    for tensor, axes in e.expect.items():
        got = {a: v["values"] for a, v in diag[tensor]["axes"].items()}
        extra = set(got) - set(axes) - set(e.allowed.get(tensor, {}))
        assert not extra, f"{bug}: {tensor} concentrates on axes {sorted(extra)} besides {sorted(axes)}: {got}"
        for axis, want in axes.items():
            assert axis in got, f"{bug}: {tensor} has no concentration on {axis}: {diag[tensor]}"
            _check_axis(bug, tensor, axis, got[axis], want)
        for axis, may in e.allowed.get(tensor, {}).items():
            # an axis the bug's values also sit on (the row tile holding the bad rows): if named, within them
            assert set(got.get(axis, [])) <= set(may), f"{bug}: {tensor} axis {axis} names {got[axis]} outside {may}"
        assert re.search(e.summary, diag[tensor]["summary"]), f"{bug}: {tensor} summary {diag[tensor]['summary']!r}"
        assert diag[tensor]["violations"] > 0 and diag[tensor]["criteria"]
    assert control["verdict"] == "pass" and not control.get("diagnosis"), f"{bug}: the control case {control}"
    twin = reports[e.twin]["cases"]
    assert [c["verdict"] for c in twin] == ["pass", "pass"], f"{e.twin}: {[c.get('reasons') for c in twin]}"
    assert not any(c.get("diagnosis") for c in twin)


@pytest.mark.slow
def test_the_model_passes_the_forward_catalogue_undiagnosed(tmp_path, monkeypatch):
    """fa4-model (production's SM100 numerics, held to the FA4 bound) on every forward case of
    the catalogue: every case passes, no diagnosis anywhere."""
    cases = [c for e in CATALOGUE.values() if not e.backward for c in (e.fails, e.control)]
    cases = list({case_from_dict(c).name: c for c in cases}.values())  # a run audits a case once
    rep = _audit(tmp_path, monkeypatch, cases, ["fa4-model"], backward=False)["fa4-model"]
    assert [c["verdict"] for c in rep["cases"]] == ["pass"] * len(cases), [c.get("reasons") for c in rep["cases"]]
    assert not any(c.get("diagnosis") for c in rep["cases"])


def test_scattered_noise_is_diagnosed_nowhere(tmp_path, monkeypatch):
    """A kernel that fails by scattered noise (2 % of the outputs moved by 1.0, uniformly) fails
    with a diagnosis that counts its violations and names no axis: the concentration test
    (audits.verdict.diagnosis) sees no pattern in noise, on a batch of 3 and on GQA heads."""
    cases = [CATALOGUE["batch_offset"].fails, CATALOGUE["gqa_last_group"].fails]
    rep = _audit(tmp_path, monkeypatch, cases, ["scattered_noise"], backward=False)["scattered_noise"]
    for c in rep["cases"]:
        assert c["verdict"] == "fail"
        assert set(c["diagnosis"]) - set(CAUSE_KEYS) == {"out"}, c["diagnosis"]  # the LSE is right
        assert not c["diagnosis"].get("causes"), c["diagnosis"]["causes"]  # noise has no cause
        out = c["diagnosis"]["out"]
        assert out["axes"] == {}, f"{c['case']}: noise read as a pattern: {out['axes']}"
        assert 0.01 < out["violations"] / out["elements"] < 0.03  # the 2 % it moved
        assert "spread over every" in out["summary"]
