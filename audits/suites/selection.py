"""One way to choose cases, for every subcommand that takes them (``run``, ``invariance``,
``static``, ``fidelity``): the same options, the same rules, the same error messages.

:func:`select_cases` turns the selection (``audits.cli.options`` reads it from the command line)
into the cases and the label the reports carry.  The rules:

- ``--suite NAME`` (a named suite of ``audits.suites.cases.SUITES``) or ``--suite FILE.toml`` (a suite
  file, ``audits.suites.suite_file``); absent: the subcommand's default suite.  An unknown name is a
  usage error naming the known suites.
- ``--config JSON`` (repeatable) and ``--case-file FILE`` (repeatable) give the cases
  themselves; with ``--suite`` they are refused (it would be ignored otherwise).
- ``--domain FILE.toml`` narrows what the kernels declare (``audits.suites.domain``): named suites and
  suite files are built within the kernels' domain (one kernel's, several kernels' union); given
  cases (``--config``, ``--case-file``, a suite file's ``[[case]]``) outside the file's domain
  are not run, and said on stderr.
- ``--seed N`` is added to every case's seed; ``--case GLOB`` then keeps the cases whose name
  (or ``fidelity`` label, e.g. ``d128_softcap``) matches; a glob matching nothing is a usage
  error naming the glob and the selection.

Run-specific slicing (``run --shard``) is applied by ``audits.cli.run`` on top.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from audits.common import UsageError
from audits.kernels import kernel_domain
from audits.suites.case import case_from_json, cases_from_file
from audits.suites.cases import SUITES, build_suite, fidelity_cases, suite
from audits.suites.domain import Domain, DomainError
from audits.suites.suite_file import build, is_suite_file, load

__all__ = ["Selection", "select_cases", "kernels_domains", "read_domain"]


@dataclass(frozen=True)
class Selection:
    """The selected cases, the label the reports carry (the suite's name, ``config``, the case
    files' names), the domain the suite was built in (the report's ``domain``; None when no
    domain restricted it), the ``--domain`` file's domain (None: none given) and each kernel's
    declared domain narrowed by it (resolved once for the run: the coverage bases reuse them)."""

    cases: list
    label: str
    domain_info: dict | None = None
    narrowing: Domain | None = None
    kernel_domains: dict[str, Domain] = field(default_factory=dict)


def read_domain(path: str | Path) -> Domain:
    """The domain of a ``--domain`` file; a :class:`UsageError` naming the option and the file."""
    try:
        return Domain.from_toml(path)
    except DomainError as exc:
        raise UsageError(f"--domain: {exc}") from exc


def kernels_domains(kernels: Sequence[str], narrow: Domain | None = None) -> tuple[dict[str, Domain], Domain]:
    """(each kernel's declared domain narrowed by ``narrow``, the ``--domain`` file's domain; the
    domain to build in): several kernels' union (``Domain.widen``), one kernel's own, or with no
    kernel (``static``) ``narrow``'s.  The union, not the intersection: kernels are compared case
    by case on one suite, and none loses the cases only it supports; each skips the cases outside
    its own domain (``audits.engine.evaluate``, ``audits.checks.invariance.core``)."""
    narrow = Domain() if narrow is None else narrow
    try:
        own = {kern: kernel_domain(kern).narrow(narrow) for kern in dict.fromkeys(kernels)}
    except ValueError as exc:  # a kernel that cannot be loaded, or a malformed declaration: its own message
        raise UsageError(str(exc)) from exc
    return own, functools.reduce(Domain.widen, own.values()) if own else narrow


def select_cases(
    *,
    suite: str | None = None,
    default_suite: str = "smoke",
    configs: Sequence[str] = (),
    case_files: Sequence[str] = (),
    case_glob: str | None = None,
    domain: Domain | str | Path | None = None,
    seed: int = 0,
    kernels: Sequence[str] = (),
) -> Selection:
    """The cases selected (module doc: the rules): ``suite`` (a named suite or a suite file;
    None: ``default_suite``) or the given ``configs`` (JSON texts) and ``case_files``, built
    within ``kernels``' declared domains narrowed by ``domain`` (a Domain, or a ``--domain``
    file's path, read here once); ``seed`` added to every case's seed; ``case_glob`` keeping the
    cases whose name or fidelity label matches.  Every mistake is a :class:`UsageError` naming
    the option and the value."""
    if suite is not None and (configs or case_files):
        raise UsageError("--suite cannot be combined with --config or --case-file: they give the cases themselves")
    narrow = domain if domain is None or isinstance(domain, Domain) else read_domain(domain)
    own, d = kernels_domains(kernels, narrow)
    narrow = Domain() if narrow is None else narrow
    try:
        if configs or case_files:
            sel = _given(list(configs), list(case_files), narrow)
        else:
            sel = _suite(suite or default_suite or "smoke", narrow, own, d)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    cases = sel.cases
    if seed:
        cases = [dataclasses.replace(c, seed=c.seed + seed) for c in cases]
    if case_glob:
        labels = _fidelity_labels()
        cases = [
            c for c in cases if fnmatch.fnmatch(c.name, case_glob) or fnmatch.fnmatch(labels.get(c, ""), case_glob)
        ]
        if not cases:
            raise UsageError(f"--case {case_glob!r} matches no case of {sel.label!r}")
    if not cases:
        raise UsageError(f"the selection {sel.label!r} holds no case")
    return dataclasses.replace(sel, cases=cases, narrowing=None if domain is None else narrow, kernel_domains=own)


@functools.cache
def _fidelity_labels() -> dict:
    return {c: label for label, c in fidelity_cases().items()}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr)


def _given(configs: list[str], files: list[str], narrow) -> Selection:
    """``--config`` and ``--case-file`` cases (in order, each once), those outside the
    ``--domain`` file left out and said."""
    cases = [case_from_json(text, where=f"--config #{i + 1}") for i, text in enumerate(configs)]
    for path in files:
        cases += cases_from_file(path)
    label = "+".join((["config"] if configs else []) + [Path(p).name for p in files])
    kept = []
    for c in dict.fromkeys(cases):
        why = narrow.refusal(c)
        if why is None:
            kept.append(c)
        else:
            _say(f"{label}: case {c.name} not run: outside the --domain file: {why}")
    if not kept:
        raise ValueError(f"none of the {len(cases)} given cases lies in the --domain file's domain")
    return Selection(kept, label)


def _suite(name: str, narrow, own: dict, d) -> Selection:
    """A named suite or a suite file, built within ``d``."""
    if is_suite_file(name):
        return _suite_file(name, narrow, own, d)
    if name not in SUITES:
        suite(name)  # its ValueError names the known suites
    if d == Domain() and all(x == Domain() for x in own.values()):
        return Selection(suite(name), name)
    built = build_suite(name, d)
    info = _domain_info(own, d, built, name)
    if built["axes"] is None and d != Domain():  # a fixed list (fidelity's) filtered, not built: say what it lost
        whole, kept = suite(name), set(built["cases"])
        lost = [c for c in whole if c not in kept]
        if lost:
            info["cases_outside"] = len(lost)
            _say(
                f"{name}: {len(lost)} of {len(whole)} cases lie outside the kernels' domain and are not run "
                f"(e.g. {lost[0].name}: {d.refusal(lost[0])})"
            )
    if len(own) > 1:  # the per-kernel domains and the cases each will skip
        outside = {k: sum(x.refusal(c) is not None for c in built["cases"]) for k, x in own.items()}
        info["kernels"] = {k: {"domain": x.as_dict(), "cases_outside": outside[k]} for k, x in own.items()}
        for kern, n in outside.items():
            if n:
                _say(f"{name}: {kern} skips {n} of {len(built['cases'])} cases outside its declared domain")
    if not built["cases"]:
        raise ValueError(f"suite {name!r}: none of its cases lies in the domain {d.as_dict()}")
    return Selection(built["cases"], name, info)


def _domain_info(own: dict, d, built: dict, label: str) -> dict:
    """The report's ``domain``: the rule (one kernel's domain, several kernels' union, or the
    ``--domain`` file's alone), the domain built within, the pairs covered, the families not
    applicable (also said on stderr)."""
    for fam, why in built["not_applicable"].items():
        _say(f"{label}: family {fam} not applicable in the kernels' domain: {why}")
    rule = "union" if len(own) > 1 else "single" if own else "domain file"
    return {
        "rule": rule,
        "domain": d.as_dict(),
        "pairs_covered": built["pairs_covered"],
        "not_applicable": built["not_applicable"],
    }


def _suite_file(path: str, narrow, own: dict, d) -> Selection:
    """``--suite FILE.toml`` (``audits.suites.suite_file``): its axes' covering array built within
    ``d`` as a named suite is, and its ``[[case]]`` s as given: one outside a kernel's declared
    domain is that kernel's ``skipped`` case with the reason, one outside the ``--domain`` file
    is not run; both said on stderr (and in the report's ``domain``)."""
    sf = load(path)
    built = build(sf, d, cases_in=narrow)
    info = _domain_info(own, d, built, sf.name)  # says which families do not apply, restricted or not
    restricted = d != Domain() or any(x != Domain() for x in own.values())
    for axis, why in built["restricted"].items():
        _say(f"{sf.name}: axis {axis}: {why}")
    for s in built["skipped"]:
        _say(f"{sf.name}: [[case]] {s['case']} not run: outside the --domain file: {s['reason']}")
    for kern, x in own.items():
        for c in sf.cases:
            if c in built["cases"] and (why := x.refusal(c)):
                _say(f"{sf.name}: [[case]] {c.name}: {kern} skips it, outside its declared domain: {why}")
    if not built["cases"]:
        raise ValueError(f"suite file {path}: none of its cases lies in the kernels' domain")
    info = {**info, "axes_restricted": built["restricted"], "skipped": built["skipped"]} if restricted else None
    return Selection(built["cases"], sf.name, info)
