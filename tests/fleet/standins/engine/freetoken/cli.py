"""STAND-IN for freetoken/cli.py: the `ft` console script (only `serve` runs; other commands are named)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

HELP = """usage: ft <command> [args]

Commands:
  serve       Start the FreeToken API server
  shell       Chat with a FreeToken server in the terminal
  ctl         Query and manage a running FreeToken server
  daemon      Run the FreeToken supervisor (persistent engine service)
  launch      Configure and launch an agent against a FreeToken server
  checkpoint  Convert an HF safetensors checkpoint to FTW
  bench       Run a micro-benchmark (e.g. "bench bw" = CPU vs PCIe bandwidth)

Use "ft <command> --help" for command-specific options.
Use "ft --version" to print the FreeToken version."""

COMMANDS = ("serve", "shell", "ctl", "daemon", "launch", "checkpoint", "bench")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(HELP, file=sys.stderr)
        return 2
    if args[0] in {"-h", "--help"}:
        print(HELP)
        return 0
    if args[0] in {"-V", "--version"}:
        from .version import __version__

        print(f"freetoken version {__version__}")
        return 0
    if args[0] not in COMMANDS:
        print(f"unknown ft command: {args[0]}", file=sys.stderr)
        print(HELP, file=sys.stderr)
        return 2
    if args[0] != "serve":
        print(f"ft {args[0]}: not available in the FreeToken stand-in", file=sys.stderr)
        return 2
    from .server import launch_server

    launch_server(argv=args[1:], prog="ft serve")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
