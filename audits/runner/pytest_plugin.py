"""pytest plugin (entry point ``pytest11``): audit your own kernels inside your test suite.

    def test_my_kernel(fa4_audit):
        fa4_audit("mypkg.attention:my_kernel", suite="smoke")

The ``fa4_audit`` fixture runs a suite for a kernel (a registered name or ``module:attr``)
exactly as ``fa4-audit run`` does, writes the report under pytest's temporary directory, and
fails the test with the failing cases, their reasons and reproducers; it returns the report.
"""

from __future__ import annotations

import fnmatch

import pytest

__all__ = ["fa4_audit"]


@pytest.fixture
def fa4_audit(tmp_path):
    """Callable ``(kernel, *, suite="smoke", case="*", device="cpu", thresholds=None,
    isolate=False, backward=False, repeat=2, deterministic=False) -> report dict``; fails the
    calling test when any case fails.  ``backward``: audit the gradients too (``run --backward``)."""
    import torch

    from audits.runner.engine import FAILING, run_suite
    from audits.runner.gate import load_thresholds
    from audits.runner.report import build_report, exit_code, summary_line, write_report

    def audit(
        kernel: str,
        *,
        suite: str = "smoke",
        case: str = "*",
        device: str = "cpu",
        thresholds=None,
        isolate: bool = False,
        backward: bool = False,
        repeat: int = 2,
        deterministic: bool = False,
    ) -> dict:
        from audits.runner.backward import BackwardOptions

        cases = [c for c in _cases(kernel, suite) if fnmatch.fnmatch(c.name, case)]
        th = load_thresholds(thresholds)
        out = tmp_path / f"fa4-audit-{suite}"
        bwd = BackwardOptions(repeat=repeat, deterministic=deterministic) if backward else None
        records = run_suite(
            kernel, cases, device=torch.device(device), out_dir=out, thresholds=th, suite=suite, isolate=isolate,
            backward=bwd,
        )  # fmt: skip
        rep = build_report(
            kernel=kernel,
            suite=suite,
            seed=0,
            device=device,
            environment={},
            thresholds=th,
            records=records,
            command=f"fa4_audit({kernel!r}, suite={suite!r}, case={case!r})",
            created="",
            shard=None,
        )
        paths = write_report(rep, out)
        if exit_code(rep):
            bad = [r for r in records if r["verdict"] in FAILING]
            lines = [f"  {r['verdict']}: {r['case']}: {'; '.join(x for x in r['reasons'] if x)}\n"
                     f"    reproduce: {r['repro']}" for r in bad[:10]]  # fmt: skip
            why = f"fails {len(bad)} case(s)" if bad else "evaluated no case (nothing was audited)"
            pytest.fail(
                f"fa4-audit: {kernel} {why} of suite {suite}; {summary_line(rep)} (report {paths['md']}):\n"
                + "\n".join(lines),
                pytrace=False,
            )
        return rep

    return audit


def pytest_configure(config):
    config.addinivalue_line("markers", "fa4_audit: a test that audits an attention kernel with fa4-audit")


def _cases(kernel: str, suite: str) -> list:
    """The suite's cases as ``fa4-audit run`` builds them for this one kernel: a named suite
    (or a suite file, ``audits.suite_file``) within the kernel's declared domain."""
    from audits.domain import Domain, named_suite_within
    from audits.kernels import kernel_domain
    from audits.suite_file import build, is_suite_file, load

    d = kernel_domain(kernel)
    if is_suite_file(suite):  # its [[case]]s outside the domain stay: the engine skips them, with the reason
        return build(load(suite), d, cases_in=Domain())["cases"]
    return named_suite_within(suite, d)["cases"]
