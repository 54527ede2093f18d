"""What a kernel supports: its declared domain (issue 14's building block).

A kernel declares it as an attribute of the callable, a plain dict whose keys are optional
(absent = no restriction)::

    fn.fa4_audit_domain = {
        "dtypes": ["float16"], "head_dims": [[64, 64], [128, 128]],
        "seqlen_multiple": 128, "equal_seqlens": True, "max_seqlen": 8192,
        "causal": True, "local": False, "softcap": False, "sink": False, "gqa": True,
        "layouts": ["contiguous", "strided"], "backward": False, "deterministic": False,
    }

or in a TOML file with the same keys (a file narrows what the attribute allows); the attribute
may be a callable returning the dict, evaluated when asked (production's depends on the GPU).
:func:`domain_of` reads the attribute; :meth:`Domain.narrow` / :meth:`Domain.widen` take the
intersection / the union (several kernels sharing one suite); :meth:`Domain.from_dict` / :meth:`Domain.from_toml` check
every key and value and raise :class:`DomainError` naming the bad one, where it came from and
what is accepted; :meth:`Domain.refusal` says why a case lies outside (None: inside).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from audits.cases import DTYPES, LAYOUTS, Case
from audits.common import read_toml

__all__ = ["Domain", "DomainError", "domain_of"]

_BOOL_KEYS = ("equal_seqlens", "causal", "local", "softcap", "sink", "gqa", "backward", "deterministic")


class DomainError(ValueError):
    """A malformed domain declaration; the message names the key, the value, where it was read
    and what is accepted."""


@dataclass(frozen=True)
class Domain:
    """A kernel's supported configurations.  dtypes, head_dims ((d, dv) pairs), layouts: None =
    any; seqlen_multiple: both lengths multiples of it; equal_seqlens: seqlen_q == seqlen_k;
    min_seqlen / max_seqlen: bounds on both lengths; causal, local (windows), softcap, sink (a
    learnable sink), gqa (heads_q > heads_kv): supported or not; backward, deterministic: whether
    ``run --backward`` / ``--deterministic`` apply."""

    dtypes: tuple[str, ...] | None = None
    head_dims: tuple[tuple[int, int], ...] | None = None
    seqlen_multiple: int = 1
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

    @classmethod
    def from_dict(cls, d, *, where: str) -> Domain:
        """The domain a dict declares (keys optional), every key and value checked."""
        if not isinstance(d, dict):
            raise DomainError(f"{where}: a domain is a dict of keys {', '.join(_FIELDS)}, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_FIELDS))
        if unknown:
            raise DomainError(f"{where}: unknown domain key(s) {', '.join(unknown)}; accepted: {', '.join(_FIELDS)}")
        return cls(**{k: _value(k, v, where) for k, v in d.items()})

    @classmethod
    def from_toml(cls, path: str | Path) -> Domain:
        """The domain a TOML file declares (top-level keys, as the dict form)."""
        return cls.from_dict(read_toml(path, what="domain", error=DomainError), where=str(path))

    def narrow(self, other: Domain) -> Domain:
        """What both allow (a ``--domain`` file narrowing the kernel's own declaration)."""

        def meet(a, b):
            return b if a is None else a if b is None else tuple(x for x in a if x in b)

        lo = [m for m in (self.max_seqlen, other.max_seqlen) if m is not None]
        return Domain(
            dtypes=meet(self.dtypes, other.dtypes), head_dims=meet(self.head_dims, other.head_dims),
            seqlen_multiple=_lcm(self.seqlen_multiple, other.seqlen_multiple),
            equal_seqlens=self.equal_seqlens or other.equal_seqlens,
            min_seqlen=max(self.min_seqlen, other.min_seqlen), max_seqlen=min(lo) if lo else None,
            layouts=meet(self.layouts, other.layouts),
            **{k: getattr(self, k) and getattr(other, k) for k in _BOOL_KEYS if k != "equal_seqlens"},
        )  # fmt: skip

    def widen(self, other: Domain) -> Domain:
        """What either allows, key by key (the box around both: several kernels sharing one suite,
        each skipping the cases outside its own domain): the union of the listed values (None,
        any, wins), the gcd of the length multiples, equal lengths only if both want them, the
        smaller minimum and the larger maximum (None wins), each feature if either supports it."""

        def join(a, b):
            return None if a is None or b is None else tuple(dict.fromkeys(a + b))

        hi = None if self.max_seqlen is None or other.max_seqlen is None else max(self.max_seqlen, other.max_seqlen)
        return Domain(
            dtypes=join(self.dtypes, other.dtypes), head_dims=join(self.head_dims, other.head_dims),
            seqlen_multiple=math.gcd(self.seqlen_multiple, other.seqlen_multiple),
            equal_seqlens=self.equal_seqlens and other.equal_seqlens,
            min_seqlen=min(self.min_seqlen, other.min_seqlen), max_seqlen=hi,
            layouts=join(self.layouts, other.layouts),
            **{k: getattr(self, k) or getattr(other, k) for k in _BOOL_KEYS if k != "equal_seqlens"},
        )  # fmt: skip

    def refusal(self, case: Case) -> str | None:
        """Why ``case`` lies outside the domain (the first reason found), None when inside.  A
        varlen case's lengths are checked per sequence (:meth:`_lengths_refusal`)."""
        lengths = self._lengths_refusal(case)
        checks = (
            (self.dtypes is not None and case.dtype not in self.dtypes, f"dtype {case.dtype} not in {self.dtypes}"),
            (self.head_dims is not None and (case.d, case.dv) not in self.head_dims,
             f"head dims ({case.d}, {case.dv}) not in {self.head_dims}"),
            (lengths is not None, lengths),
            (case.causal and not self.causal, "causal masking unsupported"),
            (case.local and not self.local, "local windows unsupported"),
            (case.softcap > 0 and not self.softcap, "softcap unsupported"),
            (case.sink and not self.sink, "learnable sink unsupported"),
            (case.heads_q != case.heads_kv and not self.gqa, "GQA/MQA unsupported"),
            (self.layouts is not None and case.layout not in self.layouts,
             f"layout {case.layout} not in {self.layouts}"),
        )  # fmt: skip
        return next((why for bad, why in checks if bad), None)

    def _length_refusal(self, sq: int, sk: int) -> str | None:
        """Why lengths ``sq`` x ``sk`` lie outside the domain's length keys, or None."""
        checks = (
            (sq % self.seqlen_multiple or sk % self.seqlen_multiple,
             f"seqlens {sq}x{sk} not multiples of {self.seqlen_multiple}"),
            (self.equal_seqlens and sq != sk, "seqlen_q != seqlen_k"),
            (min(sq, sk) < self.min_seqlen, f"a seqlen below {self.min_seqlen}"),
            (self.max_seqlen is not None and max(sq, sk) > self.max_seqlen, f"a seqlen above {self.max_seqlen}"),
        )  # fmt: skip
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
        """The declaration in the dict form (lists for tuples), for reports."""
        d = dataclasses.asdict(self)
        return {
            k: [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v for k, v in d.items()
        }


_FIELDS = tuple(f.name for f in dataclasses.fields(Domain))


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def _value(key: str, v, where: str):
    """One declared value, checked and normalised (tuples for lists)."""
    bad = lambda want: DomainError(f"{where}: domain key {key!r} = {v!r}: expected {want}")
    if key in _BOOL_KEYS:
        if not isinstance(v, bool):
            raise bad("true or false")
        return v
    if key in ("seqlen_multiple", "min_seqlen", "max_seqlen"):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad("a positive integer")
        return v
    accepted = {"dtypes": DTYPES, "layouts": LAYOUTS}.get(key)
    if accepted is not None:
        if not isinstance(v, (list, tuple)) or not v or any(x not in accepted for x in v):
            raise bad(f"a non-empty list of {', '.join(accepted)}")
        return tuple(v)
    pairs = (
        isinstance(v, (list, tuple))
        and v
        and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, int) and x > 0 for x in p) for p in v
        )
    )
    if not pairs:
        raise bad("a non-empty list of [d, dv] pairs of positive integers")
    return tuple(tuple(p) for p in v)


def domain_of(fn) -> Domain:
    """The domain a kernel declares (its ``fa4_audit_domain`` attribute: a dict or a Domain, or
    a callable returning one, evaluated now: production's depends on the GPU it runs on); the
    unrestricted domain when it declares none."""
    d = getattr(fn, "fa4_audit_domain", None)
    if callable(d):
        d = d()
    if d is None:
        return Domain()
    if isinstance(d, Domain):
        return d
    return Domain.from_dict(d, where=f"{getattr(fn, '__qualname__', fn)!s}.fa4_audit_domain")


#: multiples of the domain's block that generated lengths take: one block, not-a-power-of-two
#: multiples, and long ones (capped by max_seqlen, or at 8192 when it has none)
_LENGTH_MULTIPLES = (1, 3, 5, 8, 17, 33, 64)
_DEFAULT_MAX = 8192


def seqlens_within(d: Domain, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(seqlen_q, seqlen_k) pairs inside the domain: the given ones it admits, and lengths made
    from its block (``_LENGTH_MULTIPLES``: the smallest, odd multiples, long ones), as equal
    pairs and, unless the domain wants equal lengths, as neighbouring unequal pairs both ways."""
    probe = lambda sq, sk: Case(seqlen_q=sq, seqlen_k=sk, dtype=(d.dtypes or ("bfloat16",))[0])
    free = Domain(seqlen_multiple=d.seqlen_multiple, equal_seqlens=d.equal_seqlens, min_seqlen=d.min_seqlen,
                  max_seqlen=d.max_seqlen)  # fmt: skip
    kept = [p for p in pairs if free.refusal(probe(*p)) is None]
    if free == Domain():  # no constraint on the lengths: the suite's own pairs
        return kept
    m, hi = d.seqlen_multiple, d.max_seqlen or _DEFAULT_MAX
    lengths = [m * k for k in _LENGTH_MULTIPLES if d.min_seqlen <= m * k <= hi]
    made = [(n, n) for n in lengths]
    if not d.equal_seqlens:
        made += [p for a, b in zip(lengths, lengths[1:]) for p in ((a, b), (b, a))]
    return list(dict.fromkeys(kept + made))


#: a domain listing more (d, dv) pairs than this (a range written out, as production's SM100
#: head dims 8..128) has its head-dim axis sampled at the suite's own head dims
_HEAD_DIM_AXIS_MAX = 16


def _head_dim_axis(d: Domain, base_ds: list[int]) -> list[tuple[int, int]]:
    """The head-dim axis: the listed pairs, or for a long list, per head dim of the suite
    ``(d, d)`` if listed, else the first listed pair with that d (production's (192, 128) for
    the (192, 192) it refuses)."""
    if d.head_dims is None:
        return [(x, x) for x in base_ds]
    if len(d.head_dims) <= _HEAD_DIM_AXIS_MAX:
        return list(d.head_dims)
    picked = []
    for x in base_ds:
        same = [p for p in d.head_dims if p[0] == x]
        if same:
            picked.append((x, x) if (x, x) in same else same[0])
    return picked or list(d.head_dims[:_HEAD_DIM_AXIS_MAX])


def axes_within(d: Domain, base: dict | None = None) -> dict[str, list]:
    """The release axes (``audits.cases.RELEASE_AXES``) restricted to what the domain supports;
    head dims as (d, dv) pairs."""
    from audits.cases import RELEASE_AXES

    base = base or RELEASE_AXES
    return {
        "dtype": list(d.dtypes) if d.dtypes else list(base["dtype"]),
        "d": _head_dim_axis(d, list(base["d"])),
        "mask": ["none"] + ["causal"] * d.causal + ["local"] * d.local,
        "softcap": [0.0] + [15.0] * d.softcap,
        "sink": [False] + [True] * d.sink,
        "heads": [h for h in base["heads"] if d.gqa or h[0] == h[1]],
        "seqlens": seqlens_within(d, list(base["seqlens"])),
        "layout": list(d.layouts) if d.layouts else list(base["layout"]),
    }


def case_within(d: Domain, row: dict, family: str, seed: int) -> tuple[Case | None, str | None]:
    """The release case of ``row`` for ``family`` (``audits.cases.release_case``, head dims from
    the row's pair), or why the family cannot be placed in the domain.  Public: suite files
    (``audits.suite_file``) place their rows with it, as the named suites do."""
    from audits.cases import release_case

    dd, dv = row["d"]
    case = dataclasses.replace(release_case({**row, "d": dd}, family, seed), dv=dv)
    why = d.refusal(case)
    return (case, None) if why is None else (None, why)


def release_within(d: Domain, *, seeds: tuple[int, ...] = (0,), extra_pairs: list | None = None) -> dict:
    """``release`` built over the domain, not filtered: the pairwise covering array of the
    supported axis values (:func:`axes_within`) times every input family.  Returns ``{"cases",
    "axes", "pairs_covered", "not_applicable": {family: reason}}`` — a family none of whose cases
    fits the domain (``nan_inf_masked`` needs keys no query sees: a left window and unequal
    lengths) is listed with the reason, never a case outside the domain.  Then release's varlen
    cases that lie inside the domain (:func:`_varlen_within`)."""
    from audits.cases import pairwise, release_varlen
    from audits.inputs import FAMILIES

    axes = axes_within(d)
    if extra_pairs:
        axes["seqlens"] = list(dict.fromkeys(axes["seqlens"] + seqlens_within(d, list(extra_pairs))))
    rows = pairwise(axes)
    cases, missing = [], {}
    for f in FAMILIES:
        placed = [case_within(d, r, f, s) for s in seeds for r in rows]
        ok = [c for c, _ in placed if c is not None]
        if not ok:
            need = " (it needs keys no query sees: a left window short of them)" if f == "nan_inf_masked" else ""
            missing[f] = f"no case of family {f} fits the domain{need}; e.g. {next(why for _, why in placed)}"
        cases += ok
    names = list(axes)
    pairs = sum(len(axes[a]) * len(axes[b]) for i, a in enumerate(names) for b in names[i + 1 :])
    cases += _varlen_within(d, release_varlen(seeds))
    return {"cases": list(dict.fromkeys(cases)), "axes": axes, "pairs_covered": pairs, "not_applicable": missing}


def _varlen_within(d: Domain, cases: list[Case]) -> list[Case]:
    """A suite's varlen cases (``audits.cases.smoke_varlen``, ``release_varlen``) that lie inside
    the domain, as they are: their sequences' lengths are the serving mix, not axis values."""
    return [c for c in cases if d.refusal(c) is None]


def _smoke_case_within(d: Domain, row: dict, family: str) -> tuple[Case | None, str | None]:
    """:func:`case_within` for smoke, which leaves bf16 ``near_max`` out as ``smoke_suite``
    does: V ~ 3.4e38 makes P.V overflow float32 in any float32-accumulating kernel."""
    if family == "near_max" and row["dtype"] == "bfloat16":
        return None, "smoke leaves bfloat16 near_max out (P.V overflows float32 in every kernel)"
    return case_within(d, row, family, 0)


def smoke_within(d: Domain) -> dict:
    """``smoke`` over the domain: the pairwise rows of its axes with short lengths (up to five
    blocks), each input family on one row (families and rows taken in turn until both are used
    up), as :func:`release_within` reports them, then smoke's varlen cases inside the domain.  The
    unrestricted domain gives smoke itself."""
    from audits.cases import pairwise, smoke_suite, smoke_varlen
    from audits.inputs import FAMILIES

    if d == Domain():
        return {"cases": smoke_suite(), "axes": None, "pairs_covered": None, "not_applicable": {}}
    short = dataclasses.replace(d, max_seqlen=min(d.max_seqlen or 1 << 30, max(3 * d.seqlen_multiple, 256)))
    axes = {**axes_within(d), "seqlens": seqlens_within(short, [(64, 128), (130, 70), (200, 300), (256, 256)])}
    rows, fams = pairwise(axes), list(FAMILIES)
    cases, missing = [], {}
    for i in range(max(len(rows), len(fams))):
        f = fams[i % len(fams)]
        tries = [_smoke_case_within(d, rows[(i + j) % len(rows)], f) for j in range(len(rows))]
        case = next((c for c, _ in tries if c is not None), None)
        if case is None:
            missing.setdefault(f, f"no case of family {f} fits the domain; e.g. {tries[0][1]}")
        else:
            cases.append(case)
    names = list(axes)
    pairs = sum(len(axes[a]) * len(axes[b]) for i, a in enumerate(names) for b in names[i + 1 :])
    cases += _varlen_within(d, smoke_varlen())
    return {"cases": list(dict.fromkeys(cases)), "axes": axes, "pairs_covered": pairs, "not_applicable": missing}


def named_suite_within(name: str, d: Domain) -> dict:
    """:func:`suite_within`, or the named suite itself (as it is defined in ``audits.cases``)
    when ``d`` restricts no case (``backward`` and ``deterministic`` choose no case)."""
    from audits.cases import suite

    if dataclasses.replace(d, backward=True, deterministic=True) == Domain():
        return {"cases": suite(name), "axes": None, "pairs_covered": None, "not_applicable": {}}
    return suite_within(name, d)


def suite_within(name: str, d: Domain) -> dict:
    """A named suite built over the domain (``smoke``, ``release``, ``nightly``); a fixed list
    (``fidelity``) filtered to it."""
    if name == "smoke":
        return smoke_within(d)
    if name == "release":
        return release_within(d)
    if name == "nightly":
        return release_within(d, seeds=(0, 1, 2), extra_pairs=[(16384, 16384), (2048, 32768), (32768, 32768)])
    from audits.cases import SUITES, suite

    if name in SUITES:  # a fixed list (fidelity's): its cases inside the domain, none made
        return {"cases": [c for c in suite(name) if d.refusal(c) is None], "axes": None, "pairs_covered": None,
                "not_applicable": {}}  # fmt: skip
    raise ValueError(f"unknown suite {name!r}; accepted: {', '.join(SUITES)}")
