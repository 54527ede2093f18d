"""The suites' varlen cases (the serving entry, ``docs/varlen.md``): smoke's (:func:`smoke_varlen`)
and release's, a pairwise covering array of :data:`VARLEN_AXES` (:func:`release_varlen`)."""

from __future__ import annotations

from dataclasses import replace

from audits.suites.axes import pairwise
from audits.suites.case import Case, varlen_case

__all__ = ["smoke_varlen", "VARLEN_PROFILES", "VARLEN_AXES", "release_varlen"]


def smoke_varlen() -> list[Case]:
    """smoke's varlen cases (the serving entry, ``docs/varlen.md``): sequences of mixed lengths
    with empty ones (no query; queries and no key), seqused_k below the allocated keys, decode rows
    against ~1000 keys, paged caches with shuffled pages (a page size dividing the 128-key tile and
    one that does not), split-KV with pack_gqa, a local window.  Inside every 16-bit kernel's
    domain (no softcap, sink or fp8): a fixed-length peer skips them for the missing varlen entry
    (or audits them per sequence with ``run --per-sequence``).  Families and seeds keep clear of
    the fixed-length cases' name globs the tests select by (``*normal*``, ``*drift-seed0``,
    ``*uniform*``, ``*tile_step*``, ``*sink*``)."""
    return [
        # GQA, causal: a sequence with no query, one of 1x1, one with queries and no key (out 0,
        # LSE -inf), rows with no visible key (37 > 30), lengths off the tile
        varlen_case(
            seqlens=((0, 50), (1, 1), (37, 30), (130, 130), (5, 0), (64, 200)),
            dtype="bfloat16",
            d=64,
            dv=64,
            heads_q=4,
            heads_kv=2,
            causal=True,
            family="student_t",
        ),
        # seqused_k below the allocated keys; the drifting logits put the largest ones in the unused tail
        varlen_case(
            seqlens=((100, 300), (64, 256), (1, 90)),
            seqused_k=(150, 200, 90),
            dtype="float16",
            d=128,
            dv=128,
            heads_q=2,
            heads_kv=2,
            causal=True,
            family="drift",
            seed=1,
        ),
        # decode: 1..4 rows per sequence against ~1000 keys, MQA
        varlen_case(
            seqlens=((1, 1000), (4, 1024), (3, 1100), (2, 777)),
            dtype="bfloat16",
            d=64,
            dv=64,
            heads_q=8,
            heads_kv=1,
            causal=True,
            family="outliers",
        ),
        # paged KV, shuffled pages of 64 keys (dividing the tile) and of 48 (not), seqused_k set
        varlen_case(
            seqlens=((70, 300), (1, 129), (200, 200)),
            page_size=64,
            dtype="bfloat16",
            d=64,
            dv=64,
            heads_q=4,
            heads_kv=1,
            causal=True,
            family="peaked",
        ),
        varlen_case(
            seqlens=((3, 500), (50, 97), (0, 10), (20, 48)),
            seqused_k=(410, 97, 10, 20),
            page_size=48,
            dtype="float16",
            d=128,
            dv=128,
            heads_q=2,
            heads_kv=2,
            causal=True,
            family="long_tail",
        ),
        # split-KV (3 splits and their combine) with pack_gqa; the drift makes each split's maximum differ
        varlen_case(
            seqlens=((2, 700), (77, 400), (100, 300)),
            num_splits=3,
            pack_gqa=True,
            dtype="bfloat16",
            d=64,
            dv=64,
            heads_q=4,
            heads_kv=2,
            causal=True,
            family="drift",
            seed=1,
        ),
        # a local window per sequence
        varlen_case(
            seqlens=((200, 400), (65, 65), (10, 300)),
            window=(96, 8),
            dtype="bfloat16",
            d=128,
            dv=128,
            heads_q=2,
            heads_kv=2,
            family="flat",
        ),
    ]


#: per-sequence (seqlen_q, seqlen_k) profiles of the release's varlen cases
VARLEN_PROFILES = {
    # many sequences, empty ones among them, lengths off the tile up to a few thousand
    "mixed": ((0, 64), (1, 1), (113, 203), (640, 128), (5, 0), (1023, 1024), (3000, 3000), (17, 2048)),
    # decode: 1..4 rows per sequence against 2k-8k keys
    "decode": ((1, 2048), (4, 8192), (2, 5000), (3, 3333), (1, 7777)),
    # long sequences, unequal lengths
    "long": ((2048, 2048), (1000, 4096), (4224, 4224)),
    # chunked prefill: query chunks against long caches
    "chunked": ((256, 4096), (128, 2176), (512, 6000), (64, 1000)),
}
#: the varlen axes of the release (a pairwise covering array, :func:`release_varlen`); production's
#: SM90 path refuses num_splits > 1 ("SplitKV not supported on SM 9.0"): skipped there by that rule
VARLEN_AXES = {
    "dtype": ["bfloat16", "float16"],
    "d": [64, 128],
    "heads": [(4, 4), (8, 2), (8, 1)],
    "mask": ["none", "causal", "local"],
    "page_size": [0, 16, 48, 64, 128, 256],
    "num_splits": [1, 2, 4],
    "profile": list(VARLEN_PROFILES),
    "family": ["normal", "outliers", "drift", "nan_inf_masked", "long_tail", "peaked"],
}


def _varlen_release_case(row: dict, seed: int) -> Case:
    """The varlen case of a covering-array row of :data:`VARLEN_AXES`: the profile's lengths;
    with a page size, seqused_k at 7/8 of each allocated length (pages past it unused); pack_gqa
    forced on for split GQA rows.  ``nan_inf_masked`` needs keys no query sees in every sequence:
    a left window of 64 and keys at least 80 past each sequence's queries."""
    pairs = VARLEN_PROFILES[row["profile"]]
    mask, fam = row["mask"], row["family"]
    window = (128, 32) if mask == "local" else (None, None)
    if fam == "nan_inf_masked":
        window, mask = (64, 0), "local"
        pairs = tuple((a, max(b, a + 80)) for a, b in pairs)
    used = tuple(b - b // 8 for _, b in pairs) if row["page_size"] and fam != "nan_inf_masked" else ()
    hq, hk = row["heads"]
    split_gqa = row["num_splits"] > 1 and hq > hk
    return varlen_case(
        seqlens=pairs,
        seqused_k=used,
        page_size=row["page_size"],
        num_splits=row["num_splits"],
        pack_gqa=True if split_gqa else None,
        dtype=row["dtype"],
        d=row["d"],
        dv=row["d"],
        heads_q=hq,
        heads_kv=hk,
        causal=mask == "causal",
        window=window,
        family=fam,
        seed=seed,
    )


def release_varlen(seeds: tuple[int, ...] = (0,)) -> list[Case]:
    """The release's varlen cases (GPU): a pairwise covering array of :data:`VARLEN_AXES`; a
    split row also without splits, so that a kernel refusing split-KV (production on SM90)
    still audits every other axis value of it."""
    cases = []
    for s in seeds:
        for r in pairwise(VARLEN_AXES, seed=15):
            c = _varlen_release_case(r, s)
            cases += [c] if c.num_splits == 1 else [c, replace(c, num_splits=1, pack_gqa=None)]
    return list(dict.fromkeys(cases))
