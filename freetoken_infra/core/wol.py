"""Wake-on-LAN under a policy: when the gateway's queue has built, wake one
parked (sleeping) workstation, never one its owner took back.

The gateway host's waker (``operations/scripts/waker.py``, a systemd service as its own user)
reads HAProxy's ``show stat`` once a second through a read-only stats socket. ``read_stat`` turns
that CSV into plain rows; ``step`` turns the waker's memory and one reading into its next memory
and at most one host to wake; ``magic_packet`` is what it then sends (UDP broadcast, port 9).
Pure functions of plain values: tested without a host in ``tests/unit/test_waker.py``.

A host is woken only when all of these hold:
- the backend's queue (requests waiting for a slot) has been non-empty for ``queue_built_s``;
- HAProxy has it DOWN (its checks fail: asleep, off), not in maintenance (the operator's) nor
  drained;
- the last word its host agent answered before it went quiet was not a drain (the agent drains
  a host that yields to its owner's game or is snoozed; ``serve_hours`` and a pending reboot
  drain it too): the waker remembers that word, since an asleep agent answers nothing. HAProxy
  2.6 shows the agent's ``drain 0% up #snoozed`` as ``last_agt`` ``via agent : up (snoozed)``
  (``agent_word``), and a bare ``drain 0%`` not at all (``agent_status`` CHECKED, ``last_agt``
  empty; both seen in the fleet test), but the drain's ``0%`` as weight 0, kept after the agent
  goes quiet: so the memory is taken from the note, and from rows in service with weight 0 or
  DRAIN;
- it has a ``wake_on_lan_mac`` and is within its ``serve_hours`` (``Target.within_serve_hours``,
  read by ``scripts/waker.py`` against the gateway's clock each time it decides);
- it was not woken in the last ``cooldown_s``, and no other woken host is still booting
  (woken less than ``boot_s`` ago and not seen up since): one PC at a time.

Standard library only: uploaded beside ``waker.py`` (``layout.WOL_MODULE``).
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field, replace

WOL_PORT = 9  # the discard port: the usual one for magic packets (wakeonlan, etherwake -b)
QUEUE_BUILT_S = 3.0
COOLDOWN_S = 600.0  # a host woken is not woken again this long (boot, WSL, the model's load)
BOOT_S = 300.0  # while a woken host is not up this long, no other host is woken

# Agent words that keep a host out of service (core/owner.py's WORD_DRAIN, HAProxy's others).
_HELD_WORDS = ("drain", "maint", "down", "stopped", "fail")
_MAC_RE = re.compile(r"[0-9a-f]{2}([:-])[0-9a-f]{2}(\1[0-9a-f]{2}){4}")
_MAX_ROWS = 1024
_MAX_WORD = 160


class MacError(ValueError):
    pass


def parse_mac(text: str) -> str:
    """A unicast MAC address as ``aa:bb:cc:dd:ee:ff`` (``-`` separators accepted), else MacError."""
    value = text.lower()
    if not _MAC_RE.fullmatch(value):
        raise MacError(f"{text!r} is not a MAC address (six hex pairs separated by ':' or '-')")
    value = value.replace("-", ":")
    first = int(value[:2], 16)
    if value == "00:00:00:00:00:00" or first & 1:
        raise MacError(f"{value} is not a network card's address (all zero, broadcast or multicast)")
    return value


def magic_packet(mac: str) -> bytes:
    """Six 0xFF bytes, then the MAC sixteen times (102 bytes; AMD's Magic Packet format)."""
    raw = bytes.fromhex(parse_mac(mac).replace(":", ""))
    return b"\xff" * 6 + raw * 16


def packet_mac(packet: bytes) -> str | None:
    """The MAC a magic packet wakes, or None when it is not one (the harness's listener)."""
    if len(packet) < 102 or packet[:6] != b"\xff" * 6:
        return None
    raw = packet[6:12]
    if any(packet[6 + 6 * i : 12 + 6 * i] != raw for i in range(16)):
        return None
    return ":".join(f"{b:02x}" for b in raw)


@dataclass(frozen=True)
class Server:
    """One server row of ``show stat`` as the waker needs it."""

    name: str
    status: str  # "UP", "DOWN", "DRAIN", "MAINT", "UP 1/3", "DOWN 1/2", "no check", ...
    queue: int  # requests queued for this server (a conversation's host)
    agent_answered: bool  # the last agent check got an answer (agent_status L7OK...)
    agent_word: str  # what it answered (last_agt); "" when it did not answer
    # HAProxy's effective weight: 0 once the agent said `drain 0%` (or the operator drained it),
    # and it stays 0 when the agent goes quiet; None when unreadable
    weight: int | None = None

    @property
    def up(self) -> bool:
        return self.status.startswith(("UP", "DRAIN", "NOLB"))

    @property
    def parked(self) -> bool:
        """Down by its checks: not the operator's maintenance, not a drain."""
        return self.status.startswith("DOWN")


@dataclass(frozen=True)
class Reading:
    queue: int  # the backend's queue (no server assigned yet) plus every server's
    servers: tuple[Server, ...]


def read_stat(text: str, backend: str) -> Reading:
    """``show stat`` CSV (its ``# pxname,svname,...`` header first) for ``backend``. Columns are
    found by name; unreadable numbers count 0. The text is HAProxy's, but the agent words in it
    are each host's: only kept short and compared, never run or shown unquoted."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        return Reading(0, ())
    rows = csv.DictReader(io.StringIO("\n".join([lines[0][2:], *lines[1:_MAX_ROWS]])))
    queue = 0
    servers: list[Server] = []
    for row in rows:
        if row.get("pxname") != backend:
            continue
        name = row.get("svname") or ""
        waiting = _int(row.get("qcur"))
        queue += waiting
        if name in ("BACKEND", "FRONTEND"):
            continue
        agent = (row.get("agent_status") or "").strip()
        answered = agent.startswith("L7OK")
        word = (row.get("last_agt") or "").strip()[:_MAX_WORD] if answered else ""
        weight = (row.get("weight") or "").strip()
        servers.append(
            Server(
                name,
                (row.get("status") or "").strip(),
                waiting,
                answered,
                word,
                int(weight) if weight.isdigit() and len(weight) < 6 else None,
            )
        )
    return Reading(queue, tuple(servers))


def _int(value: str | None) -> int:
    text = (value or "").strip()
    return int(text) if text.isdigit() and len(text) < 10 else 0


@dataclass(frozen=True)
class Target:
    """A host the waker may wake: its MAC and the serve-hours hook."""

    name: str
    mac: str
    within_serve_hours: bool = True  # the host's serve_hours read now (scripts/waker.py in_their_hours)


@dataclass(frozen=True)
class Policy:
    queue_built_s: float = QUEUE_BUILT_S
    cooldown_s: float = COOLDOWN_S
    boot_s: float = BOOT_S


@dataclass(frozen=True)
class Memory:
    """What the waker remembers between readings (in memory: a restart forgets, see ``held``)."""

    queued_since: float | None = None
    last_word: dict[str, str] = field(default_factory=dict)  # each host's last answered agent word
    woken_at: dict[str, float] = field(default_factory=dict)
    booting: dict[str, float] = field(default_factory=dict)  # woken and not seen up since


_VIA_AGENT = re.compile(r"via agent\s*:\s*", re.I)
# "up (snoozed)", "up (yielded (app eldenring.exe))": the state word, then the agent's #WORD
_AGENT_NOTE = re.compile(r"\S+\s+\((.{1,120})\)")


def agent_said(last_agt: str) -> str:
    """The agent's word as the waker remembers it, from HAProxy's ``last_agt``. The host agent
    answers ``drain 0% up #WORD`` while the host is its owner's (core/owner.py ``agent_word``:
    yielded, snoozed, off schedule, reboot pending), which HAProxy 2.6 shows as ``via agent : up
    (WORD)`` (seen in the fleet test; core/owner.py ``word_from_last_agt`` reads the same): a
    note in brackets is a drain."""
    text = _VIA_AGENT.sub("", last_agt.strip(), count=1)
    note = _AGENT_NOTE.fullmatch(text)
    return f"drain ({note.group(1).strip()})" if note else text


def held(word: str) -> bool:
    """The agent's word keeps its host out: a yield, a snooze, off schedule, a reboot pending."""
    return word.strip().lower().startswith(_HELD_WORDS)


def step(
    memory: Memory, reading: Reading, targets: tuple[Target, ...], now: float, policy: Policy = Policy()
) -> tuple[Memory, Target | None, str]:
    """The next memory, the host to wake now (or None), and why (one line for the journal)."""
    words = dict(memory.last_word)
    for server in reading.servers:
        said = agent_said(server.agent_word) if server.agent_answered else ""
        if server.up:  # what it says while in HAProxy's view (a DOWN row's weight says nothing)
            if server.weight == 0 or server.status.startswith("DRAIN"):
                # drained by its agent (or the operator), and HAProxy keeps it so
                words[server.name] = said if held(said) else ("drain (weight 0)" if server.weight == 0 else "drain")
            else:
                words[server.name] = said or "up"  # in service: an earlier drain is over
        elif said:
            words[server.name] = said
    booting = {
        name: at
        for name, at in memory.booting.items()
        if now - at < policy.boot_s and not any(s.name == name and s.up for s in reading.servers)
    }
    memory = replace(memory, last_word=words, booting=booting)
    if reading.queue <= 0:
        return replace(memory, queued_since=None), None, "no queue"
    since = memory.queued_since if memory.queued_since is not None else now
    memory = replace(memory, queued_since=since)
    if now - since < policy.queue_built_s:
        return memory, None, f"queue {reading.queue} for {now - since:.1f} s"
    by_name = {s.name: s for s in reading.servers}
    if booting:
        return memory, None, f"queue {reading.queue}: waiting for {', '.join(sorted(booting))} to boot"
    skipped: list[str] = []
    candidates: list[Target] = []
    for target in targets:
        row = by_name.get(target.name)
        if row is None or not row.parked:
            continue
        word = words.get(target.name, "")
        if held(word):
            skipped.append(f"{target.name} (its agent said {word!r})")
        elif not target.within_serve_hours:
            skipped.append(f"{target.name} (off schedule)")
        elif now - memory.woken_at.get(target.name, -policy.cooldown_s) < policy.cooldown_s:
            skipped.append(f"{target.name} (woken {now - memory.woken_at[target.name]:.0f} s ago)")
        else:
            candidates.append(target)
    if not candidates:
        why = f"queue {reading.queue} for {now - since:.1f} s, no host to wake"
        return memory, None, why + (": " + ", ".join(skipped) if skipped else "")
    # The host woken longest ago (never woken first), then by name: a fair turn among sleepers.
    chosen = min(candidates, key=lambda t: (memory.woken_at.get(t.name, float("-inf")), t.name))
    woken = {**memory.woken_at, chosen.name: now}
    why = f"queue {reading.queue} for {now - since:.1f} s: waking {chosen.name} ({chosen.mac})"
    return replace(memory, woken_at=woken, booting={**booting, chosen.name: now}, queued_since=None), chosen, why
