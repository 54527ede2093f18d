"""Per-case diagnosis (audits.verdict.diagnosis, docs/diagnosis.md): the concentration test on
synthetic violation masks (one batch, one GQA group, head-dim columns, the last partial row tile,
and uniform noise that must stay unlocalized), the varlen mapping of tokens to sequences and
rows, the error-map file's round trip, and ``fa4-audit run`` end to end on seeded bugs."""

import json
from pathlib import Path

import pytest
import torch

from audits import cli
from audits.suites.cases import Case
from audits.verdict import diagnosis as dg
from audits.verdict.vocabulary import CAUSE_KEYS

ROOT = Path(__file__).parents[1]


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.restricted_kernels resolves as module:attr


def _mask(case: Case, *, d: int | None = None) -> torch.Tensor:
    """An empty out-shaped violation mask (B, L, H, D) of ``case``."""
    return torch.zeros(case.batch, case.seqlen_q, case.heads_q, d or case.dv, dtype=torch.bool)


def _local(case: Case, mask: torch.Tensor, *, tile: int = 128, tensor: str = "out") -> dict:
    return dg.localize(tensor=tensor, mask=mask, layout=dg.layout_of(case=case, level="row", tile=tile))


def test_one_batch_is_named_and_the_clean_one_said():
    """The issue's batch-offset bug: every violation in batch 1 of 2."""
    case = Case(batch=2, heads_q=2, heads_kv=2, seqlen_q=256, seqlen_k=256, d=64, dv=64)
    g = torch.Generator().manual_seed(2)
    m = _mask(case)
    m[1] = torch.rand(m[1].shape, generator=g) < 0.3
    got = _local(case, m)
    assert set(got["axes"]) == {"batch"}
    assert got["axes"]["batch"] == {"values": [1], "share_of_violations": 1.0, "share_of_elements": 0.5, "of": 2}
    assert got["summary"].startswith(f"all {int(m.sum()):,} out violations in batch 1 (of 2)")
    assert got["summary"].endswith("; batch 0 within bound")


def test_a_gqa_group_is_one_kv_head_and_its_heads_are_not_repeated():
    """Heads 4..7 are kv head 1's group (8 query heads, 2 kv heads): the summary names the kv head
    and puts its heads in its parentheses, once."""
    case = Case(batch=1, heads_q=8, heads_kv=2, seqlen_q=128, seqlen_k=128, d=64, dv=64)
    m = _mask(case)
    m[:, :, 4:, :] = True
    got = _local(case, m)
    assert got["axes"]["kv_head"]["values"] == [1] and got["axes"]["head"]["values"] == [4, 5, 6, 7]
    assert got["summary"] == "all 32,768 out violations in kv head 1 (heads 4..7; of 2); kv head 0 within bound"


def test_a_head_and_a_dim_are_two_facts():
    """Head 0 and dim 0 have the same index, not the same elements: both stay in the sentence."""
    case = Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=128, seqlen_k=128, d=64, dv=64)
    m = _mask(case)
    m[:, :, 0, 0] = True
    got = _local(case, m)
    assert got["axes"]["head"]["values"] == [0] and got["axes"]["dim"]["values"] == [0]
    assert got["summary"] == "all 128 out violations in dim 0 (of 0..63) and head 0 (of 2); dims 1..63 within bound"


def test_head_dim_columns_from_16_on():
    """dQ wrong only at head-dim columns >= 16 of 80 (80% of the elements: still a concentration,
    ``MAX_SHARE_OF_ELEMENTS`` 0.9), sparse within them."""
    case = Case(batch=2, heads_q=2, heads_kv=1, seqlen_q=128, seqlen_k=128, d=80, dv=80)
    m = _mask(case)
    g = torch.Generator().manual_seed(1)
    m[..., 16:] = torch.rand(m[..., 16:].shape, generator=g) < 0.05
    got = _local(case, m, tensor="dq")
    assert got["axes"]["dim"]["values"] == list(range(16, 80)) and got["axes"]["dim"]["share_of_elements"] == 0.8
    assert set(got["axes"]) == {"dim"}
    assert got["summary"].startswith(f"all {int(m.sum()):,} dq violations in dims 16..79 (of 0..79)")


def test_rows_of_the_last_partial_tile_read_as_that_region():
    """seqlen 200 with 128-row tiles: rows 128..199 are the last, partial row tile.  Row, row tile
    and mask region all hold them; the summary says it once, by the region's name."""
    case = Case(batch=1, heads_q=2, heads_kv=2, seqlen_q=200, seqlen_k=200, d=64, dv=64)
    m = _mask(case)
    m[:, 128:] = True
    got = _local(case, m, tile=128)
    assert got["axes"]["row"]["values"] == list(range(128, 200))
    assert got["axes"]["row_tile"]["values"] == [1]
    assert got["axes"]["mask_region"]["values"] == ["last partial row tile"]
    assert (
        got["summary"]
        == "all 9,216 out violations in the last partial row tile (rows 128..199); full tiles within bound"
    )


@pytest.mark.parametrize("density", [0.05, 0.5])
def test_uniform_noise_has_no_concentrated_axis(density):
    """A correct but imprecise kernel: violations spread uniformly at random over every element.
    No axis may claim them (the false patterns a report must not show)."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=256, seqlen_k=256, d=64, dv=64)
    g = torch.Generator().manual_seed(0)
    m = torch.rand(_mask(case).shape, generator=g) < density
    got = _local(case, m)
    assert got["axes"] == {}
    assert "spread over every batch, head, kv head, row, row tile and dim" in got["summary"]


def test_sparse_noise_is_not_a_pattern_but_a_sparse_bug_is():
    """20 violations at random elements touch at most 20 of 256 rows: a set chosen after the fact,
    which the union bound over C(256, k) row sets rejects.  20 violations all in batch 1 of 2 are
    2**-20 x C(2, 1) x 2**2 = 7.6e-6 likely by chance: not enough (``MAX_CHANCE`` 1e-6); 30 are
    7.5e-9: localized."""
    case = Case(batch=2, heads_q=2, heads_kv=2, seqlen_q=256, seqlen_k=256, d=64, dv=64)
    g = torch.Generator().manual_seed(3)
    m = _mask(case)
    m.view(-1)[torch.randperm(m.numel(), generator=g)[:20]] = True
    assert _local(case, m)["axes"] == {}
    m = _mask(case)
    m[1].view(-1)[torch.randperm(m[1].numel(), generator=g)[:20]] = True
    assert _local(case, m)["axes"] == {}
    m[1].view(-1)[torch.randperm(m[1].numel(), generator=g)[:10]] = True
    m[1].view(-1)[torch.randperm(m[1].numel(), generator=g)[:10]] = True  # 30 or more, some may coincide
    assert int(m.sum()) >= 30 and _local(case, m)["axes"]["batch"]["values"] == [1]


def test_concentration_thresholds():
    """The three conditions one at a time: too few violations to tell from chance (5 in one of two
    equal batches: 2 x 2**-5), more than 90% of the elements, less than 99% of the violations."""
    assert dg.concentration(violations=[0, 5], elements=[100, 100]) is None
    assert dg.concentration(violations=[0, 40], elements=[100, 100]).index == (1,)
    assert dg.concentration(violations=[0] + [90] * 19, elements=[100] * 20) is None  # 95% of the elements
    assert dg.concentration(violations=[0, 0] + [90] * 18, elements=[100] * 20).index == tuple(range(2, 20))
    c = dg.concentration(violations=[2, 98, 0, 0], elements=[100] * 4)  # 98%: under the 99% of (1)
    assert c is not None and c.index == (0, 1)  # then every violating value is the set
    assert dg.concentration(violations=[1, 1000], elements=[100, 100]).index == (1,)  # 99.9%
    assert dg.concentration(violations=[3, 0], elements=[0, 100]) is None  # one value with elements


def test_a_span_of_rows_is_one_of_few_intervals():
    """44 violations in rows 212..255 of 256 (one per row, an LSE): as a set of 44 rows, one of
    C(256, 44) = 6.8e49, p**V = 0.17**44 does not beat chance; as one run, one of 32,896 intervals,
    it does.  The same 44 rows scattered (44 runs) stay unlocalized."""
    viol = [0] * 212 + [1] * 44
    assert dg.concentration(violations=viol, elements=[1] * 256, ordered=True).index == tuple(range(212, 256))
    assert dg.concentration(violations=viol, elements=[1] * 256) is None
    scattered = [1 if i % 5 == 0 and i < 220 else 0 for i in range(256)]
    assert dg.concentration(violations=scattered, elements=[1] * 256, ordered=True) is None


def test_ordered_axes_close_the_gaps_of_violating_values():
    """Rows with a few violations between rows with many (just under the 99% cut) are taken into
    the span on an ordered axis, never rows without any."""
    viol = [0] * 10 + [50, 1, 50, 50, 0, 50] + [0] * 10
    c = dg.concentration(violations=[v * 100 for v in viol], elements=[1000] * len(viol), ordered=True)
    assert c.index == (10, 11, 12, 13, 15) and c.share_of_violations == 1.0
    # a stray violation in every other row: "every violating row" is all of them; the densest rows
    # reach 99% without row 45, which lies inside their span and joins them
    viol = [1] * 40 + [1000] * 5 + [5] + [1000] * 14 + [1] * 40
    c = dg.concentration(violations=viol, elements=[1000] * 100, ordered=True)
    assert c.index == tuple(range(40, 60))
    c = dg.concentration(violations=viol, elements=[1000] * 100)  # unordered (heads, batches): no span
    assert c.index == (*range(40, 45), *range(46, 60))


def test_varlen_tokens_map_to_their_sequence_and_row():
    """Packed queries: batch = the sequence (cu_seqlens), row within it; a sequence with no query
    has no value; one with no key is all "no visible key"; tiles restart with each sequence."""
    case = Case(batch=4, heads_q=2, heads_kv=1, seqlen_q=100, seqlen_k=100, d=64, dv=64,
                seqlens=((100, 100), (60, 80), (0, 5), (30, 0)), causal=True)  # fmt: skip
    lay = dg.layout_of(case=case, level="row", tile=64)
    assert lay.batch.tolist() == [[0] * 100 + [1] * 60 + [3] * 30]
    assert lay.pos.tolist() == [list(range(100)) + list(range(60)) + list(range(30))]
    words = [dg.MASK_REGIONS[i] for i in lay.region[0].tolist()]
    assert words[:64] == ["full tiles"] * 64 and words[64:100] == ["last partial row tile"] * 36
    assert words[100:160] == ["last partial row tile"] * 60  # 60 rows: its one 64-row tile is partial
    assert words[160:] == ["no visible key"] * 30
    m = torch.zeros(1, 190, 2, 64, dtype=torch.bool)
    m[0, 110:120] = True  # sequence 1, rows 10..19
    got = dg.localize(tensor="out", mask=m, layout=lay)
    assert got["axes"]["batch"]["values"] == [1] and got["axes"]["batch"]["of"] == 3
    assert got["axes"]["row"]["values"] == list(range(10, 20))
    assert got["summary"].startswith("all 1,280 out violations in ") and "sequence 1 (of 3)" in got["summary"]


def test_key_level_regions_and_tiles():
    """dK / dV are placed by key: keys no query sees (a window's left edge with more keys than
    queries), the last partial key tile, full tiles; a GQA kv head is its own head axis."""
    case = Case(batch=1, heads_q=4, heads_kv=2, seqlen_q=64, seqlen_k=160, window=(20, 0), d=64, dv=64)
    lay = dg.layout_of(case=case, level="key", tile=128)
    words = [dg.MASK_REGIONS[i] for i in lay.region[0].tolist()]
    assert words == ["unseen key"] * 76 + ["full tiles"] * 52 + ["last partial key tile"] * 32
    m = torch.zeros(1, 160, 2, 64, dtype=torch.bool)
    m[0, :76, 1] = True
    got = dg.localize(tensor="dk", mask=m, layout=lay)
    assert got["axes"]["mask_region"]["values"] == ["unseen key"] and got["axes"]["kv_head"]["values"] == [1]
    assert "head" not in got["axes"] and got["axes"]["col"]["values"] == list(range(76))
    assert got["summary"].startswith("all 4,864 dk violations in unseen keys (keys 0..75)")


def test_error_map_round_trip_and_pooling(tmp_path):
    """save_map / load_map keep the meta JSON and the float32 panels (inf included); a panel
    larger than 256 is max-pooled by integer steps, its maximum kept."""
    x = torch.zeros(600, 80)
    x[599, 79] = 7.0
    pooled, rs, cs = dg._pool(x)
    assert (rs, cs) == (3, 1) and tuple(pooled.shape) == (200, 80) and float(pooled.max()) == 7.0
    meta = {"case": "c", "config": {}, "tile_m": 128, "tile_n": 128, "panels": [], "omitted_panels": 0}
    arr = torch.tensor([[1.0, float("inf")], [0.5, 2.0]]).numpy()
    path = dg.save_map(tmp_path / "maps" / "c.npz", error_map=dg.ErrorMap(meta, {"out_b0_h0": arr}))
    back = dg.load_map(path)
    assert back.meta == meta and back.arrays["out_b0_h0"].dtype.name == "float32"
    assert back.arrays["out_b0_h0"].tolist() == arr.tolist()


def _run(*argv) -> int:
    return cli.main(["run", "--quiet", "--no-isolate", "--maps", "0", *argv])


def _cases(path: Path) -> dict:
    return {c["case"]: c for c in json.loads((path / "report.json").read_text())["cases"]}


def test_run_localizes_the_batch_offset_bug_and_keeps_it_on_resume(tmp_path):
    """tests/restricted_kernels.py's batch_offset (batch index >= 1 reads the previous sequence's
    rows) and its correct twin on the same case: the failing case's diagnosis names batch 1, its
    error map lies at the path the record gives, with panels of batch 1 only; the passing case has
    neither.  ``--resume`` keeps both from the journal."""
    cfg = json.dumps({"dtype": "float16", "d": 64, "dv": 64, "batch": 2, "heads_q": 2, "heads_kv": 1,
                      "seqlen_q": 128, "seqlen_k": 128})  # fmt: skip
    kernels = ["--kernel", "tests.restricted_kernels:batch_offset", "--kernel", "tests.restricted_kernels:attention"]
    assert _run(*kernels, "--config", cfg, "--out", str(tmp_path)) == 1
    bad_dir, good_dir = (
        tmp_path / "tests.restricted_kernels.batch_offset",
        tmp_path / "tests.restricted_kernels.attention",
    )
    (bad,), (good,) = _cases(bad_dir).values(), _cases(good_dir).values()
    assert bad["verdict"] == "fail" and good["verdict"] == "pass"
    assert set(bad["diagnosis"]) - set(CAUSE_KEYS) == {"out", "lse"}
    for t in ("out", "lse"):
        assert bad["diagnosis"][t]["axes"]["batch"]["values"] == [1]
        assert "bound" in bad["diagnosis"][t]["criteria"]
    assert bad["diagnosis"]["out"]["violations"] == bad["bound"]["violations"]  # the bound is the whole union here
    assert bad["diagnosis"]["out"]["summary"].endswith("in batch 1 (of 2); batch 0 within bound")
    assert "diagnosis" not in good and "error_map" not in good
    assert bad["error_map"] == f"maps/{bad['case']}.npz"
    emap = dg.load_map(bad_dir / bad["error_map"])
    assert emap.meta["case"] == bad["case"] and emap.meta["tile_m"] == 192  # SM90's forward tile at d 64
    assert {p["batch"] for p in emap.meta["panels"]} == {1}
    assert {p["tensor"] for p in emap.meta["panels"]} == {"out", "lse"}
    for p in emap.meta["panels"]:
        assert emap.arrays[p["key"]].shape == (p["rows"], p["cols"]) and p["max_ratio"] > 1
    assert _run(*kernels, "--config", cfg, "--out", str(tmp_path), "--resume") == 1
    (again,) = _cases(bad_dir).values()
    assert again["resumed"] and again["diagnosis"] == bad["diagnosis"] and again["error_map"] == bad["error_map"]


def test_run_backward_localizes_gradient_columns_and_unseen_keys(tmp_path):
    """Seeded backward bugs of tests/bugged_backward.py on one windowed case (64 queries, 160 keys,
    window (20, 0): row i sees keys i + 76 .. i + 96, keys 0..75 none): dV columns past 64 of 80
    dropped (FA's criterion fails on dims 64..79 only, and nothing else); the backward ignoring the
    window's left edge, so keys no query sees get non-zero dK and dV (the exact-zero rule, counted
    as "zeros", the violations in keys from 0 on)."""
    cfg = {"dtype": "bfloat16", "d": 80, "dv": 80, "batch": 1, "heads_q": 2, "heads_kv": 1, "seqlen_q": 64,
           "seqlen_k": 160, "window": [20, 0]}  # fmt: skip
    bugs = ["dv_unaligned_cols", "window_left_leak"]
    kernels = [a for b in bugs for a in ("--kernel", f"tests.bugged_backward:bug_{b}")]
    assert _run("--backward", *kernels, "--config", json.dumps(cfg), "--out", str(tmp_path)) == 1
    (c,) = _cases(tmp_path / "tests.bugged_backward.bug_dv_unaligned_cols").values()
    assert set(c["diagnosis"]) - set(CAUSE_KEYS) == {"dv"} and c["diagnosis"]["dv"]["criteria"].keys() == {
        "fa_criterion"
    }
    assert c["diagnosis"]["dv"]["axes"]["dim"]["values"] == list(range(64, 80))
    summary = c["diagnosis"]["dv"]["summary"]
    assert summary.startswith("all 1,190 dv violations in dims 64..79 (of 0..79) and keys some query sees (keys 76..")
    assert summary.endswith("; dims 0..63 within bound")
    leak = tmp_path / "tests.bugged_backward.bug_window_left_leak"
    (c,) = _cases(leak).values()
    dk = c["diagnosis"]["dk"]
    assert dk["criteria"]["zeros"] == c["backward"]["zeros"]["dk_unseen_nonzero"] > 0
    assert dk["axes"]["col"]["values"][0] == 0 and "keys 0.." in dk["summary"]
    panels = dg.load_map(leak / c["error_map"]).meta["panels"]
    assert {p["row_axis"] for p in panels if p["tensor"] in ("dk", "dv")} == {"col"}
    assert {(p["tile_m"], p["tile_n"]) for p in panels if p["tensor"] != "out"} == {(64, 128)}  # SM90 bwd at d 80


@pytest.mark.slow  # two job processes, each importing torch: ~20 s CPU
def test_jobs_bring_their_error_maps_beside_the_parents_report(tmp_path):
    """``run --jobs 2``: each job writes its failing case's map under OUT/jobs/I/maps/; the parent's
    report names ``maps/<case>.npz`` relative to OUT, so the parent copies them there."""
    cfgs = [{"dtype": "float16", "d": 64, "dv": 64, "batch": 2, "heads_q": 2, "heads_kv": 1, "seqlen_q": 128,
             "seqlen_k": 128}, {"dtype": "float16", "d": 128, "dv": 128, "batch": 3, "heads_q": 2, "heads_kv": 2,
             "seqlen_q": 128, "seqlen_k": 128, "causal": True}]  # fmt: skip
    args = [a for c in cfgs for a in ("--config", json.dumps(c))]
    assert _run("--jobs", "2", "--kernel", "tests.restricted_kernels:batch_offset", *args, "--out", str(tmp_path)) == 1
    cases = _cases(tmp_path)
    assert len(cases) == 2
    for c in cases.values():
        assert c["diagnosis"]["out"]["axes"]["batch"]["values"] == ([1] if c["config"]["batch"] == 2 else [1, 2])
        assert dg.load_map(tmp_path / c["error_map"]).meta["case"] == c["case"]


def test_full_tiles_yield_to_the_row_tile_they_are():
    """Sequences 1 and 2 of three 200-row sequences wrong in their first 128-row tile: row tile 0,
    its rows and the "full tiles" region cover the same tokens; the sentence says the row tile."""
    case = Case(batch=3, heads_q=1, heads_kv=1, seqlen_q=200, seqlen_k=200, d=128, dv=128, seqlens=((200, 200),) * 3)
    m = torch.zeros(1, 600, 1, 128, dtype=torch.bool)
    m[0, 200:328] = m[0, 400:528] = True
    got = dg.localize(tensor="out", mask=m, layout=dg.layout_of(case=case, level="row", tile=128))
    assert got["axes"]["mask_region"]["values"] == ["full tiles"] and got["axes"]["row_tile"]["values"] == [0]
    assert got["summary"] == (
        "all 32,768 out violations in row tile 0 (rows 0..127; of 2, tile_m 128) and sequences 1..2 (of 3); "
        "row tile 1 within bound"
    )
