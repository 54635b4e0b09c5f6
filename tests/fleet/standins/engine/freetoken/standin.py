"""STAND-IN for the running FreeToken 0.2.1 server (uvicorn + scheduler workers on a GPU).

Observable behaviour imitated (read from the real 0.2.1 wheel: server/api_server.py,
server/control_api.py, server/supervisor.py, utils/logger.py):

* Model check at start like the real loader: config.json must exist and parse (else a traceback
  and exit 1 before binding); quantisation from config.json ``quantization_config`` (top level,
  then ``text_config``), else ``hf_quant_config.json`` ``quantization`` (modelopt). Per-tensor /
  per-channel FP8 experts fail in the "scheduler worker" with a traceback ending in
  ``NotImplementedError: no quant method for moe.fp8_tensor``; shards listed in
  ``model.safetensors.index.json`` that are missing fail with ``FileNotFoundError``. Such a
  worker failure, like any backend death, turns /health to ``{"status": "error", "message"}``
  and the process stops ``error_exit_delay_s`` (default 10, like the real
  BACKEND_DEATH_EXIT_GRACE_S) later - by SIGTERM to itself, as the real one does (uvicorn
  re-raises the signal, so the process dies *by SIGTERM*, status 143); ``fatal_exit: "code"``
  in the stand-in config makes it exit 1 instead.
* The HTTP server binds first (``/health`` answers while loading, always HTTP 200):
  ``{"status": "loading", "phase": "weights"|"expert_banks"|"warmup", "progress":
  {"done_bytes", "total_bytes"}, "model", "instance_id"}`` then ``{"status": "ok", "model",
  "instance_id", "uptime_s", "maintenance": "serving", "version"}``. (Phase names are the real
  enum of supervisor.phase_slug.) Inference routes answer 503 ``{"error": "model is still
  loading"}`` while loading. 127.0.0.1:<port+1> is bound like the real gloo process group.
* Log lines in the real logger's format (``[YYYY-MM-DD|HH:MM:SS] LEVEL    message`` with ANSI
  colours, on STDOUT like the real ``init_logger``; env LOG_LEVEL honoured), uvicorn's lines,
  ending with ``API server is ready to serve on HOST:PORT``. Tracebacks go to stderr.
* Auth: key from --api-key or FREETOKEN_API_KEY; ``Authorization: Bearer`` or ``x-api-key``;
  401 ``{"error": "Unauthorized"}``; /health exempt.
* ``POST /v1/admin/prepare-stop`` (loopback only, key required): closes admission, drains,
  aborts the rest, answers the sealed snapshot (``Handler._prepare_stop``).
* /v1/models, /v1/chat/completions (plain and SSE stream, usage incl.
  ``stream_options.include_usage``), /v1/completions, /v1/messages, /v1/stats; tokens are
  emitted at ``tokens_per_s``.

Stand-in configuration (not the real engine's): /etc/freetoken-standin.json, or the JSON file
named by env FREETOKEN_STANDIN_CONFIG: ``{"tokens_per_s": 24.0, "load_seconds": 3,
"error_exit_delay_s": 10, "broken": false, "fatal_exit": "sigterm", "default_max_tokens": 32}``.
``broken: true`` (or a wheel built broken, version.BROKEN) fails after loading.

Answers: a question "What is A + B?" (the health gate's) is answered with the sum, as a real
model does at temperature 0, ending at the answer (finish_reason "stop"); anything else gets the
paced stand-in words. ``wrong_answers`` in the config (``true``, or a list of engine versions it
applies to, e.g. ``["0.2.2"]``) makes it answer the sum plus one instead: an engine that streams
garbage (broken kernels, a bad shard) while /health says ok.

Fault switches: ``POST /_standin/fault`` ``{"kind": "crash"|"exit"|"oom"|"swap"|"wrong"}`` (loopback
clients only; API key required when one is set): crash = the process dies at once with a worker
traceback and exit code 1 (no health error); exit = backend death: health error, then exit
after the delay; oom = a scheduler worker dies of CUDA OOM while serving: its traceback (the field
report's OOM line, naming the host's GPU: config ``gpu_total_mib``, ``gpu_free_mib``; with
``"shape": "accelerator"`` torch 2.11's ``torch.AcceleratorError: CUDA error: out of memory``) on stderr,
then the backend death as for exit (ERROR "Backend supervisor: backend worker ... exited"); swap
(``"mib_per_s"`` optional, default config ``swap_mib_per_s``) = the host's swap use grows at that
pace up to SwapTotal for as long as this process lives and falls back when it ends, as a real
process's swapped-out memory does: it holds a connection to the simulated fleet's VM memory
stand-in (config ``swap_url``, tests/fleet/standins/vm_memory.py), which rewrites the host's
/proc/meminfo source; 400 when no ``swap_url`` is configured, 502 when it cannot be reached.
The answer (200) comes once the growth has begun. wrong = from now on this process answers
questions wrongly (see ``wrong_answers``; the config survives a restart, the switch does not).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .version import BROKEN, __version__

DEFAULT_CONFIG = {
    "tokens_per_s": 24.0,
    "load_seconds": 3.0,
    "error_exit_delay_s": 10.0,
    "broken": False,
    "fatal_exit": "sigterm",
    "default_max_tokens": 32,
    "gpu_total_mib": 16311,
    "gpu_free_mib": 11878,
    "swap_url": None,
    "swap_mib_per_s": 256,
    "wrong_answers": False,
    "vram_mib": 6042,
    "gpu_name": "NVIDIA GeForce RTX 5060 Ti",
    "gpu_uuid": "GPU-00000000-0000-0000-0000-000000000000",
}
STATS_WINDOW_S = 5.0  # the real StatsTracker's sliding window for decode_tps
SYSTEM_CONFIG = "/etc/freetoken-standin.json"
QUESTION = re.compile(r"What is (-?\d+) \+ (-?\d+)\?")
WORDS = "Hello from the FreeToken stand-in , a tiny model that speaks in paced tokens .".split()
# The field report's line (an RTX 5060 Ti: 16311 MiB total, 11.6 GiB "free" under the WDDM lock);
# total and free come from the host's GPU (stand-in config gpu_total_mib / gpu_free_mib).
OOM_LINE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 MiB. GPU 0 has a total capacity of "
    "{total_gib:.2f} GiB of which {free_gib:.2f} GiB is free. Including non-PyTorch memory, this process has 17179869184.00 GiB "
    "memory in use. Of the allocated memory 4.21 GiB is allocated by PyTorch, and 103.52 MiB is reserved by "
    "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)

# torch >= 2.11 raises a raw CUDA allocation failure as torch.AcceleratorError; its message goes
# on over four lines (captured on an H200: tests/fixtures/real/torch-2.11-cuda-oom-h200.txt).
ACCELERATOR_OOM = (
    "torch.AcceleratorError: CUDA error: out of memory\n"
    "Search for `cudaErrorMemoryAllocation' in "
    "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
    "might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)


def load_config() -> dict:
    cfg = dict(DEFAULT_CONFIG)
    path = os.environ.get("FREETOKEN_STANDIN_CONFIG") or (SYSTEM_CONFIG if os.path.exists(SYSTEM_CONFIG) else None)
    if path:
        with open(path) as f:
            cfg.update(json.load(f))
    cfg["broken"] = bool(cfg.get("broken")) or BROKEN
    wrong = cfg.get("wrong_answers")
    cfg["wrong_answers"] = wrong is True or (isinstance(wrong, list) and __version__ in wrong)
    return cfg


# ------------------------------------------------------------------ logging like utils/logger.py
class _Fmt(logging.Formatter):
    COLORS = {
        "DEBUG": "\033[36m",
        "INFO": "\033[32m",
        "WARNING": "\033[33m",
        "ERROR": "\033[31m",
        "CRITICAL": "\033[35m",
    }

    def __init__(self, tag: str = "") -> None:
        super().__init__()
        # init_logger(name, suffix): the suffix joins the timestamp, "[...|HH:MM:SS|FrontendAPI]"
        self.tag = f"|{tag}" if tag else ""

    def format(self, record):
        ts = self.formatTime(record, f"[%Y-%m-%d|%H:%M:%S{self.tag}]")
        return f"\033[1m{ts}\033[0m {self.COLORS.get(record.levelname, '')}{record.levelname:<8}\033[0m {record.getMessage()}"


def _logger(name: str = "freetoken", tag: str = "") -> logging.Logger:
    log = logging.getLogger(name)
    level = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}.get(
        os.getenv("LOG_LEVEL", "").upper(), 20
    )
    log.setLevel(level)
    log.handlers.clear()
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(_Fmt(tag))
    log.addHandler(h)
    log.propagate = False
    return log


def _uvicorn(msg: str, level: str = "INFO") -> None:
    if {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}.get(level, 20) >= logger.level:
        sys.stderr.write(f"{level + ':':<9} {msg}\n")
        sys.stderr.flush()


logger = _logger()
# The real server/api_server.py logger: init_logger(__name__, "FrontendAPI"). Its records (the
# backend supervisor's among them) carry that tag, which the guard matches.
api_logger = _logger("freetoken.server.api_server", "FrontendAPI")


# ------------------------------------------------------------------ model checks
def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_hf_config(model_path: str) -> dict:
    path = os.path.join(model_path, "config.json")
    if not os.path.isdir(model_path):
        raise OSError(f"{model_path} is not a local folder and is not a valid model identifier listed on the hub")
    if not os.path.isfile(path):
        raise OSError(f"{model_path} does not appear to have a file named config.json.")
    try:
        return _read_json(path)
    except (OSError, ValueError) as exc:
        raise OSError(f"It looks like the config file at '{path}' is not a valid JSON file.") from exc


def quantization_config_of(cfg: dict, model_path: str) -> dict | None:
    q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    if q is None:
        sidecar = os.path.join(model_path, "hf_quant_config.json")
        if os.path.isfile(sidecar):
            quant = _read_json(sidecar).get("quantization")
            if isinstance(quant, dict):
                q = {"quant_method": "modelopt", **quant}
    return q


def _modelopt_kind(algo: str) -> str:
    kinds = {
        "NVFP4": "nvfp4",
        "W4A16_NVFP4": "nvfp4",
        "FP8": "fp8_tensor",
        "FP8_PER_CHANNEL_PER_TOKEN": "fp8_tensor",
        "FP8_PB_WO": "fp8_block",
        "MXFP8": "mxfp8",
    }
    if algo not in kinds:
        raise NotImplementedError(f"ModelOpt quant_algo {algo!r} is not supported")
    return kinds[algo]


def _ct_kind(spec: dict) -> str:
    w = spec.get("weights") or {}
    bits, wtype = int(w.get("num_bits") or 0), str(w.get("type") or "").lower()
    strategy, group = str(w.get("strategy") or "").lower(), int(w.get("group_size") or 0)
    if bits == 4 and wtype == "float":
        if strategy == "tensor_group" and group == 16:
            return "nvfp4"
        raise NotImplementedError(
            f"compressed-tensors 4-bit float scheme (strategy={strategy!r}, group_size={group}) is not supported; only NVFP4 is"
        )
    if bits == 8 and wtype == "float":
        if strategy in ("tensor", "channel"):
            return "fp8_tensor"
        if strategy == "block" and tuple(int(x) for x in (w.get("block_structure") or ())) == (128, 128):
            return "fp8_block"
    raise NotImplementedError(f"compressed-tensors weight scheme {w} is not supported")


MOE_KINDS = {"none", "fp8_block", "mxfp4", "mxfp8", "nvfp4", "gguf"}


def expert_quant_kinds(q: dict | None) -> set[str]:
    """The quant kinds the routed experts use, resolved like the real dialects do."""
    if q is None:
        return {"none"}
    method = str(q.get("quant_method") or "").lower()
    if method == "modelopt" or (not method and q.get("quant_algo")):
        algo = str(q.get("quant_algo") or "").upper()
        if algo != "MIXED_PRECISION":
            return {_modelopt_kind(algo)}
        layers = q.get("quantized_layers") or {}
        if not layers:
            raise NotImplementedError("ModelOpt MIXED_PRECISION without quantized_layers in quantization_config")
        kinds = {_modelopt_kind(str((v or {}).get("quant_algo") or "").upper()) for v in layers.values()}
        return {
            _modelopt_kind(str((v or {}).get("quant_algo") or "").upper())
            for k, v in layers.items()
            if ".experts." in k
        } or ({"none"} if kinds else {"none"})
    if method == "compressed-tensors":
        kinds = set()
        for spec in (q.get("config_groups") or {}).values():
            kind = _ct_kind(spec)
            targets = " ".join(spec.get("targets") or ())
            if "expert" in targets or "Linear" in targets:
                kinds.add(kind)
        return kinds or {"none"}
    if method in ("mxfp4", "gguf", "fp8"):
        return {"mxfp4" if method == "mxfp4" else method if method == "gguf" else "fp8_block"}
    raise NotImplementedError(f"quantization method {q.get('quant_method')!r} is not supported")


def check_weights(model_path: str, cfg: dict) -> list[str]:
    """Shards to 'load'; raises like the real loader for unsupported experts or missing shards."""
    for kind in sorted(expert_quant_kinds(quantization_config_of(cfg, model_path))):
        if kind not in MOE_KINDS:
            raise NotImplementedError(f"no quant method for moe.{kind}")
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        shards = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        shards = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not shards:
        raise FileNotFoundError(f"No safetensors weights found in {model_path}")
    for s in shards:
        p = os.path.join(model_path, s)
        if not os.path.isfile(p):
            raise FileNotFoundError(2, "No such file or directory", p)
    return [os.path.join(model_path, s) for s in shards]


# ------------------------------------------------------------------ engine state
class Engine:
    def __init__(self, args, cfg: dict):
        self.args = args
        self.cfg = cfg
        self.model = args.served_model_name
        self.instance_id = str(uuid.uuid4())
        self.state = "loading"
        self.phase_desc = "Loading weights"
        self.done_bytes = 0
        self.total_bytes = 0
        self.ready_at: float | None = None
        self.fatal: str | None = None
        self.lock = threading.Lock()
        self.requests_total = 0
        self.tokens_generated = 0
        self.gloo: socket.socket | None = None
        self.aborting = False  # prepare-stop's abort of what its drain time did not finish
        self.sealed: dict | None = None  # prepare-stop's snapshot, the same on every retry
        # Slots, as the real scheduler runs them: at most --max-running-requests generations at
        # once, the rest wait inside the engine in arrival order (before any byte of their answer).
        # /v1/stats counts both as "active", as the real StatsTracker does (admitted, not finished).
        self.max_running = max(1, int(args.extra.get("max_running_req") or 4))
        self.slots = threading.Condition(self.lock)
        self.running = 0
        self.active = 0
        self.completed = 0
        self.prompt_tokens_total = 0
        self._waiting: deque[object] = deque()
        self._decoded: deque[float] = deque(maxlen=4096)  # one timestamp per token, for decode_tps
        self._durations_ms: deque[int] = deque(maxlen=512)
        self._ttft_ms: deque[int] = deque(maxlen=512)

    # -------------------------------------------------------------- slots
    def admit(self, prompt_tokens: int) -> None:
        """Wait for a free slot, first come first served."""
        ticket = object()
        with self.slots:
            self.active += 1
            self.prompt_tokens_total += prompt_tokens
            self._waiting.append(ticket)
            while self._waiting[0] is not ticket or self.running >= self.max_running:
                self.slots.wait()
            self._waiting.popleft()
            self.running += 1
            self.slots.notify_all()

    def release(self, started: float, first_token: float | None, completed: bool) -> None:
        with self.slots:
            self.running -= 1
            self.active -= 1
            if completed:
                self.completed += 1
                self._durations_ms.append(int((time.monotonic() - started) * 1000))
                if first_token is not None:
                    self._ttft_ms.append(int((first_token - started) * 1000))
            self.slots.notify_all()

    def stats(self) -> dict:
        """/v1/stats in the real 0.2.1 shape (server/stats.py build_stats); values from the
        stand-in's own counters, the GPU from its config."""
        now = time.monotonic()
        with self.lock:
            recent = [t for t in self._decoded if t >= now - STATS_WINDOW_S]
            durations = sorted(self._durations_ms)
            ttft = list(self._ttft_ms)
            active, completed = self.active, self.completed
            prompt_total, completion_total = self.prompt_tokens_total, self.tokens_generated
        span = max(now - recent[0], 1e-9) if recent else 0.0
        # loaded: serving, or past prepare-stop (the real StatsTracker keeps its last values)
        ready = self.state in ("serving", "stopping") and self.ready_at is not None
        page = max(1, int(self.args.extra.get("page_size") or 1))
        tokens = int(self.args.extra.get("num_token_override") or 8192)
        return {
            "instance_id": self.instance_id,
            "model": {"id": self.model, "ctx": tokens, "attn": "mha", "moe": True, "input_modalities": ["text"]},
            "uptime_s": max(0, int(now - self.ready_at)) if ready and self.ready_at is not None else 0,
            "kv": {"used_pages": 0, "total_pages": tokens // page, "page_size": page} if ready else None,
            "mamba": None,
            "swa": None,
            "vram_bytes": int(self.cfg["vram_mib"]) * 2**20 if ready else 0,
            "gpus": [
                {
                    "index": 0,
                    "name": self.cfg["gpu_name"],
                    "uuid": self.cfg["gpu_uuid"],
                    "total_bytes": int(self.cfg["gpu_total_mib"]) * 2**20,
                }
            ]
            if ready
            else [],
            "throughput": {"decode_tps": round(len(recent) / span, 1) if recent else 0.0, "prefill_tps": 0.0},
            "requests": {
                "active": active,
                "completed": completed,
                "p95_ms": durations[min(len(durations) - 1, int(len(durations) * 0.95))] if durations else 0,
                "ttft_mean_ms": int(sum(ttft) / len(ttft)) if ttft else 0,
                "prompt_tokens_total": prompt_total,
                "completion_tokens_total": completion_total,
            },
        }

    # -------------------------------------------------------------- health
    def health(self) -> dict:
        if self.fatal:
            return {"status": "error", "message": self.fatal, "instance_id": self.instance_id}
        if self.state == "loading":
            d = self.phase_desc.lower()
            phase = (
                "expert_banks"
                if "expert" in d
                else "weights"
                if "weight" in d
                else "warmup"
                if ("graph" in d or "warm" in d)
                else "other"
            )
            return {
                "status": "loading",
                "phase": phase,
                "progress": {"done_bytes": self.done_bytes, "total_bytes": self.total_bytes},
                "model": self.model,
                "instance_id": self.instance_id,
            }
        return {
            "status": "ok",
            "model": self.model,
            "instance_id": self.instance_id,
            "uptime_s": max(0, int(time.monotonic() - (self.ready_at or time.monotonic()))),
            "maintenance": self.state,
            "version": __version__,
        }

    # -------------------------------------------------------------- failure paths
    def worker_traceback(self, exc: BaseException) -> None:
        sys.stderr.write("Process freetoken-TP0-scheduler:\n")
        sys.stderr.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        sys.stderr.flush()

    def backend_died(self, message: str) -> None:
        with self.lock:
            if self.fatal:
                return
            self.fatal = message
            self.state = "failed"
        api_logger.error("Backend supervisor: %s", message)
        t = threading.Timer(float(self.cfg["error_exit_delay_s"]), self._stop_after_death)
        t.daemon = True
        t.start()

    def _stop_after_death(self) -> None:
        api_logger.error("Backend worker is gone and cannot be restarted; stopping the API server")
        sys.stdout.flush()
        if self.cfg.get("fatal_exit") == "code":
            _uvicorn(f"Finished server process [{os.getpid()}]")
            os._exit(1)
        # like the real one: SIGTERM to itself; the main thread's handler (uvicorn's) shuts down
        # and re-raises it, so the process dies by SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)

    # -------------------------------------------------------------- loading
    def load(self) -> None:
        try:
            self._load()
        except Exception as exc:  # a worker dying during load
            self.worker_traceback(exc)
            self.backend_died(f"backend worker freetoken-TP0-scheduler exited during load: {type(exc).__name__}: {exc}")

    def _bind_gloo(self) -> None:
        port = self.args.server_port + 1
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            raise RuntimeError(
                f"The server socket has failed to listen on any local network address. port: {port}, "
                "useIPv6: 0, code: -98, name: EADDRINUSE, message: address already in use"
            ) from None
        s.listen(16)
        self.gloo = s

    def _load(self) -> None:
        cfg, load_s = self.cfg, max(0.0, float(self.cfg["load_seconds"]))
        self._bind_gloo()
        hf = load_hf_config(self.args.model_path)
        shards = check_weights(self.args.model_path, hf)
        sizes = [os.path.getsize(s) for s in shards]
        self.total_bytes = sum(sizes)
        arch = ",".join(hf.get("architectures") or []) or hf.get("model_type", "?")
        logger.info(f"Model architecture: {arch}, {len(shards)} safetensors shards, {self.total_bytes} bytes")
        steps = 4
        for desc, share, lo, hi in (("Loading weights", 0.3, 0.0, 0.3), ("Loading experts", 0.4, 0.3, 1.0)):
            self.phase_desc = desc
            for i in range(1, steps + 1):
                time.sleep(load_s * share / steps)
                frac = lo + (hi - lo) * i / steps
                self.done_bytes = int(self.total_bytes * frac)
                logger.info(f"{desc}: {int(100 * i / steps)}% ({self.done_bytes >> 20}/{self.total_bytes >> 20} MiB)")
        self.phase_desc = "Capturing CUDA graphs"
        bs = [1, 2, 4, 8]
        logger.info(f"Capturing CUDA graphs for batch sizes {bs}")
        t0 = time.monotonic()
        time.sleep(load_s * 0.2)
        logger.info(f"CUDA graph capture finished in {time.monotonic() - t0:.2f}s")
        self.phase_desc = "Warming up"
        logger.info("Warming up the engine")
        time.sleep(load_s * 0.1)
        if cfg["broken"]:
            raise RuntimeError(f"freetoken {__version__}: scheduler failed after load (stand-in built broken)")
        with self.lock:
            if self.state == "loading":
                self.state = "serving"
                self.ready_at = time.monotonic()
        api_logger.info(f"API server is ready to serve on {self.args.server_host}:{self.args.server_port}")

    # -------------------------------------------------------------- faults
    def crash(self) -> None:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as exc:
            self.worker_traceback(exc)
        os._exit(1)

    def oom(self, shape: str = "allocator") -> None:
        """A CUDA OOM in the scheduler worker while serving, as the real 0.2.1 shows it: the
        worker (multiprocessing, name freetoken-TP0-scheduler; Scheduler.run_forever catches
        nothing) prints its traceback to stderr and dies; the API server's supervisor logs
        ERROR "Backend supervisor: backend worker <name> exited", /health turns error and the
        process stops after the grace (server/supervisor.py, server/api_server.py). ``shape``:
        "allocator" ends the traceback in the caching allocator's torch.OutOfMemoryError (the
        field report's line), "accelerator" in torch 2.11's raw allocation failure,
        torch.AcceleratorError, with the four further lines of its message (ACCELERATOR_OOM)."""
        if shape == "accelerator":
            last = ACCELERATOR_OOM
        else:
            last = OOM_LINE.format(total_gib=self.cfg["gpu_total_mib"] / 1024, free_gib=self.cfg["gpu_free_mib"] / 1024)
        sys.stderr.write(
            "Process freetoken-TP0-scheduler:\n"
            "Traceback (most recent call last):\n"
            '  File "freetoken/moe/offload.py", line 412, in _alloc_slot\n'
            "    buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)\n" + last + "\n"
        )
        sys.stderr.flush()
        self.backend_died("backend worker freetoken-TP0-scheduler exited")

    def grow_swap(self, mib_per_s: float) -> None:
        """Become a process whose memory spills into swap: the VM's swap use (the fleet's VM
        memory stand-in, ``swap_url``) grows for as long as this process lives."""
        import urllib.request

        req = urllib.request.Request(
            self.cfg["swap_url"],
            data=json.dumps({"mib_per_s": mib_per_s}).encode(),
            headers={"Content-Type": "application/json"},
        )
        held = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=10)

        def hold():
            with held:
                while held.readline():
                    pass

        threading.Thread(target=hold, name="freetoken-standin-swap", daemon=True).start()


# ------------------------------------------------------------------ HTTP
def _prompt_tokens(text: str) -> int:
    return max(1, (len(text) + 3) // 4)


def _request_text(path: str, body: dict) -> str:
    if path == "/v1/completions":
        prompt = body.get("prompt") or ""
        return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    text = _messages_text(body.get("messages"))
    return body["system"] + "\n" + text if isinstance(body.get("system"), str) else text


def _messages_text(messages) -> str:
    out = []
    for m in messages or []:
        c = m.get("content") if isinstance(m, dict) else ""
        if isinstance(c, list):
            c = " ".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
        out.append(str(c or ""))
    return "\n".join(out)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    engine: Engine

    def setup(self):
        super().setup()
        # Like the real server (uvicorn on asyncio, which sets TCP_NODELAY on every connection):
        # a body written after its headers goes out at once, not held for the peer's delayed ACK.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):
        if self.path == "/health" and logger.level > 10:
            return  # the real access-log filter hides health polling
        _uvicorn(
            f'{self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" {args[1] if len(args) > 1 else ""}'
        )

    def _json(self, status: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            doc = json.loads(raw or b"{}")
        except ValueError:
            doc = None
        return doc if isinstance(doc, dict) else {}

    def _authorised(self) -> bool:
        key = self.engine.args.api_key
        if key is None:
            return True
        scheme, _, token = (self.headers.get("authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode()):
            return True
        x = self.headers.get("x-api-key")
        return x is not None and hmac.compare_digest(x.encode(), key.encode())

    def _gate(self) -> bool:
        st = self.engine.state
        if st == "serving":
            return True
        msg = (
            "model is still loading"
            if st == "loading"
            else "server unavailable: maintenance failed (restart required)"
            if st == "failed"
            else f"server unavailable: engine is {st}"  # "stopping": after prepare-stop
        )
        self._json(503, {"error": msg})
        return False

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/health":
            return self._json(200, self.engine.health())
        if not self._authorised():
            return self._json(401, {"error": "Unauthorized"})
        if path == "/v1/models":
            return self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.engine.model,
                            "object": "model",
                            "created": int(time.time()),
                            "owned_by": "freetoken",
                        }
                    ],
                },
            )
        if path == "/v1/stats":
            return self._json(200, self.engine.stats())
        self._json(404, {"detail": "Not Found"})

    def do_POST(self):
        path = self.path.split("?")[0]
        body = self._body()
        if not self._authorised():
            return self._json(401, {"error": "Unauthorized"})
        if path == "/_standin/fault":
            return self._fault(body)
        if path == "/v1/admin/prepare-stop":
            return self._prepare_stop(body)
        if path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
            if not self._gate():
                return
            return self._generate(path, body)
        self._json(404, {"detail": "Not Found"})

    def _prepare_stop(self, body: dict) -> None:
        """``POST /v1/admin/prepare-stop`` as 0.2.1 has it (server/accounting.py): loopback only;
        closes admission (state "stopping": new generations get 503), waits up to
        ``drain_timeout_s`` (0..10, default 5) for admitted work, then aborts what is left and
        waits ``abort_timeout_s`` (0..4, default 3); answers the sealed snapshot (the same on a
        retry), or 503 ``{"error", "drain_complete": false, "engine_preserved": true}``."""
        if not (self.client_address[0].startswith("127.") or self.client_address[0] == "::1"):
            return self._json(403, {"error": "loopback access required"})
        e = self.engine
        try:
            drain = float(body.get("drain_timeout_s", 5.0))
            abort = float(body.get("abort_timeout_s", 3.0))
        except (TypeError, ValueError):
            return self._json(422, {"detail": "drain_timeout_s and abort_timeout_s are numbers"})
        if not (0.0 <= drain <= 10.0 and 0.0 <= abort <= 4.0):
            return self._json(422, {"detail": "drain_timeout_s is 0..10 and abort_timeout_s 0..4"})
        with e.lock:
            if e.sealed is not None:
                return self._json(200, dict(e.sealed))
            if e.state not in ("loading", "serving", "stopping", "failed"):
                return self._json(503, {"error": f"engine cannot prepare stop from state {e.state!r}"})
            e.state = "stopping"

        def idle(timeout: float) -> bool:
            deadline = time.monotonic() + timeout
            while True:
                with e.lock:
                    if e.active == 0:
                        return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.02)

        if not idle(drain):
            e.aborting = True
            if not idle(abort):
                return self._json(
                    503,
                    {
                        "error": f"accounting abort barrier timed out with {e.active} request(s) still active",
                        "drain_complete": False,
                        "engine_preserved": True,
                    },
                )
        with e.lock:
            e.sealed = {
                "instance_id": e.instance_id,
                "model_id": e.model,
                "prompt_tokens_total": e.prompt_tokens_total,
                "completion_tokens_total": e.tokens_generated,
                "uptime_s": max(0, int(time.monotonic() - e.ready_at)) if e.ready_at is not None else 0,
                "drain_complete": True,
            }
            return self._json(200, dict(e.sealed))

    def _fault(self, body: dict) -> None:
        if not (self.client_address[0].startswith("127.") or self.client_address[0] == "::1"):
            return self._json(403, {"error": "fault switches are loopback-only"})
        kind = body.get("kind")
        if kind not in ("crash", "exit", "oom", "swap", "wrong"):
            return self._json(400, {"error": "kind must be crash, exit, oom, swap or wrong"})
        if kind == "swap":
            if not self.engine.cfg.get("swap_url"):
                return self._json(400, {"error": "no swap source: swap_url is not in the stand-in config"})
            try:
                rate = float(body.get("mib_per_s", self.engine.cfg["swap_mib_per_s"]))
                self.engine.grow_swap(rate)
            except (OSError, ValueError, TypeError) as exc:
                return self._json(502, {"error": f"swap source {self.engine.cfg['swap_url']}: {exc}"})
        # the state changes before the answer, so a client that got 200 already sees the fault
        if kind == "exit":
            self.engine.backend_died(
                f"backend worker freetoken-TP0-scheduler (pid {os.getpid() + 1}) exited unexpectedly with code -9"
            )
        elif kind == "oom":
            self.engine.oom("accelerator" if body.get("shape") == "accelerator" else "allocator")
        elif kind == "wrong":
            self.engine.cfg["wrong_answers"] = True
        self._json(200, {"ok": True, "kind": kind})
        self.wfile.flush()
        if kind == "crash":
            threading.Timer(0.1, self.engine.crash).start()

    # -------------------------------------------------------------- generation
    def _generate(self, path: str, body: dict) -> None:
        """One generation in one of the engine's slots (waiting for one first)."""
        e = self.engine
        started = time.monotonic()
        e.admit(_prompt_tokens(_request_text(path, body)))
        self._first_token: float | None = None
        self._aborted = False  # a streamed answer's client went away
        completed = False
        try:
            self._answer(path, body)
            completed = not self._aborted
        finally:
            e.release(started, self._first_token, completed)

    def _answer(self, path: str, body: dict) -> None:
        e = self.engine
        text_in = _request_text(path, body)
        limit = body.get("max_tokens", body.get("max_completion_tokens"))
        n = int(limit) if isinstance(limit, int) and limit > 0 else int(e.cfg["default_max_tokens"])
        finish = "length" if isinstance(limit, int) and limit > 0 else "stop"
        words = WORDS
        asked = QUESTION.search(text_in)
        if asked:  # one right answer: the sum, and the reply ends there
            total = int(asked.group(1)) + int(asked.group(2)) + (1 if e.cfg.get("wrong_answers") else 0)
            words, n, finish = [str(total)], 1, "stop"
        prompt_tokens = _prompt_tokens(text_in)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        with e.lock:
            e.requests_total += 1
        rid = uuid.uuid4().hex[:24]
        created = int(time.time())

        def tokens():
            tps = max(0.001, float(e.cfg["tokens_per_s"]))
            t0 = time.monotonic()
            for i in range(n):
                if e.aborting:  # prepare-stop ran out of its drain time: end it here
                    return
                delay = t0 + (i + 1) / tps - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                with e.lock:
                    e.tokens_generated += 1
                    e._decoded.append(time.monotonic())
                if self._first_token is None:
                    self._first_token = time.monotonic()
                yield (" " if i else "") + words[i % len(words)]

        if not body.get("stream"):
            text = "".join(tokens())
            if path == "/v1/messages":
                return self._json(
                    200,
                    {
                        "id": f"msg_{rid}",
                        "type": "message",
                        "role": "assistant",
                        "model": e.model,
                        "content": [{"type": "text", "text": text}],
                        "stop_reason": "max_tokens" if finish == "length" else "end_turn",
                        "stop_sequence": None,
                        "usage": {"input_tokens": prompt_tokens, "output_tokens": n},
                    },
                )
            if path == "/v1/completions":
                return self._json(
                    200,
                    {
                        "id": f"cmpl-{rid}",
                        "object": "text_completion",
                        "created": created,
                        "model": e.model,
                        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                        "usage": usage,
                    },
                )
            return self._json(
                200,
                {
                    "id": f"chatcmpl-{rid}",
                    "object": "chat.completion",
                    "created": created,
                    "model": e.model,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                    ],
                    "usage": usage,
                },
            )
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def send(data: str, event: str | None = None) -> None:
            payload = (f"event: {event}\n" if event else "") + f"data: {data}\n\n"
            raw = payload.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
            self.wfile.flush()

        try:
            if path == "/v1/messages":
                send(
                    json.dumps(
                        {
                            "type": "message_start",
                            "message": {
                                "id": f"msg_{rid}",
                                "type": "message",
                                "role": "assistant",
                                "model": e.model,
                                "content": [],
                                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
                            },
                        }
                    ),
                    "message_start",
                )
                send(
                    json.dumps(
                        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
                    ),
                    "content_block_start",
                )
                for tok in tokens():
                    send(
                        json.dumps(
                            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": tok}}
                        ),
                        "content_block_delta",
                    )
                send(json.dumps({"type": "content_block_stop", "index": 0}), "content_block_stop")
                send(
                    json.dumps(
                        {
                            "type": "message_delta",
                            "delta": {"stop_reason": "max_tokens" if finish == "length" else "end_turn"},
                            "usage": {"output_tokens": n},
                        }
                    ),
                    "message_delta",
                )
                send(json.dumps({"type": "message_stop"}), "message_stop")
            else:
                chat = path == "/v1/chat/completions"
                obj = "chat.completion.chunk" if chat else "text_completion"
                base = {
                    "id": ("chatcmpl-" if chat else "cmpl-") + rid,
                    "object": obj,
                    "created": created,
                    "model": e.model,
                }
                if chat:
                    send(
                        json.dumps(
                            {
                                **base,
                                "choices": [
                                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                                ],
                            }
                        )
                    )
                for tok in tokens():
                    choice = {"index": 0, "delta": {"content": tok}} if chat else {"index": 0, "text": tok}
                    send(json.dumps({**base, "choices": [{**choice, "finish_reason": None}]}))
                last = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
                send(json.dumps({**base, "choices": [{**last, "finish_reason": finish}]}))
                if (body.get("stream_options") or {}).get("include_usage"):
                    send(json.dumps({**base, "choices": [], "usage": usage}))
                send("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self._aborted = True
            self.close_connection = True


def serve(args) -> None:
    cfg = load_config()
    e = Engine(args, cfg)
    pid = os.getpid()
    try:
        hf = load_hf_config(args.model_path)  # the real parse_args reads it (dtype auto) before binding
    except OSError:
        traceback.print_exc()
        sys.exit(1)
    gen = {}
    gpath = os.path.join(args.model_path, "generation_config.json")
    if os.path.isfile(gpath):
        try:
            gen = _read_json(gpath)
        except ValueError:
            gen = {}
    del hf
    logger.info(
        "Default sampling config (source=%s): temperature=%s, top_k=%s, top_p=%s",
        "model" if gen else "framework",
        gen.get("temperature", 0.0),
        gen.get("top_k", -1),
        gen.get("top_p", 1.0),
    )
    if args.api_key is not None:
        api_logger.info("API key required on every route except /health")
    handler = type("BoundHandler", (Handler,), {"engine": e})
    _uvicorn(f"Started server process [{pid}]")
    _uvicorn("Waiting for application startup.")
    _uvicorn("Application startup complete.")
    try:
        httpd = ThreadingHTTPServer((args.server_host, args.server_port), handler)
    except OSError as exc:
        _uvicorn(
            f"[Errno {exc.errno}] error while attempting to bind on address "
            f"('{args.server_host}', {args.server_port}): {exc.strerror.lower() if exc.strerror else exc}",
            "ERROR",
        )
        _uvicorn("Waiting for application shutdown.")
        _uvicorn("Application shutdown complete.")
        sys.exit(1)
    httpd.daemon_threads = True
    _uvicorn(f"Uvicorn running on http://{args.server_host}:{args.server_port} (Press CTRL+C to quit)")

    def on_term(signum, frame):
        _uvicorn("Shutting down")
        _uvicorn("Waiting for application shutdown.")
        _uvicorn("Application shutdown complete.")
        _uvicorn(f"Finished server process [{pid}]")
        sys.stdout.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(pid, signum)  # die by the signal, as uvicorn re-raises it

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    threading.Thread(target=e.load, name="freetoken-backend-supervisor", daemon=True).start()
    httpd.serve_forever()
