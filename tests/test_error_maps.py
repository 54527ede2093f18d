"""Error maps (``audits.report.maps``): the figure says where |error| / bound passes 1, on
the right rows, in the right colours, beside the right mask; the worst N failing cases get one
in report.html and as PNG/SVG files; ``fa4-audit show --case --plot`` renders one; and the page
shows it in a real browser (headless Chromium, ``browser`` marker)."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from audits import cli
from audits.report import maps as error_maps
from audits.report.maps import html_figures, render, visibility, write_maps
from audits.suites.cases import Case, varlen_case
from numerics.call import AttentionCall
from numerics.reference import visible_mask

CHROMIUM = Path("/usr/bin/chromium")


def make_map(path: Path, *, case: Case, panels: list, tile_m: int = 128, tile_n: int = 128) -> Path:
    """An error-map file as the run saves it (docs/diagnosis.md, "Error maps"; the interface in
    ``audits.verdict.diagnosis.save_map``): ``panels`` are (tensor, batch, head, full ratio array),
    max-pooled here by integer steps to at most 256 x 256."""
    arrays, meta = {}, []
    for tensor, b, h, full in panels:
        n_rows, n_cols = full.shape
        s, t = -(-n_rows // 256), -(-n_cols // 256)
        pad = np.full((-(-n_rows // s) * s, -(-n_cols // t) * t), -np.inf)
        pad[:n_rows, :n_cols] = full
        pooled = pad.reshape(pad.shape[0] // s, s, pad.shape[1] // t, t).max(axis=(1, 3)).astype(np.float32)
        key = f"{tensor}_b{b}_h{h}"
        arrays[key] = pooled
        meta.append({
            "key": key, "tensor": tensor, "batch": b, "head": h, "rows": pooled.shape[0], "cols": pooled.shape[1],
            "row_step": s, "col_step": t, "row_axis": "col" if tensor in ("dk", "dv") else "row", "n_rows": n_rows,
            "n_cols": n_cols, "max_ratio": float(full.max()), "violations": int((~(full <= 1)).sum()),
        })  # fmt: skip
    doc = {"case": case.name, "config": case.as_dict(), "tile_m": tile_m, "tile_n": tile_n, "panels": meta,
           "omitted_panels": 0}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, meta=np.array(json.dumps(doc)), **arrays)
    return path


#: the smoke suite's GQA case: batch 2, causal, 200 x 300 (seqlen_k not a multiple of 128)
CASE = Case("bfloat16", 64, 64, 2, 4, 2, 200, 300, causal=True, family="normal")


def _batch1_rows(path: Path, *, worst: float = 1e3, inf: bool = True) -> Path:
    """A map of :data:`CASE` whose out violates from query row 150 on (the bound times ``worst``)
    and (``inf``) holds a block of infinities (rows 0-19, columns 0-9); dk violates from key 256 on."""
    rng = np.random.default_rng(0)
    out = rng.uniform(0.01, 0.3, (200, 64))
    out[150:] *= worst
    if inf:
        out[:20, :10] = np.inf
    dk = rng.uniform(0.01, 0.3, (300, 64))
    dk[256:] *= 20
    return make_map(path, case=CASE, panels=[("out", 1, 0, out), ("dk", 1, 1, dk)])


def _png(data: bytes) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(io.BytesIO(data), format="png")


def _pixel(img: np.ndarray, ax, fx: float, fy: float) -> np.ndarray:
    """The RGB of ``img`` at the point (fx, fy) of ``ax`` (fractions, y from the top)."""
    box = ax.get_window_extent()
    x = int(box.x0 + fx * box.width)
    y = int(img.shape[0] - (box.y1 - fy * box.height))
    return img[y, x, :3]


def _warm(rgb) -> bool:
    """Past the bound: yellow to dark red (#800026), red well above blue."""
    return rgb[0] > 0.45 and rgb[0] > rgb[2] + 0.3


def _blue(rgb) -> bool:
    return rgb[2] > rgb[0] + 0.15


def _magenta(rgb) -> bool:
    return rgb[0] > 0.9 and rgb[1] < 0.2 and rgb[2] > 0.9


@pytest.mark.parametrize(
    "sq,sk,causal,window",
    [(200, 300, True, (None, None)), (130, 70, True, (None, None)), (64, 64, False, (16, 4)),
     (100, 40, False, (None, 0)), (40, 100, True, (8, 3)), (50, 50, False, (None, None))],
)  # fmt: skip
def test_visibility_is_the_references_mask(sq, sk, causal, window):
    """The figure's mask is ``numerics.reference.visible_mask`` at the sampled points (the figure
    samples; the reference builds the full mask)."""
    want = visible_mask(sq, sk, causal=causal, window_size=window).numpy()
    rows, keys = np.arange(sq), np.arange(sk)
    got = visibility(rows=rows, keys=keys, seqlen_q=sq, seqlen_k=sk, causal=causal, window=window)
    assert (got == want).all()
    r, k = rows[::7], keys[3::5]
    assert (
        visibility(rows=r, keys=k, seqlen_q=sq, seqlen_k=sk, causal=causal, window=window) == want[np.ix_(r, k)]
    ).all()


def test_mask_marks_rows_with_no_key_and_keys_past_seqused_k():
    """Varlen sequence 1 of 30 rows and 40 keys, 25 used, causal: rows 0-4 see no key (bottom-right
    alignment: row i sees keys <= i - 5), keys 25-39 are unseen, the rest is the reference's mask."""
    case = varlen_case(seqlens=((16, 16), (30, 40)), seqused_k=(16, 25), causal=True, d=64, dv=64)
    cat, rows, keys, sq, sk, used = error_maps._mask_image(case.as_dict(), 1)
    assert (sq, sk, used) == (30, 40, 25)
    vis = visible_mask(30, 25, causal=True).numpy()
    assert (cat[:, 25:] == 2).all(), "keys past seqused_k"
    assert (cat[:5, :25] == 3).all(), "rows 0-4 see no key"
    assert ((cat[5:, :25] == 1) == vis[5:]).all() and (cat[5:, :25] != 3).all()


@pytest.mark.parametrize(
    "sq,sk,causal,window", [(130, 70, True, (None, None)), (64, 64, False, (None, -3)), (900, 700, False, (4, -1)),
                            (700, 900, True, (0, None)), (100, 100, False, (None, None))],
)  # fmt: skip
def test_rows_with_no_visible_key_are_the_references(sq, sk, causal, window):
    """Rows with no visible key are those of the reference's mask, also where the mask is sampled
    (over 512 keys) and a window narrower than the sampling step would hide a row's keys."""
    case = Case(seqlen_q=sq, seqlen_k=sk, causal=causal, window=window)
    cat, rows, *_ = error_maps._mask_image(case.as_dict(), 0)
    want = ~visible_mask(sq, sk, causal=causal, window_size=window).numpy().any(axis=1)
    assert ((cat == 3).all(axis=1) == want[rows]).all()


#: mod cases (docs/mods.md) whose mods hide what the flags show: a block-sparse prefix-LM (prefixes
#: 68 and 18: full, partial and skipped 128 x 128 blocks; the flags none); a document mask beside
#: causal=True;
#: a causal mask_mod at more queries than keys (rows 0-99 see no key, the flags hide none)
MOD_CASES = {
    "block_sparse": Case("bfloat16", 64, 64, 2, 4, 2, 256, 384, mask_mod="prefix_lm", block_sparse=(128, 128), seed=2),
    "document": Case("bfloat16", 64, 64, 2, 4, 2, 200, 300, causal=True, mask_mod="document", seed=3),
    "empty_rows": Case("float16", 64, 64, 1, 2, 2, 300, 200, mask_mod="causal"),
}


def _block_kind(blocks, case: Case, block_size: tuple, b: int) -> np.ndarray:
    """A (B|1, H|1, nq, nk) block mask at token level for batch b, head 0: (seqlen_q, seqlen_k)."""
    bq, bk = block_size
    m = blocks.expand(case.batch, case.heads_q, *blocks.shape[2:])[b, 0].numpy()
    return m[np.ix_(np.arange(case.seqlen_q) // bq, np.arange(case.seqlen_k) // bk)]


@pytest.mark.parametrize("name", sorted(MOD_CASES))
def test_the_mask_panel_draws_the_mods(name):
    """With mods the mask beside a panel is the reference's (``numerics.reference.call_visibility``:
    the flags and the mods, as ``audits.suites.inputs.make_inputs`` builds them for the run), block
    sparsity's partial blocks (kept and hidden keys) and skipped blocks told from full blocks, and
    rows the mods leave without a key marked; the figure's title and legend say so."""
    from audits.suites.inputs import make_inputs
    from numerics.reference import call_visibility

    case = MOD_CASES[name]
    kw = make_inputs(case)["kw"]
    bs = kw.get("block_sparse_tensors")
    call = AttentionCall(
        causal=case.causal,
        window_size=case.window,
        mask_mod=kw.get("mask_mod"),
        block_sparse_tensors=bs,
        aux_tensors=kw.get("aux_tensors"),
    )
    want = call_visibility(
        batch=case.batch, heads=case.heads_q, seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k, call=call
    )
    want = want.expand(case.batch, case.heads_q, case.seqlen_q, case.seqlen_k).numpy()
    flags = visible_mask(case.seqlen_q, case.seqlen_k, causal=case.causal, window_size=case.window).numpy()
    for b in range(case.batch):
        cat, rows, keys, *_ = error_maps._mask_image(case.as_dict(), b, (0,))
        assert (rows == np.arange(case.seqlen_q)).all() and (keys == np.arange(case.seqlen_k)).all()
        vis, empty = want[b, 0], ~want[b, 0].any(axis=1)
        assert ((cat == 3).all(axis=1) == empty).all(), f"{name}: rows with no visible key are the mods' too"
        cat, vis = cat[~empty], vis[~empty]
        if bs is None:
            assert ((cat == 1) == vis).all() and set(np.unique(cat)) <= {0, 1}, f"{name}: the mask is flags & mods"
        else:
            full, part = (_block_kind(m, case, bs.block_size, b)[~empty] for m in (bs.full, bs.partial))
            expect = np.where(full, np.where(vis, 1, 0), np.where(part, np.where(vis, 4, 5), 6))
            assert (cat == expect).all(), f"{name}: full, partial and skipped blocks drawn apart"
            assert {1, 4, 5, 6} <= set(np.unique(cat).tolist()), f"{name}: every block kind is in the case"
    # the mods hide keys the flags show: a mask of the flags alone would differ
    assert (want[:, 0] != flags).any()


def test_a_mod_case_figure_names_its_mods(tmp_path):
    """The mask panel's title names the mask_mod and the block size; the legend the block kinds."""
    case = MOD_CASES["block_sparse"]
    rng = np.random.default_rng(0)
    ratio = rng.uniform(0.01, 0.3, (case.seqlen_q, 64))
    ratio[128:] *= 50
    dk = rng.uniform(0.01, 0.3, (case.seqlen_k, 64))
    dk[:40] *= 50
    npz = make_map(tmp_path / "m.npz", case=case, panels=[("out", 1, 0, ratio), ("dk", 0, 1, dk)])
    svg = render(npz, fmt="svg").decode()
    for text in ("mask (mask_mod prefix_lm &amp; block-sparse 128x128)", "visible key, full block",
                 "visible key, partial block (mask_mod applied)", "masked key, partial block",
                 "skipped block (not visited)"):  # fmt: skip
        assert text in svg, text


def test_map_colours_violations_warm_within_bound_blue_inf_magenta(tmp_path):
    """In the PNG, the out panel is warm (past the bound) on rows 150-199 only, blue above, and
    magenta on the block of infinities; the dk panel is warm from key 256 on only."""
    fig = error_maps._figure(_batch1_rows(tmp_path / "m.npz"), tensor=None)
    img = _png(error_maps._save(fig, "png"))
    out_ax, dk_ax = fig.axes[0], fig.axes[2]
    assert out_ax.get_title().startswith("out, batch 1, head 0") and dk_ax.get_title().startswith("dk, batch 1, kv")
    assert _warm(_pixel(img, out_ax, 0.5, 0.9)) and _warm(_pixel(img, out_ax, 0.9, 0.99))
    assert _blue(_pixel(img, out_ax, 0.5, 0.5)) and _blue(_pixel(img, out_ax, 0.5, 0.7))
    assert _magenta(_pixel(img, out_ax, 0.05, 0.05))
    assert _warm(_pixel(img, dk_ax, 0.5, 0.95)) and _blue(_pixel(img, dk_ax, 0.5, 0.6))


def test_map_draws_tiles_mask_edges_and_labels(tmp_path):
    """The tile grid (ticks at 128 on the map; lines every tile on the mask), the causal diagonal,
    the violating rows over the mask, the axis labels and the colour bar's label, in the SVG's text."""
    npz = _batch1_rows(tmp_path / "m.npz")
    fig = error_maps._figure(npz, tensor=None)
    out_ax, mask_ax = fig.axes[0], fig.axes[1]
    assert list(out_ax.yaxis.get_minorticklocs()) == [128]
    assert sorted(round(ln.get_xdata()[0]) for ln in mask_ax.lines if len(set(ln.get_xdata())) == 1) == [128, 256]
    diagonal = [ln for ln in mask_ax.lines if ln.get_linestyle() == "--"]
    assert len(diagonal) == 1 and list(diagonal[0].get_xdata()) == [101.0, 301.0]  # key j > i + 100 hidden
    bands = [p for p in mask_ax.patches if p.get_hatch()]
    assert [(round(b.get_y()), round(b.get_y() + b.get_height())) for b in bands] == [(0, 20), (150, 200)]
    svg = render(npz, fmt="svg").decode()
    for text in ("query row (batch 1)", "key (batch 1)", "head-dim column", "1 (bound)", "|error| / bound",
                 "mask (causal)", "3,400 violations", "128-row tiles", CASE.name):  # fmt: skip
        assert text in svg, text


def test_render_one_tensor_and_refuses_a_missing_one(tmp_path):
    npz = _batch1_rows(tmp_path / "m.npz")
    assert "dk, batch 1" in render(npz, fmt="svg", tensor="dk").decode()
    assert "out, batch 1" not in render(npz, fmt="svg", tensor="dk").decode()
    with pytest.raises(ValueError, match="no panel of tensor 'dq'; the map has dk, out"):
        render(npz, tensor="dq")
    with pytest.raises(ValueError, match="format 'jpg'"):
        render(npz, fmt="jpg")


def test_tall_panels_keep_a_one_row_violation_visible(tmp_path):
    """4096 rows with only each tile's first row past the bound: pooled twice (to 256, then to the
    panel's height) by max, every 128-row tile still shows its violation."""
    rng = np.random.default_rng(1)
    dq = rng.uniform(0.01, 0.3, (4096, 128))
    dq[::128] = 5.0
    case = Case("bfloat16", 128, 128, 1, 2, 2, 4096, 4096, family="flat")
    fig = error_maps._figure(make_map(tmp_path / "t.npz", case=case, panels=[("dq", 0, 0, dq)]), tensor=None)
    img = _png(error_maps._save(fig, "png"))
    ax = fig.axes[0]
    hits = [_warm(_pixel(img, ax, 0.5, (t * 128 + 16) / 4096)) for t in range(32)]  # mid of a 32-row pixel
    assert all(hits), hits
    assert "a cell: max of 32 rows x 1 columns" in ax.get_xlabel()


def _report(tmp_path: Path) -> dict:
    """A report of four cases: three failing with maps (worst 1e3, 1e5, 10 x bound), one passing."""
    recs = []
    for seed, worst in ((0, 1e3), (1, 1e5), (2, 10.0)):
        c = Case(**{**CASE.as_dict(), "seed": seed})
        _batch1_rows(tmp_path / "maps" / f"{c.name}.npz", worst=worst, inf=False)
        recs.append({"case": c.name, "verdict": "fail", "error_map": f"maps/{c.name}.npz",
                     "diagnosis": {"out": {"summary": "all 3,200 violations in batch 1 (of 2)"}}})  # fmt: skip
    recs.append({"case": "passing", "verdict": "pass"})
    return {"cases": recs}


def test_write_maps_renders_the_worst_and_html_inlines_them(tmp_path):
    rep = _report(tmp_path)
    names = [r["case"] for r in rep["cases"]]
    written = write_maps(rep, tmp_path, worst=2)
    assert sorted(p.name for p in written) == sorted(f"{n}.{f}" for n in names[:2] for f in ("png", "svg"))
    page = html_figures(rep, tmp_path)
    assert page.count("<figure") == 2 and "1 more failing cases have map data" in page
    assert page.index(names[1]) < page.index(names[0]), "worst (1e5) first"
    assert "out: all 3,200 violations in batch 1 (of 2)" in page
    png = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page).group(1)
    assert base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_maps(rep, tmp_path, worst=0) == [] and html_figures(rep, tmp_path) == ""
    assert not list((tmp_path / "maps").glob("*.png")), "--maps 0 leaves no image of an earlier render"


def test_a_damaged_map_is_skipped_and_said_the_report_still_written(tmp_path, capsys):
    """A map file cut short (a full disk, a copy interrupted) costs its picture, not the others'
    and not the report: named on stderr, the other maps drawn."""
    rep = _report(tmp_path)
    bad = tmp_path / rep["cases"][1]["error_map"]
    bad.write_bytes(bad.read_bytes()[:100])
    written = write_maps(rep, tmp_path, worst=3)
    assert sorted({p.stem for p in written}) == sorted(rep["cases"][i]["case"] for i in (0, 2))
    assert f"error map {bad} unreadable, not drawn" in capsys.readouterr().err
    assert html_figures(rep, tmp_path).count("<figure") == 2


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory) -> tuple[Path, str]:
    """A real run of the seeded batch-offset kernel (every batch index >= 1 reads the wrong keys)
    on one case: its run directory and the case's name (shared: the tests below only read it)."""
    tmp_path = tmp_path_factory.mktemp("error-maps")
    cfg = {"dtype": "float16", "d": 64, "dv": 64, "batch": 2, "heads_q": 2, "heads_kv": 1, "seqlen_q": 128,
           "seqlen_k": 128, "causal": True}  # fmt: skip
    out = tmp_path / "run"
    code = cli.main(["run", "--kernel", "tests.restricted_kernels:batch_offset", "--config", json.dumps(cfg),
                     "--out", str(out)])  # fmt: skip
    assert code == 1
    rep = json.loads((out / "report.json").read_text())
    (rec,) = rep["cases"]
    assert rec["verdict"] == "fail" and rec["error_map"] == f"maps/{rec['case']}.npz", rec.get("error_map")
    return out, rec["case"]


def test_run_writes_maps_and_show_plots_one(failing_run, tmp_path, capsys):
    """``run`` renders the failing case's map beside the report and inlines it; ``show --case
    --plot`` writes the figure and prints its path; a passing case or an unknown tensor: exit 2."""
    out, name = failing_run
    assert (out / "maps" / f"{name}.png").is_file() and (out / "maps" / f"{name}.svg").is_file()
    assert "<h2>Error maps</h2>" in (out / "report.html").read_text()
    capsys.readouterr()
    dest = tmp_path / "plot.svg"
    args = ["show", str(out / "report.json"), "--case", name, "--plot"]
    assert cli.main([*args, "--format", "svg", "--out", str(dest)]) == 0
    assert capsys.readouterr().out.strip() == str(dest)
    assert "batch 1" in dest.read_text()
    assert cli.main([*args, "--tensor", "dk"]) == 2
    assert "no panel of tensor 'dk'" in capsys.readouterr().err
    assert cli.main(["show", str(out / "report.json"), "--case", "nope", "--plot"]) == 2
    assert "no case matches 'nope'" in capsys.readouterr().err


def test_show_plot_says_why_a_case_has_no_map(failing_run, tmp_path, capsys):
    out, name = failing_run
    rep = json.loads((out / "report.json").read_text())
    rep["cases"][0]["verdict"], rep["cases"][0]["error_map"] = "pass", None
    (tmp_path / "report.json").write_text(json.dumps(rep))
    assert cli.main(["show", str(tmp_path / "report.json"), "--case", name, "--plot"]) == 2
    assert f"case {name} has no error map: it did not fail (verdict pass)" in capsys.readouterr().err
    assert cli.main(["run", "--kernel", "fa4-model", "--suite", "smoke", "--maps", "-1", "--out", str(tmp_path)]) == 2


def test_show_case_selects_by_glob_and_plot_needs_exactly_one(failing_run, tmp_path, capsys):
    """``show --case GLOB`` lists the matching cases only; ``--plot`` with a glob matching two is
    exit 2 naming them, and without ``--case`` exit 2 saying it needs one."""
    out, name = failing_run
    rep = json.loads((out / "report.json").read_text())
    twin = {**rep["cases"][0], "case": name.replace("seed0", "seed7")}
    rep["cases"].append(twin)
    (tmp_path / "report.json").write_text(json.dumps(rep))
    capsys.readouterr()
    assert cli.main(["show", str(tmp_path / "report.json"), "--case", "*seed7"]) == 0
    shown = capsys.readouterr().out
    assert twin["case"] in shown and f" {name}\n" not in shown
    assert cli.main(["show", str(tmp_path / "report.json"), "--case", "*causal*", "--plot"]) == 2
    assert "matches 2 cases" in capsys.readouterr().err
    assert cli.main(["show", str(tmp_path / "report.json"), "--plot"]) == 2
    assert "--plot needs --case NAME" in capsys.readouterr().err


@pytest.mark.browser
def test_report_page_shows_the_map_in_chromium(failing_run, tmp_path):
    """report.html of a failing run, screenshotted by headless Chromium: the page is not blank,
    and the figure's region (found by the map's colours) holds the colour scale: blues within the
    bound and warm colours past it, as ``test_map_colours_...`` checks in the PNG itself."""
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is absent (CI installs Debian's chromium; .ci/run)")
    out, _ = failing_run
    shot = tmp_path / "shot.png"
    profile = tempfile.mkdtemp(dir=tmp_path)
    subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         f"--user-data-dir={profile}", f"--screenshot={shot}", "--window-size=1400,2000",
         (out / "report.html").as_uri()],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    shutil.rmtree(profile, ignore_errors=True)
    img = _png(shot.read_bytes())[..., :3]
    assert img.shape[:2] == (2000, 1400)
    ink = (img < 0.9).any(axis=2)
    assert ink.mean() > 0.02, "the page is blank"
    blue = (img[..., 2] > img[..., 0] + 0.15) & (img[..., 2] > 0.5)
    warm = (img[..., 0] > 0.45) & (img[..., 0] > img[..., 2] + 0.3)
    rows = np.flatnonzero(blue.sum(axis=1) > 50)
    assert rows.size > 100, "no map in the screenshot"
    region = slice(rows.min(), rows.max() + 1)
    assert warm[region].sum() > 2000, "the map shows no violation colour"
