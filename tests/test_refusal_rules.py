"""Production's refusals decided by rule (fa4.refusals.REFUSALS), not by wording.

The rules are unit-tested on call features for each supported release (4.0.0b36, 4.0.0b40);
where the releases' wheels are present (``pip download --no-deps flash-attn-4==VERSION -d DIR``;
looked for in ``$FA4_WHEELS`` and in /tmp/fa4whl_b36, /tmp/fa4whl_b40; CI downloads nothing and
skips), every cited source line is checked to exist in that release, and the head-dim rule is
compared with the release's own ``_validate_head_dims``, compiled from the wheel alone."""

import ast
import os
import zipfile
from pathlib import Path

import pytest
import torch

from audits.engine.backward import _refused
from fa4.refusals import (
    REFUSALS,
    SUPPORTED_VERSIONS,
    CallFeatures,
    ProductionRefusal,
    RefusalMatch,
    call_features,
    head_dims_supported,
    predicted_refusals,
    production_refusal,
)

B36, B40 = SUPPORTED_VERSIONS
#: b40's words for SM90 split-KV (seen on the H200 with 4.0.0b40, issue 33); b36's below
B40_SPLIT = "SM9 forward does not support SM100-only options: num_splits=3 (needs 1)"
B36_SPLIT = "SplitKV not supported on SM 9.0"


def _wheel(version: str) -> Path | None:
    dirs = [os.environ.get("FA4_WHEELS"), f"/tmp/fa4whl_{version[-3:]}"]
    for d in filter(None, dirs):
        p = Path(d) / f"flash_attn_4-{version}-py3-none-any.whl"
        if p.is_file():
            return p
    return None


def _source(version: str, name: str) -> str:
    whl = _wheel(version)
    if whl is None:
        pytest.skip(f"flash-attn-4 {version}'s wheel is not present (pip download --no-deps flash-attn-4=={version})")
    with zipfile.ZipFile(whl) as z:
        return z.read(f"flash_attn/cute/{name}").decode()


def sm90(version: str, **kw) -> CallFeatures:
    return CallFeatures(**{"version": version, "arch": 9, "itemsize": 2, "d": 128, "dv": 128, **kw})


def names(f: CallFeatures) -> set[str]:
    return {r.name for r in predicted_refusals(f)}


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_every_cited_line_is_in_the_release(version):
    """Each rule that claims a release cites lines that exist verbatim in that release's file."""
    missing = [
        f"{r.name}: {f}: {frag!r}"
        for r in REFUSALS
        for v, f, frag in r.cited
        if v == version and frag not in _source(version, f)
    ]
    assert not missing, f"flash-attn-4 {version} lacks the cited lines: {missing}"


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_head_dim_rule_is_the_release_validation(version):
    """``head_dims_supported`` against the release's own ``_validate_head_dims`` on a grid of
    (d, dv) in 1..520 x 1..520 (every 3rd value plus production's special ones), SM90 and
    SM100/110, at the 16-bit alignment 8 and fp8's 16."""
    tree = ast.parse(_source(version, "interface.py"))
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_validate_head_dims"]
    assert len(fn) == 1
    fn[0].decorator_list = []
    ns: dict = {}
    exec(compile(ast.Module(body=fn, type_ignores=[]), "interface.py", "exec"), ns)
    values = sorted(set(range(1, 521, 3)) | {8, 16, 64, 128, 136, 192, 256, 264, 512})
    wrong = []
    for arch in (9, 10, 11):
        for align in (8, 16):
            for d in values:
                for dv in values:
                    try:
                        ns["_validate_head_dims"](d, dv, arch, align)
                        ok = True
                    except AssertionError:
                        ok = False
                    if ok != head_dims_supported(d=d, dv=dv, arch=arch, alignment=align):
                        wrong.append((arch, align, d, dv, ok))
    assert not wrong, f"head_dims_supported disagrees with {version}'s _validate_head_dims on {wrong[:5]}"


def test_sm90_split_kv_is_refused_in_each_release_own_words():
    """The case of issue 33: b40 words SM90 split-KV differently and raises ValueError; both are
    a refusal of a split call, in each release's own type."""
    b36 = production_refusal(AssertionError(B36_SPLIT), sm90(B36, num_splits=3))
    b40 = production_refusal(ValueError(B40_SPLIT), sm90(B40, num_splits=3))
    assert b36 is not None and b36.rule.name == "sm90-split-kv" and b36.confirmed
    assert b40 is not None and b40.rule.name == "sm90-split-kv" and b40.confirmed
    assert "config.py, validate_fwd_config" in b40.reason(ValueError(B40_SPLIT))
    # each release's type only: b36 never raised ValueError for it, b40 never AssertionError
    assert production_refusal(ValueError(B40_SPLIT), sm90(B36, num_splits=3)) is None
    assert production_refusal(AssertionError(B36_SPLIT), sm90(B40, num_splits=3)) is None


def test_an_unpredicted_exception_is_an_error_whatever_its_wording():
    """The refusal's exact words on a call no rule predicts refused (no split) are an error."""
    assert production_refusal(ValueError(B40_SPLIT), sm90(B40, num_splits=1)) is None
    assert production_refusal(AssertionError(B36_SPLIT), sm90(B36)) is None
    assert production_refusal(RuntimeError("illegal memory access"), sm90(B40, num_splits=3)) is None


def test_the_prediction_decides_and_the_message_only_confirms():
    """A supported release's predicted refusal in new words is still the refusal, said unconfirmed;
    an unsupported release's needs the known wording."""
    m = production_refusal(ValueError("split-KV is SM100-only"), sm90(B40, num_splits=2))
    assert m == RefusalMatch(next(r for r in REFUSALS if r.exc_type is ValueError), False)
    assert "not in the rule's known wording" in m.reason(ValueError("x"))
    assert production_refusal(ValueError("split-KV is SM100-only"), sm90("4.0.0b99", num_splits=2)) is None
    unknown = production_refusal(ValueError(B40_SPLIT), sm90("4.0.0b99", num_splits=2))
    assert unknown is not None and unknown.confirmed


@pytest.mark.parametrize(
    ("features", "expected"),
    [
        (sm90(B36), set()),
        (sm90(B40, causal=True, sink=True, softcap=True, backward=True), set()),
        (sm90(B36, itemsize=1), {"fp8-needs-sm100"}),
        (CallFeatures(version=B40, arch=10, itemsize=1, d=128, dv=128), set()),
        (CallFeatures(version=B40, arch=10, itemsize=1, d=128, dv=128, backward=True), {"fp8-backward"}),
        (CallFeatures(version=B36, arch=10, itemsize=1, d=72, dv=72), {"head-dims"}),  # fp8 aligns to 16
        (CallFeatures(version=B40, arch=10, itemsize=2, d=192, dv=192), {"head-dims"}),
        (CallFeatures(version=B36, arch=9, itemsize=2, d=192, dv=192), set()),
        (CallFeatures(version=B36, arch=7, itemsize=2, d=64, dv=64), {"compute-capability"}),
        (CallFeatures(version=B36, arch=8, itemsize=2, d=64, dv=64, backward=True), {"compute-capability"}),
        (sm90(B40, softcap=True, score_mod=True), {"softcap-with-score-mod"}),
        (sm90(B36, block_sparse=True), {"block-size-kv", "block-size-q", "block-size-kv-tensors"}),
        (sm90(B36, backward=True, deterministic=True, block_sparse=True, varlen=True), None),
        (CallFeatures(version=B36, arch=12, itemsize=2, d=64, dv=64, backward=True, mask_mod=True), None),
    ],
)
def test_rule_table_on_features(features, expected):
    """What each release's rules predict for a call's features (None: see the assertions below)."""
    got = names(features)
    if expected is not None:
        assert got == expected
    elif features.arch == 12:
        assert got == {"sm120-backward-mods"}
    else:
        assert {"sm90-deterministic-block-sparse-backward", "varlen-block-sparse-backward", "varlen-block-size"} <= got


def test_sm100_hd256_backward_refusals_are_b36_only():
    """b36's dedicated hdim-256 backward refused sink, softcap and windows; b40 removed that kernel
    (its generic backward runs them), so the same exception there is an error."""
    f36 = CallFeatures(version=B36, arch=10, itemsize=2, d=256, dv=256, backward=True, sink=True, local=True)
    f40 = CallFeatures(**{**f36.__dict__, "version": B40})
    assert names(f36) == {"sm100-hd256-backward-sink-softcap", "sm100-hd256-backward-local"}
    assert names(f40) == set()
    msg = AssertionError("SM100 backward with head_dim=256 does not support learnable_sink")
    assert production_refusal(msg, f36).rule.name == "sm100-hd256-backward-sink-softcap"
    assert production_refusal(msg, f40) is None
    generic = CallFeatures(**{**f36.__dict__, "hd256_generic_bwd": True})
    assert names(generic) == set()


def test_call_features_read_the_call():
    """The adapters' arguments as production's validation reads them (CPU tensors: no arch)."""
    q, k, v = torch.zeros(1, 4, 2, 64), torch.zeros(1, 4, 2, 64), torch.zeros(1, 4, 2, 32)
    f = call_features(q, k, v, backward=True, window_size=(None, 0), softcap=5.0, num_splits=4)
    assert (f.arch, f.d, f.dv, f.itemsize, f.causal, f.local, f.softcap, f.num_splits) == (
        None,
        64,
        32,
        4,
        True,
        False,
        True,
        4,
    )
    assert call_features(q, k, v, backward=False, window_size=(3, 0)).local
    assert call_features(q, k, v, backward=False, causal=True, window_size=(-1, -1)).causal
    assert call_features(q, k, v, backward=False, cu_seqlens_q=torch.zeros(2)).varlen
    assert predicted_refusals(f) == ()  # no GPU: production cannot run, no rule predicts anything


def test_backward_runner_decides_by_the_kernel_rule():
    """audits.engine.backward: the adapter's forward refusal passes through; what the backward
    raises is decided by the kernel's ``fa4_audit_refusal`` on the call (backward=True)."""
    seen = {}

    def decide(exc, q, k, v, *, backward, **kw):
        seen.update(backward=backward, **kw)
        return RefusalMatch(REFUSALS[0], True) if isinstance(exc, AssertionError) else None

    def kernel(q, k, v, **kw):
        raise AssertionError("unreachable")

    kernel.fa4_audit_refusal = decide
    t = torch.zeros(1)
    assert _refused(ProductionRefusal("production refuses X"), kernel, (t, t, t, {})) == "production refuses X"
    why = _refused(AssertionError("boom"), kernel, (t, t, t, {"softcap": 1.0}))
    assert why.startswith("production refuses this configuration (rule fp8-needs-sm100") and seen["backward"]
    assert seen["softcap"] == 1.0
    assert _refused(ValueError("boom"), kernel, (t, t, t, {})) is None
