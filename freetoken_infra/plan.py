"""The converge's plan: every decision of one run of ``deploys/freetoken.py`` on one host.

``converge_plan`` is a pure function of what was seen (``Seen``: the host lock's outcome, the
preflight's record, the few facts the deploy's decisions read, the inventory as plain values)
and returns a frozen ``ConvergePlan``: whether the host stops and why, the Windows-side merges
and the restart wait, and for a host that converges every value its steps are called with (the
launch plan, the nvcc arch, the LAN cache's order and sources, the bind addresses, the firewall,
the restart and the gate's condition, the rollback target). The deploy only calls operations
with these values; tests/unit/test_plan.py tests each flow.

Nothing here touches a host or pyinfra's state; names are resolved on the controller through a
``Lookup`` the caller may replace (``core.addresses.lookup`` by default).
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from facts.engine import EngineInstallInfo
from facts.windows import dialect_of
from freetoken_infra.core import wsl_ini
from freetoken_infra.core.addresses import Address, AddressError, Lookup, fleet_address, lookup, resolve
from freetoken_infra.core.gate_record import Gated, GateResult
from freetoken_infra.core.launch import LaunchPlan, engine_command
from freetoken_infra.core.layout import DEFAULT_DRIVE_ROOT, GATEWAY_GROUP, RESTART_MESSAGE, WSL_CONF, WSLCONFIG_NAME
from freetoken_infra.core.records import Refusal, Unchanged
from freetoken_infra.core.settings import Settings
from freetoken_infra.core.text import printable
from freetoken_infra.rules import SYSTEMD_ON, Finding, HostPreflight, plan_for, primary_gpu

# The step a connection lost while the lock was taken is reported in.
FACTS_STEP = "the host lock and the fact reads (before any change)"
AUTOSTART_TASK = "FreeToken-WSL"


# --------------------------------------------------------------------------- what was seen
@dataclass(frozen=True)
class FleetHost:
    """One host of the inventory, as the plan needs it."""

    name: str
    ssh_hostname: str | None = None
    groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class LockRefused:
    """The host lock was not taken (held by another run, or the connection was lost), or the
    facts read with it were cut at their deadline (``reason`` names the fact that hung)."""

    host_name: str
    reason: str
    connection_lost: bool = False


@dataclass(frozen=True)
class EngineSeen:
    """What the deploy's later decisions read, gathered only on a host the preflight let on."""

    running: bool  # the engine's unit was running before this run
    manifest_sha256: str | None = None  # the model manifest's hash (None: none)
    distro: str = ""  # the WSL distro's name (read when windows_autostart is set)
    owner: str | None = None  # the host agent stopped the engine for its owner: why (None: it did not)


@dataclass(frozen=True)
class Seen:
    """A host whose lock this run holds: its preflight record and what else was read."""

    host_name: str
    preflight: HostPreflight
    fleet: Mapping[str, FleetHost]
    windows_files: Mapping[str, bytes | None] = field(default_factory=dict)  # path -> bytes (None: absent)
    engine: EngineSeen | None = None  # None: not gathered (the preflight blocked the host)
    # path -> why root did not read it (a link on the way, a FIFO, over the cap): left unchanged
    windows_refused: Mapping[str, str] = field(default_factory=dict)


# The unit renderers of operations/service.py, given by the deploy (the plan sits below the
# operations): the gate's subject hashes what they render.
@dataclass(frozen=True)
class Renderers:
    engine_unit: Callable[[Settings, LaunchPlan, str], str]
    engine_environment: Callable[[Settings], str]


# --------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Stop:
    """The host stops before any change; ``lost_in``: the connection was lost in that step;
    ``standing``: the preflight's blockers that keep it refused until its next boot (its record
    says so, and the next run answers from it while nothing it read has changed)."""

    reason: str
    lost_in: str | None = None
    advice: str | None = None
    standing: tuple[Finding, ...] = ()


@dataclass(frozen=True)
class IniTarget:
    """One Windows-side merge (operations/windows.ini_values)."""

    name: str
    path: str
    section: str
    values: Mapping[str, str]
    changes: bool  # the merge writes the file (WSL reads another value)


@dataclass(frozen=True)
class WindowsSide:
    targets: tuple[IniTarget, ...]
    notice: str | None = None  # the line printed for the host (a WSL restart is due)
    waits: bool = False  # every later step waits for the restart: the host stops after the merges

    @property
    def changing(self) -> list[str]:
        return [t.path for t in self.targets if t.changes]


@dataclass(frozen=True)
class Autostart:
    """The Windows scheduled task that starts the distro at logon."""

    task_name: str
    distro: str
    drive_root: str


@dataclass(frozen=True)
class ModelPlan:
    """The model's fetch: the fleet's LAN cache host fetches first (from upstream) and then
    serves its verified copy; the other hosts fetch after it, from it."""

    name: str
    sources: tuple[str, ...]
    fetches_first: bool
    serves_cache: bool  # this host is the fleet's model_cache_host
    cache_bind: str | None = None  # where its cache listens (on the cache host)


@dataclass(frozen=True)
class GatePlan:
    subject: Gated  # what this run's gate proves (but for the manifest's hash)
    why: str | None  # why it gates although nothing changed; None: only when something changes
    rollback_to: str | None  # the version a failed gate switches back to
    held: bool = False  # the host agent keeps the engine stopped for its owner: neither runs

    def run_if(self, changed: Callable[[], bool]) -> list[Callable[[], bool]]:
        """The ``_if`` of the restart and the gate: never while the owner holds the engine; none
        when they must run; else `changed`."""
        if self.held:
            return [lambda: False]
        return [changed] if self.why is None else []


@dataclass(frozen=True)
class Converge:
    """Every value the converge's steps are called with."""

    settings: Settings
    launch: LaunchPlan
    nvcc_arch: str  # what nvcc must list (compute_XY of the GPU)
    autostart: Autostart | None
    model: ModelPlan
    gate: GatePlan
    restart_if_running: bool  # the engine ran before: restart it (under the gate's condition)
    firewall_present: bool
    gateways: tuple[Address, ...]
    node_exporter_bind: str
    drive_root: str = DEFAULT_DRIVE_ROOT  # wsl.conf's automount root: the drives no confined unit sees
    owner_holds: str | None = None  # the host agent yielded the GPU to its owner: the engine is left
    # stopped, not started, restarted or gated (the agent starts it when the owner is done); why


@dataclass(frozen=True)
class ConvergePlan:
    host_name: str
    stop: Stop | None = None  # the host stops here, before any change
    windows: WindowsSide | None = None  # the Windows-side merges (None: not touched)
    converge: Converge | None = None  # None: the host does not converge this run
    unchanged: Unchanged | None = None  # nothing to do: read from its converge record
    # What the run prints for this host before any step (report.announce), and how its record
    # answered, for the gate table (None: the host was read in full).
    notices: tuple[str, ...] = ()
    answered: str | None = None
    # The record the lock's release writes when the run has a fingerprint and every operation
    # succeeded: () a converge's, blockers a refusal's that stands until the next boot; None none.
    record: tuple[Refusal, ...] | None = None


# --------------------------------------------------------------------------- the one function
def converge_plan(seen: Seen | LockRefused | Unchanged, render: Renderers, find: Lookup = lookup) -> ConvergePlan:
    """Every decision of one converge on one host, in the order the deploy acts on them."""
    if isinstance(seen, Unchanged):
        return unchanged_plan(seen)
    if isinstance(seen, LockRefused):
        if seen.connection_lost:  # one line, as for a connection lost in a step
            stop = Stop("connection lost", lost_in=FACTS_STEP, advice="re-run to finish")
        else:
            stop = Stop(seen.reason)
        return ConvergePlan(seen.host_name, stop=stop)

    name, pre = seen.host_name, seen.preflight
    settings, obs = pre.settings, pre.observations
    if pre.blocked and pre.restart_only:
        # The only blockers are the deploy's own to fix: apply the Windows side, then stop.
        side = windows_side(settings, pre, seen.windows_files, seen.windows_refused)
        pending = ", ".join(side.changing) or "systemd not yet PID 1"
        notice = f"{name}: {RESTART_MESSAGE} ({pending}); every later step waits for it"
        return ConvergePlan(name, windows=WindowsSide(side.targets, notice=notice, waits=True), notices=(notice,))
    if pre.blocked:
        standing = tuple(pre.standing)
        record = tuple((f.check, f.evidence, f.remedy) for f in standing) if standing else None
        return ConvergePlan(name, stop=Stop(pre.stop_reason, standing=standing), record=record)

    if seen.engine is None:  # gathered on every host the preflight lets on
        return ConvergePlan(name, stop=Stop("the engine's state was not read"))
    gpu, launch = primary_gpu(obs), plan_for(settings, obs)
    if gpu is None or gpu.compute_cap is None or launch is None:
        # The preflight's gpu, compute_capability and launch_plan checks block such a host.
        return ConvergePlan(name, stop=Stop("no GPU to plan for (see the gpu check)"))
    ssh_hostname = seen.fleet[name].ssh_hostname if name in seen.fleet else None
    serves_cache = settings.model_cache_host == name
    try:
        # Where the engine's firewall admits connections from: the inventory's gateway host(s),
        # resolved before any change, as are the bind addresses below.
        firewall = firewall_needed(settings)
        gateways = gateway_addresses(seen.fleet, find) if firewall else []
        exporter_bind = node_exporter_bind(settings, name, ssh_hostname, find)
        cache_bind = cache_bind_address(settings, name, ssh_hostname, find) if serves_cache else None
    except AddressError as exc:
        return ConvergePlan(name, stop=Stop(str(exc)))

    side = windows_side(settings, pre, seen.windows_files, seen.windows_refused)
    if side.changing:
        side = WindowsSide(
            side.targets,
            notice=f"{RESTART_MESSAGE}: {', '.join(side.changing)} change(s); the engine runs with the "
            "old VM limits until then (no later step waits for it)",
        )

    engine = seen.engine
    root = wsl_ini.drive_root(obs.wslconf.ini) if obs.wslconf.ini is not None else DEFAULT_DRIVE_ROOT
    autostart = Autostart(AUTOSTART_TASK, engine.distro, root) if settings.windows_autostart else None

    subject = gate_subject(
        settings,
        render.engine_unit(settings, launch, root),
        render.engine_environment(settings),
        engine_command(settings, launch),
    )
    # The gate (and the restart) are skipped only when nothing changed and the host's last
    # passed gate was for exactly what is installed and serving now; anything else (a run cut
    # off after a change but before the restart or the gate, a failed gate, another version or
    # state) restarts the engine on what is installed and gates it again.
    why: str | None = "the engine was not serving before this run"
    if obs.health is not None and gate_may_skip(pre, engine.running):
        why = why_gate(obs.gate_record, subject, engine.manifest_sha256, obs.health.version)

    model = ModelPlan(
        name=f"Model: {settings.model_repo}@{settings.model_revision}",
        sources=tuple(cache_sources(settings, name, seen.fleet)),
        fetches_first=settings.model_cache_host in (None, name),
        serves_cache=serves_cache,
        cache_bind=cache_bind,
    )
    owner_holds = engine.owner if not engine.running else None
    notices: tuple[str, ...] = (side.notice,) if side.notice else ()
    if owner_holds:
        notices += (
            f"the engine stays stopped: {owner_holds} (the host agent starts it when its owner is done); "
            "no restart, no gate",
        )
    return ConvergePlan(
        name,
        windows=side,
        notices=notices,
        record=(),
        converge=Converge(
            settings=settings,
            launch=launch,
            nvcc_arch=f"compute_{gpu.compute_cap[0]}{gpu.compute_cap[1]}",
            autostart=autostart,
            model=model,
            gate=GatePlan(
                subject,
                why,
                rollback_target(obs.engine, settings, obs.gate_record),
                held=bool(engine.owner and not engine.running),
            ),
            restart_if_running=engine.running,
            owner_holds=owner_holds,
            firewall_present=firewall,
            gateways=tuple(gateways),
            node_exporter_bind=exporter_bind,
            drive_root=root,
        ),
    )


# --------------------------------------------------------------------------- the Windows side
def unchanged_plan(seen: Unchanged) -> ConvergePlan:
    """A host whose record stood: nothing is read or changed; a refusal's record stops it again
    with the blockers that record names."""
    if not seen.refused:
        return ConvergePlan(
            seen.host_name,
            unchanged=seen,
            notices=(
                f"unchanged since its last converge ({seen.inputs} inputs of its facts checked in one read): "
                "nothing to do",
            ),
            answered="unchanged since its last converge (its record answered; nothing read)",
        )
    standing = tuple(
        Finding(check, "block", evidence, remedy, standing=True) for check, evidence, remedy in seen.refused
    )
    reason = f"preflight blockers: {', '.join(f.check for f in standing)} (unchanged since its last full read)"
    advice = "the remedies above; once they are done, the next run reads every fact"
    return ConvergePlan(
        seen.host_name,
        stop=Stop(reason, advice=advice, standing=standing),
        unchanged=seen,
        notices=tuple(
            f"refused, unchanged since its last full read ({seen.inputs} inputs of its facts checked in one read): "
            f"{f.check}: {printable(f.evidence)} -> {printable(f.remedy)}"
            for f in standing
        ),
        answered="refused at preflight (unchanged since its last full read)",
    )


def windows_targets(settings: Settings, pre: HostPreflight) -> list[tuple[str, str, Mapping[str, str]]]:
    """The Windows-side files the deploy merges: ``.wslconfig [wsl2]`` (when the Windows profile
    is known) and ``/etc/wsl.conf [boot] systemd=true``, as (path, section, values)."""
    profile = pre.observations.windows_profile
    targets: list[tuple[str, str, Mapping[str, str]]] = [(WSL_CONF, "boot", SYSTEMD_ON)]
    if profile is not None and profile.path:
        targets.insert(0, (f"{profile.path}/{WSLCONFIG_NAME}", "wsl2", settings.wslconfig_values()))
    return targets


def windows_side(
    settings: Settings,
    pre: HostPreflight,
    files: Mapping[str, bytes | None],
    refused: Mapping[str, str] | None = None,
) -> WindowsSide:
    """The merges, each saying whether it writes its file (read as WSL reads it); a file root
    refused to read (``refused``: a link, a FIFO, over the cap) is written by none."""
    targets = []
    for path, section, values in windows_targets(settings, pre):
        label = ".wslconfig [wsl2]" if section == "wsl2" else f"{path} [{section}]"
        writes = (
            path not in (refused or {}) and wsl_ini.merge(files.get(path), dialect_of(path), section, values).writes
        )
        targets.append(IniTarget(f"Windows side: {label}", path, section, values, writes))
    return WindowsSide(tuple(targets))


# --------------------------------------------------------------------------- addresses
def firewall_needed(settings: Settings) -> bool:
    """The firewall is kept while the engine or node_exporter listens beyond loopback
    (node_exporter without ``node_exporter_bind`` listens where the engine does, or on the
    host's fleet address: ``node_exporter_bind``)."""
    if not settings.firewall_enabled:
        return False
    bind = settings.node_exporter_bind
    exporter = settings.node_exporter_enabled and bind is not None and not bind.is_loopback
    return not ipaddress.ip_address(str(settings.listen_host)).is_loopback or exporter


def gateway_addresses(fleet: Mapping[str, FleetHost], find: Lookup = lookup) -> list[Address]:
    """The addresses of the inventory's gateway host(s) (group ``gateway``): the only hosts
    besides loopback and the settings' lists that reach a workstation's engine."""
    out: set[Address] = set()
    for h in fleet.values():
        if GATEWAY_GROUP in h.groups:
            out.update(resolve(h.name, fleet_address(h.name, h.ssh_hostname), find))
    return sorted(out, key=lambda a: (a.version, int(a)))


def _resolved(address: str, port: int, find: Lookup, why: str) -> str:
    """`address` as an IP literal: itself, else the first address it resolves to."""
    try:
        return str(ipaddress.ip_address(address.strip("[]")))
    except ValueError:
        pass
    try:
        return find(address, port)[0]
    except (OSError, IndexError) as exc:
        raise AddressError(f"cannot resolve {address} for {why} ({exc})") from None


def node_exporter_bind(settings: Settings, host_name: str, ssh_hostname: str | None, find: Lookup = lookup) -> str:
    """Where node_exporter listens: ``node_exporter_bind``, else ``listen_host`` (where the
    gateway reaches the engine), else, when the engine listens on every address, the address
    the fleet reaches the host by (its ``ssh_hostname``, else its name), resolved here."""
    if settings.node_exporter_bind is not None:
        return str(settings.node_exporter_bind)
    listen = ipaddress.ip_address(str(settings.listen_host))
    if not listen.is_unspecified:
        return str(listen)
    address = str(ssh_hostname or host_name).strip("[]")
    try:
        return _resolved(address, settings.node_exporter_port, find, "node_exporter's bind address")
    except AddressError as exc:
        raise AddressError(f"{host_name}: {exc}; set node_exporter_bind") from None


def cache_sources(settings: Settings, host_name: str, fleet: Mapping[str, FleetHost]) -> list[str]:
    """Where ``host_name`` fetches the model before the hub: the fleet's LAN cache host (unless
    it is this host), reached at the address pyinfra reaches it by, then ``model_sources``."""
    sources = []
    if settings.model_cache_host and settings.model_cache_host != host_name:
        cache = fleet.get(settings.model_cache_host)
        address = (cache.ssh_hostname if cache is not None else None) or settings.model_cache_host
        if ":" in address and not address.startswith("["):
            address = f"[{address}]"  # IPv6 literal
        sources.append(f"http://{address}:{settings.model_cache_port}")
    return sources + [str(u).rstrip("/") for u in settings.model_sources]


def cache_bind_address(settings: Settings, host_name: str, ssh_hostname: str | None, find: Lookup = lookup) -> str:
    """Where the cache host's cache listens: ``model_cache_bind``, else the address the rest of
    the fleet reaches it by (what ``cache_sources`` gives them: its ``ssh_hostname``, else its
    inventory name), resolved here when it is a name, never every interface."""
    if settings.model_cache_bind is not None:
        return str(settings.model_cache_bind)
    address = str(ssh_hostname or host_name)
    try:
        return _resolved(address, settings.model_cache_port, find, "the LAN model cache's bind address")
    except AddressError as exc:
        raise AddressError(f"{host_name}: {exc}; set model_cache_bind") from None


# --------------------------------------------------------------------------- the gate
def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def gate_may_skip(pre: HostPreflight, running: bool) -> bool:
    """The gate can be skipped only on a host whose engine ran and served before this run (then
    the model manifest's hash is read, for ``why_gate``)."""
    serving = pre.observations.health
    return running and serving is not None and serving.status == "ok"


def gate_subject(settings: Settings, unit_text: str, environment_text: str, launch_argv: list[str]) -> Gated:
    """What this run's gate proves, but for the model manifest's hash (read on the host when the
    gate runs): the engine version, the unit and its environment (hashes), the model revision,
    the launch plan's command line."""
    return Gated(
        engine_version=settings.engine_version,
        unit_sha256=_sha256(unit_text),
        environment_sha256=_sha256(environment_text),
        model=f"{settings.model_repo}@{settings.model_revision}",
        launch=tuple(launch_argv),
    )


def why_gate(
    record: GateResult | None,
    subject: Gated,
    manifest_sha256: str | None,
    serving_version: str | None,
) -> str | None:
    """Why this run must gate the host although nothing it converges changed (None: it need not,
    the last gate passed for exactly what is installed and serving now). Anything else runs the
    gate: no record, a failed or cut-off gate, another engine, unit, environment, model,
    manifest or launch plan than the one gated, or another version serving."""
    if record is None:
        return "no gate record on the host"
    if not record.ok:
        return f"the last gate did not pass ({record.phase or '?'})"
    if record.gated is None:
        return "the last gate does not say what it gated"
    differs = record.gated.differs(replace(subject, manifest_sha256=manifest_sha256))
    if differs:
        return "the last passed gate was for another " + ", ".join(differs)
    if serving_version != subject.engine_version:
        return f"the engine serving reports version {serving_version}, not {subject.engine_version}"
    return None


def rollback_target(installed: EngineInstallInfo | None, settings: Settings, record: GateResult | None) -> str | None:
    """The version to switch back to when this run's version fails its gate: the one serving
    before this run (``active`` now, when it is another installed version), else the version of
    the host's last passed gate (a run cut off after the switch left ``active`` on the new one).

    Blue-green: the version that serves now stays installed (docs/deploy.md, "Upgrades and
    rollback").
    """
    if installed is None:
        return None
    candidates = [installed.active]
    last_passed = record.last_passed if record is not None else None
    if last_passed is not None:
        candidates.append((last_passed.gated and last_passed.gated.engine_version) or last_passed.version)
    for version in candidates:
        if version and version != settings.engine_version and installed.versions.get(version) == version:
            return str(version)
    return None
