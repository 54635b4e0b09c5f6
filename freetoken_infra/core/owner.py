"""The host agent's decisions: when a workstation yields its GPU to its owner, and what it tells
the gateway (issue 22 items 1 and 2).

The agent (``operations/scripts/owner_agent.py``, a systemd service as root) observes once a
second: the card's used memory (``nvidia-smi``), whether the engine runs, what the engine itself
holds (its ``/v1/stats`` ``vram_bytes``), whether its ``/health`` is ok, and the owner's snooze.
``step`` turns the last state and one ``Observation`` into the next state and at most one action
(stop the engine, start it); ``agent_word`` is what HAProxy's ``agent-check`` reads. Pure
functions of plain values: tested without a host in ``tests/unit/test_owner.py``.

The owner's claim on the GPU is what other processes hold (under WSL ``nvidia-smi`` counts the
owner's Windows games in the card's used memory without listing them, microsoft/WSL#7162) above
``owner_vram_threshold_gb``, or a snooze the owner set with ``freetoken-owner snooze``.

    serving --claim--> yielding (drain at the gateway) --gateway read it--> yielded (engine
    stopped after its streams) --claim gone for owner_quiet_s--> starting --/health ok--> serving

Standard library only: uploaded beside the agent (``layout.OWNER_MODULE``).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass, replace

SERVING, YIELDING, YIELDED, STARTING = "serving", "yielding", "yielded", "starting"
MODES = (SERVING, YIELDING, YIELDED, STARTING)
STOP, START = "stop", "start"

MIB_PER_GIB = 1024
# HAProxy reads the agent every `agent-inter` (operations/gateway.py AGENT_INTER_S); after this
# long without a read the agent stops the engine all the same (no gateway, or it is down).
GATEWAY_NOTICE_S = 5.0
# After its own drain the agent says `ready 100%` this long (several agent reads), then only
# `up`: an `up` leaves an operator's drain alone (`freetoken_infra.fleet drain`), `ready` would
# undo it.
REJOIN_READY_S = 10.0
# An engine that was started after a yield and is still not healthy after this long: the agent
# stops waiting and lets the gateway's own health checks decide (it says so in its reason).
START_TIMEOUT_S = 900.0
# freetoken-owner snooze: at most a week.
SNOOZE_MAX_S = 7 * 24 * 3600

# The agent-check answers (HAProxy 2.6, "agent-check"): `drain` alone keeps the server's weight,
# which the conversations' `use-server ... srv_weight gt 0` rules read, so `0%` goes with it (the
# fleet CLI's drain also sets weight 0); `ready 100%` undoes both; `up` changes nothing.
WORD_DRAIN = b"drain 0%\n"
WORD_READY = b"ready 100%\n"
WORD_UP = b"up\n"


@dataclass(frozen=True)
class Policy:
    """The host's settings that decide a yield."""

    vram_threshold_mib: int  # others' VRAM above this is a claim; 0: VRAM never claims
    quiet_s: float  # the claim gone this long before the engine starts again


@dataclass(frozen=True)
class Observation:
    """One look at the host, taken by the agent."""

    now: float
    gpu_used_mib: int | None  # the card's used memory; None: nvidia-smi could not be read
    engine_active: bool  # systemd's word for the engine unit
    engine_vram_mib: int | None  # what the engine holds (/v1/stats vram_bytes); None: unknown
    health_ok: bool  # /health said "status": "ok"
    snooze_until: float | None = None  # the owner's snooze, if any
    drain_answered: bool = False  # the gateway has read `drain` since this yield began


@dataclass(frozen=True)
class AgentState:
    """What the agent keeps (in root's state file) and prints for ``freetoken-owner status``."""

    mode: str = SERVING
    reason: str = ""
    since: float = 0.0
    clear_since: float | None = None  # the claim has been gone since then (yielded only)
    ready_until: float = 0.0  # answer `ready 100%` until then
    others_mib: int | None = None  # the last measure of other processes' VRAM
    stopped: bool = False  # the agent stopped the engine (it starts only what it stopped)
    idle_used_mib: int | None = None  # the card's used memory last seen with the engine stopped
    engine_mib: int | None = None  # what the engine took when it came up (used less idle_used)


def others_mib(obs: Observation, learned_engine_mib: int | None = None) -> int | None:
    """Other processes' VRAM: the card's used memory less the engine's own; None when unknown
    (nvidia-smi unread, or the engine runs and neither said what it holds nor was seen coming
    up). The engine's own: its ``/v1/stats`` figure (0.2.1 reports it only once a request has
    been served), else what the card's used memory grew by when it came up (FreeToken takes its
    pages at load; ``learn``)."""
    if obs.gpu_used_mib is None:
        return None
    if not obs.engine_active:
        return obs.gpu_used_mib
    engine = obs.engine_vram_mib if obs.engine_vram_mib is not None else learned_engine_mib
    if engine is None:
        return None
    return max(0, obs.gpu_used_mib - engine)


def learn(state: AgentState, obs: Observation) -> AgentState:
    """What the card holds without the engine (seen while it is stopped), and what the engine took
    once it is up and healthy (learnt once per start)."""
    if obs.gpu_used_mib is None:
        return state
    if not obs.engine_active:
        return replace(state, idle_used_mib=obs.gpu_used_mib, engine_mib=None)
    if obs.health_ok and state.engine_mib is None and state.idle_used_mib is not None:
        return replace(state, engine_mib=max(0, obs.gpu_used_mib - state.idle_used_mib))
    return state


def gib(mib: float) -> str:
    return f"{mib / MIB_PER_GIB:.1f} GiB"


def claim(obs: Observation, policy: Policy, learned_engine_mib: int | None = None) -> str | None:
    """Why the owner claims the GPU now, or None."""
    if obs.snooze_until is not None and obs.snooze_until > obs.now:
        return f"snoozed by the owner until {time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(obs.snooze_until))}"
    others = others_mib(obs, learned_engine_mib)
    if policy.vram_threshold_mib > 0 and others is not None and others > policy.vram_threshold_mib:
        return (
            f"the owner's GPU use: {gib(others)} held by other processes "
            f"(over owner_vram_threshold_gb, {gib(policy.vram_threshold_mib)})"
        )
    return None


def step(state: AgentState, obs: Observation, policy: Policy) -> tuple[AgentState, str | None]:
    """The next state and the action to take now (``STOP``, ``START`` or None)."""
    state = learn(state, obs)
    now, why = obs.now, claim(obs, policy, state.engine_mib)
    others = others_mib(obs, state.engine_mib)
    state = replace(state, others_mib=others if others is not None else state.others_mib)
    if state.mode == SERVING:
        if why is None:
            return state, None
        if obs.engine_active:  # drain first; the engine stops once the gateway has read it
            return replace(state, mode=YIELDING, reason=why, since=now, clear_since=None, ready_until=0.0), None
        # Not running (the guard, the operator): nothing to stop, but it is the owner's now.
        return (
            replace(state, mode=YIELDED, reason=why, since=now, clear_since=None, ready_until=0.0, stopped=False),
            None,
        )
    if state.mode == YIELDING:
        if why is None:  # gone before the engine stopped: undo the drain
            return _serving(state, now, "the owner's claim ended before the engine stopped"), None
        if obs.drain_answered or now - state.since >= GATEWAY_NOTICE_S:
            return replace(state, mode=YIELDED, reason=why, stopped=True), STOP
        return replace(state, reason=why), None
    if state.mode == YIELDED:
        if why is not None:
            return replace(state, reason=why, clear_since=None), None
        if others is None:  # cannot tell: wait
            return state, None
        clear = state.clear_since if state.clear_since is not None else now
        if now - clear >= policy.quiet_s:
            if not state.stopped:  # someone else stopped it: theirs to start
                return _serving(state, now, "the owner's claim is gone (the engine was not ours to start)"), None
            reason = f"the owner's claim gone for {now - clear:.0f} s: starting the engine"
            return replace(state, mode=STARTING, reason=reason, since=now, clear_since=None), START
        return replace(state, clear_since=clear), None
    if state.mode == STARTING:
        if obs.snooze_until is not None and obs.snooze_until > now and why is not None:
            return replace(state, mode=YIELDED, reason=why, since=now, clear_since=None, stopped=True), STOP
        if obs.engine_active and obs.health_ok:
            return _serving(state, now, "back in service after a yield"), None
        if now - state.since >= START_TIMEOUT_S:
            return _serving(state, now, f"the engine was not healthy {START_TIMEOUT_S:.0f} s after its start"), None
        return state, None
    return _serving(state, now, f"unknown mode {state.mode!r} reset"), None


def _serving(state: AgentState, now: float, reason: str) -> AgentState:
    return replace(
        state,
        mode=SERVING,
        reason=reason,
        since=now,
        clear_since=None,
        ready_until=now + REJOIN_READY_S,
        stopped=False,
    )


def agent_word(state: AgentState, now: float) -> bytes:
    """What the agent-check port answers: one of three fixed lines."""
    if state.mode != SERVING:
        return WORD_DRAIN
    if now < state.ready_until:
        return WORD_READY
    return WORD_UP


# --------------------------------------------------------------------------- the state file
def dump_state(state: AgentState, now: float) -> bytes:
    doc = asdict(state)
    doc["updated"] = now
    return (json.dumps(doc, sort_keys=True) + "\n").encode()


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _mib(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def load_state(text: str) -> AgentState:
    """The state file read back, checked field by field: anything not a state is a fresh one
    (serving)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return AgentState()
    if not isinstance(doc, dict) or doc.get("mode") not in MODES:
        return AgentState()
    reason = doc.get("reason")
    return AgentState(
        mode=doc["mode"],
        reason=reason if isinstance(reason, str) else "",
        since=_finite(doc.get("since")) or 0.0,
        clear_since=_finite(doc.get("clear_since")),
        ready_until=_finite(doc.get("ready_until")) or 0.0,
        others_mib=_mib(doc.get("others_mib")),
        stopped=doc.get("stopped") is True,
        idle_used_mib=_mib(doc.get("idle_used_mib")),
        engine_mib=_mib(doc.get("engine_mib")),
    )


# --------------------------------------------------------------------------- the owner's override
_DURATION = re.compile(r"(?:(\d{1,4})d)?(?:(\d{1,4})h)?(?:(\d{1,5})m)?(?:(\d{1,7})s)?")


def parse_duration(text: str) -> int:
    """``2h``, ``90m``, ``1h30m``, ``45s``, ``1d``: seconds, at most a week. ValueError otherwise."""
    match = _DURATION.fullmatch(text.strip().lower())
    if not text.strip() or match is None or not any(match.groups()):
        raise ValueError(f"not a duration: {text!r} (say 2h, 90m, 1h30m)")
    d, h, m, s = (int(g or 0) for g in match.groups())
    seconds = ((d * 24 + h) * 60 + m) * 60 + s
    if not 0 < seconds <= SNOOZE_MAX_S:
        raise ValueError(f"a snooze lasts from 1 s to 7 days, not {text!r}")
    return seconds


def load_snooze(text: str) -> float | None:
    """The override file's ``snooze_until`` (epoch seconds), or None."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return _finite(doc.get("snooze_until")) if isinstance(doc, dict) else None


def describe(state: AgentState, snooze_until: float | None, now: float) -> str:
    """``freetoken-owner status``: the state, why, since when, the snooze."""
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(state.since)) if state.since else "-"
    lines = [
        f"state:   {state.mode}",
        f"reason:  {state.reason or '-'}",
        f"since:   {when}",
        f"others' GPU memory: {gib(state.others_mib) if state.others_mib is not None else 'unknown'}",
    ]
    if snooze_until is not None and snooze_until > now:
        left = int(snooze_until - now)
        lines.append(f"snoozed: {left // 3600} h {left % 3600 // 60} min left (freetoken-owner resume ends it)")
    return "\n".join(lines)
