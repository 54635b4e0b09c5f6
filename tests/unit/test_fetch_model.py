"""operations/scripts/fetch_model.py against the hub stand-in, on loopback only.

The script runs as a subprocess from a directory holding only it and quant.py, with the
system-style interpreter and no project on its path: exactly what the target gets.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.fleet.standins import hub_repos
from tests.loopback import free_port, wait_listening

ROOT = Path(__file__).resolve().parents[2]
SUPPORTED = hub_repos.SUPPORTED_REPO
UNSUPPORTED = hub_repos.UNSUPPORTED_REPO
SHARD1 = "model-00001-of-00003.safetensors"
SHARD2 = "model-00002-of-00003.safetensors"
CHUNK = 1024 * 1024  # the script's read size
TOKEN = "hf_standinSECRETtoken_0123456789"


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("HF_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


class Hub:
    """A hub stand-in subprocess on a free loopback port."""

    def __init__(self, repos: Path, token_file: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "tests.fleet.standins.hub",
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--repos",
            str(repos),
        ]
        if token_file:
            cmd += ["--require-token-file", str(token_file)]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=_clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_listening(self.port, self.proc, "hub stand-in")
        except RuntimeError:
            self.close()
            raise

    def _call(self, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method="POST" if data is not None else "GET")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=10) as r:
            return json.loads(r.read())

    def stats(self) -> dict:
        return self._call("/_standin/stats")

    def reset(self) -> None:
        self._call("/_standin/reset", {})

    def cut(self, after_bytes: int, times: int = 1) -> None:
        self._call("/_standin/cut", {"after_bytes": after_bytes, "times": times})

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def repos(standin_repos) -> Path:
    return standin_repos


@pytest.fixture(scope="module")
def script_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lib-freetoken")
    shutil.copy(ROOT / "operations" / "scripts" / "fetch_model.py", d / "fetch_model.py")
    shutil.copy(ROOT / "freetoken_infra" / "core" / "quant.py", d / "quant.py")
    shutil.copy(ROOT / "freetoken_infra" / "core" / "manifest.py", d / "manifest.py")
    shutil.copy(ROOT / "freetoken_infra" / "core" / "hostio.py", d / "hostio.py")
    return d


@pytest.fixture(scope="module")
def hub(repos):
    h = Hub(repos)
    yield h
    h.close()


@pytest.fixture()
def fresh(hub):
    hub.reset()
    return hub


def model_bytes(repos: Path, repo: str = SUPPORTED) -> dict[str, int]:
    base = repos.joinpath(*repo.split("/"))
    return {str(p.relative_to(base)): p.stat().st_size for p in base.rglob("*") if p.is_file()}


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, status_file: Path):
        self.rc = proc.returncode
        self.stderr = proc.stderr
        self.status_raw = status_file.read_text() if status_file.exists() else ""
        self.status = json.loads(self.status_raw) if self.status_raw else {}


def fetch(script_dir: Path, endpoint: str, dest: Path, *extra: str, repo: str = SUPPORTED, timeout=60) -> Run:
    status = dest.parent / (dest.name + ".status.json")
    cmd = [
        sys.executable,
        "-I",
        str(script_dir / "fetch_model.py"),
        "--endpoint",
        endpoint,
        "--repo",
        repo,
        "--revision",
        "main",
        "--dest",
        str(dest),
        "--status-file",
        str(status),
        "--disk-margin-gb",
        "0",
        "--backoff-s",
        "0.05",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd="/", env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    return Run(proc, status)


def sha256_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_complete(dest: Path, repos: Path, repo: str = SUPPORTED) -> dict:
    base = repos.joinpath(*repo.split("/"))
    for name in model_bytes(repos, repo):
        assert (dest / name).read_bytes() == (base / name).read_bytes(), name
    manifest = json.loads((dest / ".freetoken-manifest.json").read_text())
    assert manifest["repo"] == repo and manifest["revision"] == "main"
    assert manifest["commit"] == hub_repos.REPOS[repo]["sha"]
    assert manifest["complete"] is True
    assert set(manifest["files"]) == set(model_bytes(repos, repo))
    assert not (dest / ".partial").exists()
    return manifest


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# --------------------------------------------------------------------------- tests


def test_complete_download_then_rerun_transfers_and_hashes_nothing(script_dir, fresh, repos, tmp_path):
    dest = tmp_path / "model"
    first = fetch(script_dir, fresh.url, dest)
    assert first.rc == 0, first.stderr
    manifest = assert_complete(dest, repos)
    sizes = model_bytes(repos)
    total = sum(sizes.values())
    shard = manifest["files"][SHARD1]
    assert shard["size"] == sizes[SHARD1] and len(shard["sha256"]) == 64 and shard["verified_at"]
    assert len(manifest["files"]["config.json"]["oid"]) == 40  # small file: git blob sha1
    st = first.status
    assert st["state"] == "done" and st["error"] is None
    assert st["commit"] == hub_repos.REPOS[SUPPORTED]["sha"]
    assert st["bytes_total"] == st["bytes_missing_at_start"] == st["bytes_transferred"] == st["bytes_done"] == total
    assert fresh.stats()["bytes_sent"] == total
    # one human line per file
    for name in sizes:
        assert f"{name}: " in first.stderr

    fresh.reset()
    second = fetch(script_dir, fresh.url, dest)
    assert second.rc == 0, second.stderr
    assert fresh.stats()["bytes_sent"] == 0
    assert second.status["bytes_transferred"] == 0 and second.status["bytes_missing_at_start"] == 0
    # The manifest vouched for every file: nothing was re-hashed.
    assert second.status["bytes_hashed"] == 0
    assert second.status["files_trusted"] == len(sizes)
    assert "hashed 0 B, 11 trusted from the manifest" in second.stderr


def test_cut_transfers_resume_without_refetching(script_dir, fresh, repos, tmp_path):
    dest = tmp_path / "model"
    sizes = model_bytes(repos)
    # Every transfer of the next 8 is cut after 1.5 MiB: small files pass, the shards resume.
    fresh.cut(after_bytes=1536 * 1024, times=8)
    run = fetch(script_dir, fresh.url, dest)
    assert run.rc == 0, run.stderr
    assert "retry" in run.stderr and "resuming" in run.stderr
    assert_complete(dest, repos)
    missing = sum(sizes.values())
    sent = fresh.stats()["bytes_sent"]
    assert run.status["bytes_transferred"] == sent
    assert missing <= sent <= missing + CHUNK


def test_cut_with_no_retries_fails_then_next_run_resumes(script_dir, fresh, repos, tmp_path):
    dest = tmp_path / "model"
    sizes = model_bytes(repos)
    fresh.cut(after_bytes=2 * 1024 * 1024, times=20)
    first = fetch(script_dir, fresh.url, dest, "--retries", "0")
    assert first.rc == 1
    assert first.status["state"] == "failed" and "link dropped" in first.status["error"]
    partial = dest / ".partial" / (SHARD1 + ".part")
    assert partial.stat().st_size == 2 * 1024 * 1024
    fresh._call("/_standin/cut", {"after_bytes": 0, "times": 0})
    second = fetch(script_dir, fresh.url, dest)
    assert second.rc == 0, second.stderr
    assert_complete(dest, repos)
    missing = sum(sizes.values())
    assert second.status["bytes_missing_at_start"] == missing - first.status["bytes_transferred"]
    assert missing <= fresh.stats()["bytes_sent"] <= missing + CHUNK


@pytest.fixture()
def complete_model(script_dir, fresh, repos, tmp_path):
    dest = tmp_path / "model"
    assert fetch(script_dir, fresh.url, dest).rc == 0
    fresh.reset()
    return dest


def test_reverify_finds_same_size_same_mtime_corruption(script_dir, fresh, repos, complete_model):
    dest = complete_model
    shard = dest / SHARD2
    st = shard.stat()
    flip_byte(shard, st.st_size // 2)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime unchanged
    plain = fetch(script_dir, fresh.url, dest)
    assert plain.rc == 0 and fresh.stats()["bytes_sent"] == 0  # trusted: only --reverify can tell
    run = fetch(script_dir, fresh.url, dest, "--reverify")
    assert run.rc == 0, run.stderr
    assert f"{SHARD2}: on disk but corrupt" in run.stderr
    assert fresh.stats()["by_file"] == {f"{SUPPORTED}/{SHARD2}": st.st_size}
    assert run.status["bytes_hashed"] >= sum(model_bytes(repos).values())
    assert_complete(dest, repos)


def test_changed_mtime_triggers_verify_and_refetch_of_only_that_file(script_dir, fresh, repos, complete_model):
    dest = complete_model
    shard = dest / SHARD1
    flip_byte(shard, 100)
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    run = fetch(script_dir, fresh.url, dest)
    assert run.rc == 0, run.stderr
    assert fresh.stats()["by_file"] == {f"{SUPPORTED}/{SHARD1}": shard.stat().st_size}
    assert run.status["bytes_hashed"] == shard.stat().st_size  # only the suspect file was hashed
    assert_complete(dest, repos)


def test_truncated_file_is_refetched(script_dir, fresh, repos, complete_model):
    dest = complete_model
    shard = dest / SHARD2
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 3)
    run = fetch(script_dir, fresh.url, dest)
    assert run.rc == 0, run.stderr
    assert "wrong size" in run.stderr
    assert fresh.stats()["by_file"] == {f"{SUPPORTED}/{SHARD2}": size}
    assert_complete(dest, repos)


def test_unsupported_quantisation_refused_before_any_weight(script_dir, fresh, tmp_path):
    dest = tmp_path / "model"
    run = fetch(script_dir, fresh.url, dest, repo=UNSUPPORTED)
    assert run.rc == 3, run.stderr
    assert run.status["state"] == "refused"
    for text in (run.stderr, run.status["error"]):
        assert "fp8_tensor" in text and f"use {SUPPORTED}" in text
    served = fresh.stats()["by_file"]
    assert served and not [k for k in served if k.endswith(".safetensors")]
    assert not list(dest.glob("*.safetensors")) and not (dest / "config.json").exists()


def test_disk_check_refuses_before_any_weight(script_dir, fresh, tmp_path):
    dest = tmp_path / "model"
    run = fetch(script_dir, fresh.url, dest, "--disk-margin-gb", "1000000000")
    assert run.rc == 4, run.stderr
    assert run.status["state"] == "refused" and "not enough disk" in run.status["error"]
    assert not [k for k in fresh.stats()["by_file"] if k.endswith(".safetensors")]


def test_token_is_sent_but_never_shown(script_dir, repos, tmp_path):
    token_file = tmp_path / "hub-token"
    token_file.write_text(TOKEN + "\n")
    gated = Hub(repos, token_file=token_file)
    try:
        denied = fetch(script_dir, gated.url, tmp_path / "denied")
        assert denied.rc == 1
        assert "401" in denied.stderr and "--token-file" in denied.stderr
        run = fetch(script_dir, gated.url, tmp_path / "model", "--token-file", str(token_file))
        assert run.rc == 0, run.stderr
        assert_complete(tmp_path / "model", repos)
        for text in (
            denied.stderr,
            denied.status_raw,
            run.stderr,
            run.status_raw,
            (tmp_path / "model" / ".freetoken-manifest.json").read_text(),
        ):
            assert TOKEN not in text
    finally:
        gated.close()


def _cache_repos(repos: Path, dest: Path, corrupt: str | None = None) -> Path:
    """A second stand-in's repos dir: the same repo and commit, optionally one file corrupted."""
    cache = dest / "cache-repos"
    shutil.copytree(repos, cache)
    if corrupt:
        flip_byte(cache.joinpath(*SUPPORTED.split("/"), corrupt), 4096)
    return cache


def test_lan_source_serves_files_upstream_only_lists(script_dir, fresh, repos, tmp_path):
    cache = Hub(_cache_repos(repos, tmp_path))
    try:
        dest = tmp_path / "model"
        run = fetch(script_dir, fresh.url, dest, "--source", cache.url)
        assert run.rc == 0, run.stderr
        assert_complete(dest, repos)
        up = fresh.stats()
        assert up["bytes_sent"] == 0 and up["by_file"] == {} and up["requests"] >= 1
        assert cache.stats()["bytes_sent"] == sum(model_bytes(repos).values())
        assert "from cache " + cache.url in run.stderr
    finally:
        cache.close()


def test_lan_source_with_wrong_bytes_is_rejected_and_upstream_used(script_dir, fresh, repos, tmp_path):
    cache = Hub(_cache_repos(repos, tmp_path, corrupt=SHARD1))
    try:
        dest = tmp_path / "model"
        run = fetch(script_dir, fresh.url, dest, "--source", cache.url)
        assert run.rc == 0, run.stderr
        assert "does not match the upstream listing" in run.stderr
        assert_complete(dest, repos)
        assert fresh.stats()["by_file"] == {f"{SUPPORTED}/{SHARD1}": model_bytes(repos)[SHARD1]}
    finally:
        cache.close()


def test_unreachable_source_is_dropped_at_once_and_upstream_used(script_dir, fresh, repos, tmp_path):
    """A cache host that is down costs one refused connection, not retries for every file."""
    dead = f"http://127.0.0.1:{free_port()}"
    dest = tmp_path / "model"
    run = fetch(script_dir, fresh.url, dest, "--source", dead)
    assert run.rc == 0, run.stderr
    assert_complete(dest, repos)
    assert fresh.stats()["bytes_sent"] == sum(model_bytes(repos).values())
    assert run.stderr.count(dead) == 1, run.stderr
    assert "not asking it again" in run.stderr and "retry" not in run.stderr


def test_the_token_goes_to_upstream_only_never_to_a_source(script_dir, repos, tmp_path):
    """A LAN cache is plain HTTP on a shared network: it gets no Authorization header."""
    import http.server
    import threading

    seen: list[dict] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(dict(self.headers))
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    source = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=source.serve_forever, daemon=True).start()
    token_file = tmp_path / "hub-token"
    token_file.write_text(TOKEN + "\n")
    gated = Hub(repos, token_file=token_file)
    try:
        run = fetch(
            script_dir,
            gated.url,
            tmp_path / "model",
            "--token-file",
            str(token_file),
            "--source",
            f"http://127.0.0.1:{source.server_address[1]}",
        )
        assert run.rc == 0, run.stderr
        assert_complete(tmp_path / "model", repos)
        assert seen and all("Authorization" not in h and TOKEN not in str(h) for h in seen)
    finally:
        gated.close()
        source.shutdown()


def test_status_file_is_rewritten_while_waiting(script_dir, fresh, repos, tmp_path):
    """A slow link still gets a fresh status (rate, eta) at least every second."""
    fresh._call("/_standin/throttle", {"bytes_per_s": 3_000_000})
    dest = tmp_path / "model"
    status = tmp_path / "model.status.json"
    cmd = [
        sys.executable,
        "-I",
        str(script_dir / "fetch_model.py"),
        "--endpoint",
        fresh.url,
        "--repo",
        SUPPORTED,
        "--dest",
        str(dest),
        "--status-file",
        str(status),
        "--disk-margin-gb",
        "0",
    ]
    proc = subprocess.Popen(cmd, env=_clean_env(), stderr=subprocess.DEVNULL)
    seen = []
    try:
        while proc.poll() is None and len(seen) < 40:
            if status.exists():
                seen.append(json.loads(status.read_text()))
            time.sleep(0.25)
        assert proc.wait(60) == 0
    finally:
        fresh._call("/_standin/throttle", {"bytes_per_s": 0})
        if proc.poll() is None:
            proc.kill()
    downloading = [s for s in seen if s["state"] == "downloading" and s["bytes_transferred"] > 0]
    assert downloading, seen[-1:]
    assert any(s["rate_bps"] > 0 and s["eta_s"] is not None and s["current_file"] for s in downloading)
    assert len({s["updated_at"] for s in seen}) >= 2
    assert json.loads(status.read_text())["state"] == "done"


# --------------------------------------------------------------------------- the operations' pure parts


def _fetch_unit_with_token() -> str:
    from freetoken_infra.core.settings import Settings
    from operations.model import fetch_unit

    s = Settings(
        hub_token_file="/etc/freetoken/hub-token",
        hub_endpoint="http://10.213.0.1:8082",
        model_dir="/home/dev/models/Qwen3.6-35B-A3B-NVFP4-nvidia",
    )
    return fetch_unit(s, ["http://10.213.0.9:8090"])


def test_fetch_unit_runs_as_the_fetch_user_with_token_as_credential():
    from freetoken_infra.core.settings import Settings
    from operations.model import fetch_unit

    unit = _fetch_unit_with_token()
    exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_line.startswith(
        "ExecStart=/usr/bin/python3 /usr/local/lib/freetoken/fetch_model.py --endpoint "
        "http://10.213.0.1:8082 --repo nvidia/Qwen3.6-35B-A3B-NVFP4 --revision main"
    )
    assert "--source http://10.213.0.9:8090" in exec_line and "--token-file %d/hub-token" in exec_line
    assert "--status-file /var/lib/freetoken/model-fetch/status.json" in exec_line
    for line in (
        "Type=oneshot",
        "User=freetoken-fetch",
        "ProtectProc=invisible",
        "Environment=HF_HUB_DISABLE_XET=1",
        "LoadCredential=hub-token:/etc/freetoken/hub-token",
        "TimeoutStartSec=infinity",
        "ReadWritePaths=/home/dev/models/Qwen3.6-35B-A3B-NVFP4-nvidia /var/lib/freetoken/model-fetch",
    ):
        assert line in unit.splitlines(), line
    plain = fetch_unit(Settings(hub_disable_xet=False))
    assert "HF_HUB_DISABLE_XET" not in plain and "--token-file" not in plain and "LoadCredential" not in plain


def test_the_fetch_unit_has_only_keys_systemd_knows(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (systemd package); the fleet tests load the unit for real")
    unit = _fetch_unit_with_token()
    path = tmp_path / "freetoken-model-fetch.service"
    path.write_text(unit)
    out = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True)
    assert "Unknown key" not in out.stderr and "Unknown section" not in out.stderr, out.stderr


def _fact_output(dest: Path) -> list[str]:
    from facts.model_manifest import ModelManifest

    cmd = ModelManifest().command(str(dest))
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout.splitlines()


def test_manifest_fact_covers_only_a_complete_untouched_download(script_dir, fresh, complete_model):
    from facts.model_manifest import parse_model_manifest_output

    dest = complete_model
    info = parse_model_manifest_output(str(dest), _fact_output(dest))
    assert info.covers(SUPPORTED, "main") == (True, "complete")
    assert info.covers(SUPPORTED, hub_repos.REPOS[SUPPORTED]["sha"])[0]
    assert not info.covers(UNSUPPORTED, "main")[0]
    assert not info.covers(SUPPORTED, "v2")[0]
    shard = dest / SHARD1
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1))
    touched = parse_model_manifest_output(str(dest), _fact_output(dest))
    assert touched.covers(SUPPORTED, "main") == (False, f"{SHARD1} changed since it was verified")
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns - 1))
    assert parse_model_manifest_output(str(dest), _fact_output(dest)).covers(SUPPORTED, "main")[0]
    (dest / SHARD2).unlink()
    assert "missing" in parse_model_manifest_output(str(dest), _fact_output(dest)).covers(SUPPORTED, "main")[1]
    empty = parse_model_manifest_output(str(dest / "nope"), _fact_output(dest / "nope"))
    assert empty.manifest is None and not empty.covers(SUPPORTED, "main")[0]


class _Output:
    def __init__(self, lines):
        self.stdout_lines = self.output_lines = lines


class FakeHost:
    """Answers the wait callback's commands from a script of unit/status states."""

    name = "ws1"
    print_prefix = "[ws1] "

    def __init__(self, probes):
        self.probes = list(probes)
        self.commands = []

    def run_shell_command(self, command, **kwargs):
        self.commands.append((command, kwargs))
        if command.startswith("systemctl show"):
            unit, status = self.probes.pop(0) if len(self.probes) > 1 else self.probes[0]
            lines = [f"{k}={v}" for k, v in unit.items()] + ([json.dumps(status)] if status else [])
            return True, _Output(lines)
        if command.startswith("journalctl"):
            return True, _Output(["fetch_model: REFUSED: refusing unsloth/..."])
        return True, _Output([])


def test_wait_follows_the_unit_and_reports_refusal_with_host_and_error(capsys):
    from pyinfra.api.exceptions import OperationError

    from freetoken_infra.core.settings import Settings
    from operations.model import wait_for_fetch

    downloading = {
        "state": "downloading",
        "bytes_done": 5_000_000_000,
        "bytes_total": 22_000_000_000,
        "rate_bps": 50_000_000,
        "eta_s": 340,
        "current_file": SHARD1,
    }
    done = {**downloading, "state": "done", "bytes_done": 22_000_000_000, "bytes_transferred": 17e9}
    host = FakeHost(
        [
            ({"ActiveState": "activating", "jobs": "0"}, downloading),
            ({"ActiveState": "inactive", "Result": "success", "jobs": "0"}, done),
        ]
    )
    result = wait_for_fetch(None, host, Settings(), {"_sudo": True}, poll_s=0.6)
    assert result["state"] == "done"
    # The stale status goes as the download's user: root never follows a link planted in its folder.
    assert host.commands[0][0].startswith(
        "systemctl is-active -q freetoken-model-fetch.service || "
        "setpriv --reuid=freetoken-fetch --regid=freetoken-fetch --clear-groups -- rm -f "
    )
    assert "systemctl start --no-block freetoken-model-fetch.service" in host.commands[0][0]
    assert all(kw == {"_sudo": True} for _, kw in host.commands)
    err = capsys.readouterr().err
    assert "[ws1] model downloading: 5.0 GB of 22.0 GB (22.7 %), 50.0 MB/s, 5m40s left" in err

    refused = {"state": "refused", "error": "refusing unsloth/Qwen3.6-35B-A3B-NVFP4: ... fp8_tensor ..."}
    host = FakeHost([({"ActiveState": "failed", "Result": "exit-code", "ExecMainStatus": "3", "jobs": "0"}, refused)])
    with pytest.raises(OperationError) as exc:
        wait_for_fetch(None, host, Settings(), poll_s=0.6)
    text = str(exc.value)
    assert text.startswith("host ws1: the model download refused: refusing unsloth") and "journalctl" in text


# --------------------------------------------------------------------------- the LAN model cache
# The cache is Debian's nginx on the cache host: what it serves is tested in
# tests/unit/test_trust_model_cache.py (the lists model_cache.py writes) and, served by nginx,
# in tests/fleet/test_model.py. A LAN source's bytes: test_lan_source_* above.


def resolve(name: str, rev: str = hub_repos.REPOS[SUPPORTED]["sha"]) -> str:
    return f"/{SUPPORTED}/resolve/{rev}/{name}"


def check(script_dir: Path, dest: Path, revision: str = "main") -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-I",
            str(script_dir / "fetch_model.py"),
            "--check",
            "--repo",
            SUPPORTED,
            "--revision",
            revision,
            "--dest",
            str(dest),
        ],
        cwd="/",
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_check_passes_only_a_complete_untouched_download(script_dir, complete_model, tmp_path):
    assert check(script_dir, complete_model).returncode == 0
    assert check(script_dir, complete_model, hub_repos.REPOS[SUPPORTED]["sha"]).returncode == 0
    other = check(script_dir, complete_model, "v2")
    assert other.returncode == 1 and "not v2" in other.stderr
    empty = check(script_dir, tmp_path / "nothing")
    assert empty.returncode == 1 and "no .freetoken-manifest.json" in empty.stderr
    shard = complete_model / SHARD1
    flip_byte(shard, 10)  # an edit changes the mtime
    bad = check(script_dir, complete_model)
    assert bad.returncode == 1 and f"{SHARD1} changed since it was verified" in bad.stderr
    assert "must not start" in bad.stderr


def test_a_reverify_request_survives_until_a_run_verifies_everything(
    script_dir, fresh, repos, complete_model, tmp_path
):
    request = tmp_path / "reverify-requested"
    request.touch()
    shard = complete_model / SHARD2
    st = shard.stat()
    flip_byte(shard, st.st_size // 3)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # only a full re-hash can tell
    fresh.cut(after_bytes=1000, times=100)  # the re-fetch fails ...
    failed = fetch(script_dir, fresh.url, complete_model, "--reverify-request", str(request), "--retries", "1")
    assert failed.rc == 1 and request.exists()  # ... and the request stays for the next run
    fresh.reset()
    run = fetch(script_dir, fresh.url, complete_model, "--reverify-request", str(request))
    assert run.rc == 0, run.stderr
    assert run.status["bytes_hashed"] >= sum(model_bytes(repos).values()) - st.st_size
    assert_complete(complete_model, repos)
    assert not request.exists()
    again = fetch(script_dir, fresh.url, complete_model, "--reverify-request", str(request))
    assert again.rc == 0 and again.status["bytes_hashed"] == 0


@pytest.mark.parametrize(
    "bad_name", ["notes\nmodel-00001-of-00003.safetensors", "tab\there", "esc\x1b[31m", "back\\slash"]
)
def test_a_listing_with_a_control_character_in_a_name_is_refused_before_any_write(
    script_dir, repos, tmp_path, bad_name
):
    """A hub (or mirror) file name with a newline is refused before anything is
    written: such a name would split every line-based record it reached."""
    own = _cache_repos(repos, tmp_path)
    (own.joinpath(*SUPPORTED.split("/")) / bad_name).write_text("x")
    hub = Hub(own)
    try:
        dest = tmp_path / "model"
        run = fetch(script_dir, hub.url, dest)
        assert run.rc != 0
        assert "unsafe file name" in run.stderr and repr(bad_name) in run.stderr, run.stderr
        assert not dest.exists() or not any(p.is_file() for p in dest.rglob("*")), list(dest.rglob("*"))
        assert hub.stats()["bytes_sent"] == 0
    finally:
        hub.close()


@pytest.mark.parametrize("size", [-(10**12), -1, True, 1.5, "12"])
def test_a_hostile_listing_with_a_size_that_is_no_byte_count_is_refused_before_any_byte(
    script_dir, fresh, repos, tmp_path, size
):
    """A hub listing a shard with a negative size cancelled the other shards
    in the disk check (a full disk passed) and left a manifest that never covered (re-fetch and
    restart on every run). The stand-in lists the hostile size; the fetcher refuses the listing
    in one line, before a byte is fetched or a file written. (A string makes the fetcher fall
    back to the tree API: the same check holds there.)"""
    fresh._call("/_standin/listing", {"sizes": {SHARD2: size}})
    dest = tmp_path / "model"
    run = fetch(script_dir, fresh.url, dest, "--retries", "0")
    assert run.rc != 0
    refusal = [line for line in run.stderr.splitlines() if "FAILED" in line]
    assert refusal == [
        f"fetch_model: FAILED: the hub listed {SHARD2} with the size {size!r}, not a byte count; refusing the listing"
    ], run.stderr
    assert fresh.stats()["bytes_sent"] == 0
    assert not dest.exists() or not any(p.is_file() for p in dest.rglob("*")), list(dest.rglob("*"))
    assert run.status["state"] == "failed" and "not a byte count" in run.status["error"]
