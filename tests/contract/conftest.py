"""The real FreeToken 0.2.1 in its own venv (setup_real_parser.sh), shared by the contract tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parent / "setup_real_parser.sh"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "contract: runs our engine command lines and the engine stand-in's answers against the real "
        "FreeToken 0.2.1 (builds a ~5.7 GB venv on first use; FREETOKEN_CONTRACT=skip skips)",
    )


@pytest.fixture(scope="session")
def real_parser_python() -> str:
    """The interpreter of the venv that holds the real FreeToken 0.2.1 (built on first use)."""
    if os.environ.get("FREETOKEN_CONTRACT", "").lower() == "skip":
        pytest.skip("FREETOKEN_CONTRACT=skip")
    explicit = os.environ.get("FREETOKEN_CONTRACT_PYTHON")
    if explicit:
        return explicit
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL)
    sys.stderr.write(proc.stdout[-4000:])  # shown with -s, or on failure
    if proc.returncode != 0:
        pytest.fail(f"{SETUP.name} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("FREETOKEN_CONTRACT_PYTHON="), proc.stdout[-2000:]
    return line.split("=", 1)[1]
