"""Fixtures shared by the unit tests."""

from pathlib import Path

import pytest

from tests.fleet.standins import hub_repos


@pytest.fixture(scope="session")
def standin_repos(tmp_path_factory) -> Path:
    """The hub stand-in's tiny model repositories, built once per test session (read-only)."""
    d = tmp_path_factory.mktemp("repos")
    hub_repos.build(str(d))
    return d
