"""The mod properties (docs/invariance.md, "Mod properties"): ``block_sparse`` and ``mask_flag``,
on a kernel's fixed-length entry, out and LSE, through the kernel contract (``score_mod=``,
``mask_mod=``, ``aux_tensors=``, ``block_sparse_tensors=`` with ``numerics.mods`` objects).

Each comparison is *claimed bitwise* where production's SM90 forward computes the same arithmetic
on both variants (read from flash-attn-4 4.0.0b36, ``flash_attn/cute``), and must then be equal
bit for bit; elsewhere both variants must stay within their forward bounds (as ``split``), and a
kernel without FA4 numerics (no bound) must be equal bit for bit.  SM100's paths
(``flash_fwd_sm100.py``) were not read for this: no bitwise claim there.

``block_sparse``: a mask_mod dense vs the same mask_mod with block sparsity built from it
(``numerics.mods.block_sparse_from_mask``), at the case's block size (``Case.block_sparse``, else
``audits.suites.cases.MOD_BLOCK``), flags off (a mask_mod drops them in production), with the case's
score_mod if any; for the case's own mask_mod and for a random block mask
(``audits.suites.strategies.random_mask``, seeded by the case: full, partial and empty blocks).
What SM90 does (``flash_fwd_sm90.py`` ``mma``, ``block_sparse_utils.py``
``consume_block_sparse_loads``): dense, every key tile from ``n_block_max - 1`` down to 0, the
mask_mod on each; block-sparse, the partial ("mask") blocks' tiles first, then the full ones,
each list from its last entry down (``fa4.mods.block_sparse_index_lists`` writes them
ascending, as ``compute_block_sparsity`` does), the mask_mod on partial blocks only.  A tile a
row sees no key of is a no-op for that row (its max stays, ``online_softmax``'s rescale is
``exp2(0) = 1``, P = 0; after a row's all-masked first tile the rescale is ``exp2(-inf) = 0`` on
a zero sum and accumulator, and SM90's ``fadd_reduce`` starts from 0 either way), and a kept
key's score is the same on both paths; so a row's result is the same bits when the two paths
visit the tiles it sees in the same order with the same ``tile_n``:

* ``tile_n``: dense, ``interface._tile_size_fwd_sm90`` without causal / local (a mask_mod
  resolves both off, ``_resolve_causal_local_window``); block-sparse,
  ``_fit_sm90_fwd_tile_to_block_sparsity`` takes block_k when smaller (and a multiple of 16),
  and ``normalize_block_sparse_config`` wants block_k == tile_n.  Unequal: no claim (the
  rescales fall on other key boundaries).
* order: the row's visible keys in partial blocks all lie in higher tiles than every full
  block's (partial-then-full, each descending, is then descending overall): causal's diagonal
  partial block above full ones is; a sliding window's left-edge partial block is not.  Rows
  where it fails are compared within the bound.

``mask_flag``: on the case's inputs, flags and mods cleared (its learnable sink kept):
``causal=True`` vs the causal mask_mod; ``window_size=(WINDOW, 0)`` vs the sliding_window mask_mod
(``numerics.mod_library.WINDOW``); ``softcap=SOFTCAP_CAP`` vs the softcap score_mod
(``numerics.mod_library.SOFTCAP_CAP``).  Each where the kernel's domain takes both sides.  The
same keys are kept on both sides (``mask.py`` ``apply_mask`` vs the mod's predicate, both
bottom-right aligned); the flag paths skip the key tiles no row of a query tile sees and mask
only the boundary tiles, the mask_mod path visits every tile and masks every one: the extra
tiles are no-ops as above.  So the flag and the mod compute the same bits where ``tile_n`` is
the same: causal (``_tile_size_fwd_sm90``: 192 x 128 causal vs 192 x 144 plain at 64 < d <= 96;
equal elsewhere), window (local: 128 vs 144 at 64 < d <= 96, 96 vs 128 / 112 at 128 < d <= 192,
64 vs 80 above; equal at d <= 64 and 96 < d <= 128).  softcap: ``_flash_attn_fwd`` turns
``softcap=`` into ``utils.create_softcap_scoremod(softcap)``, the very function
``fa4.mods``' softcap form is, with the same scale handling (``compute_softmax_scale_log2``):
claimed bitwise everywhere.
"""

from __future__ import annotations

import dataclasses

import torch

from audits.checks.invariance.compare import Refused, call_fixed, pair, verdict
from audits.suites.cases import MOD_BLOCK
from audits.suites.inputs import make_inputs
from audits.suites.strategies import mask_mod_of, random_mask
from fa4.code_paths import sm90_fwd_tile
from fa4.mods import build_mods
from numerics.call import AttentionCall
from numerics.forward_bound import forward_error_bound
from numerics.mod_library import SOFTCAP_CAP, WINDOW
from numerics.mods import block_sparse_from_mask, index_grid, visibility
from numerics.reference import attention_reference

__all__ = ["ModInputs", "block_sparse", "mask_flag", "sm90_block_sparse_rows", "sm90_tile_n"]

#: the mod properties, with what each compares
_FLAGS_OFF = {"causal": False, "window_size": (None, None), "softcap": 0.0}
_MOD_KEYS = ("score_mod", "mask_mod", "aux_tensors", "block_sparse_tensors", "aux_scalars")


def sm90_tile_n(d: int, dv: int, *, causal: bool = False, local: bool = False, block_k: int | None = None) -> int:
    """SM90 forward's tile_n (``fa4.code_paths.sm90_fwd_tile``, from
    ``interface._tile_size_fwd_sm90``), with block sparsity at ``block_k`` keys
    (``_fit_sm90_fwd_tile_to_block_sparsity``: block_k when smaller and a multiple of 16)."""
    tn = sm90_fwd_tile(d=d, dv=dv, causal=causal, local=local)[1]
    if block_k is not None and block_k < tn and block_k % 16 == 0:
        tn = block_k
    return tn


def sm90_block_sparse_rows(bs, kept: torch.Tensor, d: int, dv: int, seqlen_k: int) -> tuple[torch.Tensor, str]:
    """(bool (B, H, rows): the rows SM90 computes bit for bit alike dense and block-sparse, why
    the others are not) for block sparsity ``bs`` (``numerics.mods.BlockSparse``) of a mask
    keeping ``kept`` (bool, broadcastable to (B, H, rows, seqlen_k)); module doc."""
    dense_tn = sm90_tile_n(d, dv)
    sparse_tn = sm90_tile_n(d, dv, block_k=bs.block_size[1])
    n = kept.shape[2]
    kw = dict(batch=bs.full.shape[0], heads=bs.full.shape[1], seqlen_q=n, seqlen_k=seqlen_k, device=kept.device)
    full = visibility(block_sparse=dataclasses.replace(bs, partial=torch.zeros_like(bs.partial), mask_mod=None), **kw)
    part = visibility(block_sparse=dataclasses.replace(bs, full=torch.zeros_like(bs.full), mask_mod=None), **kw)
    shape = torch.broadcast_shapes(full.shape, part.shape, kept.shape)
    if sparse_tn != dense_tn:
        why = f"tile_n {sparse_tn} block-sparse vs {dense_tn} dense: the online softmax rescales at other boundaries"
        return torch.zeros(shape[:3], dtype=torch.bool, device=kept.device), why
    full, part = full.expand(shape), (part & kept).expand(shape)
    tile = (torch.arange(seqlen_k, device=kept.device) // dense_tn).expand(shape)
    pmin = torch.where(part, tile, torch.full_like(tile, seqlen_k + 1)).min(-1).values
    fmax = torch.where(full, tile, torch.full_like(tile, -1)).max(-1).values
    why = "rows whose visible partial-block keys do not all lie above their full blocks: visited in another order"
    return pmin > fmax, why


class ModInputs:
    """A case's inputs for the mod properties, shared by the measured kernel and its model: q, k,
    v, the case's keywords, and per variant (a label and its keywords) each kernel's call, the
    FP64 reference and each kernel's forward bound, made when first asked."""

    def __init__(self, case, device):
        self.case, self.device = case, device
        x = make_inputs(case, device=device)
        self.q, self.k, self.v, self.kw = x["q"], x["k"], x["v"], x["kw"]
        self._calls: dict = {}
        self._refs: dict = {}
        self._bounds: dict = {}

    def plain(self) -> dict:
        """The case's keywords with the flags off and no mods (its sink and scale kept)."""
        kw = {k: v for k, v in self.kw.items() if k not in _MOD_KEYS}
        kw.update(_FLAGS_OFF)
        return kw

    def call(self, t, label: str, kw: dict):
        key = (t.name, label)
        if key not in self._calls:
            self._calls[key] = call_fixed(t.fn, self.q, self.k, self.v, kw)
        return self._calls[key]

    def ref(self, label: str, kw: dict):
        if label not in self._refs:
            self._refs[label] = attention_reference(
                self.q, self.k, self.v, call=AttentionCall.from_kwargs(**kw), return_lse=True
            )
        return self._refs[label]

    def bound(self, t, label: str, kw: dict):
        """(out_bound, lse_bound) of variant ``label`` for ``t``'s numerics; (None, None) without."""
        if t.nmf is None:
            return None, None
        key = (t.name, label)
        if key not in self._bounds:
            nm = t.nmf(self.q, self.k, self.v, bool(kw.get("causal")), tuple(kw.get("window_size", (None, None))))
            call = AttentionCall.from_kwargs(**kw)
            self._bounds[key] = forward_error_bound(
                self.q, self.k, self.v, nm, call=call, reference=self.ref(label, kw)
            )
        return self._bounds[key]


def _rows(res, sel: torch.Tensor | None):
    """(out, lse) restricted to the (B, H, rows) selection ``sel`` (None: all): out rows as (n, dv)."""
    out, lse = res
    if sel is None:
        return out, lse
    o = out.permute(0, 2, 1, 3)[sel.expand(out.shape[0], out.shape[2], out.shape[1])]
    return o, None if lse is None else lse[sel.expand(lse.shape)]


def _compare(x: ModInputs, t, what: str, va: tuple, vb: tuple, claimed, why: str) -> list[dict]:
    """Variant ``va`` = (label, kw) against ``vb``: one comparison of the rows claimed bitwise
    (``claimed``: True, False or a (B, H, rows) mask) and one of the others (within the bound)."""
    a, b = x.call(t, *va), x.call(t, *vb)
    B, H, S = a[0].shape[0], a[0].shape[2], a[0].shape[1]
    if isinstance(claimed, bool):
        claimed = torch.full((B, H, S), claimed, dtype=torch.bool)
    claimed = claimed.expand(B, H, S).to(a[0].device)
    comps = []
    for sel, is_claimed in ((claimed, True), (~claimed, False)):
        if not bool(sel.any()):
            continue

        def lazy(sel=sel):
            # one FP64 reference for both: the two variants are one function (what is audited)
            ro, rl = _rows(x.ref(*va), sel)
            ba, bb = x.bound(t, *va), x.bound(t, *vb)
            if ba[0] is None:
                return ro, rl, None, None
            (oa, la), (ob, lb) = _rows(ba, sel), _rows(bb, sel)
            return ro, rl, (oa, ob), (la, lb)

        n = int(sel.sum())
        label = f"{what}: {n} row(s) " + ("claimed bitwise" if is_claimed else f"within the bound ({why})")
        rec = pair(label, _rows(a, sel), _rows(b, sel), lazy)
        rec["bitwise_claimed"] = is_claimed
        comps.append(rec)
    return comps


def _claims(t) -> str | None:
    """None when ``t`` is production's SM90 arithmetic (its model included), else why no claim."""
    if t.arch == "sm90":
        return None
    if t.arch is None:
        return "no FA4 numerics: no bitwise claim, and no bound: the variants must agree bit for bit"
    return f"no bitwise claim for {t.arch} (its paths were not read for this): compared within the bound"


def _library(x: ModInputs, **names) -> dict:
    c = x.case
    return build_mods(
        **names,
        batch=c.batch,
        heads_q=c.heads_q,
        seqlen_q=c.seqlen_q,
        seqlen_k=c.seqlen_k,
        seed=c.seed,
        device=x.device,
    )


def _inside(t, case, **fields) -> str | None:
    """Why the variant of ``case`` with ``fields`` lies outside ``t``'s declared domain, or None."""
    if t.domain is None:
        return None
    return t.domain.refusal(dataclasses.replace(case, **fields))


def block_sparse(x: ModInputs, t) -> dict:
    """The ``block_sparse`` property of the case for target ``t`` (module doc)."""
    c = x.case
    blk = tuple(c.block_sparse) or MOD_BLOCK
    no = _inside(
        t, c, causal=False, window=(None, None), softcap=0.0, mask_mod=c.mask_mod or "causal", block_sparse=blk
    )
    if no:
        raise Refused(f"outside the kernel's declared domain: {no}")
    base = x.plain()
    score = _library(x, score_mod=c.score_mod) if c.score_mod else {}
    base.update(score)
    aux0 = list(score.get("aux_tensors") or [])
    masks = []
    if c.mask_mod:
        lib = _library(x, score_mod=c.score_mod, mask_mod=c.mask_mod)
        masks.append((f"mask_mod {c.mask_mod}", lib["mask_mod"], list(lib.get("aux_tensors") or [])))
    pat = random_mask(
        batch=c.batch,
        heads=c.heads_q,
        seqlen_q=c.seqlen_q,
        seqlen_k=c.seqlen_k,
        block_size=blk,
        seed=c.seed,
        per_head=c.seed % 2 == 0,
        per_batch=c.seed % 3 == 0,
    )
    mm, maux = mask_mod_of(pat, aux_base=len(aux0), device=x.device)
    masks.append((f"random blocks (seed {c.seed})", mm, aux0 + maux))
    no_claim = _claims(t)
    comps, notes = [], []
    for what, mask, aux in masks:
        dense = {**base, "mask_mod": mask, "aux_tensors": aux}
        bs = block_sparse_from_mask(
            mask,
            batch=c.batch,
            heads=c.heads_q,
            seqlen_q=c.seqlen_q,
            seqlen_k=c.seqlen_k,
            block_size=blk,
            aux=aux,
            device=x.device,
        )
        sparse = {**dense, "block_sparse_tensors": bs}
        if no_claim:
            claimed, why = False, no_claim
        else:
            b, h, q, kv = index_grid(c.batch, c.heads_q, c.seqlen_q, c.seqlen_k, device=x.device)
            kept = mask.fn(b, h, q, kv, aux).to(torch.bool)
            claimed, why = sm90_block_sparse_rows(bs, kept, c.d, c.dv, c.seqlen_k)
        where = f"{what} at {blk[0]}x{blk[1]}"
        comps += _compare(x, t, where, (f"{what} dense", dense), (f"{what} block-sparse {blk}", sparse), claimed, why)
        notes.append(f"{where}: {_claimed_rows(claimed)}")
    return verdict(comps, "; ".join(notes), within_bound_holds=True)


def _claimed_rows(claimed) -> str:
    if isinstance(claimed, bool):
        return "every row claimed bitwise" if claimed else "no row claimed bitwise"
    return f"{int(claimed.sum())} of {claimed.numel()} rows claimed bitwise"


def mask_flag(x: ModInputs, t) -> dict:
    """The ``mask_flag`` property of the case for target ``t`` (module doc)."""
    c, dom = x.case, t.domain
    mods = dom.mods if dom is not None else ("score_mod", "mask_mod")
    d, dv = c.d, c.dv
    plain_tn = sm90_tile_n(d, dv)
    checks = [
        (
            "causal=True vs the causal mask_mod",
            {"causal": True},
            dict(causal=True),
            {"mask_mod": "causal"},
            "mask_mod",
            sm90_tile_n(d, dv, causal=True),
        ),
        (
            f"window_size=({WINDOW}, 0) vs the sliding_window mask_mod",
            {"window_size": (WINDOW, 0)},
            dict(window=(WINDOW, 0)),
            {"mask_mod": "sliding_window"},
            "mask_mod",
            sm90_tile_n(d, dv, local=True),
        ),
        (
            f"softcap={SOFTCAP_CAP} vs the softcap score_mod",
            {"softcap": SOFTCAP_CAP},
            dict(softcap=SOFTCAP_CAP),
            {"score_mod": "softcap"},
            "score_mod",
            plain_tn,
        ),
    ]
    off = dict(causal=False, window=(None, None), softcap=0.0, score_mod="", mask_mod="", block_sparse=())
    comps, skipped = [], []
    no_claim = _claims(t)
    for what, flag_kw, flag_case, mod_names, kind, flag_tn in checks:
        if kind not in mods:
            skipped.append(f"{what}: the kernel's domain declares no {kind}")
            continue
        why = _inside(t, c, **{**off, **flag_case}) or _inside(t, c, **{**off, **mod_names})
        if why:
            skipped.append(f"{what}: outside the kernel's declared domain ({why})")
            continue
        flag = {**x.plain(), **flag_kw}
        mod = {**x.plain(), **_library(x, **mod_names)}
        if no_claim:
            claimed, reason = False, no_claim
        elif flag_tn != plain_tn:
            claimed, reason = False, f"SM90 tile_n {flag_tn} with the flag vs {plain_tn} with the mod"
        else:
            claimed, reason = True, ""
        comps += _compare(x, t, what, (what + " [flag]", flag), (what + " [mod]", mod), claimed, reason)
    if not comps:
        return {"result": "not applicable", "reason": "; ".join(skipped) or "nothing to compare"}
    return verdict(comps, "; ".join(skipped) or None, within_bound_holds=True)
