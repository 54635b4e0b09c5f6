"""Converge a workstation into a FreeToken endpoint:
`pyinfra inventories/home.py deploys/freetoken.py`.

0. The host lock: one run per host at a time, taken before this run reads what it acts on
   (a run that finds another one's lock waits, saying who holds it, up to host_lock_timeout_s).
1. Preflight (the doctor's rules): a host with a blocker is stopped before any
   change, with its findings printed; the other hosts go on.
2. Windows side: .wslconfig [wsl2] and /etc/wsl.conf [boot] systemd=true, merged
   into the user's files. A change needs `wsl.exe --shutdown`; when systemd is not
   up yet, everything after this step waits for that restart.
3. CUDA 13 toolchain from NVIDIA's repository, with driver packages pinned out.
4. The engine in its own environment, the model (downloaded and verified by a
   systemd unit), the service, the guard timer, node_exporter reading the guard's samples.
5. Health gate: /health ok on the version this run installed, a question with one right answer,
   decode tokens/s. Skipped only when the host's last passed gate was for exactly what is
   installed and serving now.
A second run on a converged host changes nothing.
"""

from collections.abc import Mapping
from typing import Any

import click
from pyinfra import host
from pyinfra.api.exceptions import OperationError
from pyinfra.context import state
from pyinfra.facts.files import Sha256File
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import python, systemd
from pyinfra.operations.util import any_changed

from facts import batch
from facts.windows_tasks import WslDistroName
from freetoken_infra import rules
from freetoken_infra.core import records
from freetoken_infra.core.launch import engine_command
from freetoken_infra.core.layout import DEFAULT_DRIVE_ROOT, ENGINE_UNIT, RESTART_MESSAGE
from freetoken_infra.core.pyinfra_internals import connection_lost
from freetoken_infra.core.wsl_ini import drive_root
from freetoken_infra.preflight import fail_host, fleet_settings, run_preflight
from operations import cuda, engine, firewall, guard, health, host_lock, model, node_exporter, service, windows

# Every host's settings, validated before this deploy reads anything from any host. The repo's
# config.py already did this before pyinfra connected; this covers runs that skip config.py
# (another working directory, `--config`, the Python API).
fleet_settings(state)


def lock_then_facts(command: str, script: str, elevation: Mapping[str, Any]) -> tuple[bool, list[str]] | None:
    """One round trip: the host lock, then (only once it is held) every fact this host's last
    run read (facts/batch.py). Operations need root: a workstation user's run goes through sudo,
    which the lock's first try finds out (operations/host_lock.take)."""
    if elevation.get("_sudo"):
        host.data._sudo = True
    return batch.prefetch(state, host, first=(command, script))


FACTS_STEP = "the host lock and the fact reads (before any change)"
# One run per host at a time (operations/host_lock.py): taken before the facts this run acts on
# are read, so that a run that waited plans from the state the other run left.
lock_refused = host_lock.take(
    state,
    host,
    fleet_settings(state)[host.name].host_lock_timeout_s,
    {"_sudo": True} if host.data.get("_sudo") else {},
    run=lock_then_facts,
)
if lock_refused and connection_lost(host):  # one line, as for a connection lost in a step
    lost = records.RunRecords.of(state).lost_during(host.name, FACTS_STEP, say=False)
    fail_host(state, host, "connection lost", line=lost, advice="re-run to finish")
elif lock_refused:
    fail_host(state, host, lock_refused)


def windows_side(settings, obs) -> list[str]:
    """Queue the Windows-side merges; return the files that will change."""
    targets = [("/etc/wsl.conf", "boot", {"systemd": "true"})]
    if obs.windows_profile is not None and obs.windows_profile.path:
        targets.insert(0, (f"{obs.windows_profile.path}/.wslconfig", "wsl2", settings.wslconfig_values()))
    changing = [p for p, section, values in targets if windows.ini_needs_change(p, section, values)]
    for path, section, values in targets:
        name = ".wslconfig [wsl2]" if section == "wsl2" else f"{path} [{section}]"
        windows.ini_values(name=f"Windows side: {name}", path=path, section=section, values=values)
    records.record(host.name, restart_pending=changing)  # for a rollout's fleet report
    return changing


def stop_for_restart(obs) -> None:
    """The only blockers are the deploy's own to fix: apply the Windows side, then stop."""
    changing = windows_side(fleet_settings(state)[host.name], obs)
    message = f"{host.name}: {RESTART_MESSAGE} ({', '.join(changing) or 'systemd not yet PID 1'}); every later step waits for it"
    click.echo(f"    [{host.name}] {message}", err=True)

    def stop():
        raise OperationError(message)

    python.call(name="Wait for the WSL restart", function=stop)


ok = False
if not lock_refused:
    # The host's preflight record: the settings and everything this deploy knows of the host.
    pre, ok = run_preflight(state, host, on_fixable=stop_for_restart)
    settings, obs = pre.settings, pre.observations

# Where the engine's firewall admits connections from (operations/firewall.py): the inventory's
# gateway host(s), resolved before any change; an address that cannot be stops this host.
gateways: list = []
if ok and firewall.needed(settings):
    try:
        gateways = firewall.gateway_addresses(state.inventory)
    except firewall.FirewallError as exc:
        fail_host(state, host, str(exc))
        ok = False

if ok:
    changing = windows_side(settings, obs)
    if changing:
        click.echo(
            f"    [{host.name}] {RESTART_MESSAGE}: {', '.join(changing)} change(s); the engine runs with the "
            "old VM limits until then (no later step waits for it)",
            err=True,
        )
    if settings.windows_autostart:
        windows.windows_autostart(
            name="Windows: start the distro at logon",
            task_name="FreeToken-WSL",
            distro=host.get_fact(WslDistroName),
            drive_root=drive_root(obs.wslconf.ini) if obs.wslconf.ini is not None else DEFAULT_DRIVE_ROOT,
        )

    gpu = rules.primary_gpu(obs)
    plan = rules.plan_for(settings, obs)
    # The preflight's gpu, compute_capability and launch_plan checks block a host without these.
    assert gpu is not None and gpu.compute_cap is not None and plan is not None, host.name
    arch = f"compute_{gpu.compute_cap[0]}{gpu.compute_cap[1]}"

    cuda.packages_present(name="Prerequisites", packages=["ca-certificates", "curl", "python3-venv"])
    cuda.repository(name="CUDA: NVIDIA repository, keyring, driver pin", settings=settings)
    cuda.toolkit(name=f"CUDA: toolkit packages, nvcc lists {arch}", settings=settings, gpu_arch=arch)

    engine.service_user(name="Engine: service user and directories", settings=settings)
    # Blue-green: the version that serves now stays installed; if the new one fails the
    # health gate, the gate switches back to it (README, "Upgrades and rollback"). A run cut off
    # after the switch left `active` on the new version: then it is the last passed gate's.
    rollback_to = health.rollback_target(obs.engine, settings, obs.gate_record)
    env_op = engine.environment(name=f"Engine: {settings.engine_requirement} environment", settings=settings)

    # The fleet's LAN model cache host fetches first and then serves its verified copy; the
    # other hosts fetch after it, from it (upstream is read once per fleet). pyinfra orders
    # operations per host; the cache step, called by every host from this one line, is the
    # point the others wait for.
    model_name = f"Model: {settings.model_repo}@{settings.model_revision}"
    sources = model.cache_sources(settings, host.name, state.inventory)
    fetches_first = settings.model_cache_host in (None, host.name)
    if fetches_first:
        model.model_fetcher(name="Model: downloader unit", settings=settings, sources=sources)
        model_op = model.model_present(name=model_name, settings=settings)
    model.model_cache(
        name="Model: LAN cache (on the model_cache_host only)",
        settings=settings,
        present=settings.model_cache_host == host.name,
    )
    if settings.model_cache_host == host.name and model_op.will_change:
        # nginx serves the files its list named at its start: a newly verified model is served
        # from the reload on (the list is rebuilt from the manifest).
        model.model_cache_reload(name="Model: LAN cache serves the newly verified files")
    if not fetches_first:
        model.model_fetcher(name="Model: downloader unit (LAN cache first)", settings=settings, sources=sources)
        model_op = model.model_present(name=f"{model_name} (LAN cache first)", settings=settings)

    key_op = service.api_key(name="Service: API key (0600)", settings=settings)
    unit_op = service.unit(name=f"Service: {ENGINE_UNIT} and its environment", settings=settings, plan=plan)
    changed = any_changed(env_op, model_op, key_op, unit_op)

    guard.clear_guard_state(name="Guard: clear a tripped state", settings=settings)
    # The question the service step below asks too (pyinfra fills in the defaults): read once.
    was_running = (host.get_fact(SystemdStatus, services=[ENGINE_UNIT]) or {}).get(ENGINE_UNIT, False)

    # The gate (and the restart) are skipped only when nothing changed and the host's last
    # passed gate was for exactly what is installed and serving now; anything else (a run cut
    # off after a change but before the restart or the gate, a failed gate, another version or
    # state) restarts the engine on what is installed and gates it again.
    subject = health.gate_subject(
        settings,
        service.engine_unit(settings, plan),
        service.engine_environment(settings),
        engine_command(settings, plan),
    )
    serving = obs.health
    why_gate: str | None = "the engine was not serving before this run"
    if serving is not None and serving.status == "ok" and was_running:
        manifest = host.get_fact(Sha256File, path=health.manifest_path(settings))
        why_gate = health.why_gate(obs.gate_record, subject, manifest, serving.version)
    gate_args: dict[str, Any] = {"_if": changed} if why_gate is None else {}

    # Before the engine (re)starts on its address: its port and node_exporter's from the gateway
    # and loopback only (issue 20 items 6 and 14; README, "Security model").
    firewall.firewall(
        name="Firewall: the engine's and node_exporter's ports from the gateway only",
        settings=settings,
        gateways=gateways,
    )
    systemd.service(name="Service: enabled and running", service=ENGINE_UNIT, running=True, enabled=True)
    if was_running:
        systemd.service(
            name="Service: restart (unit, environment, key, model or engine changed, or not gated as it is)",
            service=ENGINE_UNIT,
            restarted=True,
            **gate_args,
        )
    guard.guard(name="Guard: timer", settings=settings)
    # The guard's samples for the fleet's scrape (README, "One endpoint for the fleet": Metrics).
    node_exporter.node_exporter(
        name="Metrics: node_exporter (Debian) reading the guard's samples",
        settings=settings,
        bind=node_exporter.bind_address(settings, host.name, host.data.get("ssh_hostname")),
    )

    health.health_gate(
        name="Health gate: /health ok, the right answer, decode tok/s",
        settings=settings,
        key_file=service.key_path(settings),
        rollback_to=rollback_to,
        subject=subject,
        **gate_args,
    )
