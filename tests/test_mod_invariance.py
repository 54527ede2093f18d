"""The mod invariance properties (audits.checks.invariance.mods): block-sparse vs dense and mask_mod /
score_mod vs the flags, on the SM90 model (bitwise where production's SM90 forward computes the
same arithmetic, within the forward bound elsewhere), their claims read from production's tile
and visiting rules, and seeded breaks each caught."""

import dataclasses
import math

import pytest
import torch

from audits.checks.invariance import core
from audits.checks.invariance.mods import sm90_block_sparse_rows, sm90_tile_n
from audits.kernels import get_kernel
from audits.suites.cases import Case, varlen_case
from audits.suites.domain import domain_of
from numerics.mod_library import make_mask_mod
from numerics.mods import BlockSparse, block_sparse_from_mask, index_grid

CPU = torch.device("cpu")
MODS = ["block_sparse", "mask_flag"]
_MODEL = get_kernel("fa4-model-sm90")
_DOMAIN = {"dtypes": ["bfloat16", "float16"], "mods": ["score_mod", "mask_mod", "block_sparse"]}


def _target(fn, name: str) -> core.Target:
    fn.fa4_audit_domain = _DOMAIN
    return core.Target(name, fn, None, domain_of(fn), _nmf(), "sm90")


def _nmf():
    from fa4.model import FA4Numerics

    return lambda q, k, v, causal, window: FA4Numerics.for_inputs("sm90", q, k, v, causal, window)


def model(q, k, v, **kw):
    """The SM90 model, declaring the mods (its own domain may not yet)."""
    return _MODEL(q, k, v, **kw)


model.fa4_audit_domain = _DOMAIN  # the CLI test reads these, as for any user kernel
model.fa4_audit_numerics = "sm90"


def leaky(q, k, v, **kw):
    """Seeded break: block-sparse calls treat each head's first partial block as full (the
    mask_mod skipped there: masked keys leak in one block)."""
    bs = kw.get("block_sparse_tensors")
    if bs is not None:
        part = bs.partial.clone()
        first = part.flatten(2).float().argmax(-1)  # first partial block per (b, h)
        full = bs.full.clone().flatten(2)
        hit = part.flatten(2).gather(-1, first.unsqueeze(-1))
        full.scatter_(-1, first.unsqueeze(-1), hit)
        part = part.flatten(2)
        part.scatter_(-1, first.unsqueeze(-1), torch.zeros_like(hit))
        kw["block_sparse_tensors"] = dataclasses.replace(
            bs, full=full.view(bs.full.shape), partial=part.view(bs.partial.shape)
        )
    return _MODEL(q, k, v, **kw)


def reordered(q, k, v, **kw):
    """Seeded break: the block-sparse path rounds its output differently in one element (one
    step of the format), as a kernel visiting the blocks in another order would: inside the
    bound, but where production claims bitwise equality."""
    out = _MODEL(q, k, v, **kw)
    if kw.get("block_sparse_tensors") is not None:
        o, lse = out if isinstance(out, tuple) else (out, None)
        o = o.clone()
        at = (0, 0, 1, 0)  # batch 0, row 0, head 1: a row SMALL's random blocks claim bitwise
        o[at] = torch.nextafter(o[at].float(), torch.tensor(math.inf)).to(o.dtype)
        if o[at] == out[0][at]:  # bf16 absorbs a float32 step: one bf16 step instead
            o[at] = (o[at].float() * (1 + 2**-7)).to(o.dtype)
        return (o, lse) if isinstance(out, tuple) else o
    return out


def causal_off_by_one(q, k, v, **kw):
    """Seeded break: the causal mask_mod is applied one key too wide (kv <= q + offset + 1)."""
    mm = kw.get("mask_mod")
    if mm is not None and mm.name == "causal":
        off = mm.params["offset"]
        kw["mask_mod"] = dataclasses.replace(mm, fn=lambda b, h, q_, kv, aux: kv <= q_ + off + 1)
    return _MODEL(q, k, v, **kw)


#: d = 128: SM90's dense tile_n (128) is the 128-key block's, so claims exist; 3 key blocks.  Seed
#: 4's random blocks: head 0 partial, empty, full (the partial block visited first, below the
#: full one: not claimed), head 1 empty, empty, partial (claimed)
SMALL = Case("bfloat16", 128, 128, 1, 2, 2, 32, 384, family="normal", seed=4)


def _run(fn, case, props=MODS, name="m"):
    return core.run_case(case, _target(fn, name), device=CPU, properties=props)["properties"]


# ---- claims, from production's rules -------------------------------------------------------------


def test_tile_n_rules():
    """``_tile_size_fwd_sm90``: 128 keys at d <= 64 and d = 128; 144 plain vs 128 causal at d = 96;
    local 96 vs 128 at d = 192; block sparsity takes a smaller block_k (multiple of 16)."""
    assert sm90_tile_n(64, 64) == 128 and sm90_tile_n(128, 128) == 128
    assert sm90_tile_n(96, 96) == 144 and sm90_tile_n(96, 96, causal=True) == 128
    assert sm90_tile_n(192, 128, local=True) == 96 and sm90_tile_n(192, 128) == 128
    assert sm90_tile_n(128, 128, block_k=64) == 64 and sm90_tile_n(128, 128, block_k=200) == 128


def _claims(name: str, sq: int, sk: int, d: int = 128, blk=(128, 128)):
    mm, aux = make_mask_mod(name, batch=1, heads_q=1, seqlen_q=sq, seqlen_k=sk)
    bs = block_sparse_from_mask(mm, batch=1, heads=1, seqlen_q=sq, seqlen_k=sk, block_size=blk, aux=aux)
    b, h, q, kv = index_grid(1, 1, sq, sk)
    return sm90_block_sparse_rows(bs, mm.fn(b, h, q, kv, aux), d, d, sk)


def test_block_sparse_claims():
    """Causal: the diagonal (partial) block lies above the full ones, every row claimed.  A
    sliding window reaching back over a full block to a partial left edge: those rows are not
    (partial blocks first, each list descending).  d = 96: tile_n 144 dense vs 128 sparse,
    none claimed."""
    rows, _ = _claims("causal", 256, 512)
    assert bool(rows.all())
    # a 97-key window never fills a 128 x 128 block: no full block, every row claimed
    assert bool(_claims("sliding_window", 512, 512)[0].all())
    bs = BlockSparse(
        full=torch.tensor([[[[False, True, False]]]]), partial=torch.tensor([[[[True, False, True]]]]),
        block_size=(128, 128),
    )  # fmt: skip
    kept = torch.ones(1, 1, 128, 384, dtype=torch.bool)
    rows, why = sm90_block_sparse_rows(bs, kept, 128, 128, 384)
    assert not bool(rows.any()) and "another order" in why  # block 0 partial, below full block 1
    kept[..., :128] = False  # the low partial block sees nothing: visiting it is a no-op, claimed again
    assert bool(sm90_block_sparse_rows(bs, kept, 128, 128, 384)[0].all())
    rows, why = _claims("causal", 256, 512, d=96)
    assert not bool(rows.any()) and "tile_n 128 block-sparse vs 144 dense" in why


# ---- on the model ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_properties_hold_on_the_model():
    """The SM90 model: block-sparse == dense bitwise on every claimed row (causal: all; random
    blocks: the rows whose order agrees), the rest within the bound; the flags == the mods
    bitwise at d = 128 (same tile_n), within the bound at d = 96 (tile_n 144 vs 128)."""
    res = _run(model, dataclasses.replace(SMALL, seqlen_q=200, seqlen_k=300, mask_mod="causal"))
    bs = res["block_sparse"]
    assert bs["result"] == "holds", bs
    assert "mask_mod causal at 128x128: 200 of 200 rows claimed bitwise" in bs["note"]
    assert all("within the bound" in c for c in bs.get("differing", []))
    assert res["mask_flag"]["result"] == "holds" and res["mask_flag"]["bitwise"] is True
    res = _run(model, dataclasses.replace(SMALL, d=96, dv=96, seqlen_q=130, seqlen_k=260), props=["mask_flag"])
    mf = res["mask_flag"]
    assert mf["result"] == "holds" and mf["bitwise"] is False and mf["out"]["within_bound"]
    assert any("SM90 tile_n 128 with the flag vs 144 with the mod" in c for c in mf["differing"])


def test_block_sparse_holds_and_is_bitwise_where_claimed():
    """Head 1's rows are claimed and equal bit for bit; head 0's, visited in another order,
    differ within the bound (the model follows production's order)."""
    res = _run(model, SMALL, props=["block_sparse"])["block_sparse"]
    assert res["result"] == "holds" and res["bitwise"] is False, res
    assert res["note"] == "random blocks (seed 4) at 128x128: 32 of 64 rows claimed bitwise"
    assert res["differing"] == [
        "random blocks (seed 4) at 128x128: 32 row(s) within the bound (rows whose visible partial-block keys do not "
        "all lie above their full blocks: visited in another order)"
    ]
    assert res["out"]["within_bound"] is True


def test_a_leaked_block_is_caught():
    """Seeded: one partial block per head taken as full (its masked keys leak) differs beyond the bound."""
    res = _run(leaky, SMALL, props=["block_sparse"], name="leaky")["block_sparse"]
    assert res["result"] == "differs" and res["beyond_bound"], res
    assert res["out"]["within_bound"] is False


def test_a_claimed_bitwise_difference_fails_even_within_the_bound():
    """Seeded: one step of difference on a row production computes bitwise alike: differs,
    though the value is within the forward bound."""
    res = _run(reordered, SMALL, props=["block_sparse"], name="reordered")["block_sparse"]
    assert res["result"] == "differs", res
    assert all("claimed bitwise" in c for c in res["beyond_bound"])


def test_mask_flag_holds_bitwise_at_d128_and_catches_a_wrong_causal_mod():
    case = dataclasses.replace(SMALL, seqlen_q=64, seqlen_k=192)
    res = _run(model, case, props=["mask_flag"])["mask_flag"]
    assert res["result"] == "holds" and res["bitwise"] is True and res["comparisons"] == 3, res
    bad = _run(causal_off_by_one, case, props=["mask_flag"], name="off")["mask_flag"]
    assert bad["result"] == "differs"
    assert bad["beyond_bound"] == ["causal=True vs the causal mask_mod: 128 row(s) claimed bitwise"]


def test_not_applicable_and_skipped_say_why():
    """A kernel declaring no mods: block_sparse skipped (outside its domain), mask_flag not
    applicable (naming the missing kinds); a varlen case: not applicable."""

    def plain(q, k, v, **kw):
        return _MODEL(q, k, v, **kw)

    plain.fa4_audit_domain = {"dtypes": ["bfloat16", "float16"]}  # no "mods": none taken
    t = core.Target("plain", plain, None, domain_of(plain), _nmf(), "sm90")
    res = core.run_case(SMALL, t, device=CPU, properties=MODS)["properties"]
    assert res["block_sparse"]["result"] == "skipped" and "mask_mod unsupported" in res["block_sparse"]["reason"]
    assert res["mask_flag"]["result"] == "not applicable"
    assert "the kernel's domain declares no mask_mod" in res["mask_flag"]["reason"]
    vc = varlen_case(seqlens=((64, 128), (32, 96)), dtype="bfloat16", d=128, dv=128, heads_q=2, heads_kv=2)
    res = core.run_case(vc, _target(model, "m"), device=CPU, properties=MODS)["properties"]
    assert res["block_sparse"] == {
        "result": "not applicable",
        "reason": "a varlen case: the mods apply to fixed-length calls",
    }
    with pytest.raises(ValueError, match="unknown invariance property bogus; accepted: batch,"):
        core.run_case(SMALL, t, device=CPU, properties=["bogus"])


def test_the_five_properties_are_not_applicable_beside_mods():
    """batch / decode slice the call and reuse its mods: with prefix_lm (a per-batch aux tensor)
    a sequence alone would read batch 0's prefix; not applicable, saying why."""
    case = dataclasses.replace(SMALL, mask_mod="prefix_lm")
    res = core.run_case(case, _target(model, "m"), device=CPU)["properties"]
    for p in ("batch", "decode", "split", "paged", "pack_gqa"):
        assert res[p]["result"] == "not applicable", p
    assert res["batch"]["reason"].startswith("a case with mods (mask_mod): this property slices or repacks")


def test_default_properties_unchanged():
    """Without asking, the five properties of before run, and nothing else."""
    assert list(core.PROPERTIES) == ["batch", "decode", "split", "paged", "pack_gqa"]
    assert set(core.ALL_PROPERTIES) == set(core.PROPERTIES) | {"block_sparse", "mask_flag"}


# ---- GPU: production (the lead runs these) -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        Case("bfloat16", 128, 128, 2, 4, 2, 256, 512, family="normal", mask_mod="causal", seed=4),
        Case("bfloat16", 128, 128, 1, 2, 2, 200, 384, family="outliers", mask_mod="document", seed=5),
        Case("float16", 64, 64, 1, 2, 2, 256, 384, family="normal", score_mod="alibi", mask_mod="prefix_lm", seed=6),
        Case("bfloat16", 96, 96, 1, 2, 2, 256, 384, family="normal", seed=7),
    ],
    ids=lambda c: c.name,
)
def test_production_holds_the_mod_properties(case):
    """Production SM90 (kernel ``fa4``): block-sparse == dense bit for bit on the rows the
    source reading claims, within the bound elsewhere; the flags == the mods likewise (d = 96:
    tile_n 128 vs 144, within the bound).  A failure here is a finding about production or about
    the claims (docs/invariance.md, "Mod properties")."""
    from audits.kernels import production_arch

    if production_arch() != "sm90":
        pytest.skip("the bitwise claims are SM90's")
    res = core.run_case(case, core.target("fa4"), device=torch.device("cuda"), properties=MODS)["properties"]
    for p in MODS:
        assert res[p]["result"] == "holds", (p, res[p])
