"""The suites built from code-path classes (audits/suites/cases.py): release covers every class of every
arch in both directions, head-dims is every SM90 head dim, smoke pairs each non-finite family
with every mask kind it applies to, and the sweep's cases are what its docstring says."""

import pytest

from audits.suites.cases import (
    NONFINITE_MASKS,
    SM90_HEAD_DIMS,
    SUITES,
    class_cases,
    head_dim_sweep,
    suite,
)
from audits.suites.inputs import FAMILIES, make_inputs
from fa4.code_paths import ARCHS, classes, classes_of
from numerics.call import AttentionCall

DIRS = ("forward", "backward")


def _covered(cases, arch: str, *, deterministic: bool) -> dict[str, set]:
    out = {d: set() for d in DIRS}
    for c in cases:
        for d in DIRS:
            out[d].update(classes_of(arch, c.call(deterministic=deterministic and d == "backward"), direction=d))
    return out


def _missed(cases, arch: str) -> list[str]:
    """The classes of ``arch`` no case falls in: the union over a plain run and a
    ``--deterministic`` one (the deterministic backward is a run option, not a case)."""
    plain, det = _covered(cases, arch, deterministic=False), _covered(cases, arch, deterministic=True)
    return sorted(c.name for c in classes(arch) if c.name not in plain[c.direction] | det[c.direction])


@pytest.mark.parametrize("arch", ARCHS)
def test_class_cases_cover_every_class(arch):
    assert _missed(class_cases(), arch) == []
    plain = _covered(class_cases(), arch, deterministic=False)
    # without --deterministic only the deterministic backward is missing
    assert sorted(c.name for c in classes(arch) if c.name not in plain[c.direction]) == [f"{arch}.bwd.deterministic"]


@pytest.mark.parametrize("arch", ARCHS)
def test_release_covers_every_class_forward_and_backward(arch):
    rel = suite("release")
    assert _missed(rel, arch) == []
    assert set(class_cases()) <= set(rel)


def test_class_cases_are_needed():
    """Without class_cases release misses classes (what they are there for): the 64x48
    head dims that production pads (release's 64..256 are multiples of 16 and 32), split-KV at
    d != dv among them."""
    rel = [c for c in suite("release") if c not in set(class_cases())]
    missed = set(_missed(rel, "sm90")) | set(_missed(rel, "sm100"))
    assert {"sm90.bwd.hdim_padded64", "sm90.fwd.hdim_padded16", "sm100.fwd.splitkv.tile_n64"} <= missed


def test_class_cases_build_inputs_and_have_unique_names():
    cases = class_cases()
    assert len({c.name for c in cases}) == len(cases)
    for c in cases:
        if c.seqlen_q * c.seqlen_k <= 1 << 17:
            make_inputs(c)


def test_head_dims_suite():
    cases = suite("head-dims")
    assert len(cases) == 128 and len({c.name for c in cases}) == 128
    assert sorted({c.d for c in cases}) == list(range(8, 257, 8)) == list(SM90_HEAD_DIMS)
    assert all(c.d == c.dv for c in cases)
    assert {(c.dtype, c.causal) for c in cases} == {(t, k) for t in ("bfloat16", "float16") for k in (False, True)}
    assert all(not c.local and c.family == "normal" for c in cases)
    assert {(c.batch, c.heads_q, c.heads_kv, c.seqlen_q, c.seqlen_k) for c in cases} == {(2, 4, 2, 200, 333)}
    tiles = (48, 64, 80, 96, 112, 128, 144, 192, 256)
    assert all(c.seqlen_q % t and c.seqlen_k % t for c in cases for t in tiles), "lengths must be off every tile"
    assert len({c.seed for c in cases}) > 100, "seeds derive from the case"
    assert set(cases) <= set(SUITES["nightly"]())


def test_head_dim_sweep_takes_pairs_dtypes_masks():
    cases = head_dim_sweep(pairs=[(64, 64), (192, 128)], dtypes=("float16",), masks=("none", "causal", "local"))
    assert [(c.d, c.dv, c.causal, c.local) for c in cases] == [
        (64, 64, False, False), (64, 64, True, False), (64, 64, False, True),
        (192, 128, False, False), (192, 128, True, False), (192, 128, False, True),
    ]  # fmt: skip
    again = head_dim_sweep(pairs=[(64, 64), (192, 128)], dtypes=("float16",), masks=("none", "causal", "local"))
    assert [c.seed for c in again] == [c.seed for c in cases]
    with pytest.raises(ValueError, match=r"mask\(s\) \['sliding'\] are not known; accepted: none, causal, local"):
        head_dim_sweep(pairs=[(64, 64)], dtypes=("float16",), masks=("sliding",))


def _mask(c) -> str:
    return "causal" if c.causal else "local" if c.local else "none"


def test_smoke_pairs_each_nonfinite_family_with_every_mask_it_applies_to():
    """A kernel that masks causally by adding -1e6 to the scores lets a NaN key past the
    diagonal make the earlier rows NaN: only a causal nan_inf_visible case shows it."""
    nonfinite = {f for f in FAMILIES if f.startswith("nan_inf")}
    assert nonfinite == set(NONFINITE_MASKS), "a non-finite family without its mask kinds"
    smoke = suite("smoke")
    for fam, masks in NONFINITE_MASKS.items():
        got = {_mask(c) for c in smoke if c.family == fam}
        assert got == set(masks), (fam, got)
    # the causal NaN key lies past the diagonal of earlier rows (keys n-1 > row + sk - sq for row < sq-1)
    causal = [c for c in smoke if c.family == "nan_inf_visible" and c.causal]
    assert any(c.seqlen_q > 1 for c in causal)
    # inside a restricted domain (fp16, equal lengths in multiples of 128): one per mask kind there
    restricted = {_mask(c) for c in smoke if c.family == "nan_inf_visible" and c.dtype == "float16"
                  and c.seqlen_q == c.seqlen_k and c.seqlen_q % 128 == 0}  # fmt: skip
    assert restricted == {"none", "causal"}
    for c in smoke:
        if c.family in NONFINITE_MASKS:
            make_inputs(c)  # applicable: the masked family finds keys no query sees


def test_suite_sizes():
    # 46 without mods, 5 mod cases (smoke_mods: each mod kind and library mod once, skipped before
    # the call on a kernel whose domain declares no mods), 1 varlen mod case (varlen_mods(smoke=True));
    # issue 33 added a d != dv case and the temperature mod where they matter (tests/test_feature_bugs.py)
    assert len(suite("smoke")) <= 52, "smoke stays small"
    rel = suite("release")
    assert len(rel) == len(set(rel))


def _dense(x, causal: bool, window: tuple, masked: float):
    """A dense kernel in float64 whose mask adds ``masked`` to the scores it hides (-inf: correct;
    -1e6: the Triton tutorial's way)."""
    import torch

    q, k, v = (x[n].double() for n in ("q", "k", "v"))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / q.shape[-1] ** 0.5
    sq, sk = s.shape[-2:]
    i = torch.arange(sq).view(-1, 1) + sk - sq
    j = torch.arange(sk).view(1, -1)
    left, right = window
    right = 0 if causal else right
    hide = torch.zeros(sq, sk, dtype=torch.bool)
    if right is not None:
        hide |= j > i + right
    if left is not None:
        hide |= j < i - left
    s = s.masked_fill(hide, masked) if masked == float("-inf") else torch.where(hide, s + masked, s)
    return torch.einsum("bhij,bjhc->bihc", torch.softmax(s, -1), v)


def test_smoke_nonfinite_cases_pass_a_correct_kernel_and_catch_additive_masking():
    """The smoke's nan_inf_visible cases: a correct dense kernel (hidden scores -inf; P V over
    every key, as a tiled kernel's processed block) is NaN/inf only where the reference is; one
    that adds -1e6 instead is NaN where the reference is finite in the causal and local cases."""
    import torch

    from numerics.reference import attention_reference

    for c in suite("smoke"):
        if c.family != "nan_inf_visible":
            continue
        x = make_inputs(c)
        ref = attention_reference(x["q"], x["k"], x["v"], call=AttentionCall.from_kwargs(**x["kw"]))
        finite = torch.isfinite(ref)
        ok = _dense(x, c.causal, c.window, float("-inf"))
        assert not (~torch.isfinite(ok) & finite).any(), f"{c.name}: a correct kernel is NaN where the reference is not"
        bad = _dense(x, c.causal, c.window, -1e6)
        caught = bool((~torch.isfinite(bad) & finite).any())
        assert caught == (_mask(c) != "none"), f"{c.name}: additive masking caught: {caught}"


def test_each_named_suite_is_one_builder_unrestricted_or_within_a_domain():
    """A named suite is defined once, as a function of the domain: the build in the unrestricted
    domain is the suite; a domain restricting only the mod kinds gives it without the mod cases
    it does not take; the per-suite builders agree with :func:`suite`."""
    from audits.suites.cases import (
        NIGHTLY_PAIRS,
        NIGHTLY_SEEDS,
        build_suite,
        head_dims_within,
        mods_within,
        nightly_within,
        release_suite,
        release_within,
        smoke_within,
    )
    from audits.suites.domain import Domain

    builders = {
        "smoke": smoke_within,
        "release": release_within,
        "nightly": nightly_within,
        "head-dims": head_dims_within,
        "mods": mods_within,
    }
    for name in SUITES:
        whole = suite(name)
        assert whole and suite(name, Domain()) == suite(name, None) == whole == SUITES[name](), name
        built = build_suite(name, Domain())
        assert built["axes"] is None and built["not_applicable"] == {}, name
        if name in builders:
            assert builders[name](Domain())["cases"] == whole, name
        no_mods = Domain(mods=())
        assert suite(name, no_mods) == [c for c in whole if not c.mods], name
    nightly = release_suite(seeds=NIGHTLY_SEEDS, extra_pairs=list(NIGHTLY_PAIRS))
    assert suite("nightly") == list(dict.fromkeys(nightly + suite("head-dims")))
    with pytest.raises(ValueError, match="unknown suite 'nope'; accepted: smoke, release"):
        build_suite("nope")
