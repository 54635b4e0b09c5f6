"""Every bench under bench/ still starts and still finds what it imports from the project, its
imports inside functions included (those run only on the simulated fleet, where a rename would
be found at the bench's next run, long after); the parts that need no fleet run here: the model
fetch's loopback figure and the fleet bench's memory readings."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted((ROOT / "bench").glob("*.py"))
PROJECT = ("bench", "tests", "freetoken_infra", "operations", "facts", "deploys")


def _has(module, name: str) -> bool:
    """`from module import name`: an attribute, or a submodule of a package."""
    if hasattr(module, name):
        return True
    try:
        importlib.import_module(f"{module.__name__}.{name}")
    except ModuleNotFoundError:
        return False
    return True


@pytest.mark.parametrize("path", BENCHES, ids=[p.stem for p in BENCHES])
def test_the_bench_starts_and_everything_it_imports_from_the_project_is_there(path):
    done = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
    missing = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT:
            module = importlib.import_module(node.module)
            missing += [f"{node.module}.{a.name}" for a in node.names if not _has(module, a.name)]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PROJECT:
                    importlib.import_module(a.name)
    assert not missing, f"{path.name} imports what the project no longer has: {missing}"


def test_the_model_fetch_loopback_figure_runs_and_meets_its_target(capsys):
    from bench import model_fetch

    assert model_fetch.main(["--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "cut and resume (12 drops after 1 MB each): bytes transferred / bytes missing = " in out
    assert out.rstrip().endswith("PASS"), out


def test_the_fleet_benchs_memory_readings():
    from bench import fleet_up

    assert fleet_up._pss(os.getpid()) > 0  # this process's own smaps_rollup
    assert fleet_up._pss(2**22 + 1) == 0  # no such process: 0, not an error
    assert fleet_up.mem_available() > 0
    mib = 2**20
    line = fleet_up.format_memory("idle", {"ws1": (100 * mib, 10), "ws2": (300 * mib, 12)}, 1024 * mib)
    assert line == (
        "memory per host, idle: PSS median 200 MiB (min 100, max 300; 11 processes), 400 MiB for 2 hosts; "
        "MemAvailable dropped 512 MiB per host (1.00 GiB in all)"
    )
    assert fleet_up.format_memory("idle", {}, None) == "memory per host, idle: no host running"


def test_the_agent_check_bench_runs_on_the_stand_ins(capsys):
    from bench import agent_check

    assert agent_check.main(["--asks", "5", "--flooders", "2", "--half-open", "4"]) == 0
    out = capsys.readouterr().out
    for phase in ("idle", "under flood", "after"):
        assert any(line.startswith(phase) and "(5 answered, 0 not)" in line for line in out.splitlines()), out
    assert agent_check.line("idle", [], 3) == "idle           no answer (3 asks)"
    assert agent_check.pct([3.0, 1.0, 2.0], 50) == 2.0
