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
A second run on a converged host changes nothing, and reads nothing but its record when nothing
the last converge read has changed (step 0's fast check; README, "Re-runs"); so does a re-run on
a host the preflight refused by a blocker that stands until its next boot (an old WSL).
"""

from collections.abc import Mapping
from typing import Any

import click
from pyinfra import host
from pyinfra.api.exceptions import OperationError
from pyinfra.context import state
from pyinfra.operations import python, systemd
from pyinfra.operations.util import any_changed

from facts import batch
from freetoken_infra import plan as converge
from freetoken_infra.core import records
from freetoken_infra.core.layout import ENGINE_UNIT
from freetoken_infra.core.pyinfra_internals import connection_lost
from freetoken_infra.core.text import printable
from freetoken_infra.preflight import fast_check, fleet_settings, gather, run_preflight, stop_host
from freetoken_infra.preflight import fingerprint as fingerprint_of
from operations import (
    cuda,
    engine,
    firewall,
    guard,
    health,
    host_lock,
    model,
    node_exporter,
    owner,
    service,
    windows,
)

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


def lock_alone(command: str, script: str, elevation: Mapping[str, Any]) -> tuple[bool, list[str]]:
    """The fast check's round trip when the host's last run left a record: the lock's command
    alone. When the record stands no fact is read; when it does not, the facts follow in one more
    round trip."""
    if elevation.get("_sudo"):
        host.data._sudo = True
    ok, output = host.run_shell_command(command, _stdin=script, print_output=False, print_input=False, **elevation)
    return ok, list(output.output_lines)


def wait_for_restart(message: str) -> None:
    def stop():
        raise OperationError(message)

    python.call(name="Wait for the WSL restart", function=stop)


# One run per host at a time (operations/host_lock.py): taken before the facts this run acts on
# are read, so that a run that waited plans from the state the other run left. In the same round
# trip, the no-op fast check: when nothing the host's last converge read has changed since (its
# converge record, facts/inputs.py) and this run's fingerprint is the one it was made for, no
# fact is read and nothing is taken.
host_settings = fleet_settings(state)[host.name]
fingerprint = fingerprint_of(state, host) if fast_check(host_settings) else None
# The facts ride along with the lock unless the host's last run left a record (then the check
# most likely answers alone, and they would only cost their text on the wire and in its shell).
alone = fingerprint is not None and batch.expects_record(host)
taken = host_lock.take(
    state,
    host,
    host_settings.host_lock_timeout_s,
    {"_sudo": True} if host.data.get("_sudo") else {},
    run=lock_alone if alone else lock_then_facts,
    unchanged_if=fingerprint,
)
unchanged = taken.inputs if isinstance(taken, host_lock.Unchanged) else None
refused = taken.refused if isinstance(taken, host_lock.Unchanged) else ()
lock_refused = taken if isinstance(taken, str) else None
if taken is None and alone:
    batch.prefetch(state, host)  # the lock is held: every fact the last run read, in one command
    if connection_lost(host):  # as when it drops in the lock's own round trip: one line, re-run
        lock_refused = "connection lost"
# A fact batch cut at its deadline (facts/batch.py): the host stops with the line naming the fact
# that hung; the lock it holds is released at disconnect.
if taken is None and batch.cut_short(state, host):
    lock_refused = batch.cut_short(state, host)
# The host's preflight record (the settings and everything this deploy knows of the host), what
# else the plan reads, and every decision of this run (freetoken_infra/plan.py).
pre = None if lock_refused or unchanged is not None else run_preflight(state, host, stop_blocked=False)[0]
if pre is not None and batch.cut_short(state, host):  # cut in the preflight's own batch
    lock_refused, pre = batch.cut_short(state, host), None
plan = converge.converge_plan(
    gather(state, host, lock_refused, pre, unchanged, refused),
    converge.Renderers(service.engine_unit, service.engine_environment),
)

if plan.unchanged is not None:  # for the gate table of a run in which other hosts gate
    records.RunRecords.of(state).answered[host.name] = (
        "refused at preflight (unchanged since its last full read)"
        if plan.unchanged.refused
        else "unchanged since its last converge (its record answered; nothing read)"
    )
if plan.unchanged is not None and plan.unchanged.refused:
    for finding in plan.unchanged.refused:
        click.echo(
            f"    [{host.name}] refused, unchanged since its last full read ({plan.unchanged.inputs} inputs of its "
            f"facts checked in one read): {finding.check}: {printable(finding.evidence)} -> {printable(finding.remedy)}",
            err=True,
        )
elif plan.unchanged is not None:
    click.echo(
        f"    [{host.name}] unchanged since its last converge ({plan.unchanged.inputs} inputs of its facts "
        "checked in one read): nothing to do",
        err=True,
    )

if plan.windows is not None:
    # .wslconfig [wsl2] and /etc/wsl.conf [boot] systemd=true, merged into the user's files.
    for target in plan.windows.targets:
        windows.ini_values(name=target.name, path=target.path, section=target.section, values=target.values)
    records.record(host.name, restart_pending=plan.windows.changing)  # for a rollout's fleet report
    if plan.windows.notice:
        click.echo(f"    [{host.name}] {plan.windows.notice}", err=True)
    if plan.windows.waits:
        wait_for_restart(plan.windows.notice or "")

if plan.stop is not None:
    if plan.stop.standing and fingerprint is not None and plan.unchanged is None:
        # Refused until its next boot: the record the next run's fast check answers from.
        host_lock.HostLockKeeper.of(state).record_at_release(
            host, fingerprint, refused=tuple((f.check, f.evidence, f.remedy) for f in plan.stop.standing)
        )
    stop_host(state, host, plan.stop)

if plan.converge is not None:
    c = plan.converge
    settings = c.settings
    if c.autostart is not None:
        windows.windows_autostart(
            name="Windows: start the distro at logon",
            task_name=c.autostart.task_name,
            distro=c.autostart.distro,
            drive_root=c.autostart.drive_root,
        )

    # Windows programs keep running under systemd (the agent's owner signals, the doctor's checks).
    windows.interop_registration(name="WSL interop: its binfmt entry kept under systemd")
    cuda.packages_present(name="Prerequisites", packages=["ca-certificates", "curl", "python3-venv"])
    cuda.repository(name="CUDA: NVIDIA repository, keyring, driver pin", settings=settings)
    cuda.toolkit(name=f"CUDA: toolkit packages, nvcc lists {c.nvcc_arch}", settings=settings, gpu_arch=c.nvcc_arch)

    engine.service_user(name="Engine: service user and directories", settings=settings)
    env_op = engine.environment(name=f"Engine: {settings.engine_requirement} environment", settings=settings)

    # The fleet's LAN model cache host fetches first and then serves its verified copy; the
    # other hosts fetch after it, from it (upstream is read once per fleet). pyinfra orders
    # operations per host by the line they are called from; the cache step, called by every
    # host from this one line, is the point the others wait for.
    m = c.model
    if m.fetches_first:
        model.model_fetcher(
            name="Model: downloader unit", settings=settings, sources=m.sources, drive_root=c.drive_root
        )
        model_op = model.model_present(name=m.name, settings=settings)
    model.model_cache(
        name="Model: LAN cache (on the model_cache_host only)",
        settings=settings,
        present=m.serves_cache,
        bind=m.cache_bind,
        drive_root=c.drive_root,
    )
    if m.serves_cache and model_op.will_change:
        # nginx serves the files its list named at its start: a newly verified model is served
        # from the reload on (the list is rebuilt from the manifest).
        model.model_cache_reload(name="Model: LAN cache serves the newly verified files")
    if not m.fetches_first:
        model.model_fetcher(
            name="Model: downloader unit (LAN cache first)",
            settings=settings,
            sources=m.sources,
            drive_root=c.drive_root,
        )
        model_op = model.model_present(name=f"{m.name} (LAN cache first)", settings=settings)

    key_op = service.api_key(name="Service: API key (0600)", settings=settings)
    unit_op = service.unit(
        name=f"Service: {ENGINE_UNIT} and its environment", settings=settings, plan=c.launch, drive_root=c.drive_root
    )
    # The restart and the gate run when something changed, or always when the plan says why;
    # never while the host agent keeps the engine stopped for its owner (it starts it again).
    run_if = c.gate.run_if(any_changed(env_op, model_op, key_op, unit_op))
    if c.owner_holds:
        click.echo(
            f"    [{host.name}] the engine stays stopped: {c.owner_holds} (the host agent starts it when "
            "its owner is done); no restart, no gate",
            err=True,
        )

    guard.clear_guard_state(name="Guard: clear a tripped state", settings=settings)
    # Before the engine (re)starts on its address: its port and node_exporter's from the gateway
    # and loopback only (issue 20 items 6 and 14; README, "Security model").
    firewall.firewall(
        name="Firewall: the engine's and node_exporter's ports from the gateway only",
        settings=settings,
        gateways=c.gateways,
        present=c.firewall_present,
    )
    systemd.service(
        name="Service: enabled and running",
        service=ENGINE_UNIT,
        running=True,
        enabled=True,
        _if=[lambda: not c.owner_holds],
    )
    if c.restart_if_running:
        systemd.service(
            name="Service: restart (unit, environment, key, model or engine changed, or not gated as it is)",
            service=ENGINE_UNIT,
            restarted=True,
            _if=run_if,
        )
    guard.guard(name="Guard: timer", settings=settings, drive_root=c.drive_root)
    # The gateway's agent-check and the yield to the owner (README, "The owner comes first").
    owner.agent(
        name="Host agent: agent-check for the gateway, yield to the owner",
        settings=settings,
        firewall=c.firewall_present,
    )
    # The guard's samples for the fleet's scrape (README, "One endpoint for the fleet": Metrics).
    node_exporter.node_exporter(
        name="Metrics: node_exporter (Debian) reading the guard's samples",
        settings=settings,
        bind=c.node_exporter_bind,
    )

    # Blue-green: if this run's version fails the gate, the gate switches back to the one that
    # served before (README, "Upgrades and rollback").
    health.health_gate(
        name="Health gate: /health ok, the right answer, decode tok/s",
        settings=settings,
        key_file=service.key_path(settings),
        rollback_to=c.gate.rollback_to,
        subject=c.gate.subject,
        _if=run_if,
    )
    if fingerprint is not None:
        # When the host's lock is released at the end of a run whose operations all succeeded:
        # the converge record the next run's fast check reads.
        host_lock.HostLockKeeper.of(state).record_at_release(host, fingerprint)
