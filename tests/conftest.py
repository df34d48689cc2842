"""Shared test set-up: GPU tests skip cleanly, with the reason, where torch sees no CUDA GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run `python -m gemmgen ARGS` from the repository root; returns the finished process."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "gemmgen", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
