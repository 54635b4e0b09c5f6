"""The host agent and its engine: no engine answer stalls a decision
(one total deadline per read, the reads in a thread of their own, an answer taken only while
fresh), a lying engine hides no game, and the card's memory read through NVML (the stand-in
library the simulated fleet installs) reads as the nvidia-smi stand-in does.

The engines here are stand-ins on loopback: one drips its answer a byte every 0.5 s, one lies
about its VRAM. No assert bounds wall-clock time: deadlines run on injected clocks, and "while
the drip is still going" is the drip's own event."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from freetoken_infra.core import owner
from operations.scripts import owner_agent

ROOT = Path(__file__).resolve().parents[2]
STANDINS = ROOT / "tests" / "fleet" / "standins"
ENGINE_MIB = 6042
IDLE_MIB = 853
GAME_MIB = 12 * 1024
DRIP_BYTES = 60  # a minute of dripping at 0.5 s a byte


class Engine:
    """A stand-in engine on loopback. ``drip``: every answer's body goes out one byte every
    0.5 s (``dripping`` set once the first byte went, ``done`` once a whole body went);
    otherwise ``/health`` says ok and ``/v1/stats`` says ``vram`` at once."""

    def __init__(self, drip: bool = False, vram: object = ENGINE_MIB * 2**20):
        self.drip, self.vram = drip, vram
        self.dripping, self.done, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.requests: list[bytes] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = conn.recv(65536)
                self.requests.append(request)
                path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b"/"
                if self.drip:
                    doc: dict = {"status": "ok", "vram_bytes": ENGINE_MIB * 2**20, "drain_complete": True}
                    body = json.dumps(doc).encode().ljust(DRIP_BYTES)
                elif path == b"/health":
                    body = b'{"status": "ok"}'
                else:
                    body = json.dumps({"vram_bytes": self.vram}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
                conn.sendall(f"Content-Length: {len(body)}\r\n\r\n".encode())
                if not self.drip:
                    conn.sendall(body)
                    return
                for i in range(len(body)):
                    if self.stop.wait(0.5):
                        return
                    conn.sendall(body[i : i + 1])
                    self.dripping.set()
                self.done.set()
            except OSError:  # the agent hung up: that drip is over, not done
                pass

    def close(self) -> None:
        self.stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        except OSError:
            pass
        self.sock.close()


@pytest.fixture
def dripping_engine():
    engine = Engine(drip=True)
    yield engine
    engine.close()


class FakeClock:
    """A monotonic clock that moves ``step`` seconds each time it is read."""

    def __init__(self, step: float):
        self.t, self.step = 1000.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_an_engine_read_has_one_total_deadline_however_slowly_it_drips(dripping_engine):
    """A per-read timeout let a body dripped a byte every 1.9 s hold one call for hours: now the
    connect, the headers and the body share one deadline."""
    clock = FakeClock(0.5)  # each look at the clock: half a second gone
    assert owner_agent.http_json(f"{dripping_engine.url}/v1/stats", deadline_s=4.0, clock=clock) is None
    assert not dripping_engine.done.is_set()  # cut off while the engine was still dripping


def test_prepare_stop_keeps_its_bound_when_the_engine_drips(dripping_engine):
    clock = FakeClock(1.0)
    said = owner_agent.prepare_stop(dripping_engine.url, "k", 2.0, clock=clock)  # bound: 2 + 3 + 5 s
    assert said == "prepare-stop: no answer"
    assert not dripping_engine.done.is_set()
    assert dripping_engine.requests and b"prepare-stop" in dripping_engine.requests[0]


def test_an_engine_answer_is_read_whole_and_checked():
    engine = Engine(vram=ENGINE_MIB * 2**20)
    try:
        assert owner_agent.http_json(f"{engine.url}/health") == {"status": "ok"}
        assert owner_agent.vram_from_stats(owner_agent.http_json(f"{engine.url}/v1/stats", key="k")) == ENGINE_MIB
        assert b"Authorization: Bearer k\r\n" in engine.requests[-1]
    finally:
        engine.close()
    assert owner_agent.http_json(engine.url + "/health") is None  # nobody listens: no answer
    assert owner_agent.http_json("ftp://127.0.0.1/health") is None


def _agent(tmp_path: Path, url: str, used: list[int], deadline_s: float = 2.0) -> owner_agent.Agent:
    """The agent's decision loop, its engine seen come up (the card's idle baseline and what it
    took are in its state file), reading the engine at ``url`` from its reader thread."""
    state = owner.AgentState(since=1.0, idle_used_mib=IDLE_MIB, engine_mib=ENGINE_MIB)
    (tmp_path / "state.json").write_bytes(owner.dump_state(state, 1.0))
    (tmp_path / "key.env").write_text("FREETOKEN_API_KEY=k\n")
    argv = ["serve", "--unit", "freetoken.service", "--engine-url", url, "--key-file", str(tmp_path / "key.env")]
    argv += ["--bind", "127.0.0.1", "--port", "0", "--vram-threshold-gb", "4", "--quiet-s", "30"]
    argv += ["--drain-timeout-s", "2", "--interval-s", "0.05", "--state-file", str(tmp_path / "state.json")]
    argv += ["--override-file", str(tmp_path / "override.json")]
    args = owner_agent.parser().parse_args(argv)
    watch = owner_agent.WindowsWatch(None, (), False, False, 5.0)
    port = owner_agent.AgentPort("127.0.0.1", 0)
    agent = owner_agent.Agent(args, watch, port, gpu=lambda: used[0])
    agent.unit = owner_agent.UnitState("freetoken.service", read=lambda unit: True)  # systemd: active
    agent.reader.deadline_s = deadline_s
    threading.Thread(target=agent.reader.serve, daemon=True).start()
    return agent


def _until_stop(agent: owner_agent.Agent) -> list[owner.Observation]:
    """Decision rounds, a second apart by the agent's clock, until it decides to stop the engine
    (the gateway never reads the drain: the stop comes after owner.GATEWAY_NOTICE_S)."""
    seen = []
    for i in range(30):
        obs, action = agent.decide(2000.0 + i)
        seen.append(obs)
        if action == owner.STOP:
            return seen
    raise AssertionError(f"never decided to stop: {agent.state}")


def test_the_owners_game_stops_the_engine_while_the_engine_is_still_dripping(tmp_path, dripping_engine):
    """The engine's reads are off the decision loop: an engine that drips its /health and
    /v1/stats is unknown (no fresh answer), its share is what the card took when it came up, and
    the game stops it, all while the drip goes on."""
    # a reader that would wait an hour for each answer: the loop must not wait with it
    agent = _agent(tmp_path, dripping_engine.url, [IDLE_MIB + ENGINE_MIB + GAME_MIB], deadline_s=3600.0)
    seen = _until_stop(agent)
    assert not dripping_engine.done.is_set()
    assert all(o.engine_vram_mib is None and not o.health_ok for o in seen)  # unknown, never waited for
    assert agent.state.mode == "yielded" and agent.state.word == "yielded (game)"


def test_a_stale_answer_is_no_answer():
    reader = owner_agent.EngineReader("http://127.0.0.1:9", "/nonexistent", 1.0)
    reader.latest = owner_agent.EngineAnswer(at=100.0, answered=True, health_ok=True, vram_mib=ENGINE_MIB)
    assert reader.fresh(102.0, 3.0) == reader.latest
    assert reader.fresh(103.5, 3.0) is None


@pytest.mark.parametrize("vram", [2**50, 10**40, -(2**20), "1e15", 1.5e15, None, [1], True])
def test_an_engine_lying_about_its_vram_still_yields_to_a_game(tmp_path, vram):
    """/v1/stats says the engine holds 1 PiB (or a negative, or not a number) while the owner's
    game holds 12 GiB: the engine's share is bounded by what the card shows it took, and the
    engine is stopped."""
    engine = Engine(vram=vram)
    try:
        agent = _agent(tmp_path, engine.url, [IDLE_MIB + ENGINE_MIB])
        assert agent.reader.published.wait(60) and agent.reader.latest is not None  # read once
        obs, action = agent.decide(1999.0)
        assert obs.health_ok and agent.state.mode == "serving" and action is None
        agent.gpu = lambda: IDLE_MIB + ENGINE_MIB + GAME_MIB  # the game
        seen = _until_stop(agent)
        assert seen[0].health_ok  # the engine's answers were fresh: its figure was weighed
        assert agent.state.others_mib == IDLE_MIB + GAME_MIB
    finally:
        engine.close()


def test_the_unit_state_is_read_only_when_it_may_have_changed():
    reads: list[str] = []
    unit = owner_agent.UnitState("freetoken.service", every_s=10.0, read=lambda u: reads.append(u) or True)
    assert unit.active(0.0, True)
    for t in range(1, 10):
        unit.active(float(t), True)
    assert len(reads) == 1  # not once a second
    unit.active(9.5, False)  # the engine stopped answering: read now
    assert len(reads) == 2
    unit.active(9.6, False)
    unit.forget()  # the agent's own start or stop
    unit.active(9.7, False)
    assert len(reads) == 3
    unit.active(19.7, False)
    assert len(reads) == 4


def test_the_windows_thread_wakes_only_as_often_as_its_signals_need(tmp_path):
    reboot_only = owner_agent.WindowsWatch(str(tmp_path), (), False, True, 5.0, reboot_interval_s=60.0)
    assert reboot_only.period_s == 60.0
    apps = owner_agent.WindowsWatch(str(tmp_path), ("game.exe",), False, True, 5.0, reboot_interval_s=60.0)
    assert apps.period_s == 5.0
    assert not owner_agent.WindowsWatch(str(tmp_path), (), False, False, 5.0).wanted  # no thread at all


# ---- the card's memory through NVML: the fleet's stand-in library against its nvidia-smi stand-in


@pytest.fixture(scope="module")
def standin_nvml(tmp_path_factory) -> Path:
    """tests/fleet/standins/libnvidia-ml.c built as harness.build_libnvidia_ml builds it."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed (tests/run.sh installs it): cannot build the NVML stand-in")
    out = tmp_path_factory.mktemp("nvml") / "libnvidia-ml.so.1"
    src = STANDINS / "libnvidia-ml.c"
    cmd = [gcc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-Wl,-soname,libnvidia-ml.so.1", "-o", str(out)]
    subprocess.run([*cmd, str(src)], check=True, capture_output=True)
    return out


def _smi_used(sim: Path) -> int:
    run = subprocess.run(
        [
            sys.executable,
            str(STANDINS / "bin" / "nvidia-smi"),
            "--query-gpu=memory.used",
            "--format=csv,noheader,nounits",
        ],
        env={**os.environ, "FREETOKEN_SIM_DIR": str(sim)},
        capture_output=True,
        text=True,
        check=True,
    )
    return int(run.stdout.strip())


def test_the_agent_reads_the_cards_memory_through_nvml_as_nvidia_smi_shows_it(standin_nvml, tmp_path, monkeypatch):
    from tests.fleet import harness, profiles

    profile = profiles.profile_for("ws1")
    sim = tmp_path / "sim"
    sim.mkdir()
    (sim / "profile.json").write_text(json.dumps(profile.to_dict()))
    (sim / "gpu.conf").write_text(harness.gpu_conf_text(profile))
    monkeypatch.setenv("FREETOKEN_SIM_DIR", str(sim))
    smi_calls: list[int] = []
    gpu = owner_agent.GpuMemory((str(tmp_path / "missing.so"), str(standin_nvml)), fallback=lambda: smi_calls.append(1))
    assert gpu.used_mib() == _smi_used(sim) == profile.gpu.memory_used_mib
    game = profile.gpu.memory_total_mib - 1024  # the owner's game, as tests/fleet/test_owner.py sets it
    (sim / "gpu-memory-used-mib").write_text(f"{game}\n")
    assert gpu.used_mib() == _smi_used(sim) == game
    (sim / "gpu-memory-used-mib").unlink()
    assert gpu.used_mib() == _smi_used(sim) == profile.gpu.memory_used_mib
    assert smi_calls == [] and gpu.source == "through NVML"  # never a process
    nvml = gpu.nvml
    assert nvml is not None
    nvml.close()


def test_without_nvml_the_agent_reads_nvidia_smi(standin_nvml, tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_SIM_DIR", str(tmp_path / "no-sim"))  # the stand-in finds no GPU
    assert owner_agent.GpuMemory((str(standin_nvml),), fallback=lambda: 42).used_mib() == 42
    assert owner_agent.GpuMemory((str(tmp_path / "none.so"),), fallback=lambda: 43).used_mib() == 43
    assert owner_agent.GpuMemory((), fallback=lambda: 44).used_mib() == 44


def _smi_query(sim: Path, fields: str) -> list[str]:
    run = subprocess.run(
        [
            sys.executable,
            str(STANDINS / "bin" / "nvidia-smi"),
            f"--query-gpu={fields}",
            "--format=csv,noheader,nounits",
        ],
        env={**os.environ, "FREETOKEN_SIM_DIR": str(sim)},
        capture_output=True,
        text=True,
        check=True,
    )
    return [v.strip() for v in run.stdout.strip().split(",")]


def test_the_agents_metrics_read_the_cards_total_and_power_through_nvml(standin_nvml, tmp_path, monkeypatch):
    """nvmlDeviceGetPowerUsage (milliwatts) as watts, and the total memory, for the agent's
    samples: what nvidia-smi's power.draw and memory.total say of the same card."""
    from tests.fleet import harness, profiles

    profile = profiles.profile_for("ws1")
    sim = tmp_path / "sim"
    sim.mkdir()
    (sim / "profile.json").write_text(json.dumps(profile.to_dict()))
    (sim / "gpu.conf").write_text(harness.gpu_conf_text(profile))
    monkeypatch.setenv("FREETOKEN_SIM_DIR", str(sim))
    gpu = owner_agent.GpuMemory((str(standin_nvml),), fallback=lambda: None)
    assert gpu.power_watts() is None  # not opened yet: no read
    draws = []
    for game in (None, profile.gpu.memory_total_mib - 1024):
        if game is not None:
            (sim / "gpu-memory-used-mib").write_text(f"{game}\n")
        used = gpu.used_mib()
        total, smi_used, watts = _smi_query(sim, "memory.total,memory.used,power.draw")
        assert used == int(smi_used)
        assert gpu.reading == owner_agent.GpuReading(used * 2**20, int(total) * 2**20)
        assert gpu.power_watts() == float(watts)
        draws.append(float(watts))
    assert draws == [6.12, 142.31]  # idle, then the game's draw
    # nvidia-smi's fallback: the used memory only, no draw
    smi = owner_agent.GpuMemory((), fallback=lambda: 853)
    assert smi.used_mib() == 853 and smi.reading == owner_agent.GpuReading(853 * 2**20)
    assert smi.power_watts() is None
    assert gpu.nvml is not None
    gpu.nvml.close()
