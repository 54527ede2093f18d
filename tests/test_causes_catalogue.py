"""The causes catalogue end to end (issue 35's measure): each seeded bug of distinct cause, run
through the engine as ``fa4-audit run`` runs a case (``audits.api.open_session``, poisoned re-runs
on), gets its cause FIRST in ``rec["diagnosis"]["causes"]``; the correct kernels get none."""

from __future__ import annotations

import pytest
import torch

from audits.api import RunOptions, open_session
from audits.suites.cases import Case, bias_suite, suite
from tests.test_causes_data import CATALOGUE as DATA_CATALOGUE

SMOKE = suite("smoke")
#: bug -> (case, its cause): the data-tested ones (tests/test_causes_data.py), the poisoned-run
#: ones (tests/test_poison.py) and the rounding bias (tests/test_bias.py)
CATALOGUE = {
    **{spec: (case, cause) for spec, (case, cause, _) in DATA_CATALOGUE.items()},
    "tests.cause_bugs:unwritten_rows": (SMOKE[0], "unwritten_output"),
    "tests.cause_bugs:uninitialized_accumulator": (SMOKE[0], "uninitialized_read"),
    "tests.cause_bugs:truncating_pv": (bias_suite()[0], "rounding_bias"),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread (as tests/test_causes_data.py: oversubscribed threads on a loaded
    2-core machine make the FP64 recomputations tens of times slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _first_cause(spec: str, case: Case) -> tuple[dict, list[dict]]:
    with open_session(spec, RunOptions(poison=True, isolate=False)) as s:
        rec = s.evaluate(case)
    return rec, (rec.get("diagnosis") or {}).get("causes") or []


def test_the_catalogue_has_ten_distinct_causes_or_more():
    assert len({cause for _, cause in CATALOGUE.values()}) >= 10


@pytest.mark.slow  # 15 bugs through the engine, poisoned re-runs of the failing ones: about 40 s
@pytest.mark.parametrize("spec", list(CATALOGUE))
def test_each_seeded_bug_is_named_first_through_the_engine(spec):
    case, cause = CATALOGUE[spec]
    rec, causes = _first_cause(spec, case)
    assert rec["verdict"] in ("fail", "warn"), rec["reasons"]
    assert causes and causes[0]["cause"] == cause, causes


@pytest.mark.parametrize("spec", ["fa4-model", "tests.bugged_kernels:exact"])
def test_correct_kernels_get_no_cause_through_the_engine(spec):
    for case in [SMOKE[0], SMOKE[1], bias_suite()[0]]:
        rec, causes = _first_cause(spec, case)
        assert causes == [], (case.name, rec["verdict"], causes)
