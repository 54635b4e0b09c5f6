"""Session fixture `sim_fleet`: the simulated fleet, up for the whole test session and torn down
at its end even when tests fail. Yields a tests.fleet.harness.Fleet.

Hosts: FREETOKEN_SIM_HOSTS (default 3). Needs root; without root the fleet tests are skipped."""
import os

import pytest

from tests.fleet import harness


@pytest.fixture(scope="session")
def sim_fleet():
    if os.geteuid() != 0:
        pytest.skip("the simulated fleet needs root (systemd-nspawn, network namespaces)")
    with harness.exclusive():
        fleet = harness.up(int(os.environ.get("FREETOKEN_SIM_HOSTS", "3")))
        try:
            yield fleet
        finally:
            harness.down()
