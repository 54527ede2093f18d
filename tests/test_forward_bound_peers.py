"""The peer bound's score-product term (numerics.forward_bound.score_product_error;
docs/peers.md "The bound").

flex_attention's Triton template (torch/_inductor/kernel/flex/templates/common.py.jinja,
``forward_block_mn``) forms its base-2 score as ``y = fl(fl(fl32(q.k) * SM_SCALE) * RCP_LN2)``: two
float32 products, each rounding ``|y|``, where FA4's FFMA rounds only ``t_j = y_j - m``.  Step 1's
error ``e_score`` plus the constant's ``|q.k| d_sl2`` must bound ``|y - q.k scale log2 e|`` for every
element; with ``score_products=2`` it does, without it it does not.
"""

from __future__ import annotations

import math

import pytest
import torch

from numerics.call import AttentionCall
from numerics.forward_bound import dot_products, forward_error_bound, score_product_error, step1_score

U = 2.0**-24


def _flex_score(dot32: torch.Tensor, d: int) -> torch.Tensor:
    """flex's base-2 score from the float32 dot: ``fl(fl(a * fl32(1/sqrt d)) * fl32(1.44269504))``."""
    scale32 = torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)
    rcp_ln2 = torch.tensor(1.44269504, dtype=torch.float32)
    return (dot32 * scale32) * rcp_ln2


def _inputs(d: int, seed: int, mag: float):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, 64, 1, d, generator=g) * mag).to(torch.float16)
    k = (torch.randn(1, 64, 1, d, generator=g) * mag).to(torch.float16)
    v = torch.randn(1, 64, 1, d, generator=g).to(torch.float16)
    return q, k, v


def test_score_product_error_values():
    assert score_product_error(0) == 0.0
    assert score_product_error(1) == pytest.approx(U, rel=1e-12)
    assert score_product_error(2) == pytest.approx(3 * U, rel=1e-6)
    with pytest.raises(ValueError, match="score_products must be >= 0, got -1"):
        score_product_error(-1)


def _dot_at_its_edge(dot: torch.Tensor, e_dot: torch.Tensor) -> torch.Tensor:
    """A float32 dot as far from the exact one as step 1 allows (``E_dot``, any summation order):
    ``dot + E_dot sign(dot)`` in float32, stepped one ULP back where rounding left the allowance."""
    a = (dot + e_dot * dot.sign()).float()
    back = torch.nextafter(a, torch.zeros_like(a))
    return torch.where((a.double() - dot).abs() > e_dot, back, a)


@pytest.mark.parametrize("d", [96, 128, 192])  # scales 1/sqrt(d) that are not powers of two
def test_flex_exponent_within_step1_only_with_the_term(d):
    """Every element of flex's float32 base-2 score, from a dot anywhere within step 1's ``E_dot``,
    lies within step 1's error with the term; some lie outside it without (the two products' roundings
    of |y| come on top of a dot error the bound already spends)."""
    q, k, v = _inputs(d, seed=3, mag=6.0)
    dot, e_dot, _ = dot_products(q, k, v)
    scale = 1.0 / math.sqrt(d)
    scale32 = float(torch.tensor(scale, dtype=torch.float32))
    l2e = math.log2(math.e)
    sl2, d_sl2, base, e_score = step1_score(dot, e_dot, scale, scale32, l2e, call=AttentionCall())
    y = _flex_score(_dot_at_its_edge(dot, e_dot), d).double()
    err = (y - dot * scale * l2e).abs()
    old = e_score + base.abs() * d_sl2
    new = old + score_product_error(2) * (e_score + base.abs() * sl2)
    assert bool((err <= new).all()), f"flex's score exceeds the term's bound by {float((err - new).max()):.3g}"
    assert int((err > old).sum()) > 0, "without the term every element fits: the test no longer shows the gap"


def test_peer_bound_grows_only_by_the_term():
    """score_products=2 never lowers a bound, and leaves FA4's (0) unchanged."""
    q, k, v = _inputs(128, seed=5, mag=4.0)
    call = AttentionCall()
    ob0, lb0 = forward_error_bound(q, k, v, _numerics(q), call=call)
    ob2, lb2 = forward_error_bound(q, k, v, _numerics(q), call=call, score_products=2)
    assert bool((ob2 >= ob0).all()) and bool((lb2 >= lb0).all())
    assert bool((lb2 > lb0).any()), "the term changed no LSE bound"
    ob0b, lb0b = forward_error_bound(q, k, v, _numerics(q), call=call, score_products=0)
    assert torch.equal(ob0, ob0b) and torch.equal(lb0, lb0b)


def _numerics(q):
    from fa4.model import FA4Numerics  # tests may import fa4; numerics may not

    return FA4Numerics(
        arch="sm90", tile_m=128, tile_n=128, exp2="hardware", rescale_threshold=0.0, max_offset=0, p_dtype=q.dtype
    )


def test_the_engine_gives_peers_the_term_and_fa4_none():
    """The runner's peer bound (``audits.engine.evaluate``) is formed with the two products; FA4's
    kernels keep the FFMA's (no term)."""
    from audits.engine.evaluate import PEER_SCORE_PRODUCTS, _score_products

    assert PEER_SCORE_PRODUCTS == 2 and _score_products("peer") == {"score_products": 2}
    assert _score_products("fa4") == {}
