"""A learnable sink placed against what the softmax sees with mods (``audits.suites.inputs.SINK_PLACES``):
the mask_mod's and block sparsity's visibility and the score mod's logits, not the flag-masked raw
logits.  Each case here is one where the two differ by more than a sink's band, so a placement that
ignored the mods would put the sink off its place."""

import math

import pytest
import torch

from audits.suites.cases import Case
from audits.suites.inputs import SINK_PLACES, make_inputs
from numerics.mods import bind_aux_scalars, index_grid, visibility
from numerics.reference import visible_mask

SHAPE = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=128, seqlen_k=256, sink=True)
CASES = {
    # the document mask hides every query's largest outlier key in heads 0, 2 and 3 (18-98 nats)
    "mask_mod": Case(**SHAPE, family="outliers", mask_mod="document"),
    "block_sparse": Case(**SHAPE, family="outliers", mask_mod="document", block_sparse=(128, 128)),
    # ALiBi without a causal mask raises the logits of keys right of the diagonal (0.6-62 nats)
    "score_mod": Case(**SHAPE, score_mod="alibi"),
    # a runtime scalar (aux_scalars): the logits of drift (0 to 40) times the temperature
    "aux_scalars": Case(**SHAPE, family="drift", score_mod="temperature", seed=1),
}


def _tops(c: Case, kw: dict, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head: (the largest logit the softmax sees with the mods, the flag-masked raw one), in
    float64, computed here apart from ``audits.suites.inputs``."""
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double().repeat_interleave(c.heads_q // c.heads_kv, 2))
    s = s / math.sqrt(c.d)
    flags = visible_mask(c.seqlen_q, c.seqlen_k, causal=c.causal, window_size=c.window)
    raw = s.masked_fill(~flags, -math.inf).amax(dim=(0, 2, 3))
    grid = index_grid(c.batch, c.heads_q, c.seqlen_q, c.seqlen_k)
    aux = kw.get("aux_tensors")
    score_mod, mask_mod, blocks = bind_aux_scalars(
        kw.get("aux_scalars"), score_mod=kw.get("score_mod"), mask_mod=kw.get("mask_mod"),
        block_sparse=kw.get("block_sparse_tensors"),
    )  # fmt: skip
    if score_mod is not None:
        s = score_mod.fn(s, *grid, aux).expand_as(s)
    mods = visibility(batch=c.batch, heads=c.heads_q, seqlen_q=c.seqlen_q, seqlen_k=c.seqlen_k, mask_mod=mask_mod,
                      block_sparse=blocks, aux=aux)  # fmt: skip
    vis = flags if mods is None else flags & mods
    return s.masked_fill(~vis, -math.inf).amax(dim=(0, 2, 3)), raw


@pytest.mark.parametrize("kind", sorted(CASES))
def test_the_sink_sits_against_the_logits_the_mods_leave(kind):
    c = CASES[kind]
    x = make_inputs(c)
    kw = x["kw"]
    top, raw = _tops(c, kw, x["q"], x["k"])
    sink = kw["learnable_sink"].double()
    off_place = 0
    for h in range(c.heads_q):
        lo, hi = SINK_PLACES[h % len(SINK_PLACES)]
        got = float(sink[h] - top[h])
        assert lo - 0.01 <= got <= hi + 0.01, (
            f"{c.name} head {h}: the sink is {got:+.3f} nats from the largest logit the mods leave; "
            f"its place is [{lo}, {hi}] (against the flag-masked raw logits it is {float(sink[h] - raw[h]):+.3f})"
        )
        off_place += not lo - 0.01 <= float(sink[h] - raw[h]) <= hi + 0.01
    # the case discriminates: placed against the raw logits, some head's sink would be off its place
    assert off_place >= 1, f"{c.name}: the mods do not move any head's largest logit past its sink's band"
