#!/usr/bin/python3
"""Write one of the owner's Windows-side files (``.wslconfig``, a Desktop shortcut) as root,
run ON THE TARGET by root's python3 (standard library only), never through a link.

Under DrvFs every Linux account can create, replace and link files in the owner's profile
folder. The bytes come on stdin (base64, from the controller), never from a
path another user can write; ``hostio.write_below`` walks the folder from ``/`` with
``O_NOFOLLOW`` descriptors, creates a new file with a random name ``O_EXCL`` in it, syncs it and
renames it over the name: a link planted at the name is replaced, not followed.

    printf %s BASE64 | windows_file.py write PATH

Exit 0 (``PATH: written`` on stdout), 3 with one line on stderr when a folder on the way is a
link or not a folder, or the name cannot be replaced (a folder there), 2 for bad input.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import os
import sys
from typing import TYPE_CHECKING

HERE = os.path.dirname(os.path.abspath(__file__))
# The core modules: uploaded beside this script on the target, else the package of its checkout.
sys.path.insert(0, HERE if os.path.isfile(f"{HERE}/hostio.py") else os.path.dirname(os.path.dirname(HERE)))
if TYPE_CHECKING or sys.path[0] != HERE:  # the type checker, or a checkout
    from freetoken_infra.core import hostio
else:
    import hostio

REFUSED = 3
BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write", help="replace PATH by the bytes given base64 on stdin")
    write.add_argument("path")
    args = p.parse_args(argv)
    try:
        data = base64.b64decode(sys.stdin.buffer.read().strip(), validate=True)
    except (binascii.Error, ValueError):
        print(f"windows_file.py: {args.path}: the bytes on stdin are not base64; nothing written", file=sys.stderr)
        return BAD_INPUT
    try:
        hostio.write_below(args.path, data)
    except hostio.Refused as exc:
        print(f"windows_file.py: {exc}; root does not follow or replace it: nothing written", file=sys.stderr)
        return REFUSED
    except OSError as exc:
        print(f"windows_file.py: {args.path}: {exc.strerror}; nothing written", file=sys.stderr)
        return REFUSED
    print(f"{args.path}: written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
