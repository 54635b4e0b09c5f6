"""The doctor and the main command on a machine that is not a WSL2 GPU workstation
(CI's): both print findings naming WSL and the GPU, exit non-zero, never show a
traceback, and change nothing."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
WATCHED = ["/etc", "/opt", "/var/lib", "/usr/local/bin", "/usr/local/cuda-13.0/bin"]

pytestmark = pytest.mark.skipif(
    "microsoft" in Path("/proc/version").read_text().lower(),
    reason="runs on a machine that is NOT WSL (CI); on a workstation use the doctor itself",
)


def snapshot() -> str:
    """Names, sizes and mtimes of everything under the watched trees, plus packages."""
    digest = hashlib.sha256()
    for top in WATCHED:
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for name in sorted(filenames) + dirnames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_mode}\n".encode())
    dpkg = subprocess.run(["dpkg-query", "-W"], capture_output=True, text=True)
    digest.update(dpkg.stdout.encode())
    return digest.hexdigest()


@pytest.mark.parametrize(
    "argv",
    [["@local", "deploys/doctor.py"], ["inventories/home.py", "deploys/freetoken.py"]],
    ids=["doctor", "main-command"],
)
def test_refuses_a_machine_that_is_not_a_wsl2_workstation(argv):
    before = snapshot()
    run = subprocess.run(
        [PYINFRA, *argv], cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300
    )
    after = snapshot()
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "Traceback" not in out
    for check in ("wsl2", "wsl_version", "gpu"):
        assert any(line.split()[:2] == [check, "BLOCK"] for line in out.splitlines()), out
    assert "0 of 1 host(s) ready" in out
    assert before == after, "the preflight changed something on this machine"
