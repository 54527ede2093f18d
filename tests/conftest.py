"""Shared test configuration: Hypothesis profiles and the GPU marker's skip."""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

DATA = Path(__file__).parent / "data"

# CI: derandomized and bounded (the full search is `fa4-audit fuzz`'s job).
settings.register_profile(
    "ci", derandomize=True, max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _gpu_ready() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from fa4.production import require_production

        require_production()
    except Exception as exc:  # ProductionUnavailable
        return str(exc)
    return None


def pytest_collection_modifyitems(config, items):
    if not any("gpu" in item.keywords for item in items):
        return
    reason = _gpu_ready()
    if reason:
        skip = pytest.mark.skip(reason=f"gpu test: {reason}")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
