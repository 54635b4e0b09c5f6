"""The FreeToken engine stand-in, run from its source dir on loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.fleet import harness
from tests.fleet.profiles import PROFILES
from tests.fleet.standins import hub_repos
from tests.loopback import free_port, wait_listening

ENGINE_SRC = Path(__file__).resolve().parents[1] / "fleet" / "standins" / "engine"
sys.path.insert(0, str(ENGINE_SRC))
from freetoken.server import args as standin_args  # noqa: E402


@pytest.fixture()
def model(standin_repos, tmp_path):
    dst = tmp_path / "Qwen3.6-35B-A3B-NVFP4-nvidia"
    shutil.copytree(standin_repos / hub_repos.SUPPORTED_REPO, dst)
    return dst


class Engine:
    def __init__(self, tmp_path, model, *extra, config=None, env=None):
        self.port = free_port(with_next=True)
        cfg = tmp_path / "standin.json"
        cfg.write_text(
            json.dumps({"load_seconds": 1.0, "error_exit_delay_s": 1, "tokens_per_s": 40.0, **(config or {})})
        )
        e = dict(os.environ, PYTHONPATH=str(ENGINE_SRC), FREETOKEN_STANDIN_CONFIG=str(cfg))
        e.pop("FREETOKEN_API_KEY", None)
        e.update(env or {})
        self.out, self.err = tmp_path / "out.log", tmp_path / "err.log"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "freetoken",
                "--model-path",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *extra,
            ],
            env=e,
            stdout=self.out.open("w"),
            stderr=self.err.open("w"),
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_bound(self):
        for _ in range(200):
            try:
                return self.health()
            except OSError:
                if self.proc.poll() is not None:
                    return None
                time.sleep(0.025)
        raise AssertionError("engine stand-in never bound")

    def health(self):
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
            assert r.status == 200
            return json.loads(r.read())

    def wait_status(self, status, timeout=15):
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            h = self.health()
            seen.append(h)
            if h["status"] == status:
                return h, seen
            time.sleep(0.05)
        raise AssertionError(f"never {status}: {seen[-3:]}")

    def call(self, path, body=None, headers=None, method=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}, method=method
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def logs(self):
        return self.out.read_text(), self.err.read_text()


@pytest.fixture()
def engines():
    started = []
    yield started
    for e in started:
        e.stop()


def start(engines, *a, **kw) -> Engine:
    e = Engine(*a, **kw)
    engines.append(e)
    return e


def test_loading_then_ok_503_while_loading_and_ready_line(engines, tmp_path, model):
    e = start(engines, tmp_path, model, config={"load_seconds": 2.0})
    h = e.wait_bound()
    assert h["status"] == "loading" and h["phase"] in ("weights", "expert_banks", "warmup")
    assert h["progress"]["total_bytes"] >= 0
    status, body = e.call("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert (status, json.loads(body)) == (503, {"error": "model is still loading"})
    ok, seen = e.wait_status("ok")
    phases = [s.get("phase") for s in seen if s["status"] == "loading"]
    assert "expert_banks" in phases
    assert ok["version"] == "0.2.1" and ok["model"] == model.name and isinstance(ok["uptime_s"], int)
    assert any(s["progress"]["done_bytes"] > 0 for s in seen if s["status"] == "loading")
    out, _ = e.logs()
    assert f"API server is ready to serve on 127.0.0.1:{e.port}" in out
    with socket.create_connection(("127.0.0.1", e.port + 1), timeout=2):
        pass  # the gloo stand-in listener
    status, body = e.call("/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == model.name


def test_auth_key_from_env_bearer_and_x_api_key(engines, tmp_path, model):
    e = start(engines, tmp_path, model, "--served-model-name", "qwen", env={"FREETOKEN_API_KEY": "k3y"})
    e.wait_bound()
    e.wait_status("ok")  # /health is exempt
    assert e.call("/v1/models")[0] == 401
    assert e.call("/v1/models", headers={"Authorization": "Bearer nope"})[0] == 401
    status, body = e.call("/v1/models", headers={"Authorization": "Bearer k3y"})
    assert status == 200 and json.loads(body)["data"][0]["id"] == "qwen"
    assert e.call("/v1/models", headers={"x-api-key": "k3y"})[0] == 200


def test_empty_api_key_is_an_error(tmp_path, model):
    r = subprocess.run(
        [sys.executable, "-m", "freetoken", "--model-path", str(model), "--api-key", ""],
        env=dict(os.environ, PYTHONPATH=str(ENGINE_SRC)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "--api-key is empty" in r.stderr


def test_stream_pace_and_usage(engines, tmp_path, model):
    e = start(engines, tmp_path, model, config={"tokens_per_s": 40.0, "load_seconds": 0.2})
    e.wait_bound()
    e.wait_status("ok")
    req = urllib.request.Request(
        e.url + "/v1/chat/completions",
        data=json.dumps(
            {
                "messages": [{"role": "user", "content": "count to twenty please"}],
                "max_tokens": 20,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.monotonic()
    stamps, chunks = [], []
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                chunks.append("DONE")
                break
            c = json.loads(line[6:])
            chunks.append(c)
            if c["choices"] and c["choices"][0]["delta"].get("content"):
                stamps.append(time.monotonic() - t0)
    assert chunks[-1] == "DONE" and chunks[0]["object"] == "chat.completion.chunk"
    assert len(stamps) == 20
    # Paced at 40 tokens/s: 20 tokens cannot all arrive sooner than 19 intervals after the
    # request (a slow machine only makes it later; the pace itself is bench material).
    assert stamps[-1] >= 0.9 * 19 / 40, stamps
    usage = chunks[-2]["usage"]
    assert usage["completion_tokens"] == 20 and usage["total_tokens"] == usage["prompt_tokens"] + 20
    status, body = e.call("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
    doc = json.loads(body)
    assert status == 200 and doc["usage"]["completion_tokens"] == 3 and doc["choices"][0]["finish_reason"] == "length"
    status, body = e.call("/v1/completions", {"prompt": "abc", "max_tokens": 2})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


def test_unknown_flag_rejected_like_argparse(tmp_path, model):
    r = subprocess.run(
        [sys.executable, "-m", "freetoken", "--model-path", str(model), "--attn-backend", "x"],
        env=dict(os.environ, PYTHONPATH=str(ENGINE_SRC)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "python -m freetoken: error: unrecognized arguments: --attn-backend x" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "freetoken", "--model-path", str(model), "--moe-cache-size", "256", "--moe-cache-auto"],
        env=dict(os.environ, PYTHONPATH=str(ENGINE_SRC)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


def test_parser_matches_real_0_2_1_flags():
    real = []
    for line in (ENGINE_SRC / "REAL_FLAGS_0.2.1.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            real.append(line)
    parser = standin_args.build_parser()
    groups = {}
    for name, g in (
        ("kv_capacity_group", parser._mutually_exclusive_groups[0]),
        ("moe_cache_group", parser._mutually_exclusive_groups[1]),
    ):
        for act in g._group_actions:
            groups[id(act)] = name
    mine = []
    for act in parser._actions:
        if act.option_strings == ["-h", "--help"]:
            continue
        line = " ".join(act.option_strings)
        if id(act) in groups:
            line += f" group={groups[id(act)]}"
        mine.append(line)
    assert mine == real
    ns = parser.parse_args(["--model-path", "m"])
    assert (
        ns.server_host,
        ns.server_port,
        ns.max_running_req,
        ns.max_extend_tokens,
        ns.kv_reserve_tokens,
        ns.attention_backend,
        ns.moe_strategy,
        ns.memory_ratio,
    ) == ("127.0.0.1", 1919, 4, 8192, 8192, "auto", "auto", 0.9)


def test_unsupported_model_fails_with_fp8_tensor(engines, tmp_path, standin_repos):
    e = start(engines, tmp_path, standin_repos / hub_repos.UNSUPPORTED_REPO, config={"fatal_exit": "code"})
    e.wait_bound()
    rc = e.proc.wait(20)
    _, err = e.logs()
    assert rc != 0
    lines = err.splitlines()
    i = lines.index("NotImplementedError: no quant method for moe.fp8_tensor")  # a traceback's last line
    assert "Traceback (most recent call last):" in lines[:i]


def test_missing_shard_is_an_error_and_health_reports_it(engines, tmp_path, model):
    (model / "model-00002-of-00003.safetensors").unlink()
    e = start(engines, tmp_path, model, config={"error_exit_delay_s": 3})
    e.wait_bound()
    h, _ = e.wait_status("error")
    assert "model-00002-of-00003.safetensors" in h["message"]
    assert e.proc.wait(20) == -signal.SIGTERM  # the real engine dies by SIGTERM after the grace


def test_fault_switches_oom_then_crash(engines, tmp_path, model):
    e = start(engines, tmp_path, model, config={"load_seconds": 0.2})
    e.wait_bound()
    e.wait_status("ok")
    assert e.call("/_standin/fault", {"kind": "oom"})[0] == 200
    # The real 0.2.1: the scheduler worker dies of it; the API server's supervisor logs an ERROR
    # record (tagged FrontendAPI) and /health turns error (exit follows after the grace).
    assert e.health()["status"] == "error"
    stdout, stderr = e.logs()
    record = (
        r"^\x1b\[1m\[\d{4}-\d\d-\d\d\|\d\d:\d\d:\d\d\|FrontendAPI\]\x1b\[0m \x1b\[31mERROR   "
        r"\x1b\[0m Backend supervisor: backend worker freetoken-TP0-scheduler exited$"
    )
    assert re.search(record, stdout, re.M), stdout
    traceback = (
        r"^Process freetoken-TP0-scheduler:\nTraceback \(most recent call last\):\n(  .*\n)+"
        r"torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate "
    )
    assert re.search(traceback, stderr, re.M), stderr
    assert "this process has 17179869184.00 GiB memory in use" in e.logs()[1]
    assert "GPU 0 has a total capacity of 15.93 GiB of which 11.60 GiB is free" in e.logs()[1]
    assert e.call("/_standin/fault", {"kind": "crash"})[0] == 200
    assert e.proc.wait(10) == 1
    assert e.logs()[1].rstrip().splitlines()[-1].startswith("RuntimeError: CUDA error")


def test_fault_oom_in_torch_2_11s_accelerator_shape_is_what_the_guard_stops_for(engines, tmp_path, model):
    """Both shapes are producible: ``"shape": "accelerator"`` ends the worker's traceback in
    torch 2.11's AcceleratorError (tests/fixtures/real/torch-2.11-cuda-oom-h200.txt); the guard's
    reader (operations/scripts/guard.py, find_ooms) finds an OOM death in the stand-in's output."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "operations" / "scripts"))
    try:
        import guard
    finally:
        sys.path.pop(0)
    e = start(engines, tmp_path, model, config={"load_seconds": 0.2})
    e.wait_bound()
    e.wait_status("ok")
    assert e.call("/_standin/fault", {"kind": "oom", "shape": "accelerator"})[0] == 200
    stdout, stderr = e.logs()
    assert "\ntorch.AcceleratorError: CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation'" in stderr
    # The journal's order: the worker's traceback (stderr), then the supervisor's record (stdout).
    died = [line for line in stdout.splitlines() if "Backend supervisor: backend worker" in line]
    found, _ = guard.find_ooms(stderr.splitlines() + died)
    assert found and found[-1].startswith("torch.AcceleratorError: CUDA error: out of memory"), found


def test_fault_exit_turns_health_error_then_exits(engines, tmp_path, model):
    e = start(engines, tmp_path, model, config={"load_seconds": 0.2, "error_exit_delay_s": 1, "fatal_exit": "code"})
    e.wait_bound()
    e.wait_status("ok")
    assert e.call("/_standin/fault", {"kind": "exit"})[0] == 200
    assert e.health()["status"] == "error"
    assert e.call("/v1/completions", {"prompt": "x"})[0] == 503
    assert e.proc.wait(10) == 1


def test_broken_build_reports_error_after_load(engines, tmp_path, model):
    e = start(engines, tmp_path, model, config={"broken": True, "fatal_exit": "code"})
    e.wait_bound()
    h, _ = e.wait_status("error")
    assert "broken" in h["message"]
    assert e.proc.wait(10) == 1


def test_oom_line_names_the_hosts_gpu(engines, tmp_path, model):
    # ws2's RTX 5090: 32607 MiB; the config the harness writes for the host says so
    e = start(engines, tmp_path, model, config={"load_seconds": 0.2, "gpu_total_mib": 32607, "gpu_free_mib": 31484})
    e.wait_bound()
    e.wait_status("ok")
    assert e.call("/_standin/fault", {"kind": "oom"})[0] == 200
    e.wait_status("error")
    assert "GPU 0 has a total capacity of 31.84 GiB of which 30.75 GiB is free" in e.logs()[1]


@pytest.fixture()
def vm_memory(tmp_path):
    """The fleet's VM memory stand-in on loopback, for one simulated host at 127.0.0.1 whose
    /proc/meminfo source is tmp_path/host/.sim/meminfo (ws1's profile, no swap in use)."""
    profile = PROFILES["ws1"]
    root = tmp_path / "host"
    (root / ".sim").mkdir(parents=True)
    meminfo = root / ".sim" / "meminfo"
    meminfo.write_text(harness.meminfo_text(profile))
    state = tmp_path / "state.json"
    state.write_text(
        json.dumps(
            {"hosts": {"ws1": {"name": "ws1", "address": "127.0.0.1", "root": str(root), "profile": profile.to_dict()}}}
        )
    )
    port = free_port()
    log = tmp_path / "vm_memory.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.fleet.standins.vm_memory",
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--state",
            str(state),
        ],
        cwd=harness.REPO_ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_listening(port, proc, "vm_memory stand-in", log)
        yield f"http://127.0.0.1:{port}/swap/grow", meminfo, profile
    finally:
        proc.terminate()
        proc.wait(10)


def swap_used(meminfo: Path) -> int:
    """SwapTotal - SwapFree, read the way `free` and the guard read /proc/meminfo."""
    kb = {line.split(":")[0]: int(line.split()[1]) for line in meminfo.read_text().splitlines()}
    return (kb["SwapTotal"] - kb["SwapFree"]) * 1024


def wait_for(what, predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def test_fault_swap_grows_the_hosts_swap_until_the_engine_ends(engines, tmp_path, model, vm_memory):
    url, meminfo, profile = vm_memory
    e = start(engines, tmp_path, model, config={"load_seconds": 0.2, "swap_url": url})
    e.wait_bound()
    e.wait_status("ok")
    assert swap_used(meminfo) == 0
    assert e.call("/_standin/fault", {"kind": "swap", "mib_per_s": 1024})[0] == 200
    # grows step by step (not all at once) ...
    first = wait_for("swap in use", lambda: swap_used(meminfo))
    assert first < profile.swap_total_bytes
    wait_for("swap growing", lambda: swap_used(meminfo) > first)
    # ... up to the host's SwapTotal and no further, while the engine keeps serving
    wait_for("swap full", lambda: swap_used(meminfo) == profile.swap_total_bytes)
    assert e.health()["status"] == "ok"
    # the engine ends: its swapped-out memory is freed
    e.proc.kill()
    e.proc.wait(10)
    wait_for("swap freed", lambda: swap_used(meminfo) == 0)


def test_fault_swap_needs_a_swap_source(engines, tmp_path, model, vm_memory):
    e = start(engines, tmp_path, model, config={"load_seconds": 0.2})
    e.wait_bound()
    e.wait_status("ok")
    status, body = e.call("/_standin/fault", {"kind": "swap"})
    assert status == 400 and "swap_url" in json.loads(body)["error"]
    assert e.call("/_standin/fault", {"kind": "grow"})[0] == 400


def test_vm_memory_refuses_an_address_that_is_no_host(tmp_path, vm_memory):
    url, meminfo, _ = vm_memory
    state = json.loads((meminfo.parents[2] / "state.json").read_text())
    state["hosts"]["ws1"]["address"] = "10.213.0.11"
    (meminfo.parents[2] / "state.json").write_text(json.dumps(state))
    req = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=10)
    assert err.value.code == 403
    assert swap_used(meminfo) == 0


def test_slots_run_max_running_requests_at_once_and_queue_the_rest_in_order(engines, tmp_path, model):
    """--max-running-requests 1: a second request waits inside the engine, sees no byte of its
    answer until the first has finished, and /v1/stats counts both as active (as the real
    StatsTracker does: admitted and not finished)."""
    import threading

    e = start(
        engines, tmp_path, model, "--max-running-requests", "1", config={"tokens_per_s": 20.0, "load_seconds": 0.2}
    )
    e.wait_bound()
    e.wait_status("ok")
    done: dict[str, float] = {}
    first_byte: dict[str, float] = {}

    def ask(name: str, tokens: int) -> None:
        req = urllib.request.Request(
            e.url + "/v1/chat/completions",
            data=json.dumps(
                {"messages": [{"role": "user", "content": name}], "max_tokens": tokens, "stream": True}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            first_byte[name] = time.monotonic()
            r.read()
        done[name] = time.monotonic()

    a = threading.Thread(target=ask, args=("a", 20))
    a.start()
    deadline = time.monotonic() + 15
    while "a" not in first_byte and time.monotonic() < deadline:
        time.sleep(0.01)
    b = threading.Thread(target=ask, args=("b", 2))
    b.start()
    seen = []
    while time.monotonic() < deadline:
        seen.append(json.loads(e.call("/v1/stats")[1])["requests"]["active"])
        if seen[-1] == 2 or "a" in done:
            break
        time.sleep(0.01)
    a.join(30)
    b.join(30)
    assert 2 in seen, seen  # both admitted while a ran
    assert first_byte["b"] >= done["a"] - 0.05, (first_byte, done)  # b waited for a's slot
    stats = json.loads(e.call("/v1/stats")[1])
    assert stats["requests"]["active"] == 0 and stats["requests"]["completed"] == 2
    assert stats["requests"]["completion_tokens_total"] == 22
