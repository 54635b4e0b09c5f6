"""Every pyinfra internal we rely on, touched here and nowhere else.

pyinfra's public API has no hook for some things we need: reading many facts in one round
trip (facts/batch.py: how pyinfra normalises a fact call, and the Host methods that run
something), validating the inventory and the settings before the CLI connects (config.py: the
CLI's inventory loader and connect step), telling pyinfra's own host data keys from ours
(settings: the connectors' ``data_meta``), masking secrets in the ``--diff`` of files operations
(``mask_file_diffs``), a private upload folder for sudo runs (``use_upload_dir``) and an
operation's privilege arguments for its callbacks (``current_op_elevation``), the CLI's
inventory loader for the CLIs that read an inventory (``load_inventory``), the CLI's own
errors (``cli_errors``) and ``--data`` value parsing (``parse_cli_value``), and what the
run's State says of its hosts and operations (``reached_host_names`` ...), and taking pyinfra's
per-operation introspection that is the same for every host out of its per-host path
(``cache_operation_introspection``). Each is named in ``INTERNALS``; tests/unit/test_pyinfra_internals.py checks
every one against the installed pyinfra and fails naming the internal when a release changes
it. pyproject.toml allows only the pyinfra releases those tests passed on.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from pyinfra.api import Inventory
    from pyinfra.api.host import Host
    from pyinfra.api.state import State

# Host methods through which an operation runs something on the host (a fact read also uses
# run_shell_command, which the batch tells apart itself).
HOST_METHODS_THAT_RUN = ("run_shell_command", "put_file", "get_file")


def handle_fact_kwargs(
    state: State, host: Host, cls: type, args: list[Any], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(fact kwargs, global kwargs)`` of a ``get_fact`` call, normalised as pyinfra does
    (``pyinfra.api.facts._handle_fact_kwargs``)."""
    from pyinfra.api.facts import _handle_fact_kwargs

    result: tuple[dict[str, Any], dict[str, Any]] = _handle_fact_kwargs(state, host, cls, args, kwargs)
    return result


def connector_argument_keys() -> frozenset[str]:
    """The global arguments that are connector arguments (``_sudo``, ``_env``, ...)."""
    from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS

    return frozenset(CONNECTOR_ARGUMENT_KEYS)


@functools.cache
def connector_data_keys() -> frozenset[str]:
    """Host data keys pyinfra's connectors read (``ssh_user``, ...): not our settings.

    Computed once per process: it is the same for every host (the connectors' class attribute
    ``data_meta``), and finding the connectors reads the entry points of every installed
    distribution, which cost milliseconds per host when each host's settings were validated.
    The installed connectors do not change while a run goes on; a frozenset, so no caller can
    change what the next one gets."""
    from pyinfra.api.connectors import get_all_connectors

    keys: set[str] = set()
    for connector in get_all_connectors().values():  # type: ignore[no-untyped-call]
        keys.update(getattr(connector, "data_meta", {}) or {})
    return frozenset(keys)


def host_class() -> type[Host]:
    from pyinfra.api.host import Host

    return Host


def replace_host_method(name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """``Host.<name> = make(Host.<name>)``; ``name`` is ``get_fact`` or one of
    ``HOST_METHODS_THAT_RUN``."""
    host = host_class()
    setattr(host, name, make(getattr(host, name)))


def unwrap_context(obj: Any) -> Any:
    """The object behind one of pyinfra's context proxies (``from pyinfra import host``)."""
    getter = getattr(obj, "_get_module", None)
    return getter() if callable(getter) and getter() is not None else obj


def wrap_cli(name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]], marker: str) -> bool:
    """Replace the CLI's ``name`` (``connect_all`` or ``make_inventory``, which
    ``pyinfra_cli.cli`` imports by name from pyinfra.api.connect / pyinfra_cli.inventory) with
    ``make(original)``, once per process (``marker``: an attribute ``make`` sets on its result).
    False when this pyinfra's CLI has no such name to wrap."""
    import pyinfra_cli.cli

    current = getattr(pyinfra_cli.cli, name, None)
    if getattr(current, marker, False):
        return True
    if current is None or current is not _cli_originals().get(name):
        return False
    assert callable(current)
    setattr(pyinfra_cli.cli, name, make(current))  # current is the original, checked above
    return True


def _cli_originals() -> dict[str, Any]:
    import pyinfra.api.connect
    import pyinfra_cli.inventory

    return {"connect_all": pyinfra.api.connect.connect_all, "make_inventory": pyinfra_cli.inventory.make_inventory}


def connection_lost(host: Any) -> bool:
    """True when pyinfra's SSH connection to ``host`` is gone (``SSHConnector.client``, a
    paramiko ``SSHClient``); False for connectors without one (``@local``)."""
    client = getattr(getattr(host, "connector", None), "client", None)
    get_transport = getattr(client, "get_transport", None)
    if get_transport is None:
        return False
    transport = get_transport()
    return transport is None or not transport.is_active()


def wait_connection_lost(host: Any, timeout_s: float = 2.0) -> bool:
    """``connection_lost``, allowing paramiko's transport thread up to ``timeout_s`` to notice:
    it closes the session's channels before it marks the transport inactive, so a write that
    failed with "Socket is closed" can come a moment before ``is_active()`` turns False."""
    deadline = time.monotonic() + timeout_s
    while not connection_lost(host):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


DiffMask = Callable[[list[str] | None, list[str]], "tuple[list[str] | None, list[str]]"]


def mask_file_diffs(mask: DiffMask) -> None:
    """Route every diff pyinfra's files operations print under ``--diff`` (``files.put``,
    ``files.template``, ``files.line``... call ``generate_color_diff``, which
    ``pyinfra.operations.files`` imports by name from ``pyinfra.operations.util.files``) through
    ``mask(current_lines, desired_lines)`` first. Once per process."""
    import pyinfra.operations.files as files_ops

    current = files_ops.generate_color_diff
    if getattr(current, "masks_secrets", False):
        return

    def masked_color_diff(current_lines: list[str], desired_lines: list[str]) -> Any:
        before, after = mask(list(current_lines), list(desired_lines))
        return current(before or [], after)

    masked_color_diff.masks_secrets = True  # type: ignore[attr-defined]
    files_ops.generate_color_diff = masked_color_diff


def cache_operation_introspection() -> None:
    """Take two pieces of introspection whose answer is the same for every host out of the path
    pyinfra walks for every operation and every fact read of every host (the no-op
    re-run's controller CPU per host). Once per process; what pyinfra computes is unchanged.

    - ``pyinfra.api.arguments.all_global_arguments()``, which ``pop_global_arguments`` calls for
      every operation and fact read, resolves the type hints of the ``AllArguments`` TypedDict
      each time (``typing.get_type_hints``). Safe to compute once: it takes no argument, and the
      class is defined once when pyinfra is imported and nothing changes its annotations. Each
      call still gets a list of its own, so a caller that changed it changes nobody else's.
    - ``pyinfra.api.util`` places each operation in the deploy (its order and hash, from the
      line numbers of the deploy's frames; ``get_call_location`` for a message) with
      ``inspect.stack()`` and ``inspect.getframeinfo()`` and reads only each frame's file name
      and line number. Their default ``context=1`` also reads a line of source around each frame,
      which calls ``inspect.getmodule``: a scan of every loaded module for each frame whose file
      is no imported module's (the deploy files pyinfra executes). ``context=0`` gives the same
      frames, file names and line numbers (those come from the frame, not from its source) and
      reads no source. Not a cache: nothing is kept between calls, so no answer can be stale.
    """
    import sys

    import pyinfra.api.arguments as arguments
    import pyinfra.api.util as util

    if not getattr(arguments.all_global_arguments, "computed_once", False):
        hints = tuple(arguments.all_global_arguments())

        def all_global_arguments() -> list[tuple[str, type]]:
            return list(hints)

        all_global_arguments.computed_once = True  # type: ignore[attr-defined]
        arguments.all_global_arguments = all_global_arguments

    if not getattr(util.stack, "reads_no_source", False):

        def stack() -> list[inspect.FrameInfo]:
            # From the caller's frame, as inspect.stack() (which starts at its own caller): this
            # function's frame must not be among them, it would count as a deploy line.
            return inspect.getouterframes(sys._getframe(1), context=0)

        stack.reads_no_source = True  # type: ignore[attr-defined]
        util.stack = stack  # type: ignore[assignment]
        util.getframeinfo = functools.partial(inspect.getframeinfo, context=0)


def _check_operation_introspection() -> None:
    import pyinfra.api.arguments as arguments
    import pyinfra.api.util as util
    from pyinfra.api.operation import solve_operation_consistency

    # Looked up by name at each call, in the modules we replace them in.
    assert "all_global_arguments()" in inspect.getsource(arguments.pop_global_arguments)
    assert _params(arguments.all_global_arguments) == []
    assert "get_type_hints(AllArguments)" in inspect.getsource(arguments.all_global_arguments) or getattr(
        arguments.all_global_arguments, "computed_once", False
    )
    assert "get_operation_order_from_stack(state)" in inspect.getsource(solve_operation_consistency)
    source = inspect.getsource(util)
    assert "from inspect import getframeinfo, stack" in source
    # What util reads of the frames: the frame itself, its file name and line number, no source.
    assert "code_context" not in source and ".index" not in source
    for func in (util.get_operation_order_from_stack, util.get_caller_frameinfo):
        assert "stack()" in inspect.getsource(func)


def _check_file_diff() -> None:
    import pyinfra.operations.files as files_ops
    import pyinfra.operations.util.files as util_files

    current = files_ops.generate_color_diff
    assert current is util_files.generate_color_diff or getattr(current, "masks_secrets", False)
    assert _params(util_files.generate_color_diff) == ["current_lines", "desired_lines"]
    for op in (files_ops.put, files_ops.line):
        assert "generate_color_diff(" in inspect.getsource(op)


def use_upload_dir(host: Host, path: str) -> None:
    """Make ``path`` the folder pyinfra uploads through for ``host`` from now on: host data
    ``_temp_dir`` becomes every later operation's ``_temp_dir`` global argument, which
    ``files.put`` hands to ``host.get_temp_filename`` (``<path>/pyinfra-<sha1>``), the file a
    sudo upload is written to before root copies it into place."""
    host.data._temp_dir = path


def _check_upload_dir() -> None:
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.arguments import pop_global_arguments
    from pyinfra.operations import files

    inventory = Inventory((["ws-check"], {}))  # type: ignore[no-untyped-call]
    state = State(inventory, Config())  # type: ignore[no-untyped-call]
    host = inventory.get_host("ws-check")
    use_upload_dir(host, "/tmp/freetoken-upload-check")
    arguments, _ = pop_global_arguments(state, host, {})
    assert arguments["_temp_dir"] == "/tmp/freetoken-upload-check"
    assert host.get_temp_filename("/etc/x", temp_directory="/tmp/freetoken-upload-check").startswith(
        "/tmp/freetoken-upload-check/pyinfra-"
    )
    put = inspect.getsource(files.put)
    assert 'get("_temp_dir")' in put and "get_temp_filename(dest, temp_directory=temp_dir)" in put


def _check_ssh_client() -> None:
    from paramiko import SSHClient
    from pyinfra.connectors.ssh import SSHConnector

    assert "self.client = SSHClient()" in inspect.getsource(SSHConnector)
    assert hasattr(SSHClient, "get_transport")


def _params(func: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(func).parameters)


def _check_handle_fact_kwargs() -> None:
    from pyinfra.api.facts import _handle_fact_kwargs

    assert _params(_handle_fact_kwargs) == ["state", "host", "cls", "args", "kwargs"]


def _check_host_methods() -> None:
    host = host_class()
    assert _params(host.get_fact)[:2] == ["self", "name_or_cls"]
    for name in HOST_METHODS_THAT_RUN:
        assert callable(getattr(host, name)), name


def _check_cli_wraps() -> None:
    import pyinfra_cli.cli

    originals = _cli_originals()
    for name, original in originals.items():
        assert getattr(pyinfra_cli.cli, name, None) is original, name
    assert _params(originals["connect_all"]) == ["state"]
    assert _params(originals["make_inventory"])[0] == "inventory"


def _check_connector_keys() -> None:
    assert {"ssh_user", "ssh_port"} <= connector_data_keys()
    assert {"_sudo", "_env", "_sudo_password"} <= connector_argument_keys()


def _check_context_proxy() -> None:
    from pyinfra import context

    assert callable(getattr(context.host, "_get_module", None))


class InventoryLoadError(Exception):
    """An inventory file that did not load; the message says why."""


def load_inventory(path: str, data: dict[str, Any] | None = None) -> Inventory:
    """The inventory file ``path`` loaded as the pyinfra CLI loads it (its ``group_data/``, and
    ``data`` as its ``--data``), for the CLIs that read an inventory without running a deploy
    (the rollout, the fleet's drain/ready/status). The CLI's loader records the file's name on
    the current State, so it runs under a State of its own."""
    import os

    from pyinfra.api import State
    from pyinfra.context import ctx_state
    from pyinfra_cli.inventory import make_inventory

    try:
        with ctx_state.use(State()):
            inventory: Inventory = make_inventory(path, cwd=os.getcwd(), override_data=data or None)
    except SystemExit as exc:  # an inventory module may refuse, e.g. inventories/sim.py
        raise InventoryLoadError(str(exc)) from None
    except Exception as exc:
        raise InventoryLoadError(f"cannot load the inventory: {exc}") from None
    return inventory


def _check_load_inventory() -> None:
    from pyinfra_cli.inventory import make_inventory

    assert {"inventory", "cwd", "override_data"} <= set(_params(make_inventory))


# --- the run's hosts and operations, as pyinfra's State keeps them ------------------------


_Handler = TypeVar("_Handler")


def callback_handler(state: State, cls: type[_Handler]) -> _Handler:
    """The run's one ``cls`` callback handler (``State.add_callback_handler``, public API),
    created and registered on the first call."""
    for handler in state.callback_handlers:
        if isinstance(handler, cls):
            return handler
    made = cls()
    state.add_callback_handler(made)  # type: ignore[no-untyped-call]
    return made


def reached_host_names(state: State) -> set[str]:
    """Hosts pyinfra connected to in this run (``State.activated_hosts``), failed ones included."""
    return {h.name for h in state.activated_hosts}


def is_active(state: State, host: Any) -> bool:
    """Whether ``host`` is still in the run: not failed (``State.active_hosts``). Not
    ``host in state.failed_hosts``: the deploy fails hosts through pyinfra's context proxies,
    which that set keeps and which cannot be compared outside the deploy's context."""
    return host in state.active_hosts


def operations_ran(state: State) -> bool:
    """Whether this run executed its operations (``State.current_stage`` reached Execute): not a
    ``--dry`` run, nor one that stopped at the confirmation prompt."""
    from pyinfra.api.state import StateStage

    return state.current_stage >= StateStage.Execute


def active_host_names(state: State) -> set[str]:
    """Hosts still in the run (``State.active_hosts``): reached and not failed."""
    return {h.name for h in state.active_hosts}


def failed_host_names(state: State) -> set[str]:
    """Hosts pyinfra failed in this run (``State.failed_hosts``): could not connect, or an
    operation or the deploy failed them."""
    return {h.name for h in state.failed_hosts}


def changed_operations(state: State, host: Any) -> int:
    """How many of ``host``'s operations ran to the end and changed something (``State.ops``)."""
    return sum(
        1
        for op_data in state.ops.get(host, {}).values()
        if op_data.operation_meta.is_complete() and op_data.operation_meta.did_change()
    )


def diff_enabled(state: State) -> bool:
    """pyinfra's ``--diff`` (``Config.DIFF``), which makes files operations print their diff."""
    return bool(getattr(state.config, "DIFF", False))


def set_diff(state: State, enabled: bool) -> None:
    state.config.DIFF = enabled


def _check_state() -> None:
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.operation import OperationMeta

    inventory = Inventory((["ws-check", "ws-other"], {}))  # type: ignore[no-untyped-call]
    state = State(inventory, Config())  # type: ignore[no-untyped-call]
    host, other = inventory.get_host("ws-check"), inventory.get_host("ws-other")
    assert state.activated_hosts == set() and state.active_hosts == set() and state.ops == {host: {}, other: {}}
    state.activate_host(host)
    assert reached_host_names(state) == active_host_names(state) == {"ws-check"} and is_active(state, host)
    state.activate_host(other)
    state.fail_hosts({other})  # type: ignore[no-untyped-call]
    assert failed_host_names(state) == {"ws-other"} and active_host_names(state) == {"ws-check"}
    assert changed_operations(state, host) == 0
    assert callable(OperationMeta.is_complete) and callable(OperationMeta.did_change)
    assert hasattr(Config(), "DIFF")  # type: ignore[no-untyped-call]


# --- the CLI's own errors and value parsing --------------------------------------------------


def cli_errors() -> tuple[Any, Any]:
    """``(CliError, UnexpectedExternalError)`` of pyinfra's CLI: the first is printed as its
    message alone (no traceback) with exit status 1; the second is what the CLI raises for an
    exception in a file it executes (an inventory), with ``.filename`` and ``.exception``."""
    from pyinfra_cli.exceptions import CliError, UnexpectedExternalError

    return CliError, UnexpectedExternalError


def _check_cli_errors() -> None:
    import click

    cli_error, external = cli_errors()
    assert issubclass(cli_error, click.ClickException) and cli_error("x").message == "x"
    try:
        raise ValueError("boom")
    except ValueError as exc:
        wrapped = external(exc, "inventory.py")
    assert wrapped.filename == "inventory.py" and isinstance(wrapped.exception, ValueError)


def parse_cli_value(value: str) -> Any:
    """A ``--data KEY=VALUE`` value as pyinfra's CLI reads it (``pyinfra_cli.util.parse_cli_arg``):
    ``true``/``false`` in any case, then an int, then JSON, else the string. Importing the CLI
    patches this process (gevent): call it only once the process is to run pyinfra."""
    from pyinfra_cli.util import parse_cli_arg

    return parse_cli_arg(value)


def _check_parse_cli_value() -> None:
    assert [parse_cli_value(v) for v in ("TRUE", "false", "7", '{"a": [1]}', "0.5", "x y")] == [
        True,
        False,
        7,
        {"a": [1]},
        0.5,
        "x y",
    ]


# An operation's privilege arguments (``_sudo=True`` ...). A python callback of the operation
# (``FunctionCommand``) does not inherit them, so its own commands get them handed over.
ELEVATION_ARGUMENTS = (
    "_sudo",
    "_sudo_user",
    "_use_sudo_login",
    "_sudo_password",
    "_preserve_sudo_env",
    "_su_user",
    "_use_su_login",
    "_preserve_su_env",
    "_su_shell",
    "_su_password",
    "_doas",
    "_doas_user",
    "_dzdo",
    "_dzdo_user",
)


def current_op_elevation(host: Any) -> dict[str, Any]:
    """The privilege arguments of the operation ``host`` is executing now, set ones only:
    pyinfra keeps the running operation's global arguments on ``Host.current_op_global_arguments``."""
    arguments = dict(getattr(host, "current_op_global_arguments", None) or {})
    return {k: arguments[k] for k in ELEVATION_ARGUMENTS if arguments.get(k)}


def _check_current_op_arguments() -> None:
    import importlib

    # The module, not the decorator that pyinfra.api re-exports under the same name.
    operation_module = importlib.import_module("pyinfra.api.operation")
    assert "host.current_op_global_arguments = global_arguments" in inspect.getsource(operation_module)
    assert "current_op_global_arguments" in inspect.get_annotations(host_class())
    assert set(ELEVATION_ARGUMENTS) <= connector_argument_keys()


# name -> a check that raises AssertionError (or ImportError/AttributeError) when a pyinfra
# release changed that internal.
INTERNALS: dict[str, Callable[[], None]] = {
    "pyinfra.api.facts._handle_fact_kwargs(state, host, cls, args, kwargs)": _check_handle_fact_kwargs,
    "pyinfra.api.host.Host.get_fact / run_shell_command / put_file / get_file": _check_host_methods,
    "pyinfra_cli.cli.connect_all / make_inventory (imported by name)": _check_cli_wraps,
    "connectors' data_meta and pyinfra.api.arguments.CONNECTOR_ARGUMENT_KEYS": _check_connector_keys,
    "pyinfra.context proxies' _get_module()": _check_context_proxy,
    "pyinfra.connectors.ssh.SSHConnector.client (a paramiko SSHClient)": _check_ssh_client,
    "pyinfra.operations.files.generate_color_diff (the --diff formatter, imported by name)": _check_file_diff,
    "host data _temp_dir -> the _temp_dir global argument -> files.put's upload temp file": _check_upload_dir,
    "pyinfra.api.host.Host.current_op_global_arguments (the running operation's arguments)": _check_current_op_arguments,
    "pyinfra_cli.inventory.make_inventory(inventory, cwd=, override_data=) under its own State": _check_load_inventory,
    "State.activated_hosts / active_hosts / failed_hosts / ops[host][...].operation_meta, Config.DIFF": _check_state,
    "pyinfra_cli.exceptions.CliError / UnexpectedExternalError(e, filename)": _check_cli_errors,
    "pyinfra_cli.util.parse_cli_arg (how the CLI reads a --data value)": _check_parse_cli_value,
    "pyinfra.api.arguments.all_global_arguments / pyinfra.api.util's stack and getframeinfo": (
        _check_operation_introspection
    ),
}
