"""Benchmark of the model downloader's two economies, on loopback with the hub stand-in.

1. Cut and resume: the link drops part-way through several transfers; the downloader resumes
   with HTTP Range. Figure: bytes transferred / bytes missing (target <= 1.0 + one 1 MiB read
   chunk over the missing bytes; huggingface_hub >= 1.31 would start each file over).
2. A LAN cache for a fleet: three "hosts" (three model dirs) fetch the model. Without a cache
   the upstream sends 3.0 x the model. With one, the first host fetches from upstream and then
   serves its verified directory as the cache for the other two. Figure: upstream bytes / model
   size (target 1.0).

The cache is the hub stand-in itself (tests/fleet/standins/hub.py) pointed at the first
host's model directory (a repos.json naming the repo and commit, and a symlink): it already
speaks the resolve endpoint with Range, and the downloader verifies every byte from a cache
against the upstream listing anyway, so a cache server needs no logic of its own. On a real
fleet any static server exposing that path layout would do the same job.

Usage: ``python3 bench/model_fetch.py [--runs N]``  (stdlib + the project checkout)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fleet.standins import hub, hub_repos  # noqa: E402

REPO = hub_repos.SUPPORTED_REPO
SCRIPT = ROOT / "operations" / "scripts" / "fetch_model.py"
CHUNK = 1024 * 1024


class Server:
    def __init__(self, repos_dir: Path):
        self.srv = hub.make_server("127.0.0.1", 0, str(repos_dir))
        self.srv.RequestHandlerClass.log_message = lambda *a: None  # one line per request: too many
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    @property
    def state(self):
        return self.srv.state

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


def fetch(endpoint: str, dest: Path, *extra: str) -> dict:
    status = dest.parent / (dest.name + ".status.json")
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--endpoint", endpoint, "--repo", REPO, "--dest", str(dest),
         "--status-file", str(status), "--disk-margin-gb", "0", "--backoff-s", "0.05", *extra],
        capture_output=True, text=True, env=env, timeout=300,
    )
    if proc.returncode != 0:
        raise SystemExit(f"fetch failed ({proc.returncode}):\n{proc.stderr}")
    doc = json.loads(status.read_text())
    doc["wall_s"] = time.monotonic() - t0
    return doc


def cut_and_resume(repos: Path, work: Path, model_size: int) -> tuple[float, float, int]:
    server = Server(repos)
    try:
        # Every one of the next 12 transfers drops after 1 MB: shards need several resumes.
        with server.state.lock:
            server.state.cut_after, server.state.cut_times = 1_000_000, 12
        doc = fetch(server.url, work / "cut")
        sent = server.state.bytes_sent
        return sent / doc["bytes_missing_at_start"], (model_size + CHUNK) / model_size, doc["bytes_transferred"]
    finally:
        server.close()


def cache_repos_for(model_dir: Path, where: Path) -> Path:
    """A hub stand-in repos dir serving a verified model directory."""
    manifest = json.loads((model_dir / ".freetoken-manifest.json").read_text())
    owner, name = REPO.split("/")
    (where / owner).mkdir(parents=True)
    os.symlink(model_dir, where / owner / name)
    (where / hub_repos.MANIFEST).write_text(json.dumps({"repos": {REPO: {
        "sha": manifest["commit"], "revisions": {"main": manifest["commit"]},
        "files": sorted(manifest["files"])}}}))
    return where


def fleet(repos: Path, work: Path, model_size: int, with_cache: bool) -> float:
    upstream = Server(repos)
    cache = None
    try:
        fetch(upstream.url, work / "host1")
        extra: list[str] = []
        if with_cache:
            cache = Server(cache_repos_for(work / "host1", work / "cache-repos"))
            extra = ["--source", cache.url]
        for name in ("host2", "host3"):
            fetch(upstream.url, work / name, *extra)
        return upstream.state.bytes_sent / model_size
    finally:
        upstream.close()
        if cache:
            cache.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    u = platform.uname()
    print(f"machine: {u.system} {u.release} {u.machine}, nproc {os.cpu_count()}, python {platform.python_version()}")
    with tempfile.TemporaryDirectory(prefix="bench-model-fetch-") as tmp:
        repos = Path(tmp) / "repos"
        hub_repos.build(str(repos))
        base = repos.joinpath(*REPO.split("/"))
        model_size = sum(p.stat().st_size for p in base.rglob("*") if p.is_file())
        print(f"model: {REPO} stand-in, {model_size} bytes in {sum(1 for p in base.rglob('*') if p.is_file())} files")
        cut, bound, cache, nocache = [], 0.0, [], []
        for i in range(args.runs):
            work = Path(tmp) / f"run{i}"
            for sub in ("a", "b", "c"):
                (work / sub).mkdir(parents=True)
            ratio, bound, _ = cut_and_resume(repos, work / "a", model_size)
            cut.append(ratio)
            cache.append(fleet(repos, work / "b", model_size, with_cache=True))
            nocache.append(fleet(repos, work / "c", model_size, with_cache=False))
            shutil.rmtree(work)
        med = statistics.median
        print(f"cut and resume (12 drops after 1 MB each): bytes transferred / bytes missing = "
              f"{med(cut):.4f} median of {args.runs} (runs {', '.join(f'{x:.4f}' for x in cut)}); "
              f"target <= {bound:.4f} (1.0 + one 1 MiB chunk)")
        print(f"3 hosts through a LAN cache: upstream bytes / model size = {med(cache):.3f} median "
              f"(target 1.0); without the cache {med(nocache):.3f} (3.0)")
        ok = med(cut) <= bound and abs(med(cache) - 1.0) < 1e-9
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
