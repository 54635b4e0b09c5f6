"""Converge a workstation into a FreeToken endpoint:
`pyinfra inventories/home.py deploys/freetoken.py`.

0. The host lock: one run per host at a time, taken before this run reads what it acts on
   (a run that finds another one's lock waits, saying who holds it, up to host_lock_timeout_s).
1. Preflight (the doctor's rules): a host with a blocker is stopped before any change, with
   its findings printed; the other hosts go on.
2. Windows side: .wslconfig [wsl2] and /etc/wsl.conf [boot] systemd=true, merged into the
   user's files. A change needs `wsl.exe --shutdown`; without systemd up, later steps wait.
3. CUDA 13 toolchain from NVIDIA's repository, with driver packages pinned out.
4. The engine in its own environment, the model (downloaded and verified by a
   systemd unit), the service, the guard timer, node_exporter reading the guard's samples.
5. Health gate: /health ok on the version this run installed, a question with one right answer,
   decode tokens/s. Skipped only when the host's last passed gate was for exactly what is
   installed and serving now.
A second run on a converged host changes nothing, and reads nothing but its record when nothing
the last converge read has changed (step 0's fast check; docs/fast-check.md); so does a re-run on
a host the preflight refused by a blocker that stands until its next boot (an old WSL).
"""

from pyinfra import host
from pyinfra.context import state
from pyinfra.operations import systemd
from pyinfra.operations.util import any_changed

from freetoken_infra import plan as converge
from freetoken_infra.core import records
from freetoken_infra.core.layout import ENGINE_UNIT
from freetoken_infra.preflight import fast_check_fingerprint, fleet_settings, gather, stop_host
from freetoken_infra.report import announce
from operations import cuda, engine, firewall, guard, health, host_lock, model, node_exporter, owner, service, windows

# Every host's settings, validated before this deploy reads anything from any host. The repo's
# config.py already did this before pyinfra connected; this covers runs that skip config.py
# (another working directory, `--config`, the Python API).
host_settings = fleet_settings(state)[host.name]


# One run per host at a time (operations/host_lock.py), taken before the facts this run acts on
# are read, so that a run that waited plans from the state the other run left; in the same round
# trip, the no-op fast check: when nothing the host's last converge read has changed since and
# this run's fingerprint is the one it was made for, no fact is read and nothing is taken.
fingerprint = fast_check_fingerprint(state, host)
lock = host_lock.first_round(state, host, host_settings.host_lock_timeout_s, fingerprint)
# The preflight (on a host whose lock is held), what else the plan reads, and every decision of
# this run (freetoken_infra/plan.py); what it says of the host; the record the lock's release
# writes when every operation succeeded (a converge's, or a refusal that stands until a boot).
plan = converge.converge_plan(
    gather(state, host, lock.refused, lock.unchanged),
    converge.Renderers(service.engine_unit, service.engine_environment),
)
announce(state, host.name, plan.notices, plan.answered)
host_lock.HostLockKeeper.of(state).record_at_release(host, fingerprint, refused=plan.record)

if plan.windows is not None:
    # .wslconfig [wsl2] and /etc/wsl.conf [boot] systemd=true, merged into the user's files.
    for target in plan.windows.targets:
        windows.ini_values(name=target.name, path=target.path, section=target.section, values=target.values)
    records.record(host.name, restart_pending=plan.windows.changing)  # for a rollout's fleet report
    if plan.windows.waits:
        windows.wait_for_restart(plan.windows.notice or "")

if plan.stop is not None:
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

    guard.clear_guard_state(name="Guard: clear a tripped state", settings=settings)
    # Before the engine (re)starts on its address: its port and node_exporter's from the gateway
    # and loopback only (docs/security.md).
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
    # The gateway's agent-check and the yield to the owner (docs/host-agent.md).
    owner.agent(
        name="Host agent: agent-check for the gateway, yield to the owner",
        settings=settings,
        firewall=c.firewall_present,
    )
    # The guard's samples for the fleet's scrape (docs/gateway.md, "Metrics").
    node_exporter.node_exporter(
        name="Metrics: node_exporter (Debian) reading the guard's samples",
        settings=settings,
        bind=c.node_exporter_bind,
    )

    # Blue-green: if this run's version fails the gate, the gate switches back to the one that
    # served before (docs/deploy.md, "Upgrades and rollback").
    health.health_gate(
        name="Health gate: /health ok, the right answer, decode tok/s",
        settings=settings,
        key_file=service.key_path(settings),
        rollback_to=c.gate.rollback_to,
        subject=c.gate.subject,
        _if=run_if,
    )
