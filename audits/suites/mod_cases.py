"""The suites' mod cases (``docs/mods.md``): smoke's few (:func:`smoke_mods`), the ``mods`` suite
(:func:`mods_suite`: every library score_mod and mask_mod, alone and paired, dense and
block-sparse, with the cross-check pairs :func:`mods_cross_checks`), and the varlen cases with
mods (:func:`varlen_mods`).  A mod case runs only on a kernel whose domain declares its kinds
(``audits.suites.domain`` ``mods``)."""

from __future__ import annotations

from audits.suites.case import Case, seed_of, varlen_case
from numerics.mod_library import MASK_MODS, SCALAR_SCORE_MODS, SCORE_MODS, SOFTCAP_CAP, WINDOW

__all__ = [
    "MOD_BLOCK",
    "MOD_BLOCK_SM100",
    "MODS_ADVERSARIAL",
    "smoke_mods",
    "mod_configs",
    "mods_cross_checks",
    "mods_suite",
    "varlen_mods",
]

#: the block size of the suites' block-sparse cases, (block_q, block_k): production's default
#: sparse block (``block_sparsity.py``: SM90's backward derives 128-row sparse blocks when none is
#: given) and one SM90 takes at d <= 128 in both directions: the forward's tile_n 128 equals
#: block_k (``normalize_block_sparse_config`` requires it), tile_m 128 (or 192 -> 128,
#: ``_tile_size_fwd_sm90``) divides block_q; the backward's 64- or 128-row tile divides it
#: (``_tile_size_bwd_sm90`` with sparse_block_size_q).  SM100 takes it only where one Q stage
#: runs (at most 128 packed query rows): with two, block_q must be a multiple of 256
#: (``infer_block_sparse_expected_shapes``: q_stage * tile_m), hence :data:`MOD_BLOCK_SM100`.
MOD_BLOCK = (128, 128)
#: a block both archs take at any length (d <= 128): 256 query rows (SM100's two 128-row Q
#: stages; SM90's 128- and 64-row tiles divide it), 128 keys (both forwards' tile_n)
MOD_BLOCK_SM100 = (256, 128)


def smoke_mods() -> list[Case]:
    """smoke's mod cases (``docs/mods.md``), each kind at least once and every library mod at
    least once, small enough for the model on 2 cores: lengths off the 128-token block (partial
    blocks, and full ones), GQA, the per-head aux tensors of ALiBi and the relative bias,
    block-sparse from a mask_mod with partial and full blocks (at blocks both archs take for the
    shape: :data:`MOD_BLOCK_SM100` with two SM100 Q stages, :data:`MOD_BLOCK` with one), and a
    mask_mod beside causal=True (the semantic trap: production drops causal).  Families keep
    clear of the name globs other tests select fixed-length smoke cases by (``*normal*``,
    ``*drift-seed0``, ``*uniform*``, ``*tile_step*``, ``*sink*``); inside every 16-bit domain
    that declares the mods.  ``tests/test_mod_catalogue.py`` catches each seeded mod bug on these."""
    return [
        # ALiBi (per-head slopes, aux) with prefix-LM (a prefix length per batch, aux), block-sparse,
        # GQA: the seed puts batch 0's prefix at 249 keys, batch 1's at 262, so full blocks (inside
        # the prefix: one in batch 0, two in batch 1) and partial ones (the causal part, the ragged
        # 200 x 300 ends) differ per batch
        Case(
            "bfloat16",
            64,
            64,
            2,
            2,
            1,
            200,
            300,
            family="student_t",
            score_mod="alibi",
            mask_mod="prefix_lm",
            block_sparse=MOD_BLOCK_SM100,
            seed=8,
        ),
        # the relative-position bias (per-head table, bucket aux) with a document mask (segment
        # ids per token, aux), dense, fp16
        Case("float16", 64, 64, 1, 2, 2, 160, 256, family="offset", score_mod="relbias", mask_mod="document", seed=4),
        # softcap as a score_mod (its derivative is not constant) on a sliding window, block-sparse:
        # the window cuts both visited key blocks (partial ones), the first is skipped
        Case(
            "bfloat16",
            128,
            128,
            1,
            2,
            2,
            128,
            384,
            family="outliers",
            score_mod="softcap",
            mask_mod="sliding_window",
            block_sparse=MOD_BLOCK,
            seed=5,
        ),
        # a mask_mod beside causal=True: the audit's meaning is the intersection; production drops causal
        Case("bfloat16", 64, 64, 1, 2, 2, 130, 200, causal=True, family="flat", mask_mod="causal", seed=6),
        # runtime scalars (aux_scalars): the temperature mod on one dominant key 12 nats above the
        # rest, so that its factor (0.5..2, seed 9's) moves the key's weight: a kernel ignoring the
        # scalars fails here (tests/test_feature_bugs.py)
        Case("float16", 64, 64, 1, 2, 2, 96, 200, family="peaked", score_mod="temperature", seed=9),
    ]


#: the adversarial input families the ``mods`` suite takes in turn, one per mod configuration
#: beside ``normal``: logits drifting along the keys (a bias growing with the key distance, as
#: ALiBi's, moves the maximum further), outlier channels (large scores through softcap's tanh),
#: one dominant key (a mask must hide it or keep it exactly), mass in small entries
MODS_ADVERSARIAL = ("drift", "outliers", "peaked", "long_tail")


def mod_configs() -> list[dict]:
    """The mod configurations of the ``mods`` suite: every library score mod alone, every mask
    mod alone dense and block-sparse (:data:`MOD_BLOCK`, and :data:`MOD_BLOCK_SM100`, which
    SM100 takes at the suite's lengths), and every pair, dense and block-sparse (:data:`MOD_BLOCK`);
    then, after them (so that the configurations before keep their place, head dim and family), each
    score mod reading runtime scalars (``SCALAR_SCORE_MODS``: ``temperature``) alone, with the
    document mask dense and with prefix-LM block-sparse."""
    plain = [s for s in SCORE_MODS if s not in SCALAR_SCORE_MODS]
    out = [{"score_mod": s} for s in plain]
    out += [{"mask_mod": m, "block_sparse": bs} for m in MASK_MODS for bs in ((), MOD_BLOCK, MOD_BLOCK_SM100)]
    out += [
        {"score_mod": s, "mask_mod": m, "block_sparse": bs} for s in plain for m in MASK_MODS for bs in ((), MOD_BLOCK)
    ]
    for s in SCALAR_SCORE_MODS:
        out += [
            {"score_mod": s},
            {"score_mod": s, "mask_mod": "document"},
            {"score_mod": s, "mask_mod": "prefix_lm", "block_sparse": MOD_BLOCK},
        ]
    return out


def mods_cross_checks() -> dict[str, tuple[Case, Case]]:
    """The cross-check pairs of the ``mods`` suite (``docs/mods.md``), each two cases of one shape,
    family and seed (same inputs) that must give the same attention: softcap as a score_mod and
    ``softcap=SOFTCAP_CAP``; causal as a mask_mod and ``causal=True``; sliding_window as a
    mask_mod and ``window_size=(WINDOW, 0)``; a block-sparse mask_mod and the same mask_mod dense;
    and a mask_mod with ``causal=True`` against the intersection (the mask_mod alone differs from
    it: production drops causal, ``interface._resolve_causal_local_window``)."""
    base = dict(dtype="bfloat16", d=64, dv=64, batch=2, heads_q=4, heads_kv=2, seqlen_q=256, seqlen_k=384)
    mk = lambda tag, **kw: Case(**base, seed=seed_of("mods-cross", tag), **kw)
    return {
        "softcap": (mk("softcap", score_mod="softcap"), mk("softcap", softcap=SOFTCAP_CAP)),
        "causal": (mk("causal", mask_mod="causal"), mk("causal", causal=True)),
        "sliding_window": (mk("window", mask_mod="sliding_window"), mk("window", window=(WINDOW, 0))),
        "block_sparse": (mk("bs", mask_mod="document", block_sparse=MOD_BLOCK), mk("bs", mask_mod="document")),
        "mask_with_causal": (mk("mwc", mask_mod="document", causal=True), mk("mwc", mask_mod="document")),
    }


def mods_suite() -> list[Case]:
    """The ``mods`` suite (GPU): every mod configuration (:func:`mod_configs`: 42) at bf16 and
    fp16, batch 2, 4 query heads on 2 KV heads, 256 queries x 384 keys (partial 128-blocks at the
    keys' end, none at the queries'), head dim 64 and 128 in turn, family ``normal``, plus the
    configuration once with an adversarial family (:data:`MODS_ADVERSARIAL` in turn); then the
    cross-check pairs (:func:`mods_cross_checks`).  Seeds derived from the case."""
    out = []
    for i, cfg in enumerate(mod_configs()):
        tag = sorted(cfg.items())
        for j, dtype in enumerate(("bfloat16", "float16")):
            d = (64, 128)[(i + j) % 2]
            out.append(Case(dtype, d, d, 2, 4, 2, 256, 384, seed=seed_of("mods", dtype, d, tag), **cfg))
        fam = MODS_ADVERSARIAL[i % len(MODS_ADVERSARIAL)]
        d = (128, 64)[i % 2]
        out.append(Case("bfloat16", d, d, 2, 4, 2, 256, 384, family=fam, seed=seed_of("mods", fam, d, tag), **cfg))
    out += [c for pair in mods_cross_checks().values() for c in pair]
    return list(dict.fromkeys(out + varlen_mods()))


def varlen_mods(*, smoke: bool = False) -> list[Case]:
    """The varlen cases with mods (``docs/varlen.md``, "Mods on varlen cases"): every library
    score mod and mask mod through the varlen entry, on mixed lengths with an empty sequence (no
    query), a 1x1 one and one with queries and no key, GQA and MQA, packed and paged keys,
    ``seqused_k``, split-KV with pack_gqa, a window beside a score mod, decode rows.  Each mod
    sees the sequence as its batch index and positions within the sequence; the library mods' aux
    tensors have a row per sequence (``audits.suites.inputs._varlen_mods``); block sparsity per sequence
    (production's varlen layout) at SM90's and SM100's sparse blocks.  ``smoke``:
    the first case only (ALiBi with a document mask on mixed lengths, small enough for 2 cores);
    all of them are in the ``mods`` suite."""
    mixed = ((0, 50), (1, 1), (37, 30), (5, 0), (64, 100))
    cases = [
        # ALiBi (per-head aux) with a document mask (per-sequence segment ids): an empty sequence, 1x1,
        # queries without keys, GQA 4:2
        varlen_case(
            seqlens=mixed,
            dtype="bfloat16",
            d=64,
            dv=64,
            heads_q=4,
            heads_kv=2,
            family="student_t",
            score_mod="alibi",
            mask_mod="document",
            seed=11,
        ),
    ]
    if smoke:
        return cases
    cases += [
        # the relative bias with prefix-LM (a prefix per sequence), keys used below the allocation, fp16, d 128
        varlen_case(
            seqlens=((100, 300), (64, 256), (1, 90), (0, 7)),
            seqused_k=(150, 200, 90, 7),
            dtype="float16",
            d=128,
            dv=128,
            heads_q=2,
            heads_kv=2,
            score_mod="relbias",
            mask_mod="prefix_lm",
            seed=12,
        ),
        # softcap as a score_mod on a sliding window, paged keys (64-key pages), MQA
        varlen_case(
            seqlens=((70, 300), (1, 129), (200, 200)),
            page_size=64,
            seqused_k=(300, 129, 200),
            dtype="bfloat16",
            d=64,
            dv=64,
            heads_q=4,
            heads_kv=1,
            family="outliers",
            score_mod="softcap",
            mask_mod="sliding_window",
            seed=13,
        ),
        # causal as a mask_mod, split-KV with pack_gqa (the model's SM100 split path; SM90 refuses splits)
        varlen_case(
            seqlens=((2, 700), (77, 400), (100, 300)),
            num_splits=3,
            pack_gqa=True,
            dtype="bfloat16",
            d=64,
            dv=64,
            heads_q=4,
            heads_kv=2,
            family="drift",
            mask_mod="causal",
            seed=14,
        ),
        # ALiBi alone on decode rows against long caches, 48-key pages (not dividing the tile)
        varlen_case(
            seqlens=((1, 1000), (4, 1024), (3, 500)),
            page_size=48,
            seqused_k=(1000, 1000, 480),
            dtype="bfloat16",
            d=64,
            dv=64,
            heads_q=8,
            heads_kv=2,
            family="peaked",
            score_mod="alibi",
            seed=15,
        ),
        # the relative bias beside a local window (the flags stay with a score_mod alone), fp16
        varlen_case(
            seqlens=((200, 400), (65, 65), (10, 300), (0, 3)),
            window=(96, 8),
            dtype="float16",
            d=64,
            dv=64,
            heads_q=4,
            heads_kv=4,
            family="long_tail",
            score_mod="relbias",
            seed=16,
        ),
        # the document mask alone, causal flag off, fp16, on chunked-prefill lengths
        varlen_case(
            seqlens=((128, 384), (129, 257), (1, 1)),
            dtype="float16",
            d=128,
            dv=128,
            heads_q=4,
            heads_kv=2,
            mask_mod="document",
            seed=17,
        ),
        # block-sparse per sequence (production's varlen layout: cu_total_m_blocks), ALiBi with a document
        # mask: full and partial blocks, sequences without queries or keys; SM90's sparse block (128 rows:
        # q_stage * tile_m), and SM100's (two 128-row Q stages) on prefix-LM with keys used below the allocation
        varlen_case(
            seqlens=((0, 50), (1, 1), (200, 300), (5, 0), (130, 260)),
            dtype="bfloat16",
            d=64,
            dv=64,
            heads_q=4,
            heads_kv=2,
            score_mod="alibi",
            mask_mod="document",
            block_sparse=MOD_BLOCK,
            seed=18,
        ),
        varlen_case(
            seqlens=((300, 400), (1, 129), (256, 256)),
            seqused_k=(380, 129, 200),
            dtype="float16",
            d=128,
            dv=128,
            heads_q=4,
            heads_kv=2,
            family="drift",
            mask_mod="prefix_lm",
            block_sparse=MOD_BLOCK_SM100,
            seed=19,
        ),
    ]
    # a library mod none of the above names (one added later): alone, on the mixed lengths
    for key, names in (("score_mod", SCORE_MODS), ("mask_mod", MASK_MODS)):
        for name in (n for n in names if n not in {getattr(c, key) for c in cases}):
            cases.append(
                varlen_case(
                    seqlens=mixed,
                    dtype="bfloat16",
                    d=64,
                    dv=64,
                    heads_q=4,
                    heads_kv=2,
                    seed=seed_of("varlen-mods", name),
                    **{key: name},
                )
            )
    return cases
