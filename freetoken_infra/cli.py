"""`freetoken`: the operator's commands under one name, with shell completion (docs/cli.md).

    freetoken doctor INVENTORY [PYINFRA_ARG ...]          pyinfra -y INVENTORY deploys/doctor.py ...
    freetoken deploy [--ask] INVENTORY [PYINFRA_ARG ...]  pyinfra -y INVENTORY deploys/freetoken.py ...
    freetoken rollout INVENTORY [...]                     python -m freetoken_infra.rollout ...
    freetoken fleet [-i INVENTORY] status|drain|ready|add|remove ...   python -m freetoken_infra.fleet ...
    freetoken enrol [--bundle | --key ... --allow ...]    python3 operations/scripts/enrol.py ...
    freetoken completion bash|zsh|tcsh|...                the shell's completion script

Each subcommand is its module's own command line: the module's ``build_parser(prog)`` and
``main(argv, prog=...)``, so every option is declared once and the ``python -m`` forms stay as
they are. A new subcommand is one ``Command`` in ``COMMANDS``.

`doctor` and `deploy` become pyinfra (exec: its output, Ctrl-C and exit status are the
operator's, as when run by hand), started in the project's folder as the README asks (pyinfra
reads config.py, deploys/ and group_data/ from there), so they work from any folder.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol, cast

from freetoken_infra.core.redact import redact_command
from freetoken_infra.enrolment import REPO

PROG = "freetoken"
# The PC owner's enrolment script (standard library only, run on the PC as root); `--bundle`
# prints the one file the operator hands out (docs/enrol.md).
ENROL_SCRIPT = REPO / "operations" / "scripts" / "enrol.py"


class Subcommand(Protocol):
    """What a subcommand's module offers: its parser, and its entry point that parses ``argv``
    with that parser (named ``prog`` in usage and errors) and returns the exit status."""

    def build_parser(self, prog: str) -> argparse.ArgumentParser: ...

    def main(self, argv: list[str], *, prog: str) -> int: ...


@dataclass(frozen=True)
class Command:
    name: str
    load: Callable[[], Subcommand]  # imported only when used: `freetoken deploy` loads no rollout
    help: str | None = None  # the line in `freetoken --help` (default: the parser's description)


class CliError(Exception):
    """One line: what is wrong and what to do."""


def module(name: str) -> Callable[[], Subcommand]:
    """A package module with ``build_parser`` and ``main``, imported when the command runs."""
    return lambda: cast(Subcommand, importlib.import_module(name))


# --------------------------------------------------------------------------- doctor, deploy
def resolve_inventory(given: str) -> str:
    """The inventory as pyinfra gets it when it runs in the project's folder: a file here (the
    folder the operator is in), else in the project; under the project, relative to it. pyinfra's
    own forms (``@local``, ``host1,host2``) pass as they are; a path that names no file is refused."""
    path = Path(given).expanduser()
    for candidate in (path, REPO / path):
        if candidate.is_file():
            found = candidate.resolve()
            return str(found.relative_to(REPO)) if found.is_relative_to(REPO) else str(found)
    if given.endswith(".py") or "/" in given:
        raise CliError(f"inventory {given!r}: no such file here ({Path.cwd()}) or in the project ({REPO})")
    return given


def exec_pyinfra(argv: list[str], cwd: Path) -> NoReturn:
    """Become pyinfra, in ``cwd``."""
    os.chdir(cwd)
    os.execvp(argv[0], argv)


@dataclass(frozen=True)
class PyinfraRun:
    """``pyinfra -y INVENTORY DEPLOY_FILE [PYINFRA_ARG ...]``, as the README runs it."""

    deploy_file: str  # relative to the project
    description: str
    can_ask: bool  # a deploy can let pyinfra show its changes and ask first; the doctor changes nothing

    def build_parser(self, prog: str) -> argparse.ArgumentParser:
        ap = argparse.ArgumentParser(
            prog=prog,
            description=self.description,
            allow_abbrev=False,  # a pyinfra option must never be read as an abbreviation of ours
            epilog=f"Runs `pyinfra -y INVENTORY {self.deploy_file} PYINFRA_ARG...` in the project's folder "
            f"({REPO}). Options of freetoken go before INVENTORY; everything after it is pyinfra's.",
        )
        if self.can_ask:
            ap.add_argument(
                "--ask",
                action="store_true",
                help="leave out -y: pyinfra detects the changes, shows them and asks before it makes them "
                "(a run with pyinfra's --dry leaves out -y too: -y would skip the detection)",
            )
        ap.add_argument(
            "inventory",
            help="pyinfra inventory: a file here or in the project (inventories/home.py, inventories/fleet.py), "
            "or pyinfra's own @local",
        )
        ap.add_argument(
            "pyinfra_args",
            nargs=argparse.REMAINDER,
            metavar="PYINFRA_ARG",
            help="passed to pyinfra as they are, e.g. --limit ws1, --data model_reverify=true, --dry --diff",
        )
        return ap

    def main(self, argv: list[str], *, prog: str) -> int:
        args = self.build_parser(prog).parse_args(argv)
        extra = list(args.pyinfra_args)
        if extra[:1] == ["--"]:
            extra = extra[1:]
        deploy = REPO / self.deploy_file
        try:
            if not deploy.is_file():
                raise CliError(
                    f"{self.deploy_file} is not in {REPO}: freetoken runs from a checkout of the project, "
                    "installed with `pip install -e .`"
                )
            inventory = resolve_inventory(args.inventory)
        except CliError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
        from freetoken_infra.rollout import pyinfra_executable  # the same pyinfra the rollout runs

        ask = getattr(args, "ask", False) or "--dry" in extra
        command = [pyinfra_executable(), *([] if ask else ["-y"]), inventory, self.deploy_file, *extra]
        print(f"--> {redact_command(command)}   (in {REPO})", file=sys.stderr, flush=True)
        exec_pyinfra(command, REPO)


DOCTOR = PyinfraRun(
    "deploys/doctor.py",
    "Read-only preflight: every check on every host, with its evidence and remedy; changes nothing.",
    can_ask=False,
)
DEPLOY = PyinfraRun(
    "deploys/freetoken.py",
    "Converge the hosts (preflight, CUDA, engine, model, service, health gate); a second run changes nothing.",
    can_ask=True,
)


# --------------------------------------------------------------------------- enrol
def enrol_script() -> Subcommand:
    """operations/scripts/enrol.py, loaded from the project (it is a host-side script, not part of
    the installed package)."""
    name = "freetoken_enrol_script"
    if name in sys.modules:
        return cast(Subcommand, sys.modules[name])
    spec = importlib.util.spec_from_file_location(name, ENROL_SCRIPT)
    if spec is None or spec.loader is None or not ENROL_SCRIPT.is_file():
        raise CliError(f"{ENROL_SCRIPT}: not found; freetoken runs from a checkout of the project")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # its dataclasses look their module up by name
    spec.loader.exec_module(loaded)
    return cast(Subcommand, loaded)


# --------------------------------------------------------------------------- completion
class Completion:
    """`freetoken completion SHELL`: the completion script shtab makes from the parsers."""

    @staticmethod
    def build_parser(prog: str) -> argparse.ArgumentParser:
        import shtab

        ap = argparse.ArgumentParser(
            prog=prog,
            description="Print the shell completion script of freetoken (docs/cli.md says where to put it).",
        )
        ap.add_argument("shell", choices=shtab.SUPPORTED_SHELLS)
        return ap

    @staticmethod
    def main(argv: list[str], *, prog: str) -> int:
        import shtab

        args = Completion.build_parser(prog).parse_args(argv)
        parser = build_parser()
        for each in parsers(parser):
            for action in each._actions:
                if action.dest == "inventory":  # an inventory is a file: complete file names
                    action.complete = shtab.FILE  # type: ignore[attr-defined]
        sys.stdout.write(shtab.complete(parser, shell=args.shell))
        return 0


def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser below it."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += parsers(child)
    return found


# --------------------------------------------------------------------------- the command line
COMMANDS: list[Command] = [
    Command("doctor", lambda: DOCTOR),
    Command("deploy", lambda: DEPLOY),
    Command("rollout", module("freetoken_infra.rollout")),
    Command("fleet", module("freetoken_infra.fleet")),
    Command("ledger", module("freetoken_infra.ledger")),
    Command("dashboard", module("freetoken_infra.dashboard")),
    Command(
        "enrol",
        enrol_script,
        help="Make a PC's WSL distro a fleet host (on the PC, as root); --bundle prints the one-file enrol.py "
        "to hand out",
    ),
    Command("completion", lambda: Completion),
]


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's own parser under one: for `freetoken --help` and the completion script."""
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="The operator's commands for a freetoken-infra fleet. `freetoken COMMAND --help` for each.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        own = command.load().build_parser(f"{PROG} {command.name}")
        sub.add_parser(
            command.name,
            parents=[own],
            add_help=False,  # own's -h is copied with its options
            help=command.help or own.description,
            description=own.description,
            epilog=own.epilog,
        )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # facts/ and operations/ are the checkout's packages, not installed (pyproject.toml says why):
    # put the project on the path, as `python -m` and pyinfra's CLI do with the folder they run in.
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    by_name = {command.name: command for command in COMMANDS}
    try:
        if not argv or argv[0] not in by_name:
            build_parser().parse_args(argv)  # --help, or the error that lists the commands
            return 2
        command = by_name[argv[0]]
        return command.load().main(argv[1:], prog=f"{PROG} {command.name}")
    except CliError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
