"""The host agent's state as Prometheus samples: the text the agent (``operations/scripts/
owner_agent.py``) writes for node_exporter's textfile collector (``HostLayout.agent_textfile``,
beside the guard's file), and the gateway's Prometheus scrapes with ``host="NAME"``.

``render`` is a pure function of one ``AgentSample``: the text exposition format (``# HELP``,
``# TYPE``, one line a sample; prometheus/docs ``exposition_formats.md``), units in the names
and ``_total`` on counters (prometheus/docs ``practices/naming.md``). Every label value is one
of a fixed vocabulary the caller passes (the agent's modes, yield reasons and signal names,
``core/owner.py``) and checked again here: never an app's name or any text a host supplied. A
value that is unknown (the engine did not answer, NVML is not there) is left out, never 0.

Standard library only: uploaded beside the agent (``layout.AGENT_METRICS_MODULE``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

MODE = "freetoken_agent_mode"
YIELD_REASON = "freetoken_agent_yield_reason"
SIGNAL_UP = "freetoken_agent_signal_up"
LAST_LOOP = "freetoken_agent_last_loop_timestamp_seconds"
ENGINE_REQUESTS = "freetoken_engine_requests_total"
ENGINE_TOKENS = "freetoken_engine_generated_tokens_total"
GPU_POWER = "freetoken_gpu_power_watts"
GPU_USED = "freetoken_gpu_memory_used_bytes"
GPU_TOTAL = "freetoken_gpu_memory_total_bytes"
FIREWALL = "freetoken_firewall_table_loaded"

HELP = {
    MODE: "The host agent's mode: 1 for the current one (serving, yielding, yielded, starting, held), 0 for the others.",
    YIELD_REASON: "1 for the reason the workstation's owner holds the GPU now, 0 for the others (all 0 while serving).",
    SIGNAL_UP: "1 when the agent reads this owner signal now (gpu: the card's memory; apps, full_screen, "
    "reboot: Windows through interop), 0 when its last read failed.",
    LAST_LOOP: "Unix time of the host agent's last completed decision loop.",
    ENGINE_REQUESTS: "Requests the engine completed since it started (its /v1/stats requests.completed).",
    ENGINE_TOKENS: "Tokens the engine generated since it started (its /v1/stats requests.completion_tokens_total).",
    GPU_POWER: "The GPU's power draw (NVML nvmlDeviceGetPowerUsage).",
    GPU_USED: "The GPU's used memory, every process's (NVML, else nvidia-smi).",
    GPU_TOTAL: "The GPU's total memory (NVML).",
    FIREWALL: "1 when the deploy's nftables table (inet freetoken) is live as its unit loaded it, else 0.",
}
# Label values: short lower-case words, as the vocabularies the agent passes are.
_LABEL_VALUE = re.compile(r"[a-z][a-z0-9_]{0,31}")


@dataclass(frozen=True)
class AgentSample:
    """What the agent knows after one decision loop. ``None``: unknown, its samples left out."""

    modes: tuple[str, ...]  # every mode (owner.MODES)
    mode: str  # the current one, of ``modes``
    reasons: tuple[str, ...]  # every yield reason (owner.YIELD_REASONS)
    reason: str | None  # the current one, of ``reasons``; None: the owner holds nothing
    signals: tuple[tuple[str, bool], ...]  # (owner.SIGNAL_LABELS value, read now) per signal read
    last_loop: float  # unix time
    engine_requests: int | None = None
    engine_generated_tokens: int | None = None
    gpu_power_watts: float | None = None
    gpu_memory_used_bytes: int | None = None
    gpu_memory_total_bytes: int | None = None
    firewall_loaded: bool | None = None  # None: the deploy keeps no firewall on this host


def _label(value: str) -> str:
    if not isinstance(value, str) or _LABEL_VALUE.fullmatch(value) is None:
        raise ValueError(f"not a label value of the agent's vocabulary: {value!r}")
    return value


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise ValueError(f"not a finite sample value: {value!r}")
    return repr(float(value))


def _family(name: str, kind: str, rows: list[tuple[str, float]]) -> list[str]:
    """One metric family: its HELP and TYPE, then its samples (a family without samples is left
    out whole: ``promtool check metrics`` and readers expect samples under a TYPE line)."""
    if not rows:
        return []
    lines = [f"# HELP {name} {HELP[name]}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {_number(value)}" for labels, value in rows]
    return lines


def _one_hot(label: str, values: tuple[str, ...], current: str | None) -> list[tuple[str, float]]:
    if current is not None and current not in values:
        raise ValueError(f"{current!r} is not one of {values!r}")
    return [(f'{{{label}="{_label(v)}"}}', 1 if v == current else 0) for v in values]


def _count(value: int | None) -> list[tuple[str, float]]:
    if value is None:
        return []
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a counter value: {value!r}")
    return [("", value)]


def _gauge(value: float | None) -> list[tuple[str, float]]:
    return [] if value is None else [("", value)]


def render(sample: AgentSample) -> str:
    """The exposition text of ``sample``. ValueError for a label value or a number that is not
    what the agent's vocabulary and types allow (a bug, never written)."""
    lines: list[str] = []
    lines += _family(MODE, "gauge", _one_hot("mode", sample.modes, sample.mode))
    lines += _family(YIELD_REASON, "gauge", _one_hot("reason", sample.reasons, sample.reason))
    signals: list[tuple[str, float]] = [(f'{{signal="{_label(name)}"}}', 1 if up else 0) for name, up in sample.signals]
    lines += _family(SIGNAL_UP, "gauge", signals)
    lines += _family(LAST_LOOP, "gauge", [("", round(sample.last_loop, 3))])
    lines += _family(ENGINE_REQUESTS, "counter", _count(sample.engine_requests))
    lines += _family(ENGINE_TOKENS, "counter", _count(sample.engine_generated_tokens))
    lines += _family(GPU_POWER, "gauge", _gauge(sample.gpu_power_watts))
    lines += _family(GPU_USED, "gauge", _gauge(sample.gpu_memory_used_bytes))
    lines += _family(GPU_TOTAL, "gauge", _gauge(sample.gpu_memory_total_bytes))
    firewall = None if sample.firewall_loaded is None else (1 if sample.firewall_loaded else 0)
    lines += _family(FIREWALL, "gauge", _gauge(firewall))
    return "\n".join(lines) + "\n"


def changed(before: AgentSample | None, now: AgentSample) -> bool:
    """Whether ``now`` differs from ``before`` in more than its clock and its measures (the loop's
    time, the counters, the GPU's power and memory): what is written at once, where the measures
    wait for the next periodic write."""
    if before is None:
        return True
    return (before.mode, before.reason, before.signals, before.firewall_loaded) != (
        now.mode,
        now.reason,
        now.signals,
        now.firewall_loaded,
    ) or (before.engine_requests is None) != (now.engine_requests is None)
