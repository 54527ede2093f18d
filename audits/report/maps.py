"""Error maps: where in a failing case's tensors the error passes the bound, as a picture.

The run saves, per failing case with element violations, ``maps/<case>.npz`` beside the report
(``audits.verdict.diagnosis``; format in docs/diagnosis.md): per (tensor, batch, head) panel the
ratio |error| / bound over (query row x head-dim column) for out, dq and lse (a single column),
over (key x head-dim column) for dk and dv, max-pooled to at most 256 x 256.  This module turns
that data into a figure a reader takes in at a glance:

* each panel on a log colour scale that splits at 1 (the bound): blues within it, yellow to dark
  red past it, magenta where the kernel is non-finite and the reference finite;
* the production tile grid (rows every ``tile_m`` query rows, every ``tile_n`` keys), since most
  kernel bugs sit on tile edges;
* beside each panel the case's mask over (query row x key), with the same grid, the mask's
  edges (causal diagonal, window edges), the rows with no visible key, the keys past
  ``seqused_k``, and the panel's violating rows overlaid, so that where the errors sit relative
  to the mask is visible without reading indices.  A case with mods (docs/mods.md) has its
  mask_mod and block sparsity drawn (the flags' mask intersected with ``numerics.mods.visibility``,
  the keys the reference keeps, as ``numerics.reference.call_visibility``), block sparsity's
  full, partial and skipped blocks apart, since a kernel bug with mods sits on a partial block or
  a skipped one.

``write_maps`` renders the worst failing cases (``run --maps N``) as PNG and SVG under
``maps/``; ``html_figures`` inlines them in report.html; ``fa4-audit show --plot`` renders one.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import torch

from audits.common import atomic_write
from audits.report.records import FAILING
from fa4.mods import build_mods
from numerics.mods import visibility as mod_visibility
from numerics.reference import effective_window, visible_key_range, visible_mask

__all__ = ["DEFAULT_MAPS", "render", "write_maps", "html_figures", "map_meta", "visibility", "FORMATS"]

#: ``run --maps`` default: the worst six failing cases get a figure.  A four-panel figure is about
#: 250 KB of PNG (330 KB inlined as base64) and 1.4-2.2 s of CPU for PNG and SVG (docs/diagnosis.md,
#: "Error maps": measured), so six keep report.html near 2 MB and add about ten seconds to a run;
#: a run whose failures share one cause shows it six times over already.
DEFAULT_MAPS = 6
#: the tensors' order in a figure
_ORDER = ("out", "lse", "dq", "dk", "dv", "dsink")
#: the formats ``render`` writes
FORMATS = ("png", "svg")
#: tile-grid lines per axis at most: past this the lines merge into a grey wash that hides the
#: map, so the grid is drawn every k-th tile (the label says k)
_MAX_GRID_LINES = 48
#: map rows drawn at most: a panel is about 230 pixels high, and a row drawn under a pixel high can
#: vanish (nearest-neighbour drawing drops it), so taller panels are max-pooled again to this
_DISPLAY_ROWS = 160
#: the figure's rows (inches): title above, legend below, each panel with its labels
_TOP, _BOTTOM, _PANEL = 0.8, 0.95, 2.9
#: mask samples per axis at most: a panel is at most ~400 pixels wide, so more is not seen
_MASK_SAMPLES = 512
#: the figure's colours: within the bound cool, past it warm; the step at 1 is the bound
_BELOW = ("#f7fbff", "#c6dbef", "#6baed6", "#2171b5")
_ABOVE = ("#fee391", "#fd8d3c", "#e31a1c", "#800026")
_INF = "#ff00ff"
#: non-finite elements ringed one by one up to this many; past it they form visible areas themselves
_MAX_RINGS = 300
_NAN = "#808080"
#: the mask's categories: hidden (masked out), visible, key past seqused_k, row with no visible key;
#: with block sparsity (docs/mods.md) a partial block's kept and hidden keys (its mask_mod applied)
#: and a skipped block's (neither full nor partial: never visited); a full block's keys are 0 or 1
_MASK_COLOURS = ("#f0f0f0", "#9ecae1", "#bdbdbd", "#cbc9e2", "#74c476", "#e5f5e0", "#fdd0a2")
_MASK_NAMES = (
    "masked key", "visible key", "key past seqused_k (unseen)", "row with no visible key",
    "visible key, partial block (mask_mod applied)", "masked key, partial block", "skipped block (not visited)",
)  # fmt: skip
_VIOLATION = "#e31a1c"


def map_meta(npz_path: str | Path) -> dict:
    """The ``meta`` record of an error-map file (JSON in a 0-d string array): the case, its
    configuration, the tiles and the panels; read without loading the panels' arrays."""
    with np.load(npz_path, allow_pickle=False) as z:
        return json.loads(str(z["meta"][()]))


def visibility(
    *,
    rows: np.ndarray,
    keys: np.ndarray,
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    window: tuple | list,
) -> np.ndarray:
    """Bool (len(rows), len(keys)): ``numerics.reference.visible_mask`` at the given query rows and
    keys only, in numpy (the figure samples a 32k x 32k mask at a few hundred points per axis)."""
    rows_t, keys_t = (
        torch.as_tensor(np.asarray(rows, dtype=np.int64)),
        torch.as_tensor(np.asarray(keys, dtype=np.int64)),
    )
    return visible_mask(seqlen_q, seqlen_k, causal=causal, window_size=window, rows=rows_t, keys=keys_t).numpy()


def _samples(n: int) -> np.ndarray:
    """At most ``_MASK_SAMPLES`` indices spread over ``range(n)``: every index when they fit."""
    if n <= _MASK_SAMPLES:
        return np.arange(n)
    return ((np.arange(_MASK_SAMPLES) + 0.5) * n / _MASK_SAMPLES).astype(np.int64)


def _lengths(config: dict, batch: int) -> tuple[int, int, int]:
    """(query rows, keys allocated, keys used) of ``batch`` (a sequence of a varlen case)."""
    if config.get("seqlens"):
        sq, sk = config["seqlens"][batch]
        used = config["seqused_k"][batch] if config.get("seqused_k") else sk
        return int(sq), int(sk), int(used)
    return int(config["seqlen_q"]), int(config["seqlen_k"]), int(config["seqlen_k"])


def _mask_image(config: dict, batch: int, heads=None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int, int]:
    """The mask's categories (indices into ``_MASK_COLOURS``) at sampled (row, key) points, the
    sampled rows and keys, and (query rows, keys allocated, keys used).  ``heads``: the query
    heads the panel shows (a kv head's panel: its group; None: every head), which matter only
    with mods (a key is drawn visible when one of them sees it)."""
    sq, sk, used = _lengths(config, batch)
    rows, keys = _samples(sq), _samples(sk)
    flag_keys = np.minimum(keys, max(used - 1, 0))
    vis = visibility(
        rows=rows,
        keys=flag_keys,
        seqlen_q=sq,
        seqlen_k=used,
        causal=bool(config["causal"]),
        window=config.get("window"),
    )
    mods = _mod_mask(config, batch, heads, rows=rows, keys=flag_keys, used=used, sq=sq) if _has_mods(config) else None
    if mods is not None:
        vis &= mods["kept"]
    vis &= (keys < used)[None, :]
    cat = np.where(vis, 1, 0)
    if mods is not None and mods["blocks"] is not None:  # a full block's keys stay 0 / 1
        cat = np.where(mods["blocks"] == 1, np.where(vis, 4, 5), cat)
        cat = np.where(mods["blocks"] == 0, 6, cat)
    cat = np.where((keys >= used)[None, :], 2, cat)
    # a row sees no key when none of all its keys is visible, not only of the sampled ones: its
    # visible keys are the interval [i + off - left, i + off + right] cut to [0, used)
    first, last = visible_key_range(
        sq, used, causal=bool(config["causal"]), window_size=config.get("window"), rows=torch.as_tensor(rows)
    )
    empty = (first > last).numpy()
    if mods is not None:  # ... and, with mods, kept by them (every key checked, not the sampled ones)
        empty |= ~mods["row_any"]
    cat[empty, :] = np.where(cat[empty, :] == 2, 2, 3)
    return cat, rows, keys, sq, sk, used


def _has_mods(config: dict) -> bool:
    """Whether the case hides keys by mods (a mask_mod, block sparsity), not only by its flags."""
    return bool(config.get("mask_mod") or config.get("block_sparse"))


def _mod_mask(config: dict, batch: int, heads, *, rows: np.ndarray, keys: np.ndarray, used: int, sq: int) -> dict:
    """What the case's mods keep (docs/mods.md), for the error map's mask: ``kept`` bool (rows,
    keys) at the sampled points, ``numerics.mods.visibility`` (the mask_mod, and block
    sparsity's full blocks and partial blocks' kept keys) seen by any of ``heads``; ``blocks``
    per point 2 (a full block), 1 (partial), 0 (skipped), None without block sparsity;
    ``row_any`` per sampled row whether the flags and the mods keep any of its ``used`` keys.
    The mods are rebuilt from the case as the run built them (``fa4.mods.build_mods``, the recipe
    of ``audits.suites.inputs``; the score_mod left out: it hides no key): at the call's batch and
    lengths, so for a varlen case with the sequence as the batch index and its largest lengths."""
    nb, hq, lq, lk = (int(config[k]) for k in ("batch", "heads_q", "seqlen_q", "seqlen_k"))
    block = tuple(int(x) for x in config.get("block_sparse") or ())
    mods = build_mods(
        mask_mod=config.get("mask_mod") or "",
        block_sparse=block,
        batch=nb,
        heads_q=hq,
        seqlen_q=lq,
        seqlen_k=lk,
        seed=int(config.get("seed", 0)),
    )
    heads = list(range(hq)) if heads is None else [int(h) for h in heads]
    bs = mods.get("block_sparse_tensors")
    kw = dict(
        batch=nb,
        heads=hq,
        seqlen_q=lq,
        seqlen_k=lk,
        mask_mod=mods.get("mask_mod"),
        block_sparse=bs,
        aux=mods.get("aux_tensors"),
        rows=torch.as_tensor(rows),
    )

    def kept(ks: np.ndarray) -> np.ndarray:
        v = mod_visibility(**kw, keys=torch.as_tensor(ks))
        return v.expand(nb, hq, len(rows), len(ks))[batch, heads].any(0).numpy()

    row_any = np.zeros(len(rows), dtype=bool)
    for k0 in range(0, used, 4096):  # every used key, a slice at a time (a 32k-key row x 512 rows x heads)
        ks = np.arange(k0, min(k0 + 4096, used))
        flags = visibility(
            rows=rows, keys=ks, seqlen_q=sq, seqlen_k=used, causal=bool(config["causal"]), window=config.get("window")
        )
        row_any |= (flags & kept(ks)).any(axis=1)
    blocks = None
    if bs is not None:
        bq, bk = bs.block_size
        pick = lambda m: m.expand(nb, hq, *m.shape[2:])[batch, heads][:, rows // bq][:, :, keys // bk].any(0).numpy()
        full, part = pick(bs.full), pick(bs.partial)
        blocks = np.where(full, 2, np.where(part, 1, 0))
    return {"kept": kept(keys), "blocks": blocks, "row_any": row_any}


def _mask_title(config: dict) -> str:
    """What masks the case: its flags, and its mask_mod and block sparsity when it has them."""
    flags = "causal" if config["causal"] else ("window " + str(tuple(config["window"])) if _windowed(config) else "")
    parts = [flags] if flags else []
    if config.get("mask_mod"):
        parts.append(f"mask_mod {config['mask_mod']}")
    if config.get("block_sparse"):
        parts.append("block-sparse {}x{}".format(*config["block_sparse"]))
    return " & ".join(parts) or "none"


def _mask_names(config: dict) -> tuple[str, ...]:
    """The categories' legend names: with block sparsity, categories 0 and 1 are a full block's."""
    if not config.get("block_sparse"):
        return _MASK_NAMES
    return ("masked key, full block", "visible key, full block", *_MASK_NAMES[2:])


def _colours():
    """The colour map (log10 of the ratio, centred at 0 = the bound) and the legend's colours."""
    # lazy: matplotlib takes a quarter second to import, paid only where a figure is drawn
    from matplotlib.colors import LinearSegmentedColormap, ListedColormap

    below = LinearSegmentedColormap.from_list("below", _BELOW)(np.linspace(0, 1, 128))
    above = LinearSegmentedColormap.from_list("above", _ABOVE)(np.linspace(0, 1, 128))
    return ListedColormap(np.vstack([below, above]), name="ratio").with_extremes(over=_INF, bad=_NAN, under=_BELOW[0])


def _scale(panels: list[np.ndarray]) -> tuple[float, float]:
    """log10 range of the colour scale: the panels' smallest positive and largest finite ratio,
    widened to at least [0.1, 10] so that 1 (the bound) sits inside it, the bottom clipped at
    1e-6 (smaller errors are all "far within the bound" to a reader)."""
    pos = [a[np.isfinite(a) & (a > 0)] for a in panels]
    pos = np.concatenate(pos) if pos else np.zeros(0)
    lo = float(pos.min()) if pos.size else 0.1
    hi = float(pos.max()) if pos.size else 10.0
    return math.log10(min(max(lo, 1e-6), 0.1)), math.log10(max(hi, 10.0))


def _grid(ax, n: int, tile: int, *, axis: str, lines: bool) -> str:
    """The tile edges every ``tile`` along ``axis`` ("x" or "y") of ``ax``, every k-th tile when
    there are more than ``_MAX_GRID_LINES``; the label's note of k.  ``lines``: faint lines across
    the axes (the mask: pale, nothing to hide); else ticks on both edges (the map: a line across
    it would hide a violation that sits on a tile's first row, the commonest kernel bug)."""
    if tile <= 0 or n <= tile:
        return ""
    k = max(1, math.ceil(n / tile / _MAX_GRID_LINES))
    where = list(range(tile * k, n, tile * k))
    if lines:
        draw = ax.axhline if axis == "y" else ax.axvline
        for p in where:
            draw(p, color="#303030", linewidth=0.5, alpha=0.45)
    else:
        ax_ = ax.yaxis if axis == "y" else ax.xaxis
        ax_.set_ticks(where, minor=True)
        ax.tick_params(axis=axis, which="minor", length=7, width=1.2, color="black", direction="out")
        if axis == "y":
            ax.tick_params(axis="y", which="minor", right=True)
    return f" every {k} tiles" if k > 1 else ""


def _mask_edges(ax, *, sq: int, used: int, config: dict, transposed: bool) -> None:
    """The mask's edges as dashed lines: the causal diagonal or window's right edge (keys right of
    it hidden) and the window's left edge (keys left of it hidden), bottom-right aligned as FA."""
    left, right = effective_window(causal=bool(config["causal"]), window_size=config.get("window"))
    off = used - sq
    ys = np.array([0.0, float(sq)])
    for edge, shift in ((right, 1), (left, 0)):
        if edge is None:
            continue
        xs = ys + off + (edge + shift if shift else -edge)  # the axes clip it to the mask
        (a, b) = (xs, ys) if not transposed else (ys, xs)
        ax.plot(a, b, color="black", linestyle="--", linewidth=1.0)


def _mask_panel(ax, *, meta: dict, panel: dict, ratios: np.ndarray) -> set[int]:
    """The case's mask beside one panel, with the tile grid, the mask's edges and the panel's
    violating rows (or keys) as red bands; its vertical axis is the panel's row axis.  The
    mask categories drawn (indices into ``_MASK_COLOURS``)."""
    # lazy: matplotlib takes a quarter second to import, paid only where a figure is drawn
    from matplotlib.colors import ListedColormap

    config = meta["config"]
    h = int(panel["head"])
    g = int(config["heads_q"]) // int(config["heads_kv"])
    heads = range(h * g, (h + 1) * g) if panel["row_axis"] == "col" else (h,)  # a kv head: its query heads
    cat, rows, keys, sq, sk, used = _mask_image(config, panel["batch"], heads)
    by_key = panel["row_axis"] == "col"
    img = cat.T if by_key else cat
    ext = [0, sq, sk, 0] if by_key else [0, sk, sq, 0]
    ax.imshow(
        img,
        cmap=ListedColormap(_MASK_COLOURS),
        vmin=-0.5,
        vmax=len(_MASK_COLOURS) - 0.5,
        extent=ext,
        aspect="auto",
        interpolation="nearest",
    )
    _mask_edges(ax, sq=sq, used=used, config=config, transposed=by_key)
    t_rows, t_keys = _tiles(meta, panel)
    every_y = _grid(ax, sk if by_key else sq, t_keys if by_key else t_rows, axis="y", lines=True)
    _grid(ax, sq if by_key else sk, t_rows if by_key else t_keys, axis="x", lines=True)
    # the panel's violating rows: a red band across the mask where any element passes the bound
    # (runs of them merged; hatched, so the mask stays readable under them; the edge line keeps a
    # one-row run at least a pixel high)
    bad = np.concatenate([[False], ~(ratios <= 1).all(axis=1), [False]])
    starts, ends = np.flatnonzero(~bad[:-1] & bad[1:]), np.flatnonzero(bad[:-1] & ~bad[1:])
    step = panel["row_step"]
    for a, b in zip(starts, ends, strict=True):
        ax.axhspan(
            a * step,
            min(b * step, panel["n_rows"]),
            facecolor="none",
            edgecolor=_VIOLATION,
            hatch="////",
            linewidth=1.0,
        )
    ax.set_xlim(ext[0], ext[1])
    ax.set_ylim(ext[2], ext[3])
    ax.set_xlabel("query row" if by_key else "key")
    sep = "\n" if _has_mods(config) else "; "  # a mod case's mask title is long: the tiles on a line of their own
    ax.set_title(f"mask ({_mask_title(config)}){sep}tiles {t_rows} rows x {t_keys} keys{every_y}", fontsize=9)
    return {int(k) for k in np.unique(cat)}


def _tiles(meta: dict, panel: dict) -> tuple[int, int]:
    """(tile_m, tile_n) of a panel: its own when it has them (the backward's tiles, for dq, dk
    and dv, differ from the forward's), else the map's."""
    return int(panel.get("tile_m", meta["tile_m"])), int(panel.get("tile_n", meta["tile_n"]))


def _windowed(config: dict) -> bool:
    return any(w is not None for w in (config.get("window") or ()))


def _pool_rows(data: np.ndarray, k: int) -> np.ndarray:
    """Max over each ``k`` consecutive rows (NaN kept: a NaN row stays visible as NaN)."""
    if k <= 1:
        return data
    pad = np.full((-(-data.shape[0] // k) * k, data.shape[1]), -np.inf, dtype=data.dtype)
    pad[: data.shape[0]] = data
    blocks = pad.reshape(-1, k, data.shape[1])
    return np.where(
        np.isnan(blocks).any(axis=1), np.nan, np.nanmax(np.where(np.isnan(blocks), -np.inf, blocks), axis=1)
    )


def _map_panel(ax, *, meta: dict, panel: dict, data: np.ndarray, cmap, norm) -> None:
    """One panel: log10 |err|/bound over (row or key, head-dim column) with the tile grid."""
    k = max(1, math.ceil(data.shape[0] / _DISPLAY_ROWS))
    data, panel = _pool_rows(data, k), {**panel, "row_step": panel["row_step"] * k}
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(data.astype(np.float64))
    logs = np.where(np.isposinf(logs), norm.vmax + 1.0, logs)  # inf: past the top, drawn in _INF
    by_key = panel["row_axis"] == "col"
    n_rows, n_cols = panel["n_rows"], panel["n_cols"]
    ax.imshow(
        np.ma.masked_invalid(logs),
        cmap=cmap,
        norm=norm,
        extent=[0, n_cols, n_rows, 0],
        aspect="auto",
        interpolation="nearest",
    )
    t_rows, t_keys = _tiles(meta, panel)
    every = _grid(ax, n_rows, t_keys if by_key else t_rows, axis="y", lines=False)
    # a lone non-finite element is one pixel: ring each (up to a few hundred; more show as a field)
    r, c = np.nonzero(np.isposinf(data))
    if 0 < len(r) <= _MAX_RINGS:
        ys, xs = (r + 0.5) * panel["row_step"], (c + 0.5) * panel["col_step"]
        ax.scatter(xs, ys, s=40, marker="s", facecolors="none", edgecolors=_INF, linewidths=1.5)
    tensor = panel["tensor"]
    ax.set_ylabel(("key" if by_key else "query row") + f" (batch {panel['batch']})")
    unit = "keys" if by_key else "rows"
    steps = (
        f"; a cell: max of {panel['row_step']} {unit} x {panel['col_step']} columns"
        if panel["row_step"] > 1 or (panel["col_step"] > 1)
        else ""
    )
    ax.set_xlabel(("LSE (one value per row)" if tensor == "lse" else "head-dim column") + steps, fontsize=8)
    if tensor == "lse":
        ax.set_xticks([])
    head = "kv head" if by_key else "head"
    ratio = panel["max_ratio"]
    worst = "inf" if not math.isfinite(ratio) else f"{ratio:.3g}"
    tile = f"{t_keys}-key" if by_key else f"{t_rows}-row"
    ax.set_title(
        f"{tensor}, batch {panel['batch']}, {head} {panel['head']}: {panel['violations']:,} violations, "
        f"worst {worst} x bound; {tile} tiles{every}",
        fontsize=9,
    )


def render(npz_path: str | Path, *, fmt: str = "png", tensor: str | None = None) -> bytes:
    """The figure of one error-map file as PNG or SVG bytes: every panel (or ``tensor``'s only),
    each beside the case's mask, one colour bar.  Raises ValueError for an unknown format or a
    tensor with no panel (the message names the tensors there are)."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return _save(_figure(npz_path, tensor=tensor), fmt)


def _save(fig, fmt: str) -> bytes:
    """PNG or SVG bytes of ``fig``; SVG text as text (searchable, smaller), no date (reproducible)."""
    # lazy: matplotlib takes a quarter second to import, paid only where a figure is drawn
    import matplotlib

    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "fa4-audit"}):
        fig.savefig(buf, format=fmt, metadata={"Date": None} if fmt == "svg" else {"Software": None})
    return buf.getvalue()


def _ticks(lo: float, hi: float) -> list[int]:
    """The colour bar's powers of ten: every one in [lo, hi], thinned to at most 9, 0 (the bound) kept."""
    every = list(range(math.ceil(lo), math.floor(hi) + 1))
    step = math.ceil(len(every) / 9)
    return sorted({*every[::step], 0})


def _figure(npz_path: str | Path, *, tensor: str | None):
    """The figure ``render`` saves (tests read its axes' positions)."""
    # lazy: matplotlib takes a quarter second to import, paid only where a figure is drawn
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    with np.load(npz_path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"][()]))
        panels = [p for p in meta["panels"] if tensor is None or p["tensor"] == tensor]
        # read in the order of the call: out, lse, then the gradients; the worst first within each
        panels.sort(
            key=lambda p: (
                _ORDER.index(p["tensor"]) if p["tensor"] in _ORDER else len(_ORDER),
                -p["max_ratio"] if not math.isnan(p["max_ratio"]) else 0.0,
            )
        )
        if not panels:
            have = sorted({p["tensor"] for p in meta["panels"]})
            raise ValueError(f"{npz_path}: no panel of tensor {tensor!r}; the map has {', '.join(have) or 'none'}")
        data = [np.asarray(z[p["key"]], dtype=np.float32) for p in panels]
    lo, hi = _scale(data)
    cmap = _colours()
    norm = TwoSlopeNorm(vmin=lo, vcenter=0.0, vmax=hi)
    # fixed margins (inches), not a layout engine: constrained layout took half the render time
    height = _TOP + _BOTTOM + _PANEL * len(panels)
    fig = Figure(figsize=(11, height), dpi=100)
    gs = fig.add_gridspec(
        len(panels),
        3,
        width_ratios=[3, 2.2, 0.12],
        left=0.07,
        right=0.885,
        wspace=0.2,
        top=1 - _TOP / height,
        bottom=_BOTTOM / height,
        hspace=1.0 / (_PANEL - 1.0),
    )
    shown: set[int] = set()  # the mask categories drawn, for the legend
    for n, (p, d) in enumerate(zip(panels, data, strict=True)):
        ax = fig.add_subplot(gs[n, 0])
        _map_panel(ax, meta=meta, panel=p, data=d, cmap=cmap, norm=norm)
        shown |= _mask_panel(fig.add_subplot(gs[n, 1], sharey=ax), meta=meta, panel=p, ratios=d)
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), cax=fig.add_subplot(gs[:, 2]), extend="max")
    ticks = _ticks(lo, hi)
    bar.set_ticks(ticks)
    bar.set_ticklabels(["1 (bound)" if t == 0 else f"1e{t}" for t in ticks])
    bar.ax.axhline(0.0, color="black", linewidth=2)
    bar.set_label("|error| / bound  (log scale; > 1 violates the bound)")
    omitted = meta.get("omitted_panels", 0)
    more = f"  (the map data keeps the worst {len(meta['panels'])} panels; {omitted} more not kept)" if omitted else ""
    title = "\n".join(textwrap.wrap(f"{meta['case']}{more}", 125))  # a varlen case's name is long
    fig.suptitle(title, fontsize=10, y=1 - 0.08 / height, va="top")  # above the panel titles
    legend = (
        [Patch(color=_INF, label="non-finite kernel, finite reference")]
        if any(np.isposinf(d).any() for d in data)
        else []
    )
    names = _mask_names(meta["config"])
    legend += [Patch(color=_MASK_COLOURS[k], label=names[k]) for k in sorted(shown)]
    legend.append(Patch(facecolor="none", edgecolor=_VIOLATION, hatch="////", label="rows (keys) past the bound"))
    if meta["config"]["causal"] or _windowed(meta["config"]):
        legend.append(Line2D([], [], color="black", linestyle="--", label="mask edge (causal diagonal / window)"))
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8, frameon=False)
    return fig


#: what reading or drawing a damaged or foreign map file raises: the map is skipped, said on
#: stderr, and the report is still written (a picture never costs the report)
_UNREADABLE = (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile)


def _candidates(report: dict, out_dir: Path, *, say: bool = False) -> list[tuple[float, dict, Path]]:
    """The failing cases whose error-map file is there and readable, worst (largest max ratio)
    first; ``say``: name an unreadable one on stderr."""
    found = []
    for rec in report["cases"]:
        rel = rec.get("error_map")
        if rec.get("verdict") not in FAILING or not rel or not (out_dir / rel).is_file():
            continue
        try:
            ratios = [float(p["max_ratio"]) for p in map_meta(out_dir / rel)["panels"]]
        except _UNREADABLE as exc:
            if say:
                print(f"error map {out_dir / rel} unreadable, not drawn: {exc}", file=sys.stderr)
            continue
        found.append((max(ratios, default=0.0), rec, out_dir / rel))
    found.sort(key=lambda x: -x[0] if not math.isnan(x[0]) else 0.0)
    return found


def _image(npz: Path, fmt: str) -> Path:
    """The image of map data ``maps/<case>.npz`` (case names hold dots: only ".npz" is replaced)."""
    return npz.with_name(npz.name.removesuffix(".npz") + "." + fmt)


def write_maps(report: dict, out_dir: Path, *, worst: int) -> list[Path]:
    """Render the ``worst`` failing cases with the largest |error|/bound that have an error map
    (``case["error_map"]``, relative to ``out_dir``) as PNG and SVG beside it, and remove the
    images of this report's other cases (left by an earlier render), so that report.html shows
    what this run rendered.  ``worst`` 0 renders none (``run --maps 0``).  The written paths."""
    out_dir = Path(out_dir)
    cands = _candidates(report, out_dir, say=True)
    chosen = cands[: max(worst, 0)]
    written = []
    for _, _, npz in chosen:
        try:
            fig = _figure(npz, tensor=None)  # drawn once, saved in each format
        except _UNREADABLE as exc:
            print(f"error map {npz} unreadable, not drawn: {exc}", file=sys.stderr)
            continue
        for fmt in FORMATS:
            path = _image(npz, fmt)
            atomic_write(path, _save(fig, fmt))
            written.append(path)
    for _, _, npz in cands[len(chosen) :]:
        for fmt in FORMATS:
            _image(npz, fmt).unlink(missing_ok=True)
    return written


def html_figures(report: dict, out_dir: Path) -> str:
    """The "Error maps" section of report.html: per rendered map (``write_maps``), worst first,
    a <figure> with the PNG inlined (the page stays one offline file), a caption with the case,
    each tensor's diagnosis sentence when there is one, and the SVG beside the report.  "" when
    no map was rendered."""
    out_dir = Path(out_dir)
    cands = _candidates(report, out_dir)
    shown = [(rec, npz) for _, rec, npz in cands if _image(npz, "png").is_file()]
    if not shown:
        return ""
    figs = []
    for rec, npz in shown:
        png = base64.b64encode(_image(npz, "png").read_bytes()).decode("ascii")
        svg = _image(npz, "svg").relative_to(out_dir).as_posix()
        name = html.escape(rec["case"])
        diag = rec.get("diagnosis") or {}
        sentences = "".join(  # per tensor (its "causes" list is shown beside the case, not here)
            f"<br>{html.escape(t)}: {html.escape(e['summary'])}"
            for t, e in diag.items()
            if isinstance(e, dict) and e.get("summary")
        )
        figs.append(
            f"<figure style='margin:1em 0'><img src='data:image/png;base64,{png}' alt='error map of {name}' "
            f"style='max-width:100%;border:1px solid #ccc'><figcaption><b>{html.escape(rec['verdict'])}</b> "
            f"{name} (<a href='{html.escape(svg)}'>SVG</a>){sentences}</figcaption></figure>"
        )
    more = len(cands) - len(shown)
    note = f" {more} more failing cases have map data in maps/ (run --maps N renders more)." if more else ""
    intro = (
        "<p>Per failing case, |error| / bound per element on a log scale: blue within the bound, yellow to dark "
        "red past it, magenta where the kernel is non-finite and the reference finite.  Rows are query rows (out, "
        "dq, lse) or keys (dk, dv), max-pooled to at most 256 x 256; ticks on the map's edges and lines across "
        "the mask mark the production tiles.  Beside each "
        f"panel the case's mask, the panel's violating rows hatched in red.{note}</p>"
    )
    return "<h2>Error maps</h2>" + intro + "".join(figs)
