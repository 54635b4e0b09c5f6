"""What a converge costs on the simulated fleet (tests/fleet): first converge per host, the no-op
re-converge of 1, 2 and 3 hosts, the remote commands a no-op re-run sends, and the slowest facts.

    sudo .venv/bin/python bench/converge.py [--runs 5] [--keep-up] [--reuse]

Brings the fleet up (harness.up(3)) under harness.exclusive(), converges each host once on its
own (`--limit wsN`: the first converge, one sample per host), then repeats the no-op re-run
--runs times for each of: ws1 alone (`--limit ws1`), the two serving hosts (`--limit ws1
--limit ws2`) and the whole fleet (no --limit). The whole-fleet figure includes ws3, which the
preflight refuses by design on every run: a fleet re-run pays for its refused hosts too.
Every re-run must report zero changes (pyinfra's "Grand total"); the bench says so when one
does not. The fleet is taken down at the end (--keep-up leaves it running; --reuse converges
an already running fleet instead of bringing a fresh one up, and then skips the first-converge
figures).

Each pyinfra run is the real CLI (`pyinfra -y inventories/sim.py deploys/freetoken.py`) in a
child process, started through this file's --pyinfra-hook mode, which counts every call the
SSH connector makes (run_shell_command, put_file, get_file, connect) and times it; a call is
attributed to the fact being gathered (pyinfra.api.facts._get_fact) or else the operation
being executed (pyinfra.api.operations._run_host_op). Wall times are the child's, from exec to
exit (interpreter start and imports included: what a user waits for).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOOK_FLAG = "--pyinfra-hook"
SERVING = ("ws1", "ws2")
ALL = ("ws1", "ws2", "ws3")


# --------------------------------------------------------------------------- the child's hook


def _run_hooked_pyinfra(out_path: str, argv: list[str]) -> int:
    """Run pyinfra's CLI in this process, recording every remote call it makes."""
    t_process = time.monotonic()
    from pyinfra.api import facts as api_facts
    from pyinfra.api import operations as api_ops
    from pyinfra.connectors.ssh import SSHConnector
    from pyinfra_cli.main import main as pyinfra_main

    calls: list[dict] = []
    stack: dict[str, list[tuple[str, str, str]]] = defaultdict(list)

    def where(host_name: str) -> tuple[str, str, str]:
        frames = stack.get(host_name)
        return frames[-1] if frames else ("other", "(outside facts and operations)", "")

    orig_get_fact = api_facts._get_fact

    def _get_fact(state, host, cls, args=None, kwargs=None, *rest, **kw):
        shown = {k: v for k, v in (kwargs or {}).items() if not k.startswith("_")}
        detail = ", ".join(f"{k}={v}" for k, v in shown.items())
        stack[host.name].append(("fact", cls.__name__, detail))
        try:
            return orig_get_fact(state, host, cls, args, kwargs, *rest, **kw)
        finally:
            stack[host.name].pop()

    api_facts._get_fact = _get_fact

    orig_run_host_op = api_ops._run_host_op

    def _run_host_op(state, host, op_hash):
        names = ", ".join(state.get_op_meta(op_hash).names) or "Operation"
        stack[host.name].append(("operation", names, ""))
        try:
            return orig_run_host_op(state, host, op_hash)
        finally:
            stack[host.name].pop()

    api_ops._run_host_op = _run_host_op

    try:  # the project's batched fact reads (facts/batch.py): one command for many facts
        from facts import batch as fact_batch
    except ImportError:
        fact_batch = None
    if fact_batch is not None:
        orig_run_batch = fact_batch.run_batch

        def run_batch(state, host, requests):
            names = sorted({r.cls.__name__ for r in requests})
            stack[host.name].append(("fact", f"batch of {len(requests)} facts",
                                     ", ".join(names)))
            try:
                return orig_run_batch(state, host, requests)
            finally:
                stack[host.name].pop()

        fact_batch.run_batch = run_batch

    def counted(method_name: str):
        orig = getattr(SSHConnector, method_name)

        def wrapper(self, *args, **kwargs):
            name = self.host.name
            kind, label, detail = where(name)
            t0 = time.monotonic()
            try:
                return orig(self, *args, **kwargs)
            finally:
                calls.append({"host": name, "call": method_name, "kind": kind, "label": label,
                              "detail": detail, "t0": t0 - t_process, "dt": time.monotonic() - t0})

        setattr(SSHConnector, method_name, wrapper)

    for method in ("connect", "run_shell_command", "put_file", "get_file"):
        counted(method)

    sys.argv = ["pyinfra", *argv]
    rc = 1
    try:
        rc = pyinfra_main()
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        Path(out_path).write_text(json.dumps({"calls": calls, "end": time.monotonic() - t_process}))
    return rc or 0


# --------------------------------------------------------------------------- the parent


class Run:
    def __init__(self, limit: tuple[str, ...], wall: float, rc: int, output: str, calls: list[dict]):
        self.limit, self.wall, self.rc, self.output, self.calls = limit, wall, rc, output, calls

    def changed(self) -> str:
        from tests.fleet.client import parse_grand_total

        total = parse_grand_total(self.output)
        return "?" if total is None else total[1]


def run_pyinfra(limit: tuple[str, ...] = ()) -> Run:
    from tests.fleet import harness

    with tempfile.NamedTemporaryFile(prefix="converge-bench-", suffix=".json", delete=False) as f:
        out = f.name
    args = ["-y"]
    for name in limit:
        args += ["--limit", name]
    args += ["inventories/sim.py", "deploys/freetoken.py"]
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), HOOK_FLAG, out, "--", *args],
        cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=3600,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    wall = time.monotonic() - t0
    try:
        calls = json.loads(Path(out).read_text() or "{}").get("calls", [])
    except ValueError:
        calls = []
    finally:
        os.unlink(out)
    return Run(limit, wall, proc.returncode, proc.stdout + proc.stderr, calls)


def stats(values: list[float]) -> str:
    if not values:
        return "-"
    return (f"median {statistics.median(values):6.2f} s  min {min(values):6.2f}  max {max(values):6.2f}"
            f"  (n={len(values)})")


def machine() -> str:
    from bench.fleet_up import machine as fleet_machine

    return fleet_machine()


def host_span(run: Run, host: str) -> float | None:
    """From the host's first remote call to the end of its last one (within a fleet run)."""
    mine = [c for c in run.calls if c["host"] == host]
    if not mine:
        return None
    return max(c["t0"] + c["dt"] for c in mine) - min(c["t0"] for c in mine)


def remote_commands(run: Run, host: str) -> Counter:
    """(kind, label, call) -> count; connect is not a remote command and is left out."""
    return Counter((c["kind"], c["label"], c["call"]) for c in run.calls
                   if c["host"] == host and c["call"] != "connect")


def print_first(runs: dict[str, Run]) -> None:
    print("\n== first converge, one host at a time (--limit wsN; n=1 each: it happens once per fleet) ==")
    for host, run in runs.items():
        n = sum(remote_commands(run, host).values())
        print(f"{host}: {run.wall:7.1f} s  changed ops: {run.changed():>3}  remote commands: {n}"
              + ("  (refused at preflight, by design)" if host == "ws3" else ""))


def print_noop(noop: dict[str, list[Run]]) -> None:
    print("\n== no-op re-converge (wall time of `pyinfra -y ...`, process start to exit) ==")
    labels = {"1": "1 host  (--limit ws1)", "2": "2 hosts (--limit ws1 --limit ws2, the serving hosts)",
              "3": "3 hosts (whole fleet; includes ws3, refused at preflight by design)"}
    medians = {}
    for key, runs in noop.items():
        walls = [r.wall for r in runs]
        medians[key] = statistics.median(walls) if walls else None
        print(f"{labels[key]}:\n    {stats(walls)}")
        not_noop = [r.changed() for r in runs if r.changed() != "-"]
        if not_noop:
            print(f"    WARNING: {len(not_noop)} of these runs changed something (changed ops: "
                  f"{', '.join(not_noop)}): not a no-op; figures are not comparable")
    if medians.get("1"):
        for key in ("2", "3"):
            if medians.get(key):
                print(f"ratio {key} hosts / 1 host: {medians[key] / medians['1']:.2f}")
    # Where one host's time goes, from the 1-host runs.
    ones = noop.get("1") or []
    if ones:
        connect = [sum(c["dt"] for c in r.calls if c["call"] == "connect") for r in ones]
        facts = [sum(c["dt"] for c in r.calls if c["kind"] == "fact" and c["call"] != "connect") for r in ones]
        ops = [sum(c["dt"] for c in r.calls if c["kind"] == "operation") for r in ones]
        first = [min((c["t0"] for c in r.calls), default=0.0) for r in ones]
        print("1 host, where the time goes (medians): "
              f"start-up before the first SSH call {statistics.median(first):.2f} s, "
              f"SSH connect {statistics.median(connect):.2f} s, facts {statistics.median(facts):.2f} s, "
              f"operation commands {statistics.median(ops):.2f} s")


def print_commands(runs: list[Run]) -> None:
    print("\n== remote commands of a no-op re-run, per host (whole-fleet run) ==")
    if not runs:
        return
    last = runs[-1]
    for host in ALL:
        counts = remote_commands(last, host)
        varying = {sum(remote_commands(r, host).values()) for r in runs}
        total = sum(counts.values())
        facts = sum(n for (kind, _, _), n in counts.items() if kind == "fact")
        ops = sum(n for (kind, _, _), n in counts.items() if kind == "operation")
        other = total - facts - ops
        note = "" if len(varying) == 1 else f"  (varies between runs: {sorted(varying)})"
        print(f"{host}: {total} remote commands: {facts} for facts, {ops} for operations"
              + (f", {other} other" if other else "") + note)
        for (kind, label, call), n in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1])):
            suffix = "" if call == "run_shell_command" else f" [{call}]"
            print(f"    {n:3d}  {kind:9s} {label}{suffix}")


def print_slowest_facts(runs: list[Run], top: int) -> None:
    print("\n== slowest facts of a no-op re-run (whole-fleet runs; median over runs of the per-run "
          "time, per host and fact) ==")
    per: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for run in runs:
        one: dict[tuple[str, str, str], float] = defaultdict(float)
        for c in run.calls:
            if c["kind"] == "fact" and c["call"] == "run_shell_command":
                one[(c["host"], c["label"], c["detail"])] += c["dt"]
        for key, value in one.items():
            per[key].append(value)
    ranked = sorted(per.items(), key=lambda kv: -statistics.median(kv[1]))[:top]
    for (host, label, detail), values in ranked:
        print(f"  {statistics.median(values):6.3f} s (max {max(values):.3f})  {host}  {label}"
              + (f"  ({detail[:70]})" if detail else ""))


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == HOOK_FLAG:
        rest = sys.argv[3:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        return _run_hooked_pyinfra(sys.argv[2], rest)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="no-op re-runs per fleet size (default 5)")
    ap.add_argument("--top", type=int, default=10, help="how many slowest facts to list")
    ap.add_argument("--reuse", action="store_true",
                    help="use the fleet that is already up (no first-converge figures)")
    ap.add_argument("--keep-up", action="store_true", help="leave the fleet running at the end")
    a = ap.parse_args()

    from tests.fleet import harness

    with harness.exclusive():
        print(machine())
        if not a.reuse or harness.load_state() is None:
            harness.down(quiet=True)
            harness.up(3)
            a.reuse = False
        try:
            if not a.reuse:
                first = {host: run_pyinfra((host,)) for host in ALL}
                print_first(first)
            else:
                warm = run_pyinfra()  # a reused fleet may hold a stale host: converge it first
                print(f"\n(reused fleet: a converge first, changed ops: {warm.changed()})")
            noop: dict[str, list[Run]] = {"1": [], "2": [], "3": []}
            for _ in range(a.runs):  # interleaved, so load on the shared machine hits all alike
                noop["1"].append(run_pyinfra(("ws1",)))
                noop["2"].append(run_pyinfra(SERVING))
                noop["3"].append(run_pyinfra())
            print_noop(noop)
            print_commands(noop["3"])
            print_slowest_facts(noop["3"], a.top)
        finally:
            if not a.keep_up:
                harness.down(quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
