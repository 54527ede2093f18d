"""examples/triton_attention.py in Triton's interpreter (CPU; skipped where triton is not
installed, as in CI): its declared domain builds the smoke suite, and two cases pass through the
CLI as a user would run them.  Its H200 release audit: docs/h200-results.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
triton = pytest.importorskip("triton")


def test_the_triton_example_passes_two_cases_of_its_domain(tmp_path):
    configs = [
        {"dtype": "float16", "d": 64, "dv": 64, "heads_q": 4, "heads_kv": 2, "seqlen_q": 256, "seqlen_k": 256,
         "causal": True, "family": "drift"},
        {"dtype": "float16", "d": 128, "dv": 128, "heads_q": 2, "heads_kv": 2, "seqlen_q": 128, "seqlen_k": 128,
         "layout": "strided", "family": "outliers"},
    ]  # fmt: skip
    argv = [sys.executable, "-m", "audits", "run", "--quiet", "--kernel", "examples/triton_attention.py:attention"]
    for c in configs:
        argv += ["--config", json.dumps(c)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([*argv, "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads((tmp_path / "report.json").read_text())
    assert [c["verdict"] for c in rep["cases"]] == ["pass", "pass"]


def test_the_triton_examples_domain_builds_release_inside_it():
    sys.path.insert(0, str(ROOT))
    from audits.suites.cases import build_suite
    from audits.suites.domain import domain_of
    from examples.triton_attention import attention

    d = domain_of(attention)
    built = build_suite("release", d)
    assert len(built["cases"]) == 567 and all(d.refusal(c) is None for c in built["cases"])
    assert set(built["not_applicable"]) == {"nan_inf_masked"}
