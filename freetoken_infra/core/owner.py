"""The host agent's decisions: when a workstation yields its GPU to its owner, and what it tells
the gateway.

The agent (``operations/scripts/owner_agent.py``, a systemd service as root) observes once a
second: the card's used memory (``nvidia-smi``), whether the engine runs, what the engine itself
holds (its ``/v1/stats`` ``vram_bytes``), whether its ``/health`` is ok, and the owner's snooze.
``step`` turns the last state and one ``Observation`` into the next state and at most one action
(stop the engine, start it); ``agent_word`` is what HAProxy's ``agent-check`` reads. Pure
functions of plain values: tested without a host in ``tests/unit/test_owner.py``.

The owner's claim on the GPU is what other processes hold (under WSL ``nvidia-smi`` counts the
owner's Windows games in the card's used memory without listing them, microsoft/WSL#7162) above
``owner_vram_threshold_gb``, or a snooze the owner set with ``freetoken-owner snooze``, or
(through interop) an app of ``owner_apps`` running on Windows, a
full-screen app (``owner_fullscreen``), the owner's ``serve_hours`` over, or a pending Windows
reboot. Each claim has a status word (``Claim.word``: ``yielded (game)``, ``yielded (app
NAME)``, ``snoozed``, ``reboot pending``, ``off schedule``) that the agent appends to its
agent-check answer after ``#``; HAProxy 2.6 keeps it in ``show stat``'s ``last_agt`` (``via
agent : up (WORD)``), where ``freetoken_infra.fleet`` reads it back (``fleet_word``). A pending
reboot only drains (mode ``held``: no new work, the engine left as it is, Windows will stop it);
every other claim also stops the engine.

    serving --claim--> yielding (drain at the gateway) --gateway read it--> yielded (engine
    stopped after its streams) --claim gone for owner_quiet_s--> starting --/health ok--> serving

Standard library only: uploaded beside the agent (``layout.OWNER_MODULE``).
"""

from __future__ import annotations

import errno
import json
import math
import re
import time
from dataclasses import asdict, dataclass, replace

SERVING, YIELDING, YIELDED, STARTING, HELD = "serving", "yielding", "yielded", "starting", "held"
MODES = (SERVING, YIELDING, YIELDED, STARTING, HELD)
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
# While the host is the owner's the answer is `drain 0% up #WORD` (WORD: the claim's status word):
# HAProxy 2.6 keeps the text after `#` only from an answer that also carries a state word
# (measured with 2.6.12: `drain 0% #x` leaves `last_agt` empty, `drain 0% up #x` gives `via agent
# : up (x)`), and `up` changes nothing else (the health checks still decide).
WORD_DRAIN = b"drain 0%\n"
DRAIN_PREFIX = b"drain 0%"
WORD_READY = b"ready 100%\n"
WORD_UP = b"up\n"


@dataclass(frozen=True)
class Policy:
    """The host's settings that decide a yield."""

    vram_threshold_mib: int  # others' VRAM above this is a claim; 0: VRAM never claims
    quiet_s: float  # the claim gone this long before the engine starts again
    apps: tuple[str, ...] = ()  # owner_apps: Windows image names (app_name_ok), any case
    fullscreen: bool = False  # owner_fullscreen: a full-screen app on Windows claims the GPU
    hours: Hours | None = None  # serve_hours (parse_hours); None: always
    reboot: bool = True  # owner_reboot_drain: a pending Windows reboot drains the host


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
    apps_running: tuple[str, ...] = ()  # the policy's apps seen running on Windows (their names as set)
    fullscreen: bool = False  # Windows said a full-screen app runs (notification_fullscreen)
    reboot_pending: bool = False  # Windows Update's flags (reg.exe, reboot_flag)
    local: tuple[int, int] | None = None  # the host's local (weekday Mon=0, minute of the day)


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
    word: str = ""  # the claim's status word (Claim.word) while not serving
    signals: str = ""  # the owner signals read now (signals_line); "": not known yet


def engine_share_mib(
    obs: Observation, learned_engine_mib: int | None = None, idle_used_mib: int | None = None
) -> int | None:
    """What the engine holds, as far as the card bears it out; None when unknown (nvidia-smi
    unread, or the engine runs and neither said what it holds nor was seen coming up).

    Its own ``/v1/stats`` figure (0.2.1 reports it only once a request has been served), else
    what the card's used memory grew by when it came up (FreeToken takes its pages at load;
    ``learn``). The engine is untrusted (it parses LAN requests): its figure counts only up to
    what the card shows it took, i.e. what the used memory grew by when it came up (the card's
    growth counts its CUDA context too, so an honest figure is below it), else, before that is
    learnt, the used memory less the card's idle baseline (``idle_used_mib``, seen with the
    engine stopped), and never more than the card's used memory. An engine that says it holds
    1 PiB hides no game."""
    used = obs.gpu_used_mib
    if used is None:
        return None
    said = obs.engine_vram_mib
    if isinstance(said, bool) or not isinstance(said, int) or said < 0:
        said = None
    engine = said if said is not None else learned_engine_mib
    if engine is None:
        return None
    if learned_engine_mib is not None:
        bound = learned_engine_mib
    elif idle_used_mib is not None:
        bound = max(0, used - idle_used_mib)
    else:
        bound = used
    return max(0, min(engine, bound, used))


def others_mib(obs: Observation, learned_engine_mib: int | None = None, idle_used_mib: int | None = None) -> int | None:
    """Other processes' VRAM: the card's used memory less the engine's own (what it says it holds,
    bounded by what the card shows it took, ``engine_share_mib``); None when unknown."""
    if obs.gpu_used_mib is None:
        return None
    if not obs.engine_active:
        return obs.gpu_used_mib
    engine = engine_share_mib(obs, learned_engine_mib, idle_used_mib)
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


# --------------------------------------------------------------------------- the owner's claims
SNOOZE, APP, FULLSCREEN, VRAM, SCHEDULE, REBOOT = "snooze", "app", "fullscreen", "vram", "schedule", "reboot"
# Before serve_hours end the host drains this much ahead, so that streams finish in its hours.
SCHEDULE_LEAD_S = 60.0
# Windows image names an owner may list (owner_apps): a file name ending in .exe, no path, no
# quotes, commas, `#` or control characters (the name goes into the agent-check answer).
_APP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._+()&'-]{0,58}\.exe", re.IGNORECASE)


def app_name_ok(name: str) -> bool:
    return _APP_NAME.fullmatch(name) is not None and "  " not in name


@dataclass(frozen=True)
class Claim:
    """The owner's claim on the GPU: its kind, the status word the gateway and `fleet status`
    show, and the reason the agent records."""

    kind: str
    word: str
    reason: str

    @property
    def stops_engine(self) -> bool:
        """A pending reboot only drains; every other claim frees the card."""
        return self.kind != REBOOT


def claims(
    obs: Observation, policy: Policy, learned_engine_mib: int | None = None, idle_used_mib: int | None = None
) -> list[Claim]:
    """Every claim the owner has now, strongest first (the owner's own use before the schedule,
    the schedule before a reboot)."""
    out = []
    if obs.snooze_until is not None and obs.snooze_until > obs.now:
        until = time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(obs.snooze_until))
        out.append(Claim(SNOOZE, "snoozed", f"snoozed by the owner until {until}"))
    wanted = {a.lower(): a for a in policy.apps}
    running = [wanted[a.lower()] for a in obs.apps_running if a.lower() in wanted]
    if running:
        out.append(
            Claim(APP, f"yielded (app {running[0]})", f"the owner's app {running[0]} runs on Windows (owner_apps)")
        )
    if policy.fullscreen and obs.fullscreen:
        out.append(Claim(FULLSCREEN, "yielded (full-screen)", "a full-screen app runs on Windows (owner_fullscreen)"))
    others = others_mib(obs, learned_engine_mib, idle_used_mib)
    if policy.vram_threshold_mib > 0 and others is not None and others > policy.vram_threshold_mib:
        reason = (
            f"the owner's GPU use: {gib(others)} held by other processes "
            f"(over owner_vram_threshold_gb, {gib(policy.vram_threshold_mib)})"
        )
        out.append(Claim(VRAM, "yielded (game)", reason))
    if policy.hours is not None and obs.local is not None:
        day, minute = obs.local
        ahead = minute + int(SCHEDULE_LEAD_S // 60)
        if not in_hours(policy.hours, day, minute) or not in_hours(
            policy.hours, (day + ahead // 1440) % 7, ahead % 1440
        ):
            out.append(Claim(SCHEDULE, "off schedule", f"outside serve_hours ({format_hours(policy.hours)})"))
    if policy.reboot and obs.reboot_pending:
        out.append(Claim(REBOOT, "reboot pending", "Windows has a reboot pending (Windows Update): no new work"))
    return out


def claim(
    obs: Observation, policy: Policy, learned_engine_mib: int | None = None, idle_used_mib: int | None = None
) -> str | None:
    """Why the owner claims the GPU now (the strongest claim's reason), or None."""
    found = claims(obs, policy, learned_engine_mib, idle_used_mib)
    return found[0].reason if found else None


def _strongest(found: list[Claim]) -> Claim | None:
    """The claim that decides: the first that frees the card, else the first (a reboot)."""
    return next((c for c in found if c.stops_engine), found[0] if found else None)


def step(state: AgentState, obs: Observation, policy: Policy) -> tuple[AgentState, str | None]:
    """The next state and the action to take now (``STOP``, ``START`` or None)."""
    state = learn(state, obs)
    now = obs.now
    found = claims(obs, policy, state.engine_mib, state.idle_used_mib)
    c = _strongest(found)
    others = others_mib(obs, state.engine_mib, state.idle_used_mib)
    state = replace(state, others_mib=others if others is not None else state.others_mib)
    if state.mode in (SERVING, HELD):
        return _step_serving(state, obs, c)
    if state.mode == YIELDING:
        return _step_yielding(state, obs, c)
    if state.mode == YIELDED:
        return _step_yielded(state, now, c, others, policy)
    if state.mode == STARTING:
        return _step_starting(state, obs, found)
    return _serving(state, now, f"unknown mode {state.mode!r} reset"), None


def _step_serving(state: AgentState, obs: Observation, c: Claim | None) -> tuple[AgentState, str | None]:
    """Serving, or held for a pending reboot: the owner's claim, if any, takes the host."""
    now = obs.now
    if c is None:
        if state.mode == HELD:
            return _serving(state, now, "the pending reboot is gone"), None
        return state, None
    if not c.stops_engine:  # a pending reboot: no new work, the engine left as it is
        if state.mode == HELD:
            return replace(state, reason=c.reason, word=c.word), None
        return _owned(state, HELD, c, now), None
    if obs.engine_active:  # drain first; the engine stops once the gateway has read it
        return _owned(state, YIELDING, c, now), None
    # Not running (the guard, the operator): nothing to stop, but it is the owner's now.
    return replace(_owned(state, YIELDED, c, now), stopped=False), None


def _step_yielding(state: AgentState, obs: Observation, c: Claim | None) -> tuple[AgentState, str | None]:
    """Draining: the engine stops once the gateway has read the drain (or after its notice)."""
    now = obs.now
    if c is None:  # gone before the engine stopped: undo the drain
        return _serving(state, now, "the owner's claim ended before the engine stopped"), None
    if not c.stops_engine:
        return _owned(state, HELD, c, now), None
    if obs.drain_answered or now - state.since >= GATEWAY_NOTICE_S:
        return replace(state, mode=YIELDED, reason=c.reason, word=c.word, stopped=True), STOP
    return replace(state, reason=c.reason, word=c.word), None


def _step_yielded(
    state: AgentState, now: float, c: Claim | None, others: int | None, policy: Policy
) -> tuple[AgentState, str | None]:
    """The owner's: the engine starts again once the claim has been gone for ``quiet_s``."""
    if c is not None:
        return replace(state, reason=c.reason, word=c.word, clear_since=None), None
    if others is None:  # cannot tell: wait
        return state, None
    clear = state.clear_since if state.clear_since is not None else now
    if now - clear >= policy.quiet_s:
        if not state.stopped:  # someone else stopped it: theirs to start
            return _serving(state, now, "the owner's claim is gone (the engine was not ours to start)"), None
        reason = f"the owner's claim gone for {now - clear:.0f} s: starting the engine"
        return replace(state, mode=STARTING, reason=reason, word="", since=now, clear_since=None), START
    return replace(state, clear_since=clear), None


def _step_starting(state: AgentState, obs: Observation, found: list[Claim]) -> tuple[AgentState, str | None]:
    """Starting: back in service once healthy, or after ``START_TIMEOUT_S`` whatever it says."""
    now = obs.now
    # A claim that does not hang on VRAM (the engine's own grows while it loads) stops it again.
    hard = next((x for x in found if x.stops_engine and x.kind != VRAM), None)
    if hard is not None:
        return replace(_owned(state, YIELDED, hard, now), stopped=True), STOP
    if obs.engine_active and obs.health_ok:
        return _serving(state, now, "back in service after a yield"), None
    if now - state.since >= START_TIMEOUT_S:
        return _serving(state, now, f"the engine was not healthy {START_TIMEOUT_S:.0f} s after its start"), None
    return state, None


def _owned(state: AgentState, mode: str, c: Claim, now: float) -> AgentState:
    return replace(state, mode=mode, reason=c.reason, word=c.word, since=now, clear_since=None, ready_until=0.0)


def _serving(state: AgentState, now: float, reason: str) -> AgentState:
    return replace(
        state,
        mode=SERVING,
        reason=reason,
        since=now,
        clear_since=None,
        ready_until=now + REJOIN_READY_S,
        stopped=False,
        word="",
    )


def agent_note(state: AgentState) -> str | None:
    """The text after ``#`` in the agent-check answer, or None: the claim's status word while the
    host is the owner's, and the owner signals when one that is configured is off (``WORD;
    SIGNALS``, or ``SIGNALS`` alone while serving). Only words of the fixed vocabulary (checked
    again here), at most ``NOTE_MAX`` characters: the signals are left out rather than cut."""
    word = fleet_word(state.word) if state.mode != SERVING else None
    signals = state.signals if degraded(state.signals) else None
    if word is not None and signals is not None:
        both = f"{word}; {signals}"
        return both if len(both) <= NOTE_MAX else word
    return word or signals


def agent_word(state: AgentState, now: float) -> bytes:
    """What the agent-check port answers: ``drain 0% up #NOTE`` while the host is the owner's
    (``drain 0%`` when there is no note of ours), else ``ready 100%`` or ``up``, with ``up
    #NOTE`` after them while an owner signal is off (``agent_note``; HAProxy keeps a note only
    from an answer with a state word, and ``up`` changes nothing else)."""
    note = agent_note(state)
    if state.mode != SERVING:
        return WORD_DRAIN if note is None else f"drain 0% up #{note}\n".encode()
    answer = WORD_READY if now < state.ready_until else WORD_UP
    if note is None:
        return answer
    return (b"ready 100% up" if answer == WORD_READY else b"up") + f" #{note}\n".encode()


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
        word=fleet_word(doc.get("word")) or "",
        signals=doc["signals"] if signals_ok(doc.get("signals")) else "",
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
    if signals_ok(state.signals):
        lines.append(f"owner signals: {state.signals}")
    if state.mode != SERVING and fleet_word(state.word):
        lines.append(f"fleet status shows: {state.word}")
    if snooze_until is not None and snooze_until > now:
        left = int(snooze_until - now)
        lines.append(f"snoozed: {left // 3600} h {left % 3600 // 60} min left (freetoken-owner resume ends it)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- status words
_FLEET_WORDS = ("yielded (game)", "yielded (full-screen)", "snoozed", "reboot pending", "off schedule")
_APP_WORD = re.compile(r"yielded \(app (.{1,64})\)")


def fleet_word(text: object) -> str | None:
    """``text`` when it is one of the agent's status words, else None: what the fleet CLI reads
    back from HAProxy (a host's answer, untrusted) is only ever compared with this vocabulary."""
    if not isinstance(text, str):
        return None
    if text in _FLEET_WORDS:
        return text
    match = _APP_WORD.fullmatch(text)
    return text if match and app_name_ok(match.group(1)) else None


# HAProxy 2.6's `show stat` field `last_agt` after an answer with a state word and `#WORD`.
_LAST_AGT = re.compile(r"via agent : up \((.{1,100})\)")


def note_from_last_agt(last_agt: str) -> tuple[str | None, str | None]:
    """The status word and the owner signals in ``last_agt`` (``via agent : up (yielded (app
    x.exe))``, ``via agent : up (VRAM only (interop: Exec format error))``, ``via agent : up
    (yielded (game); VRAM only (...))``): each None unless it is of our vocabulary."""
    match = _LAST_AGT.fullmatch(last_agt.strip())
    if match is None:
        return None, None
    note = match.group(1)
    if (word := fleet_word(note)) is not None:
        return word, None
    if signals_ok(note):
        return None, note
    first, sep, rest = note.partition("; ")
    if sep and fleet_word(first) is not None and signals_ok(rest):
        return first, rest
    return None, None


# The claim behind a status word as a fixed label (the agent's metrics, core/agent_metrics.py):
# every app is `app`, never its name. `game` is the VRAM claim, shown as `yielded (game)`.
YIELD_REASONS = ("game", "app", "full_screen", "snoozed", "off_schedule", "reboot_pending")
_WORD_REASONS = {
    "yielded (game)": "game",
    "yielded (full-screen)": "full_screen",
    "snoozed": "snoozed",
    "off schedule": "off_schedule",
    "reboot pending": "reboot_pending",
}


def yield_reason(state: AgentState) -> str | None:
    """Why the owner holds the GPU now, one of ``YIELD_REASONS``; None while serving or starting
    (no claim), or when the word is none of ours."""
    if state.mode in (SERVING, STARTING):
        return None
    word = fleet_word(state.word)
    if word is None:
        return None
    return _WORD_REASONS.get(word, "app")  # fleet_word's only other words: `yielded (app NAME)`


def word_from_last_agt(last_agt: str) -> str | None:
    """The status word in ``last_agt`` (``via agent : up (yielded (app x.exe))``), or None."""
    return note_from_last_agt(last_agt)[0]


# --------------------------------------------------------------------------- serve_hours
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_HHMM = r"([01][0-9]|2[0-4]):([0-5][0-9])"
_DAY = r"(?:mon|tue|wed|thu|fri|sat|sun)"
_DAYSPEC = rf"{_DAY}(?:-{_DAY})?(?:,{_DAY}(?:-{_DAY})?)*"
_RANGE = re.compile(rf"(?:({_DAYSPEC})\s+)?{_HHMM}-{_HHMM}", re.IGNORECASE)
HOURS_MAX_RANGES = 14


@dataclass(frozen=True)
class HoursRange:
    days: frozenset[int]  # the days a range starts on (Mon=0)
    start: int  # minute of the day
    end: int  # minute of the day, 1..1440; end <= start: it runs past midnight into the next day


Hours = tuple[HoursRange, ...]


def _minute(hh: str, mm: str, text: str) -> int:
    minute = int(hh) * 60 + int(mm)
    if minute > 1440:
        raise ValueError(f"serve_hours: {text!r}: {hh}:{mm} is not a time of day")
    return minute


def _days(spec: str | None, text: str) -> frozenset[int]:
    if spec is None:
        return frozenset(range(7))
    out: set[int] = set()
    for part in spec.lower().split(","):
        first, _, last = part.partition("-")
        a, b = DAYS.index(first), DAYS.index(last or first)
        out.update((a + i) % 7 for i in range((b - a) % 7 + 1))  # Fri-Mon wraps over the weekend
    return frozenset(out)


def parse_hours(text: str) -> Hours:
    """``serve_hours``: when the host serves, in the host's local time. One or more ranges
    separated by ``;``, each ``[DAYS ]HH:MM-HH:MM``; DAYS: ``Mon``..``Sun``, a span ``Mon-Fri``
    (``Fri-Mon`` wraps) or a list ``Mon,Wed,Sat-Sun``; no DAYS: every day. A range whose end is
    not after its start runs past midnight (``Mon-Fri 18:00-08:00``: Friday 18:00 to Saturday
    08:00 too; Monday 00:00-08:00 only if Sunday is listed); ``24:00`` ends a day
    (``Sat-Sun 00:00-24:00``). ValueError, naming the part, for anything else."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("serve_hours: empty (leave it unset to serve at any hour)")
    parts = [p.strip() for p in text.split(";")]
    if len(parts) > HOURS_MAX_RANGES:
        raise ValueError(f"serve_hours: at most {HOURS_MAX_RANGES} ranges, not {len(parts)}")
    out = []
    for part in parts:
        match = _RANGE.fullmatch(part)
        if match is None:
            raise ValueError(
                f"serve_hours: {part!r} is not a range: say [DAYS ]HH:MM-HH:MM, e.g. 'Mon-Fri 18:00-08:00' "
                "or '22:00-07:00', several separated by ';'"
            )
        start = _minute(match.group(2), match.group(3), part)
        end = _minute(match.group(4), match.group(5), part)
        if start == 1440:
            raise ValueError(f"serve_hours: {part!r}: a range cannot start at 24:00")
        if end == 0:
            end = 1440  # 18:00-00:00: to midnight
        if start == end:
            raise ValueError(f"serve_hours: {part!r}: start and end are the same (say 00:00-24:00 for a whole day)")
        out.append(HoursRange(_days(match.group(1), part), start, end))
    return tuple(out)


def in_hours(hours: Hours, weekday: int, minute: int) -> bool:
    """Whether (weekday Mon=0, minute of the day) lies in ``hours``."""
    for r in hours:
        if r.start < r.end:
            if weekday in r.days and r.start <= minute < r.end:
                return True
        elif (weekday in r.days and minute >= r.start) or ((weekday - 1) % 7 in r.days and minute < r.end):
            return True
    return False


def format_hours(hours: Hours) -> str:
    def days(d: frozenset[int]) -> str:
        return "" if len(d) == 7 else ",".join(DAYS[i].title() for i in sorted(d)) + " "

    def hhmm(m: int) -> str:
        return f"{m // 60:02d}:{m % 60:02d}"

    return "; ".join(f"{days(r.days)}{hhmm(r.start)}-{hhmm(r.end)}" for r in hours)


# --------------------------------------------------------------------------- Windows' answers
# Everything Windows prints is untrusted text: parsed strictly, only compared, never run.
TASKLIST_ARGS = ("/fo", "csv", "/nh")
_TASKLIST_ROW = re.compile(
    r'"([^"\x00-\x1f]{1,260})","(\d{1,10})","([^"\x00-\x1f]{0,64})","(\d{1,10})","([^"\x00-\x1f]{0,32})"'
)


def parse_tasklist(data: bytes) -> set[str] | None:
    """``tasklist.exe /fo csv /nh``: the image names running (lower case), or None when the
    output is not tasklist's five quoted fields per line (``"System Idle Process","0",
    "Services","0","8 K"``; the console's code page: bytes that are not UTF-8 become U+FFFD and
    match no name of the list, which is ASCII)."""
    text = data.decode("utf-8", errors="replace")
    names: set[str] = set()
    rows = 0
    for line in text.replace("\r\n", "\n").split("\n"):
        if not line.strip():
            continue
        if line.startswith("INFO: "):  # "INFO: No tasks are running which match the specified criteria."
            continue
        match = _TASKLIST_ROW.fullmatch(line.strip())
        if match is None:
            return None
        names.add(match.group(1).lower())
        rows += 1
    return names if rows else None


def running_apps(names: set[str], apps: tuple[str, ...]) -> tuple[str, ...]:
    """The listed apps among the running image names (case-insensitive, whole names only)."""
    return tuple(a for a in apps if a.lower() in names)


# shell32's SHQueryUserNotificationState, through PowerShell: one number, QUERY_USER_NOTIFICATION_STATE.
NOTIFICATION_SCRIPT = (
    "$t = Add-Type -PassThru -Name Quns -Namespace FreeToken -MemberDefinition "
    "'[DllImport(\"shell32.dll\")] public static extern int SHQueryUserNotificationState(out int state);'; "
    "$s = 0; if ($t::SHQueryUserNotificationState([ref]$s) -eq 0) { $s } else { 'error' }"
)
QUNS_BUSY, QUNS_RUNNING_D3D_FULL_SCREEN, QUNS_PRESENTATION_MODE = 2, 3, 4
FULLSCREEN_STATES = (QUNS_BUSY, QUNS_RUNNING_D3D_FULL_SCREEN, QUNS_PRESENTATION_MODE)


def parse_notification_state(data: bytes) -> int | None:
    """The state PowerShell printed (1..7), or None for anything else."""
    text = data.decode("ascii", errors="replace").strip()
    return int(text) if len(text) == 1 and text in "1234567" else None


def notification_fullscreen(state: int | None) -> bool:
    """A full-screen app (busy, Direct3D full screen, presentation mode)."""
    return state in FULLSCREEN_STATES


# Windows Update's pending-reboot flags: `reg.exe query KEY` exits 0 when the key exists (and
# prints a blank line and the key's full name first), 1 when it does not.
REBOOT_KEYS = (
    r"HKLM\SOFTWARE\Microsoft\Windows\CurrentVersion\WindowsUpdate\Auto Update\RebootRequired",
    r"HKLM\SOFTWARE\Microsoft\Windows\CurrentVersion\Component Based Servicing\RebootPending",
)


def reboot_flag(key: str, returncode: int, data: bytes) -> bool | None:
    """Whether ``key`` exists per ``reg.exe query KEY``: True (exit 0 and the first line names
    the key), False (exit 1), None for anything else."""
    if returncode == 1:
        return False
    if returncode != 0:
        return None
    lines = [line.strip() for line in data.decode("utf-8", errors="replace").splitlines() if line.strip()]
    full = "HKEY_LOCAL_MACHINE" + key[len("HKLM") :]
    return True if lines and lines[0].lower() == full.lower() else None


# --------------------------------------------------------------------------- interop failures
# Under WSL with systemd the agent's Windows programs fail in a few known ways. Each
# call is classified into one short reason from a fixed vocabulary: what the state file,
# `freetoken-owner status`, the agent-check note and `fleet status` show. Never Windows' text.
INTEROP_OK = ""
EXEC_FORMAT = "Exec format error"  # systemd-binfmt flushed WSLInterop (microsoft/WSL#8843, #10389)
RUN_DETECTORS = "run-detectors: no interpreter"  # binfmt-support's `cli` (mono/wine) took MZ files
VSOCK_REFUSED = "vsock refused"  # a sandboxed caller: UtilBindVsockAnyPort ... socket failed 97
NO_CONNECT_BACK = "Windows never connected back"  # UtilAcceptVsock ... accept4 failed 110 (10 s)
INTEROP_ERROR = "interop error"  # another `<3>WSL (...) ERROR:` line of WSL's init
NO_ANSWER = "no answer (exit 1, nothing printed)"  # no interop socket found at all
PROGRAM_MISSING = "program missing"  # not at its place under System32
NO_WINDOWS = "no Windows drive"  # System32 is not there (not mounted, not WSL)
_SOCKET = re.compile(rb"Util(?:ConnectUnix|ConnectToInteropServer):\d{1,6}: connect failed (\d{1,5})")
_VSOCK = re.compile(rb"UtilBindVsockAnyPort:\d{1,6}: socket failed \d{1,5}")
_ACCEPT = re.compile(rb"UtilAcceptVsock:\d{1,6}: accept4 failed \d{1,5}")
_WSL_ERROR = re.compile(rb"<3>(?:WSL|init:) \(\d{1,8}[^)]{0,16}\) ERROR: ")
# Coreutils `timeout` exits 124 when it ran out of time, 137 (128 + SIGKILL) when `-k` killed it.
TIMEOUT_EXITS = (124, 137)
_SCAN = 1 << 16  # the part of the output the classifier reads


def timed_out_reason(seconds: float) -> str:
    return f"timed out after {max(1, round(seconds))} s"


def _errno_name(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    return name if re.fullmatch(r"E[A-Z0-9]{1,15}", name) else "OSError"


def interop_reason(
    exc: BaseException | None,
    returncode: int | None,
    stdout: bytes = b"",
    stderr: bytes = b"",
    timed_out: bool = False,
    timeout_s: float = 0.0,
) -> str:
    """Why an interop call failed, as one reason of the fixed vocabulary, or ``INTEROP_OK`` (the
    program ran and answered: whether its answer reads is its parser's business; an exit status
    of its own, e.g. ``reg.exe query`` of a missing key, is an answer).

    ``exc``: the OSError of the exec, if any (``Errno 8``: binfmt's WSLInterop entry is gone);
    ``timed_out``: the caller's deadline passed (it killed the program's group)."""
    if timed_out:
        return timed_out_reason(timeout_s)
    if isinstance(exc, OSError):
        return EXEC_FORMAT if exc.errno == 8 else f"cannot start ({_errno_name(exc)})"
    if exc is not None:
        return INTEROP_ERROR
    both = stderr[:_SCAN] + b"\n" + stdout[:_SCAN]
    if returncode == 126 and b"Exec format error" in both:  # the shell's: cannot execute binary file
        return EXEC_FORMAT
    if b"run-detectors: unable to find an interpreter" in both:
        return RUN_DETECTORS
    if (match := _SOCKET.search(both)) is not None:
        return f"interop socket: connect failed {int(match.group(1))}"
    if _VSOCK.search(both):
        return VSOCK_REFUSED
    if _ACCEPT.search(both):
        return NO_CONNECT_BACK
    if _WSL_ERROR.search(both):
        return INTEROP_ERROR
    if returncode == 1 and not stdout.strip() and not stderr.strip():
        return NO_ANSWER
    return INTEROP_OK


_REASON = re.compile(
    r"Exec format error|run-detectors: no interpreter|interop socket: connect failed \d{1,5}|vsock refused"
    r"|Windows never connected back|interop error|no answer \(exit 1, nothing printed\)"
    r"|program missing|no Windows drive|timed out after \d{1,5} s|cannot start \(E[A-Z0-9]{1,15}\)"
    r"|cannot start \(OSError\)"
)


def reason_ok(text: object) -> bool:
    """``text`` is one of the classifier's reasons."""
    return isinstance(text, str) and _REASON.fullmatch(text) is not None


# --------------------------------------------------------------------------- the owner's signals
# What the agent can see of its owner now. VRAM (nvidia-smi) needs no interop; the others do, and
# are listed only when configured (owner_apps, owner_fullscreen, owner_reboot_drain).
SIG_VRAM, SIG_APPS, SIG_FULLSCREEN, SIG_REBOOT = "VRAM", "apps", "full screen", "reboot"
WINDOWS_SIGNALS = (SIG_APPS, SIG_FULLSCREEN, SIG_REBOOT)
_SIGNALS = re.compile(
    r"(?P<head>VRAM only|VRAM(?:, apps)?(?:, full screen)?(?:, reboot)?)"
    r"(?: \(interop: (?P<reason>[^()]{1,60}(?:\([^()]{1,40}\))?)\))?"
)
# HAProxy 2.6 keeps a check's description in `char desc[HCHK_DESC_LEN]` (128, include/haproxy/
# defaults.h), `via agent : up (NOTE)` included: a note of at most 100 characters fits.
NOTE_MAX = 100


# Each owner signal as a fixed label (the agent's metrics): VRAM is read from the card.
SIGNAL_LABELS = {SIG_VRAM: "gpu", SIG_APPS: "apps", SIG_FULLSCREEN: "full_screen", SIG_REBOOT: "reboot"}


def signals_line(configured: tuple[str, ...], broken: dict[str, str]) -> str:
    """The owner signals the agent reads now: ``VRAM, apps, full screen, reboot`` when all that
    are configured work; ``VRAM only (interop: Exec format error)`` or ``VRAM, reboot (interop:
    timed out after 20 s)`` (the first broken signal's reason) when some do not. ``configured``:
    the Windows signals set (``WINDOWS_SIGNALS``); ``broken``: signal -> ``interop_reason``."""
    wanted = [s for s in WINDOWS_SIGNALS if s in configured]
    on = [SIG_VRAM, *(s for s in wanted if s not in broken)]
    failed = [broken[s] for s in wanted if s in broken and reason_ok(broken[s])]
    if not failed:
        return ", ".join(on)
    head = f"{SIG_VRAM} only" if on == [SIG_VRAM] else ", ".join(on)
    return f"{head} (interop: {failed[0]})"


def signals_ok(text: object) -> bool:
    """``text`` is a line ``signals_line`` makes (the state file and HAProxy's note are read back
    only through this)."""
    if not isinstance(text, str) or len(text) > NOTE_MAX:
        return False
    match = _SIGNALS.fullmatch(text)
    if match is None:
        return False
    head, reason = match.group("head"), match.group("reason")
    if reason is None:
        return head != "VRAM only"
    return head != "VRAM" and reason_ok(reason)


def degraded(signals: str) -> bool:
    """A configured owner signal is off (the line names an interop reason)."""
    return signals_ok(signals) and "(interop: " in signals
