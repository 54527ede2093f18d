"""Every figure true (issue 33, item 2): a kernel returning NaN or inf where the FP64 reference is
finite is shown so, with the count, in every view (report.md, report.html, report.json's summary,
``show``, ``summary``, ``diff``, ``gate --baseline``), never as the 0 of its finite elements
(``numerics.metrics.nan_aware_max``, ``audits.report.html.max_text``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from audits import cli
from audits.report.html import max_text
from audits.verdict.gate import against_baseline, load_thresholds
from numerics.metrics import lse_errors, nan_aware_max, output_errors

#: a tiny case (milliseconds on fa4-model): 2 x 8 x 16 = 256 output elements, 16 LSE rows
TINY = {"dtype": "bfloat16", "d": 8, "dv": 8, "batch": 1, "heads_q": 2, "heads_kv": 2, "seqlen_q": 8, "seqlen_k": 16}
N_OUT, N_LSE = 2 * 8 * 8, 2 * 8

NAN_KERNEL = """
import torch

def all_nan(q, k, v, *, return_lse=False, **kw):
    out = torch.full((*q.shape[:3], v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    if return_lse:
        return out, torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    return out
"""


def test_nan_aware_max_of_the_records():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 5, generator=g, dtype=torch.float64)
    nan = output_errors(torch.full((4, 5), math.nan, dtype=torch.bfloat16), ref)
    assert nan["max_abs"] == 0.0 and (nan["nonfinite_where_ref_finite"], nan["checked"]) == (20, 20)
    assert math.isnan(nan_aware_max(nan))
    some_inf = ref.clone().bfloat16()
    some_inf[0, 0] = math.inf
    inf = output_errors(some_inf, ref)
    assert nan_aware_max(inf) == math.inf and inf["max_abs"] > 0
    clean = output_errors(ref.bfloat16(), ref)
    assert nan_aware_max(clean) == clean["max_abs"] > 0
    # a reference -inf row (no visible key) is not checked; the other rows are
    lse_ref = torch.tensor([1.0, -math.inf, 2.0], dtype=torch.float64)
    lse = lse_errors(torch.tensor([math.nan, -math.inf, 2.0]), lse_ref)
    assert (lse["checked"], lse["nonfinite_where_ref_finite"]) == (2, 1) and math.isnan(nan_aware_max(lse))
    # a record written before the breakdown and `checked`: NaN (which non-finite value is unknown)
    old = {"max_abs": 0.002, "nonfinite_where_ref_finite": 3}
    assert math.isnan(nan_aware_max(old))
    assert max_text(old) == "nan (3 non-finite; 0.002 over the rest)"
    assert max_text(inf) == f"inf (1 of 20 non-finite; {inf['max_abs']:.3g} over the rest)"
    assert max_text(nan) == "nan (20 of 20 non-finite)" and max_text(None) == "—"


def test_the_baseline_comparison_is_nan_aware():
    th = load_thresholds()
    ok = {"max_abs": 0.002, "nonfinite_where_ref_finite": 0, "nan_swallowed": 0}
    nan = {
        "max_abs": 0.0,
        "nonfinite_where_ref_finite": 640,
        "checked": 640,
        "nonfinite_mismatches": {"NaN|finite": 640},
    }
    rec = lambda out: {"status": "ran", "out": out}
    (f,) = against_baseline(rec(nan), rec(ok), th)
    assert f.quantity == "max |out - ref|" and math.isnan(f.worst)
    assert f.message == (
        "max |out - ref| nan (640 non-finite where the reference is finite) against the baseline's 0.002 (0 non-finite)"
    )
    assert against_baseline(rec(ok), rec(nan), th) == []  # finite now, NaN before: better
    fewer = {**nan, "nonfinite_where_ref_finite": 2, "nonfinite_mismatches": {"NaN|finite": 2}}
    assert against_baseline(rec(fewer), rec(nan), th) == []
    assert [x.detail["baseline_nonfinite"] for x in against_baseline(rec(nan), rec(fewer), th)] == [2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The all-NaN kernel and fa4-model on the one tiny case: (nan dir, good dir)."""
    tmp = tmp_path_factory.mktemp("figures")
    (tmp / "nan_kernel.py").write_text(NAN_KERNEL)
    config = json.dumps(TINY)
    nan_run = ["run", "--quiet", "--kernel", f"{tmp / 'nan_kernel.py'}:all_nan", "--config", config]
    assert cli.main([*nan_run, "--out", str(tmp / "nan")]) == 1
    assert cli.main(["run", "--quiet", "--kernel", "fa4-model", "--config", config, "--out", str(tmp / "good")]) == 0
    return tmp / "nan", tmp / "good"


OUT_NAN = f"nan ({N_OUT:,} of {N_OUT:,} non-finite)"
LSE_NAN = f"nan ({N_LSE:,} of {N_LSE:,} non-finite)"


def test_every_report_file_shows_the_nan(runs):
    nan, _ = runs
    rep = json.loads((nan / "report.json").read_text())
    w = rep["summary"]["worst"]
    assert math.isnan(w["out_max_abs"]["value"]) and (w["out_max_abs"]["nonfinite"], w["out_max_abs"]["of"]) == (
        N_OUT,
        N_OUT,
    )
    assert math.isnan(w["lse_max_abs"]["value"]) and math.isnan(w["bound_tightness"]["value"])
    md = (nan / "report.md").read_text()
    assert f"- worst out_max_abs: {OUT_NAN}" in md and f"- worst lse_max_abs: {LSE_NAN}" in md
    row = next(x for x in md.splitlines() if x.startswith("| bf16-d8"))
    cells = [c.strip() for c in row.split("|")[1:7]]
    assert cells[1:6] == ["fail", OUT_NAN, "nan", LSE_NAN, f"nan ({N_OUT:,} non-finite)"]
    page = (nan / "report.html").read_text()
    assert f"<td>{OUT_NAN}</td>" in page and f"<td>{LSE_NAN}</td>" in page  # the worst cases list it
    assert "1 case(s) with NaN or inf outputs where the reference is finite: not plotted" in page


def test_show_summary_diff_and_gate_show_the_nan(runs, capsys):
    nan, good = runs
    capsys.readouterr()
    assert cli.main(["show", str(nan / "report.json")]) == 0
    said = capsys.readouterr().out
    assert f"max abs err {OUT_NAN}, LSE err {LSE_NAN}, err/bound nan ({N_OUT:,} non-finite)" in said
    assert cli.main(["summary", str(good / "report.json"), str(nan / "report.json")]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if "all_nan" in x)
    assert f"| nan ({N_OUT:,} non-finite) | nan | nan ({N_LSE:,} non-finite) | nan |" in row
    assert cli.main(["diff", str(good / "report.json"), str(nan / "report.json")]) == 1
    said = capsys.readouterr().out
    assert "pass -> fail (worse) max |err| " in said and f" -> {OUT_NAN}, LSE max |err| " in said
    assert f" -> {LSE_NAN}" in said and "-> 0" not in said
    assert cli.main(["gate", str(nan / "report.json"), "--baseline", str(good / "report.json")]) == 1
    said = capsys.readouterr().out
    assert f"max |out - ref| nan ({N_OUT:,} non-finite where the reference is finite) against the baseline's" in said
