"""`freetoken` (freetoken_infra/cli.py): every subcommand is its module's own command line, the
dispatch reaches that module's main with the arguments, `doctor`/`deploy` start pyinfra as the
README runs it, and the shell completion knows every subcommand. Only the final call that would
start pyinfra or SSH is captured; the parsers and mains are the real ones."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken_infra import cli, enrolment
from freetoken_infra.core import wsl_ini
from freetoken_infra.rollout import pyinfra_executable

ROOT = Path(__file__).resolve().parents[2]
PIN = "SHA256:" + "A" * 43
COMMANDS = ["doctor", "deploy", "rollout", "fleet", "ledger", "dashboard", "enrol", "completion"]
FLEET_COMMANDS = ["drain", "ready", "status", "add", "remove"]
# A few options each help page must show, written out here so that a parser that lost them fails
# (the test also checks every option the module's own parser declares).
SAMPLE_OPTIONS = {
    ("doctor",): ["inventory", "PYINFRA_ARG"],
    ("deploy",): ["--ask", "inventory", "PYINFRA_ARG"],
    ("rollout",): ["--batches", "--canary", "--from", "--only", "--limit", "--data"],
    ("fleet",): ["--inventory", *FLEET_COMMANDS],
    ("fleet", "status"): ["--help"],
    ("fleet", "drain"): ["--wait", "hosts"],
    ("fleet", "ready"): ["hosts"],
    ("fleet", "add"): ["--host-key", "--class", "--port", "--user", "--ssh-key", "--known-hosts", "--skip-doctor"],
    ("fleet", "remove"): ["--wait", "--no-gateway"],
    ("ledger",): ["--prometheus", "--since", "--until", "--step", "--host", "--token-file", "--json", "--csv"],
    ("dashboard",): ["--prometheus", "--since", "--until", "--host", "--dashboard", "--out", "--token-file"],
    ("enrol",): ["--key", "--key-file", "--allow", "--name", "--port", "--bundle"],
    ("completion",): ["bash", "zsh", "tcsh"],
}


class Started(Exception):
    """Raised by the stand-in for the exec: pyinfra would have started here."""


@pytest.fixture
def started(monkeypatch):
    calls: list[tuple[list[str], Path]] = []

    def fake_exec(argv, cwd):
        calls.append((list(argv), cwd))
        raise Started

    monkeypatch.setattr(cli, "exec_pyinfra", fake_exec)
    return calls


def run(argv, capsys) -> tuple[int, str, str]:
    try:
        status = cli.main(argv)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return status, out, err


def own_parser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    """The parser the subcommand's module builds itself (not the one cli copies for --help)."""
    command = {c.name: c for c in cli.COMMANDS}[path[0]]
    parser = command.load().build_parser(f"freetoken {path[0]}")
    for name in path[1:]:
        [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[name]
    return parser


# --------------------------------------------------------------------------- help
def test_the_subcommands_are_the_operators_commands():
    assert [c.name for c in cli.COMMANDS] == COMMANDS
    assert set(SAMPLE_OPTIONS) == {(name,) for name in COMMANDS} | {("fleet", n) for n in FLEET_COMMANDS}


def test_the_top_level_help_lists_every_subcommand(capsys):
    status, out, _ = run(["--help"], capsys)
    assert status == 0
    assert out.startswith("usage: freetoken ")
    for name in COMMANDS:
        assert f"\n    {name}" in out, name


@pytest.mark.parametrize("path", sorted(SAMPLE_OPTIONS), ids=" ".join)
def test_every_subcommand_help_exits_0_and_names_its_options(path, capsys):
    status, out, err = run([*path, "--help"], capsys)
    assert status == 0, err
    assert out.startswith(f"usage: freetoken {' '.join(path)} "), out
    declared = []
    for action in own_parser(path)._actions:
        if isinstance(action, argparse._SubParsersAction):
            declared += list(action.choices)
        elif action.option_strings:
            declared += action.option_strings
        else:
            declared.append(action.metavar or action.dest)
    assert set(SAMPLE_OPTIONS[path]) <= set(declared) | {"bash", "zsh", "tcsh"}
    for option in [*declared, *SAMPLE_OPTIONS[path]]:
        assert option in out, f"freetoken {' '.join(path)} --help does not name {option}:\n{out}"


def test_a_bad_subcommand_is_refused_naming_the_commands(capsys):
    status, _, err = run(["deplyo", "inventories/home.py"], capsys)
    assert status == 2
    assert "invalid choice: 'deplyo'" in err and "'deploy'" in err


# --------------------------------------------------------------------------- doctor, deploy
def test_deploy_runs_pyinfra_as_the_readme_does_from_any_folder(started, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # not the checkout: the inventory is found in the project
    with pytest.raises(Started):
        cli.main(["deploy", "inventories/home.py", "--limit", "ws1", "--data", "model_reverify=true"])
    [(argv, cwd)] = started
    assert argv == [
        pyinfra_executable(),
        "-y",
        "inventories/home.py",
        "deploys/freetoken.py",
        "--limit",
        "ws1",
        "--data",
        "model_reverify=true",
    ]
    assert argv[0] == str(Path(sys.executable).with_name("pyinfra"))  # the venv's, beside this Python
    assert cwd == ROOT == enrolment.REPO
    assert "pyinfra -y inventories/home.py deploys/freetoken.py --limit ws1" in capsys.readouterr().err


def test_doctor_runs_the_doctor_deploy_file(started, capsys):
    with pytest.raises(Started):
        cli.main(["doctor", "inventories/fleet.py", "--limit", "lab-ws01"])
    assert started == [
        ([pyinfra_executable(), "-y", "inventories/fleet.py", "deploys/doctor.py", "--limit", "lab-ws01"], ROOT)
    ]


@pytest.mark.parametrize(
    "argv",
    [["deploy", "--ask", "inventories/home.py"], ["deploy", "inventories/home.py", "--dry", "--diff"]],
    ids=["--ask", "--dry"],
)
def test_a_deploy_that_asks_or_is_dry_leaves_out_y(argv, started, capsys):
    """pyinfra's -y skips change detection: a dry run or one that asks first must not have it."""
    with pytest.raises(Started):
        cli.main(argv)
    [(command, _)] = started
    assert "-y" not in command
    assert command[1:3] == ["inventories/home.py", "deploys/freetoken.py"]


def test_an_inventory_outside_the_project_is_passed_by_its_full_path(started, capsys, monkeypatch, tmp_path):
    (tmp_path / "mine.py").write_text("hosts = ['@local']\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Started):
        cli.main(["deploy", "mine.py", "--", "--limit", "ws1"])
    [(command, cwd)] = started
    assert command[2:] == [str(tmp_path.resolve() / "mine.py"), "deploys/freetoken.py", "--limit", "ws1"]
    assert cwd == ROOT


def test_pyinfras_own_inventory_forms_pass_as_they_are(started, capsys):
    with pytest.raises(Started):
        cli.main(["doctor", "@local"])
    assert started[0][0][2] == "@local"


def test_a_missing_inventory_file_is_named_and_nothing_starts(started, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    status, _, err = run(["deploy", "inventories/flet.py"], capsys)
    assert status == 2 and started == []
    assert "freetoken deploy: inventory 'inventories/flet.py': no such file here" in err
    assert str(ROOT) in err


def test_the_doctor_has_no_ask_option(started, capsys):
    status, _, err = run(["doctor", "--ask", "inventories/home.py"], capsys)
    assert status == 2 and started == []
    assert "unrecognized arguments: --ask" in err


# --------------------------------------------------------------------------- rollout, fleet, enrol
def test_rollout_reaches_the_rollouts_main_with_its_arguments(capsys):
    """Its own check of --only without --from answers: the arguments got there, parsed."""
    status, _, err = run(["rollout", "inventories/fleet.py", "--only", "parked"], capsys)
    assert status == 2
    assert err.strip() == "rollout: --only needs --from REPORT (the rollout report whose hosts to catch up)"


def test_fleet_add_and_remove_reach_the_fleets_main_with_their_arguments(capsys, monkeypatch, tmp_path):
    inventory = tmp_path / "fleet.py"
    inventory.write_text("hosts = [\n    ('ws1', {'ssh_hostname': '192.0.2.11'}),\n]\n")
    logins = []
    monkeypatch.setattr(enrolment, "check_reachable", lambda host: logins.append(host))  # the SSH login
    status, out, err = run(
        ["fleet", "-i", str(inventory), "add", "ws7", "192.0.2.17", "--host-key", PIN, "--port", "2200"]
        + ["--user", "alice", "--skip-doctor"],
        capsys,
    )
    assert status == 0, err
    [host] = logins
    assert (host.name, host.address, host.port, host.user, host.host_key) == ("ws7", "192.0.2.17", 2200, "alice", PIN)
    assert enrolment.hosts_in(inventory.read_text()) == {"ws1": "hosts", "ws7": "hosts"}
    assert "ws7: added to" in out

    status, out, err = run(["fleet", "-i", str(inventory), "remove", "ws7", "--no-gateway"], capsys)
    assert status == 0, err
    assert enrolment.hosts_in(inventory.read_text()) == {"ws1": "hosts"}


def test_fleet_errors_are_the_fleets_own(capsys, tmp_path):
    status, _, err = run(["fleet", "-i", str(tmp_path / "none.py"), "remove", "ws7", "--no-gateway"], capsys)
    assert status == 1
    assert err.strip() == f"fleet remove: {tmp_path / 'none.py'}: no such inventory file"


def test_enrol_bundle_prints_the_one_file_enrol_script(capsys):
    status, out, err = run(["enrol", "--bundle"], capsys)
    assert status == 0, err
    compile(out, "enrol.py", "exec")
    assert out.startswith("#!/usr/bin/env python3\n")
    assert f"_BUNDLED_WSL_INI: str | None = {Path(wsl_ini.__file__).read_text()!r}" in out


# --------------------------------------------------------------------------- one registration
class Tally:
    """A subcommand as another module would offer it."""

    calls: list = []

    @staticmethod
    def build_parser(prog):
        ap = argparse.ArgumentParser(prog=prog, description="Demo tally.")
        ap.add_argument("--month")
        return ap

    @staticmethod
    def main(argv, *, prog):
        Tally.calls.append((Tally.build_parser(prog).parse_args(argv).month, prog))
        return 7


def test_a_new_subcommand_is_one_registration(capsys, monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, cli.Command("tally", lambda: Tally)])
    assert run(["tally", "--month", "2026-12"], capsys)[0] == 7
    assert Tally.calls == [("2026-12", "freetoken tally")]
    assert "tally     Demo tally." in run(["--help"], capsys)[1]
    assert "--month" in run(["tally", "--help"], capsys)[1]
    assert "tally" in run(["completion", "bash"], capsys)[1].split("_shtab_freetoken_subparsers=(")[1].split(")")[0]


# --------------------------------------------------------------------------- the installed forms
@pytest.mark.parametrize("name", ["fleet", "rollout"])
def test_the_python_m_forms_still_work(name):
    result = subprocess.run(
        [sys.executable, "-m", f"freetoken_infra.{name}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: python -m freetoken_infra.{name} ")


def test_the_installed_console_script_runs_from_any_folder(tmp_path):
    script = Path(sys.executable).with_name("freetoken")
    result = subprocess.run([str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: freetoken ")
    assert all(f"\n    {name}" in result.stdout for name in COMMANDS)
    result = subprocess.run(
        [str(script), "fleet", "add", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "--host-key" in result.stdout, result.stderr


# --------------------------------------------------------------------------- completion
def bash_complete(script: str, words: list[str], cwd: Path = ROOT) -> list[str]:
    """What bash offers for the last of ``words`` with the completion script loaded."""
    program = (
        'source /dev/stdin; COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); '
        '_shtab_freetoken; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    result = subprocess.run(
        ["bash", "-c", program, "bash", *words], input=script, cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if line]


def test_the_bash_completion_knows_every_subcommand(capsys):
    status, script, err = run(["completion", "bash"], capsys)
    assert status == 0, err
    subprocess.run(["bash", "-n"], input=script, text=True, check=True, timeout=60)
    assert "complete -o bashdefault -F _shtab_freetoken freetoken" in script
    assert bash_complete(script, ["freetoken", ""]) == COMMANDS
    assert bash_complete(script, ["freetoken", "fl"]) == ["fleet"]
    assert bash_complete(script, ["freetoken", "fleet", ""]) == FLEET_COMMANDS
    assert bash_complete(script, ["freetoken", "fleet", "add", "--h"]) == ["--help", "--host-key"]
    assert "--batches" in bash_complete(script, ["freetoken", "rollout", "--"])
    # An inventory completes as a file name.
    assert bash_complete(script, ["freetoken", "deploy", "inventories/ho"]) == ["inventories/home.py"]


@pytest.mark.parametrize("shell", ["zsh", "tcsh"])
def test_the_other_shells_completion_names_every_subcommand(shell, capsys):
    status, script, err = run(["completion", shell], capsys)
    assert status == 0, err
    for name in [*COMMANDS, *FLEET_COMMANDS]:
        assert name in script, f"{shell}: {name}"
