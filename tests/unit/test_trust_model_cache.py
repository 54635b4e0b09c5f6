"""Issue 13, boundary 5: the LAN model cache is a well-behaved network service.

model_cache.py runs as the cache host runs it (a subprocess, system-style interpreter, loopback
only) and is attacked the way anyone on the LAN could: idle connections by the hundred, control
characters in the request line, requests for a gated repository without the key.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken_infra.core.settings import Settings, SettingsError, build_settings
from operations.model import cache_bind_address, cache_unit
from tests.loopback import free_port, wait_listening
from tests.unit.test_fetch_model import (  # noqa: F401 - fixtures
    ROOT,
    SHARD1,
    SUPPORTED,
    TOKEN,
    Hub,
    _clean_env,
    assert_complete,
    complete_model,
    fetch,
    fresh,
    hub,
    model_bytes,
    repos,
    resolve,
    script_dir,
)


class Cache:
    """model_cache.py on a free loopback port, with its stderr (the journal) kept."""

    def __init__(self, script_dir: Path, model_dir: Path, *extra: str):
        shutil.copy(ROOT / "operations" / "scripts" / "model_cache.py", script_dir / "model_cache.py")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = model_dir.parent / f"cache-{self.port}.log"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                str(script_dir / "model_cache.py"),
                "--dir",
                str(model_dir),
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                *extra,
            ],
            cwd="/",
            env=_clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
        )
        wait_listening(self.port, self.proc, "model_cache.py", self.log)

    def raw(self, request: bytes, timeout: float = 30) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(request)
            chunks = []
            while True:
                block = s.recv(65536)
                if not block:
                    return b"".join(chunks)
                chunks.append(block)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes]:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        answer = self.raw(f"GET {path} HTTP/1.1\r\nHost: cache\r\n{extra}\r\n".encode())
        head, _, body = answer.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body

    def threads(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def test_200_idle_connections_do_not_stop_it_answering_nor_take_a_worker_each(script_dir, complete_model):
    cache = Cache(script_dir, complete_model, "--workers", "4")
    idle = []
    try:
        for _ in range(200):
            idle.append(socket.create_connection(("127.0.0.1", cache.port), timeout=10))
        idle[0].sendall(b"GET /hea")  # one more client stuck half-way through its request line
        want = (complete_model / SHARD1).read_bytes()
        for _ in range(3):
            status, body = cache.get(resolve(SHARD1))
            assert status == 200 and body == want
        # Waiting connections hold no thread: the pool (4) and the selector thread, not 200.
        assert cache.threads() <= 4 + 2, cache.threads()
        assert cache.proc.poll() is None
    finally:
        for conn in idle:
            conn.close()
        cache.close()


def test_an_idle_connection_is_closed_after_the_idle_timeout(script_dir, complete_model):
    cache = Cache(script_dir, complete_model, "--idle-timeout-s", "1")
    try:
        with socket.create_connection(("127.0.0.1", cache.port), timeout=20) as conn:
            assert conn.recv(1) == b""  # closed by the server (a hung server raises a timeout)
    finally:
        cache.close()


def test_more_waiting_connections_than_the_limit_close_the_oldest(script_dir, complete_model):
    cache = Cache(script_dir, complete_model, "--max-connections", "5")
    try:
        first = socket.create_connection(("127.0.0.1", cache.port), timeout=20)
        others = [socket.create_connection(("127.0.0.1", cache.port), timeout=20) for _ in range(5)]
        assert first.recv(1) == b""
        assert cache.get("/health")[0] == 200
        for conn in [first, *others]:
            conn.close()
    finally:
        cache.close()


def test_a_connection_closed_by_its_client_as_it_is_evicted_does_not_stop_the_cache(script_dir, complete_model):
    """At the limit, each new connection evicts the oldest waiting one; when that one's client
    closed it in the same moment, its stale event must not be served (it stopped the cache)."""
    cache = Cache(script_dir, complete_model, "--max-connections", "1")
    try:
        previous = socket.create_connection(("127.0.0.1", cache.port), timeout=20)
        for _ in range(1000):
            conn = socket.create_connection(("127.0.0.1", cache.port), timeout=20)
            previous.close()
            previous = conn
        previous.close()
        assert cache.get("/health")[0] == 200
        assert cache.proc.poll() is None, cache.log.read_text()[-2000:]
    finally:
        cache.close()


def test_log_lines_escape_control_characters(script_dir, complete_model):
    cache = Cache(script_dir, complete_model)
    try:
        cache.raw(b"GET /\x1b[31mred\x07/\x85x HTTP/1.0\r\n\r\n")
        cache.raw(b"GET /a\rforged HTTP/1.0\r\n\r\n")
    finally:
        cache.close()
    log = cache.log.read_bytes()
    assert b"\x1b" not in log and b"\x07" not in log and b"\r" not in log, log
    assert b"\\x1b[31mred\\x07" in log, log
    # one line per request (and the start line): nothing split a record
    assert all(line.startswith((b"model_cache: ", b"127.0.0.1 ")) for line in log.splitlines()), log


def _gated_cache(script_dir: Path, model_dir: Path, tmp_path: Path) -> tuple[Cache, Path]:
    token_file = tmp_path / "hub-token"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    return Cache(script_dir, model_dir, "--token-file", str(token_file)), token_file


def test_a_gated_cache_serves_nobody_without_the_key(script_dir, complete_model, tmp_path):
    sys.path.insert(0, str(ROOT / "operations" / "scripts"))
    try:
        import fetch_model
        import model_cache
    finally:
        sys.path.pop(0)
    key = model_cache.cache_token(TOKEN)
    assert key == fetch_model.cache_token(TOKEN) and TOKEN not in key
    cache, _ = _gated_cache(script_dir, complete_model, tmp_path)
    try:
        for headers in (
            None,
            {"X-FreeToken-Cache-Token": "guess"},
            {"Authorization": f"Bearer {TOKEN}"},
            {"X-FreeToken-Cache-Token": TOKEN},
        ):
            for path in (resolve(SHARD1), "/health"):
                assert cache.get(path, headers)[0] == 401, (path, headers)
        status, body = cache.get(resolve(SHARD1), {"X-FreeToken-Cache-Token": key})
        assert status == 200 and body == (complete_model / SHARD1).read_bytes()
    finally:
        cache.close()
    assert TOKEN not in cache.log.read_text() and key not in cache.log.read_text()


def test_a_fetcher_with_the_hub_token_reads_a_gated_cache(script_dir, repos, complete_model, tmp_path):
    """The fleet's hosts all hold the hub token: they get every byte from the gated cache and
    the upstream hub serves nothing but the listing."""
    cache, token_file = _gated_cache(script_dir, complete_model, tmp_path)
    gated = Hub(repos, token_file=token_file)
    try:
        run = fetch(script_dir, gated.url, tmp_path / "host2", "--token-file", str(token_file), "--source", cache.url)
        assert run.rc == 0, run.stderr
        assert_complete(tmp_path / "host2", repos)
        assert gated.stats()["bytes_sent"] == 0, gated.stats()
        # Without the token the same source answers 401 to everything: nothing from the cache.
        denied = fetch(script_dir, gated.url, tmp_path / "host3", "--source", cache.url)
        assert denied.rc != 0
        assert not (tmp_path / "host3" / SHARD1).exists()
    finally:
        gated.close()
        cache.close()


# --------------------------------------------------------------------------- the unit


def test_the_unit_binds_where_the_fleet_reaches_the_host_never_everywhere():
    s = Settings(model_cache_host="ws1")
    assert cache_bind_address(s, "ws1", "10.213.0.11") == "10.213.0.11"
    assert cache_bind_address(s, "10.0.0.7", None) == "10.0.0.7"
    assert cache_bind_address(s, "ws1", "fd00::11") == "fd00::11"
    assert cache_bind_address(s, "ws1", "localhost") in ("127.0.0.1", "::1")
    pinned = Settings(model_cache_host="ws1", model_cache_bind="192.168.1.20")
    assert cache_bind_address(pinned, "ws1", "10.213.0.11") == "192.168.1.20"
    unit = cache_unit(s, "10.213.0.11")
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert "--bind 10.213.0.11 " in exec_start and "0.0.0.0" not in unit
    assert "LoadCredential" not in unit and "--token-file" not in unit


def test_a_gated_repositorys_cache_unit_gets_the_token_as_a_credential_never_in_argv():
    s = Settings(model_cache_host="ws1", hub_token_file="/etc/freetoken/hub-token")
    unit = cache_unit(s, "10.213.0.11")
    assert "LoadCredential=hub-token:/etc/freetoken/hub-token" in unit.splitlines()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.endswith(" --token-file %d/hub-token")


@pytest.mark.parametrize("bad", ["every", "10.0.0.1; id", "10.0.0.300"])
def test_the_bind_setting_is_an_address(bad):
    with pytest.raises(SettingsError, match="model_cache_bind"):
        build_settings("ws1", {"model_cache_bind": bad})


def test_health_still_answers_for_an_ungated_cache(script_dir, repos, complete_model):
    cache = Cache(script_dir, complete_model)
    try:
        status, body = cache.get("/health")
        assert status == 200 and json.loads(body)["files"] == len(model_bytes(repos))
    finally:
        cache.close()
    assert SUPPORTED
