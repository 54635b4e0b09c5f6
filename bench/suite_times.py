"""The test-time table of docs/testing.md, from the junit XML files of a test run.

`bash tests/run.sh` writes one file per pytest run (the fleet tests and the others) and prints
this table at its end; run it by hand on kept files:

    python bench/suite_times.py FLEET.xml OTHERS.xml

Each row is a test module (tests/unit/ and tests/contract/ as one row each), its number of tests
and the time pytest recorded for them (setup, call and teardown: junit's `time`), the slowest
first. Figures, not assertions: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def part_of(classname: str) -> str:
    """The row a test belongs to: its module under tests/fleet/, else its folder."""
    parts = classname.split(".")
    if parts[:2] == ["tests", "fleet"] and len(parts) > 2:
        return f"tests/fleet/{parts[2]}.py"
    if len(parts) > 1 and parts[0] == "tests":
        return f"tests/{parts[1]}/"
    return classname


def times(paths: list[str]) -> dict[str, tuple[int, float]]:
    """Row -> (tests, seconds), over every testcase of the files."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            row = rows[part_of(case.get("classname") or "")]
            row[0] += 1
            row[1] += float(case.get("time") or 0.0)
    return {name: (int(n), seconds) for name, (n, seconds) in rows.items()}


def duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def table(rows: dict[str, tuple[int, float]]) -> str:
    lines = ["| part | tests | time |", "|---|---|---|"]
    for name, (n, seconds) in sorted(rows.items(), key=lambda item: -item[1][1]):
        lines.append(f"| `{name}` | {n} | {duration(seconds)} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("junit", nargs="+", help="junit XML files of pytest runs (--junitxml)")
    print(table(times(ap.parse_args(argv).junit)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
