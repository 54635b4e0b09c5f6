"""Extract the option strings of the REAL FreeToken parser (freetoken/server/args.py) with `ast`.

Writes REAL_FLAGS_<version>.txt beside this file: one line per add_argument call, in the real
order: the option strings, then `group=<name>` when the call is on a mutually exclusive group.
The engine stand-in's parser is tested against that list (tests/unit/test_standin_engine.py).

Usage (needs the real wheel, fetched once by hand, never at test time):
    pip download --no-deps freetoken==0.2.1 -d /tmp/ft && unzip -o -q /tmp/ft/*.whl -d /tmp/ft/x
    python3 extract_real_flags.py /tmp/ft/x/freetoken/server/args.py 0.2.1
"""

from __future__ import annotations

import ast
import os
import sys


def extract(source: str) -> list[str]:
    tree = ast.parse(source)
    groups: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "add_mutually_exclusive_group"
        ):
            groups.update(t.id for t in node.targets if isinstance(t, ast.Name))
    lines = []
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
    ]
    for call in sorted(calls, key=lambda c: (c.lineno, c.col_offset)):
        flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        owner = call.func.value
        line = " ".join(flags)
        if isinstance(owner, ast.Name) and owner.id in groups:
            line += f" group={owner.id}"
        lines.append(line)
    return lines


def main(argv: list[str]) -> int:
    path, version = argv
    with open(path, encoding="utf-8") as f:
        lines = extract(f.read())
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"REAL_FLAGS_{version}.txt")
    with open(out, "w") as f:
        f.write(f"# option strings of freetoken {version} freetoken/server/args.py, by extract_real_flags.py\n")
        f.write("\n".join(lines) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
