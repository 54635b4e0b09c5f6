"""Session fixture `sim_fleet`: the simulated fleet, up for the whole test session and torn down
at its end even when tests fail. Yields a tests.fleet.harness.Fleet.

Hosts: harness.host_count() (FREETOKEN_SIM_HOSTS, default one per profile: ws1..ws3); the fleet
tests need at least the profiled hosts. Needs root; without root the fleet tests are skipped
(reported as skipped with the reason). After the final teardown the machine is checked for
anything of the fleet left over (tests.fleet.client.leftovers, which does not trust the
harness's own records); a leftover is an error in this fixture's teardown, so the run fails."""

import os
import subprocess
from pathlib import Path

import pytest

from tests.fleet import client, harness
from tests.fleet.gateway_load import converge_behind_gateway, data_args, write_keys
from tests.fleet.profiles import PROFILES

FIRST_MODULE = "test_converge.py"
SHARED_GATEWAY = "gateway_fleet"


@pytest.fixture(scope="session")
def sim_fleet():
    if os.geteuid() != 0:
        pytest.skip("the simulated fleet needs root (systemd-nspawn, network namespaces)")
    n_hosts = harness.host_count()
    if n_hosts < len(PROFILES):
        raise harness.FleetError(
            f"FREETOKEN_SIM_HOSTS={n_hosts}: the fleet tests need at least "
            f"the {len(PROFILES)} profiled hosts ({', '.join(PROFILES)})"
        )
    with harness.exclusive():
        fleet = harness.up(n_hosts)
        try:
            yield fleet
        finally:
            harness.down()
            left = client.leftovers()
            if left:
                raise harness.FleetError("the session's final teardown left these behind:\n  " + "\n  ".join(left))


class SharedGateway:
    """ws1 and ws2 converged behind the gateway host, the gateway converged with alerting
    (Prometheus and Alertmanager on it), all with the shared settings (gateway_load.data_args):
    brought up once for every module that asks for `gateway_fleet` (test_agent_metrics,
    test_alerts, test_gateway, test_ledger, test_owner, test_wake), which run one after the
    other, and released
    when the run leaves them (``pytest_runtest_teardown`` below). Each of those modules leaves
    the fleet as it found it (its own fixtures undo what its tests change)."""

    def __init__(self, fleet: harness.Fleet, keys_dir: Path):
        self.fleet, self.keys_dir = fleet, keys_dir
        self.state: dict | None = None

    def up(self) -> dict:
        """{"fleet", "keys", "hosts": the workstations' run, "first": the gateway's first run}."""
        if self.state is None:
            keys = write_keys(self.keys_dir)
            harness.start_gateway()
            try:
                hosts, first = converge_behind_gateway(keys)
                assert hosts.returncode == 0, "the workstations did not converge behind the gateway"
                assert first.returncode == 0, "the gateway did not converge"
            except BaseException:
                harness.stop_gateway()
                client.deploy("--limit", "ws1", "--limit", "ws2")
                raise
            self.state = {"fleet": self.fleet, "keys": keys, "hosts": hosts, "first": first}
        return self.state

    def args(self) -> list[str]:
        """The settings of every run in the shared modules (the keys' files and SHARED_SETTINGS)."""
        return data_args(self.up()["keys"])

    def release(self, converge_back: bool) -> None:
        """The gateway host goes; with ``converge_back``, ws1 and ws2 converge back to the
        default settings (engines on loopback), as the modules after these expect them."""
        if self.state is None:
            return
        self.state = None
        harness.stop_gateway()
        if converge_back:
            run: subprocess.CompletedProcess = client.deploy("--limit", "ws1", "--limit", "ws2")
            assert run.returncode == 0, "ws1 and ws2 did not converge back to the default settings"


@pytest.fixture(scope="session")
def gateway_fleet(sim_fleet, tmp_path_factory) -> SharedGateway:
    shared = SharedGateway(sim_fleet, tmp_path_factory.mktemp("gateway-fleet") / "keys")
    _SHARED.append(shared)
    yield shared
    shared.release(converge_back=False)  # the session's fleet goes next


_SHARED: list[SharedGateway] = []


def _uses_shared_gateway(item: pytest.Item | None) -> bool:
    return item is not None and SHARED_GATEWAY in getattr(item, "fixturenames", ())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the last test of the shared gateway's modules (and their own fixtures' teardown):
    release it. ws1 and ws2 converge back unless nothing follows or the next test replaces the
    fleet (the slow 12-host tests)."""
    yield
    if _uses_shared_gateway(item) and not _uses_shared_gateway(nextitem):
        following = nextitem is not None and nextitem.get_closest_marker("slow") is None
        for shared in _SHARED:
            shared.release(converge_back=following)


def _order(item: pytest.Item) -> int:
    if item.get_closest_marker("slow") is not None:
        return 3
    if item.get_closest_marker("fleet") is not None and item.path.name == FIRST_MODULE:
        return 0
    return 2 if _uses_shared_gateway(item) else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `slow` (tests/fleet/test_scale.py) bring up a 12-host fleet of their own:
    they run after every other test, so the session's fleet serves all the others first.
    tests/fleet/test_converge.py is the main job's first converge: it needs hosts no other module
    has deployed to, so it runs first. The modules on the shared gateway fleet run together,
    just before the slow ones (one bring-up, one release, no converge back before the 12 hosts)."""
    items.sort(key=_order)  # stable: the order within each group is kept
    # `pytest -m "not fleet"` must start no fleet: a test that asks for the fleet without the
    # marker would boot it in a run that deselected the fleet.
    unmarked = [
        item.nodeid
        for item in items
        if "sim_fleet" in getattr(item, "fixturenames", ()) and item.get_closest_marker("fleet") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests use the simulated fleet but are not marked `fleet` (pytestmark = pytest.mark.fleet): "
            + ", ".join(unmarked)
        )
