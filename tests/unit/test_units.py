"""Every systemd unit and drop-in the deploy writes, rendered for representative settings and
compared byte for byte with the text pinned in ``tests/fixtures/units/`` (captured from the code
before units were declared as data, ``freetoken_infra/core/units.py``): a host already converged
must see no change, so no spurious restart, when only the way a unit is written changes.

A deliberate change to a unit regenerates the pins (``python -m tests.unit.test_units``) and the
diff of the fixtures shows what every host will get."""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Callable

import pytest

from freetoken_infra.core.launch import derive_plan
from freetoken_infra.core.settings import Settings
from freetoken_infra.core.units import (
    Comment,
    Section,
    UnitFile,
    managed_by,
    no_windows,
    render,
    unit_command,
    unit_word,
)
from operations import firewall, guard, model, node_exporter, owner, service

PINS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "units")

DEFAULT = Settings()
# Everything that adds, removes or escapes a line: a gated repository, an endpoint with a
# password, no API key, the model under /home, odd numbers, a bind on IPv6.
FULL = Settings(
    hub_token_file="/etc/freetoken/hub-token",
    hub_endpoint="https://user:pw@mirror.example/hub/",
    hub_disable_xet=False,
    api_key_source="none",
    model_dir="/home/models/qwen",
    cache_dir="/var/cache/freetoken-x",
    guard_interval_s=45,
    guard_swap_limit_gb=3.5,
    node_exporter_port=9200,
    start_timeout_s=600,
    listen_port=8100,
)
# Values the settings refuse but the units escape all the same: %, $, spaces, quotes.
ODD = Settings.model_construct(
    **{
        **Settings().model_dump(),
        "model_dir": "/srv/my models/100%$x",
        "cache_dir": '/srv/ca"che',
        "state_dir": "/srv/ft state",
        "model_repo": "org/Model $HOME",
        "hub_token_file": "/etc/hub token",
    }
)

UNITS: dict[str, Callable[[], str]] = {
    "engine-default": lambda: service.engine_unit(DEFAULT, derive_plan(DEFAULT, 16311, (12, 0))),
    "engine-full": lambda: service.engine_unit(FULL, derive_plan(FULL, 24000, (12, 0))),
    "engine-odd": lambda: service.engine_unit(ODD, derive_plan(ODD, 16311, (12, 0))),
    # wsl.conf's `[automount] root = /`: each drive at /c, /d ... is hidden from the engine.
    "engine-drives-at-root": lambda: service.engine_unit(DEFAULT, derive_plan(DEFAULT, 16311, (12, 0)), "/"),
    "firewall": firewall.unit,
    "guard-service-default": lambda: guard.guard_service_unit(DEFAULT),
    "guard-service-full": lambda: guard.guard_service_unit(FULL),
    "guard-timer-default": lambda: guard.guard_timer_unit(DEFAULT),
    "guard-timer-full": lambda: guard.guard_timer_unit(FULL),
    "fetch-default": lambda: model.fetch_unit(DEFAULT),
    "fetch-full": lambda: model.fetch_unit(FULL, ["http://10.213.0.9:8090", "http://[fd00::9]:8090"]),
    "fetch-odd": lambda: model.fetch_unit(ODD),
    "fetch-drives-elsewhere": lambda: model.fetch_unit(DEFAULT, (), "/windows/"),
    "cache-default": lambda: model.cache_unit(DEFAULT, "192.0.2.11"),
    "cache-full": lambda: model.cache_unit(FULL, "fd00::11"),
    "cache-odd": lambda: model.cache_unit(ODD, "192.0.2.11"),
    "agent-socket-default": lambda: owner.agent_socket_unit(DEFAULT),
    "agent-socket-full": lambda: owner.agent_socket_unit(FULL),
    "node-exporter-default": lambda: node_exporter.dropin(DEFAULT, "127.0.0.1"),
    "node-exporter-full": lambda: node_exporter.dropin(FULL, str(ipaddress.ip_address("fd00::5"))),
}


def pin_path(name: str) -> str:
    return os.path.join(PINS, f"{name}.txt")


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_text_is_byte_identical_to_its_pin(name):
    with open(pin_path(name), encoding="utf-8", newline="") as f:
        pinned = f.read()
    assert UNITS[name]() == pinned


def test_every_pin_is_a_unit_of_this_list():
    assert sorted(f.removesuffix(".txt") for f in os.listdir(PINS)) == sorted(UNITS)


def test_render_keeps_order_repeats_keys_and_resets_in_a_dropin():
    unit = UnitFile(
        header=managed_by("tests"),
        sections=(
            Section("Unit", (("Description", "x"),)),
            Section(
                "Service",
                (("ExecStart", ""), Comment("two\nlines"), ("ExecStartPre", "/a"), ("ExecStartPre", "/b")),
            ),
        ),
    )
    assert render(unit) == (
        "# Managed by freetoken-infra (tests); changes here are overwritten.\n"
        "[Unit]\nDescription=x\n\n"
        "[Service]\nExecStart=\n# two\n# lines\nExecStartPre=/a\nExecStartPre=/b\n"
    )


@pytest.mark.parametrize(
    "section",
    [
        Section("Service", (("ExecStart", "/bin/true\nExecStartPost=/bin/evil"),)),  # a line of its choosing
        Section("Service", (("User", "x\r"),)),
        Section("Service", (("Exec Start", "/bin/true"),)),
        Section("Service", (("ExecStart=/bin/evil\nUser", "root"),)),
        Section("Service]\n[Unit", ()),
    ],
)
def test_render_refuses_a_line_break_or_a_key_that_is_not_a_name(section):
    with pytest.raises(ValueError):
        render(UnitFile(header="h", sections=(section,)))


@pytest.mark.parametrize("root", ["/mnt/", "/", "/windows", "/mnt/drives/"])
def test_every_confined_unit_is_closed_off_from_windows(root):
    """The engine, the download, the LAN cache and the guard: no AF_VSOCK (the interop client's
    channel), WSL's socket folder and /init hidden, /mnt and the automount root an empty folder."""
    p = derive_plan(DEFAULT, 16311, (12, 0))
    for text in (
        service.engine_unit(DEFAULT, p, root),
        model.fetch_unit(DEFAULT, (), root),
        model.cache_unit(DEFAULT, "192.0.2.11", root),
        guard.guard_service_unit(DEFAULT, root),
    ):
        lines = text.splitlines()
        (families,) = [line for line in lines if line.startswith("RestrictAddressFamilies=")]
        assert "AF_VSOCK" not in families and "AF_UNIX" in families and "AF_INET" in families
        (hidden,) = [line for line in lines if line.startswith("InaccessiblePaths=")]
        assert {"-/run/WSL", "-/init"} <= set(hidden.split("=", 1)[1].split())
        (tmpfs,) = [line for line in lines if line.startswith("TemporaryFileSystem=")]
        mounts = tmpfs.split("=", 1)[1].split()
        assert "/mnt:ro" in mounts
        if root == "/":
            assert "-/c" in hidden.split("=", 1)[1].split()
        elif root == "/windows":
            assert "/windows:ro" in mounts


def test_an_automount_root_that_is_not_a_plain_path_is_refused():
    with pytest.raises(ValueError):
        no_windows("/mnt/a b")
    with pytest.raises(ValueError):
        no_windows("/x\nExecStartPre=/bin/evil")


def test_unit_words_are_escaped_for_systemd():
    assert unit_word("/srv/100%$x") == "/srv/100%%$$x"
    assert unit_word("/srv/100%$x", variables=False) == "/srv/100%%$x"
    assert unit_word("a b") == '"a b"' and unit_word('a"b') == '"a\\"b"' and unit_word(";") == "\\;"
    assert unit_command(["/usr/bin/$x", "$y", "a b"]) == '/usr/bin/$x $$y "a b"'


if __name__ == "__main__":  # regenerate the pins after a deliberate change
    for name, render in UNITS.items():
        with open(pin_path(name), "w", encoding="utf-8", newline="") as f:
            f.write(render())
        print(pin_path(name), file=sys.stderr)
