"""How the gateway places requests (deploys/gateway.py, HAProxy) under a saturating load on hosts
of different speeds, on the simulated fleet (tests/fleet): least connections with no slot limit
(the placement the gateway had before its slots and weights) against today's slots and weights,
side by side in one run; figures, not assertions.

    sudo .venv/bin/python bench/routing.py [--seconds 40] [--tokens 24] [--reuse] [--keep-up] [--plots DIR]

The fleet: ws1 (the 16 GB profile: 1 slot, its engine stand-in decodes 23.5 tok/s per stream) and
ws2 (32 GB: 2 slots, 60 tok/s), so the fleet's capacity is 1 x 23.5 + 2 x 60 = 143.5 tok/s. The
load is twice the fleet's slots: 6 clients sending streamed chat completions back to back, 3 of
them conversations (`X-Session-Id`, one each), 3 without a session.

Each configuration is the gateway's own haproxy.cfg as the deploy wrote it, or rewritten by
`leastconn_without_slots` (least connections with no limit per host, so the rest queue inside the
engines; conversations on a second, consistently hashed backend; everything else, health and
agent checks included, as deployed), installed on the
gateway host (validated with `haproxy -c`, reloaded) and loaded for --seconds. Per configuration:
fleet tok/s (completion tokens received per second) over the capacity (goal: at least 0.9), p50
and p99 time to first token, the 5xx answers (goal: none while any slot is free), and the share
of a conversation's turns that stayed on its host. --plots DIR also writes PNG plots (needs
matplotlib: `pip install -e '.[bench]'`). The deployed config is put back at the end.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from freetoken_infra.core.hardware import HARDWARE_PROFILES  # noqa: E402
from freetoken_infra.core.launch import running_requests  # noqa: E402
from freetoken_infra.core.layout import GATEWAY_BACKEND, GATEWAY_CONFIG, SERVED_BY_HEADER, SESSION_HEADER  # noqa: E402
from freetoken_infra.fleet import parse_stat, runtime_command  # noqa: E402
from tests.fleet import harness  # noqa: E402
from tests.fleet.gateway_load import CLIENT_KEY, MODEL, PORT, converge_behind_gateway, write_keys  # noqa: E402
from tests.fleet.profiles import GATEWAY_ADDRESS, GATEWAY_NAME, PROFILES  # noqa: E402

HOSTS = ("ws1", "ws2")
SESSIONS_BACKEND = "freetoken_sessions"


@dataclass
class Turn:
    t0: float
    status: int = 0
    host: str | None = None
    ttft: float | None = None
    tokens: int = 0
    session: str | None = None


def one_turn(max_tokens: int, session: str | None) -> Turn:
    turn = Turn(time.time(), session=session)
    body = json.dumps(
        {"model": MODEL, "stream": True, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    )
    headers = {"Authorization": f"Bearer {CLIENT_KEY}", "Content-Type": "application/json"}
    if session:
        headers[SESSION_HEADER] = session
    conn = http.client.HTTPConnection(GATEWAY_ADDRESS, PORT, timeout=300)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        resp = conn.getresponse()
        turn.status, turn.host = resp.status, resp.getheader(SERVED_BY_HEADER)
        if resp.status != 200:
            resp.read()
            return turn
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            if any(c.get("delta", {}).get("content") for c in json.loads(line[6:]).get("choices", [])):
                turn.tokens += 1
                if turn.ttft is None:
                    turn.ttft = time.time() - turn.t0
    except (OSError, http.client.HTTPException):
        turn.status = turn.status or -1
    finally:
        conn.close()
    return turn


def load(seconds: float, max_tokens: int, clients: int = 6) -> tuple[list[Turn], float]:
    turns: list[Turn] = []
    lock = threading.Lock()
    deadline = time.time() + seconds

    def client(i: int) -> None:
        session = f"bench-conversation-{i}" if i % 2 == 0 else None
        while time.time() < deadline:
            t = one_turn(max_tokens, session)
            with lock:
                turns.append(t)
            if t.status >= 500:
                time.sleep(0.2)  # a client told to come back does not hammer

    start = time.time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return turns, time.time() - start


# A server line as operations/gateway.py writes it: name, address, its slots and weight, then
# options of its own (the host agent's check) that the placement leaves alone.
SERVER = re.compile(r"^    server (?P<name>\S+) (?P<address>\S+) maxconn \d+ weight \d+(?P<rest>(?: .*)?)$", re.M)


class UnexpectedConfig(ValueError):
    """The deployed haproxy.cfg lacks a part the rewrite relies on (the gateway's code changed)."""


def leastconn_without_slots(config: str) -> str:
    """The deployed haproxy.cfg with the placement the gateway had before its slots and weights:
    no `maxconn`/`weight` per host (least connections, the rest queued inside the engines), no
    conversation buckets (`use-server`, `set-var(txn.bucket)`), conversations on a second,
    consistently hashed backend whose servers track the first's. Raises UnexpectedConfig naming
    what it did not find."""
    session = SESSION_HEADER.lower()
    servers = [(m["name"], m["address"]) for m in SERVER.finditer(config)]
    if not servers:
        raise UnexpectedConfig("no `server NAME ADDRESS maxconn N weight W` line")
    if len(servers) != len(re.findall(r"^    server ", config, re.M)):
        raise UnexpectedConfig("a server line without `maxconn N weight W` after its address")
    text = SERVER.sub(lambda m: f"    server {m['name']} {m['address']}{m['rest']}", config)
    text = re.sub(r"^    use-server .*\n", "", text, flags=re.M)
    text = re.sub(r"^    http-request set-var\(txn\.bucket\).*\n", "", text, flags=re.M)
    default = f"    default_backend {GATEWAY_BACKEND}\n"
    if text.count(default) != 1:
        raise UnexpectedConfig(f"not one `{default.strip()}` line")
    text = text.replace(default, f"    use_backend {SESSIONS_BACKEND} if {{ req.hdr({session}) -m found }}\n{default}")
    retry = re.search(r"^    retry-on .*\n    retries .*\n    option redispatch .*\n", text, re.M)
    if retry is None:
        raise UnexpectedConfig("no `retry-on`, `retries`, `option redispatch` lines in a row")
    tracking = "".join(f"    server {n} {a} track {GATEWAY_BACKEND}/{n}\n" for n, a in servers)
    return (
        text
        + f"\nbackend {SESSIONS_BACKEND}\n    balance hdr({session})\n    hash-type consistent\n"
        + f"{retry.group(0)}{tracking}"
    )


def install(fleet: harness.Fleet, config: str) -> None:
    b64 = base64.b64encode(config.encode()).decode()
    new = GATEWAY_CONFIG + ".bench"
    fleet.run(
        GATEWAY_NAME,
        f"echo {b64} | base64 -d > {new} && haproxy -c -q -f {new} && mv -f {new} {GATEWAY_CONFIG} "
        "&& systemctl reload haproxy",
        check=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        states = {s.host: s.state for s in parse_stat(fleet.run(GATEWAY_NAME, runtime_command("show stat")).stdout)}
        if all(states.get(h) == "in service" for h in HOSTS):
            time.sleep(2)
            return
        time.sleep(0.5)
    raise RuntimeError(f"hosts not in service after the reload: {states}")


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def figures(turns: list[Turn], seconds: float, capacity: float) -> dict:
    ok = [t for t in turns if t.status == 200]
    homes: dict[str, Counter] = {}
    for t in ok:
        if t.session:
            homes.setdefault(t.session, Counter())[t.host or "?"] += 1
    kept = sum(c.most_common(1)[0][1] for c in homes.values())
    in_session = sum(sum(c.values()) for c in homes.values())
    tps = sum(t.tokens for t in ok) / seconds
    return {
        "requests": len(turns),
        "tok/s": tps,
        "of capacity": tps / capacity,
        "ttft p50 s": pct([t.ttft for t in ok if t.ttft is not None], 50),
        "ttft p99 s": pct([t.ttft for t in ok if t.ttft is not None], 99),
        "5xx": sum(1 for t in turns if t.status >= 500),
        "other failures": sum(1 for t in turns if t.status != 200 and t.status < 500),
        "session kept": kept / in_session if in_session else float("nan"),
        "by host": dict(Counter(t.host for t in ok)),
    }


def plot(results: dict[str, tuple[dict, list[Turn]]], folder: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots: not written, matplotlib is not installed (pip install -e '.[bench]')")
        return
    folder.mkdir(parents=True, exist_ok=True)
    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [results[n][0]["of capacity"] for n in names])
    axes[0].axhline(0.9, linestyle="--", color="grey")
    axes[0].set_title("fleet tok/s / capacity (goal >= 0.9)")
    for i, q in enumerate(("ttft p50 s", "ttft p99 s")):
        axes[1].bar([x + i * 0.4 for x in range(len(names))], [results[n][0][q] for n in names], width=0.4, label=q)
    axes[1].set_xticks([x + 0.2 for x in range(len(names))], names)
    axes[1].set_title("time to first token (s)")
    axes[1].legend()
    axes[2].bar(names, [results[n][0]["session kept"] for n in names])
    axes[2].set_title("conversation turns kept on their host")
    fig.tight_layout()
    fig.savefig(folder / "routing-summary.png", dpi=100)
    fig, ax = plt.subplots(figsize=(8, 4))
    for n in names:
        ttfts = sorted(t.ttft for t in results[n][1] if t.ttft is not None)
        ax.plot(ttfts, [i / max(1, len(ttfts) - 1) for i in range(len(ttfts))], label=n)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("share of requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "routing-ttft-cdf.png", dpi=100)
    print(f"plots: {folder / 'routing-summary.png'}, {folder / 'routing-ttft-cdf.png'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--tokens", type=int, default=24, help="max_tokens of each turn")
    ap.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    ap.add_argument("--reuse", action="store_true", help="measure the running, converged fleet and gateway")
    ap.add_argument("--keep-up", action="store_true", help="leave the fleet running")
    args = ap.parse_args()
    slots = {h: running_requests(HARDWARE_PROFILES[PROFILES[h].hardware_class]) for h in HOSTS}
    capacity = sum(slots[h] * PROFILES[h].tokens_per_s for h in HOSTS)
    with harness.exclusive():
        fleet = harness.Fleet() if args.reuse else harness.up(gateway=True)
        try:
            if not args.reuse:
                with tempfile.TemporaryDirectory() as d:
                    hosts, gateway = converge_behind_gateway(write_keys(Path(d) / "keys"), shared=False)
                    if hosts.returncode or gateway.returncode:
                        print("converge failed", file=sys.stderr)
                        return 1
            deployed = fleet.run(GATEWAY_NAME, f"cat {GATEWAY_CONFIG}", check=True).stdout
            configs = {"leastconn, no slots": leastconn_without_slots(deployed), "slots + weights": deployed}
            print(
                f"fleet: {', '.join(f'{h} {slots[h]} slot(s) x {PROFILES[h].tokens_per_s} tok/s' for h in HOSTS)}; "
                f"capacity {capacity:.1f} tok/s; 6 clients (3 conversations), {args.tokens} tokens a turn, "
                f"{args.seconds:.0f} s each"
            )
            results = {}
            try:
                for name, config in configs.items():
                    install(fleet, config)
                    turns, took = load(args.seconds, args.tokens)
                    results[name] = (figures(turns, took, capacity), turns)
            finally:
                install(fleet, deployed)
            keys = [k for k in next(iter(results.values()))[0] if k != "by host"]
            widths = {k: max(10, len(k) + 2) for k in keys}
            print(
                f"\n== placement under twice the fleet's slots ==\n{'':<20}"
                + "".join(f"{k:>{widths[k]}}" for k in keys)
            )
            for name, (row, _) in results.items():
                cells = "".join(
                    f"{row[k]:>{widths[k]}.2f}" if isinstance(row[k], float) else f"{row[k]:>{widths[k]}}" for k in keys
                )
                print(f"{name:<20}{cells}   by host {row['by host']}")
            print("goals: tok/s at least 0.9 of capacity; no 5xx while a slot is free")
            if args.plots:
                plot(results, args.plots)
        finally:
            if not args.keep_up:
                harness.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
