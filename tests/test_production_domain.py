"""fa4.refusals.production_domain against production's own head-dim check.

The source test reads ``_validate_head_dims`` from production's ``flash_attn/cute/interface.py``
(flash-attn-4 4.0.0b36) without importing the package (it imports the CuTe DSL, which needs
CUDA): the installed ``flash_attn`` package when it has ``cute/interface.py`` (found by
``importlib.util.find_spec``, which imports nothing), else the directory the environment
variable ``FA4_SOURCE`` names (a ``flash_attn/cute`` directory, e.g. an unpacked sdist).  It
parses the file with ``ast``, compiles that one function alone and runs it in a namespace of its
own, and compares its verdict with the declared domain for every (d, dv) in 1..520 x 1..520.
The other tests check the declared sets themselves and need no source."""

import ast
import importlib.util
import itertools
import os
from pathlib import Path

import pytest

from audits.suites.domain import Domain
from fa4.refusals import production_domain

#: every (d, dv) the source test judges: past production's largest head dim (512) on both sides
GRID = range(1, 521)


def _interface_py() -> tuple[Path | None, str]:
    """Production's ``interface.py`` and where it was found, or None and why not."""
    spec = importlib.util.find_spec("flash_attn")  # the top-level package: found, not imported
    looked = []
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            p = Path(root) / "cute" / "interface.py"
            if p.is_file():
                return p, f"the installed flash_attn package ({p})"
            looked.append(str(p))
    else:
        looked.append("no installed flash_attn package")
    env = os.environ.get("FA4_SOURCE")
    if env:
        p = Path(env) / "interface.py"
        if p.is_file():
            return p, f"FA4_SOURCE ({p})"
        looked.append(f"FA4_SOURCE={env} has no interface.py")
    else:
        looked.append("FA4_SOURCE is not set (point it at a flash_attn/cute directory)")
    return None, "; ".join(looked)


def _validate_head_dims_from(path: Path):
    """``_validate_head_dims`` compiled from ``path`` alone, in an isolated namespace."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_validate_head_dims"]
    assert len(found) == 1, f"{path}: expected one top-level _validate_head_dims, found {len(found)}"
    found[0].decorator_list = []  # production's @lru_cache: a cache, no part of the verdict
    namespace: dict = {}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["_validate_head_dims"]


def _production_accepts(check, d: int, dv: int, cc: int, alignment: int) -> bool:
    try:
        check(d, dv, cc, alignment)
    except AssertionError:
        return False
    return True


def _declared(major: int) -> Domain:
    return Domain.from_dict(production_domain(major), where=f"production_domain({major})")


def _mismatches(check, major: int, alignment: int, domain_says) -> list:
    return [
        (d, dv)
        for d, dv in itertools.product(GRID, GRID)
        if _production_accepts(check, d, dv, major, alignment) != domain_says(d, dv)
    ]


@pytest.mark.slow  # 4 x 270,400 calls of production's check: ~10 s
def test_production_domain_agrees_with_validate_head_dims_read_from_production_source():
    """For SM90, SM100 and SM110 at the 16-bit dtypes' alignment of 8 (``_flash_attn_fwd``:
    16 // element size), production's verdict on (d, dv) is the declared domain's, pair by pair;
    at fp8's alignment of 16 on SM100 it is the declared domain's restricted to multiples of 16
    (what ``production_domain``'s docstring leaves to the run-time refusal)."""
    path, where = _interface_py()
    if path is None:
        pytest.skip(f"production's source is not available: {where}")
    check = _validate_head_dims_from(path)
    assert not _production_accepts(check, 8, 8, 9, 16) and _production_accepts(check, 16, 16, 9, 16), (
        "python -O strips production's assertions; run without it"
    )
    for major in (9, 10, 11):
        dom = _declared(major)
        accepted = set(dom.head_dim_pairs())
        bad = _mismatches(check, major, 8, lambda d, dv, accepted=accepted: (d, dv) in accepted)
        assert not bad, f"SM{major}0, alignment 8 ({where}): production and the domain differ at {bad[:10]}"
    sm100 = _declared(10)
    bad = _mismatches(check, 10, 16, lambda d, dv: sm100.accepts_head_dims(d, dv) and d % 16 == 0 == dv % 16)
    assert not bad, f"SM100 fp8, alignment 16 ({where}): production and the domain differ at {bad[:10]}"


def test_the_source_reader_extracts_only_that_function(tmp_path):
    """The reader compiles ``_validate_head_dims`` alone: the module's imports (here one that
    cannot be imported) never run; a file without it is a clear failure."""
    src = tmp_path / "interface.py"
    src.write_text(
        "import module_that_does_not_exist\n\n"
        "@module_that_does_not_exist.cache\n"
        "def _validate_head_dims(head_dim, head_dim_v, compute_capability, alignment):\n"
        "    assert head_dim == 64, 'only 64'\n"
    )
    check = _validate_head_dims_from(src)
    assert _production_accepts(check, 64, 1, 9, 8) and not _production_accepts(check, 65, 1, 9, 8)
    src.write_text("def other():\n    pass\n")
    with pytest.raises(AssertionError, match="expected one top-level _validate_head_dims, found 0"):
        _validate_head_dims_from(src)


def test_sm90_declares_every_multiple_of_8_up_to_256_for_d_and_dv_and_no_fp8():
    sm90 = _declared(9)
    assert sm90.head_dim_pairs() == tuple(itertools.product(range(8, 257, 8), repeat=2))
    assert sm90.dtypes == ("bfloat16", "float16")
    assert not sm90.accepts_head_dims(264, 264) and not sm90.accepts_head_dims(12, 12)


def test_sm100_declares_the_standard_range_and_the_special_shapes():
    sm100, sm110 = _declared(10), _declared(11)
    pairs = set(sm100.head_dim_pairs())
    standard = set(itertools.product(range(8, 129, 8), repeat=2))
    assert pairs == standard | {(192, 128), (256, 256), (64, 512), (512, 512)} and len(pairs) == 260
    for refused in ((192, 192), (128, 512), (512, 64), (256, 128), (136, 136), (4, 4)):
        assert not sm100.accepts_head_dims(*refused), refused
    assert sm100.dtypes is None  # fp8 too (its alignment of 16 is a run-time refusal)
    assert sm110.dtypes == ("bfloat16", "float16") and sm110.head_dims == sm100.head_dims  # fp8 on 10.x only


def test_the_declarations_are_compact_and_fresh():
    """production_domain writes its head dims in the range forms (a handful of items, not the
    1,024 or 260 pairs), and each call returns a new dict (a caller may change it)."""
    assert len(production_domain(9)["head_dims"]) == 1 and len(production_domain(10)["head_dims"]) == 5
    first = production_domain(10)
    first["head_dims"].clear()
    assert len(production_domain(10)["head_dims"]) == 5
    assert production_domain(8) == {} and production_domain(12) == {}


def test_production_compile_cache_is_on_unless_the_user_said_otherwise(monkeypatch):
    """The audit turns production's persistent compile cache on (cache_utils reads the variable
    when flash_attn.cute is first imported) and leaves a user's own setting alone."""
    from fa4.production import COMPILE_CACHE_ENV, enable_compile_cache

    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    assert enable_compile_cache() == "1"
    assert os.environ[COMPILE_CACHE_ENV] == "1"
    monkeypatch.setenv(COMPILE_CACHE_ENV, "0")
    assert enable_compile_cache() == "0"
    assert os.environ[COMPILE_CACHE_ENV] == "0"
