"""bench/suite_times.py: the test-time table from junit XML as pytest writes it."""

from __future__ import annotations

import subprocess
import sys

from bench import suite_times as test_times


def test_the_table_sums_each_module_from_pytests_own_junit_file(tmp_path):
    (tmp_path / "test_a.py").write_text(
        "import time\ndef test_one():\n    time.sleep(0.2)\ndef test_two():\n    pass\n"
    )
    xml = tmp_path / "run.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "test_a.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = test_times.times([str(xml)])
    ((name, (n, seconds)),) = rows.items()
    assert n == 2 and seconds >= 0.2
    assert test_times.part_of("tests.fleet.test_gateway") == "tests/fleet/test_gateway.py"
    assert test_times.part_of("tests.unit.test_plan") == "tests/unit/"
    assert test_times.duration(61.4) == "1 min 1 s" and test_times.duration(9.6) == "10 s"
    text = test_times.table({"tests/unit/": (3, 5.0), "tests/fleet/test_x.py": (1, 90.0)})
    assert text.splitlines()[2] == "| `tests/fleet/test_x.py` | 1 | 1 min 30 s |"
