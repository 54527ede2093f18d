"""The kernel session under ``audits.api``: one case evaluated through ``open_session`` is the case
``audit`` records, and a run judges cases in the domain its selection resolved (looked up once)."""

from __future__ import annotations

import pytest

from audits.api import RunOptions, audit, open_session
from audits.engine import session as session_module
from audits.report.records import without_timing
from audits.suites.case import Case
from audits.suites.domain import Domain

CASE = Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=17, seqlen_k=40, d=32, dv=32, dtype="bfloat16", seed=3)
#: the record fields the run adds (the reproducer, whether it was resumed), beside its wall-clock ones
RUN_FIELDS = {"repro", "resumed"}


def test_a_session_evaluates_a_case_as_audit_records_it(tmp_path):
    options = RunOptions(out=tmp_path / "a", isolate=False)
    (recorded,) = audit("fa4-model", [CASE], options).records["fa4-model"]
    with open_session("fa4-model", options) as s:
        got = s.evaluate(CASE)
    assert got["verdict"] == recorded["verdict"] == "pass", got["reasons"]
    # the run adds its own fields (the reproducer, the case's identity); every measured one is the same
    recorded, got = without_timing(recorded), without_timing(got)
    assert {k: recorded.get(k) for k in got if k not in RUN_FIELDS} == {
        k: v for k, v in got.items() if k not in RUN_FIELDS
    }


def test_a_run_judges_cases_in_the_domain_given_without_looking_it_up(tmp_path, monkeypatch):
    """``run_audit`` hands the selection's domain (the coverage basis) to the loop; the kernel's
    declared domain is then not resolved again, and a case outside the given domain is skipped."""

    def lookup(kernel):
        raise AssertionError(f"kernel_domain({kernel!r}) resolved again")

    monkeypatch.setattr(session_module, "kernel_domain", lookup)
    narrow = Domain.from_dict({"head_dims": [[64, 64]]}, where="test")
    basis = {"fa4-model": {"domain": narrow, "arch": None}}
    report = audit("fa4-model", [CASE], RunOptions(out=tmp_path / "b", isolate=False), coverage=basis)
    (rec,) = report.records["fa4-model"]
    assert rec["verdict"] == "skipped" and "outside the kernel's declared domain" in rec["reasons"][0], rec
    with pytest.raises(AssertionError, match="resolved again"):  # without one the session looks it up
        open_session("fa4-model", RunOptions(isolate=False))
