"""STAND-IN for freetoken.server: launch_server parses the real command line, then runs the stand-in."""

from __future__ import annotations

import sys


def launch_server(run_shell: bool = False, argv: list[str] | None = None, prog: str | None = None) -> None:
    from ..standin import serve
    from .args import parse_args

    args = parse_args(sys.argv[1:] if argv is None else argv, prog=prog)
    serve(args)


__all__ = ["launch_server"]
