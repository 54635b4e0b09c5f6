"""Benchmark of the model downloader's two economies, on loopback with the hub stand-in.

1. Cut and resume: the link drops part-way through several transfers; the downloader resumes
   with HTTP Range. Figure: bytes transferred / bytes missing (target <= 1.0 + one 1 MiB read
   chunk over the missing bytes; huggingface_hub >= 1.31 would start each file over).
2. A LAN cache for a fleet: three hosts fetch the model. Without a cache the upstream sends
   3.0 x the model; with one (the first host serves its verified copy) 1.0. The cache is
   Debian's nginx on the cache host (``freetoken-model-cache.service``), so this figure comes
   from the simulated fleet only (``--fleet``, below); bench/model_cache.py measures the cache
   under slow and idle clients.
   ``--fleet``: the figure from the deploy itself: four simulated hosts (three serve,
   ws3 is refused at preflight), ``model_cache_host=ws1``, the hub stand-in counting what it
   sent; then again without the cache.

Usage: ``python3 bench/model_fetch.py [--runs N] [--fleet]``  (stdlib + the project checkout;
``--fleet`` needs root and the project's venv)
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
        [
            sys.executable,
            str(SCRIPT),
            "--endpoint",
            endpoint,
            "--repo",
            REPO,
            "--dest",
            str(dest),
            "--status-file",
            str(status),
            "--disk-margin-gb",
            "0",
            "--backoff-s",
            "0.05",
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--fleet",
        action="store_true",
        help="also roll the deploy out to 3 serving simulated hosts (root; a few minutes)",
    )
    args = ap.parse_args(argv)
    u = platform.uname()
    print(f"machine: {u.system} {u.release} {u.machine}, nproc {os.cpu_count()}, python {platform.python_version()}")
    code = loopback(args)
    return fleet_rollout() or code if args.fleet else code


def fleet_rollout() -> int:
    """The deploy itself on the simulated fleet: ws1, ws2 and ws4 serve (ws3 is refused at
    preflight), with ws1 as model_cache_host, then again with no cache. Figure: upstream bytes
    (the hub stand-in's counters) / model size."""
    from freetoken_infra.core.settings import Settings
    from tests.fleet import harness
    from tests.fleet.client import deploy, hub

    size = sum(len(b) for b in hub_repos.repo_files(REPO).values())
    figures = {}
    with harness.exclusive():
        fleet_ = harness.up(4)
        try:
            for label, extra in (
                ("through the LAN cache (model_cache_host=ws1)", ("--data", "model_cache_host=ws1")),
                ("without a cache", ()),
            ):
                for h in ("ws1", "ws2", "ws4"):
                    fleet_.run(h, f"systemctl stop freetoken.service 2>/dev/null; rm -rf {Settings().model_dir}")
                hub(fleet_, "/_standin/reset", {})
                t0 = time.monotonic()
                run = deploy(*extra)
                wall = time.monotonic() - t0
                if "ws3" not in run.stdout + run.stderr or "Grand total" not in run.stdout + run.stderr:
                    raise SystemExit("the fleet deploy did not run through")
                sent = sum(hub(fleet_, "/_standin/stats")["by_file"].values())
                figures[label] = (sent / size, wall)
        finally:
            harness.down(quiet=True)
    for label, (ratio, wall) in figures.items():
        print(
            f"fleet rollout to 3 serving hosts {label}: upstream bytes / model size = {ratio:.3f} (deploy {wall:.0f} s)"
        )
    ok = abs(figures["through the LAN cache (model_cache_host=ws1)"][0] - 1.0) < 1e-9
    print("fleet: PASS" if ok else "fleet: FAIL (target 1.0 through the cache)")
    return 0 if ok else 1


def loopback(args) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-model-fetch-") as tmp:
        repos = Path(tmp) / "repos"
        hub_repos.build(str(repos))
        base = repos.joinpath(*REPO.split("/"))
        model_size = sum(p.stat().st_size for p in base.rglob("*") if p.is_file())
        print(f"model: {REPO} stand-in, {model_size} bytes in {sum(1 for p in base.rglob('*') if p.is_file())} files")
        cut, bound = [], 0.0
        for i in range(args.runs):
            work = Path(tmp) / f"run{i}"
            for sub in ("a", "b", "c"):
                (work / sub).mkdir(parents=True)
            ratio, bound, _ = cut_and_resume(repos, work / "a", model_size)
            cut.append(ratio)
            shutil.rmtree(work)
        med = statistics.median
        print(
            f"cut and resume (12 drops after 1 MB each): bytes transferred / bytes missing = "
            f"{med(cut):.4f} median of {args.runs} (runs {', '.join(f'{x:.4f}' for x in cut)}); "
            f"target <= {bound:.4f} (1.0 + one 1 MiB chunk)"
        )
        ok = med(cut) <= bound
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
