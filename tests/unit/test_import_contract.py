"""The layers of ARCHITECTURE.md hold in the import graph (import-linter's contracts in pyproject.toml),
and the contract is no formality: a fact that imports a rule breaks it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    # PYTHONPATH puts the tree's packages ahead of the editable install's finder.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def _copy_tree(dest: Path) -> Path:
    for name in ("freetoken_infra", "facts", "operations"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_the_import_contract_holds():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_fact_importing_a_rule_breaks_the_contract(tmp_path):
    tree = _copy_tree(tmp_path)
    fact = tree / "facts" / "wsl.py"
    fact.write_text(fact.read_text() + "\nfrom freetoken_infra import rules  # noqa: E402,F401\n")
    result = _lint_imports(tree)
    assert result.returncode != 0
    assert "facts.wsl -> freetoken_infra.rules" in result.stdout, result.stdout


def test_the_core_importing_a_fact_breaks_the_contract(tmp_path):
    tree = _copy_tree(tmp_path)
    core = tree / "freetoken_infra" / "core" / "launch.py"
    core.write_text(core.read_text() + "\nimport facts.gpu  # noqa: E402,F401\n")
    result = _lint_imports(tree)
    assert result.returncode != 0
    assert "freetoken_infra.core.launch -> facts.gpu" in result.stdout, result.stdout
