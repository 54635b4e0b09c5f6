"""The stand-in wheelhouse: pip installs the engine stand-in and ninja from it, over loopback."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import pytest

from tests.fleet.standins import wheelhouse
from tests.loopback import free_port


@pytest.fixture(scope="module")
def house(tmp_path_factory):
    d = tmp_path_factory.mktemp("wheelhouse")
    try:
        wheelhouse.build(str(d))
    except subprocess.CalledProcessError:
        pytest.skip("the real ninja wheel could not be fetched once into the cache (no registry)")
    return d


@pytest.fixture(scope="module")
def index_url(house):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "--directory", str(house)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.025)
    yield f"http://127.0.0.1:{port}/simple"
    proc.terminate()
    proc.wait(10)


def fresh_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True).create(path)
    return path / "bin" / "python"


def pip_install(py: Path, index_url: str, *reqs: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run(
        [str(py), "-m", "pip", "install", "--no-cache-dir", "--index-url", index_url, *reqs],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_index_layout_and_hashes(house):
    simple = (house / "simple" / "index.html").read_text()
    assert 'href="freetoken/"' in simple and 'href="ninja/"' in simple
    page = (house / "simple" / "freetoken" / "index.html").read_text()
    links = re.findall(r'href="\.\./\.\./packages/([^"#]+)#sha256=([0-9a-f]{64})"', page)
    assert sorted(n for n, _ in links) == [f"freetoken-0.2.{i}-py3-none-any.whl" for i in (1, 2, 3)]
    import hashlib

    for name, digest in links:
        assert hashlib.sha256((house / "packages" / name).read_bytes()).hexdigest() == digest


def test_wheels_are_reproducible(house, tmp_path):
    again = wheelhouse.build_engine_wheel("0.2.1", False, str(tmp_path))
    assert Path(again).read_bytes() == (house / "packages" / "freetoken-0.2.1-py3-none-any.whl").read_bytes()
    with zipfile.ZipFile(house / "packages" / "freetoken-0.2.3-py3-none-any.whl") as z:
        assert b"BROKEN = True" in z.read("freetoken/version.py")
        assert b"Provides-Extra: accel" in z.read("freetoken-0.2.3.dist-info/METADATA")


def test_pip_installs_engine_with_accel_and_ninja(index_url, tmp_path):
    py = fresh_venv(tmp_path / "venv")
    r = pip_install(py, index_url, "freetoken[accel]==0.2.1", "ninja")
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([str(py), "-m", "freetoken", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--attention-backend" in r.stdout
    r = subprocess.run([str(tmp_path / "venv" / "bin" / "ft"), "--version"], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "freetoken version 0.2.1"
    r = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "ninja"), "--version"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip()
    # the broken release installs like any other, and says so
    r = pip_install(py, index_url, "freetoken[accel]==0.2.3")
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        [str(py), "-c", "import freetoken.version as v; print(v.__version__, v.BROKEN)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.split() == ["0.2.3", "True"]
