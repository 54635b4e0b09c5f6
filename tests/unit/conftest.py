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


@pytest.fixture
def first_local_run():
    """For a test of the deploy's first run on this machine (``@local``, not WSL, so refused at
    preflight): a run of the deploy here before (an earlier test, an earlier run of the suite)
    left the refusal's record in root's /run/freetoken-deploy, and a re-run with the same code
    and settings is answered from it (docs/fast-check.md). It is the deploy's own
    volatile file, removed here so that the run is a first one; the test checks the re-run too."""
    from freetoken_infra.core.layout import CONVERGE_RECORD_FILE

    Path(CONVERGE_RECORD_FILE).unlink(missing_ok=True)
