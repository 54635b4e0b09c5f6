"""The verify suite's options and fixtures: every check runs once per host of a pyinfra inventory.

    pytest tests/verify --inventory inventories/home.py
    pytest tests/verify --inventory inventories/sim.py --limit ws1 --limit ws2

Options (pyinfra's words for pyinfra's ideas):
  --inventory FILE   the inventory the deploy ran with (required)
  --limit PATTERN    only these hosts: a host name, a glob or a group name; repeatable, or
                     comma-separated (like pyinfra's --limit)
  --exclude PATTERN  leave these hosts out (like pyinfra's --exclude)
  --health-wait S    how long the chat/decode checks wait for /health ok (default 15 s)

Without --inventory nothing here is collected: the project's plain `pytest` run (testpaths =
tests) leaves this folder out, and naming the folder without an inventory is a usage error.
testinfra's own --hosts does not combine with --inventory (use --limit).

Fixtures: ``target`` (the inventory host: name, groups, settings), ``host`` (testinfra's Host,
through sudo when the connection's user is not root), ``settings`` (the deploy's Settings of
that host), ``facts`` (pyinfra facts run through ``host``), ``gate`` (the health gate's result,
run once per host).
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_TARGETS = pytest.StashKey[list]()
DEFAULT_HEALTH_WAIT_S = 15.0


def pytest_addoption(parser):
    group = parser.getgroup("freetoken-verify", "FreeToken host verification (tests/verify)")
    group.addoption(
        "--inventory",
        dest="ft_inventory",
        metavar="FILE",
        help="pyinfra inventory whose hosts to verify (e.g. inventories/home.py)",
    )
    group.addoption(
        "--limit",
        dest="ft_limit",
        action="append",
        default=[],
        metavar="PATTERN",
        help="verify only these hosts: name, glob or group (repeatable, comma-separated)",
    )
    group.addoption(
        "--exclude",
        dest="ft_exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave these hosts out: name, glob or group (repeatable, comma-separated)",
    )
    group.addoption(
        "--health-wait",
        dest="ft_health_wait",
        type=float,
        default=DEFAULT_HEALTH_WAIT_S,
        metavar="SECONDS",
        help="how long the chat and decode checks wait for /health ok",
    )


def _option(config, name, default=None):
    # When this conftest is found during collection (a plain `pytest`), its options were never
    # parsed: they read as unset.
    try:
        return config.getoption(name)
    except ValueError:
        return default


def _asked_for_here(config) -> bool:
    """Whether a command-line argument names this folder or something in it."""
    base = Path(config.invocation_params.dir)
    for arg in config.args:
        path = (base / arg.split("::", 1)[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_configure(config):
    if _option(config, "ft_inventory"):
        _targets(config)  # a wrong inventory, pattern or setting is a usage error, before any test
    elif _asked_for_here(config):
        raise pytest.UsageError(
            "tests/verify checks the hosts of a pyinfra inventory: add --inventory FILE, e.g.\n"
            "  pytest tests/verify --inventory inventories/home.py"
        )


def pytest_ignore_collect(collection_path, config):
    # The project's own test run (`pytest`, testpaths = tests) has no inventory: nothing here.
    return None if _option(config, "ft_inventory") else True


def _targets(config) -> list:
    if _TARGETS not in config.stash:
        from freetoken_infra.core.settings import SettingsError
        from tests.verify.bridge import BridgeError, targets

        if _option(config, "hosts"):
            raise pytest.UsageError("--hosts is testinfra's; with --inventory, choose hosts with --limit")
        try:
            config.stash[_TARGETS] = targets(
                _option(config, "ft_inventory"),
                _option(config, "ft_limit", []),
                _option(config, "ft_exclude", []),
            )
        except (BridgeError, SettingsError) as exc:
            raise pytest.UsageError(str(exc)) from None
    return config.stash[_TARGETS]


def pytest_generate_tests(metafunc):
    if "target" in metafunc.fixturenames:
        chosen = _targets(metafunc.config)
        metafunc.parametrize("target", chosen, ids=[t.name for t in chosen], indirect=True, scope="module")


@pytest.fixture(scope="module")
def target(request):
    return request.param


@pytest.fixture(scope="module")
def host(target):
    """testinfra's Host for the inventory host (overrides testinfra's --hosts fixture here)."""
    return target.testinfra_host()


@pytest.fixture(scope="module")
def settings(target):
    return target.settings


@pytest.fixture(scope="module")
def facts(host):
    from tests.verify.probes import Facts

    return Facts(host)


@pytest.fixture(scope="module")
def gate(host, settings, request):
    from operations.service import key_path
    from tests.verify.probes import health_gate

    key_file = None if settings.api_key_source == "none" else key_path(settings)
    return health_gate(host, settings, key_file, _option(request.config, "ft_health_wait", DEFAULT_HEALTH_WAIT_S))
