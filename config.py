"""pyinfra CLI configuration for this repository (the CLI execs ./config.py first).

Settings are validated for every host of the inventory before pyinfra connects to any
of them (issue 2): a bad value stops `pyinfra INVENTORY deploys/freetoken.py` (or
doctor.py) with one line per problem, naming host, field, value and what is allowed,
and nothing has been contacted, let alone changed.

How: config.py runs before the inventory exists, so it cannot validate here. It wraps the
one call the CLI makes to connect, `connect_all(state)` (pyinfra_cli.cli imports it by
name), and validates `state.inventory` - the very inventory object the deploy will see,
--data and group data included - before handing over. Chosen over re-loading the inventory
here from the command line (a second copy of the CLI's argument handling that could drift
from what the deploy sees) and over hooking State methods (also internal, and reset by
state.init). When a pyinfra release no longer has that name to wrap we say so on stderr and
the deploys' own check (freetoken_infra/preflight.py fleet_settings, first thing in every
deploy) still stops the run before any fact is read; it also covers runs that do not read
this file (another working directory, `--config`, pyinfra's Python API).
"""

import click
import pyinfra.api.connect
import pyinfra_cli.cli
from pyinfra.api.exceptions import PyinfraError
from pyinfra_cli.exceptions import CliError

from freetoken_infra.report import record_connect_errors
from freetoken_infra.settings import SettingsError, validate_inventory


def _validate_then_connect(connect_all):
    def connect_all_after_validation(state):
        try:
            validate_inventory(state.inventory)
        except SettingsError as exc:
            # CliError: the CLI prints the message as is (no traceback, no source line), exits 1.
            raise CliError(f"{exc}\nno host was contacted") from None
        record_connect_errors(state)  # for a rollout's report: who is unreachable (parked)
        try:
            return connect_all(state)
        except PyinfraError:
            # pyinfra's "No hosts remaining!" when it could connect to none of the run's hosts
            # (PCs that are off): say so plainly; its own wording, "pyinfra error in
            # .../config.py line N", reads like a crash of ours. Nothing was done on any host.
            if state.active_hosts:
                raise
            names = sorted(h.name for h in state.failed_hosts)
            click.echo(f"\n--> no host could be reached ({', '.join(names)}; pyinfra's errors are above); "
                       "nothing was done on any host", err=True)
            raise SystemExit(1) from None

    connect_all_after_validation.validates_settings = True
    return connect_all_after_validation


_connect = getattr(pyinfra_cli.cli, "connect_all", None)
if getattr(_connect, "validates_settings", False):
    pass  # this process ran config.py before (pyinfra's CLI called in-process twice)
elif _connect is pyinfra.api.connect.connect_all:
    pyinfra_cli.cli.connect_all = _validate_then_connect(_connect)
else:
    click.echo("config.py: this pyinfra's CLI has no connect_all to wrap; settings are validated "
               "by the deploy after connecting", err=True)
