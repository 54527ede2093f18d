"""What a kernel supports: its declared domain (issue 14's building block).

A kernel declares it as an attribute of the callable, a plain dict whose keys are optional
(absent = no restriction)::

    fn.fa4_audit_domain = {
        "dtypes": ["float16"], "head_dims": [64, 128],
        "seqlen_multiple": 128, "equal_seqlens": True, "max_seqlen": 8192,
        "causal": True, "local": False, "softcap": False, "sink": False, "gqa": True,
        "layouts": ["contiguous", "strided"], "backward": False, "deterministic": False,
        "mods": ["score_mod", "mask_mod", "block_sparse", "aux_scalars"],
    }

or in a TOML file with the same keys (a file narrows what the attribute allows); the attribute
may be a callable returning the dict, evaluated when asked (production's depends on the GPU).
``head_dims`` takes ints (d == dv), [d, dv] pairs, ranges with a step and products of two
ranges, and lists mixing them (:class:`HeadDims`, :data:`HEAD_DIM_FORMS`): production SM100's
``[{"d": {"min": 8, "max": 128, "step": 8}, "dv": {"min": 8, "max": 128, "step": 8}}, [192, 128],
256, [64, 512], 512]``.  Head dims are one set for every dtype: what depends on the dtype
(production SM100's fp8 alignment of 16) stays a run-time refusal.  ``seqlen_q_multiple`` /
``seqlen_k_multiple`` constrain the two lengths apart (``seqlen_multiple``: both).  ``mods``: the
kinds of the programmable surface the kernel takes (``audits.suites.case.MOD_KINDS``: "score_mod",
"mask_mod", "block_sparse", "aux_scalars"; ``docs/mods.md``).  In a kernel's own declaration (:func:`domain_of`)
an absent ``mods`` means *none*, unlike every other key: a kernel that does not say it takes a
score_mod has its mod cases skipped as outside its domain (and left out of the suites built for
it), never run without the mod and passed.  Elsewhere (a ``--domain`` file, ``Domain()``) an
absent ``mods`` restricts nothing, as every absent key.

:func:`domain_of` reads the attribute; :meth:`Domain.narrow` / :meth:`Domain.widen` take the
intersection / the union (several kernels sharing one suite); :meth:`Domain.from_dict` /
:meth:`Domain.from_toml` check every key and value and raise :class:`DomainError` naming the
bad one, where it came from and what is accepted; :meth:`Domain.refusal` says why a case lies
outside (None: inside).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from audits.common import read_toml
from audits.suites.case import DTYPES, LAYOUTS, MOD_KINDS, Case

__all__ = ["Domain", "DomainError", "HeadDims", "HEAD_DIM_FORMS", "domain_of", "seqlens_within"]

_BOOL_KEYS = ("equal_seqlens", "causal", "local", "softcap", "sink", "gqa", "backward", "deterministic")
_MULTIPLE_KEYS = ("seqlen_q_multiple", "seqlen_k_multiple")


class DomainError(ValueError):
    """A malformed domain declaration; the message names the key, the value, where it was read
    and what is accepted."""


#: the forms a ``head_dims`` value takes (error messages name them)
HEAD_DIM_FORMS = (
    "an int d (d == dv), a [d, dv] pair, a range {min, max, step} (d == dv, step default 1), a table "
    "{d = int or range, dv = int or range} (every pair of the two), or a non-empty list of these (their union); "
    "positive integers, min <= max"
)


@dataclass(frozen=True)
class _Steps:
    """The integers ``first, first + step, ..., last`` (``last`` reached exactly; one value: step 1)."""

    first: int
    last: int
    step: int

    @staticmethod
    def make(lo: int, hi: int, step: int) -> _Steps | None:
        """``lo..hi`` by ``step``, its last value the largest one not above ``hi``; None when empty."""
        if lo > hi:
            return None
        last = lo + (hi - lo) // step * step
        return _Steps(lo, last, step if last > lo else 1)

    def __contains__(self, x: int) -> bool:
        return self.first <= x <= self.last and (x - self.first) % self.step == 0

    def values(self) -> range:
        return range(self.first, self.last + 1, self.step)

    def meet(self, other: _Steps) -> _Steps | None:
        """The values in both (an arithmetic progression again, of step lcm; None when none)."""
        lo, hi = max(self.first, other.first), min(self.last, other.last)
        if lo > hi:
            return None
        # the first value >= self.first in self's progression that is also in other's
        x0 = next(
            (x for x in (self.first + self.step * k for k in range(other.step)) if (x - other.first) % other.step == 0),
            None,
        )
        if x0 is None:
            return None
        step = _lcm(self.step, other.step)
        return _Steps.make(lo + (x0 - lo) % step, hi, step)

    def issubset(self, other: _Steps) -> bool:
        return (
            self.first in other and self.last <= other.last and (self.first == self.last or self.step % other.step == 0)
        )

    def as_value(self):
        """The dict form: the int for one value, else ``{"min", "max", "step"}``."""
        return self.first if self.first == self.last else {"min": self.first, "max": self.last, "step": self.step}

    def __str__(self) -> str:
        if self.first == self.last:
            return str(self.first)
        return f"{self.first}..{self.last}" + (f" step {self.step}" if self.step != 1 else "")


@dataclass(frozen=True)
class _Part:
    """One declared piece of a head-dim set: every pair of ``ds`` x ``dvs``, or (``same``) the
    pairs (x, x) for x in ``ds`` (then ``dvs is ds``)."""

    ds: _Steps
    dvs: _Steps
    same: bool = False

    def __contains__(self, p: tuple[int, int]) -> bool:
        d, dv = p
        return d in self.ds and dv in self.dvs and (not self.same or d == dv)

    def pairs(self):
        if self.same:
            return ((x, x) for x in self.ds.values())
        return ((d, dv) for d in self.ds.values() for dv in self.dvs.values())

    def size(self) -> int:
        n = len(self.ds.values())
        return n if self.same else n * len(self.dvs.values())

    def meet(self, other: _Part) -> _Part | None:
        if self.same or other.same:
            r = self.ds.meet(other.ds)
            r = r and r.meet(self.dvs)
            r = r and r.meet(other.dvs)
            return r and _Part(r, r, True)
        ds, dvs = self.ds.meet(other.ds), self.dvs.meet(other.dvs)
        return _Part(ds, dvs) if ds and dvs else None

    def issubset(self, other: _Part) -> bool:
        if self.size() == 1:
            return next(iter(self.pairs())) in other
        if self.same:  # (other.dvs is other.ds when other is a diagonal too)
            return self.ds.issubset(other.ds) and self.ds.issubset(other.dvs)
        return not other.same and self.ds.issubset(other.ds) and self.dvs.issubset(other.dvs)

    def as_value(self):
        if self.same:
            return self.ds.as_value()
        if self.ds.first == self.ds.last and self.dvs.first == self.dvs.last:
            return [self.ds.first, self.dvs.first]
        return {"d": self.ds.as_value(), "dv": self.dvs.as_value()}

    def __str__(self) -> str:
        if self.same:
            return f"d = dv in {self.ds}" if self.ds.first != self.ds.last else f"({self.ds}, {self.ds})"
        if self.ds.first == self.ds.last and self.dvs.first == self.dvs.last:
            return f"({self.ds}, {self.dvs})"
        return f"d in {self.ds} x dv in {self.dvs}"


class HeadDims:
    """A set of (d, dv) head-dim pairs, kept as the union of the pieces declared (pairs, ranges
    with a step, products of two ranges; :data:`HEAD_DIM_FORMS`), so that production's SM90
    "every multiple of 8 in 8..256 for d and dv" is one piece, not 1,024 pairs.  Equality,
    hashing and iteration are the set's (sorted pairs); :meth:`meet` (intersection) and
    :meth:`join` (union) are exact; :meth:`as_value` gives the dict form back, which
    :meth:`parse` reads to an equal set."""

    __slots__ = ("_parts", "_pairs")

    def __init__(self, parts):
        kept: list[_Part] = []
        for p in parts:  # drop a piece inside another one (the union is unchanged)
            if p is None or any(p.issubset(q) for q in kept):
                continue
            kept = [q for q in kept if not q.issubset(p)] + [p]
        self._parts = tuple(kept)
        self._pairs = None

    @classmethod
    def parse(cls, value, *, where: str, key: str = "head_dims") -> HeadDims:
        """The set a declared value states (:data:`HEAD_DIM_FORMS`), or :class:`DomainError`
        naming ``key``, the value, ``where`` and the accepted forms."""
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if not items:
            raise DomainError(f"{where}: domain key {key!r} = {value!r}: expected {HEAD_DIM_FORMS}")
        parts = []
        for item in items:
            part = _part(item)
            if part is None:
                bad = "" if item is value else f" (the item {item!r})"
                raise DomainError(f"{where}: domain key {key!r} = {value!r}{bad}: expected {HEAD_DIM_FORMS}")
            parts.append(part)
        return cls(parts)

    @classmethod
    def of(cls, pairs) -> HeadDims:
        """The set of the given (d, dv) pairs."""
        return cls(_Part(_Steps(d, d, 1), _Steps(dv, dv, 1)) for d, dv in pairs)

    def contains(self, d: int, dv: int) -> bool:
        """Whether (d, dv) is in the set (decided on the pieces, nothing enumerated)."""
        return any((d, dv) in p for p in self._parts)

    def __contains__(self, pair) -> bool:
        return self.contains(*pair)

    def pairs(self) -> tuple[tuple[int, int], ...]:
        """Every pair, sorted (enumerated once, then kept)."""
        if self._pairs is None:
            self._pairs = tuple(sorted({p for part in self._parts for p in part.pairs()}))
        return self._pairs

    def __iter__(self):
        return iter(self.pairs())

    def __len__(self) -> int:
        return len(self.pairs())

    def __eq__(self, other) -> bool:
        if not isinstance(other, HeadDims):
            return NotImplemented
        return self._parts == other._parts or self.pairs() == other.pairs()

    def __hash__(self) -> int:
        return hash(self.pairs())

    def meet(self, other: HeadDims) -> HeadDims:
        """The pairs in both (each piece of one intersected with each of the other)."""
        return HeadDims(a.meet(b) for a in self._parts for b in other._parts)

    def join(self, other: HeadDims) -> HeadDims:
        """The pairs in either (the pieces of both)."""
        return HeadDims(self._parts + other._parts)

    def as_value(self) -> list:
        """The dict form: a list of the pieces (:data:`HEAD_DIM_FORMS`)."""
        return [p.as_value() for p in self._parts]

    def __str__(self) -> str:
        return "{" + ", ".join(str(p) for p in self._parts) + "}"

    def __repr__(self) -> str:
        return f"HeadDims({self.as_value()!r})"


def _positive(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _is_pair(v) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 2 and all(_positive(x) for x in v)


def _steps(v) -> _Steps | None:
    """An int or a ``{min, max, step}`` range as :class:`_Steps`; None when malformed or empty."""
    if _positive(v):
        return _Steps(v, v, 1)
    if not isinstance(v, dict) or not {"min", "max"} <= set(v) <= {"min", "max", "step"}:
        return None
    lo, hi, step = v["min"], v["max"], v.get("step", 1)
    if not all(_positive(x) for x in (lo, hi, step)):
        return None
    return _Steps.make(lo, hi, step)


def _part(item) -> _Part | None:
    """One item of a ``head_dims`` value as a :class:`_Part`; None when malformed."""
    if _is_pair(item):
        return _Part(_Steps(item[0], item[0], 1), _Steps(item[1], item[1], 1))
    if isinstance(item, dict) and set(item) == {"d", "dv"}:
        ds, dvs = _steps(item["d"]), _steps(item["dv"])
        return _Part(ds, dvs) if ds and dvs else None
    r = _steps(item)
    return r and _Part(r, r, True)


@dataclass(frozen=True)
class Domain:
    """A kernel's supported configurations.  dtypes, layouts: None = any; head_dims: a
    :class:`HeadDims` set of (d, dv) pairs (None = any; a list of pairs or any form of
    :data:`HEAD_DIM_FORMS` given here is read into one); seqlen_q_multiple / seqlen_k_multiple:
    each length a multiple of its own (the dict key ``seqlen_multiple`` sets both);
    equal_seqlens: seqlen_q == seqlen_k; min_seqlen / max_seqlen: bounds on both lengths;
    causal, local (windows), softcap, sink (a learnable sink), gqa (heads_q > heads_kv):
    supported or not; backward, deterministic: whether ``run --backward`` / ``--deterministic``
    apply; mods: the mod kinds supported (:data:`audits.suites.case.MOD_KINDS`; None = any, () = none:
    a kernel's declaration without the key reads as none, :func:`domain_of`)."""

    dtypes: tuple[str, ...] | None = None
    head_dims: HeadDims | None = None
    seqlen_q_multiple: int = 1
    seqlen_k_multiple: int = 1
    equal_seqlens: bool = False
    min_seqlen: int = 1
    max_seqlen: int | None = None
    causal: bool = True
    local: bool = True
    softcap: bool = True
    sink: bool = True
    gqa: bool = True
    layouts: tuple[str, ...] | None = None
    backward: bool = True
    deterministic: bool = True
    mods: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.head_dims is not None and not isinstance(self.head_dims, HeadDims):
            object.__setattr__(self, "head_dims", HeadDims.parse(self.head_dims, where="Domain(head_dims=...)"))
        # one order (MOD_KINDS'), so that equal sets compare equal however they were declared
        if self.mods is not None:
            object.__setattr__(self, "mods", _mod_kinds(self.mods, where="Domain(mods=...)"))

    def unrestricted_but_mods(self) -> bool:
        """Whether the domain restricts no case but by its mod kinds (``backward`` and
        ``deterministic`` choose no case): a named suite is then built as it is defined."""
        return dataclasses.replace(self, backward=True, deterministic=True, mods=None) == Domain()

    def takes(self, kind: str) -> bool:
        """Whether the domain takes the mod kind ``kind`` (one of :data:`audits.suites.case.MOD_KINDS`)."""
        return self.mods is None or kind in self.mods

    @property
    def seqlen_multiple(self) -> int:
        """A length both queries and keys may take: the lcm of the two multiples (the block that
        lengths made for this domain are multiples of)."""
        return _lcm(self.seqlen_q_multiple, self.seqlen_k_multiple)

    @classmethod
    def from_dict(cls, d, *, where: str) -> Domain:
        """The domain a dict declares (keys optional), every key and value checked; the shorthand
        ``seqlen_multiple`` sets both length multiples (a specific one given too must agree)."""
        keys = (*_FIELDS, "seqlen_multiple")
        if not isinstance(d, dict):
            raise DomainError(f"{where}: a domain is a dict of keys {', '.join(keys)}, got {type(d).__name__}")
        unknown = sorted(set(d) - set(keys))
        if unknown:
            raise DomainError(f"{where}: unknown domain key(s) {', '.join(unknown)}; accepted: {', '.join(keys)}")
        values = {k: _value(k, v, where) for k, v in d.items()}
        both = values.pop("seqlen_multiple", None)
        if both is not None:
            for k in _MULTIPLE_KEYS:
                if values.setdefault(k, both) != both:
                    raise DomainError(
                        f"{where}: domain keys 'seqlen_multiple' = {both} and {k!r} = {values[k]} disagree; "
                        f"give seqlen_multiple (both lengths) or seqlen_q_multiple / seqlen_k_multiple, or equal values"
                    )
        return cls(**values)

    @classmethod
    def from_toml(cls, path: str | Path) -> Domain:
        """The domain a TOML file declares (top-level keys, as the dict form)."""
        return cls.from_dict(read_toml(path, what="domain", error=DomainError), where=str(path))

    def head_dim_pairs(self) -> tuple[tuple[int, int], ...] | None:
        """Every accepted (d, dv) pair, sorted; None when head dims are unrestricted."""
        return None if self.head_dims is None else self.head_dims.pairs()

    def accepts_head_dims(self, d: int, dv: int) -> bool:
        """Whether the domain accepts head dims (d, dv) (decided without enumerating the set)."""
        return self.head_dims is None or self.head_dims.contains(d, dv)

    def narrow(self, other: Domain) -> Domain:
        """What both allow (a ``--domain`` file narrowing the kernel's own declaration): the
        intersection of the listed values and head-dim sets, the lcm of each length multiple."""

        def meet(a, b):
            return b if a is None else a if b is None else tuple(x for x in a if x in b)

        lo = [m for m in (self.max_seqlen, other.max_seqlen) if m is not None]
        hd = (
            other.head_dims
            if self.head_dims is None
            else self.head_dims
            if other.head_dims is None
            else (self.head_dims.meet(other.head_dims))
        )
        return Domain(
            dtypes=meet(self.dtypes, other.dtypes),
            head_dims=hd,
            **{k: _lcm(getattr(self, k), getattr(other, k)) for k in _MULTIPLE_KEYS},
            equal_seqlens=self.equal_seqlens or other.equal_seqlens,
            min_seqlen=max(self.min_seqlen, other.min_seqlen),
            max_seqlen=min(lo) if lo else None,
            layouts=meet(self.layouts, other.layouts),
            mods=meet(self.mods, other.mods),
            **{k: getattr(self, k) and getattr(other, k) for k in _BOOL_KEYS if k != "equal_seqlens"},
        )

    def widen(self, other: Domain) -> Domain:
        """What either allows, key by key (the box around both: several kernels sharing one suite,
        each skipping the cases outside its own domain): the union of the listed values and
        head-dim sets (None, any, wins), the gcd of each length multiple, equal lengths only if
        both want them, the smaller minimum and the larger maximum (None wins), each feature if
        either supports it."""

        def join(a, b):
            return None if a is None or b is None else tuple(dict.fromkeys(a + b))

        hi = None if self.max_seqlen is None or other.max_seqlen is None else max(self.max_seqlen, other.max_seqlen)
        hd = None if self.head_dims is None or other.head_dims is None else self.head_dims.join(other.head_dims)
        return Domain(
            dtypes=join(self.dtypes, other.dtypes),
            head_dims=hd,
            **{k: math.gcd(getattr(self, k), getattr(other, k)) for k in _MULTIPLE_KEYS},
            equal_seqlens=self.equal_seqlens and other.equal_seqlens,
            min_seqlen=min(self.min_seqlen, other.min_seqlen),
            max_seqlen=hi,
            layouts=join(self.layouts, other.layouts),
            mods=join(self.mods, other.mods),
            **{k: getattr(self, k) or getattr(other, k) for k in _BOOL_KEYS if k != "equal_seqlens"},
        )

    def refusal(self, case: Case) -> str | None:
        """Why ``case`` lies outside the domain (the first reason found), None when inside.  A
        varlen case's lengths are checked per sequence (:meth:`_lengths_refusal`)."""
        lengths = self._lengths_refusal(case)
        checks = (
            (self.dtypes is not None and case.dtype not in self.dtypes, f"dtype {case.dtype} not in {self.dtypes}"),
            (not self.accepts_head_dims(case.d, case.dv), f"head dims ({case.d}, {case.dv}) not in {self.head_dims}"),
            (lengths is not None, lengths),
            (case.causal and not self.causal, "causal masking unsupported"),
            (case.local and not self.local, "local windows unsupported"),
            (case.softcap > 0 and not self.softcap, "softcap unsupported"),
            (case.sink and not self.sink, "learnable sink unsupported"),
            (case.heads_q != case.heads_kv and not self.gqa, "GQA/MQA unsupported"),
            (
                self.layouts is not None and case.layout not in self.layouts,
                f"layout {case.layout} not in {self.layouts}",
            ),
        )
        return next((why for bad, why in checks if bad), None) or self._mods_refusal(case)

    def _mods_refusal(self, case: Case) -> str | None:
        """Why the case's mods lie outside (the first kind the domain does not declare), or None."""
        kind = next((k for k in case.mods if not self.takes(k)), None)
        if kind is None:
            return None
        have = ", ".join(self.mods) if self.mods else "none"
        return (
            f"{kind} unsupported (the domain's mods: {have}; a kernel taking it declares "
            f"mods = [{', '.join(repr(k) for k in MOD_KINDS)}] or the kinds it takes)"
        )

    def _length_refusal(self, sq: int, sk: int) -> str | None:
        """Why lengths ``sq`` x ``sk`` lie outside the domain's length keys, or None."""
        qm, km = self.seqlen_q_multiple, self.seqlen_k_multiple
        checks = (
            (qm == km and (sq % qm or sk % km), f"seqlens {sq}x{sk} not multiples of {qm}"),
            (sq % qm, f"seqlen_q {sq} not a multiple of {qm}"),
            (sk % km, f"seqlen_k {sk} not a multiple of {km}"),
            (self.equal_seqlens and sq != sk, "seqlen_q != seqlen_k"),
            (min(sq, sk) < self.min_seqlen, f"a seqlen below {self.min_seqlen}"),
            (self.max_seqlen is not None and max(sq, sk) > self.max_seqlen, f"a seqlen above {self.max_seqlen}"),
        )
        return next((why for bad, why in checks if bad), None)

    def _lengths_refusal(self, case: Case) -> str | None:
        """The length keys on ``case``: a fixed-length case's lengths; a varlen case's per sequence
        with queries and keys (its rows and used keys: what a sequence computes), each as a call
        of those lengths would be judged.  Sequences without queries or keys are the varlen
        entry's business (rows of no sequence; rows with no key): no length key speaks of them."""
        if not case.varlen:
            return self._length_refusal(case.seqlen_q, case.seqlen_k)
        for i, (sq, sk) in enumerate(case.seqlens):
            used = case.seqused_k[i] if case.seqused_k else sk
            why = self._length_refusal(sq, used) if sq and used else None
            if why is not None:
                return f"sequence {i}: {why}"
        return None

    def as_dict(self) -> dict:
        """The declaration in the dict form (lists for tuples, head dims as
        :meth:`HeadDims.as_value`; ``mods`` left out when None, any), for reports; ``from_dict``
        reads it back to an equal domain."""
        out = {}
        for f in _FIELDS:
            v = getattr(self, f)
            out[f] = v.as_value() if isinstance(v, HeadDims) else list(v) if isinstance(v, tuple) else v
        if self.mods is None:  # any (absent, as a --domain file says it; TOML has no null)
            del out["mods"]
        return out


_FIELDS = tuple(f.name for f in dataclasses.fields(Domain))
#: the keys whose None means "any" (as absent)
_NULLABLE = tuple(f.name for f in dataclasses.fields(Domain) if f.default is None)


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def _value(key: str, v, where: str):
    """One declared value, checked and normalised (tuples for lists, :class:`HeadDims`)."""
    bad = lambda want: DomainError(f"{where}: domain key {key!r} = {v!r}: expected {want}")
    if v is None and key in _NULLABLE:  # as_dict's "any" (TOML has no null: there the key is left out)
        return None
    if key in _BOOL_KEYS:
        if not isinstance(v, bool):
            raise bad("true or false")
        return v
    if key in ("seqlen_multiple", *_MULTIPLE_KEYS, "min_seqlen", "max_seqlen"):
        if not _positive(v):
            raise bad("a positive integer")
        return v
    if key == "mods":
        return _mod_kinds(v, where=where)
    accepted = {"dtypes": DTYPES, "layouts": LAYOUTS}.get(key)
    if accepted is not None:
        if not isinstance(v, (list, tuple)) or not v or any(x not in accepted for x in v):
            raise bad(f"a non-empty list of {', '.join(accepted)}")
        return tuple(v)
    return HeadDims.parse(v, where=where, key=key)


def _mod_kinds(v, *, where: str) -> tuple[str, ...]:
    """A declared ``mods`` value: a list (possibly empty: none) of :data:`audits.suites.case.MOD_KINDS`,
    returned in MOD_KINDS' order without repeats; :class:`DomainError` naming the accepted kinds."""
    if not isinstance(v, (list, tuple)) or any(not isinstance(x, str) or x not in MOD_KINDS for x in v):
        raise DomainError(
            f"{where}: domain key 'mods' = {v!r}: expected a list of {', '.join(MOD_KINDS)} (the mod kinds the "
            "kernel takes; [] or absent: none)"
        )
    return tuple(k for k in MOD_KINDS if k in v)


def domain_of(fn) -> Domain:
    """The domain a kernel declares (its ``fa4_audit_domain`` attribute: a dict or a Domain, or
    a callable returning one, evaluated now: production's depends on the GPU it runs on); the
    unrestricted domain when it declares none — but for the mods: a declaration that does not
    name ``mods`` (or none at all) takes none (module doc)."""
    d = getattr(fn, "fa4_audit_domain", None)
    if callable(d):
        d = d()
    if d is None:
        return Domain(mods=())
    if not isinstance(d, Domain):
        d = Domain.from_dict(d, where=f"{getattr(fn, '__qualname__', fn)!s}.fa4_audit_domain")
    return d if d.mods is not None else dataclasses.replace(d, mods=())


#: multiples of the domain's block that generated lengths take: one block, not-a-power-of-two
#: multiples, and long ones (capped by max_seqlen, or at 8192 when it has none)
_LENGTH_MULTIPLES = (1, 3, 5, 8, 17, 33, 64)
_DEFAULT_MAX = 8192


#: the Domain fields that constrain lengths
_LENGTH_FIELDS = (*_MULTIPLE_KEYS, "equal_seqlens", "min_seqlen", "max_seqlen")


def seqlens_within(d: Domain, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(seqlen_q, seqlen_k) pairs inside the domain: the given ones it admits, and lengths made
    from its block (the lcm of its two multiples; ``_LENGTH_MULTIPLES``: the smallest, odd
    multiples, long ones), as equal pairs and, unless the domain wants equal lengths, as
    neighbouring unequal pairs both ways, and partial blocks (:func:`_partial_blocks`) when one
    length's multiple is finer than the other's."""
    probe = lambda sq, sk: Case(seqlen_q=sq, seqlen_k=sk, dtype=(d.dtypes or ("bfloat16",))[0])
    free = Domain(**{k: getattr(d, k) for k in _LENGTH_FIELDS})
    kept = [p for p in pairs if free.refusal(probe(*p)) is None]
    if free == Domain():  # no constraint on the lengths: the suite's own pairs
        return kept
    m, hi = d.seqlen_multiple, d.max_seqlen or _DEFAULT_MAX
    lengths = [m * k for k in _LENGTH_MULTIPLES if d.min_seqlen <= m * k <= hi]
    made = [(n, n) for n in lengths]
    if not d.equal_seqlens:
        made += [p for a, b in zip(lengths, lengths[1:]) for p in ((a, b), (b, a))]
        made += _partial_blocks(d, lengths[:3], hi)
    return list(dict.fromkeys(kept + made))


def _partial_blocks(d: Domain, lengths: list[int], hi: int) -> list[tuple[int, int]]:
    """For a domain whose two length multiples differ (keys in blocks of 64, queries free):
    pairs whose finer length is not a multiple of the coarser one (a kernel tiling by the
    coarser block meets a partial block there), the coarser length ``n`` of ``lengths`` and the
    finer ``n - r`` and ``n + r``, ``r`` the finer multiple nearest half the coarser one."""
    qm, km = d.seqlen_q_multiple, d.seqlen_k_multiple
    if qm == km:
        return []
    fine, coarse = min(qm, km), max(qm, km)
    r = fine * max(1, coarse // 2 // fine)  # 0 < r < coarse: n +- r is no multiple of coarse
    out = []
    for n in lengths:
        for x in (n - r, n + r):
            if max(d.min_seqlen, 1) <= x <= hi:
                out.append((x, n) if qm < km else (n, x))
    return out
