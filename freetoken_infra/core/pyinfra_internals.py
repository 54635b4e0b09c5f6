"""Every pyinfra internal we rely on, touched here and nowhere else.

pyinfra's public API has no hook for three things we need: reading many facts in one round
trip (facts/batch.py: how pyinfra normalises a fact call, and the Host methods that run
something), validating settings before the CLI connects (config.py: the CLI's connect
step), and telling pyinfra's own host data keys from ours (settings: the connectors'
``data_meta``). Each is named in ``INTERNALS``; tests/unit/test_pyinfra_internals.py checks
every one against the installed pyinfra and fails naming the internal when a release changes
it. pyproject.toml allows only the pyinfra releases those tests passed on.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from pyinfra.api.host import Host
    from pyinfra.api.state import State

# Host methods through which an operation runs something on the host (a fact read also uses
# run_shell_command, which the batch tells apart itself).
HOST_METHODS_THAT_RUN = ("run_shell_command", "put_file", "get_file")


def handle_fact_kwargs(state: State, host: Host, cls: type, args: list[Any],
                       kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(fact kwargs, global kwargs)`` of a ``get_fact`` call, normalised as pyinfra does
    (``pyinfra.api.facts._handle_fact_kwargs``)."""
    from pyinfra.api.facts import _handle_fact_kwargs

    result: tuple[dict[str, Any], dict[str, Any]] = _handle_fact_kwargs(state, host, cls, args, kwargs)
    return result


def connector_argument_keys() -> frozenset[str]:
    """The global arguments that are connector arguments (``_sudo``, ``_env``, ...)."""
    from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS

    return frozenset(CONNECTOR_ARGUMENT_KEYS)


def connector_data_keys() -> set[str]:
    """Host data keys pyinfra's connectors read (``ssh_user``, ...): not our settings."""
    from pyinfra.api.connectors import get_all_connectors

    keys: set[str] = set()
    for connector in get_all_connectors().values():  # type: ignore[no-untyped-call]
        keys.update(getattr(connector, "data_meta", {}) or {})
    return keys


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


def wrap_cli_connect(make: Callable[[Callable[[State], Any]], Callable[[State], Any]],
                     marker: str) -> bool:
    """Replace the CLI's ``connect_all`` (``pyinfra_cli.cli`` imports it by name) with
    ``make(connect_all)``, once per process (``marker``: an attribute ``make`` sets on its
    result). False when this pyinfra's CLI has no such name to wrap."""
    import pyinfra.api.connect
    import pyinfra_cli.cli

    current = getattr(pyinfra_cli.cli, "connect_all", None)
    if getattr(current, marker, False):
        return True
    if current is not pyinfra.api.connect.connect_all:
        return False
    pyinfra_cli.cli.connect_all = make(current)
    return True


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


def _check_cli_connect_all() -> None:
    import pyinfra.api.connect
    import pyinfra_cli.cli

    assert hasattr(pyinfra_cli.cli, "connect_all")
    assert _params(pyinfra.api.connect.connect_all) == ["state"]


def _check_connector_keys() -> None:
    assert {"ssh_user", "ssh_port"} <= connector_data_keys()
    assert {"_sudo", "_env", "_sudo_password"} <= connector_argument_keys()


def _check_context_proxy() -> None:
    from pyinfra import context

    assert callable(getattr(context.host, "_get_module", None))


# name -> a check that raises AssertionError (or ImportError/AttributeError) when a pyinfra
# release changed that internal.
INTERNALS: dict[str, Callable[[], None]] = {
    "pyinfra.api.facts._handle_fact_kwargs(state, host, cls, args, kwargs)": _check_handle_fact_kwargs,
    "pyinfra.api.host.Host.get_fact / run_shell_command / put_file / get_file": _check_host_methods,
    "pyinfra_cli.cli.connect_all (imported by name from pyinfra.api.connect)": _check_cli_connect_all,
    "connectors' data_meta and pyinfra.api.arguments.CONNECTOR_ARGUMENT_KEYS": _check_connector_keys,
    "pyinfra.context proxies' _get_module()": _check_context_proxy,
}
