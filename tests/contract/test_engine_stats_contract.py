"""Contract: the engine stand-in's ``GET /v1/stats`` has the shape of the REAL FreeToken 0.2.1's
(``freetoken/server/stats.py`` ``build_stats``, run in the contract venv on a state filled as
the real server fills it), key for key and type for type, so that what reads it here (the
gateway's weights, the host agent) reads the real engine the same way."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

STANDIN = Path(__file__).resolve().parents[1] / "fleet" / "standins" / "engine"
sys.path.insert(0, str(STANDIN))
from freetoken import standin  # noqa: E402
from freetoken.server import args as standin_args  # noqa: E402

pytestmark = pytest.mark.contract

# The real server's state as api_server.FrontendManager holds it once ready: a StatsTracker fed
# by the scheduler's replies (kv pages, VRAM, tokens), the GPU list from the readiness meta.
REAL = r"""
import json, time
from types import SimpleNamespace as NS
from freetoken.server.stats import StatsTracker, build_stats
tr = StatsTracker()
tr.on_new_user(1)
tr.observe(NS(completion_tokens_delta=3, prompt_tokens_delta=12, kv_used_pages=4, kv_total_pages=64,
              gpu_mem_bytes=6 << 30, finished=False))
cfg = NS(model_config=NS(is_moe=True), served_model_name="m", max_seq_len=4096, served_modalities=set(),
         page_size=1)
state = NS(stats=tr, config=cfg, ready_at=time.monotonic() - 5, cache_pools={}, instance_id="i",
           gpus=[{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-x", "total_bytes": 150754820096}])
print(json.dumps(build_stats(state, 120, 40)))
"""


def shape(value):
    """The key tree with each leaf's JSON type (a list by its first item)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def test_the_standins_stats_have_the_real_engines_shape(real_parser_python, tmp_path):
    real = subprocess.run([real_parser_python, "-c", REAL], capture_output=True, text=True, timeout=300)
    assert real.returncode == 0, real.stderr[-3000:]
    real_doc = json.loads(real.stdout.strip().splitlines()[-1])

    model = tmp_path / "m"
    model.mkdir()
    args = standin_args.parse_args(["--model-path", str(model), "--num-tokens", "4096", "--max-running-requests", "2"])
    engine = standin.Engine(args, dict(standin.DEFAULT_CONFIG))
    engine.state, engine.ready_at = "serving", 0.0  # what the stand-in enters once loaded
    engine.admit(12)  # one request in its slot, a token out
    engine._decoded.append(time.monotonic())
    ours = engine.stats()

    assert shape(ours) == shape(real_doc)
    assert ours["requests"]["active"] == real_doc["requests"]["active"] == 1
    assert ours["model"]["ctx"] == real_doc["model"]["ctx"] == 4096
