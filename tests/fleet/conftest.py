"""Session fixture `sim_fleet`: the simulated fleet, up for the whole test session and torn down
at its end even when tests fail. Yields a tests.fleet.harness.Fleet.

Hosts: harness.host_count() (FREETOKEN_SIM_HOSTS, default one per profile: ws1..ws3); the fleet
tests need at least the profiled hosts. Needs root; without root the fleet tests are skipped
(reported as skipped with the reason). After the final teardown the machine is checked for
anything of the fleet left over (tests.fleet.client.leftovers, which does not trust the
harness's own records); a leftover is an error in this fixture's teardown, so the run fails."""

import os

import pytest

from tests.fleet import client, harness
from tests.fleet.profiles import PROFILES

FIRST_MODULE = "test_converge.py"


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `slow` (tests/fleet/test_scale.py) bring up a 12-host fleet of their own:
    they run after every other test, so the session's fleet serves all the others first."""
    # tests/fleet/test_converge.py is the main job's first converge: it needs hosts no other module
    # has deployed to, so it runs first (test_agent_port.py, say, sorts before it and converges ws1).
    items.sort(
        key=lambda item: (
            item.get_closest_marker("slow") is not None,
            item.get_closest_marker("fleet") is not None and item.path.name != FIRST_MODULE,
        )
    )  # stable: order kept otherwise
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
