"""Shape errors name the tensor and group by fault (issue 33, item 9): a kernel whose out, LSE or
gradient breaks the contract's shape gets a reason naming that tensor, the shape it returned and
the shape expected with its axes; the run's failing cases form one group per tensor and fault
(``audits.contract.ContractBreach``, ``audits.verdict.separators.fault_groups``), whatever the
cases' sizes.  The kernels below are this file's (module:attr specs), each breaking one tensor."""

import json
from pathlib import Path

import pytest
import torch

from audits import cli
from audits.contract import contract_breaches, varlen_contract_breaches
from audits.engine.backward import _autograd_breach
from audits.report.build import collapse_reasons
from audits.report.records import FAILING
from tests.bugged_backward import clean as clean_backward
from tests.bugged_kernels import exact

ROOT = Path(__file__).parents[1]
ME = "tests.test_shape_faults"

#: small cases of different sizes (seqlen_q != heads_q in each, so that a swap of those axes
#: shows in the shape); the second has q, k and v of one shape, where only the autograd
#: Function's input index tells dq from dk and dv
CONFIGS = [
    {"dtype": "bfloat16", "d": 32, "dv": 32, "batch": 1, "heads_q": 2, "heads_kv": 1, "seqlen_q": 17, "seqlen_k": 24},
    {"dtype": "float16", "d": 32, "dv": 32, "batch": 2, "heads_q": 2, "heads_kv": 2, "seqlen_q": 9, "seqlen_k": 9},
    {"dtype": "bfloat16", "d": 64, "dv": 64, "batch": 1, "heads_q": 4, "heads_kv": 2, "seqlen_q": 33, "seqlen_k": 40,
     "causal": True},
]  # fmt: skip


@pytest.fixture(autouse=True)
def _cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # tests.* resolve as module:attr


# ---- the kernels, each breaking one tensor of the contract -------------------------------------


def transposed_out(q, k, v, *, return_lse=False, **kw):
    """out returned (batch, heads_q, seqlen_q, dv), the LSE right."""
    out, lse = exact(q, k, v, return_lse=True, **kw)
    out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_lse else out


def transposed_lse(q, k, v, *, return_lse=False, **kw):
    """The LSE returned (batch, seqlen_q, heads_q), out right."""
    out, lse = exact(q, k, v, return_lse=True, **kw)
    return (out, lse.transpose(1, 2).contiguous()) if return_lse else out


def two_faults(q, k, v, *, return_lse=False, **kw):
    """Two faults by case: out transposed at head dim 64, the LSE transposed at the others."""
    return (transposed_out if q.shape[-1] == 64 else transposed_lse)(q, k, v, return_lse=return_lse, **kw)


class _TransposedGrad(torch.autograd.Function):
    """The identity forward; a backward returning its gradient with axes 1 and 2 swapped."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.transpose(1, 2).contiguous()


def transposed_dq(q, k, v, **kw):
    """tests.bugged_backward's correct kernel, its dq returned (batch, heads_q, seqlen_q, d)."""
    return clean_backward(_TransposedGrad.apply(q), k, v, **kw)


def _run(*argv) -> int:
    return cli.main(["run", "--quiet", "--device", "cpu", "--no-isolate", *argv])  # in-process: no worker to start


def _configs() -> list[str]:
    return [a for c in CONFIGS for a in ("--config", json.dumps(c))]


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


# ---- the reasons --------------------------------------------------------------------------------


def _t(*shape, dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    "out,lse,reasons,faults",
    [
        (_t(1, 2, 17, 32), None,
         ["out: shape (1, 2, 17, 32) returned, (1, 17, 2, 32) expected (batch, seqlen_q, heads_q, dv): "
          "seqlen_q and heads_q swapped"], ["seqlen_q and heads_q swapped"]),
        (_t(1, 17, 2, 32), _t(1, 17, 2, dtype=torch.float32),
         ["lse: shape (1, 17, 2) returned, (1, 2, 17) expected (batch, heads_q, seqlen_q): heads_q and seqlen_q "
          "swapped"], ["heads_q and seqlen_q swapped"]),
        (_t(1, 17, 2, 48), None,
         ["out: shape (1, 17, 2, 48) returned, (1, 17, 2, 32) expected (batch, seqlen_q, heads_q, dv): wrong dv"],
         ["wrong dv"]),
        (_t(34, 32), None,
         ["out: shape (34, 32) returned, (1, 17, 2, 32) expected (batch, seqlen_q, heads_q, dv): 2 axes returned, "
          "4 expected (batch, seqlen_q, heads_q, dv)"], ["2 axes returned, 4 expected (batch, seqlen_q, heads_q, dv)"]),
        (_t(1, 17, 2, 32, dtype=torch.float32), _t(1, 2, 17, dtype=torch.float64),
         ["out: dtype float32 returned, bfloat16 expected (the input dtype, bfloat16 for fp8 inputs)",
          "lse: dtype float64 returned, float32 expected (float32)"],
         ["dtype float32 returned (expected the input dtype, bfloat16 for fp8 inputs)",
          "dtype float64 returned (expected float32)"]),
        ((_t(1, 17, 2, 32),), None,
         ["out: a tuple returned, a tensor of shape (1, 17, 2, 32) (batch, seqlen_q, heads_q, dv) and dtype "
          "bfloat16 expected"], ["a tuple returned, not a tensor"]),
    ],
)  # fmt: skip
def test_a_breach_names_the_tensor_its_shapes_and_its_fault(out, lse, reasons, faults):
    q, v = _t(1, 17, 2, 32), _t(1, 24, 1, 32)
    got = contract_breaches(q=q, v=v, out=out, lse=lse)
    assert [b.reason for b in got] == reasons
    assert [b.fault for b in got] == faults
    assert contract_breaches(q=q, v=v, out=_t(1, 17, 2, 32), lse=_t(1, 2, 17, dtype=torch.float32)) == []


def test_a_varlen_breach_names_the_packed_axes():
    q, v = _t(30, 2, 32), _t(40, 1, 32)  # packed: (total_q, heads_q, d)
    got = varlen_contract_breaches(q=q, v=v, out=_t(2, 30, 32), lse=_t(30, 2, dtype=torch.float32), packed=True)
    assert [b.reason for b in got] == [
        "out: shape (2, 30, 32) returned, (30, 2, 32) expected (total_q, heads_q, dv): total_q and heads_q swapped",
        "lse: shape (30, 2) returned, (2, 30) expected (heads_q, total_q): heads_q and total_q swapped",
    ]


def test_autograd_refusing_a_gradient_names_it_by_its_input():
    """autograd refuses a wrongly shaped gradient before the audit sees it: its error is read back
    into the gradient's breach, named by the input of that shape, or by the Function's input index
    where q and k share a shape (the contract's order q, k, v)."""
    q, k = _t(1, 9, 2, 32), _t(1, 24, 1, 32)
    leaves = {"q": q, "k": k, "v": k}
    exc = RuntimeError(
        "Function XBackward returned an invalid gradient at index 0 - got [1, 2, 9, 32] but expected shape "
        "compatible with [1, 9, 2, 32]"
    )
    bad = _autograd_breach(exc, leaves)
    assert bad.reason == (
        "dq: shape (1, 2, 9, 32) returned, (1, 9, 2, 32) expected (batch, seqlen_q, heads_q, d): "
        "seqlen_q and heads_q swapped"
    )
    same = {"q": q, "k": q, "v": q}
    at1 = RuntimeError(str(exc).replace("index 0", "index 1"))
    assert _autograd_breach(at1, same).tensor == "dk"
    assert _autograd_breach(RuntimeError("another error"), leaves) is None
    # a shape no input has (the kernel reshaped before its Function): not the contract's tensor
    other = RuntimeError(str(exc).replace("[1, 9, 2, 32]", "[18, 32]"))
    assert _autograd_breach(other, leaves) is None


# ---- runs: one group per fault ------------------------------------------------------------------


def _groups(rep: dict) -> list[tuple[str, int]]:
    """The console's groups of failing cases (``collapse_reasons``): (first reason, cases)."""
    bad = [c for c in rep["cases"] if c["verdict"] in FAILING]
    return [(r["reasons"][0], n) for r, n in collapse_reasons(bad)]


def test_a_transposed_output_is_one_fault_over_cases_of_every_size(tmp_path, capsys):
    assert _run("--kernel", f"{ME}:transposed_out", *_configs(), "--out", str(tmp_path)) == 1
    rep = _report(tmp_path)
    cases = rep["cases"]
    assert [c["verdict"] for c in cases] == ["error"] * 3
    assert cases[0]["reason"] == (
        "out: shape (1, 2, 17, 32) returned, (1, 17, 2, 32) expected (batch, seqlen_q, heads_q, dv): "
        "seqlen_q and heads_q swapped"
    )
    assert [c["contract"][0]["got"] for c in cases] == [[1, 2, 17, 32], [2, 2, 9, 32], [1, 4, 33, 64]]
    assert {c["contract"][0]["fault"] for c in cases} == {"seqlen_q and heads_q swapped"}
    assert rep["diagnosis"]["faults"] == [
        {"tensor": "out", "fault": "seqlen_q and heads_q swapped", "cases": 3, "first": cases[0]["case"]}
    ]
    assert len(_groups(rep)) == 1
    stdout = capsys.readouterr().out
    assert stdout.count("  ERROR ") == 1 and "(x3 cases; the others in the report)" in stdout
    assert (
        "Contract breaches by fault: out: seqlen_q and heads_q swapped (3 cases)"
        in (tmp_path / "report.md").read_text()
    )


def test_a_transposed_lse_is_named_and_grouped(tmp_path):
    assert _run("--kernel", f"{ME}:transposed_lse", *_configs(), "--out", str(tmp_path)) == 1
    rep = _report(tmp_path)
    assert rep["cases"][1]["reasons"] == [
        "lse: shape (2, 9, 2) returned, (2, 2, 9) expected (batch, heads_q, seqlen_q): heads_q and seqlen_q swapped"
    ]
    assert [(g["tensor"], g["fault"], g["cases"]) for g in rep["diagnosis"]["faults"]] == [
        ("lse", "heads_q and seqlen_q swapped", 3)
    ]
    assert len(_groups(rep)) == 1


def test_two_faults_make_two_groups(tmp_path, capsys):
    assert _run("--kernel", f"{ME}:two_faults", *_configs(), "--out", str(tmp_path)) == 1
    rep = _report(tmp_path)
    assert [(g["tensor"], g["fault"], g["cases"]) for g in rep["diagnosis"]["faults"]] == [
        ("out", "seqlen_q and heads_q swapped", 1),
        ("lse", "heads_q and seqlen_q swapped", 2),
    ]
    groups = _groups(rep)
    assert [(r.split(":")[0], n) for r, n in groups] == [("lse", 2), ("out", 1)]
    assert capsys.readouterr().out.count("  ERROR ") == 2


def test_a_gradient_of_the_wrong_shape_is_named_and_grouped(tmp_path):
    """``run --backward``: the forward passes; autograd refuses dq's shape, which the backward's
    record names (its ``contract``) and the run groups as one fault over cases of every size."""
    assert _run("--backward", "--kernel", f"{ME}:transposed_dq", *_configs(), "--out", str(tmp_path)) == 1
    rep = _report(tmp_path)
    cases = rep["cases"]
    assert [c["verdict"] for c in cases] == ["error"] * 3
    assert cases[0]["reasons"] == [
        "backward: dq: shape (1, 2, 17, 32) returned, (1, 17, 2, 32) expected (batch, seqlen_q, heads_q, d): "
        "seqlen_q and heads_q swapped"
    ]
    assert [c["backward"]["contract"][0]["tensor"] for c in cases] == ["dq"] * 3
    assert [(g["tensor"], g["fault"], g["cases"]) for g in rep["diagnosis"]["faults"]] == [
        ("dq", "seqlen_q and heads_q swapped", 3)
    ]
    assert len(_groups(rep)) == 1


def test_a_gradient_breach_in_a_ran_backward_is_judged_by_its_tensor():
    """A gradient that reaches the audit in another shape (``analyse_backward``'s own check, for
    what autograd does not refuse) is a ``grad-contract`` finding about that gradient: its reason
    names it, ``--known`` files can name it (``grad-contract:dq``), and views group it by fault."""
    from audits.engine.backward import _contract
    from audits.verdict.gate import judge, load_thresholds
    from audits.verdict.known import failure_labels
    from audits.verdict.separators import reasons_by_fault
    from tests.test_reasons import _backward, _record

    th = load_thresholds()
    z = torch.zeros(4, dtype=torch.float64)
    rec = _record(z.float(), z, dtype="float32")
    rec["backward"] = _backward({"dk": (z.float(), z)})
    rec["backward"]["contract"] = [_contract("dq", _t(1, 2, 9, 32), _t(1, 9, 2, 32))]
    verdict, reasons = judge(rec, th)
    assert verdict == "error" and reasons == [
        "gradient contract: dq: shape (1, 2, 9, 32) returned, (1, 9, 2, 32) expected (batch, seqlen_q, heads_q, d): "
        "seqlen_q and heads_q swapped"
    ]
    assert ("grad-contract", "dq") in failure_labels(rec=rec, thresholds=th)
    assert reasons_by_fault({**rec, "reasons": reasons}) == ("gradient contract: dq: seqlen_q and heads_q swapped",)
    # a report written before breaches were typed kept the reason alone: still judged
    rec["backward"]["contract"] = ["dq has shape (1, 2, 9, 32)"]
    assert judge(rec, th) == ("error", ["gradient contract: dq has shape (1, 2, 9, 32)"])
