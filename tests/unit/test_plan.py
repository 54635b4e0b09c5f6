"""The converge's plan (freetoken_infra/plan.py): every decision of deploys/freetoken.py, from
plain observations, for each flow the fleet runs end to end (lock -> preflight -> Windows side ->
restart wait -> ... -> gate skip), with no host and no DNS (a stub resolver)."""

from __future__ import annotations

import ipaddress
from dataclasses import FrozenInstanceError, replace

import pytest

from facts.engine import EngineHealthInfo, EngineInstallInfo
from facts.gpu_memory import GpuMemoryProbeResult
from facts.init import InitInfo
from facts.windows import IniFileInfo
from facts.wsl import WslKernelInfo, WslVersionInfo
from freetoken_infra import plan, rules
from freetoken_infra.core.addresses import AddressError, fleet_address
from freetoken_infra.core.gate_record import Gated, GateResult
from freetoken_infra.core.layout import RESTART_MESSAGE
from freetoken_infra.core.settings import Settings
from tests.unit.test_rules import healthy

WSLCONFIG = "/mnt/c/Users/dev/.wslconfig"
WSLCONFIG_OK = b"[wsl2]\nmemory=24GB\nprocessors=8\nswap=4GB\nlocalhostForwarding=true\nvmIdleTimeout=0\n"
CONVERGED_FILES = {WSLCONFIG: WSLCONFIG_OK, "/etc/wsl.conf": b"[boot]\nsystemd=true\n"}
RENDER = plan.Renderers(
    lambda s, launch, root="/mnt/": f"unit {s.engine_version} {launch} {root}", lambda s: f"env {s.listen_port}"
)
FLEET = {
    "ws1": plan.FleetHost("ws1", "192.0.2.11"),
    "ws2": plan.FleetHost("ws2", None),
    "ws3": plan.FleetHost("ws3", "fd00::3"),
    "gw1": plan.FleetHost("gw1", "192.0.2.5", ("gateway",)),
}


def no_dns(name, port):
    raise OSError(f"no DNS in this test ({name})")


def dns(table):
    return lambda name, port: table[name] if name in table else no_dns(name, port)


def serving(version=None, status="ok"):
    return EngineHealthInfo(True, status, None, None, None, version or Settings().engine_version, None, None, None)


def seen(
    settings=None,
    obs=None,
    name="ws1",
    files=None,
    running=True,
    manifest="m1",
    distro="",
    fleet=FLEET,
    owner=None,
):
    settings = settings or Settings()
    obs = obs or healthy()
    pre = rules.HostPreflight(settings, obs, rules.evaluate(settings, obs))
    engine = None if pre.blocked else plan.EngineSeen(running, manifest, distro, owner)
    return plan.Seen(name, pre, fleet, CONVERGED_FILES if files is None else files, engine)


def planned(find=no_dns, **kwargs) -> plan.ConvergePlan:
    return plan.converge_plan(seen(**kwargs), RENDER, find)


# --------------------------------------------------------------------------- lock and preflight
def test_a_refused_lock_stops_the_host_before_anything_else():
    p = plan.converge_plan(plan.LockRefused("ws1", "held by run 42 (pid 7)"), RENDER)
    assert p.stop == plan.Stop("held by run 42 (pid 7)") and p.windows is None and p.converge is None
    lost = plan.converge_plan(plan.LockRefused("ws1", "ssh closed", connection_lost=True), RENDER).stop
    assert lost == plan.Stop("connection lost", lost_in=plan.FACTS_STEP, advice="re-run to finish")


def test_an_engine_the_agent_stopped_for_its_owner_is_left_stopped_by_the_plan():
    held = planned(running=False, owner="yielded (game)").converge
    assert held is not None and held.owner_holds == "yielded (game)" and not held.restart_if_running
    (never,) = held.gate.run_if(lambda: True)  # neither the restart nor the gate, changed or not
    assert never() is False
    # A running engine is the agent's to stop; the converge goes on as always.
    assert planned(running=True, owner="yielded (game)").converge.owner_holds is None
    assert planned(running=False).converge.owner_holds is None


def test_the_agents_state_file_holds_the_engine_only_when_it_stopped_it_itself():
    from freetoken_infra.core import owner
    from freetoken_infra.preflight import owner_hold

    yielded = owner.AgentState(mode=owner.YIELDED, reason="the owner's GPU use", stopped=True, word="yielded (game)")
    assert owner_hold(owner.dump_state(yielded, 0.0).decode()) == "yielded (game)"
    assert owner_hold(owner.dump_state(replace(yielded, stopped=False), 0.0).decode()) is None
    assert owner_hold(owner.dump_state(replace(yielded, mode=owner.SERVING), 0.0).decode()) is None
    assert owner_hold(None) is None and owner_hold("not json") is None
    assert owner_hold('{"mode": "yielded", "stopped": "yes"}') is None  # checked field by field


def test_a_preflight_blocker_stops_the_host_with_the_blockers_named_and_nothing_queued():
    obs = healthy(gpus=replace(healthy().gpus, gpus=()))
    p = planned(obs=obs)
    assert p.stop is not None and p.stop.reason.startswith("preflight blockers: gpu")
    assert "launch_plan" in p.stop.reason
    assert p.windows is None and p.converge is None


def test_a_fixable_blocker_merges_the_windows_side_then_every_later_step_waits():
    # systemd not PID 1 and not enabled in wsl.conf: the deploy's own step fixes it.
    obs = healthy(init=InitInfo("init", None), wslconf=IniFileInfo("/etc/wsl.conf", False))
    p = planned(obs=obs, files={WSLCONFIG: WSLCONFIG_OK, "/etc/wsl.conf": None})
    assert p.stop is None and p.converge is None
    assert p.windows is not None and p.windows.waits
    assert [(t.path, t.section, dict(t.values), t.changes) for t in p.windows.targets] == [
        (WSLCONFIG, "wsl2", Settings().wslconfig_values(), False),
        ("/etc/wsl.conf", "boot", {"systemd": "true"}, True),
    ]
    assert p.windows.changing == ["/etc/wsl.conf"]
    assert p.windows.notice == f"ws1: {RESTART_MESSAGE} (/etc/wsl.conf); every later step waits for it"


def test_a_fixable_blocker_with_nothing_left_to_write_still_waits_for_systemd():
    obs = healthy(init=InitInfo("init", None), wslconf=IniFileInfo("/etc/wsl.conf", False))
    p = planned(obs=obs)  # the files already hold the values (a previous run wrote them)
    assert p.windows is not None and p.windows.waits and p.windows.changing == []
    assert p.windows.notice is not None and "(systemd not yet PID 1)" in p.windows.notice


def test_a_changing_windows_side_on_a_converging_host_only_says_a_restart_is_due():
    p = planned(files={WSLCONFIG: b"[wsl2]\nmemory=8GB\n", "/etc/wsl.conf": b"[boot]\nsystemd=true\n"})
    assert p.converge is not None and p.windows is not None and not p.windows.waits
    assert p.windows.changing == [WSLCONFIG]
    assert p.windows.notice is not None and p.windows.notice.startswith(f"{RESTART_MESSAGE}: {WSLCONFIG} change(s)")
    assert "no later step waits for it" in p.windows.notice
    converged = planned()
    assert converged.windows is not None and converged.windows.changing == [] and converged.windows.notice is None


def test_without_a_windows_profile_only_wsl_conf_is_merged():
    p = planned(obs=healthy(windows_profile=None))
    assert p.windows is not None and [t.path for t in p.windows.targets] == ["/etc/wsl.conf"]


def test_the_plan_is_frozen():
    p = planned()
    with pytest.raises(FrozenInstanceError):
        p.stop = plan.Stop("x")  # type: ignore[misc]


# --------------------------------------------------------------------------- firewall and addresses
def test_firewall_needed_while_anything_of_ours_listens_beyond_loopback():
    assert not plan.firewall_needed(Settings())  # the default: engine and node_exporter on loopback
    assert plan.firewall_needed(Settings(listen_host="0.0.0.0"))
    assert plan.firewall_needed(Settings(listen_host="192.0.2.11"))
    assert plan.firewall_needed(Settings(node_exporter_bind="192.0.2.11"))
    assert not plan.firewall_needed(Settings(node_exporter_bind="192.0.2.11", node_exporter_enabled=False))
    assert not plan.firewall_needed(Settings(listen_host="0.0.0.0", firewall_enabled=False))


def test_a_needed_firewall_admits_the_gateways_resolved_before_any_change():
    c = planned(settings=Settings(listen_host="0.0.0.0")).converge
    assert c is not None and c.firewall_present and [str(a) for a in c.gateways] == ["192.0.2.5"]
    off = planned().converge
    assert off is not None and not off.firewall_present and off.gateways == ()


def test_an_unresolvable_gateway_address_stops_the_host_naming_it():
    fleet = {**FLEET, "gw1": plan.FleetHost("gw1", "gw.lan", ("gateway",))}
    p = planned(settings=Settings(listen_host="0.0.0.0"), fleet=fleet)
    assert p.stop is not None and p.stop.reason.startswith("host gw1: cannot resolve gw.lan on the controller")
    assert p.windows is None and p.converge is None
    resolved = planned(settings=Settings(listen_host="0.0.0.0"), fleet=fleet, find=dns({"gw.lan": ["192.0.2.50"]}))
    assert resolved.converge is not None and [str(a) for a in resolved.converge.gateways] == ["192.0.2.50"]
    # Not needed: the gateway is never resolved.
    assert planned(fleet=fleet).converge is not None


def test_gateway_addresses_come_from_the_inventorys_gateway_group():
    fleet = {
        "ws1": plan.FleetHost("ws1", "192.0.2.11"),
        "gw1": plan.FleetHost("gw1", "192.0.2.5", ("gateway",)),
        "gw2": plan.FleetHost("gw2", "fd00::5", ("gateway",)),
    }
    assert [str(a) for a in plan.gateway_addresses(fleet)] == ["192.0.2.5", "fd00::5"]
    hostile = {"gw1": plan.FleetHost("gw1", HOSTILE, ("gateway",))}
    with pytest.raises(AddressError, match="host gw1: ssh_hostname"):
        plan.gateway_addresses(hostile)


HOSTILE = "10.0.0.1\n    server evil 1.2.3.4:80"


@pytest.mark.parametrize(
    "value", [HOSTILE, "10.0.0.1\n", "gw.lan\n", "gw lan", "@local", "gw;rm", "-gw", "a..b", "x" * 254, ""]
)
def test_a_hostile_ssh_hostname_is_refused_naming_host_and_field(value):
    with pytest.raises(AddressError, match=r"^host gw1: ssh_hostname .* is not a host name or an IP address") as err:
        fleet_address("gw1", value)
    assert "\n" not in str(err.value)  # one line: the value shown escaped


def test_host_names_and_ip_literals_pass():
    assert fleet_address("gw1", "10.213.0.5") == "10.213.0.5"
    assert fleet_address("gw1", "[fd00::5]") == "fd00::5"
    assert fleet_address("gw1", "gw-1.lab.example.") == "gw-1.lab.example."
    assert fleet_address("gw1", None) == "gw1"
    with pytest.raises(AddressError, match="host @local: name"):
        fleet_address("@local", None)


def test_node_exporter_bind_follows_the_engine_never_every_interface_by_default():
    bind = plan.node_exporter_bind
    # Default engine on loopback: node_exporter on loopback too.
    assert bind(Settings(), "ws1", "192.0.2.11") == "127.0.0.1"
    # An engine on one LAN address: the same address (the gateway reaches the host there).
    assert bind(Settings(listen_host="192.0.2.21"), "ws1", "192.0.2.11") == "192.0.2.21"
    # An engine on every address: the address the fleet reaches the host by.
    assert bind(Settings(listen_host="0.0.0.0"), "ws1", "192.0.2.11") == "192.0.2.11"
    assert bind(Settings(listen_host="0.0.0.0"), "localhost", None) in ("127.0.0.1", "::1")
    # The setting wins.
    assert bind(Settings(listen_host="0.0.0.0", node_exporter_bind="10.0.0.7"), "ws1", "x") == "10.0.0.7"


def test_an_unresolvable_node_exporter_bind_stops_the_host():
    p = planned(settings=Settings(listen_host="0.0.0.0"), name="ws2")  # ws2 has no ssh_hostname
    assert p.stop is not None and p.stop.reason.startswith("ws2: cannot resolve ws2 for node_exporter's bind address")
    assert p.stop.reason.endswith("set node_exporter_bind")
    ok = planned(settings=Settings(listen_host="0.0.0.0"), name="ws2", find=dns({"ws2": ["192.0.2.12"]}))
    assert ok.converge is not None and ok.converge.node_exporter_bind == "192.0.2.12"


def test_the_cache_binds_where_the_fleet_reaches_the_host_never_everywhere():
    s = Settings(model_cache_host="ws1")
    assert plan.cache_bind_address(s, "ws1", "10.213.0.11") == "10.213.0.11"
    assert plan.cache_bind_address(s, "10.0.0.7", None) == "10.0.0.7"
    assert plan.cache_bind_address(s, "ws1", "fd00::11") == "fd00::11"
    assert plan.cache_bind_address(s, "ws1", "localhost") in ("127.0.0.1", "::1")
    pinned = Settings(model_cache_host="ws1", model_cache_bind="192.168.1.20")
    assert plan.cache_bind_address(pinned, "ws1", "10.213.0.11") == "192.168.1.20"
    with pytest.raises(AddressError, match="ws2: cannot resolve ws2 .*; set model_cache_bind"):
        plan.cache_bind_address(Settings(model_cache_host="ws2"), "ws2", None, no_dns)


# --------------------------------------------------------------------------- the LAN model cache
def test_cache_sources_point_at_the_cache_host_address_then_the_extra_sources():
    fleet = {
        "ws1": plan.FleetHost("ws1", "10.0.0.11"),
        "ws2": plan.FleetHost("ws2"),
        "ws3": plan.FleetHost("ws3", "fd00::3"),
    }
    s = Settings(model_cache_host="ws1", model_sources=["http://controller:8090/"])
    assert plan.cache_sources(s, "ws2", fleet) == ["http://10.0.0.11:8090", "http://controller:8090"]
    assert plan.cache_sources(s, "ws1", fleet) == ["http://controller:8090"]  # the cache host fetches upstream
    assert plan.cache_sources(Settings(model_cache_host="ws2", model_cache_port=9000), "ws1", fleet) == [
        "http://ws2:9000"
    ]
    assert plan.cache_sources(Settings(model_cache_host="ws3"), "ws1", fleet) == ["http://[fd00::3]:8090"]
    assert plan.cache_sources(Settings(), "ws1", fleet) == []


def test_the_lan_cache_host_fetches_first_and_serves_the_others_fetch_after_it_from_it():
    s = Settings(model_cache_host="ws1")
    cache = planned(settings=s, name="ws1").converge
    other = planned(settings=s, name="ws3").converge
    assert cache is not None and other is not None
    assert (cache.model.fetches_first, cache.model.serves_cache, cache.model.sources) == (True, True, ())
    assert cache.model.cache_bind == "192.0.2.11"  # its ssh_hostname: where the others reach it
    assert (other.model.fetches_first, other.model.serves_cache, other.model.cache_bind) == (False, False, None)
    assert other.model.sources == ("http://192.0.2.11:8090",)
    alone = planned().converge  # no cache host: every host fetches upstream, first
    assert alone is not None and (alone.model.fetches_first, alone.model.serves_cache) == (True, False)
    assert alone.model.name == f"Model: {Settings().model_repo}@{Settings().model_revision}"


def test_a_cache_host_whose_bind_cannot_resolve_stops_before_any_change():
    p = planned(settings=Settings(model_cache_host="ws2"), name="ws2")
    assert p.stop is not None and p.stop.reason.endswith("set model_cache_bind") and p.converge is None


# --------------------------------------------------------------------------- the gate
def passed_record(p: plan.ConvergePlan, manifest="m1", **gated):
    assert p.converge is not None
    return GateResult(ok=True, phase="done", gated=replace(p.converge.gate.subject, manifest_sha256=manifest, **gated))


def gate_of(**kwargs) -> plan.GatePlan:
    c = planned(**kwargs).converge
    assert c is not None
    return c.gate


def changed():
    return True


def test_the_gate_is_skipped_when_the_last_passed_gate_is_for_exactly_what_serves():
    record = passed_record(planned())
    gate = gate_of(obs=healthy(health=serving(), gate_record=record))
    assert gate.why is None
    assert gate.run_if(changed) == [changed]  # restart and gate only when a step changes something


@pytest.mark.parametrize(
    "obs_changes,seen_changes,why",
    [
        ({"gate_record": None}, {}, "no gate record on the host"),
        ({"gate_record": GateResult(ok=False, phase="answer")}, {}, "the last gate did not pass (answer)"),
        ({"gate_record": GateResult(ok=False)}, {}, "the last gate did not pass (?)"),
        ({"gate_record": GateResult(ok=True, decode_tps=23.5)}, {}, "the last gate does not say what it gated"),
        ({}, {"manifest": "m2"}, "the last passed gate was for another manifest_sha256"),
        ({"health": serving("0.1.9")}, {}, "the engine serving reports version 0.1.9, not "),
        ({}, {"running": False}, "the engine was not serving before this run"),
        ({"health": None}, {}, "the engine was not serving before this run"),
        ({"health": serving(status="loading")}, {}, "the engine was not serving before this run"),
    ],
)
def test_the_gate_runs_for_each_reason(obs_changes, seen_changes, why):
    record = passed_record(planned())
    obs = healthy(**{"health": serving(), "gate_record": record, **obs_changes})
    gate = gate_of(obs=obs, **seen_changes)
    assert gate.why is not None and gate.why.startswith(why)
    assert gate.run_if(changed) == []  # the restart and the gate run whatever changed


def test_the_gate_runs_when_the_unit_environment_model_or_launch_differ():
    base = planned()
    record = passed_record(base)
    for settings, differs in [
        (Settings(listen_port=18000), "environment_sha256"),
        (Settings(model_revision="r2"), "model"),
        (Settings(engine_version="0.2.9"), "engine_version, unit_sha256"),
    ]:
        obs = healthy(health=serving(settings.engine_version), gate_record=record)
        gate = gate_of(settings=settings, obs=obs)
        assert gate.why is not None and gate.why.startswith(f"the last passed gate was for another {differs}")


def test_why_gate_reads_the_record():
    subject = Gated(engine_version="0.2.1", unit_sha256="u1", environment_sha256="e1", model="m@main")
    doc = GateResult(ok=True, phase="done", gated=subject)
    assert plan.why_gate(doc, subject, None, "0.2.1") is None
    assert "another unit_sha256" in (plan.why_gate(doc, replace(subject, unit_sha256="u2"), None, "0.2.1") or "")
    assert "another launch" in (plan.why_gate(doc, replace(subject, launch=("x",)), None, "0.2.1") or "")


def test_the_gate_subject_hashes_what_the_steps_render():
    c = planned().converge
    assert c is not None
    s = Settings()
    assert c.gate.subject == plan.gate_subject(
        s, RENDER.engine_unit(s, c.launch), RENDER.engine_environment(s), list(c.gate.subject.launch or ())
    )
    assert c.gate.subject.engine_version == s.engine_version
    assert c.gate.subject.model == f"{s.model_repo}@{s.model_revision}"


# --------------------------------------------------------------------------- rollback
def info(active, versions):
    return EngineInstallInfo("/opt/freetoken", versions, active)


def test_the_rollback_target_is_only_an_installed_other_version():
    s = Settings(engine_version="0.2.3")
    assert plan.rollback_target(info("0.2.1", {"0.2.1": "0.2.1", "0.2.3": "0.2.3"}), s, None) == "0.2.1"
    assert plan.rollback_target(info("0.2.3", {"0.2.3": "0.2.3"}), s, None) is None  # same version
    assert plan.rollback_target(info(None, {}), s, None) is None  # first install
    assert plan.rollback_target(info("0.2.1", {"0.2.1": None}), s, None) is None  # broken venv
    assert plan.rollback_target(None, s, None) is None  # the fact was not read


def test_a_run_cut_off_after_the_switch_rolls_back_to_the_last_passed_gates_version():
    upgrade = Settings(engine_version="0.2.2")
    both = {"0.2.1": "0.2.1", "0.2.2": "0.2.2"}
    cut = GateResult.from_dict(
        {"ok": False, "phase": "started", "last_passed": {"ok": True, "gated": {"engine_version": "0.2.1"}}}
    )
    assert plan.rollback_target(info("0.2.2", both), upgrade, cut) == "0.2.1"
    assert plan.rollback_target(info("0.2.2", {"0.2.2": "0.2.2"}), upgrade, cut) is None  # not installed
    assert plan.rollback_target(info("0.2.2", both), upgrade, None) is None
    # An older record names the version only.
    old = GateResult.from_dict({"ok": False, "last_passed": {"ok": True, "version": "0.2.1"}})
    assert plan.rollback_target(info("0.2.2", both), upgrade, old) == "0.2.1"


def test_the_converge_plan_carries_the_rollback_target():
    obs = healthy(engine=info("0.2.0", {"0.2.0": "0.2.0"}))
    gate = gate_of(obs=obs)
    assert gate.rollback_to == "0.2.0"
    assert gate_of().rollback_to is None


# --------------------------------------------------------------------------- the rest of the converge
def test_the_converging_host_gets_its_launch_plan_arch_restart_and_autostart():
    c = planned(running=True).converge
    assert c is not None
    obs = healthy()
    assert c.launch == rules.plan_for(Settings(), obs)
    assert c.nvcc_arch == "compute_120"  # the RTX 5060 Ti's compute capability 12.0
    assert c.restart_if_running and c.autostart is None
    assert c.node_exporter_bind == "127.0.0.1"
    stopped = planned(running=False).converge
    assert stopped is not None and not stopped.restart_if_running
    auto = planned(settings=Settings(windows_autostart=True), distro="Debian").converge
    assert auto is not None and auto.autostart == plan.Autostart("FreeToken-WSL", "Debian", "/mnt/")


def test_an_ipv6_gateway_and_bind_are_kept_as_addresses():
    fleet = {**FLEET, "gw1": plan.FleetHost("gw1", "[fd00::5]", ("gateway",))}
    c = planned(settings=Settings(listen_host="::"), name="ws3", fleet=fleet).converge
    assert c is not None and c.gateways == (ipaddress.ip_address("fd00::5"),)
    assert c.node_exporter_bind == "fd00::3"


# --------------------------------------------------------------------------- a refusal that stands
OLD_WSL = WslVersionInfo("ok", (2, 6, 1), "wslinfo", "2.6.1")
LOCKED = GpuMemoryProbeResult("allocation_locked", 11 * 1024**3, 16 * 1024**3, True, False, 8 * 1024**3, "OOM")


def test_only_blockers_that_change_with_a_boot_stand_until_it():
    """ws3's refusal: an old WSL stands until WSL is updated (which restarts its VM: a new
    boot); the locked GPU memory, free memory or disk never stand (they change at any time)."""
    p = planned(obs=healthy(wsl=OLD_WSL, gpu_memory=LOCKED))
    assert p.stop is not None and p.stop.reason == "preflight blockers: wsl_version, gpu_memory"
    assert [f.check for f in p.stop.standing] == ["wsl_version"]
    assert planned(obs=healthy(gpu_memory=LOCKED)).stop.standing == ()  # the probe alone: re-read every run
    full = replace(healthy().resources, disk_free_bytes=1)
    assert planned(obs=healthy(resources=full)).stop.standing == ()
    no_gpu = healthy(gpus=replace(healthy().gpus, gpus=()))  # a driver can come back without a boot
    assert planned(obs=no_gpu).stop.standing == ()
    wsl1 = healthy(kernel=WslKernelInfo("wsl1", "4.4.0-19041-Microsoft", "Linux version ..."))
    assert [f.check for f in planned(obs=wsl1).stop.standing][:1] == ["wsl2"]


def test_a_refused_hosts_record_stops_it_again_with_its_blockers_and_reads_nothing():
    standing = (rules.Finding("wsl_version", "block", "WSL 2.6.1 < 2.7.13", "wsl.exe --update", standing=True),)
    p = plan.converge_plan(
        plan.Unchanged("ws3", 97, (("wsl_version", "WSL 2.6.1 < 2.7.13", "wsl.exe --update"),)), RENDER
    )
    assert p.stop == plan.Stop(
        "preflight blockers: wsl_version (unchanged since its last full read)",
        advice="the remedies above; once they are done, the next run reads every fact",
        standing=standing,
    )
    assert p.unchanged is not None and p.converge is None and p.windows is None


# --------------------------------------------------------------------------- the fast check's outcomes
# What the deploy prints for a host before any step, how its record answered (the gate table)
# and which record the lock's release writes: fields of the plan, one outcome each.
def test_fast_check_an_unchanged_host_says_so_writes_no_record_and_does_nothing():
    p = plan.converge_plan(plan.Unchanged("ws1", 140), RENDER)
    assert (p.stop, p.windows, p.converge, p.record) == (None, None, None, None)
    assert p.notices == (
        "unchanged since its last converge (140 inputs of its facts checked in one read): nothing to do",
    )
    assert p.answered == "unchanged since its last converge (its record answered; nothing read)"


def test_fast_check_a_refused_hosts_record_prints_each_blocker_and_keeps_its_record():
    refused = (("wsl_version", "WSL 2.6.1\x1b[2J < 2.7.13", "wsl.exe --update"), ("gpu_memory", "locked", "restart"))
    p = plan.converge_plan(plan.Unchanged("ws3", 97, refused), RENDER)
    assert p.record is None  # the record that answered stands; the release writes none
    assert [f.check for f in p.stop.standing] == ["wsl_version", "gpu_memory"]
    assert all(f.standing and f.status == "block" for f in p.stop.standing)
    assert p.answered == "refused at preflight (unchanged since its last full read)"
    assert len(p.notices) == 2 and p.notices[1].endswith("gpu_memory: locked -> restart")
    assert "\x1b" not in p.notices[0]  # the record's text is the host's: printed as text only


def test_fast_check_a_lock_held_elsewhere_or_lost_writes_no_record_and_says_nothing_more():
    for seen_ in (plan.LockRefused("ws1", "held by run 42"), plan.LockRefused("ws1", "x", connection_lost=True)):
        p = plan.converge_plan(seen_, RENDER)
        assert p.stop is not None and (p.record, p.notices, p.answered) == (None, (), None)


def test_fast_check_a_full_read_records_a_converge_or_a_refusal_that_stands():
    assert planned().record == () and planned().answered is None
    old_wsl = planned(obs=healthy(wsl=WslVersionInfo("ok", (2, 6, 1), "wslinfo", "2.6.1")))
    assert old_wsl.stop is not None and old_wsl.record is not None
    assert [check for check, _, _ in old_wsl.record] == [f.check for f in old_wsl.stop.standing] != []
    # A blocker that a boot does not clear (a full disk) is re-read every run: no record.
    full = planned(obs=healthy(resources=replace(healthy().resources, disk_free_bytes=1)))
    assert full.stop is not None and full.record is None
    # A host that waits for WSL's restart writes none either; it says why it waits.
    obs = healthy(init=InitInfo("init", None), wslconf=IniFileInfo("/etc/wsl.conf", False))
    waits = planned(obs=obs, files={WSLCONFIG: WSLCONFIG_OK, "/etc/wsl.conf": None})
    assert waits.windows is not None and waits.windows.waits and waits.record is None
    assert waits.notices == (waits.windows.notice,)


def test_fast_check_an_engine_held_for_its_owner_is_said_in_the_plans_notices():
    p = planned(running=False, owner="yielded (game)")
    assert p.record == () and any("the engine stays stopped: yielded (game)" in n for n in p.notices)
