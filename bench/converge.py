"""What a converge costs on the simulated fleet (tests/fleet): the first converge of one host and of
the whole fleet through the LAN model cache, the no-op re-converge of growing parts of the fleet
against one host, where the time goes as the fleet grows, the remote commands a no-op re-run
sends per host, and the slowest facts.

    sudo .venv/bin/python bench/converge.py [--hosts N] [--sizes 1,2,3] [--runs 5] [--keep-up] [--reuse]

--hosts N (default FREETOKEN_SIM_HOSTS, else 3): the fleet's size; hosts beyond ws3 repeat the
healthy profiles (tests/fleet/profiles.py). --sizes: the parts of the fleet re-converged, each k
meaning ws1..wsk (`--limit` each; k = N is the whole fleet, no --limit); default 1,2,3 for 3
hosts, else 1, 3, N/2 and N. Every size includes ws3 from k = 3 on, which the preflight refuses
by design on every run: a fleet re-run pays for its refused hosts too. For every size the line
`ratio k hosts / 1 host: X` compares medians of wall time.

Every run passes `--data model_cache_host=ws1`: ws1 fetches the model from the hub stand-in and
serves it to the others (docs/deploy.md, "The model"). First converge, n=1 each (it happens once per
fleet): ws1 alone on a fresh one-host fleet (`harness.up(1)`), then all N hosts at once on a
fresh N-host fleet, with the bytes the hub stand-in sent over the model's size (target 1.0) and
the wall time against the one host's; then the memory each converged host costs (PSS, as
bench/fleet_up.py measures it). Then the no-op re-runs, --runs times per size, interleaved.
Every re-run must report zero changes (pyinfra's "Grand total"); the bench says so when one
does not. The fleet is taken down at the end (--keep-up leaves it running; --reuse converges
an already running fleet instead of bringing a fresh one up, and then skips the first-converge
figures).

Each pyinfra run is the real CLI (`pyinfra -y inventories/sim.py deploys/freetoken.py`) in a
child process, started through this file's --pyinfra-hook mode, which counts every call the
SSH connector makes (run_shell_command, put_file, get_file, connect) and times it; a call is
attributed to the fact being gathered (pyinfra.api.facts._get_fact) or else the operation
being executed (pyinfra.api.operations._run_host_op). Wall times are the child's, from exec to
exit (interpreter start and imports included: what a user waits for). Where the time goes is
measured, per run: the wall-clock phases of the child (start-up before its first SSH call, the
span of the connects, of the fact reads, of the operations' commands, and the rest up to its
exit), the CPU the controller used (the child's rusage) and the CPU the hosts used, against the
cores of the machine. Each host's CPU is read from a cpuacct cgroup the bench puts the host's
processes in (nanoseconds, ended processes included), before and after the run; where the machine
has no cgroup v1 cpuacct, from utime+stime+cutime+cstime summed over the processes in the host's
network namespace (10 ms clock ticks: commands that ended count through their reaper). Either
way the host's resident services that poll on their own clock, deploy or not (the owner agent),
are counted apart and printed as a rate: they are not the run's cost. The bytes each host's link carried in a run (its eth0 in its network namespace, both
ways: SSH with its handshake) are counted the same way, and each host's medians are printed with
how many of its runs the fast check answered (docs/fast-check.md); the 50- and
100-host projections use the measured per-host controller CPU, host CPU and bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
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
PROFILE_ENV = "FREETOKEN_BENCH_CPROFILE"  # the child profiles the controller into this file
BATCHES_ENV = "FREETOKEN_BENCH_BATCHES"  # the child records each host's batched fact commands
# Runs each command of a fact batch on the host on its own, with the CPU (own rusage of its
# children) and wall time it took; the commands come as JSON on stdin. Facts only observe.
FACT_COSTS_SCRIPT = r"""
import json, resource, subprocess, sys, time
out = []
for command in json.load(sys.stdin):
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    subprocess.run(["sh", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    out.append([cpu, time.monotonic() - t0])
print(json.dumps(out))
"""
CACHE_HOST = "ws1"
CACHE_DATA = ("--data", f"model_cache_host={CACHE_HOST}")
REFUSED = ("ws3",)  # refused at preflight by design (tests/fleet/profiles.py)


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

    try:  # the host lock's take, with the no-op fast check (operations/host_lock.py)
        from operations import host_lock as lock_ops
    except ImportError:
        lock_ops = None  # type: ignore[assignment]
    if lock_ops is not None:
        orig_take = lock_ops.take

        def take(state, host, *args, **kwargs):
            fast = kwargs.get("unchanged_if") is not None
            stack[host.name].append(("lock", "the host lock" + (" and the fast check" if fast else ""), ""))
            try:
                return orig_take(state, host, *args, **kwargs)
            finally:
                stack[host.name].pop()

        lock_ops.take = take

    try:  # the project's batched fact reads (facts/batch.py): one command for many facts
        from facts import batch as fact_batch
    except ImportError:
        fact_batch = None  # type: ignore[assignment]
    if fact_batch is not None:
        orig_run_batch = fact_batch.run_batch

        def run_batch(state, host, requests, first=None):
            names = sorted({r.cls.__name__ for r in requests})
            label = f"batch of {len(requests)} facts" + (" after the host lock" if first else "")
            stack[host.name].append(("fact", label, ", ".join(names)))
            try:
                return orig_run_batch(state, host, requests, first)
            finally:
                stack[host.name].pop()

        fact_batch.run_batch = run_batch

        orig_batch_command = fact_batch.batch_command

        def batch_command(commands, first=None, **kwargs):
            text = orig_batch_command(commands, first, **kwargs)
            made[text] = list(commands)
            return text

        fact_batch.batch_command = batch_command
    made: dict[str, list[str]] = {}  # a batch's command -> its facts' commands
    batches: dict[str, list[str]] = {}  # host -> its last batch's facts' commands
    keep_batches = bool(os.environ.get(BATCHES_ENV))

    def counted(method_name: str):
        orig = getattr(SSHConnector, method_name)

        def wrapper(self, *args, **kwargs):
            name = self.host.name
            kind, label, detail = where(name)
            t0 = time.monotonic()
            if keep_batches and label.startswith("batch of") and args:
                command = args[0]
                text = command.get_masked_value() if hasattr(command, "get_masked_value") else str(command)
                if text in made:
                    batches[name] = made[text]
            try:
                return orig(self, *args, **kwargs)
            finally:
                calls.append(
                    {
                        "host": name,
                        "call": method_name,
                        "kind": kind,
                        "label": label,
                        "detail": detail,
                        "t0": t0 - t_process,
                        "dt": time.monotonic() - t0,
                    }
                )

        setattr(SSHConnector, method_name, wrapper)

    for method in ("connect", "run_shell_command", "put_file", "get_file"):
        counted(method)

    sys.argv = ["pyinfra", *argv]
    rc = 1
    profile_to = os.environ.get(PROFILE_ENV)
    profiler = None
    if profile_to:
        import cProfile

        profiler = cProfile.Profile(time.process_time)  # CPU, not the waits on the hosts
        profiler.enable()
    try:
        rc = pyinfra_main()
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        if profiler is not None and profile_to:
            profiler.disable()
            profiler.dump_stats(profile_to)
        Path(out_path).write_text(json.dumps({"calls": calls, "end": time.monotonic() - t_process, "batches": batches}))
    return rc or 0


# --------------------------------------------------------------------------- the parent


# Each simulated host's CPU is counted in a cpuacct cgroup (v1) of its own, in nanoseconds and with
# the processes that ended in a run included; the host's resident services that poll on their own
# clock whether or not a deploy runs (the owner agent, once a second) in one below it, counted apart.
CGROUPS = Path("/sys/fs/cgroup/cpuacct/freetoken-bench")
RESIDENT = ("/usr/local/lib/freetoken/owner_agent.py",)  # in a process's command line


def _netns_pids(netns: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()


def _is_resident(pid: str) -> bool:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return any(r in command for r in RESIDENT)


def place_hosts() -> bool:
    """Put every process of each running simulated host into its cgroup (its resident services
    into the one below it); what they start from then on is counted there too. False when this
    machine has no cgroup v1 cpuacct hierarchy to do it in (then ``host_cpu_seconds`` sums clock
    ticks over the hosts' processes instead)."""
    from tests.fleet import harness

    if not CGROUPS.parent.is_dir():
        return False
    try:
        for name, h in (harness.load_state() or {"hosts": {}})["hosts"].items():
            (CGROUPS / name / "resident").mkdir(parents=True, exist_ok=True)
            for pid in _netns_pids(h["netns"]):
                target = CGROUPS / name / ("resident" if _is_resident(pid) else "")
                try:
                    (target / "cgroup.procs").write_text(pid)
                except OSError:  # ended meanwhile
                    pass
    except OSError:
        return False
    return True


def remove_cgroups() -> None:
    for folder in sorted(CGROUPS.glob("*/resident")) + sorted(CGROUPS.glob("*")) + [CGROUPS]:
        try:
            folder.rmdir()
        except OSError:  # still holds a process (a fleet kept up): left for the next run
            pass


def _usage(folder: Path) -> float:
    return int((folder / "cpuacct.usage").read_text()) / 1e9


def host_cpu_seconds(resident: bool = False) -> dict[str, float]:
    """CPU seconds each running simulated host has used, its resident services' excepted (with
    ``resident``: theirs alone): from its cgroup (``place_hosts``), else the sum of utime+stime+
    cutime+cstime over the processes in its network namespace (10 ms clock ticks; a command that
    ended counts through its reaper) with the resident services' processes left out."""
    from tests.fleet import harness

    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for name, h in (harness.load_state() or {"hosts": {}})["hosts"].items():
        folder = CGROUPS / name
        if (folder / "resident" / "cpuacct.usage").exists():
            own = _usage(folder / "resident")
            out[name] = own if resident else _usage(folder) - own
            continue
        total = 0
        for pid in _netns_pids(h["netns"]):
            if _is_resident(pid) != resident:
                continue
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        out[name] = total / tick
    return out


def host_link_bytes() -> dict[str, int]:
    """Bytes each running simulated host's link (its eth0, both ways) has carried: SSH and its
    handshakes, and whatever else the run made the host fetch."""
    from tests.fleet import harness

    out: dict[str, int] = {}
    for name, h in (harness.load_state() or {"hosts": {}})["hosts"].items():
        r = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                h["netns"],
                "cat",
                "/sys/class/net/eth0/statistics/rx_bytes",
                "/sys/class/net/eth0/statistics/tx_bytes",
            ],
            capture_output=True,
            text=True,
        )
        try:
            out[name] = sum(int(x) for x in r.stdout.split())
        except ValueError:
            continue
    return out


class Run:
    def __init__(
        self,
        limit: tuple[str, ...],
        wall: float,
        rc: int,
        output: str,
        calls: list[dict],
        end: float,
        cpu_controller: float,
        cpu_hosts: dict[str, float],
        batches: dict[str, list[str]] | None = None,
        bytes_hosts: dict[str, int] | None = None,
        resident: dict[str, float] | None = None,
    ):
        self.limit, self.wall, self.rc, self.output, self.calls = limit, wall, rc, output, calls
        self.end, self.cpu_controller, self.cpu_hosts = end, cpu_controller, cpu_hosts
        self.batches = batches or {}
        self.bytes_hosts = bytes_hosts or {}
        self.resident = resident or {}  # each host's resident services, CPU-s per second of the run

    def changed(self) -> str:
        from tests.fleet.client import parse_grand_total

        total = parse_grand_total(self.output)
        return "?" if total is None else total[1]

    def hosts(self) -> list[str]:
        from freetoken_infra.core.settings import natural_key

        return sorted({c["host"] for c in self.calls}, key=natural_key)


def answered_from_record(run: Run) -> int:
    """How many hosts of ``run`` the fast check answered (a converge's record or a refusal's)."""
    return sum(
        bool(re.search(r"\] (refused, )?unchanged since its last (converge|full read) \(", line))
        for line in run.output.splitlines()
    )


def run_pyinfra(
    limit: tuple[str, ...] = (), extra: tuple[str, ...] = CACHE_DATA, env: dict[str, str] | None = None
) -> Run:
    from tests.fleet import harness

    with tempfile.NamedTemporaryFile(prefix="converge-bench-", suffix=".json", delete=False) as f:
        out = f.name
    args = ["-y", *extra]
    for name in limit:
        args += ["--limit", name]
    args += ["inventories/sim.py", "deploys/freetoken.py"]
    bytes_before = host_link_bytes()
    place_hosts()  # a resident service restarted since (a converge) goes back into its own cgroup
    resident_before = host_cpu_seconds(resident=True)
    cpu_before, usage_before = host_cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), HOOK_FLAG, out, "--", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=3600,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir()), **(env or {})},
    )
    wall = time.monotonic() - t0
    usage, cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN), host_cpu_seconds()
    resident_after = host_cpu_seconds(resident=True)
    controller = (usage.ru_utime + usage.ru_stime) - (usage_before.ru_utime + usage_before.ru_stime)
    hosts = {n: cpu_after[n] - cpu_before.get(n, 0.0) for n in cpu_after}
    resident = {n: (resident_after[n] - resident_before.get(n, 0.0)) / wall for n in resident_after}
    bytes_after = host_link_bytes()
    link = {n: bytes_after[n] - bytes_before[n] for n in bytes_after if n in bytes_before}
    try:
        doc = json.loads(Path(out).read_text() or "{}")
    except ValueError:
        doc = {}
    finally:
        os.unlink(out)
    return Run(
        limit,
        wall,
        proc.returncode,
        proc.stdout + proc.stderr,
        doc.get("calls", []),
        doc.get("end", wall),
        controller,
        hosts,
        doc.get("batches"),
        link,
        resident,
    )


def stats(values: list[float]) -> str:
    if not values:
        return "-"
    return (
        f"median {statistics.median(values):6.2f} s  min {min(values):6.2f}  max {max(values):6.2f}  (n={len(values)})"
    )


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
    return Counter(
        (c["kind"], c["label"], c["call"]) for c in run.calls if c["host"] == host and c["call"] != "connect"
    )


def covered(calls: list[dict]) -> float:
    """Wall-clock seconds during which at least one of `calls` was in flight."""
    total, reach = 0.0, None
    for start, stop in sorted((c["t0"], c["t0"] + c["dt"]) for c in calls):
        if reach is None or start > reach:
            total += stop - start
            reach = stop
        elif stop > reach:
            total += stop - reach
            reach = stop
    return total


def phases(run: Run) -> dict[str, float]:
    """Where one run's wall time went (seconds): the child's start-up before its first SSH call,
    the time connects / fact reads / operation commands were in flight (on any host), the rest
    of the child's life (the deploy code between calls, output, the report), the CPU of the
    controller and of the hosts."""
    first = min((c["t0"] for c in run.calls), default=run.end)
    connect = covered([c for c in run.calls if c["call"] == "connect"])
    facts = covered([c for c in run.calls if c["kind"] == "fact" and c["call"] != "connect"])
    ops = covered([c for c in run.calls if c["kind"] == "operation" and c["call"] != "connect"])
    return {
        "start-up": first,
        "connect": connect,
        "facts": facts,
        "operations": ops,
        "rest": max(0.0, run.end - first - covered(run.calls)),
        "controller CPU": run.cpu_controller,
        "hosts' CPU": sum(run.cpu_hosts.values()),
    }


def median_phases(runs: list[Run]) -> str:
    per = [phases(r) for r in runs]
    cores = os.cpu_count() or 1
    keys = list(per[0]) if per else []
    text = ", ".join(f"{k} {statistics.median(p[k] for p in per):.2f} s" for k in keys)
    busy = statistics.median((p["controller CPU"] + p["hosts' CPU"]) / r.wall for p, r in zip(per, runs, strict=False))
    return f"{text}; CPU busy {busy:.2f} of {cores} cores"


def size_label(k: int, n: int) -> str:
    what = "whole fleet, no --limit" if k == n else ("ws1" if k == 1 else f"--limit ws1..ws{k}")
    refused = [h for h in REFUSED if int(h[2:]) <= k]
    return f"{k} host{'s' if k > 1 else ''} ({what}" + (
        f"; includes {', '.join(refused)}, refused at preflight by design)" if refused else ")"
    )


def limit_for(k: int, n: int) -> tuple[str, ...]:
    return () if k == n else tuple(f"ws{i}" for i in range(1, k + 1))


def upstream_ratio(fleet) -> float:
    """Bytes the hub stand-in sent since its last reset, over the model's size."""
    from tests.fleet.client import hub
    from tests.fleet.standins import hub_repos

    size = sum(len(b) for b in hub_repos.repo_files(hub_repos.SUPPORTED_REPO).values())
    return sum(hub(fleet, "/_standin/stats")["by_file"].values()) / size


def first_converge(n: int) -> None:
    """ws1 alone on a fresh 1-host fleet, then all n hosts at once on a fresh n-host fleet (left
    up for the no-op runs); both through the LAN cache setting; prints the figures."""
    from bench.fleet_up import format_memory, host_memory
    from tests.fleet import harness

    print("\n== first converge (n=1 each: it happens once per fleet; model_cache_host=ws1) ==")
    results = []
    memory: dict[str, tuple[int, int]] = {}
    for size in (1, n) if n > 1 else (1,):
        harness.down(quiet=True)
        fleet = harness.up(size)
        run = run_pyinfra()
        results.append((size, run, upstream_ratio(fleet)))
        memory = host_memory()  # of the last fleet: n hosts
    for size, run, ratio in results:
        commands = [sum(remote_commands(run, h).values()) for h in run.hosts()]
        label = "1 host  (ws1, a fresh 1-host fleet)" if size == 1 else f"{size} hosts at once (a fresh fleet)"
        print(
            f"{label}: {run.wall:7.1f} s  changed ops: {run.changed():>3}  "
            f"upstream bytes / model size: {ratio:.3f} (target 1.0)  "
            f"remote commands per host: max {max(commands, default=0)}"
        )
        print(f"    where the time goes: {median_phases([run])}")
    if n > 1:
        one, many = results[0][1], results[-1][1]
        print(f"ratio first converge {n} hosts / 1 host: {many.wall / one.wall:.2f}")
        spans = {h: host_span(many, h) or 0.0 for h in many.hosts()}
        print(
            "    per host, first to last remote call: "
            + ", ".join(f"{h} {spans[h]:.0f} s" + (" (refused)" if h in REFUSED else "") for h in spans)
        )
    print(format_memory("converged, engines serving", memory, None))
    # The run after a first converge still reads some facts one by one: the checksums of files
    # the first converge created (nothing asked for them while the files did not exist), which
    # facts/batch.py learns for the runs after it. Shown, not counted among the no-op runs.
    second = run_pyinfra()
    counts = [sum(remote_commands(second, h).values()) for h in second.hosts()]
    print(
        f"the run right after it (learns what to batch; not counted below): {second.wall:.1f} s, "
        f"changed ops: {second.changed()}, remote commands per host: max {max(counts, default=0)}, "
        f"median {statistics.median(counts) if counts else 0:g}"
    )


def print_noop(noop: dict[int, list[Run]], n: int) -> None:
    print("\n== no-op re-converge (wall time of `pyinfra -y ...`, process start to exit) ==")
    medians: dict[int, float] = {}
    for k, runs in noop.items():
        walls = [r.wall for r in runs]
        if walls:
            medians[k] = statistics.median(walls)
        print(f"{size_label(k, n)}:\n    {stats(walls)}")
        not_noop = [r.changed() for r in runs if r.changed() != "-"]
        if not_noop:
            print(
                f"    WARNING: {len(not_noop)} of these runs changed something (changed ops: "
                f"{', '.join(not_noop)}): not a no-op; figures are not comparable"
            )
    if medians.get(1):
        for k in noop:
            if k != 1 and medians.get(k):
                print(f"ratio {k} hosts / 1 host: {medians[k] / medians[1]:.2f}")
    print(
        "\n== where the time goes as the fleet grows (no-op re-runs, medians; phases are wall-clock "
        "seconds with a call in flight on any host, CPU in core-seconds) =="
    )
    for k, runs in noop.items():
        print(f"{k:3d} host{'s' if k > 1 else ' '}: {median_phases(runs)}")
        per_host = [
            c["dt"] for r in runs for c in r.calls if c["kind"] in ("fact", "lock") and c["call"] == "run_shell_command"
        ]
        cpu = [v for r in runs for h, v in r.cpu_hosts.items() if h in r.hosts()]
        link = [v for r in runs for h, v in r.bytes_hosts.items() if h in r.hosts()]
        if per_host:
            print(
                f"      one round trip (the lock, or facts): median {statistics.median(per_host):.2f} s, "
                f"max {max(per_host):.2f}; per host and run: CPU median "
                f"{statistics.median(cpu) if cpu else 0:.3f} s (min {min(cpu, default=0):.3f}, max "
                f"{max(cpu, default=0):.3f}), bytes on its link median {statistics.median(link) if link else 0:.0f}"
            )
        names = sorted({h for r in runs for h in r.hosts()}, key=lambda h: (len(h), h))
        each = []
        for h in names:
            values = [r.cpu_hosts[h] for r in runs if h in r.cpu_hosts and h in r.hosts()]
            sent = [r.bytes_hosts[h] for r in runs if h in r.bytes_hosts and h in r.hosts()]
            fast = sum(
                f"[{h}] unchanged since its last converge" in r.output
                or f"[{h}] refused, unchanged since its last full read" in r.output
                for r in runs
            )
            if values:
                each.append(
                    f"{h} {statistics.median(values):.3f} CPU-s {statistics.median(sent) / 1024 if sent else 0:.1f} KiB"
                    f"{' (refused at preflight by design)' if h in REFUSED else ''} fast check {fast}/{len(runs)}"
                )
        print("      each host, medians: " + "; ".join(each))
        rates = [v for r in runs for h, v in r.resident.items() if h in r.hosts() and v > 0]
        if rates:
            print(
                f"      not counted above: each host's resident services (the owner agent polling), "
                f"median {statistics.median(rates):.3f} CPU-s per second of the run, deploy or not"
            )
    ones, alls = noop.get(1), noop.get(n)
    if ones and alls and n > 1:
        cores = os.cpu_count() or 1
        med = statistics.median
        controller_step = (med(r.cpu_controller for r in alls) - med(r.cpu_controller for r in ones)) / (n - 1)
        per_host_cpu = med(v for r in alls for v in r.cpu_hosts.values() if v > 0)
        link = [v for r in alls for h, v in r.bytes_hosts.items() if h in r.hosts()]
        per_host_bytes = med(link) if link else 0
        needed = med(r.cpu_controller + sum(r.cpu_hosts.values()) for r in alls)
        print(
            f"from 1 to {n} hosts: the controller's CPU grows {controller_step:.3f} s per added host; "
            f"a host's run costs {per_host_cpu:.2f} CPU-s on the host (median); at {n} hosts the run "
            f"needs {needed:.1f} CPU-s, {needed / cores:.1f} s on this machine's {cores} cores at best, "
            f"while every simulated host shares them (on real PCs each host's share runs on its own CPU)"
        )
        base = med(r.cpu_controller for r in ones)
        for size in (50, 100):  # linear in the measured per-host step
            controller = base + (size - 1) * controller_step
            print(
                f"projected at {size} hosts: the controller {controller:.1f} CPU-s per no-op run "
                f"({controller / cores:.1f} s on {cores} cores at best), each host {per_host_cpu:.2f} CPU-s "
                f"on its own CPU and {per_host_bytes / 1024:.0f} KiB on its link, "
                f"{size * per_host_bytes / 1024 / 1024:.1f} MiB through the controller's"
            )


def print_parallel(parallel: dict[int, list[Run]], ones: list[Run], n: int) -> None:
    """The whole fleet's no-op run with pyinfra's --parallel P (at most P hosts at a time)."""
    if not parallel:
        return
    print(f"\n== no-op re-converge of the whole fleet ({n} hosts) with pyinfra --parallel P ==")
    one = statistics.median(r.wall for r in ones) if ones else None
    for p, runs in parallel.items():
        walls = [r.wall for r in runs]
        print(
            f"--parallel {p}: {stats(walls)}"
            + (f"; ratio to 1 host: {statistics.median(walls) / one:.2f}" if one and walls else "")
        )


def print_commands(runs: list[Run]) -> None:
    print("\n== remote commands of a no-op re-run, per host (whole-fleet run; target <= 2) ==")
    if not runs:
        return
    last = runs[-1]
    hosts = last.hosts()
    totals = {h: sum(remote_commands(last, h).values()) for h in hosts}
    for host in hosts:
        counts = remote_commands(last, host)
        varying = {sum(remote_commands(r, host).values()) for r in runs}
        total = totals[host]
        lock = sum(c for (kind, _, _), c in counts.items() if kind == "lock")
        facts = sum(c for (kind, _, _), c in counts.items() if kind == "fact")
        ops = sum(c for (kind, _, _), c in counts.items() if kind == "operation")
        other = total - lock - facts - ops
        note = "" if len(varying) == 1 else f"  (varies between runs: {sorted(varying)})"
        print(
            f"{host}: {total} remote commands: {lock} for the lock, {facts} for facts, {ops} for operations"
            + (f", {other} other" if other else "")
            + note
        )
        if host in ("ws1", "ws2", "ws3") or total > 2:
            for (kind, label, call), c in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1])):
                suffix = "" if call == "run_shell_command" else f" [{call}]"
                print(f"    {c:3d}  {kind:9s} {label}{suffix}")
    if totals:
        over = [h for h, t in totals.items() if t > 2]
        print(
            f"per host: max {max(totals.values())}, median {statistics.median(totals.values()):g} "
            f"over {len(totals)} hosts" + (f"; over the target: {', '.join(over)}" if over else "")
        )


def print_slowest_facts(runs: list[Run], top: int) -> None:
    print(
        "\n== slowest facts of a no-op re-run (whole-fleet runs; median over runs of the per-run "
        "time, per host and fact) =="
    )
    per: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for run in runs:
        one: dict[tuple[str, str, str], float] = defaultdict(float)
        for c in run.calls:
            if c["kind"] == "fact" and c["call"] == "run_shell_command":
                one[(c["host"], c["label"], c["detail"])] += c["dt"]
        for key, value in one.items():
            per[key].append(value)
    ranked = sorted(per.items(), key=lambda kv: -statistics.median(kv[1]))[:top]
    if not ranked:
        print("  none: every host answered from its record (docs/fast-check.md)")
    for (host, label, detail), values in ranked:
        print(
            f"  {statistics.median(values):6.3f} s (max {max(values):.3f})  {host}  {label}"
            + (f"  ({detail[:70]})" if detail else "")
        )


def print_controller_profile(n: int, top: int) -> None:
    """One more whole-fleet no-op run, its controller under cProfile: where the controller's CPU
    goes (the functions with the most time of their own, and the deploy-level callers)."""
    import pstats

    with tempfile.NamedTemporaryFile(prefix="converge-bench-", suffix=".prof", delete=False) as f:
        path = f.name
    try:
        run = run_pyinfra(env={PROFILE_ENV: path})
        print(
            f"\n== the controller's CPU in a no-op run of {n} hosts (cProfile, CPU time; this run took "
            f"{run.wall:.1f} s with the profiler's overhead, controller CPU {run.cpu_controller:.2f} s) =="
        )
        st = pstats.Stats(path)
        rows = []
        for (file, line, func), (_, calls, own, cumulative, _) in st.stats.items():
            where = file.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
            rows.append((own, cumulative, calls, f"{where}:{line} {func}"))
        print("  own s   cum s      calls  function")
        for own, cumulative, calls, name in sorted(rows, reverse=True)[:top]:
            print(f"  {own:5.2f}  {cumulative:6.2f}  {calls:9d}  {name}")
    finally:
        os.unlink(path)


def print_fact_costs(host: str, top: int) -> None:
    """What one host's fact batch costs on the host, command by command: a no-op run of that host
    records its batch's commands, which then run again on the host one at a time, timed."""
    from tests.fleet import harness

    run = run_pyinfra((host,), env={BATCHES_ENV: "1"})
    commands = run.batches.get(host)
    if not commands:
        print(f"\n(no fact batch recorded for {host})")
        return
    r = subprocess.run(
        harness.Fleet().ssh_argv(host) + ["python3 -c " + shlex.quote(FACT_COSTS_SCRIPT)],
        input=json.dumps(commands),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        print(f"\n(fact costs on {host} failed: {r.stderr[-500:]})")
        return
    costs = json.loads(r.stdout)
    total_cpu, total_wall = sum(c for c, _ in costs), sum(w for _, w in costs)
    print(
        f"\n== {host}'s fact batch on the host, command by command ({len(commands)} commands, each run "
        f"alone: CPU {total_cpu:.2f} s, wall {total_wall:.2f} s in all; the costliest) =="
    )
    ranked = sorted(zip(costs, commands, strict=False), key=lambda cc: -cc[0][0])[:top]
    for (cpu, wall), command in ranked:
        print(f"  CPU {cpu:5.3f} s  wall {wall:5.3f} s  {' '.join(command.split())[:90]}")


def parse_sizes(text: str | None, n: int) -> list[int]:
    if not text:
        return [1, 2, 3] if n == 3 else sorted({k for k in (1, 3, n // 2, n) if 1 <= k <= n})
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise SystemExit(f"--sizes {text!r}: give host counts, e.g. 1,3,12") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > n:
        raise SystemExit(f"--sizes {text!r}: each size from 1 to the fleet's {n} hosts")
    return sorted({1, *sizes})  # every ratio is against 1 host


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == HOOK_FLAG:
        rest = sys.argv[3:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        return _run_hooked_pyinfra(sys.argv[2], rest)

    from tests.fleet import harness

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=None, help="hosts in the fleet (default: FREETOKEN_SIM_HOSTS, else 3)")
    ap.add_argument(
        "--sizes",
        default=None,
        help="comma-separated parts of the fleet to re-converge, k = ws1..wsk "
        "(default 1,2,3 for 3 hosts, else 1,3,N/2,N)",
    )
    ap.add_argument("--runs", type=int, default=5, help="no-op re-runs per size (default 5)")
    ap.add_argument("--top", type=int, default=10, help="how many slowest facts to list")
    ap.add_argument("--reuse", action="store_true", help="use the fleet that is already up (no first-converge figures)")
    ap.add_argument("--keep-up", action="store_true", help="leave the fleet running at the end")
    ap.add_argument(
        "--parallel",
        default="",
        type=lambda text: [int(x) for x in text.split(",") if x],
        help="also re-converge the whole fleet with pyinfra --parallel P, for each P given (e.g. 2,4)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="one more whole-fleet no-op run with the controller under cProfile, and "
        "ws1's fact batch on the host command by command",
    )
    a = ap.parse_args()
    n = harness.host_count() if a.hosts is None else a.hosts
    sizes = parse_sizes(a.sizes, n)

    with harness.exclusive():
        print(machine())
        state = harness.load_state()
        if a.reuse and state is not None and len(state["hosts"]) != n:
            print(f"(the running fleet has {len(state['hosts'])} hosts, not {n}: bringing up a fresh one)")
            a.reuse = False
        if not a.reuse or state is None:
            a.reuse = False
        try:
            counted = "cgroup v1 cpuacct, ns" if place_hosts() else "clock ticks of the hosts' processes, 10 ms"
            print(f"(each host's CPU from: {counted}; its resident services counted apart)")
            if not a.reuse:
                first_converge(n)
            else:
                warm = run_pyinfra()  # a reused fleet may hold a stale host: converge it first
                print(f"\n(reused fleet: a converge first, changed ops: {warm.changed()})")
            # The run after a converge that changed something reads every fact once more and
            # records (docs/fast-check.md); the timed no-op runs are the steady ones.
            warm = run_pyinfra()
            print(
                f"(the whole fleet's first re-run after its converge: {warm.wall:.2f} s, changed ops: "
                f"{warm.changed()}, fast check {answered_from_record(warm)} of {n} hosts)"
            )
            noop: dict[int, list[Run]] = {k: [] for k in sizes}
            for _ in range(a.runs):  # interleaved, so load on the shared machine hits all alike
                for k in sizes:
                    noop[k].append(run_pyinfra(limit_for(k, n)))
            parallel: dict[int, list[Run]] = {p: [] for p in a.parallel}
            for _ in range(a.runs if parallel else 0):
                for p in parallel:
                    parallel[p].append(run_pyinfra(extra=CACHE_DATA + ("--parallel", str(p))))
            print_noop(noop, n)
            print_parallel(parallel, noop.get(1) or [], n)
            print_commands(noop[n] if n in noop else noop[sizes[-1]])
            print_slowest_facts(noop[sizes[-1]], a.top)
            if a.profile:
                print_controller_profile(n, a.top + 10)
                print_fact_costs(CACHE_HOST, a.top + 5)
        finally:
            if not a.keep_up:
                harness.down(quiet=True)
                remove_cgroups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
