"""audits.checks.ex2.ptx: the instruction facts of production's compiled exp2 against the model.

The PTX under tests/data/ptx was compiled from flash-attn-4 4.0.0b36 for sm_100a on a CPU-only
machine (``fa4-audit ex2 --ptx``; see docs/ex2.md).  Variants with one fact changed must be caught.
"""

import pytest

from audits.checks.ex2.ptx import PtxFormatError, check_ptx, float_instructions
from fa4.ex2 import DEGREES
from tests.conftest import DATA

PTX = DATA / "ptx"


def ptx(variant: str, degree: int) -> str:
    return (PTX / f"ex2_{variant}_deg{degree}.sm_100a.ptx").read_text()


@pytest.mark.parametrize("degree", DEGREES)
@pytest.mark.parametrize("variant", ["scalar", "packed"])
def test_production_ptx_matches_model(variant, degree):
    assert check_ptx(ptx(variant, degree), variant=variant, degree=degree) == []


def test_packed_round_down_has_no_ftz_but_scalar_has():
    assert float_instructions(ptx("packed", 3))[("add", "rm", False, 2)] == 1
    assert float_instructions(ptx("scalar", 3))[("add", "rm", True, 1)] == 2  # two elements per thread


@pytest.mark.parametrize(
    "variant,old,new,needle",
    [
        ("packed", "add.rm.f32x2", "add.rm.ftz.f32x2", "add.rm.ftz.f32x2"),  # a flush flag appears
        ("scalar", "add.rm.ftz.f32", "add.rm.f32", "add.rm.f32"),  # the flush flag disappears
        ("packed", "fma.rn.f32x2", "fma.rz.f32x2", "fma.rz.f32x2"),  # another rounding mode
        ("scalar", "max.f32", "max.ftz.f32", "max.ftz.f32"),
        ("scalar", "0f3D9DF09D", "0f3D9DF09E", "constants"),  # a coefficient changes
        ("packed", "0fC2FE0000", "0fC3000000", "constants"),  # the clamp changes (-128)
    ],
)
def test_changed_fact_is_reported(variant, old, new, needle):
    text = ptx(variant, 3)
    assert old in text
    diffs = check_ptx(text.replace(old, new), variant=variant, degree=3)
    assert diffs and any(needle in d for d in diffs), diffs


def test_wrong_degree_is_reported():
    diffs = check_ptx(ptx("packed", 4), variant="packed", degree=3)
    assert any("fma.rn.f32x2: PTX has 4, model expects 3" in d for d in diffs)


def test_unrecognised_ptx_is_an_error():
    with pytest.raises(PtxFormatError, match="no .entry"):
        float_instructions("this is not ptx")
    with pytest.raises(PtxFormatError, match="no f32 arithmetic"):
        float_instructions(".entry k() { ret; }")
    with pytest.raises(ValueError, match="variant must be one of"):
        check_ptx(ptx("packed", 3), variant="vector", degree=3)
