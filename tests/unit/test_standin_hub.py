"""The hub stand-in against the real huggingface_hub client, on loopback only."""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.fleet.standins import hub, hub_repos

SUPPORTED = hub_repos.SUPPORTED_REPO
UNSUPPORTED = hub_repos.UNSUPPORTED_REPO
SHARD = "model-00001-of-00003.safetensors"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def repos_dir(standin_repos):
    return standin_repos


@pytest.fixture()
def server(repos_dir):
    srv = hub.make_server("127.0.0.1", 0, str(repos_dir))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture()
def hf_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")


def get(url, headers=None, method="GET"):
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def post(url, obj):
    req = urllib.request.Request(
        url, data=json.dumps(obj).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ------------------------------------------------------------------ the repositories
def test_build_is_deterministic(tmp_path, repos_dir):
    hub_repos.build(str(tmp_path))
    for repo in (SUPPORTED, UNSUPPORTED):
        for name in hub_repos.repo_files(repo):
            assert (tmp_path / repo / name).read_bytes() == (repos_dir / repo / name).read_bytes(), name


def test_shards_have_valid_safetensors_headers(repos_dir):
    root = repos_dir / SUPPORTED
    index = json.loads((root / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    total = 0
    for shard in shards:
        data = (root / shard).read_bytes()
        assert 1 << 20 < len(data) < 8 << 20
        (hlen,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + hlen])
        end = 0
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            assert index["weight_map"][name] == shard
            b, e = spec["data_offsets"]
            assert b == end and e >= b
            end = e
            total += e - b
        assert 8 + hlen + end == len(data)
    assert total == index["metadata"]["total_size"]


def test_quantisation_shapes(repos_dir):
    nv = json.loads((repos_dir / SUPPORTED / "config.json").read_text())
    q = nv["quantization_config"]
    assert q["quant_method"] == "modelopt" and q["quant_algo"] == "MIXED_PRECISION"
    sidecar = json.loads((repos_dir / SUPPORTED / "hf_quant_config.json").read_text())
    assert sidecar["producer"]["name"] == "modelopt"
    layers = sidecar["quantization"]["quantized_layers"]
    assert layers["model.layers.0.mlp.experts.0.gate_proj"]["group_size"] == 16
    assert layers["model.layers.0.self_attn.q_proj"] == {"quant_algo": "FP8"}
    un = json.loads((repos_dir / UNSUPPORTED / "config.json").read_text())["quantization_config"]
    assert un["quant_method"] == "compressed-tensors"
    strategies = {g["weights"]["strategy"] for g in un["config_groups"].values()}
    assert strategies == {"tensor", "tensor_group"}


# ------------------------------------------------------------------ real client
def test_snapshot_download_matches_tree(server, hf_env, tmp_path):
    from huggingface_hub import HfApi, snapshot_download

    srv, url = server
    out = snapshot_download(SUPPORTED, revision="main", endpoint=url, local_dir=tmp_path / "m")
    api = HfApi(endpoint=url)
    tree = {f.path: f for f in api.list_repo_tree(SUPPORTED, revision="main", recursive=True)}
    assert set(tree) == set(hub_repos.repo_files(SUPPORTED))
    for name, f in tree.items():
        local = Path(out) / name
        assert local.stat().st_size == f.size
        if f.lfs is not None:
            assert sha256(local) == f.lfs.sha256
        else:
            data = local.read_bytes()
            assert hub.git_blob_sha1(data) == f.blob_id
    assert tree[SHARD].lfs is not None and tree["config.json"].lfs is None


def test_hf_hub_download_single_file_into_cache(server, hf_env, tmp_path):
    from huggingface_hub import hf_hub_download

    _, url = server
    p = hf_hub_download(UNSUPPORTED, "config.json", revision="main", endpoint=url, cache_dir=tmp_path / "c")
    assert hub_repos.REPOS[UNSUPPORTED]["sha"] in p  # snapshots/<commit>/config.json
    assert json.loads(Path(p).read_text())["quantization_config"]["quant_method"] == "compressed-tensors"


def test_model_info_files_metadata(server, hf_env, repos_dir):
    from huggingface_hub import HfApi

    _, url = server
    info = HfApi(endpoint=url).model_info(SUPPORTED, revision="main", files_metadata=True)
    assert info.sha == hub_repos.REPOS[SUPPORTED]["sha"]
    sib = {s.rfilename: s for s in info.siblings}
    assert sib[SHARD].size == (repos_dir / SUPPORTED / SHARD).stat().st_size
    assert sib[SHARD].lfs.sha256 == sha256(repos_dir / SUPPORTED / SHARD)
    assert sib["config.json"].lfs is None


def test_client_maps_error_codes(server, hf_env, tmp_path):
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    _, url = server
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("nobody/nothing", "config.json", endpoint=url, cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(SUPPORTED, "config.json", revision="v9", endpoint=url, cache_dir=tmp_path)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(SUPPORTED, "nope.json", endpoint=url, cache_dir=tmp_path)


# ------------------------------------------------------------------ raw HTTP
def test_resolve_headers_and_404_forms(server, repos_dir):
    _, url = server
    sha = hub_repos.REPOS[SUPPORTED]["sha"]
    status, h, body = get(f"{url}/{SUPPORTED}/resolve/main/{SHARD}", method="HEAD")
    size = (repos_dir / SUPPORTED / SHARD).stat().st_size
    assert status == 200 and body == b""
    assert h["X-Repo-Commit"] == sha
    assert h["ETag"] == f'"{sha256(repos_dir / SUPPORTED / SHARD)}"' == h["X-Linked-Etag"]
    assert h["X-Linked-Size"] == h["Content-Length"] == str(size)
    assert h["Accept-Ranges"] == "bytes"
    status, h, _ = get(f"{url}/{SUPPORTED}/resolve/{sha}/config.json", method="HEAD")
    assert status == 200 and "X-Linked-Etag" not in h
    assert h["ETag"] == f'"{hub.git_blob_sha1((repos_dir / SUPPORTED / "config.json").read_bytes())}"'

    status, h, body = get(f"{url}/nobody/nothing/resolve/main/config.json")
    assert (status, h["X-Error-Code"], json.loads(body)) == (404, "RepoNotFound", {"error": "Repository Not Found"})
    status, h, _ = get(f"{url}/{SUPPORTED}/resolve/main/missing.bin")
    assert (status, h["X-Error-Code"], h["X-Repo-Commit"]) == (404, "EntryNotFound", sha)
    status, h, _ = get(f"{url}/{SUPPORTED}/resolve/deadbeef/config.json")
    assert (status, h["X-Error-Code"]) == (404, "RevisionNotFound")
    status, h, _ = get(f"{url}/api/models/nobody/nothing")
    assert (status, h["X-Error-Code"]) == (404, "RepoNotFound")


def test_range_requests_return_exact_slices(server, repos_dir):
    _, url = server
    data = (repos_dir / SUPPORTED / SHARD).read_bytes()
    u = f"{url}/{SUPPORTED}/resolve/main/{SHARD}"
    status, h, body = get(u, {"Range": "bytes=100-199"})
    assert status == 206 and body == data[100:200]
    assert h["Content-Range"] == f"bytes 100-199/{len(data)}"
    status, h, body = get(u, {"Range": "bytes=1000000-"})
    assert status == 206 and body == data[1000000:]
    status, _, body = get(u, {"Range": "bytes=-16"})
    assert status == 206 and body == data[-16:]
    status, h, _ = get(u, {"Range": f"bytes={len(data)}-"})
    assert status == 416 and h["Content-Range"] == f"bytes */{len(data)}"


def test_cut_switch_drops_link_after_n_bytes_then_recovers(server, repos_dir):
    _, url = server
    u = f"{url}/{SUPPORTED}/resolve/main/{SHARD}"
    full = (repos_dir / SUPPORTED / SHARD).read_bytes()
    assert post(f"{url}/_standin/cut", {"after_bytes": 4096, "times": 1})["ok"]
    host, port = url[len("http://") :].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"GET /{SUPPORTED}/resolve/main/{SHARD} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert f"Content-Length: {len(full)}".encode() in head
    assert body == full[:4096]  # then EOF: the link dropped
    status, _, body = get(u)  # times=1: the next transfer is whole again
    assert status == 200 and body == full


def test_stats_count_body_bytes_and_reset(server, repos_dir):
    _, url = server
    post(f"{url}/_standin/reset", {})
    get(f"{url}/{SUPPORTED}/resolve/main/config.json")
    get(f"{url}/{SUPPORTED}/resolve/main/{SHARD}", {"Range": "bytes=0-9"})
    get(f"{url}/{SUPPORTED}/resolve/main/{SHARD}", method="HEAD")
    _, _, body = get(f"{url}/_standin/stats")
    stats = json.loads(body)
    cfg = (repos_dir / SUPPORTED / "config.json").stat().st_size
    assert stats["by_file"] == {f"{SUPPORTED}/config.json": cfg, f"{SUPPORTED}/{SHARD}": 10}
    assert stats["bytes_sent"] == cfg + 10 and stats["requests"] == 3
    post(f"{url}/_standin/reset", {})
    assert json.loads(get(f"{url}/_standin/stats")[2]) == {"bytes_sent": 0, "by_file": {}, "requests": 0}


def test_gated_token_file_cli_and_no_token_in_log(repos_dir, tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text("hf_sekrit_123\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.fleet.standins.hub",
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--repos",
            str(repos_dir),
            "--require-token-file",
            str(token_file),
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        status, h, _ = get(f"{url}/api/models/{SUPPORTED}")
        assert (status, h["X-Error-Code"]) == (401, "GatedRepo")
        status, h, _ = get(f"{url}/{SUPPORTED}/resolve/main/config.json", {"Authorization": "Bearer wrong"})
        assert (status, h["X-Error-Code"]) == (401, "GatedRepo")
        status, _, body = get(f"{url}/api/models/{SUPPORTED}", {"Authorization": "Bearer hf_sekrit_123"})
        assert status == 200 and json.loads(body)["sha"] == hub_repos.REPOS[SUPPORTED]["sha"]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert err.count("GET /api/models/") == 2 and "hf_sekrit_123" not in err
