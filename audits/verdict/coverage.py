"""Coverage: which of the values a kernel accepts, and which of production's code-path classes,
a run actually compared with the reference, in the forward and in the backward (issue 24).

Every run report carries ``report["coverage"]`` (:func:`coverage`); ``fa4-audit coverage
REPORT`` prints it (:func:`coverage_lines`); ``run --require-coverage all|head_dims|classes``
fails a run that missed any (:func:`missed`).  What is accepted comes from the kernel's declared
domain (``audits.suites.domain.Domain.head_dim_pairs``, narrowed by ``--domain FILE``); the classes
from ``fa4.code_paths`` for the kernel's architecture (:func:`arch_of`: ``fn.fa4_audit_arch``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from collections.abc import Callable, Iterable, Sequence

from audits.kernels import get_kernel, kernel_domain
from audits.suites.cases import DTYPES, MOD_KINDS, SM90_HEAD_DIMS, case_from_dict
from audits.suites.domain import Domain, DomainError
from audits.suites.signal import features_of, signal
from fa4.code_paths import Call, classes, classes_of

__all__ = [
    "DIRECTIONS",
    "REQUIRE",
    "coverage",
    "classes_ran",
    "arch_of",
    "basis_of",
    "coverage_from_basis",
    "basis_of_coverage",
    "unjudgeable",
    "missed",
    "compact_ints",
    "pair_pieces",
    "format_pairs",
    "pairs_text",
    "missed_text",
    "coverage_lines",
    "coverage_summary",
]

DIRECTIONS = ("forward", "backward")
#: what ``run --require-coverage`` takes: every gated section, or one of them
REQUIRE = ("all", "head_dims", "classes")
#: the sections each ``--require-coverage`` value gates (features are reported, not gated: a
#: domain cannot say which features a kernel's backward supports, so a backward "miss" of a
#: feature may be a refusal the kernel is entitled to)
GATED = {"all": ("head_dims", "classes"), "head_dims": ("head_dims",), "classes": ("classes",)}
#: the kernel architectures whose classes ``fa4.code_paths`` states
KNOWN_ARCHS = ("sm90", "sm100")
#: classes (by name without the architecture) that no fa4-audit run can compare, and why: they
#: are listed, never called missed
NOT_AUDITABLE = {
    "bwd.varlen": "varlen cases audit the forward only: no backward through the varlen entry (docs/varlen.md)",
}
#: how a run covers a class it missed, where that needs an option (by name without the architecture)
HOW_TO_COVER = {"bwd.deterministic": "run --backward --deterministic"}


def arch_of(fn: Callable) -> str | None:
    """The architecture a kernel declares (``fn.fa4_audit_arch``: "sm90" or "sm100", or a callable
    returning one or None, evaluated now: production's depends on the GPU), None when it declares
    none.  A declaration that is not one of :data:`KNOWN_ARCHS` is a ValueError naming it."""
    arch = getattr(fn, "fa4_audit_arch", None)
    if callable(arch):
        arch = arch()
    if arch is not None and arch not in KNOWN_ARCHS:
        name = getattr(fn, "__name__", repr(fn))
        raise ValueError(f"kernel {name}: fa4_audit_arch {arch!r} is not one of {', '.join(KNOWN_ARCHS)} (or None)")
    return arch


def _compared(rec: dict, direction: str) -> bool:
    """Whether ``rec`` compared ``direction`` with the reference (the rule of :func:`coverage`)."""
    if rec.get("status") != "ran" or rec.get("verdict") == "out-of-domain" or not isinstance(rec.get("out"), dict):
        return False
    if direction == "forward":
        return True
    b = rec.get("backward")
    return isinstance(b, dict) and b.get("status") == "ran" and bool(b.get("grads")) and not b.get("audit_error")


def _features(domain) -> list[str]:
    """The feature values ``domain`` accepts (dtypes, masks, softcap, sink, GQA, its mod kinds)."""
    out = [f"dtype={d}" for d in (domain.dtypes or DTYPES)] + ["mask=none"]
    out += ["mask=causal"] if domain.causal else []
    out += ["mask=local"] if domain.local else []
    out += [f for f in ("softcap", "sink", "gqa") if getattr(domain, f)]
    return out + [k for k in MOD_KINDS if domain.takes(k)]


def _features_of(case) -> set[str]:
    """The features ``case`` covers: those it has (``audits.suites.signal.features_of``) that its
    inputs make matter (``audits.suites.signal.signal``, the one statement of that rule)."""
    return features_of(case) & signal(case)


def coverage(
    *, cases: Sequence, records: Sequence[dict], domain, arch: str | None, backward: bool | None = None
) -> dict:
    """What the run's ``records`` (its per-case report records, with verdicts) covered of what
    ``domain`` (``audits.suites.domain.Domain``) accepts and of the code-path classes of ``arch``.

    The rule: a case covers a value (a head-dim pair, a class, a feature) in a direction only
    when that direction was actually compared with the reference.  Forward: the kernel ran
    (status ``ran``), its output was measured, and the verdict is not ``out-of-domain`` — so a
    ``pass``, a ``warn`` and a ``fail`` cover (a failing comparison is still a comparison: the
    value was audited, and found wrong); ``skipped``, ``out-of-domain``, ``error``, ``timeout`` and
    ``crash`` do not (nothing was compared).  A case whose forward was compared but whose backward
    errored covers the forward only.  Backward: as the forward, and its gradients ran
    (``backward.status`` ``ran``, gradients measured, no audit error), which needs ``run
    --backward``.  Classes come from ``fa4.code_paths.classes_of(arch, case.call(...),
    direction=...)``, the backward's with the run's ``deterministic``.

    ``cases``: the selected cases (records are matched to them by name; a record of no case is
    read from its ``config``).  ``backward``: whether the run audited gradients (None: whether any
    record has a ``backward``); the backward is judged only then, and only when the domain
    accepts it.  ``arch`` None: no classes (``"classes": None``, a note says why).  Head dims
    the domain leaves unrestricted (``head_dim_pairs()`` None): ``accepted`` is None, nothing is
    called missed (a note says so).

    Returns ``{"arch", "domain" (its dict form: the basis, so a report can be re-read),
    "directions" (judged), "head_dims": {"accepted", "forward", "backward", "missed_forward",
    "missed_backward" ((d, dv) pairs), "values": the same keys as ``{"d": [...], "dv": [...]}``},
    "classes": {name: {"description", "source", "directions", "forward",
    "backward"}} | None, "features": {value: {"forward", "backward"}}, "notes"}``; each covered
    entry names the first case (in record order) that covered it.  A class's ``directions`` are
    those it is judged in; one no run can compare (:data:`NOT_AUDITABLE`) is listed under
    ``not_auditable`` ({direction: why}) instead, and one no call inside the domain falls in
    (a kernel restricted to some head dims has none of the others' tiles) under
    ``outside_domain``: never missed.  A varlen case run ``--per-sequence`` covers no class."""
    by_name = {c.name: c for c in cases}
    if backward is None:
        backward = any(isinstance(r.get("backward"), dict) for r in records)
    notes: list[str] = []
    directions = ["forward"]
    if not domain.backward:
        notes.append("the kernel's domain declares no backward: backward coverage does not apply")
    elif backward:
        directions.append("backward")
    else:
        notes.append("gradients not audited (run without --backward): backward coverage not judged")
    got = _scan(records, by_name, directions, arch, notes)
    pairs = domain.head_dim_pairs()
    accepted = None if pairs is None else [list(p) for p in pairs]
    heads = {"accepted": accepted}
    values = {"accepted": None if accepted is None else _values(accepted)}
    for d in DIRECTIONS:
        heads[d] = [list(p) for p in sorted(got["head_dims"][d])]
        judged = accepted is not None and d in directions
        heads[f"missed_{d}"] = [p for p in accepted if tuple(p) not in got["head_dims"][d]] if judged else None
        values[d] = _values(heads[d])
        values[f"missed_{d}"] = (
            {k: [x for x in values["accepted"][k] if x not in values[d][k]] for k in ("d", "dv")} if judged else None
        )
    heads["values"] = values
    if accepted is None:
        notes.append(
            "head dims unrestricted: the domain accepts any (d, dv), so no head dim is called missed; declare "
            "head_dims (fn.fa4_audit_domain, or --domain FILE.toml) to have them judged"
        )
    if arch is None:
        notes.append(
            "no architecture declared (fn.fa4_audit_arch): code-path classes not judged, head dims and features only"
        )
    classes = None if arch is None else _class_entries(arch, domain, got["classes"])
    features = {f: {d: got["features"][d].get(f) for d in DIRECTIONS} for f in _features(domain)}
    return {
        "arch": arch,
        "domain": domain.as_dict(),
        "directions": directions,
        "head_dims": heads,
        "classes": classes,
        "features": features,
        "notes": notes,
    }


def _values(pairs) -> dict[str, list[int]]:
    """The head-dim values of (d, dv) pairs: ``{"d": [...], "dv": [...]}``, sorted."""
    return {"d": sorted({p[0] for p in pairs}), "dv": sorted({p[1] for p in pairs})}


def classes_ran(*, rec: dict, case, arch: str, direction: str, cache: dict) -> tuple[str, ...]:
    """The code-path classes of ``arch`` (``fa4.code_paths.classes_of``) that the call of
    record ``rec`` (its case ``case``) ran in ``direction``: the backward's with the record's
    ``deterministic``; none for a varlen case run one fixed-length call per sequence
    (--per-sequence), which ran none of the varlen entry's code paths.  ``cache``: (call,
    direction) -> classes, shared across records (many cases share a call)."""
    if (rec.get("varlen") or {}).get("entry") == "per-sequence":
        return ()
    det = direction == "backward" and bool((rec.get("backward") or {}).get("deterministic"))
    key = (case.call(deterministic=det), direction)
    if key not in cache:
        cache[key] = classes_of(arch, key[0], direction=direction)
    return cache[key]


def _scan(records: Sequence[dict], by_name: dict, directions: list[str], arch: str | None, notes: list[str]) -> dict:
    """What ``records`` covered, per section and direction: value -> the first case's name."""
    got = {k: {d: {} for d in DIRECTIONS} for k in ("head_dims", "classes", "features")}
    seen: dict[tuple, tuple] = {}  # (call, direction) -> class names: many cases share a call
    bad = 0
    for rec in records:
        hit = [d for d in directions if _compared(rec, d)]
        if not hit:
            continue
        case = by_name.get(rec.get("case"))
        if case is None:
            try:
                case = case_from_dict(rec.get("config") or {}, where=f"record {rec.get('case')}")
            except ValueError:
                bad += 1
                continue
        for d in hit:
            if "head_dims" in signal(case):  # a subnormal-key case computes the same at any scale
                got["head_dims"][d].setdefault((case.d, case.dv), case.name)
            for f in _features_of(case):
                got["features"][d].setdefault(f, case.name)
            if arch is not None:  # head dims and features count for every record; classes as it ran
                for name in classes_ran(rec=rec, case=case, arch=arch, direction=d, cache=seen):
                    got["classes"][d].setdefault(name, case.name)
    if bad:
        notes.append(f"{bad} records with an unreadable config were not counted")
    return got


def _class_entries(arch: str, domain, covered: dict) -> dict:
    """The classes of ``arch`` whose direction the domain has, each with the case that covered it
    per direction (``covered``: direction -> name -> case); one that no call inside the domain
    falls in (:func:`_reachable`) is listed under ``outside_domain``, not judged."""
    out: dict[str, dict] = {}
    applicable = DIRECTIONS if domain.backward else ("forward",)
    reach = _reachable(arch, domain)
    for pc in classes(arch):
        if pc.direction not in applicable:
            continue
        e = out.setdefault(
            pc.name,
            {"description": pc.description, "source": pc.source, "directions": [], "forward": None, "backward": None},
        )
        e[pc.direction] = covered[pc.direction].get(pc.name)
        why = NOT_AUDITABLE.get(pc.name.split(".", 1)[1])
        if why:
            e.setdefault("not_auditable", {})[pc.direction] = why
        elif reach is not None and pc.name not in reach[pc.direction] and e[pc.direction] is None:
            e.setdefault("outside_domain", {})[pc.direction] = "no call the kernel's domain accepts falls in it"
        else:
            e["directions"].append(pc.direction)
    return out


#: the shapes :func:`_reachable` tries at every accepted head dim and mask: (heads_q, heads_kv,
#: pack_gqa, seqlen_q, seqlen_k, varlen, paged, num_splits): one row tile and two, GQA packed and
#: not, varlen, paged, split-KV over enough KV blocks for SM100's 64-key split tile
_SHAPES = (
    (1, 1, None, 128, 128, False, False, 1), (1, 1, None, 300, 333, False, False, 1),
    (4, 2, None, 300, 333, False, False, 1), (4, 2, False, 300, 333, False, False, 1),
    (2, 2, None, 300, 333, True, False, 1), (2, 2, None, 300, 333, True, True, 1),
    (2, 2, None, 64, 16384, False, False, 2),
)  # fmt: skip


def _reachable(arch: str, domain) -> dict[str, set] | None:
    """The classes of ``arch`` some call inside ``domain`` falls in, per direction: every accepted
    (d, dv) with every mask the domain takes, over :data:`_SHAPES` (GQA ones only where it takes
    GQA), then softcap, sink and the deterministic backward each where it takes them, and the mod
    kinds it declares (block sparsity with a mask_mod, at every accepted head dim and the blocks of
    :data:`_MOD_BLOCKS`).  None (all reachable) for a domain that restricts none of these.  Only
    what the domain states is left out: lengths and the rest vary over shapes the domain is not
    asked about."""
    full = all(getattr(domain, k) for k in _TOGGLES) and all(domain.takes(k) for k in MOD_KINDS)
    if domain.head_dim_pairs() is None and full:
        return None
    return _reachable_cached(arch, json.dumps(domain.as_dict(), sort_keys=True))


_TOGGLES = ("causal", "local", "gqa", "softcap", "sink", "deterministic")
#: the sparse blocks :func:`_reachable` tries: the suites' (``audits.suites.cases.MOD_BLOCK``) and the
#: ones ``audits.suites.cases.class_cases`` takes for SM90's block-sparse tiles
_MOD_BLOCKS = ((128, 128), (128, 64), (64, 128))


@functools.cache
def _reachable_cached(arch: str, domain_json: str) -> dict[str, set]:
    dom = Domain.from_dict(json.loads(domain_json), where="coverage")
    pairs = dom.head_dim_pairs() or tuple(itertools.product(SM90_HEAD_DIMS, SM90_HEAD_DIMS))
    masks = [(False, False)] + [(True, False)] * dom.causal + [(False, True)] * dom.local
    shapes = [s for s in _SHAPES if dom.gqa or s[0] == s[1]]
    dtype = (dom.dtypes or ("bfloat16",))[0]
    calls = [
        Call(
            dtype=dtype,
            d=d,
            dv=dv,
            causal=c,
            local=w,
            heads_q=hq,
            heads_kv=hk,
            pack_gqa=pk,
            seqlen_q=sq,
            seqlen_k=sk,
            varlen=vl,
            paged=pg,
            num_splits=ns,
        )
        for d, dv in pairs
        for c, w in masks
        for hq, hk, pk, sq, sk, vl, pg, ns in shapes
    ]
    toggles = [k for k in ("softcap", "sink") if getattr(dom, k)] + ["deterministic"] * dom.deterministic
    toggles += [k for k in ("score_mod", "mask_mod") if dom.takes(k)]
    calls += [dataclasses.replace(calls[0], **{k: True}) for k in toggles]
    if dom.takes("block_sparse") and dom.takes("mask_mod"):  # a case's block sparsity comes from its mask_mod
        calls += [dataclasses.replace(c, mask_mod=True, block_sparse=bs) for c in calls for bs in _MOD_BLOCKS]
    return {d: {n for c in calls for n in classes_of(arch, c, direction=d)} for d in DIRECTIONS}


# ---- the basis: what a report's coverage is computed from -------------------------------------


def basis_of(kernel: str, *, domain=None) -> dict:
    """``{"domain": Domain, "arch": ...}`` of kernel ``kernel`` (a name or ``module:attr``): its
    declared domain (narrowed by ``domain``, a ``--domain`` file's, when given) and :func:`arch_of`."""
    own = kernel_domain(kernel)
    return {"domain": own if domain is None else own.narrow(domain), "arch": arch_of(get_kernel(kernel))}


def coverage_from_basis(basis: dict, *, records: Sequence[dict], backward: bool | None = None) -> dict:
    """:func:`coverage` of ``records`` (cases read from their configs) on a basis of
    :func:`basis_of`, :func:`basis_of_coverage` or ``audits.report.schema``'s of an old report; a basis ``{"absent":
    why}`` gives ``{"absent": why}``."""
    if "absent" in basis:
        return {"absent": basis["absent"]}
    cov = coverage(cases=[], records=records, domain=basis["domain"], arch=basis["arch"], backward=backward)
    if basis.get("legacy"):
        cov["notes"].insert(0, basis["legacy"])
    return cov


def basis_of_coverage(cov: dict | None) -> dict | None:
    """The basis a report's coverage was computed on (to recompute it over other records: a
    re-judged or merged report), None when there is none to read."""
    if not isinstance(cov, dict):
        return None
    if "absent" in cov:
        return {"absent": cov["absent"]}
    try:
        return {"domain": Domain.from_dict(cov.get("domain") or {}, where="coverage.domain"), "arch": cov.get("arch")}
    except DomainError:
        return None


# ---- judging: run --require-coverage ----------------------------------------------------------


def unjudgeable(*, domain, arch: str | None, require: str) -> list[str]:
    """Why ``--require-coverage require`` cannot be judged for a kernel of ``domain`` and
    ``arch`` (empty when it can): head dims need a declared head-dim set, classes an architecture."""
    why = []
    sections = GATED[require]
    if "head_dims" in sections and domain.head_dim_pairs() is None:
        why.append(
            "head dims: the domain accepts any (d, dv), so no head dim can be missed; declare the accepted head dims "
            "(head_dims in fn.fa4_audit_domain, or a --domain FILE.toml with head_dims)"
        )
    if "classes" in sections and arch is None:
        why.append(
            "classes: the kernel declares no architecture, so its code-path classes are unknown; declare "
            "fn.fa4_audit_arch = 'sm90' or 'sm100'"
        )
    return why


def missed(cov: dict, *, require: str) -> list[str]:
    """What ``cov`` missed of the sections ``require`` gates, in the directions it judged, one
    line each ("head dims forward: 72, 80"; "class sm90.bwd.x (backward)"); a section it cannot
    judge is a line too (an absent coverage, unrestricted head dims, no architecture)."""
    if "absent" in cov:
        return [f"coverage absent: {cov['absent']}"]
    lines = []
    sections = GATED[require]
    if "head_dims" in sections:  # judged by value: every accepted d and every accepted dv compared
        h = cov["head_dims"]
        if h["accepted"] is None:
            lines.append("head dims: not judged (unrestricted)")
        for d in cov["directions"]:
            gone = h["values"].get(f"missed_{d}") or {}
            parts = [f"{k} {compact_ints(gone[k])}" for k in ("d", "dv") if gone.get(k)]
            if parts:
                lines.append(f"head dims {d}: {'; '.join(parts)}")
    if "classes" in sections:
        if cov["classes"] is None:
            lines.append("classes: not judged (no architecture)")
        for name, e in (cov["classes"] or {}).items():
            gone = [d for d in e["directions"] if d in cov["directions"] and e[d] is None]
            if gone:
                how = HOW_TO_COVER.get(name.split(".", 1)[1])
                lines.append(f"class {name} ({', '.join(gone)})" + (f": {how} covers it" if how else ""))
    return lines


# ---- text -------------------------------------------------------------------------------------


def compact_ints(xs) -> str:
    """Sorted distinct integers as ranges with a step: 8, 16, ..., 256 -> "8..256/8"; runs of
    fewer than three values listed ("64, 96")."""
    a = sorted(set(xs))
    parts, i = [], 0
    while i < len(a):
        j = i + 1
        if j < len(a):
            step = a[j] - a[i]
            while j + 1 < len(a) and a[j + 1] - a[j] == step:
                j += 1
        if j < len(a) and j - i >= 2:
            parts.append(f"{a[i]}..{a[j]}" + (f"/{step}" if step != 1 else ""))
            i = j + 1
        else:
            parts.append(str(a[i]))
            i += 1
    return ", ".join(parts)


#: a pairs listing longer than this (characters) is not printed: the count is, and report.json
#: holds every pair
PAIRS_CHARS = 200
#: up to this many pairs are listed whatever the length of their listing
PAIRS_LISTED = 8


def pair_pieces(*, pairs: Iterable) -> tuple[list[tuple[list[int], list[int]]], list[int], list[tuple[int, int]]]:
    """(d, dv) pairs split exactly into ``(products, diagonal, singles)``: products ``(ds, dvs)``
    of at least three pairs (every d of ``ds`` with every dv of ``dvs``), the values x of a
    diagonal piece (every (x, x)), and the single pairs left, sorted by (dv, d); each pair in
    exactly one piece.

    Greedy: group the dv values by their set of d values, take the group with the most pairs,
    widen it to every dv whose d-set holds that set and then to every d whose dv-set holds the
    widened dv set, remove it, repeat; the pairs with d = dv are one diagonal piece instead when
    they outnumber the best product.  A production domain is one product (SM90,
    ``fa4.refusals.production_domain(9)``) or one product and four single pairs (SM100)."""
    rest = {(int(p[0]), int(p[1])) for p in pairs}
    products: list[tuple[list[int], list[int]]] = []
    diagonal: list[int] = []
    while rest:
        by_dv: dict[int, set[int]] = {}
        by_d: dict[int, set[int]] = {}
        for d, dv in rest:
            by_dv.setdefault(dv, set()).add(d)
            by_d.setdefault(d, set()).add(dv)
        groups: dict[frozenset, set[int]] = {}
        for dv, ds in by_dv.items():
            groups.setdefault(frozenset(ds), set()).add(dv)
        ds, dvs = max(groups.items(), key=lambda g: (len(g[0]) * len(g[1]), -min(g[1])))
        dvs = {dv for dv, got in by_dv.items() if ds <= got}
        ds = {d for d, got in by_d.items() if dvs <= got}
        same = sorted(d for d, dv in rest if d == dv)
        if not diagonal and len(same) >= 2 and len(same) > len(ds) * len(dvs):
            diagonal = same
            rest -= {(x, x) for x in same}
        elif len(ds) * len(dvs) >= 3:
            products.append((sorted(ds), sorted(dvs)))
            rest -= {(d, dv) for d in ds for dv in dvs}
        else:
            break
    return products, diagonal, sorted(rest, key=lambda p: (p[1], p[0]))


def format_pairs(pairs) -> str:
    """(d, dv) pairs compactly (:func:`pair_pieces`), pieces separated by "; ": a product as "d
    8..128/8 x dv 8..128/8", a diagonal as "d=dv 64..128/32", single pairs as "(192, 128),
    (256, 256)"; the older form (d = dv as ranges of d, the others grouped by dv: "dv 512: d
    64") where it is shorter; "none" for none."""
    pairs = [(int(p[0]), int(p[1])) for p in pairs]
    if not pairs:
        return "none"
    products, diagonal, singles = pair_pieces(pairs=pairs)
    out = [f"d {compact_ints(ds)} x dv {compact_ints(dvs)}" for ds, dvs in products]
    out += [f"d=dv {compact_ints(diagonal)}"] if diagonal else []
    out += [", ".join(f"({d}, {dv})" for d, dv in singles)] if singles else []
    compact = "; ".join(out)
    legacy = _by_dv(pairs)
    return legacy if len(legacy) < len(compact) else compact


def _by_dv(pairs: list[tuple[int, int]]) -> str:
    """The older form of :func:`format_pairs`: "d=dv 8..256/8; dv 128: d 192"."""
    same = [d for d, dv in pairs if d == dv]
    out = [f"d=dv {compact_ints(same)}"] if same else []
    other: dict[int, list[int]] = {}
    for d, dv in pairs:
        if d != dv:
            other.setdefault(dv, []).append(d)
    out += [f"dv {dv}: d {compact_ints(ds)}" for dv, ds in sorted(other.items())]
    return "; ".join(out)


def _listing(pairs: list) -> str | None:
    """:func:`format_pairs` of ``pairs`` when a line can hold it (at most :data:`PAIRS_LISTED`
    pairs, or shorter than :data:`PAIRS_CHARS` characters), else None."""
    text = format_pairs(pairs)
    return text if len(pairs) <= PAIRS_LISTED or len(text) < PAIRS_CHARS else None


def pairs_text(*, pairs: Sequence, of: int | None = None) -> str:
    """(d, dv) pairs for a line of text, bounded: :func:`format_pairs` and the count ("d 8..256/8
    x dv 8..256/8 (1024 pairs)"; "(5 of 1024 pairs)" with ``of``, the pairs there are) when a
    line can hold the listing, else the count and where the pairs are ("700 of 1024 pairs (pairs
    are listed in report.json)")."""
    pairs = list(pairs)
    count = f"{len(pairs)} of {of} pairs" if of is not None else f"{len(pairs)} pairs"
    text = _listing(pairs)
    return f"{count} (pairs are listed in report.json)" if text is None else f"{text} ({count})"


def coverage_lines(cov: dict | None) -> list[str]:
    """The coverage as plain lines (the console, ``fa4-audit coverage``, report.md's section)."""
    if not isinstance(cov, dict):
        return ["coverage: none recorded"]
    if "absent" in cov:
        return [f"coverage absent: {cov['absent']}"]
    h = cov["head_dims"]
    acc = h["accepted"]
    judged = cov["directions"]
    L = [f"architecture: {cov['arch'] or 'none declared'}; directions judged: {', '.join(judged)}"]
    L.append("head dims accepted: " + ("unrestricted" if acc is None else pairs_text(pairs=acc)))
    for d in DIRECTIONS:
        of = None if acc is None else len(acc)
        L.append(f"  {d}: {pairs_text(pairs=h[d], of=of)}" if d in judged else f"  {d}: not judged")
        if h.get(f"missed_{d}") is not None:
            L.append(f"  missed {d}: {missed_text(heads=h, direction=d)}")
    if cov["classes"] is not None:
        n = {d: sum(1 for e in cov["classes"].values() if d in e["directions"]) for d in DIRECTIONS}
        got = {d: sum(1 for e in cov["classes"].values() if d in e["directions"] and e[d]) for d in DIRECTIONS}
        L.append(f"classes ({cov['arch']}): " + "; ".join(f"{d} {got[d]} of {n[d]} covered" for d in judged))
        w = max((len(n) for n in cov["classes"]), default=5)

        def cell(e: dict, d: str) -> str:
            if d in (e.get("not_auditable") or {}):
                return "not auditable"
            if d in (e.get("outside_domain") or {}):
                return "outside the domain"
            if d not in e["directions"]:
                return "-"
            return e[d] or ("MISSED" if d in judged else "not judged")

        cw = max([len("forward")] + [len(cell(e, "forward")) for e in cov["classes"].values()])
        L.append(f"  {'class':{w}}  {'forward':{cw}}  backward")
        for name, e in cov["classes"].items():
            L.append(f"  {name:{w}}  {cell(e, 'forward'):{cw}}  {cell(e, 'backward')}")
        L += [
            f"  {n}: not auditable ({d}): {why}"
            for n, e in cov["classes"].items()
            for d, why in (e.get("not_auditable") or {}).items()
        ]
    feats = cov.get("features") or {}
    if feats:
        L.append("features (reported, not gated):")
        for f, e in feats.items():
            L.append(
                f"  {f}  "
                + "; ".join(f"{d}: {e.get(d) or ('missed' if d in judged else 'not judged')}" for d in DIRECTIONS)
            )
    req = cov.get("required")
    if req:
        state = "met" if req["met"] else "NOT met"
        L.append(f"required ({req['require']}): {state}" + "".join(f"\n  missed: {m}" for m in req["missed"]))
    L += [f"note: {n}" for n in cov["notes"]]
    return L


def missed_text(*, heads: dict, direction: str) -> str:
    """What ``heads`` (a judged coverage's ``head_dims``) missed in ``direction``: every missed d
    and dv value (what the gate judges, :func:`missed`), then the missed pairs, listed as
    :func:`pairs_text` lists them, else counted ("values d 8..56/8; dv 8..256/8; 1019 of 1024
    pairs (the gate judges d and dv values; pairs are listed in report.json)")."""
    gone = heads["values"][f"missed_{direction}"]
    vals = "; ".join(f"{k} {compact_ints(gone[k]) or 'none'}" for k in ("d", "dv"))
    pairs, n = heads[f"missed_{direction}"], len(heads["accepted"])
    text = _listing(pairs)
    if text is None:
        why = "the gate judges d and dv values; pairs are listed in report.json"
        return f"values {vals}; {len(pairs)} of {n} pairs ({why})"
    return f"values {vals}; pairs {text} ({len(pairs)} of {n} pairs)"


def coverage_summary(cov: dict | None) -> str:
    """One line: head dims and classes covered per judged direction ("head dims forward 5 of
    32, backward 5 of 32; classes forward 12 of 14, ...")."""
    if not isinstance(cov, dict) or "absent" in cov:
        return coverage_lines(cov)[0]
    h, judged = cov["head_dims"], cov["directions"]
    acc, v = h["accepted"], h["values"]

    def of(d: str) -> str:
        if acc is None:
            return f"{d} {len(v[d]['d'])} d values"
        return f"{d} {len(v[d]['d'])} of {len(v['accepted']['d'])} d values ({len(h[d])} of {len(acc)} pairs)"

    line = "head dims " + ", ".join(of(d) for d in judged) + (" (unrestricted)" if acc is None else "")
    if cov["classes"] is None:
        return line + "; classes not judged (no architecture)"
    n = {d: [e[d] for e in cov["classes"].values() if d in e["directions"]] for d in judged}
    return line + "; classes " + ", ".join(f"{d} {sum(map(bool, n[d]))} of {len(n[d])}" for d in judged)
