"""One deploy run per host at a time: the host lock (``layout.HOST_LOCK_FILE``, root's).

Two runs on one host (two people, or a rollout and a hand run) would otherwise interleave: the
later run's plan is made from facts the earlier run is about to change, and each reports a
state that is not the one serving. So a run takes the host's lock *before it reads the facts
it acts on* (while pyinfra prepares the host, the deploy's first step), renews the lease while
it works, and releases it when pyinfra disconnects from the host (at the end of the run, failed
or not). A second run waits, saying who holds the lock, up to ``host_lock_timeout_s``, then
stops that host with one line. A lock left by a cut run is taken over once its holder is
provably gone (the SSH session that took it ended: a killed controller) or its lease ran out
(a connection that died silently stops renewing it).

The decisions are made on the target under an flock (``scripts/host_lock.py``, sent on stdin,
so nothing has to be installed first); this module is the controller's side.
"""

from __future__ import annotations

import base64
import getpass
import json
import os
import re
import secrets
import shlex
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import gevent
from pyinfra.api.state import BaseStateCallback

from facts import batch
from facts.inputs import inputs_of_run
from freetoken_infra.core.layout import CONVERGE_RECORD_FILE, HOST_LOCK_FILE, HOST_LOCK_MUTEX
from freetoken_infra.core.pyinfra_internals import (
    callback_handler,
    changed_operations,
    connection_lost,
    is_active,
    operations_ran,
    use_upload_dir,
)
from freetoken_infra.core.records import Refusal, Unchanged
from freetoken_infra.core.redact import mask_text, redact_command

SCRIPT_SOURCE = Path(__file__).resolve().parent / "scripts" / "host_lock.py"
# A run renews its lease every LEASE_S / 4 seconds; a holder that stopped renewing (its
# connection died silently) blocks the host for at most LEASE_S.
LEASE_S = 120.0
POLL_S = 2.0
HELD_EXIT = 3
UNCHANGED_EXIT = 5
_RUN_STARTED = time.time()


def redacted_command(argv: list[str]) -> str:
    """The controller's command line for the lock's holder, its secrets masked
    (core.redact.redact_argv: password/key/token options, URL passwords, secret --data values)
    before it is written anywhere (the lock file, the target's process list, the doctor)."""
    return redact_command(argv)


def _shown_command(command: Any) -> str:
    """A holder's command as shown: masked again, since a lock file an older release wrote (or a
    hand-edited one) may hold a secret."""
    text = str(command)
    try:
        return redact_command(shlex.split(text)) if text.strip() else text
    except ValueError:
        return mask_text(text)


def holder_info(token: str, argv: list[str] | None = None) -> dict[str, Any]:
    """Who this run is: controller host, user, process, start time, command, token."""
    return {
        "controller": socket.gethostname(),
        "user": getpass.getuser(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(_RUN_STARTED)),
        "command": redacted_command(sys.argv if argv is None else argv),
        "token": token,
    }


def describe(holder: Mapping[str, Any] | None) -> str:
    """``alice@laptop (pid 4242) since 2026-12-03 07:45:01 UTC: pyinfra -y ...``"""
    if not holder:
        return "nobody"
    return (
        f"{holder.get('user', '?')}@{holder.get('controller', '?')} (pid {holder.get('pid', '?')}) "
        f"since {holder.get('started', '?')}: {_shown_command(holder.get('command', '?'))}"
    )


@dataclass(frozen=True)
class Record:
    """What a release writes as the host's record (scripts/host_lock.py ``write_record``): the
    run's fingerprint, the inputs of every fact it read (facts/inputs.py) and, for a host the
    preflight refused until its next boot, the blockers that refused it."""

    fingerprint: str
    inputs: dict[str, list[str]]
    refused: tuple[Refusal, ...] = ()


def lock_command(
    action: str,
    *,
    holder: Mapping[str, Any] | None = None,
    token: str | None = None,
    lease_s: float = LEASE_S,
    upload_dir: str | None = None,
    unchanged_if: str | None = None,
    record: Record | None = None,
) -> str:
    """The target-side command; the script itself comes on stdin (``python3 -``).

    ``unchanged_if`` (take): the controller's fingerprint, answered with "unchanged" when the
    converge record stands; ``record`` (release): written before the lock is released."""
    # -I -S: none of the environment's PYTHON* variables, no site-packages (the script is stdlib only)
    argv = ["python3", "-I", "-S", "-", action, "--lock-file", HOST_LOCK_FILE, "--mutex", HOST_LOCK_MUTEX]
    if unchanged_if is not None:
        argv += ["--record", CONVERGE_RECORD_FILE, "--unchanged-if", unchanged_if]
    if record is not None:
        encoded = base64.b64encode(json.dumps(record.inputs, sort_keys=True).encode()).decode()
        argv += ["--record", CONVERGE_RECORD_FILE, "--fingerprint", record.fingerprint, "--inputs", encoded]
        if record.refused:
            outcome = {"refused": [list(finding) for finding in record.refused]}
            argv += ["--outcome", base64.b64encode(json.dumps(outcome).encode()).decode()]
    if action in ("take", "renew"):
        argv += ["--lease", f"{lease_s:g}"]
    if holder is not None:
        argv += ["--holder", base64.b64encode(json.dumps(dict(holder)).encode()).decode()]
    if token is not None:
        argv += ["--token", token]
    if upload_dir is not None:
        argv += ["--upload-dir", upload_dir]
    return " ".join(shlex.quote(a) for a in argv)


# The run's private upload folder, as the lock script makes it (scripts/host_lock.py): only this
# shape is taken from the host's answer.
UPLOAD_PREFIX = "/tmp/freetoken-upload-"
UPLOAD_DIR_RE = re.compile(re.escape(UPLOAD_PREFIX) + r"[A-Za-z0-9_]{8,32}")


def _last_json(lines: list[str]) -> dict[str, Any] | None:
    for line in reversed(lines):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return None


class HostLockKeeper(BaseStateCallback):
    """Renews the leases of the locks this run holds and releases them at disconnect."""

    def __init__(self) -> None:
        self.tokens: dict[str, str] = {}
        self.renewers: dict[str, Any] = {}
        self.elevation: dict[str, dict[str, Any]] = {}
        self.upload_dirs: dict[str, str] = {}
        self.fingerprints: dict[str, str] = {}  # hosts whose converge is recorded at release
        self.refusals: dict[str, tuple[Refusal, ...]] = {}  # hosts refused until their next boot

    @classmethod
    def of(cls, state) -> HostLockKeeper:
        return callback_handler(state, cls)

    def hold(self, host, token: str, elevation: Mapping[str, Any], lease_s: float) -> None:
        self.tokens[host.name] = token
        self.elevation[host.name] = dict(elevation)
        self.renewers[host.name] = gevent.spawn(self._renew, host, token, lease_s)

    def _renew(self, host, token: str, lease_s: float) -> None:
        script = SCRIPT_SOURCE.read_text()
        while True:
            gevent.sleep(lease_s / 4)
            try:
                ok, output = host.run_shell_command(
                    lock_command("renew", token=token, lease_s=lease_s), _stdin=script, **self.elevation[host.name]
                )
            except Exception:  # the connection is gone: the lease runs out by itself
                return
            if not ok and (_last_json(output.stdout_lines) or {}).get("renewed") is False:
                click.echo(
                    f"    [{host.name}] the host lock was taken over by another run "
                    f"({describe((_last_json(output.stdout_lines) or {}).get('holder'))})",
                    err=True,
                )
                return

    def record_at_release(self, host, fingerprint: str | None, refused: tuple[Refusal, ...] | None = ()) -> None:
        """Write the converge record when this host's lock is released, if its run executed its
        operations and none failed (``converge_record``); ``refused``: the host stops here, refused
        by these blockers until its next boot, and the record says so (``refusal_record``). No
        fingerprint (a run without the fast check) or ``refused`` None: no record."""
        if fingerprint is None or refused is None:
            return
        self.fingerprints[host.name] = fingerprint
        if refused:
            self.refusals[host.name] = tuple(refused)

    def host_disconnect(self, state, host) -> None:  # type: ignore[override]  # pyinfra's is static
        renewer = self.renewers.pop(host.name, None)
        fingerprint = self.fingerprints.pop(host.name, None)
        refused = self.refusals.pop(host.name, ())
        if renewer is not None:
            renewer.kill()
        token = self.tokens.pop(host.name, None)
        upload_dir = self.upload_dirs.pop(host.name, None)
        if connection_lost(host):
            return
        if token is None:
            if upload_dir is not None:  # made by private_uploads, as the SSH user: removed so
                try:
                    host.run_shell_command(f"rm -rf -- {shlex.quote(upload_dir)}")
                except Exception:  # best effort: a 0700 folder of the SSH user's in /tmp
                    pass
            return
        if not fingerprint:
            record = None
        elif refused:
            record = refusal_record(state, host, fingerprint, refused)
        else:
            record = converge_record(state, host, fingerprint)
        try:
            _, output = host.run_shell_command(
                lock_command("release", token=token, upload_dir=upload_dir, record=record),
                _stdin=SCRIPT_SOURCE.read_text(),
                **self.elevation.get(host.name, {}),
            )
        except Exception:  # best effort: the holder's session ends with the run, which frees it
            return
        if fingerprint:
            recorded = (_last_json(output.stdout_lines) or {}).get("recorded")
            batch.set_expects_record(host, isinstance(recorded, int))


def converge_record(state, host, fingerprint: str) -> Record | None:
    """What the release writes as the host's converge record: the fingerprint and the inputs of
    every fact this run read (facts/inputs.py). None (the record stays removed, as the take left
    it) unless the run executed its operations, the host is still in it and none of them changed
    anything, and every fact it read has known inputs.

    Only a run that found nothing to do records: the facts it read are then exactly those the
    next run reads on the same host (a run that changes something reads what it found before:
    a check it skipped because an earlier one already failed is no input of its record). So the
    run after a converge that changed something reads every fact once more and records."""
    if not operations_ran(state) or not is_active(state, host) or changed_operations(state, host):
        return None
    return _record(state, host, fingerprint)


def refusal_record(state, host, fingerprint: str, refused: tuple[Refusal, ...]) -> Record | None:
    """The record of a host the preflight refused by blockers that stand until its next boot
    (rules.Finding.standing): while every input of the facts this run read reads as then, the
    next run answers with the same refusal from the record, without reading a fact. Written
    whether or not the run got as far as other hosts' operations: the refusal was decided from
    the facts it read, before anything on the host changed."""
    return _record(state, host, fingerprint, refused)


def _record(state, host, fingerprint: str, refused: tuple[Refusal, ...] = ()) -> Record | None:
    read = batch.read_this_run(state, host)
    if not read:
        return None
    inputs = inputs_of_run(read)
    if isinstance(inputs, str):
        click.echo(f"    [{host.name}] no converge record: {inputs}; the next run reads every fact", err=True)
        return None
    return Record(fingerprint, inputs.to_json(), refused)


REFUSAL_MAX = 8  # blockers in a record's refusal, and characters in each of their texts:
REFUSAL_TEXT_MAX = 2000  # beyond, or not of this shape, the record is not taken at its word


def refusal_of(outcome: Any) -> tuple[Refusal, ...] | None:
    """The blockers a record's ``outcome`` names (``()``: none, a converge's record); None when
    the host's answer is not of the shape this controller's release writes (the next run then
    reads every fact rather than trust it)."""
    if outcome is None:
        return ()
    refused = outcome.get("refused") if isinstance(outcome, dict) and set(outcome) == {"refused"} else None
    if not isinstance(refused, list) or not 0 < len(refused) <= REFUSAL_MAX:
        return None
    out = []
    for item in refused:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and all(isinstance(text, str) and len(text) <= REFUSAL_TEXT_MAX for text in item)
            and re.fullmatch(r"[a-z][a-z0-9_]{0,39}", item[0])
        ):
            return None
        out.append((item[0], item[1], item[2]))
    return tuple(out)


Run = Callable[[str, str, Mapping[str, Any]], "tuple[bool, list[str]] | None"]


def take(
    state,
    host,
    timeout_s: float,
    elevation: Mapping[str, Any] | None = None,
    lease_s: float = LEASE_S,
    argv: list[str] | None = None,
    run: Run | None = None,
    unchanged_if: str | None = None,
) -> str | Unchanged | None:
    """Take ``host``'s lock for this run, waiting up to ``timeout_s`` for another run's.

    Returns None once held (renewed in the background, released at disconnect), else the one
    line that says why not (the caller stops the host with it). Prints who holds the lock while
    it waits, and whose lock it took over.

    ``unchanged_if``: this run's fingerprint (``preflight.fingerprint``). When the host's converge
    record names it and every input it lists reads as then, nothing is taken and ``Unchanged`` is
    returned (the no-op fast check, in the same round trip); the lock is free at that moment.

    ``run(command, script, elevation)`` makes the round trip (the deploy reads its facts in the
    same one, after the lock is held: ``facts/batch.prefetch``) and returns ``(exited 0, output
    lines)``; by default the command runs alone. Without ``elevation`` the first try runs as the
    SSH user; when that is not root, the lock is asked for again through sudo, and that
    elevation is the one ``run`` is given from then on.
    """
    elevation = dict(elevation or {})
    keeper = HostLockKeeper.of(state)
    token = secrets.token_hex(16)
    holder = holder_info(token, argv)
    script = SCRIPT_SOURCE.read_text()
    deadline = time.monotonic() + timeout_s
    announced = None
    while True:
        command = lock_command("take", holder=holder, lease_s=lease_s, unchanged_if=unchanged_if)
        result = (run or _run_alone(host))(command, script, elevation)
        ok, lines = result if result is not None else (False, [])
        doc = _last_json(lines) or {}
        if doc.get("unchanged") is True and isinstance(doc.get("inputs"), int):
            refused = refusal_of(doc.get("outcome"))
            if refused is not None:
                batch.set_expects_record(host, True)
                return Unchanged(host.name, doc["inputs"], refused)
            # A record this controller would not write: read every fact (nothing was taken).
            click.echo(
                f"    [{host.name}] reading every fact: its record's outcome is not one this deploy writes", err=True
            )
            unchanged_if = None
            continue
        if ok and doc.get("taken"):
            if unchanged_if is not None and isinstance(doc.get("fast_check"), str):
                click.echo(f"    [{host.name}] reading every fact: {mask_text(doc['fast_check'])}", err=True)
            if doc.get("took_over"):
                click.echo(
                    f"    [{host.name}] took over the host lock ({doc.get('why')}) from {describe(doc['took_over'])}",
                    err=True,
                )
            keeper.hold(host, token, elevation, lease_s)
            upload_dir = doc.get("upload_dir")
            if isinstance(upload_dir, str) and UPLOAD_DIR_RE.fullmatch(upload_dir):
                # Through sudo: pyinfra uploads through this run's own 0700 folder, not /tmp.
                keeper.upload_dirs[host.name] = upload_dir
                use_upload_dir(host, upload_dir)
            return None
        if doc.get("need_root") and not elevation:
            elevation = {"_sudo": True}
            continue
        if doc.get("taken") is not False:
            tail = " / ".join(lines[-3:]) or "no output"
            return f"cannot take the host lock: {tail}"
        who = describe(doc.get("holder"))
        if time.monotonic() >= deadline:
            return f"the host lock is held by {who}; gave up after {timeout_s:g} s (host_lock_timeout_s)"
        if who != announced:
            click.echo(f"    [{host.name}] waiting for the host lock, held by {who} (up to {timeout_s:g} s)", err=True)
            announced = who
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


@dataclass(frozen=True)
class Round:
    """The deploy's first round trip on a host (``first_round``): the lock is held and the facts
    read (both None), the host's record stood (``unchanged``: nothing read, nothing taken), or
    the one line that says why the host stops (``refused``)."""

    refused: str | None = None
    unchanged: Unchanged | None = None


def first_round(state, host, timeout_s: float, fingerprint: str | None) -> Round:
    """The host lock and, in the same round trip, the no-op fast check and every fact this host's
    last run read (facts/batch.py). ``fingerprint``: this run's (None: no fast check). When the
    host's last run left a record the lock's command goes alone (the check most likely answers,
    and the facts would only cost their text on the wire); the facts then follow in one more
    round trip. Operations need root: a workstation user's run goes through sudo, which the
    lock's first try finds out (``take``)."""
    alone = fingerprint is not None and batch.expects_record(host)

    def run(command: str, script: str, elevation: Mapping[str, Any]) -> tuple[bool, list[str]] | None:
        if elevation.get("_sudo"):
            host.data._sudo = True
        if not alone:
            return batch.prefetch(state, host, first=(command, script))
        ok, output = host.run_shell_command(command, _stdin=script, print_output=False, print_input=False, **elevation)
        return ok, list(output.output_lines)

    elevation = {"_sudo": True} if host.data.get("_sudo") else {}
    taken = take(state, host, timeout_s, elevation, run=run, unchanged_if=fingerprint)
    if isinstance(taken, Unchanged):
        return Round(unchanged=taken)
    if taken is not None:
        return Round(refused=taken)
    if alone:
        batch.prefetch(state, host)  # the lock is held: every fact the last run read, in one command
    # A fact batch cut at its deadline: the host stops with the line naming the fact that hung;
    # the lock it holds is released at disconnect.
    cut = batch.cut_short(state, host)
    if cut:
        return Round(refused=cut)
    if alone and connection_lost(host):  # as when it drops in the lock's own round trip: one line
        return Round(refused="connection lost")
    return Round()


def private_uploads(state, host) -> None:
    """For a deploy that takes no host lock (deploys/gateway.py): when the host's operations go
    through sudo, make this run's own upload folder now, as the SSH user (``mktemp -d``: 0700,
    an unpredictable name), upload through it, and remove it at disconnect."""
    if not host.data.get("_sudo"):
        return
    ok, output = host.run_shell_command(f"mktemp -d {UPLOAD_PREFIX}XXXXXXXX", _sudo=False)
    path = output.stdout_lines[-1].strip() if ok and output.stdout_lines else ""
    if not UPLOAD_DIR_RE.fullmatch(path):
        raise OSError(f"{host.name}: cannot make a private upload folder (mktemp -d: {path or 'no output'})")
    HostLockKeeper.of(state).upload_dirs[host.name] = path
    use_upload_dir(host, path)


def _run_alone(host) -> Run:
    def run(command: str, script: str, elevation: Mapping[str, Any]) -> tuple[bool, list[str]]:
        ok, output = host.run_shell_command(command, _stdin=script, **elevation)
        return ok, list(output.output_lines)

    return run
