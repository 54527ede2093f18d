"""Known defects (``--known FILE.toml``): failures a team has recorded, tracked upstream, and does
not want to fail its gate on, while every other failure still does (issue 33, item 4;
docs/known.md).

A known file is a TOML list of entries::

    [[known]]
    id = "masked-key-nonfinite-leak"          # unique in the file; a case record's known_id
    reason = "NaN/inf at keys a row never sees leak through P.V (0 * inf = NaN)"
    upstream = "https://github.com/Dao-AILab/flash-attention/issues/..."   # optional: where it is tracked
    rule = "family in {nan_inf_masked, nan_inf_visible} and fails nonfinite"
    failures = ["nonfinite", "fa-criterion", "bound", "grad-bound", "unseen-nonzero"]
    kernels = ["fa4"]                          # optional: the kernels it applies to (default: every kernel)
    versions = ">=4.0.0b36"                    # optional: flash-attn-4 versions, as the report records them
    torch_versions = ">=2.11"                  # optional: torch versions, as the report records them
    devices = ["cuda"]                         # optional: the devices it applies to (cpu, cuda; default: both)
    raises = "NoValidChoicesError"             # optional: a regex every kernel-call failure's reason must match
    evidence = ["reports/h200/release/fa4/report.json.xz: ..."]   # optional: where it was seen

``rule`` is a conjunction (``and``) of the predicates ``audits.verdict.separators`` prints, over
a case's configuration (any ``Case`` field, and ``local``, ``varlen``, ``backward``: the case's
backward was called, whether it ran, raised, crashed or timed out): booleans (``causal``, ``not
sink``, ``no seqused_k``, a bare field: set and not 0/empty), comparisons (``d != dv``,
``softcap > 0``, ``seqlen_q < seqlen_k``, ``d % 32 != 0``, ``window == (64, 0)``), memberships
(``family in {a, b}``, ``score_mod not in {alibi}``), code-path classes (``class
sm90.bwd.accum.wider_than_tile``, read with the report's architecture) and failure kinds
(``fails nonfinite:lse``: the case has a failing finding of that kind, on that tensor).
``failures`` lists the failure kinds (:data:`FAILURE_KINDS`, ``KIND`` or ``KIND:TENSOR``) the
defect accounts for.

A failing case (``audits.report.records.FAILING``) is ``known`` under the first entry (in file
order) that applies to the report (its kernel, its device, its flash-attn-4 and torch versions),
whose rule it satisfies, whose ``failures`` cover every failing finding of the case, and, with
``raises``, whose pattern every kernel-call failure of the case (``error``, ``crash``,
``timeout`` and the backward's) matches in its reason (a call's failure is otherwise known by
its configuration alone, and any exception there would pass as the known one): a case that also fails for a
reason the entry does not name keeps its verdict, so a new defect on a known configuration still
fails.  The record keeps the verdict it had (``known_from``) and the entry (``known_id``).  An
entry that applies, and whose rule's configuration part (the rule without its ``fails``
predicates) some judged case satisfies, but that matches no failing case is **no longer
reproducing**; one that no such case exercised is **not exercised** (a smoke run has no case
where a backward defect could show: that says nothing about the defect).

Entries are read strictly: an unknown key, a missing id, reason, rule or failures, a duplicate
id, a rule that does not parse or names an unknown field, an unknown failure kind, a bad
version range, a device not in :data:`DEVICES` or a ``raises`` that is not a regular expression
is a :class:`KnownError` naming the file, the entry and what is accepted (the
commands exit 2 on it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

from audits.common import read_toml
from audits.kernels import base_kernel
from audits.report.records import FAILING, CaseRecord
from audits.suites.case import Case, case_from_dict
from audits.verdict.coverage import classes_ran
from audits.verdict.gate import findings
from audits.verdict.separators import separators

__all__ = [
    "KNOWN",
    "SHIPPED",
    "FAILURE_KINDS",
    "TENSORS",
    "ENTRY_KEYS",
    "DEVICES",
    "KnownError",
    "KnownEntry",
    "KnownFile",
    "Rule",
    "parse_rule",
    "load_known",
    "failure_labels",
    "apply_known",
    "known_lines",
    "strict_failed",
]

#: the verdict of a failing case that a known entry describes (``audits.report.records.VERDICTS``)
KNOWN = "known"
#: the known files shipped in the package, selectable by name (``--known fa4``; several joined by
#: commas, ``--known fa4,torch``): production FA4's known defects, and PyTorch's peers' (the
#: ``flex`` and ``sdpa-*`` kernels, docs/peers.md)
SHIPPED = {
    "fa4": Path(__file__).with_name("known_fa4.toml"),
    "torch": Path(__file__).with_name("known_torch.toml"),
}
#: the device types an entry's ``devices`` names (a report's ``device``, ``--device``)
DEVICES = ("cpu", "cuda")
#: the failure kinds a ``failures`` list and a ``fails`` predicate name: the gate's findings
#: (``audits.verdict.findings``) by their kind; a kernel call's failure by its verdict
FAILURE_KINDS = {
    "nonfinite": "NaN or inf where the reference is finite (or a deviation the policy fails)",
    "bound": "a value beyond the per-element forward-pass bound",
    "fa-criterion": "FlashAttention's own test criterion missed",
    "lse-ceiling": "an LSE error above the [lse] ceiling",
    "lse-missing": "no LSE returned, under [policy] lse_missing = fail",
    "uncertified": "the FP64 reference not certified by the exact row",
    "unwritten": "elements never written, in a result the other checks accepted (the poisoned re-runs; out and LSE)",
    "memory-read": "elements reading memory never written, in a result the other checks accepted (out and LSE)",
    "grad-bound": "a gradient beyond the backward bound",
    "grad-missing": "autograd returned no gradient for an input",
    "grad-contract": "the backward broke the gradient contract",
    "unseen-nonzero": "dK/dV not zero at keys no query sees",
    "empty-row-nonzero": "dQ not zero on rows that see no key",
    "nondeterministic": "gradients differ between runs under deterministic=True",
    "grad-uncertified": "the FP64 gradients not certified by the exact elements",
    "baseline": "worse than the baseline report (gate --baseline)",
    "error": "the kernel call raised",
    "crash": "the kernel's worker process died",
    "timeout": "the kernel call passed --timeout",
    "backward-error": "the backward call raised",
    "backward-crash": "the backward's worker process died",
    "backward-timeout": "the backward call passed --timeout",
}
#: the tensors a failure kind may name (``KIND:TENSOR``), as findings name them, lower-cased
TENSORS = ("out", "lse", "dq", "dk", "dv", "dsink", "reference")
#: an entry's keys, each with its type; the required ones first
ENTRY_KEYS = {
    "id": str, "reason": str, "rule": str, "failures": list,
    "upstream": str, "kernels": list, "versions": str, "torch_versions": str, "devices": list, "raises": str,
    "evidence": list,
}  # fmt: skip
_REQUIRED = ("id", "reason", "rule", "failures")
#: a case's fields a rule may name: the Case fields, and the derived ones
_CASE_DEFAULTS = {f.name: f.default for f in fields(Case)}
_DERIVED = ("local", "varlen", "backward")
#: a case's backward statuses (``audits.engine.backward``) under which the backward was called
_CALLED = ("ran", "error", "crash", "timeout")
_NUMERIC = {k for k, v in _CASE_DEFAULTS.items() if isinstance(v, int | float) and not isinstance(v, bool)}


class KnownError(ValueError):
    """A malformed known file or rule; the message names the file, the entry and what is accepted."""


# ---- versions: flash-attn-4's release numbers (PEP 440's N.N.N[{a,b,rc}N][.postN][.devN]) -------

_VERSION = re.compile(r"(\d+(?:\.\d+)*)(?:(a|b|rc)(\d+))?(?:\.post(\d+))?(?:\.dev(\d+))?(?:\+[\w.]+)?")
_OPS = {
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b, ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b,
}  # fmt: skip


def _version_key(text: str) -> tuple | None:
    """A version's sort key (PEP 440 order for the forms flash-attn-4 releases use: a dev release
    before its pre-releases, these before the release, the release before its post releases; a
    local part ignored), or None when ``text`` is not such a version."""
    m = _VERSION.fullmatch(text.strip())
    if not m:
        return None
    rel, pre, pre_n, post, dev = m.groups()
    nums = tuple(int(x) for x in rel.split("."))
    nums += (0,) * (6 - len(nums))
    pre_key = ({"a": 0, "b": 1, "rc": 2}[pre], int(pre_n)) if pre else ((-1, 0) if dev and not post else (3, 0))
    return (nums, pre_key, int(post) if post else -1, int(dev) if dev else float("inf"))


def _parse_versions(spec: str, where: str) -> tuple[tuple[str, tuple], ...]:
    """``">=4.0.0b36, <4.0.0b41"`` as ((op, key), ...): every clause must hold."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(==|!=|>=|<=|>|<)\s*(\S+)\s*", part)
        key = _version_key(m.group(2)) if m else None
        if key is None:
            raise KnownError(
                f"{where}: versions {spec!r}: {part.strip()!r} is not OP VERSION; accepted: comma-separated clauses "
                "of ==, !=, >=, <=, >, < and a version such as 4.0.0b40"
            )
        out.append((m.group(1), key))
    return tuple(out)


# ---- rules -------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(==|!=|>=|<=|[<>{}(),%:]|-?\d+(?:\.\d+)?(?:e-?\d+)?|[A-Za-z_][\w.\-]*)")


def _tokens(text: str, where: str) -> list[str]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise KnownError(f"{where}: rule {text!r}: cannot read {text[pos:].strip()!r} (at character {pos})")
        out.append(m.group(1))
        pos = m.end()
    return out


def _value(tok: str):
    """A rule's literal: a number, None, true/false, else a bare word (a string)."""
    if re.fullmatch(r"-?\d+", tok):
        return int(tok)
    if re.fullmatch(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", tok):
        return float(tok)
    return {"None": None, "none": None, "null": None, "true": True, "True": True, "false": False, "False": False}.get(
        tok, tok
    )


@dataclass(frozen=True)
class _Pred:
    """One predicate: ``op`` "truth" (``left`` a field), "compare" (``left`` and ``right``
    operands: ("field", name, modulus or None) or ("value", v)), "in" (``right`` a frozenset),
    "class" (``left`` a class name), "fails" (``left`` a failure kind, ``right`` a tensor or
    None); ``negated`` for ``not``."""

    op: str
    left: object
    right: object = None
    cmp: str = ""
    negated: bool = False


class _Parser:
    def __init__(self, text: str, where: str):
        self.text, self.where = text, where
        self.toks = _tokens(text, where)
        self.i = 0

    def fail(self, why: str) -> KnownError:
        return KnownError(f"{self.where}: rule {self.text!r}: {why}")

    def peek(self, k: int = 0) -> str | None:
        return self.toks[self.i + k] if self.i + k < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise self.fail(f"expected {want or 'more'} {'at the end' if tok is None else f'before {tok!r}'}")
        self.i += 1
        return tok

    def rule(self) -> tuple[_Pred, ...]:
        if not self.toks:
            raise self.fail("empty; write predicates joined by 'and' (docs/known.md)")
        preds = [self.clause()]
        while self.peek() == "and":
            self.take()
            preds.append(self.clause())
        if self.peek() is not None:
            raise self.fail(f"unexpected {self.peek()!r}: predicates are joined by 'and' only")
        return tuple(preds)

    def clause(self) -> _Pred:
        tok = self.peek()
        if tok in ("not", "no") and self.peek(1) not in (None, "in", "==", "!="):
            self.take()
            p = self.clause()
            return _Pred(p.op, p.left, p.right, p.cmp, not p.negated)
        if tok == "class":
            self.take()
            return _Pred("class", self.take())
        if tok == "fails":
            self.take()
            return _Pred("fails", *_failure(self.take_failure(), self.where))
        left = self.operand(left=True)
        op = self.peek()
        if op == "not" and self.peek(1) == "in":
            self.take()
            return self.membership(left, negated=True)
        if op == "in":
            return self.membership(left, negated=False)
        if op in _OPS:
            self.take()
            right = self.operand(left=False)
            if op not in ("==", "!=") and not all(self.numeric(x) for x in (left, right)):
                raise self.fail(f"{op} compares numbers; numeric fields: {', '.join(sorted(_NUMERIC))}")
            return _Pred("compare", left, right, op)
        if left[0] != "field" or left[2] is not None:
            raise self.fail(f"expected a field before {op!r}" if op else "a value alone is no predicate")
        return _Pred("truth", left[1])

    def take_failure(self) -> str:
        kind = self.take()
        if self.peek() == ":":
            self.take()
            return f"{kind}:{self.take()}"
        return kind

    def membership(self, left: tuple, *, negated: bool) -> _Pred:
        if left[0] != "field":
            raise self.fail("'in' needs a field on its left")
        self.take("in")
        self.take("{")
        vals = [self.literal()]
        while self.peek() == ",":
            self.take()
            vals.append(self.literal())
        self.take("}")
        return _Pred("in", left, frozenset(vals), negated=negated)

    def literal(self):
        if self.peek() == "(":  # a tuple: window == (64, 0)
            self.take()
            vals = [self.literal()]
            while self.peek() == ",":
                self.take()
                vals.append(self.literal())
            self.take(")")
            return tuple(vals)
        return _value(self.take())

    def operand(self, *, left: bool) -> tuple:
        """A field (with its ``% m``), or a literal; an unknown word is an error on the left (a
        misspelt field), a bare string on the right (``family == normal``)."""
        tok = self.peek()
        word = tok is not None and re.fullmatch(r"[A-Za-z_]\w*", tok) and _value(tok) == tok
        if word and (left or tok in _CASE_DEFAULTS or tok in _DERIVED):
            self.take()
            if tok not in _CASE_DEFAULTS and tok not in _DERIVED:
                accepted = ", ".join([*_CASE_DEFAULTS, *_DERIVED])
                raise self.fail(f"unknown field {tok!r}; accepted: {accepted}, class NAME, fails KIND[:TENSOR]")
            mod = None
            if self.peek() == "%":
                self.take()
                mod = _value(self.take())
                if not isinstance(mod, int) or mod < 1 or tok not in _NUMERIC:
                    raise self.fail(f"'{tok} % {mod}': a residue takes a numeric field and a positive integer")
            return ("field", tok, mod)
        return ("value", self.literal())

    @staticmethod
    def numeric(x: tuple) -> bool:
        if x[0] == "field":
            return x[1] in _NUMERIC
        return isinstance(x[1], int | float) and not isinstance(x[1], bool)


def _failure(text: str, where: str) -> tuple[str, str | None]:
    """``KIND`` or ``KIND:TENSOR`` as (kind, tensor or None); KnownError naming what is accepted."""
    kind, _, tensor = text.partition(":")
    if kind not in FAILURE_KINDS:
        raise KnownError(f"{where}: unknown failure kind {kind!r}; accepted: {', '.join(FAILURE_KINDS)}")
    if tensor and tensor.lower() not in TENSORS:
        raise KnownError(f"{where}: {text!r} names the tensor {tensor!r}; accepted: {', '.join(TENSORS)}")
    return kind, tensor.lower() or None


@dataclass(frozen=True)
class Rule:
    """A parsed rule: its text and its predicates (all must hold)."""

    text: str
    preds: tuple

    def holds(self, *, rec: CaseRecord, labels: frozenset, classes: frozenset, configuration_only: bool) -> bool:
        """Whether case record ``rec`` (its failing findings' ``labels``, :func:`failure_labels`;
        its code-path ``classes``) satisfies the rule; ``configuration_only``: the ``fails``
        predicates (negated or not) are left out (does the configuration exercise the defect?)."""
        for p in self.preds:
            if p.op == "fails":
                if configuration_only:
                    continue
                got = any(k == p.left and (p.right is None or t == p.right) for k, t in labels)
            elif p.op == "class":
                got = p.left in classes
            elif p.op == "truth":
                got = bool(_field(rec, p.left))
            elif p.op == "in":
                got = _operand(rec, p.left) in p.right
            else:
                a, b = _operand(rec, p.left), _operand(rec, p.right)
                ordered = p.cmp in ("==", "!=") or (a is not None and b is not None)
                got = ordered and _OPS[p.cmp](a, b)
            if got == p.negated:
                return False
        return True

    @property
    def needs_classes(self) -> bool:
        return any(p.op == "class" for p in self.preds)


def parse_rule(*, text: str, where: str) -> Rule:
    """``text`` parsed (grammar: the module docstring); KnownError naming ``where`` when it does not parse."""
    return Rule(text, _Parser(text, where).rule())


def _field(rec: CaseRecord, name: str):
    cfg = rec.get("config") or {}
    if name == "backward":  # the backward was called (it ran, raised, crashed or timed out; not skipped)
        return (rec.get("backward") or {}).get("status") in _CALLED
    if name == "varlen":
        return bool(cfg.get("seqlens"))
    if name == "local":
        w = cfg.get("window") or (None, None)
        return not cfg.get("causal") and any(x is not None for x in w)
    v = cfg.get(name, _CASE_DEFAULTS[name])
    return tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list | tuple) else v


def _operand(rec: CaseRecord, x: tuple):
    if x[0] == "value":
        return x[1]
    v = _field(rec, x[1])
    return v % x[2] if x[2] is not None and isinstance(v, int | float) else v


# ---- entries and files ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KnownEntry:
    """One known defect (the module docstring says what each key means)."""

    id: str
    reason: str
    rule: str
    failures: tuple[str, ...]
    upstream: str = ""
    kernels: tuple[str, ...] = ()
    versions: str = ""
    torch_versions: str = ""
    devices: tuple[str, ...] = ()
    raises: str = ""
    evidence: tuple[str, ...] = ()

    def compiled(self, where: str) -> tuple[Rule, frozenset, tuple]:
        """(rule, failures as (kind, tensor) pairs, (flash-attn-4 clauses, torch clauses)), each
        checked, as are ``devices`` and ``raises``."""
        rule = parse_rule(text=self.rule, where=where)
        allowed = frozenset(_failure(f, where) for f in self.failures)
        versions = _parse_versions(self.versions, where) if self.versions else ()
        torch_versions = _parse_versions(self.torch_versions, f"{where}: torch_versions") if self.torch_versions else ()
        if bad := [d for d in self.devices if d not in DEVICES]:
            raise KnownError(
                f"{where}: devices {list(self.devices)!r}: {bad[0]!r} is no device; accepted: {', '.join(DEVICES)}"
            )
        if self.raises:
            try:
                re.compile(self.raises)
            except re.error as exc:
                raise KnownError(f"{where}: raises {self.raises!r} is not a regular expression ({exc})") from None
        return rule, allowed, (versions, torch_versions)

    def as_dict(self) -> dict:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}


@dataclass(frozen=True)
class KnownFile:
    """A known file: where it was read (``path``; a shipped one by its path) and its entries, in order."""

    path: str
    entries: tuple[KnownEntry, ...]

    def as_dict(self) -> dict:
        return {"path": self.path, "entries": [e.as_dict() for e in self.entries]}

    @classmethod
    def from_dict(cls, d: dict) -> KnownFile:
        """The file :meth:`as_dict` gave (a ``--jobs`` child's options), checked again."""
        return _entries(d.get("entries"), str(d.get("path", "known")))


def _entries(raw, path: str) -> KnownFile:
    if not isinstance(raw, list) or not raw:
        raise KnownError(f"{path}: expected [[known]] entries (each id, reason, rule, failures; docs/known.md)")
    out, seen = [], {}
    for i, e in enumerate(raw):
        label = f"{path}: [[known]] entry {i + 1}" + (f" ({e['id']!r})" if isinstance(e, dict) and "id" in e else "")
        if not isinstance(e, dict):
            raise KnownError(f"{label}: expected a table of keys {', '.join(ENTRY_KEYS)}")
        if unknown := sorted(set(e) - set(ENTRY_KEYS)):
            raise KnownError(f"{label}: unknown key(s) {', '.join(unknown)}; accepted: {', '.join(ENTRY_KEYS)}")
        if missing := [k for k in _REQUIRED if k not in e]:
            raise KnownError(f"{label}: missing {', '.join(missing)} (required: {', '.join(_REQUIRED)})")
        for key, typ in ENTRY_KEYS.items():
            if key in e and not isinstance(e[key], typ):
                raise KnownError(f"{label}: {key} = {e[key]!r} must be a {typ.__name__}")
            if typ is list and key in e and not all(isinstance(x, str) for x in e[key]):
                raise KnownError(f"{label}: {key} must be a list of strings")
        if not e["id"].strip() or not re.fullmatch(r"[A-Za-z0-9_.\-]+", e["id"]):
            raise KnownError(f"{label}: id {e['id']!r} must be a non-empty word of letters, digits, '.', '_', '-'")
        if e["id"] in seen:
            raise KnownError(f"{label}: duplicate id {e['id']!r} (also entry {seen[e['id']]})")
        if not e["failures"]:
            raise KnownError(f"{label}: failures is empty; list the failure kinds it accounts for")
        seen[e["id"]] = i + 1
        entry = KnownEntry(**{k: tuple(v) if isinstance(v, list) else v for k, v in e.items()})
        entry.compiled(label)  # every rule, failure kind and version range checked on reading
        out.append(entry)
    return KnownFile(path=path, entries=tuple(out))


def load_known(spec: str) -> KnownFile:
    """A known file: a shipped one by name (:data:`SHIPPED`: ``fa4``, ``torch``) or a path to a
    TOML file; several joined by commas (``fa4,torch``, ``fa4,team.toml``) are one file of their
    entries in that order (an id in two of them is a KnownError).  KnownError naming the file, the
    entry and what is accepted when one is missing or malformed."""
    if "," in spec:
        parts = [p.strip() for p in spec.split(",")]
        if not all(parts):
            raise KnownError(
                f"--known {spec!r}: an empty name between commas; accepted: NAME or FILE.toml, comma-joined"
            )
        files = [load_known(p) for p in parts]
        seen: dict[str, str] = {}
        for f in files:
            for e in f.entries:
                if e.id in seen:
                    raise KnownError(f"--known {spec!r}: id {e.id!r} is in both {seen[e.id]} and {f.path}")
                seen[e.id] = f.path
        return KnownFile(path=", ".join(f.path for f in files), entries=tuple(e for f in files for e in f.entries))
    path = SHIPPED.get(spec, Path(spec))
    if spec not in SHIPPED and not str(spec).endswith(".toml"):
        raise KnownError(
            f"--known {spec!r}: expected a shipped name ({', '.join(SHIPPED)}) or a FILE.toml, "
            "or several joined by commas"
        )
    data = read_toml(path, what="known", error=KnownError)
    if unknown := sorted(set(data) - {"known"}):
        raise KnownError(f"{path}: unknown top-level key(s) {', '.join(unknown)}; accepted: [[known]] entries")
    return _entries(data.get("known"), str(path))


# ---- applying a known file to a report -----------------------------------------------------------


def failure_labels(*, rec: CaseRecord, thresholds: dict) -> frozenset[tuple[str, str | None]]:
    """The (kind, tensor) of every failing finding of case record ``rec`` under ``thresholds``
    (``audits.verdict.gate.findings``): a kernel call's failure as its verdict (``error``,
    ``backward-error``, ...), the rest by the finding's kind and tensor (lower-cased; None for none)."""
    out = set()
    for f in findings(rec, thresholds):
        if f.severity not in FAILING:
            continue
        if f.kind == "status":
            out.add((f.severity, None))
        elif f.kind == "backward":
            out.add((f"backward-{f.severity}", None))
        else:
            out.add((f.kind, f.quantity.lower() or None))
    return frozenset(out)


def _covered(labels: frozenset, allowed: frozenset) -> bool:
    return bool(labels) and all(any(k == a and (t is None or t == at) for a, t in allowed) for k, at in labels)


def _applies(entry: KnownEntry, versions: tuple, report: dict) -> str | None:
    """Why ``entry`` does not apply to ``report`` (its kernel, its device, its flash-attn-4 and
    torch versions), else None."""
    kernel = report["kernel"]  # fa4@DIR is production, a variant its model (audits.kernels.base_kernel)
    if entry.kernels and kernel not in entry.kernels and base_kernel(kernel) not in entry.kernels:
        return f"kernel {kernel} is not one of {', '.join(entry.kernels)}"
    device = str(report.get("device") or "unknown").split(":")[0]
    if entry.devices and device not in entry.devices:
        return f"device {device} is not one of {', '.join(entry.devices)}"
    env = report.get("environment") or {}
    fa4_clauses, torch_clauses = versions
    for package, clauses, spec in (
        ("flash-attn-4", fa4_clauses, entry.versions),
        ("torch", torch_clauses, entry.torch_versions),
    ):
        if not clauses:
            continue
        have = env.get(package) or (env.get("versions") or {}).get(package)
        key = _version_key(str(have)) if have else None
        if key is None:
            return f"the report records no {package} version ({have!r}); the entry applies to {spec}"
        if not all(_OPS[op](key, want) for op, want in clauses):
            return f"{package} {have} is outside {spec}"
    return None


#: the failure kinds of a kernel call that failed (a reason, no finding): the ones ``raises`` reads
_CALL_FAILURES = ("error", "crash", "timeout")


def _raises_match(rec: CaseRecord, labels: frozenset, pattern: str) -> bool:
    """Whether every kernel-call failure among ``labels`` (the call's, the backward's) has a
    reason that ``pattern`` matches (``re.search``); True when the case has none."""
    for kind, _ in labels:
        if kind in _CALL_FAILURES:
            why = rec.get("reason")
        elif kind.startswith("backward-") and kind.removeprefix("backward-") in _CALL_FAILURES:
            why = (rec.get("backward") or {}).get("reason")
        else:
            continue
        if not re.search(pattern, str(why or "")):
            return False
    return True


def _unknown(rec: dict) -> dict:
    """A record as it was before a known file was applied to it."""
    if rec.get("verdict") != KNOWN and "known_id" not in rec:
        return rec
    out = {k: v for k, v in rec.items() if k not in ("known_id", "known_from")}
    if rec.get("verdict") == KNOWN:
        out["verdict"] = rec.get("known_from", "fail")
    return out


def _classes(rec: CaseRecord, arch: str | None, cache: dict) -> frozenset:
    """The code-path classes the record's call went through (forward; backward when it was called)."""
    if arch is None:
        return frozenset()
    case = case_from_dict(rec["config"], where=f"case {rec.get('case')}")
    called = (rec.get("backward") or {}).get("status") in _CALLED
    dirs = ("forward", "backward") if called else ("forward",)
    return frozenset(c for d in dirs for c in classes_ran(rec=rec, case=case, arch=arch, direction=d, cache=cache))


def apply_known(*, report: dict, known: KnownFile | None, strict: bool = False) -> dict:
    """``report`` with ``known`` applied (a new dict; the cases copied where they change): each
    failing case an entry describes gets the verdict ``known`` (``known_id``, ``known_from``: the
    verdict it had), the summary's counts follow, and ``report["known"]`` says per entry whether
    it applied, how many cases it matched and exercised, and its status (reproduced, no longer
    reproducing, not exercised, not applicable); ``strict``: an entry no longer reproducing fails
    the run (``audits.report.build.exit_code``).  A previous application is undone first; None
    undoes it alone.  KnownError when the report's thresholds are a digest (a journal read back):
    the failure kinds need the whole thresholds."""
    cases = [_unknown(c) for c in report["cases"]]
    out = {**report, "cases": cases}
    out.pop("known", None)
    if known is None:
        return _recount(out)
    th = report.get("thresholds") or {}
    if not isinstance(th.get("policy"), dict):
        raise KnownError(
            f"--known {known.path}: the report keeps only its thresholds' digest (it was read from a journal), "
            "and failure kinds are judged under the whole thresholds: re-judge it with gate and --thresholds first"
        )
    arch = (report.get("coverage") or {}).get("arch")
    compiled = []
    for i, e in enumerate(known.entries):
        rule, allowed, versions = e.compiled(f"{known.path}: [[known]] entry {i + 1} ({e.id!r})")
        compiled.append((e, rule, allowed, _applies(e, versions, report)))
    live = [(e, rule, allowed) for e, rule, allowed, why in compiled if why is None]
    matched = {e.id: 0 for e in known.entries}
    exercised = dict(matched)
    cache: dict = {}
    for i, rec in enumerate(cases):
        if rec.get("verdict") in ("skipped", "out-of-domain") or not live:
            continue
        classes = _classes(rec, arch, cache) if any(r.needs_classes for _, r, _ in live) else frozenset()
        failing = rec["verdict"] in FAILING
        labels = failure_labels(rec=rec, thresholds=th) if failing else frozenset()
        hit = None
        for e, rule, allowed in live:
            if rule.holds(rec=rec, labels=labels, classes=classes, configuration_only=True):
                exercised[e.id] += 1
                ok = failing and _covered(labels, allowed) and (not e.raises or _raises_match(rec, labels, e.raises))
                if hit is None and ok and rule.holds(rec=rec, labels=labels, classes=classes, configuration_only=False):
                    hit = e.id
        if hit is not None:
            matched[hit] += 1
            cases[i] = {**rec, "verdict": KNOWN, "known_id": hit, "known_from": rec["verdict"]}
    out["known"] = _section(known, compiled, matched, exercised, strict)
    return _recount(out)


def _section(known: KnownFile, compiled: list, matched: dict, exercised: dict, strict: bool) -> dict:
    entries = []
    for e, _, _, why in compiled:
        if why is not None:
            status = "not applicable"
        elif matched[e.id]:
            status = "reproduced"
        elif exercised[e.id]:
            status = "no longer reproducing"
        else:
            status = "not exercised"
        entries.append({
            "id": e.id, "reason": e.reason, "upstream": e.upstream, "rule": e.rule, "status": status,
            "matched": matched[e.id], "exercised": exercised[e.id], "not_applicable": why,
        })  # fmt: skip
    gone = [x["id"] for x in entries if x["status"] == "no longer reproducing"]
    return {"file": known.path, "strict": strict, "entries": entries, "not_reproducing": gone}


def _recount(rep: dict) -> dict:
    """The summary's verdict counts after verdicts changed (the rest of the summary stands), and
    the separators recomputed over the cases still failing (a known case is neither failing nor
    passing: ``audits.verdict.separators``)."""
    if isinstance(rep.get("diagnosis"), dict):
        rep["diagnosis"] = separators(rep["cases"], arch=(rep.get("coverage") or {}).get("arch"))
    summary = rep.get("summary")
    if isinstance(summary, dict) and isinstance(summary.get("verdicts"), dict):
        counts = {v: 0 for v in summary["verdicts"]} | {KNOWN: 0}
        for c in rep["cases"]:
            counts[c["verdict"]] = counts.get(c["verdict"], 0) + 1
        evaluated = counts.get("pass", 0) + counts.get("warn", 0) + counts.get("fail", 0)
        evaluated += sum(c.get("known_from") == "fail" for c in rep["cases"] if c["verdict"] == KNOWN)
        rep["summary"] = {**summary, "verdicts": counts, "evaluated": evaluated}
    return rep


def strict_failed(report: dict) -> bool:
    """Whether a report's known section fails it: ``--strict-known`` and an entry no longer reproducing."""
    k = report.get("known")
    return isinstance(k, dict) and bool(k.get("strict")) and bool(k.get("not_reproducing"))


def _headline(reason: str) -> str:
    """A reason's first clause (up to its first ": " or ". "), for one-line views; the report's
    ``known`` keeps the whole."""
    return re.split(r":\s|\.\s", reason.strip(), maxsplit=1)[0]


def known_lines(report: dict) -> list[str]:
    """The known section in words, for every view (report.md, ``show``, ``gate``, ``run``): a line
    per entry that matched cases (id, count, reason, upstream), per entry no longer reproducing
    (and whether that fails the run), and one for the entries not exercised or not applicable."""
    k = report.get("known")
    if not isinstance(k, dict):
        return []
    lines = [f"known defects ({k['file']}): {sum(e['matched'] for e in k['entries'])} failing case(s) known"]
    for e in k["entries"]:
        up = f" ({e['upstream']})" if e.get("upstream") else ""
        head = _headline(e["reason"])
        if e["status"] == "reproduced":
            lines.append(f"  KNOWN {e['id']}: {e['matched']} case(s): {head}{up}")
        elif e["status"] == "no longer reproducing":
            fails = "; fails the run (--strict-known)" if k.get("strict") else ""
            lines.append(
                f"  NO LONGER REPRODUCING {e['id']}: none of the {e['exercised']} case(s) of its configuration "
                f"failed its way in this run (fixed, or inputs that do not trigger it: docs/known.md){fails}: "
                f"{head}{up}"
            )
    quiet = [e["id"] for e in k["entries"] if e["status"] == "not exercised"]
    if quiet:
        lines.append(f"  not exercised by any case of this run: {', '.join(quiet)}")
    na = [f"{e['id']} ({e['not_applicable']})" for e in k["entries"] if e["status"] == "not applicable"]
    if na:
        lines.append(f"  not applicable: {'; '.join(na)}")
    return lines
