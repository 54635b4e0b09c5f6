"""Bad input is refused before any change.

Each case runs the real `pyinfra INVENTORY deploys/X.py` (config.py applies, as in the README's
commands) against an inventory whose one host is a loopback listener counting connections, and
expects: exit status 1, one line naming the file or the field, no traceback, no
pyinfra-debug.log, and no connection.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.unit.test_settings_before_connect import ROOT, inventory, listener, pyinfra  # noqa: F401

DEBUG_LOG = ROOT / "pyinfra-debug.log"


def refused(run, *expected: str) -> str:
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "Traceback" not in out and "internal exception" not in out.lower(), out
    assert not DEBUG_LOG.exists(), "pyinfra wrote its debug log"
    for text in expected:
        assert text in out, out
    return out


@pytest.fixture(autouse=True)
def no_debug_log_before():
    assert not DEBUG_LOG.exists(), "remove the stale pyinfra-debug.log first"
    yield
    if DEBUG_LOG.exists():
        DEBUG_LOG.unlink()


def test_a_missing_inventory_file_is_refused(tmp_path):
    missing = tmp_path / "inventories" / "fleet.py"
    run = pyinfra(str(missing), "deploys/freetoken.py")
    refused(run, f"inventory file {missing}: not found")


def test_an_inventory_without_hosts_is_refused(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("hosts = []\n")
    refused(pyinfra(str(empty), "deploys/doctor.py"), f"inventory {empty}: no hosts")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("listen_port = = 8000\n", ":1: syntax error: invalid syntax"),
        ("import os\nlisten_port = int(os.environ['FREETOKEN_NO_SUCH_VAR'])\n", ": KeyError: 'FREETOKEN_NO_SUCH_VAR'"),
        ("listen_port = 1 / 0\n", ": ZeroDivisionError: division by zero"),
    ],
    ids=["syntax", "keyerror", "zerodivision"],
)
def test_a_broken_group_data_file_is_named_in_one_line(tmp_path, listener, text, expected):
    inv = inventory(tmp_path, listener.port, group_all=text)
    out = refused(pyinfra(str(inv), "deploys/freetoken.py"))
    name = str(tmp_path / "group_data" / "all.py")
    lines = [line for line in out.splitlines() if name in line]
    assert len(lines) == 1 and expected in lines[0], out
    assert listener.connections == 0


def test_a_broken_inventory_file_is_named_in_one_line(tmp_path):
    inv = tmp_path / "inventory.py"
    inv.write_text("hosts = [\n")
    refused(pyinfra(str(inv), "deploys/doctor.py"), f"{inv}:1: syntax error")


@pytest.mark.parametrize("value", ["1e309", "inf", "nan"])
def test_a_swap_limit_that_is_not_finite_is_refused(tmp_path, listener, value):
    inv = inventory(tmp_path, listener.port)
    refused(
        pyinfra("--data", f"guard_swap_limit_gb={value}", str(inv), "deploys/freetoken.py"),
        "setting 'guard_swap_limit_gb'",
        "finite number",
    )
    assert listener.connections == 0


def test_an_api_key_file_missing_on_the_controller_is_refused(tmp_path, listener):
    inv = inventory(tmp_path, listener.port)
    missing = tmp_path / "keys" / "freetoken.key"
    refused(
        pyinfra("--data", f"api_key_source=file:{missing}", str(inv), "deploys/freetoken.py"),
        "setting 'api_key_source' = 'file:",
        "is invalid: the file does not exist on the controller",
    )
    assert listener.connections == 0


def test_an_unset_api_key_variable_is_refused(tmp_path, listener):
    inv = inventory(tmp_path, listener.port)
    assert "FREETOKEN_TEST_UNSET_KEY" not in os.environ
    run = pyinfra("--data", "api_key_source=env:FREETOKEN_TEST_UNSET_KEY", str(inv), "deploys/freetoken.py")
    refused(run, "the variable FREETOKEN_TEST_UNSET_KEY is not set on the controller")
    assert listener.connections == 0


def test_controller_key_checks_never_show_the_key(tmp_path, monkeypatch):
    from freetoken_infra.core.settings import controller_key_problem

    key = tmp_path / "key"
    key.write_text("sk-secret-0123\n")
    assert controller_key_problem(f"file:{key}") is None
    key.write_text("sk-secret-0123\nsecond line\n")
    problem = controller_key_problem(f"file:{key}")
    assert problem and "sk-secret" not in problem
    key.write_text("")
    assert controller_key_problem(f"file:{key}") == "it gives an empty or multi-line key"
    monkeypatch.setenv("FREETOKEN_TEST_KEY", "  ")
    assert controller_key_problem("env:FREETOKEN_TEST_KEY") == "it gives an empty or multi-line key"
    monkeypatch.setenv("FREETOKEN_TEST_KEY", "sk-secret")
    assert controller_key_problem("env:FREETOKEN_TEST_KEY") is None
    assert controller_key_problem("generate") is None and controller_key_problem("none") is None
    assert Path(key).exists()
