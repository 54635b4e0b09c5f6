"""pyinfra CLI configuration for this repository (the CLI execs ./config.py first).

Settings are validated for every host of the inventory before pyinfra connects to any
of them: a bad value stops `pyinfra INVENTORY deploys/freetoken.py` (or
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

The inventory is loaded the same way, through `make_inventory` (also imported by name into
pyinfra_cli.cli): a missing inventory file (pyinfra would go on with zero hosts and exit 0), an
inventory with no host, and an inventory or group_data file that does not compile or raises (a
traceback, or "An internal exception occurred" plus a pyinfra-debug.log in the working directory)
each stop the run with one line naming the file, exit 1, nothing contacted.
"""

import os

import click
from pyinfra.api.exceptions import PyinfraError

from freetoken_infra.core import pyinfra_internals, redact
from freetoken_infra.core.records import RunRecords
from freetoken_infra.core.settings import SettingsError, validate_inventory

CliError, UnexpectedExternalError = pyinfra_internals.cli_errors()


def _validate_then_connect(connect_all):
    def connect_all_after_validation(state):
        try:
            validate_inventory(state.inventory)
        except SettingsError as exc:
            # CliError: the CLI prints the message as is (no traceback, no source line), exits 1.
            raise CliError(f"{exc}\nno host was contacted") from None
        RunRecords.of(state)  # the run's records, before connecting: who is unreachable (parked)
        try:
            return connect_all(state)
        except PyinfraError:
            # pyinfra's "No hosts remaining!" when it could connect to none of the run's hosts
            # (PCs that are off): say so plainly; its own wording, "pyinfra error in
            # .../config.py line N", reads like a crash of ours. Nothing was done on any host.
            if pyinfra_internals.active_host_names(state):
                raise
            names = sorted(pyinfra_internals.failed_host_names(state))
            click.echo(
                f"\n--> no host could be reached ({', '.join(names)}; pyinfra's errors are above); "
                "nothing was done on any host",
                err=True,
            )
            raise SystemExit(1) from None

    connect_all_after_validation.validates_settings = True  # type: ignore[attr-defined]
    return connect_all_after_validation


def _names_a_file(inventory: str) -> bool:
    """Whether pyinfra's CLI argument is meant as an inventory file (not `@local`, `host1,host2`
    or a module path)."""
    return not inventory.startswith("@") and "," not in inventory and (inventory.endswith(".py") or os.sep in inventory)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _load_inventory_or_say_why(make_inventory):
    def make_inventory_checked(inventory, *args, **kwargs):
        if isinstance(inventory, str) and _names_a_file(inventory) and not os.path.isfile(inventory):
            raise CliError(f"inventory file {inventory}: not found; no host was contacted")
        try:
            loaded = make_inventory(inventory, *args, **kwargs)
        except SyntaxError as exc:  # pyinfra compiles outside its own error handling
            raise CliError(f"{exc.filename}:{exc.lineno}: syntax error: {exc.msg}; no host was contacted") from None
        except UnexpectedExternalError as exc:
            raise CliError(f"{exc.filename}: {_one_line(exc.exception)}; no host was contacted") from None
        if len(loaded) == 0:
            raise CliError(f"inventory {inventory}: no hosts; no host was contacted")
        return loaded

    make_inventory_checked.checks_inventory = True  # type: ignore[attr-defined]
    return make_inventory_checked


if not pyinfra_internals.wrap_cli("make_inventory", _load_inventory_or_say_why, "checks_inventory"):
    click.echo(
        "config.py: this pyinfra's CLI has no make_inventory to wrap; a missing or broken "
        "inventory is reported by pyinfra itself",
        err=True,
    )
# --diff: every diff pyinfra's files operations print goes through the secret mask first
# (operations/preview.py does the same for runs that do not read this file).
pyinfra_internals.mask_file_diffs(redact.mask_lines)
# pyinfra's per-operation introspection that is the same for every host, done once.
pyinfra_internals.cache_operation_introspection()
if not pyinfra_internals.wrap_cli("connect_all", _validate_then_connect, "validates_settings"):
    click.echo(
        "config.py: this pyinfra's CLI has no connect_all to wrap; settings are validated "
        "by the deploy after connecting",
        err=True,
    )
