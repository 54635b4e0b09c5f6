"""The host agent's samples for node_exporter's textfile collector (core/agent_metrics.py, written
by operations/scripts/owner_agent.py): every metric of the contract with its HELP and TYPE, the
1/0 samples following the agent's state, unknown values left out, label values only from fixed
vocabularies, the file replaced whole, and the text accepted by Prometheus's own checker
(``promtool check metrics``, from Debian's prometheus package)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from freetoken_infra.core import agent_metrics, hostio, owner
from operations.scripts import owner_agent

CONTRACT = {
    "freetoken_agent_mode": "gauge",
    "freetoken_agent_yield_reason": "gauge",
    "freetoken_agent_signal_up": "gauge",
    "freetoken_agent_last_loop_timestamp_seconds": "gauge",
    "freetoken_engine_requests_total": "counter",
    "freetoken_engine_generated_tokens_total": "counter",
    "freetoken_gpu_power_watts": "gauge",
    "freetoken_gpu_memory_used_bytes": "gauge",
    "freetoken_gpu_memory_total_bytes": "gauge",
    "freetoken_firewall_table_loaded": "gauge",
}
_SAMPLE = re.compile(r'([a-z_:][a-z0-9_:]*)(\{(?:[a-z_]+="[a-z0-9_]*",?)*\})? (\S+)')


def parse(text: str) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """(name -> TYPE, name -> {labels -> value}); each sample under its own HELP and TYPE."""
    assert text.endswith("\n")
    helped: set[str] = set()
    types: dict[str, str] = {}
    samples: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helped and len(line.split(" ", 3)[3]) > 10, line
            helped.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name in helped and name not in types and name not in samples, line
            types[name] = kind
        else:
            match = _SAMPLE.fullmatch(line)
            assert match, f"not a sample line: {line!r}"
            name, labels = match.group(1), match.group(2) or ""
            assert name in types, f"a sample without its HELP and TYPE: {line}"
            assert labels not in samples.setdefault(name, {}), f"twice: {line}"
            samples[name][labels] = float(match.group(3))
    return types, samples


def promtool(text: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool") or "/usr/bin/promtool"
    assert os.access(binary, os.X_OK), "promtool is not installed: install Debian's prometheus package"
    return subprocess.run([binary, "check", "metrics"], input=text, capture_output=True, text=True, check=False)


def sample(state: owner.AgentState, **values) -> agent_metrics.AgentSample:
    """The agent's samples for ``state`` (as ``Agent.sample`` builds them), every value known."""
    known = dict(
        signals=(("gpu", True), ("apps", True), ("reboot", True)),
        engine_requests=12,
        engine_generated_tokens=3456,
        gpu_power_watts=142.31,
        gpu_memory_used_bytes=6895 * 2**20,
        gpu_memory_total_bytes=16311 * 2**20,
        firewall_loaded=True,
    )
    return agent_metrics.AgentSample(
        modes=owner.MODES,
        mode=state.mode,
        reasons=owner.YIELD_REASONS,
        reason=owner.yield_reason(state),
        last_loop=1765000000.25,
        **{**known, **values},
    )


def test_every_metric_of_the_contract_with_its_help_and_type():
    text = agent_metrics.render(sample(owner.AgentState()))
    types, samples = parse(text)
    assert types == CONTRACT
    assert samples["freetoken_agent_mode"] == {f'{{mode="{m}"}}': float(m == "serving") for m in owner.MODES}
    assert set(samples["freetoken_agent_mode"]) == {
        '{mode="serving"}',
        '{mode="yielding"}',
        '{mode="yielded"}',
        '{mode="starting"}',
        '{mode="held"}',
    }
    reasons = {"game", "app", "full_screen", "snoozed", "off_schedule", "reboot_pending"}
    assert samples["freetoken_agent_yield_reason"] == {f'{{reason="{r}"}}': 0.0 for r in reasons}
    assert samples["freetoken_agent_signal_up"] == {'{signal="gpu"}': 1, '{signal="apps"}': 1, '{signal="reboot"}': 1}
    assert samples["freetoken_agent_last_loop_timestamp_seconds"] == {"": 1765000000.25}
    assert samples["freetoken_engine_requests_total"] == {"": 12}
    assert samples["freetoken_engine_generated_tokens_total"] == {"": 3456}
    assert samples["freetoken_gpu_power_watts"] == {"": 142.31}
    assert samples["freetoken_gpu_memory_used_bytes"] == {"": 6895 * 2**20}
    assert samples["freetoken_gpu_memory_total_bytes"] == {"": 16311 * 2**20}
    assert samples["freetoken_firewall_table_loaded"] == {"": 1}
    checked = promtool(text)
    assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr


GAME = owner.Observation(
    now=100.0, gpu_used_mib=6895 + 12 * 1024, engine_active=True, engine_vram_mib=6042, health_ok=True
)
POLICY = owner.Policy(vram_threshold_mib=4 * 1024, quiet_s=30)


def one_hot(text: str, name: str) -> str | None:
    """The label value whose sample is 1 (checking that all the others are 0)."""
    rows = parse(text)[1][name]
    on = [labels for labels, value in rows.items() if value == 1]
    assert all(value in (0, 1) for value in rows.values()) and len(on) <= 1, rows
    return on[0].split('"')[1] if on else None


def test_a_game_flips_the_mode_and_the_reason_and_its_end_flips_them_back():
    serving = owner.AgentState(since=1.0)
    before = agent_metrics.render(sample(serving))
    assert one_hot(before, "freetoken_agent_mode") == "serving"
    assert one_hot(before, "freetoken_agent_yield_reason") is None
    yielding, _ = owner.step(serving, GAME, POLICY)
    assert yielding.mode == owner.YIELDING
    after = agent_metrics.render(sample(yielding))
    assert one_hot(after, "freetoken_agent_mode") == "yielding"
    assert one_hot(after, "freetoken_agent_yield_reason") == "game"
    yielded, action = owner.step(yielding, replace(GAME, now=101.0, drain_answered=True), POLICY)
    assert action == owner.STOP
    text = agent_metrics.render(sample(yielded))
    assert one_hot(text, "freetoken_agent_mode") == "yielded"
    assert one_hot(text, "freetoken_agent_yield_reason") == "game"
    starting = replace(yielded, mode=owner.STARTING, word="")
    text = agent_metrics.render(sample(starting))
    assert one_hot(text, "freetoken_agent_mode") == "starting"
    assert one_hot(text, "freetoken_agent_yield_reason") is None
    assert agent_metrics.changed(sample(serving), sample(yielding))
    assert not agent_metrics.changed(sample(yielding), replace(sample(yielding), last_loop=2e9, gpu_power_watts=6.12))


@pytest.mark.parametrize(
    "mode, word, reason",
    [
        (owner.YIELDED, "yielded (game)", "game"),
        (owner.YIELDED, "yielded (app eldenring.exe)", "app"),
        (owner.YIELDING, "yielded (full-screen)", "full_screen"),
        (owner.YIELDED, "snoozed", "snoozed"),
        (owner.YIELDED, "off schedule", "off_schedule"),
        (owner.HELD, "reboot pending", "reboot_pending"),
        (owner.SERVING, "", None),
        (owner.YIELDED, 'yielded (app x"} 1\nfreetoken_agent_mode{mode="serving.exe)', None),  # none of ours
    ],
)
def test_each_claim_is_its_fixed_reason_never_the_apps_name(mode, word, reason):
    state = owner.AgentState(mode=mode, word=word)
    assert owner.yield_reason(state) == reason
    text = agent_metrics.render(sample(state))
    assert one_hot(text, "freetoken_agent_yield_reason") == reason
    assert "eldenring" not in text and 'x"' not in text


def test_what_is_not_known_is_left_out_never_zero():
    nothing = sample(
        owner.AgentState(),
        engine_requests=None,
        engine_generated_tokens=None,
        gpu_power_watts=None,
        gpu_memory_used_bytes=None,
        gpu_memory_total_bytes=None,
        firewall_loaded=None,
    )
    text = agent_metrics.render(nothing)
    types, _ = parse(text)
    assert set(types) == {
        "freetoken_agent_mode",
        "freetoken_agent_yield_reason",
        "freetoken_agent_signal_up",
        "freetoken_agent_last_loop_timestamp_seconds",
    }
    assert "freetoken_engine" not in text and "freetoken_gpu" not in text and "firewall" not in text
    checked = promtool(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # a firewall that is kept but not live is a 0, not left out
    assert parse(agent_metrics.render(replace(nothing, firewall_loaded=False)))[1][
        "freetoken_firewall_table_loaded"
    ] == {"": 0}
    # the engine stopped answering: its counters go, at once (not at the next periodic write)
    assert agent_metrics.changed(sample(owner.AgentState()), replace(sample(owner.AgentState()), engine_requests=None))


def test_engine_counters_are_read_from_its_stats_and_checked():
    stats = {"vram_bytes": 1, "requests": {"active": 1, "completed": 7, "completion_tokens_total": 901}}
    assert owner_agent.counters_from_stats(stats) == (7, 901)
    assert owner_agent.counters_from_stats(None) == (None, None)
    assert owner_agent.counters_from_stats({"requests": "7"}) == (None, None)
    assert owner_agent.counters_from_stats({"requests": {"completed": -1, "completion_tokens_total": True}}) == (
        None,
        None,
    )
    assert owner_agent.counters_from_stats({"requests": {"completed": 1.5, "completion_tokens_total": "9"}}) == (
        None,
        None,
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"mode": 'serving"} 1\nx{a="'},  # not a mode of the vocabulary
        {"signals": (("Among Us.exe", True),)},  # host text as a label value
        {"engine_requests": -1},
        {"gpu_power_watts": float("nan")},
    ],
)
def test_a_value_outside_the_vocabulary_or_its_type_is_refused(bad):
    with pytest.raises(ValueError):
        agent_metrics.render(replace(sample(owner.AgentState()), **bad))


def _export_agent(tmp_path: Path, power=None) -> owner_agent.Agent:
    argv = ["serve", "--unit", "freetoken.service", "--engine-url", "http://127.0.0.1:9", "--key-file", "/none"]
    argv += ["--bind", "127.0.0.1", "--port", "0", "--vram-threshold-gb", "4", "--quiet-s", "30"]
    argv += ["--drain-timeout-s", "2", "--state-file", str(tmp_path / "state.json")]
    argv += ["--override-file", str(tmp_path / "override.json"), "--textfile", str(tmp_path / "m" / "agent.prom")]
    args = owner_agent.parser().parse_args(argv)
    watch = owner_agent.WindowsWatch(None, (), False, False, 5.0)
    port = owner_agent.AgentPort("127.0.0.1", 0)
    port.sock.close()
    return owner_agent.Agent(args, watch, port, gpu=lambda: 853, power=power)


OBS = owner.Observation(now=0.0, gpu_used_mib=853, engine_active=False, engine_vram_mib=None, health_ok=False)


def test_the_file_is_replaced_whole_and_a_failed_write_leaves_the_last_one(tmp_path, monkeypatch):
    agent = _export_agent(tmp_path)
    folder = tmp_path / "m"
    agent.export(1000.0, OBS)  # no folder (node_exporter off): nothing written, the loop goes on
    assert not folder.exists() and agent.export_problem and "FileNotFoundError" in agent.export_problem
    folder.mkdir()
    agent.export(1001.0, OBS)  # a change? no, but the last write failed long enough ago: not yet
    assert not (folder / "agent.prom").exists()
    agent.export(1006.0, OBS)
    first = (folder / "agent.prom").read_text()
    assert parse(first)[1]["freetoken_agent_last_loop_timestamp_seconds"] == {"": 1006.0}
    assert oct((folder / "agent.prom").stat().st_mode & 0o777) == "0o644"  # node_exporter is not root
    assert agent.export_problem is None
    agent.export(1007.0, OBS)  # nothing changed but the clock: not rewritten before METRICS_EVERY_S
    assert (folder / "agent.prom").read_text() == first
    agent.state = replace(agent.state, mode=owner.YIELDED, word="snoozed")
    agent.export(1007.5, OBS)  # the mode changed: written at once
    snoozed = (folder / "agent.prom").read_text()
    assert one_hot(snoozed, "freetoken_agent_mode") == "yielded"
    assert one_hot(snoozed, "freetoken_agent_yield_reason") == "snoozed"
    agent.state = replace(agent.state, mode=owner.HELD, word="reboot pending")
    # the write dies half way (the disk full): the collector still reads the last whole file, and
    # the temporary one, never named *.prom, is gone
    seen: list[list[str]] = []

    def fail(fd: int) -> None:
        seen.append(sorted(os.listdir(folder)))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hostio.os, "fsync", fail)
    agent.export(1008.0, OBS)
    assert seen and any(n.endswith(".tmp") and not n.endswith(".prom") for n in seen[0])
    assert sorted(os.listdir(folder)) == ["agent.prom"] and (folder / "agent.prom").read_text() == snoozed
    assert agent.export_problem == "OSError: No space left on device"
    monkeypatch.undo()
    agent.export(1009.0, OBS)  # a failed write is tried again every METRICS_EVERY_S, not every round
    assert (folder / "agent.prom").read_text() == snoozed
    agent.export(1013.0, OBS)
    text = (folder / "agent.prom").read_text()
    assert one_hot(text, "freetoken_agent_mode") == "held"
    assert one_hot(text, "freetoken_agent_yield_reason") == "reboot_pending"
    assert sorted(os.listdir(folder)) == ["agent.prom"] and agent.export_problem is None
    # without --textfile nothing is rendered or written
    agent.args.textfile = None
    agent.export(2000.0, OBS)
    assert (folder / "agent.prom").read_text() == text


def test_the_firewall_table_is_listed_once_a_minute_and_must_read_as_loaded(tmp_path):
    record = tmp_path / "freetoken-firewall.loaded"
    listing = "table inet freetoken {\n\tchain input {\n\t}\n}\n"
    record.write_text(listing)
    live: list[str | None] = [listing]
    calls: list[int] = []

    def nft() -> str | None:
        calls.append(1)
        return live[0]

    check = owner_agent.FirewallCheck(str(record), listing=nft)
    assert check.check(1000.0) is True
    live[0] = None  # `nft flush ruleset`
    assert check.check(1030.0) is True and len(calls) == 1  # not listed again within the minute
    assert check.check(1060.0) is False and len(calls) == 2
    live[0] = listing.replace("chain input", "chain input2")  # changed by hand
    assert check.check(1120.0) is False
    live[0] = listing
    record.unlink()  # the unit never loaded it this boot
    assert check.check(1180.0) is False
    record.write_text(listing)
    assert check.check(1240.0) is True
    assert check.check(900.0) is True and len(calls) == 6  # a clock set back lists again


def test_signals_are_fixed_labels_of_the_configured_windows_reads():
    watch = owner_agent.WindowsWatch("/nowhere", ("eldenring.exe",), True, False, 5.0)
    assert watch.signal_states() == ()  # not read yet: left out
    with watch.lock:
        watch.read_yet = True
        watch.broken = {owner.SIG_FULLSCREEN: owner.EXEC_FORMAT}
    assert watch.signal_states() == (("apps", True), ("full_screen", False))
    assert set(owner.SIGNAL_LABELS.values()) == {"gpu", "apps", "full_screen", "reboot"}


def test_the_cards_draw_is_read_only_for_a_write(tmp_path):
    draws: list[float] = []

    def power() -> float:
        draws.append(6.12)
        return 6.12

    agent = _export_agent(tmp_path, power)
    (tmp_path / "m").mkdir()
    for now in (1000.0, 1001.0, 1002.0, 1003.0, 1004.0, 1005.0):
        agent.export(now, OBS)
    assert len(draws) == 2  # written at 1000 and 1005, not every round
    samples = parse((tmp_path / "m" / "agent.prom").read_text())[1]
    assert samples["freetoken_gpu_power_watts"] == {"": 6.12}
    assert samples["freetoken_gpu_memory_used_bytes"] == {"": 853 * 2**20}
    assert "freetoken_gpu_memory_total_bytes" not in samples  # nvidia-smi's figure alone: no total
    # the card unread: neither its memory nor its draw
    agent.export(1010.0, replace(OBS, gpu_used_mib=None))
    samples = parse((tmp_path / "m" / "agent.prom").read_text())[1]
    assert "freetoken_gpu_power_watts" not in samples and "freetoken_gpu_memory_used_bytes" not in samples
    assert samples["freetoken_agent_signal_up"] == {'{signal="gpu"}': 0}
    assert len(draws) == 2
