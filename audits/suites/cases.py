"""Audit cases and named suites.

A :class:`Case` is one configuration of the audited call plus its inputs' family and seed;
:meth:`Case.call` gives the parts of it that select production's code path, which
``fa4.code_paths.classes_of`` maps to code-path classes.
``SUITES["smoke"]`` is the CPU/CI suite: every feature axis and every input family at least
once, each non-finite family with every mask kind it applies to (:data:`NONFINITE_MASKS`: a
kernel masking with a large negative score instead of -inf is caught only by a causal NaN key),
small enough for the model on 2 cores.  ``release`` (GPU) is a pairwise-covering array of FA's
test axes times every input family, the varlen array, and :func:`class_cases` (every code-path
class of both archs, forward and backward); ``head-dims`` is every head dim SM90 accepts, both
16-bit dtypes, causal and not (:func:`head_dim_sweep`); ``nightly`` is release with three seeds,
lengths up to 32k, and ``head-dims``; ``fidelity`` is the fixed list the model is compared with
production on (``fa4-audit fidelity``); ``mods`` is every library score_mod and mask_mod, alone
and paired, dense and block-sparse, with the cross-check pairs (:func:`mods_suite`,
``docs/mods.md``), part of release and nightly; smoke has a few mod cases (:func:`smoke_mods`).
A mod case runs only on a kernel whose domain declares its kinds (``audits.suites.domain`` ``mods``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fa4.code_paths import Call

__all__ = [
    "Case", "varlen_case", "smoke_suite", "smoke_varlen", "release_suite", "release_varlen", "nightly_suite",
    "pairwise", "SUITES", "suite", "fidelity_cases", "fidelity_suite", "head_dim_sweep", "head_dims_suite",
    "class_cases", "SM90_HEAD_DIMS", "NONFINITE_MASKS", "MOD_KINDS", "mods_suite", "smoke_mods", "MOD_BLOCK",
    "MOD_BLOCK_SM100", "mods_cross_checks", "MODS_ADVERSARIAL", "varlen_mods",
]  # fmt: skip

#: the kinds of the programmable surface a case may use and a domain may declare
#: (``audits.suites.domain`` key ``mods``; ``docs/mods.md``)
MOD_KINDS = ("score_mod", "mask_mod", "block_sparse", "aux_scalars")


@dataclass(frozen=True)
class Case:
    """One audited configuration.  dtype: torch dtype name; window: (left, right), None =
    unbounded; layout: contiguous | strided | packed_qkv; family: see ``audits.suites.inputs``."""

    dtype: str = "bfloat16"
    d: int = 128
    dv: int = 128
    batch: int = 1
    heads_q: int = 2
    heads_kv: int = 2
    seqlen_q: int = 128
    seqlen_k: int = 128
    causal: bool = False
    window: tuple = (None, None)
    softcap: float = 0.0
    sink: bool = False
    layout: str = "contiguous"
    family: str = "normal"
    seed: int = 0
    #: varlen (the serving entry, ``docs/varlen.md``): per-sequence (seqlen_q, seqlen_k) as
    #: allocated; empty for a fixed-length case.  batch / seqlen_q / seqlen_k then hold the
    #: count and the largest lengths.
    seqlens: tuple = ()
    #: per-sequence keys used (``seqused_k``, each <= the allocated seqlen_k); empty: all
    seqused_k: tuple = ()
    #: keys per page of a paged KV cache (pages shuffled); 0: packed contiguous KV
    page_size: int = 0
    #: split-KV: the KV blocks of a tile split this many ways, then combined
    num_splits: int = 1
    #: pack_gqa: None = the kernel's default
    pack_gqa: bool | None = None
    #: the programmable surface (``docs/mods.md``): a score_mod and a mask_mod of the library
    #: (``numerics.mod_library.SCORE_MODS`` / ``MASK_MODS``; "" = none), and block sparsity built
    #: from the mask_mod at (block_q, block_k) tokens (() = dense).  ``audits.suites.inputs.make_inputs``
    #: builds them (``fa4.mods.build_mods``) into the call's keywords.
    score_mod: str = ""
    mask_mod: str = ""
    block_sparse: tuple = ()

    @property
    def local(self) -> bool:
        return not self.causal and any(w is not None for w in self.window)

    @property
    def name(self) -> str:
        parts = [
            self.dtype.replace("float", "f").replace("bf16", "bf16"),
            f"d{self.d}" + (f"v{self.dv}" if self.dv != self.d else ""),
            f"b{self.batch}h{self.heads_q}k{self.heads_kv}",
            f"s{self.seqlen_q}x{self.seqlen_k}",
        ]
        if self.causal:
            parts.append("causal")
        if self.local:
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.sink:
            parts.append("sink")
        if self.layout != "contiguous":
            parts.append(self.layout)
        parts += self._mod_parts()
        parts += self._varlen_parts()
        parts += [self.family, f"seed{self.seed}"]
        return "-".join(parts)

    @property
    def varlen(self) -> bool:
        """A case of the varlen entry (``docs/varlen.md``)."""
        return bool(self.seqlens)

    @property
    def mods(self) -> tuple[str, ...]:
        """The mod kinds this case uses (``audits.suites.domain`` ``mods``): among "score_mod",
        "mask_mod", "block_sparse", and "aux_scalars" when a mod reads runtime scalars (the call
        then passes ``aux_scalars=``, a keyword a kernel must declare it takes)."""
        from numerics.mod_library import SCALAR_SCORE_MODS

        have = (self.score_mod, self.mask_mod, self.block_sparse, self.score_mod in SCALAR_SCORE_MODS)
        return tuple(k for k, on in zip(MOD_KINDS, have) if on)

    def _mod_parts(self) -> list[str]:
        parts = [f"sm-{self.score_mod}"] if self.score_mod else []
        parts += [f"mm-{self.mask_mod}"] if self.mask_mod else []
        return parts + ([f"bs{self.block_sparse[0]}x{self.block_sparse[1]}"] if self.block_sparse else [])

    def _varlen_parts(self) -> list[str]:
        if not self.varlen:
            return []
        parts = ["vl" + ".".join(f"{a}x{b}" for a, b in self.seqlens)]
        if self.seqused_k:
            parts.append("used" + ".".join(str(u) for u in self.seqused_k))
        if self.page_size:
            parts.append(f"page{self.page_size}")
        if self.num_splits != 1:
            parts.append(f"split{self.num_splits}")
        if self.pack_gqa is not None:
            parts.append("packgqa" if self.pack_gqa else "nopackgqa")
        return parts

    @property
    def compile_key(self) -> tuple:
        """What a JIT kernel specialises on: cases sharing it reuse one compiled variant."""
        return (
            self.dtype,
            self.d,
            self.dv,
            self.causal,
            self.local,
            self.softcap > 0,
            self.sink,
            self.heads_q // self.heads_kv,
            self.varlen,
            self.page_size,
            self.num_splits,
            self.pack_gqa,
            # production hashes the mod callables into its compile key (interface._flash_attn_fwd
            # score_mod_hash / mask_mod_hash) and specialises on block sparsity's tile fit
            self.score_mod,
            self.mask_mod,
            tuple(self.block_sparse),
        )

    @property
    def cost(self) -> int:
        """Expected work (multiply-adds), for balancing shards."""
        if self.varlen:
            return self.heads_q * sum(a * b for a, b in self.seqlens) * (self.d + self.dv)
        return self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * (self.d + self.dv)

    def as_dict(self) -> dict:
        """The JSON form (``case_from_dict`` reads it back).  The mod fields are left out when
        unset, so that reports and reproducers of cases without mods read as before."""
        d = asdict(self)
        for k in ("score_mod", "mask_mod", "block_sparse"):
            if not d[k]:
                del d[k]
        if "block_sparse" in d:
            d["block_sparse"] = list(d["block_sparse"])
        return d

    def call(self, *, deterministic: bool = False) -> Call:
        """The parts of this case that select production's code path
        (:class:`fa4.code_paths.Call`), for ``fa4.code_paths.classes_of``;
        ``deterministic``: the backward's ``deterministic=True`` (not a case field)."""
        return Call(
            dtype=self.dtype,
            d=self.d,
            dv=self.dv,
            causal=self.causal,
            local=self.local,
            softcap=self.softcap > 0,
            sink=self.sink,
            seqlen_q=self.seqlen_q,
            seqlen_k=self.seqlen_k,
            heads_q=self.heads_q,
            heads_kv=self.heads_kv,
            varlen=self.varlen,
            paged=self.page_size > 0,
            num_splits=self.num_splits,
            pack_gqa=self.pack_gqa,
            deterministic=deterministic,
            score_mod=bool(self.score_mod),
            mask_mod=bool(self.mask_mod),
            block_sparse=tuple(self.block_sparse),
            aux_scalars="aux_scalars" in self.mods,
        )


#: the mask kinds ("none", "causal", "local") each non-finite input family applies to; smoke has
#: each pair (nan_inf_masked needs keys no query sees: a left window, so local only)
NONFINITE_MASKS = {"nan_inf_visible": ("none", "causal", "local"), "nan_inf_masked": ("local",)}


def smoke_suite() -> list[Case]:
    """Every feature axis and input family at least once, and the range-stressing families per
    dtype (tests/test_inputs.py and the seeded-bug catalogue, tests/test_catalogue.py, keep it so)."""
    from audits.suites.inputs import FAMILIES

    base = [
        Case("bfloat16", 64, 64, 2, 4, 2, 200, 300, causal=True, family="normal"),  # GQA, batch 2, non-multiple-of-128
        Case("float16", 128, 128, 1, 4, 1, 160, 160, family="uniform"),  # MQA
        Case("float8_e4m3fn", 128, 128, 1, 2, 2, 128, 384, family="student_t"),
        Case("float8_e5m2", 64, 64, 1, 2, 2, 96, 200, causal=True, family="outliers"),
        Case("bfloat16", 256, 256, 1, 2, 1, 64, 260, family="offset"),
        Case("bfloat16", 96, 96, 1, 2, 2, 130, 70, causal=True, family="peaked"),  # sq > sk: rows with no visible key
        Case("bfloat16", 128, 128, 1, 2, 2, 200, 200, window=(64, 16), family="flat"),
        Case("float8_e4m3fn", 64, 64, 1, 1, 1, 64, 2048, family="long_tail"),
        Case("bfloat16", 64, 64, 1, 1, 1, 64, 2048, family="long_tail", seed=1),  # flush of small P, 16-bit
        Case("bfloat16", 64, 64, 1, 2, 2, 64, 1024, family="drift", sink=True),
        Case("bfloat16", 128, 128, 1, 2, 2, 128, 128, softcap=15.0, layout="packed_qkv", family="huge_logits"),
        Case("float16", 64, 64, 1, 2, 2, 100, 100, family="near_max", layout="strided"),
        Case("bfloat16", 64, 72, 1, 2, 2, 64, 96, family="subnormal"),  # head_dim_v not a multiple of 32
        # the non-finite families with every mask kind they apply to (NONFINITE_MASKS): a kernel
        # that masks by adding -1e6 to the scores lets the NaN key past the diagonal poison the
        # rows before it, which only a causal nan_inf_visible case shows; the fp16 ones at equal
        # lengths of 128 lie inside restricted domains (fp16, multiples of 128)
        Case("bfloat16", 64, 64, 1, 2, 2, 64, 200, causal=True, family="nan_inf_visible"),
        Case("float16", 64, 64, 1, 2, 2, 128, 128, causal=True, family="nan_inf_visible"),
        Case("float16", 64, 64, 1, 2, 2, 128, 128, family="nan_inf_visible"),
        Case("bfloat16", 64, 64, 1, 2, 2, 64, 256, window=(64, 16), family="nan_inf_visible"),
        Case("bfloat16", 64, 64, 1, 2, 2, 64, 400, window=(32, 0), family="nan_inf_masked"),
        Case("float16", 64, 64, 1, 2, 2, 64, 300, window=(40, 24), family="nan_inf_masked"),
        Case("bfloat16", 128, 128, 1, 16, 4, 160, 256, family="normal"),  # 2560 query rows x heads
        # the learnable sink on 3 heads (above, near and below the head's max logit: see
        # audits.suites.inputs.SINK_PLACES), MQA, and rows with no visible key (out 0, lse = sink)
        Case("float16", 64, 64, 1, 3, 1, 96, 64, causal=True, sink=True, family="normal"),
        # softcap where tanh does not saturate: logits 0..40 against a cap of 15
        Case("bfloat16", 64, 64, 1, 2, 2, 96, 256, softcap=15.0, family="drift"),
        # range stress per dtype: drifting maxima (19 log2 units per 128-key tile; causal rows end
        # at every key of the last tile, so the max's lag at the last rescale takes every value),
        # V near the dtype's largest value, outlier channels.  bf16 near_max is absent: V ~ 3.4e38
        # makes P.V overflow float32 in any float32-accumulating kernel (out of every domain).
        Case("float16", 64, 64, 1, 2, 2, 128, 384, causal=True, family="drift"),
        Case("float16", 128, 128, 1, 2, 2, 64, 256, family="outliers"),
        Case("bfloat16", 128, 128, 1, 2, 2, 64, 256, family="outliers"),
        Case("float8_e4m3fn", 64, 64, 1, 2, 2, 128, 384, causal=True, family="drift"),
        Case("float8_e4m3fn", 64, 64, 1, 2, 2, 64, 200, family="near_max"),
        Case("float8_e4m3fn", 128, 128, 1, 2, 2, 64, 256, family="outliers"),
        Case("float8_e5m2", 64, 64, 1, 2, 2, 128, 384, causal=True, family="drift"),
        Case("float8_e5m2", 64, 64, 1, 2, 2, 64, 200, family="near_max"),
    ]
    steps = [Case("bfloat16", 64, 64, 1, 1, 1, 32, 1024, family=f) for f in FAMILIES if f.startswith("tile_step_")]
    return base + steps + smoke_varlen() + smoke_mods() + varlen_mods(smoke=True)


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
    ]


#: the adversarial input families the ``mods`` suite takes in turn, one per mod configuration
#: beside ``normal``: logits drifting along the keys (a bias growing with the key distance, as
#: ALiBi's, moves the maximum further), outlier channels (large scores through softcap's tanh),
#: one dominant key (a mask must hide it or keep it exactly), mass in small entries
MODS_ADVERSARIAL = ("drift", "outliers", "peaked", "long_tail")


def _mod_configs() -> list[dict]:
    """The mod configurations of the ``mods`` suite: every library score mod alone, every mask
    mod alone dense and block-sparse (:data:`MOD_BLOCK`, and :data:`MOD_BLOCK_SM100`, which
    SM100 takes at the suite's lengths), and every pair, dense and block-sparse (:data:`MOD_BLOCK`);
    then, after them (so that the configurations before keep their place, head dim and family), each
    score mod reading runtime scalars (``SCALAR_SCORE_MODS``: ``temperature``) alone, with the
    document mask dense and with prefix-LM block-sparse."""
    from numerics.mod_library import MASK_MODS, SCALAR_SCORE_MODS, SCORE_MODS

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
    from numerics.mod_library import SOFTCAP_CAP, WINDOW

    base = dict(dtype="bfloat16", d=64, dv=64, batch=2, heads_q=4, heads_kv=2, seqlen_q=256, seqlen_k=384)
    mk = lambda tag, **kw: Case(**base, seed=_seed_of("mods-cross", tag), **kw)
    return {
        "softcap": (mk("softcap", score_mod="softcap"), mk("softcap", softcap=SOFTCAP_CAP)),
        "causal": (mk("causal", mask_mod="causal"), mk("causal", causal=True)),
        "sliding_window": (mk("window", mask_mod="sliding_window"), mk("window", window=(WINDOW, 0))),
        "block_sparse": (mk("bs", mask_mod="document", block_sparse=MOD_BLOCK), mk("bs", mask_mod="document")),
        "mask_with_causal": (mk("mwc", mask_mod="document", causal=True), mk("mwc", mask_mod="document")),
    }


def mods_suite() -> list[Case]:
    """The ``mods`` suite (GPU): every mod configuration (:func:`_mod_configs`: 42) at bf16 and
    fp16, batch 2, 4 query heads on 2 KV heads, 256 queries x 384 keys (partial 128-blocks at the
    keys' end, none at the queries'), head dim 64 and 128 in turn, family ``normal``, plus the
    configuration once with an adversarial family (:data:`MODS_ADVERSARIAL` in turn); then the
    cross-check pairs (:func:`mods_cross_checks`).  Seeds derived from the case."""
    out = []
    for i, cfg in enumerate(_mod_configs()):
        tag = sorted(cfg.items())
        for j, dtype in enumerate(("bfloat16", "float16")):
            d = (64, 128)[(i + j) % 2]
            out.append(Case(dtype, d, d, 2, 4, 2, 256, 384, seed=_seed_of("mods", dtype, d, tag), **cfg))
        fam = MODS_ADVERSARIAL[i % len(MODS_ADVERSARIAL)]
        d = (128, 64)[i % 2]
        out.append(Case("bfloat16", d, d, 2, 4, 2, 256, 384, family=fam, seed=_seed_of("mods", fam, d, tag), **cfg))
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
    from numerics.mod_library import MASK_MODS, SCORE_MODS

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
                    seed=_seed_of("varlen-mods", name),
                    **{key: name},
                )
            )
    return cases


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


#: (seqlen_q, seqlen_k) pairs of FA's own tests (flash-attention/tests/cute/test_flash_attn.py) and more
SEQLEN_PAIRS = [
    (1, 239),
    (3, 799),
    (127, 512),
    (127, 513),
    (113, 203),
    (128, 217),
    (113, 211),
    (108, 256),
    (256, 512),
    (384, 256),
    (640, 128),
    (512, 256),
    (1024, 1024),
    (1023, 1024),
    (1024, 1023),
    (200, 2048),
    (2048, 2048),
    (4096, 4096),
    (8192, 8192),
    (1, 8192),
    (4224, 4224),
    (1000, 3000),
]
RELEASE_AXES = {
    "dtype": ["bfloat16", "float16", "float8_e4m3fn"],
    "d": [64, 96, 128, 192, 256],
    "mask": ["none", "causal", "local"],
    "softcap": [0.0, 15.0],
    "sink": [False, True],
    "heads": [(4, 4), (8, 2), (4, 1)],
    "seqlens": SEQLEN_PAIRS,
    "layout": ["contiguous", "strided"],
}


def pairwise(axes: dict[str, list], seed: int = 0, candidates: int = 40) -> list[dict]:
    """A covering array of strength 2: rows (one value per axis) such that every pair of values
    of every two axes appears in some row.  Greedy (AETG-style): each new row is the best of
    ``candidates`` random rows seeded by an uncovered pair; deterministic from ``seed``."""
    import itertools
    import random

    names = list(axes)
    rng = random.Random(seed)
    uncovered = {
        (a, i, b, j)
        for a, b in itertools.combinations(range(len(names)), 2)
        for i in range(len(axes[names[a]]))
        for j in range(len(axes[names[b]]))
    }
    rows = []
    while uncovered:
        a, i, b, j = min(uncovered)
        best, gain = None, -1
        for _ in range(candidates):
            row = [rng.randrange(len(axes[n])) for n in names]
            row[a], row[b] = i, j
            g = sum((x, row[x], y, row[y]) in uncovered for x, y in itertools.combinations(range(len(names)), 2))
            if g > gain:
                best, gain = row, g
        for x, y in itertools.combinations(range(len(names)), 2):
            uncovered.discard((x, best[x], y, best[y]))
        rows.append({n: axes[n][best[k]] for k, n in enumerate(names)})
    return rows


def release_case(row: dict, family: str, seed: int) -> Case:
    """The case of a covering-array row (one value per axis of ``RELEASE_AXES``; the mask axis
    also takes a window, a (left, right) pair: local with that window) for ``family``.  Public:
    ``audits.suites.domain`` places a domain's rows with it."""
    sq, sk = row["seqlens"]
    hq, hk = row["heads"]
    mask = row["mask"]
    window = (128, 32) if mask == "local" else tuple(mask) if isinstance(mask, (tuple, list)) else (None, None)
    if family == "nan_inf_masked":  # needs keys that no query sees: a left window short of them
        window, sq = (64, 0), min(sq, max(1, sk - 80))
        if sk - sq - 64 <= 0:
            sk = sq + 80
    d = row["d"]
    return Case(
        row["dtype"],
        d,
        d,
        1 if sq * sk > 4096 * 4096 else 2,
        hq,
        hk,
        sq,
        sk,
        causal=mask == "causal" and family != "nan_inf_masked",
        window=window,
        softcap=row["softcap"],
        sink=row["sink"],
        layout=row["layout"],
        family=family,
        seed=seed,
    )


def release_suite(seeds: tuple[int, ...] = (0,), extra_pairs: list | None = None) -> list[Case]:
    """A pairwise-covering array of FA's test axes (``RELEASE_AXES``) times every input family,
    then the varlen cases (:func:`release_varlen`), the code-path cases (:func:`class_cases`) and
    the ``mods`` suite (:func:`mods_suite`)."""
    from audits.suites.inputs import FAMILIES

    axes = dict(RELEASE_AXES)
    if extra_pairs:
        axes["seqlens"] = axes["seqlens"] + list(extra_pairs)
    rows = pairwise(axes)
    cases = [release_case(r, f, s) for s in seeds for f in FAMILIES for r in rows]
    # a family's fix-ups can make two rows one case
    return list(dict.fromkeys(cases + release_varlen(seeds) + class_cases() + mods_suite()))


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
    from dataclasses import replace

    cases = []
    for s in seeds:
        for r in pairwise(VARLEN_AXES, seed=15):
            c = _varlen_release_case(r, s)
            cases += [c] if c.num_splits == 1 else [c, replace(c, num_splits=1, pack_gqa=None)]
    return list(dict.fromkeys(cases))


def nightly_suite() -> list[Case]:
    """release with three seeds and sequence lengths up to 32k, and every head dim SM90 accepts
    (:func:`head_dims_suite`)."""
    cases = release_suite(seeds=(0, 1, 2), extra_pairs=[(16384, 16384), (2048, 32768), (32768, 32768)])
    return list(dict.fromkeys(cases + head_dims_suite()))


#: the masks :func:`head_dim_sweep` takes, as (causal, window)
SWEEP_MASKS = {"none": (False, (None, None)), "causal": (True, (None, None)), "local": (False, (96, 32))}
#: the sweep's lengths: a multiple of no tile of either arch or direction (fa4.code_paths)
SWEEP_SEQLENS = (200, 333)


def _seed_of(*parts) -> int:
    """A seed derived from what names a case (stable across runs and Python versions)."""
    import zlib

    return zlib.crc32("-".join(map(str, parts)).encode()) % 100_000


def head_dim_sweep(
    *, pairs: tuple | list, dtypes: tuple | list, masks: tuple | list = ("none", "causal")
) -> list[Case]:
    """One case per (d, dv) pair x dtype x mask ("none", "causal" or "local"): batch 2, 4 query
    heads on 2 KV heads, 200 queries x 333 keys (partial tiles at both ends), family normal,
    the seed derived from the case.  Nightly's every-head-dim axis (``head-dims``)."""
    bad = [m for m in masks if m not in SWEEP_MASKS]
    if bad:
        raise ValueError(f"head_dim_sweep: mask(s) {bad} are not known; accepted: {', '.join(SWEEP_MASKS)}")
    sq, sk = SWEEP_SEQLENS
    out = []
    for d, dv in pairs:
        for dtype in dtypes:
            for m in masks:
                causal, window = SWEEP_MASKS[m]
                seed = _seed_of("head-dims", dtype, d, dv, m)
                out.append(Case(dtype, d, dv, 2, 4, 2, sq, sk, causal=causal, window=window, seed=seed))
    return out


#: every head dim production's SM90 path accepts for 16-bit inputs (``interface._validate_head_dims``:
#: 8..256, a multiple of 16 bytes / element size = 8)
SM90_HEAD_DIMS = tuple(range(8, 257, 8))


def head_dims_suite() -> list[Case]:
    """The ``head-dims`` suite: d = dv at every SM90 head dim (:data:`SM90_HEAD_DIMS`), bf16 and
    fp16, causal and not (128 cases; :func:`head_dim_sweep`)."""
    return head_dim_sweep(pairs=[(d, d) for d in SM90_HEAD_DIMS], dtypes=("bfloat16", "float16"))


#: the input families class cases take in turn: finite ones whose errors sit well inside the
#: bounds on a correct kernel (a code path's fault then shows as a plain failure), several of them
#: so that a class case's head dim or lengths, which no other case of ``release`` has, need not
#: wait for the ``normal`` slot of the run order (``audits.engine.shards.run_order``: every axis
#: value of release within its first 26 cases, ``tests/test_run_stop.py``)
_CLASS_FAMILIES = ("normal", "uniform", "student_t", "outliers", "offset", "peaked", "flat", "long_tail")


def class_cases() -> list[Case]:
    """Cases that together fall in every code-path class of every arch (``fa4.code_paths``)
    in the forward and the backward — the deterministic backward aside, a run option
    (``deterministic=True``), not a case: SM90's forward tiles by head-dim band, mask and dv; its
    backward tiles (the 80-row dQ_swapAB tile, 64x96 at both dv, 64x48); head dims padded at
    every granularity (16, 32, 64) and exact; SM100's 2-CTA and 1-CTA, one and two Q stages,
    (192, 128) and (256, 256) with the dedicated hd256 backward; GQA packed and not; softcap,
    sink, varlen, paged and split-KV (with the 64-key tile of split d != dv); score_mod,
    mask_mod, block sparsity with SM90's block-sparse tiles and runtime scalars.  Lengths off every tile; batch
    1-2.  ``tests/test_cases.py`` checks the coverage."""

    families = iter(_CLASS_FAMILIES * 4)

    def fixed(dtype, d, dv, hq, hk, sq, sk, **kw) -> Case:
        tag = "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
        seed = _seed_of("class", dtype, d, dv, hq, hk, sq, sk, tag)
        return Case(dtype, d, dv, 2, hq, hk, sq, sk, seed=seed, family=next(families), **kw)

    def var(seqlens, d, dv, hq, hk, **kw) -> Case:
        seed = _seed_of("class-varlen", seqlens, d, dv, hq, hk, sorted(kw.items()))
        return varlen_case(seqlens=seqlens, dtype="bfloat16", d=d, dv=dv, heads_q=hq, heads_kv=hk, seed=seed, **kw)

    local = (96, 32)
    return [
        fixed("bfloat16", 64, 64, 4, 2, 300, 333),  # SM90 192x128 / 128x128; SM100 q_stage 2, 1-CTA
        fixed("bfloat16", 96, 96, 2, 2, 300, 333, causal=True),  # 192x128 causal / 64x128 one-WG dQ
        fixed("float16", 96, 96, 2, 2, 300, 333),  # 192x144
        fixed("bfloat16", 128, 128, 2, 2, 300, 333),  # 128x128 / 80x128 dQ_swapAB; SM100 2-CTA both ways
        fixed("float16", 128, 128, 2, 2, 300, 333, causal=True),  # 64x128
        fixed("bfloat16", 192, 128, 2, 2, 300, 333),  # 128x128 at hd192 / 64x96; SM100 (192, 128)
        fixed("bfloat16", 192, 192, 2, 2, 300, 333),  # 128x112 / 64x96 with one dO stage
        fixed("float16", 192, 128, 2, 2, 300, 333, window=local),  # 128x96 local
        fixed("bfloat16", 256, 256, 2, 2, 300, 333),  # 128x80 / 64x48; SM100 hd256, dedicated backward
        fixed("float16", 256, 256, 2, 2, 300, 333, window=local),  # 128x64 local
        fixed("float16", 72, 72, 2, 2, 300, 333, causal=True),  # padded to 16 (SM90), 32 (SM100 backward);
        # SM90's backward accumulators wider than its tile (96 vs 80)
        fixed("bfloat16", 104, 104, 2, 2, 300, 333),  # SM90 80-row dQ_swapAB tile at padded head dim 112
        fixed("bfloat16", 200, 200, 2, 2, 300, 333),  # SM90 backward padded to 64
        fixed("bfloat16", 128, 128, 2, 2, 100, 333),  # SM100 q_stage 1: one M block, 1-CTA
        fixed("bfloat16", 256, 256, 6, 2, 300, 333),  # SM100 hd256 at 128 % 3 != 0: pack_gqa off
        fixed("bfloat16", 64, 64, 2, 2, 300, 333, softcap=15.0, sink=True),
        # the mods (docs/mods.md), at blocks production's SM90 takes in both directions: score_mod,
        # mask_mod and block sparsity; the 128-row forward tile at d <= 96 (block_q no multiple of 192);
        # runtime scalars (aux_scalars: the temperature score mod)
        fixed("bfloat16", 64, 64, 2, 2, 300, 333, score_mod="alibi", mask_mod="document", block_sparse=MOD_BLOCK),
        fixed("float16", 96, 96, 2, 2, 300, 333, score_mod="temperature", mask_mod="causal", block_sparse=MOD_BLOCK),
        # hd256 block-sparse: backward 64x64 (block_k = its tile_n 64), forward 128x80 fitted to 64
        fixed("bfloat16", 256, 256, 2, 2, 300, 333, mask_mod="sliding_window", block_sparse=(128, 64)),
        # a 64-row sparse block: the forward's tile_m 64 (a fitted tile), the backward's 64 x 128
        fixed("bfloat16", 128, 128, 2, 2, 300, 333, score_mod="softcap", mask_mod="prefix_lm", block_sparse=(64, 128)),
        var(((100, 400), (37, 300), (0, 20)), 64, 64, 4, 2, page_size=64, causal=True),  # varlen, paged
        var(((100, 400), (37, 300)), 64, 64, 4, 2, pack_gqa=False),  # GQA without pack_gqa
        var(((2, 700), (77, 400)), 64, 64, 4, 2, num_splits=3, pack_gqa=True),  # split-KV
        var(((1, 8192), (3, 8100)), 192, 128, 2, 2, num_splits=2),  # split at d != dv, 64 blocks: 64-key tiles
    ]


def _fidelity_case(d: int, sq: int, sk: int, *, hq: int = 4, hk: int = 4, b: int = 2, **kw) -> Case:
    return Case(kw.pop("dtype", "bfloat16"), d, d, b, hq, hk, sq, sk, **kw)


def fidelity_cases() -> dict[str, Case]:
    """The ``fidelity`` suite's cases by label (``--case`` globs match these labels as well as the
    case names): head dims 64-256, causal and not, GQA/MQA, seqlen_q != seqlen_k, a local window,
    softcap, a learnable sink, fp16 and drifting logits; the default of ``fa4-audit fidelity``
    (``audits.checks.fidelity.core``), whose committed H200 reports name them."""
    out = {}
    for d in (64, 96, 128, 192, 256):
        for causal in (False, True):
            for hk in (4, 1):
                label = f"d{d}{'_causal' if causal else ''}{'_mqa' if hk == 1 else ''}"
                out[label] = _fidelity_case(d, 384, 640, hk=hk, causal=causal, seed=d + causal)
        out[f"d{d}_sq_gt_sk_causal"] = _fidelity_case(d, 600, 333, causal=True, seed=d + 7)
    out.update(
        d128_window=_fidelity_case(128, 512, 512, window=(100, 20), seed=11),
        d64_window_left=_fidelity_case(64, 300, 700, window=(64, None), seed=12),
        d128_softcap=_fidelity_case(128, 256, 512, softcap=15.0, seed=13),
        d128_sink=_fidelity_case(128, 256, 384, sink=True, seed=14),
        d128_fp16=_fidelity_case(128, 256, 1024, dtype="float16", seed=15),
        d128_fp16_drift=_fidelity_case(128, 128, 2048, dtype="float16", family="drift", seed=16),
        d128_bf16_drift_gqa=_fidelity_case(128, 256, 1536, hq=8, hk=2, family="drift", seed=17),
        d256_long=_fidelity_case(256, 128, 4096, hq=2, hk=2, b=1, seed=18),
    )
    return out


def fidelity_suite() -> list[Case]:
    """:func:`fidelity_cases` in order: the model against production, case for case."""
    return list(fidelity_cases().values())


def _suites() -> dict:
    return {
        "smoke": smoke_suite,
        "release": release_suite,
        "nightly": nightly_suite,
        "head-dims": head_dims_suite,
        "fidelity": fidelity_suite,
        "mods": mods_suite,
    }


SUITES = _suites()


def suite(name: str) -> list[Case]:
    """The cases of a named suite; ValueError naming the valid ones otherwise."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; accepted: {', '.join(SUITES)}, or a suite file FILE.toml")
    return SUITES[name]()


DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
LAYOUTS = ("contiguous", "strided", "packed_qkv")


def case_from_dict(d: dict, *, where: str = "case") -> Case:
    """A :class:`Case` from its JSON form (``Case.as_dict()``, as reports and reproducers carry
    it; absent keys take the defaults).  ``ValueError`` naming ``where``, the bad key or value
    and what is accepted."""
    from dataclasses import fields

    from audits.suites.inputs import FAMILIES

    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object of Case fields, got {type(d).__name__}")
    known = {f.name: f for f in fields(Case)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; accepted: {', '.join(known)}")
    kw = dict(d)
    if "window" in kw:
        w = kw["window"]
        ok = isinstance(w, (list, tuple)) and len(w) == 2
        if not ok or not all(x is None or (isinstance(x, int) and not isinstance(x, bool) and x >= 0) for x in w):
            raise ValueError(f"{where}: window {w!r} must be [left, right], each a non-negative integer or null")
        kw["window"] = tuple(w)
    for key in ("d", "dv", "batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "seed"):
        least = 0 if key == "seed" else 1
        if key in kw and (not isinstance(kw[key], int) or isinstance(kw[key], bool) or kw[key] < least):
            raise ValueError(f"{where}: {key} = {kw[key]!r} must be an integer >= {least}")
    for key in ("causal", "sink"):
        if key in kw and not isinstance(kw[key], bool):
            raise ValueError(f"{where}: {key} = {kw[key]!r} must be true or false")
    cap = kw.get("softcap", 0.0)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0:
        raise ValueError(f"{where}: softcap = {kw['softcap']!r} must be a number >= 0 (0: off)")
    for key, accepted in (("dtype", DTYPES), ("layout", LAYOUTS), ("family", tuple(FAMILIES))):
        if key in kw and kw[key] not in accepted:
            raise ValueError(f"{where}: {key} = {kw[key]!r} is not accepted; accepted: {', '.join(accepted)}")
    _varlen_fields(kw, where)
    _mod_fields(kw, where)
    c = Case(**kw)
    if c.heads_q % c.heads_kv:
        raise ValueError(f"{where}: heads_q {c.heads_q} must be a multiple of heads_kv {c.heads_kv}")
    return c


def _nonneg_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _varlen_fields(kw: dict, where: str) -> None:
    """Validate (and turn JSON lists back into tuples) the varlen fields of a case dict."""
    pairs = kw.get("seqlens", ())
    if not isinstance(pairs, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(_nonneg_int(x) for x in p) for p in pairs
    ):
        raise ValueError(f"{where}: seqlens {pairs!r} must be a list of [seqlen_q, seqlen_k] pairs of integers >= 0")
    kw["seqlens"] = tuple(tuple(p) for p in pairs)
    used = kw.get("seqused_k", ())
    if not isinstance(used, (list, tuple)) or not all(_nonneg_int(u) for u in used):
        raise ValueError(f"{where}: seqused_k {used!r} must be a list of integers >= 0")
    if used and (len(used) != len(pairs) or any(u > p[1] for u, p in zip(used, pairs))):
        raise ValueError(f"{where}: seqused_k {list(used)} must give one count per sequence, each <= its seqlen_k")
    kw["seqused_k"] = tuple(used)
    if not _nonneg_int(kw.get("page_size", 0)):
        raise ValueError(f"{where}: page_size = {kw['page_size']!r} must be an integer >= 0 (0: contiguous KV)")
    splits = kw.get("num_splits", 1)
    if not _nonneg_int(splits) or splits < 1:
        raise ValueError(f"{where}: num_splits = {splits!r} must be an integer >= 1")
    if kw.get("pack_gqa") not in (None, True, False):
        raise ValueError(f"{where}: pack_gqa = {kw['pack_gqa']!r} must be true, false or null")
    if not pairs and (used or kw.get("page_size", 0) or splits != 1 or kw.get("pack_gqa") is not None):
        raise ValueError(f"{where}: seqused_k, page_size, num_splits and pack_gqa need a varlen case (seqlens)")
    if pairs:
        want = {"batch": len(pairs), "seqlen_q": max(p[0] for p in pairs), "seqlen_k": max(p[1] for p in pairs)}
        bad = {k: v for k, v in want.items() if k in kw and kw[k] != v}
        if bad:
            raise ValueError(f"{where}: a varlen case has {want}, got {bad} (batch and lengths follow seqlens)")
        kw.update(want)


def _mod_fields(kw: dict, where: str) -> None:
    """Validate (and turn a JSON list back into a tuple) the mod fields of a case dict: library
    names (``numerics.mod_library``), block sparsity as two positive ints and only with a
    mask_mod (the partial blocks apply it; production's ``BlockSparseTensorsTorch`` comes with
    one); a varlen case takes them too (``docs/varlen.md``, "Mods on varlen cases": the blocks per
    sequence)."""
    from numerics.mod_library import MASK_MODS, SCORE_MODS

    for key, accepted in (("score_mod", SCORE_MODS), ("mask_mod", MASK_MODS)):
        v = kw.get(key, "")
        if not isinstance(v, str) or (v and v not in accepted):
            names = ", ".join(accepted)
            raise ValueError(f"{where}: {key} = {v!r} is not accepted; accepted: {names} (or an empty string: none)")
    bs = kw.get("block_sparse", ())
    if not isinstance(bs, (list, tuple)) or (bs and (len(bs) != 2 or not all(_nonneg_int(x) and x > 0 for x in bs))):
        raise ValueError(f"{where}: block_sparse = {bs!r} must be [block_q, block_k], two positive integers (or [])")
    kw["block_sparse"] = tuple(bs)
    if bs and not kw.get("mask_mod"):
        raise ValueError(
            f"{where}: block_sparse {list(bs)} needs a mask_mod (its blocks are built from it); "
            f"accepted: {', '.join(MASK_MODS)}"
        )


def varlen_case(*, seqlens, **kw) -> Case:
    """A varlen :class:`Case`: ``seqlens`` per-sequence (seqlen_q, seqlen_k); batch and the
    largest lengths are derived.  Other fields as :class:`Case`'s."""
    pairs = tuple(tuple(p) for p in seqlens)
    if not pairs:
        raise ValueError("seqlens must name at least one sequence")
    d = {"seqlens": pairs, **kw}
    _varlen_fields(d, "varlen_case")
    return Case(**d)


def case_from_json(text: str, *, where: str, **overrides) -> Case:
    """A :class:`Case` from its JSON text (``--config``), ``overrides`` replacing fields;
    ``ValueError`` naming ``where`` when the text is not JSON or not a valid case."""
    import json

    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{where} {text!r}: not JSON; expected a JSON object of audits.suites.cases.Case fields ({exc})"
        ) from exc
    return case_from_dict({**d, **overrides} if isinstance(d, dict) else d, where=where)


def cases_from_file(path) -> list[Case]:
    """The cases of a case file: a JSON list of Case objects, JSON lines (one object per line), or
    an audit report (``report.json``, ``.gz``/``.xz``: its cases' configurations)."""
    import json
    import lzma
    from pathlib import Path

    from audits.common import read_bytes

    p = Path(path)
    try:
        p.stat()
    except OSError as exc:
        raise ValueError(f"case file {p}: cannot be read ({exc.strerror or exc})") from exc
    try:
        text = read_bytes(p).decode()
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, EOFError, UnicodeDecodeError, lzma.LZMAError, json.JSONDecodeError) as exc:
        raise ValueError(f"case file {p}: not JSON, JSON lines or a report ({type(exc).__name__}: {exc})") from exc
    if isinstance(doc, dict) and isinstance(doc.get("cases"), list):  # a report
        doc = [c.get("config") if isinstance(c, dict) else c for c in doc["cases"]]
    if not isinstance(doc, list) or not doc:
        raise ValueError(f"case file {p}: expected a non-empty list of Case objects (or a report)")
    return [case_from_dict(d, where=f"case file {p}, entry {i + 1}") for i, d in enumerate(doc)]
