"""Fixtures shared by the unit tests."""

import shutil
from pathlib import Path

import pytest

from tests.fleet.standins import hub_repos


@pytest.fixture(scope="session")
def standin_repos(tmp_path_factory) -> Path:
    """The hub stand-in's tiny model repositories, built once per test session (read-only)."""
    d = tmp_path_factory.mktemp("repos")
    hub_repos.build(str(d))
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, standin_repos) -> Path:
    """A model directory as the engine sees it: the supported stand-in repository, named as
    the deploy names it (the served model name is the directory's last component)."""
    dst = tmp_path_factory.mktemp("models") / "Qwen3.6-35B-A3B-NVFP4-nvidia"
    shutil.copytree(standin_repos / hub_repos.SUPPORTED_REPO, dst)
    return dst
