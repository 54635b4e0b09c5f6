"""Preflight inside a pyinfra deploy: gather the facts, run the rules, print the
findings, and stop a host that has a blocker before anything on it changes.

Used by deploys/doctor.py (read-only) and deploys/freetoken.py (first step; it then gathers
what its plan reads, ``gather``, and stops a host as the plan says, ``stop_host``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import click
import pyinfra
from pyinfra.api.exceptions import PyinfraError
from pyinfra.facts.systemd import SystemdStatus

from facts import batch
from facts.cuda import CudaToolchain
from facts.engine import EngineHealth, EngineInstall
from facts.files import FileBytes, FileText
from facts.gpu import NvidiaGpus
from facts.gpu_memory import GpuMemoryProbe
from facts.guard import GuardState
from facts.init import InitSystem
from facts.model import ModelDirectory
from facts.model_manifest import ModelManifest
from facts.resources import HostResources
from facts.restart import RestartPending
from facts.wake_on_lan import WakeOnLanReadiness
from facts.windows import WindowsFile, WindowsProfileInfo, WindowsUserProfile, WslConfFile, WslConfigFile
from facts.windows_tasks import WslDistroName
from facts.wsl import InteropAsService, InteropRegistration, WslKernel, WslVersion
from freetoken_infra import plan, rules
from freetoken_infra.core import owner
from freetoken_infra.core.gate_record import GateRecordError, GateResult
from freetoken_infra.core.layout import (
    AGENT_STATE_FILE,
    DEFAULT_DRIVE_ROOT,
    ENGINE_UNIT,
    WSL_CONF,
    WSLCONFIG_NAME,
    HostLayout,
)
from freetoken_infra.core.pyinfra_internals import connection_lost, reached_host_names
from freetoken_infra.core.records import RECORD_ENV, RunRecords, Unchanged
from freetoken_infra.core.settings import Settings, SettingsError, controller_key, validate_inventory
from freetoken_infra.core.text import printable
from freetoken_infra.core.wsl_ini import drive_root
from freetoken_infra.report import findings_table, fleet_summary, print_gate_report_if_gated, record_host


def fleet_settings(state) -> dict[str, Settings]:
    """Validate every host's settings once per run; stop the run on any error.

    Runs while pyinfra is still preparing (nothing has been executed on any host),
    so a bad value anywhere means no host is touched.
    """
    run = RunRecords.of(state)
    if run.settings is None:
        try:
            run.settings = validate_inventory(state.inventory)
        except SettingsError as exc:
            raise PyinfraError(str(exc)) from None
    return run.settings


def on_windows_drive(host, fact, wslconf):
    """``fact`` (a fact that runs a Windows program) looked for under wsl.conf's ``[automount]
    root`` (``/mnt/`` unless the user moved the drives, e.g. ``root = /``: C: at ``/c``)."""
    root = drive_root(wslconf.ini) if wslconf.ini is not None else DEFAULT_DRIVE_ROOT
    if root == DEFAULT_DRIVE_ROOT:
        return host.get_fact(fact)  # the batched (prefetched) form
    return host.get_fact(fact, drive_root=root)


def windows_profile(host, wslconf) -> WindowsProfileInfo:
    return on_windows_drive(host, WindowsUserProfile, wslconf)


def observe(host, settings: Settings, probe_gpu_memory: bool = True, probe_interop: bool = False) -> rules.Observations:
    """Read the host (facts only; nothing is changed).

    The facts travel in one batched command (facts/batch.py), each parsed by its own fact.
    The GPU memory probe (the one expensive fact: a CUDA context and real allocations) is
    skipped while the engine answers ``/health`` ok: a serving engine holds its GPU memory,
    which proves the allocations pitfall 4B is about work, and a probe beside it would only
    measure the engine's own use. A stopped, loading or failed engine is probed as before.
    """
    layout = HostLayout.of(settings)
    engine_health = (EngineHealth, {"host": str(settings.listen_host), "port": settings.listen_port})
    batch.prefetch(
        host.state,
        host,
        [
            (WslKernel, {}),
            (NvidiaGpus, {}),
            (WindowsUserProfile, {}),
            (WslVersion, {}),
            (InitSystem, {}),
            (CudaToolchain, {"cuda_home": settings.cuda_home}),
            (HostResources, {"path": settings.model_dir}),
            (WslConfFile, {}),
            (EngineInstall, {"base_dir": settings.engine_base_dir}),
            (ModelDirectory, {"path": settings.model_dir}),
            (GuardState, {"state_file": layout.guard_state_file}),
            (FileText, {"path": layout.last_gate_file}),
            engine_health,
        ],
    )
    kernel = host.get_fact(WslKernel)
    gpus = host.get_fact(NvidiaGpus)
    health = host.get_fact(engine_health[0], **engine_health[1])
    if health.status == "ok":
        probe_gpu_memory = False
    wslconf = host.get_fact(WslConfFile)
    profile = windows_profile(host, wslconf) if kernel.kind == "wsl2" else None
    wslconfig = (
        host.get_fact(WslConfigFile, path=f"{profile.path}/{WSLCONFIG_NAME}")
        if profile is not None and profile.path
        else None
    )
    gpu_memory = host.get_fact(GpuMemoryProbe) if probe_gpu_memory and gpus.gpus else None
    # Wake-on-LAN readiness, through PowerShell (a second or so): only where the waker may wake it.
    wake_on_lan = (
        on_windows_drive(host, WakeOnLanReadiness, wslconf)
        if settings.wake_on_lan_mac is not None and kernel.kind == "wsl2"
        else None
    )
    # Interop as a service sees it (the doctor: a Windows program started, a second or so).
    wsl2 = kernel.kind == "wsl2"
    interop = on_windows_drive(host, InteropAsService, wslconf) if probe_interop and wsl2 else None
    interop_binfmt = host.get_fact(InteropRegistration) if probe_interop and wsl2 else None
    # Files whose change waits for a WSL restart (a rollout's fleet report says so).
    restart_files = [WSL_CONF]
    if profile is not None and profile.path:
        restart_files.insert(0, f"{profile.path}/{WSLCONFIG_NAME}")
    return rules.Observations(
        kernel=kernel,
        wsl=on_windows_drive(host, WslVersion, wslconf),
        init=host.get_fact(InitSystem),
        gpus=gpus,
        cuda=host.get_fact(CudaToolchain, cuda_home=settings.cuda_home),
        resources=host.get_fact(HostResources, path=settings.model_dir),
        wslconf=wslconf,
        windows_profile=profile,
        wslconfig=wslconfig,
        gpu_memory=gpu_memory,
        engine=host.get_fact(EngineInstall, base_dir=settings.engine_base_dir),
        model=host.get_fact(ModelDirectory, path=settings.model_dir),
        guard_state=host.get_fact(GuardState, state_file=layout.guard_state_file),
        health=health,
        gate_record=_gate_record(host.get_fact(FileText, path=layout.last_gate_file)),
        restart_pending=host.get_fact(RestartPending, paths=restart_files),
        wake_on_lan=wake_on_lan,
        interop=interop,
        interop_binfmt=interop_binfmt,
    )


def _gate_record(text: str | None) -> GateResult | None:
    """The host's gate record; None when there is none or it is not one (the gate runs, says so
    and writes a new one: ``operations.health.gate_record``)."""
    try:
        return GateResult.from_json(text) if text else None
    except GateRecordError:
        return None


def unreachable_finding() -> rules.Finding:
    return rules.Finding(
        "unreachable",
        "block",
        "pyinfra could not connect to this host (its error is above)",
        "check that the host is up and reachable over SSH with the inventory's settings",
    )


def _maybe_print_summary(state, run: RunRecords) -> None:
    """Print the fleet summary once, when every host this run reached has its findings.

    The run's hosts are the inventory's within --limit/--exclude; the reached ones are those
    pyinfra connected to. A host of the run it could not connect to never gets here, so it is
    listed as unreachable instead of holding the summary back.
    """
    reached = reached_host_names(state)
    if run.summary_printed or not reached or not reached <= set(run.preflight):
        return
    run.summary_printed = True
    summary = {name: run.preflight[name].findings for name in reached}
    for host in state.inventory:
        if state.is_host_in_limit(host) and host.name not in reached:
            summary[host.name] = [unreachable_finding()]
    click.echo("\n" + fleet_summary(summary), err=True)


def fail_host(state, host, reason: str, line: str | None = None, advice: str | None = None) -> None:
    """Stop this host (pyinfra marks it failed), printing ``line`` (by default
    ``[host] stopped: reason``); the others go on.

    When it was the run's last host, the run ends here with one plain line and exit status 1:
    nothing has run on any host yet (this is the preparing stage), so there is nothing to
    report but why (and ``advice``: by default, the findings above). Not a PyinfraError:
    pyinfra would print that as ``pyinfra error in .../preflight.py line N``, which reads like
    a crash of ours. SystemExit still lets the CLI disconnect (so a rollout's record gets every
    host's end).
    """
    reason = printable(reason)  # may quote what the host said
    click.echo(printable(line) if line else f"    [{host.name}] stopped: {reason}", err=True)
    try:
        state.fail_hosts({host})
    except PyinfraError:
        # pyinfra raises "No hosts remaining!" when this was the last one.
        click.echo(f"\n--> {run_ended_line(host.name, reason, advice)}", err=True)
        raise SystemExit(1) from None


def run_ended_line(host_name: str, reason: str, advice: str | None = None) -> str:
    """The last line of a run whose every host was stopped before any change."""
    return (
        f"no host left to go on: the last one, {host_name}, stopped at preflight ({reason}); "
        f"nothing was changed on any host; {advice or 'the findings above say what to do'}"
    )


def run_preflight(
    state, host, stop_blocked: bool = True, probe_interop: bool = False
) -> tuple[rules.HostPreflight, bool]:
    """Gather, evaluate, record, print. Returns (the host's preflight record, ok).

    The record (settings, observations, findings) is kept on the run (``RunRecords.preflight``)
    and, under $FREETOKEN_RUN_RECORD, written for a rollout's fleet report before a blocked host
    is stopped (stopping the last host ends the run). `stop_blocked` False leaves a blocked host
    to the caller (the deploy's plan says what it does: freetoken_infra/plan.py).
    """
    run = RunRecords.of(state)
    run.when_done(print_gate_report_if_gated)  # the gate table, once every host is done
    settings = fleet_settings(state)[host.name]
    obs = observe(host, settings, probe_interop=probe_interop)
    cut = batch.cut_short(state, host)
    # A fact batch cut at its deadline: the facts it did not answer are defaults, not the host's;
    # the host stops with the line that names the fact that hung.
    findings = [facts_cut_finding(cut)] if cut else rules.evaluate(settings, obs)
    pre = rules.HostPreflight(settings, obs, findings)
    run.preflight[host.name] = pre
    record_host(host.name, pre)
    click.echo("\n" + findings_table(host.name, pre.findings), err=True)
    _maybe_print_summary(state, run)
    if pre.blocked and stop_blocked:
        fail_host(state, host, cut or pre.stop_reason)
    return pre, not pre.blocked


def facts_cut_finding(cut: str) -> rules.Finding:
    """The one blocker of a host whose fact batch was cut at its deadline (``batch.cut_short``)."""
    return rules.Finding(
        "facts",
        "block",
        cut,
        "find what hangs that fact on the host (a FIFO or a hung mount where it reads, a program "
        f"that never returns), then re-run; {batch.DEADLINE_ENV} sets the deadline",
    )


# What a converge's decisions are made by on the controller (the fast check's fingerprint): this
# checkout's code, and every host's settings and place in the inventory.
_CODE_ROOT = Path(__file__).resolve().parents[1]
_CODE_DIRS = ("deploys", "operations", "facts", "freetoken_infra", "group_data")
FINGERPRINT_VERSION = 1


@functools.cache
def code_digest() -> str:
    """sha256 over this checkout's Python code (the deploy, operations, facts, the library,
    group_data and config.py) and pyinfra's version: another release or a local edit is a new
    fingerprint."""
    h = hashlib.sha256(f"pyinfra {pyinfra.__version__}\n".encode())
    files = sorted(p for d in _CODE_DIRS for p in (_CODE_ROOT / d).rglob("*.py"))
    for path in [*files, _CODE_ROOT / "config.py"]:
        if path.is_file():
            h.update(f"{path.relative_to(_CODE_ROOT)}\n".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def fingerprint(state, host) -> str:
    """What this run would converge ``host`` from, on the controller side: the code, every
    host's settings (the plan reads other hosts': gateways, the LAN cache host), the inventory's
    names, addresses and groups, the run's elevation, and the API key a ``file:``/``env:``
    source gives (as its hash). The host's converge record names the fingerprint it was made
    for; another one means a full run."""
    run = RunRecords.of(state)
    if run.fleet_fingerprint is None:  # once per run: the same for every host
        settings = fleet_settings(state)
        keys = {}
        for name, s in settings.items():
            if s.api_key_source.partition(":")[0] in ("file", "env"):
                keys[name] = hashlib.sha256(controller_key(s.api_key_source).encode()).hexdigest()
        fleet = {
            "version": FINGERPRINT_VERSION,
            "code": code_digest(),
            "settings": {name: s.model_dump(mode="json") for name, s in sorted(settings.items())},
            "fleet": sorted([h.name, h.ssh_hostname, sorted(h.groups)] for h in fleet_of(state.inventory).values()),
            "keys": keys,
        }
        run.fleet_fingerprint = hashlib.sha256(json.dumps(fleet, sort_keys=True, default=str).encode()).hexdigest()
    doc = [run.fleet_fingerprint, host.name, bool(host.data.get("_sudo"))]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


def fast_check_fingerprint(state, host) -> str | None:
    """This run's ``fingerprint`` for ``host`` when the run may answer it from its record
    (``fast_check``), else None."""
    return fingerprint(state, host) if fast_check(fleet_settings(state)[host.name]) else None


def fast_check(settings: Settings) -> bool:
    """Whether this run may answer a host from its converge record: the ``fast_check`` setting,
    and not under a rollout (``$FREETOKEN_RUN_RECORD``: its fleet report wants every host's
    preflight)."""
    return settings.fast_check and not os.environ.get(RECORD_ENV)


def fleet_of(inventory) -> dict[str, plan.FleetHost]:
    """The inventory as the plan reads it: each host's name, ``ssh_hostname`` and groups."""
    return {h.name: plan.FleetHost(h.name, h.data.get("ssh_hostname"), tuple(h.groups)) for h in inventory}


def owner_hold(text: str | None) -> str | None:
    """Why the host agent keeps the engine stopped for the owner (its state file, root's, checked
    field by field by ``owner.load_state``), None when it does not: only an engine the agent
    stopped itself and has not started again."""
    state = owner.load_state(text or "")
    if state.mode != owner.YIELDED or not state.stopped:
        return None
    return state.word or printable(state.reason)[:200] or "yielded to the owner"


def gather(
    state, host, lock_refused: str | None, unchanged: Unchanged | None = None
) -> plan.Seen | plan.LockRefused | Unchanged:
    """What the deploy's plan reads beyond the preflight's record, read before any change (a
    step that asks the same fact later gets pyinfra's cached answer): the lock's outcome, the
    Windows-side files (on a host that converges or only waits for the WSL restart), and on a
    host the preflight lets on whether the engine runs, the model manifest's hash (when the gate
    may be skipped) and the distro's name (a blocked host may have no systemd to ask).
    ``unchanged``: the host's record stood (the lock's answer): nothing is read. On a host whose
    lock is held, the preflight runs first (its findings printed; ``run_preflight``)."""
    if unchanged is not None:
        return unchanged
    pre = None if lock_refused else run_preflight(state, host, stop_blocked=False)[0]
    cut = batch.cut_short(state, host)  # a fact batch cut at its deadline (the preflight's own, say)
    if lock_refused or pre is None or cut:
        return plan.LockRefused(host.name, lock_refused or cut or "not locked", connection_lost=connection_lost(host))
    fleet = fleet_of(state.inventory)
    if pre.blocked:
        targets = plan.windows_targets(pre.settings, pre) if pre.restart_only else []
        files, not_read = windows_files(host, [path for path, _, _ in targets])
        return plan.Seen(host.name, pre, fleet, files, windows_refused=not_read)
    files, not_read = windows_files(host, [path for path, _, _ in plan.windows_targets(pre.settings, pre)])
    running = bool((host.get_fact(SystemdStatus, services=[ENGINE_UNIT]) or {}).get(ENGINE_UNIT, False))
    # The manifest lies in the download's user's folder: its hash is taken from the bytes the
    # ModelManifest fact read without following a link (none when it refused a link or a FIFO).
    engine = plan.EngineSeen(
        running=running,
        manifest_sha256=host.get_fact(ModelManifest, model_dir=pre.settings.model_dir).sha256
        if plan.gate_may_skip(pre, running)
        else None,
        distro=host.get_fact(WslDistroName) if pre.settings.windows_autostart else "",
        owner=None
        if running or not pre.settings.agent_enabled
        else owner_hold(host.get_fact(FileText, path=AGENT_STATE_FILE)),
    )
    return plan.Seen(host.name, pre, fleet, files, engine, not_read)


def windows_files(host, paths: list[str]) -> tuple[dict[str, bytes | None], dict[str, str]]:
    """The bytes of the Windows-side files the plan merges (None: absent), and why root refused
    each one it did not read: ``/etc/wsl.conf`` is root's; ``.wslconfig``, below the drive root
    where every Linux account can plant a link, is read by ``WindowsFile`` (no link followed)."""
    files: dict[str, bytes | None] = {}
    refused: dict[str, str] = {}
    for path in paths:
        if path == WSL_CONF:
            files[path] = host.get_fact(FileBytes, path=path)
            continue
        seen = host.get_fact(WindowsFile, path=path)
        files[path] = seen.data
        if seen.refused is not None:
            refused[path] = seen.refused
    return files, refused


def stop_host(state, host, stop: plan.Stop) -> None:
    """Stop this host as the plan says (``fail_host``); a lost connection is recorded as such."""
    line = RunRecords.of(state).lost_during(host.name, stop.lost_in, say=False) if stop.lost_in else None
    fail_host(state, host, stop.reason, line=line, advice=stop.advice)
