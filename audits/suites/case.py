"""An audit case: :class:`Case`, one configuration of the audited call plus its inputs' family and
seed, and its JSON forms (:func:`case_from_dict`, :func:`case_from_json`, :func:`cases_from_file`).
:meth:`Case.call` gives the parts of it that select production's code path, which
``fa4.code_paths.classes_of`` maps to code-path classes.  :meth:`Case.identity` (and
:func:`identity_of` for a report's ``config``) is a case's identity: what reports are compared by."""

from __future__ import annotations

import hashlib
import json
import lzma
import zlib
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from audits.common import read_bytes
from audits.suites.inputs import ADVERSARIAL_FAMILIES, FAMILIES
from fa4.code_paths import Call
from numerics.mod_library import MASK_MODS, SCALAR_SCORE_MODS, SCORE_MODS

__all__ = [
    "Case",
    "MOD_KINDS",
    "DTYPES",
    "LAYOUTS",
    "case_from_dict",
    "case_from_json",
    "cases_from_file",
    "varlen_case",
    "seed_of",
    "identity_of",
    "canonical_identity",
    "IDENTITY_PREFIX",
]

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

    @property
    def identity(self) -> str:
        """This case's identity (:func:`canonical_identity`): a key from its configuration alone,
        never its name or its place in a suite."""
        return canonical_identity(self, ignore_seed=False)

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


DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
LAYOUTS = ("contiguous", "strided", "packed_qkv")


def case_from_dict(d: dict, *, where: str = "case") -> Case:
    """A :class:`Case` from its JSON form (``Case.as_dict()``, as reports and reproducers carry
    it; absent keys take the defaults).  ``ValueError`` naming ``where``, the bad key or value
    and what is accepted."""
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
    for key, accepted in (("dtype", DTYPES), ("layout", LAYOUTS), ("family", (*FAMILIES, *ADVERSARIAL_FAMILIES))):
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


#: the prefix of every case identity ("cfg-" + 16 hex digits), telling it from a case name
IDENTITY_PREFIX = "cfg-"


def _canonical(value):
    """A field value in the one JSON form its identity hashes: tuples as lists, recursively."""
    if isinstance(value, (tuple, list)):
        return [_canonical(v) for v in value]
    return value


def canonical_identity(case: Case, *, ignore_seed: bool = False) -> str:
    """A case's identity: ``"cfg-"`` + the first 16 hex digits of the SHA-256 of its canonical
    configuration, the JSON object (keys sorted, no spaces) of every :class:`Case` field whose value
    differs from the field's default, float fields as floats (a softcap of 15 and of 15.0 are one
    case), tuples as lists.  The fields are what determines the inputs and the call (shape, dtype,
    flags, layout, mods, varlen layout, input family and seed), so two reports hold the same case
    exactly when its identity is equal, whatever its name (names are for people, and their format
    has changed between versions) or its place in a suite.  Fields at their default are left out so
    that a field added to :class:`Case` later (with a default: the behaviour of before) moves no
    earlier case's identity; ``tests/test_case_identity.py`` pins the identities of fixed
    configurations, so a changed default, which would move them, is caught.  ``ignore_seed``: the
    identity without the seed (``diff`` / ``gate --ignore-seed``: the same configuration drawn
    from another seed).  64 bits: the chance that two of 10^5 distinct cases share one is about
    3e-10."""
    canon = {}
    for f in fields(Case):
        if ignore_seed and f.name == "seed":
            continue
        v = getattr(case, f.name)
        default = f.default if f.default is not MISSING else None
        if v == default and (type(v) is type(default) or isinstance(default, float)):  # 0 == 0.0 == False
            continue
        canon[f.name] = float(v) if isinstance(default, float) and not isinstance(v, bool) else _canonical(v)
    text = json.dumps(canon, sort_keys=True, separators=(",", ":"))
    return IDENTITY_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:16]


def identity_of(config: Mapping, *, ignore_seed: bool = False, where: str = "case config") -> str:
    """The identity (:func:`canonical_identity`) of a case record's ``config`` (``Case.as_dict``,
    as reports carry it, of any version: absent fields take their defaults); ``ValueError`` naming
    ``where`` for a config that is not a valid case (:func:`case_from_dict`)."""
    return canonical_identity(case_from_dict(dict(config), where=where), ignore_seed=ignore_seed)


def seed_of(*parts) -> int:
    """A seed derived from what names a case (stable across runs and Python versions)."""
    return zlib.crc32("-".join(map(str, parts)).encode()) % 100_000
