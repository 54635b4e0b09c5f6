"""Batched facts: many fact commands in one remote round trip, each parsed by its own fact.

pyinfra 3 runs one remote command per ``host.get_fact`` call and caches nothing, so a no-op
converge paid ~75 SSH round trips per host (benchmark: ``bench/converge.py``). Two things
here cut that to a handful, without changing what any fact or operation sees:

1. **Batches.** ``run_batch`` joins the commands of several facts into one shell command
   (each in its own subshell, its stdout and then its exit status base64-encoded between
   ``@@ftbatch:`` marker lines, so that no remote text can forge a marker) and hands every
   fact exactly the stdout lines it would have got alone, to its own ``process()``. A
   sub-command that exits non-zero, or a fact that cannot be batched (preconditions, a custom
   shell, ``batchable = False`` such as the GPU memory probe), is left out and fetched the
   normal way, so pyinfra's error handling is unchanged.

2. **A memo, valid until the host runs something.** pyinfra 3 reads an operation's facts when
   the operation executes. Reading a fact twice with nothing run on the host in between gives
   the same answer, so the memo answers it (a deep copy) instead of asking the host again. Any
   command an operation runs on the host (``Host.run_shell_command``, ``put_file``,
   ``get_file``, callbacks included) clears the host's memo: after a change every fact is read
   live again. In a no-op run nothing is run, so every fact comes from the first batch.
   Which facts a host's run asked for is remembered on the controller
   (``$XDG_CACHE_HOME/freetoken-infra/fact-requests/``: fact names and arguments, never
   values); the next run's ``prefetch`` fetches all of them in one batch. Values are always
   read from the host in the current run; only the list of questions is reused. A stale list
   costs a few extra lines of output, a missing entry one normal round trip (and is learned
   for next time); at the end of a host's run that did not fail, the list becomes what that
   run asked, so a question no longer asked leaves it.
   The list is a file on the controller that someone else may have written, and its questions
   run as root on the host, so it is data checked against an allow-list (``allowed``): facts of
   our own ``facts`` package and the few pyinfra facts the deploy reads (never ``Command`` or
   another fact that runs a command it is given), each argument checked for its shape (an
   absolute path, a name, an address, a port), run with this run's own connector arguments.
   Anything else in the file is dropped with one warning line; the run goes on as if it had
   not been learned.

3. **A deadline.** A batch's facts run under coreutils ``timeout`` (``DEADLINE_S`` in all,
   ``$FREETOKEN_FACT_BATCH_DEADLINE_S`` to change it): a fact that never ends (a FIFO planted
   where a fact reads, a hung program) is killed with the rest of the batch's process group,
   and the batch says so. Each fact's section starts with its marker before the fact runs, so
   the cut output names the fact that was running (``batch_cut``). ``prefetch`` keeps that one
   line for the host (``cut_short``); the deploy and the preflight stop the host with it (the
   lock, taken before, is released at disconnect as for any stopped host), and no fact the
   batch did not answer is read again on that host in this run (it could hang as long again).

``FREETOKEN_FACT_BATCH=0`` turns off the first two (every fact is its own command, as in plain
pyinfra).
"""

from __future__ import annotations

import base64
import binascii
import copy
import functools
import hashlib
import importlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from pyinfra.api.command import StringCommand
from pyinfra.api.facts import FactBase, ShortFactBase
from pyinfra.api.state import BaseStateCallback
from pyinfra.facts.server import Command

from facts import registry
from facts._declare import Shape
from facts.pyinfra_reads import PYINFRA_READS
from freetoken_infra.core import pyinfra_internals

BATCH_MARKER = "@@ftbatch:"
ENV_SWITCH = "FREETOKEN_FACT_BATCH"
# Every batch's facts end within this many seconds in all (a no-op converge's batch takes a few;
# the slowest facts are bounded by their own, shorter timeouts: Windows programs 30 s each).
DEADLINE_S = 300
DEADLINE_ENV = "FREETOKEN_FACT_BATCH_DEADLINE_S"
KILL_AFTER_S = 5  # after the deadline's TERM, KILL to whatever ignored it
_CUT = "cut "
MAX_LEARNED = 300
# Connector arguments that make a request unfit to remember (secrets, environments, what an
# operation feeds a command on stdin); any other argument named like a password too.
_NEVER_WRITTEN = ("_sudo_password", "_su_password", "_env", "_stdin")
# pyinfra's own sentinel for "the fact's required command is missing" (pyinfra.api.facts).
_MISSING = "__pyinfra_missing_command__"

# --------------------------------------------------------------------------- the allow-list
# What a learned list may name. An argument's shape is checked by its name; a fact argument
# whose name has no shape makes the request one that is never written down nor replayed.
# Each fact declares its arguments' shapes beside itself (``argument_shapes``, facts/_declare.py);
# this is their union over the facts package and facts/pyinfra_reads.py (facts/registry.py).


class _ArgumentShapes(Mapping[str, Shape]):
    """``argument name -> shape``, derived from the facts' declarations on first use (the
    registry imports every fact module, this one included, so it cannot at import)."""

    def __getitem__(self, name: str) -> Shape:
        return registry.argument_shapes()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(registry.argument_shapes())

    def __len__(self) -> int:
        return len(registry.argument_shapes())


ARGUMENT_SHAPES: Mapping[str, Shape] = _ArgumentShapes()
# The pyinfra facts the deploy's operations read (facts/pyinfra_reads.py): reads of a path, a
# program's name or unit names. Not Command, not any fact that runs what it is given.
PYINFRA_FACTS = frozenset(PYINFRA_READS)
_OUR_FACT_RE = re.compile(r"facts\.[a-z][a-z0-9_]*:[A-Z][A-Za-z0-9]*")
# Connector arguments that may differ from the run's own between runs: whether the run went
# through sudo, and the run's private upload folder (operations/host_lock.py).
_RUN_VARIES = ("_sudo", "_temp_dir")


def allowed(fact: Any, kwargs: Any) -> str | None:
    """Why a learned request naming ``fact`` ("module:Class") with ``kwargs`` may not be run
    (None: it may)."""
    if not isinstance(fact, str) or not (fact in PYINFRA_FACTS or _OUR_FACT_RE.fullmatch(fact)):
        return f"{fact!r} is not a fact the deploy reads"
    if not isinstance(kwargs, dict):
        return f"{fact}: arguments {kwargs!r} are not named arguments"
    for name, value in kwargs.items():
        shape = ARGUMENT_SHAPES.get(name)
        if shape is None or not shape(value):
            return f"{fact}: argument {name}={value!r} is not an expected {name}"
    return None


def _fact_class(fact: str) -> type | None:
    """The class a fact name of the allow-list names: defined in that very module (a name a
    module merely imports, such as ``facts.batch:Command``, is not taken)."""
    module_name, _, name = fact.partition(":")
    try:
        fact_cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return None
    if not isinstance(fact_cls, type) or fact_cls.__module__ != module_name or not batchable(fact_cls):
        return None
    return fact_cls


# --------------------------------------------------------------------------- pure parts


def deadline_s() -> int:
    """The batch's deadline: ``$FREETOKEN_FACT_BATCH_DEADLINE_S`` when it is a positive whole
    number of seconds, else ``DEADLINE_S``."""
    text = os.environ.get(DEADLINE_ENV, "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else DEADLINE_S


def batch_command(commands: list[str], first: str | None = None, deadline: int | None = None) -> str:
    """One shell command running each of ``commands`` in its own subshell.

    Output: for each command ``i``, a line ``@@ftbatch:i``, then base64 lines of what the
    command printed followed by ``\n@@ftbatch:rc STATUS\n`` (encoded with it), then a line
    ``@@ftbatch:end i``. Everything a command prints travels encoded: a fact's output may hold
    text the host does not control (a ``/health`` body, journal lines, file names), and no byte
    of it can end its own section or forge another fact's (base64 has no ``@`` and no newline
    of its own making). The status line comes after the command ended, so it is always the
    last line of the decoded text.

    With ``deadline`` (seconds), the commands run in one ``sh`` under ``timeout -k 5 DEADLINE``
    (their text on its stdin, a here-document: no argument grows); when it kills them, a line
    ``@@ftbatch:cut DEADLINE`` follows what they printed, and the section of the command that
    was running has its start line and no end (``batch_cut``).

    With ``first``, that command runs before the others (its stdout and stderr in section
    ``len(commands)``, printed first) and the others run only when it exits 0: the host lock
    is taken in the same round trip as the facts it guards. ``first`` may read the batch's
    stdin; the facts never do. The deadline is the facts' alone: ``first``'s answer (the lock
    taken) always comes back.
    """
    parts = []
    for index, command in enumerate(commands):
        parts.append(
            f"echo '{BATCH_MARKER}{index}'; "
            f"( ( {command}\n) </dev/null; printf '\\n{BATCH_MARKER}rc %s\\n' \"$?\" ) | base64; "
            f"echo '{BATCH_MARKER}end {index}'"
        )
    body = "; ".join(parts) + "; true" if parts else "true"
    if deadline is not None and parts:
        end = "FT_BATCH_" + hashlib.sha256(body.encode()).hexdigest()[:16]
        body = (
            f"timeout -k {KILL_AFTER_S} {int(deadline)} sh <<'{end}'\n{body}\n{end}\n"
            f'ft_rc=$?; if [ "$ft_rc" = 124 ] || [ "$ft_rc" = 137 ]; then '
            f"echo '{BATCH_MARKER}{_CUT}{int(deadline)}'; fi; true"
        )
    if first is None:
        return body
    n = len(commands)
    # $(...) drops the final newline, printf puts it back; the status line is ours and last, so
    # nothing ``first`` prints can make the facts run.
    return (
        f"ft_first=$( ( {first}\n) 2>&1; printf '\\n{BATCH_MARKER}rc %s\\n' \"$?\" ); "
        f"echo '{BATCH_MARKER}{n}'; printf '%s\\n' \"$ft_first\" | base64; echo '{BATCH_MARKER}end {n}'; "
        f"case \"$ft_first\" in *'{BATCH_MARKER}rc 0')\n{body}\n;; esac; true"
    )


def batch_cut(lines: list[str]) -> tuple[int, int | None] | None:
    """``(deadline, index of the command that was running)`` when the batch was cut at its
    deadline (the index None when none had started), else None."""
    running: int | None = None
    for line in lines:
        if line.startswith(BATCH_MARKER + "end "):
            running = None
        elif line.startswith(BATCH_MARKER) and line[len(BATCH_MARKER) :].isdigit():
            running = int(line[len(BATCH_MARKER) :])
        elif line.startswith(BATCH_MARKER + _CUT):
            seconds = line[len(BATCH_MARKER) + len(_CUT) :].strip()
            return (int(seconds) if seconds.isdigit() else 0), running
    return None


def _decoded_section(encoded: list[str]) -> tuple[int | None, list[str]] | None:
    """``(status, stdout lines)`` from one command's base64 section; None when it is broken."""
    try:
        text = base64.b64decode("".join(line.strip() for line in encoded), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    body, sep, tail = text.rpartition(f"\n{BATCH_MARKER}rc ")
    if not sep or not tail.endswith("\n") or "\n" in tail[:-1]:
        return None
    try:
        status: int | None = int(tail.strip())
    except ValueError:
        status = None
    # The lines pyinfra gives for the command alone: split at "\n", no empty line after a
    # final newline (pyinfra.connectors.util.read_buffer strips each line's "\n" only).
    lines = body.split("\n")
    if lines[-1] == "":
        lines.pop()
    return status, lines


def split_batch_output(lines: list[str]) -> dict[int, tuple[int | None, list[str]]]:
    """``index -> (exit status, stdout lines as pyinfra would give them for the command alone)``.

    A command whose section never ended (the batch was cut short) or does not decode is absent.
    """
    out: dict[int, tuple[int | None, list[str]]] = {}
    current: int | None = None
    encoded: list[str] = []
    for line in lines:
        if line.startswith(BATCH_MARKER + "end "):
            if current is not None and line[len(BATCH_MARKER) + 4 :].strip() == str(current):
                section = _decoded_section(encoded)
                if section is not None:
                    out[current] = section
            current, encoded = None, []
        elif line.startswith(BATCH_MARKER) and line[len(BATCH_MARKER) :].isdigit():
            current, encoded = int(line[len(BATCH_MARKER) :]), []
        elif current is not None:
            encoded.append(line)
    return out


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class FactRequest:
    """One fact read: the class, its arguments as pyinfra normalises them, and the connector
    arguments (sudo and the like) it runs with."""

    cls: type
    fact_kwargs: tuple  # sorted (name, value) pairs
    executor: tuple  # sorted (name, value) pairs, connector arguments only

    @property
    def key(self) -> str:
        return json.dumps(
            [_class_path(self.cls), list(self.fact_kwargs), list(self.executor)], sort_keys=True, default=repr
        )

    def to_json(self, one_off: Iterable[Any] = ()) -> dict | None:
        """The request as remembered on the controller; None for one that is not plain data,
        carries what must never be written down (a password, an environment, stdin), or whose
        arguments hold one of ``one_off`` (this run's ``--data`` values: a path given for one
        run is not a question for the next)."""
        executor = dict(self.executor)
        if any(executor.get(k) for k in _NEVER_WRITTEN) or any("password" in k and v for k, v in executor.items()):
            return None
        if _holds_any(dict(self.fact_kwargs), list(one_off)):
            return None
        executor.pop("_temp_dir", None)  # this run's own upload folder: nothing to remember
        doc = {"fact": _class_path(self.cls), "kwargs": dict(self.fact_kwargs), "executor": executor}
        if allowed(doc["fact"], doc["kwargs"]) is not None:
            return None  # never written: it would be dropped, with a warning, when read back
        try:
            if json.loads(json.dumps(doc)) != doc:
                return None
        except (TypeError, ValueError):
            return None
        return doc

    @classmethod
    def from_json(cls, doc: Any, executor: tuple) -> FactRequest | str:
        """The request a learned entry stands for, run with ``executor`` (this run's connector
        arguments), or why it is dropped: not on the allow-list (``allowed``), or remembered with
        connector arguments other than this run's (a shell, a user, an environment...)."""
        if not isinstance(doc, dict):
            return f"{doc!r} is not a fact request"
        fact, kwargs = doc.get("fact"), doc.get("kwargs") or {}
        why = allowed(fact, kwargs)
        if why is not None:
            return why
        fact_cls = _fact_class(str(fact))
        if fact_cls is None:
            return f"{fact!r} is not a fact the deploy reads"
        ours = dict(executor)
        learned = doc.get("executor")
        if (
            not isinstance(learned, dict)
            or not all(learned.get(k) == v for k, v in ours.items() if k not in _RUN_VARIES)
            or set(learned) - set(ours) - set(_RUN_VARIES)
        ):
            return f"{fact}: connector arguments other than this run's"
        if not isinstance(learned.get("_sudo", False), bool):
            return f"{fact}: connector arguments other than this run's"
        return cls(fact_cls, tuple(sorted(kwargs.items())), tuple(sorted(ours.items())))


def _holds_any(value: Any, needles: list[Any]) -> bool:
    """Whether ``value`` (nested lists and dicts) holds one of ``needles``: a string needle as
    a part of a string, any other needle (a number) as an equal value."""
    if isinstance(value, dict):
        return any(_holds_any(v, needles) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_any(v, needles) for v in value)
    for needle in needles:
        if isinstance(needle, str):
            if isinstance(value, str) and needle in value:
                return True
        elif value == needle and type(value) is type(needle):
            return True
    return False


def one_off_values(host) -> list[Any]:
    """This run's ``--data KEY=VALUE`` values (pyinfra's override data): strings of two or more
    characters and numbers; booleans say nothing about a request."""
    inventory = getattr(host, "inventory", None)
    data = inventory.get_override_data() if inventory is not None else {}
    values: list[Any] = []
    for value in (data or {}).values():
        if isinstance(value, str) and len(value) >= 2:
            values.append(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            values.append(value)
    return values


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def batchable(cls: Any) -> bool:
    return (
        isinstance(cls, type)
        and issubclass(cls, FactBase)
        and not issubclass(cls, ShortFactBase)
        and getattr(cls, "batchable", True)
        and not getattr(cls, "shell_executable", None)
    )


def make_request(state, host, cls: type, args, kwargs) -> FactRequest:
    """Normalise a ``get_fact`` call the way pyinfra does (pyinfra.api.facts._get_fact)."""
    fact_kwargs, global_kwargs = pyinfra_internals.handle_fact_kwargs(
        state, host, cls, list(args or ()), dict(kwargs or {})
    )
    fact_kwargs = {k: v for k, v in fact_kwargs.items() if k != "self"}
    connector_keys = pyinfra_internals.connector_argument_keys()
    executor = {k: v for k, v in global_kwargs.items() if k in connector_keys}
    return FactRequest(cls, tuple(sorted(fact_kwargs.items())), tuple(sorted(executor.items(), key=lambda kv: kv[0])))


def _sub_command(fact: FactBase, request: FactRequest, state, host) -> str | None:
    """The shell text of one fact's command, as pyinfra would run it; None: not batchable."""
    if fact.check_preconditions(state, host):
        return None
    kwargs = dict(request.fact_kwargs)
    command = fact.command(**kwargs) if callable(fact.command) else fact.command
    requires = fact.requires_command(**kwargs) if callable(fact.requires_command) else fact.requires_command
    text = command.get_raw_value() if isinstance(command, StringCommand) else command
    if not isinstance(text, str):
        return None
    if requires:
        req = requires.get_raw_value() if isinstance(requires, StringCommand) else str(requires)
        text = f"if command -v {req} >/dev/null 2>&1; then ( {text}\n); else echo '{_MISSING}'; fi"
    return text


FirstResult = tuple[bool, list[str]]  # (exited 0, its output lines)


def run_batch(
    state, host, requests: list[FactRequest], first: tuple[str, str | None] | None = None
) -> tuple[dict[str, Any], FirstResult | None]:
    """Run the facts of ``requests`` (all with the same connector arguments) in one command.

    Returns ``request.key -> value`` for each fact whose command succeeded, and, with ``first``
    (``(command, its stdin)``, see ``batch_command``), that command's result; the facts ran only
    when it succeeded.
    """
    facts: list[tuple[FactRequest, FactBase, str]] = []
    for request in requests:
        fact = request.cls()
        try:
            text = _sub_command(fact, request, state, host)
        except Exception:  # a fact that cannot build its command here: fetched alone later
            text = None
        if text is not None:
            facts.append((request, fact, text))
    if not facts and first is None:
        return {}, None
    if not host.connected:
        host.connect(reason="to load facts (batched)", raise_exceptions=True)
    executor = dict(requests[0].executor if requests else _plain_executor(state, host))
    if first is not None and first[1] is not None:
        executor["_stdin"] = first[1]
    deadline = deadline_s()
    try:
        status, output = host.run_shell_command(
            StringCommand(
                batch_command([text for _, _, text in facts], first[0] if first else None, deadline=deadline)
            ),
            print_output=False,
            print_input=False,
            **executor,
        )
    except OSError:
        # The session ended while its stdin (the first command's script) was still being written:
        # paramiko raises "Socket is closed" where a session cut a moment later returns a failed
        # command. Nothing was read, as then; the caller sees the connection gone.
        if not pyinfra_internals.wait_connection_lost(host):
            raise
        return {}, (False, []) if first is not None else None
    results = split_batch_output(output.stdout_lines) if status else {}
    cut = batch_cut(output.stdout_lines) if status else None
    if cut is not None:
        seconds, running = cut
        hung = describe(facts[running][0]) if running is not None and running < len(facts) else "none had started"
        _memo_for(
            state, host
        ).cut = f"the fact batch was cut at its {seconds} s deadline ({DEADLINE_ENV}): {hung} did not finish"
    first_result: FirstResult | None = None
    if first is not None:
        rc, lines = results.get(len(facts), (None, None))
        first_result = (rc == 0, lines) if lines is not None else (False, list(output.output_lines))
        if rc != 0:
            return {}, first_result
    values: dict[str, Any] = {}
    for index, (request, fact, _) in enumerate(facts):
        rc, lines = results.get(index, (None, None))
        if rc != 0 or lines is None:
            continue
        if lines == [_MISSING]:
            values[request.key] = fact.default()
            continue
        try:
            values[request.key] = fact.process(lines) if lines else fact.default()
        except Exception:  # the normal path reports a processing error properly
            continue
    return values, first_result


def describe(request: FactRequest) -> str:
    """``facts.model_manifest:ModelManifest(model_dir='/m')``: a request as a line names it."""
    args = ", ".join(f"{k}={v!r}" for k, v in request.fact_kwargs)
    return f"{_class_path(request.cls)}({args})"


def cut_short(state, host) -> str | None:
    """The line that says which fact hung when one of this host's batches was cut at its
    deadline in this run (None: none was). From then on the host's facts are not read: each
    answers its default without a command, and the caller stops the host with this line."""
    memo = _memos.get((id(state), pyinfra_internals.unwrap_context(host).name))
    return memo.cut if memo is not None else None


def _plain_executor(state, host) -> tuple:
    """The connector arguments a fact read without arguments of its own runs with now."""
    return make_request(state, host, Command, (), {"command": "true"}).executor


# --------------------------------------------------------------------------- memo


@dataclass
class _Memo:
    values: dict[str, Any] = field(default_factory=dict)
    learned: list[dict] = field(default_factory=list)
    asked: list[dict] = field(default_factory=list)  # this run's requests, in order
    primed: bool = False
    path: Path | None = None
    reading: int = 0  # > 0 while a fact is being read
    warned: bool = False  # the learned list's dropped entries were reported
    read: list[dict] = field(default_factory=list)  # every fact this run read: name and arguments
    cut: str | None = None  # a batch was cut at its deadline: the line naming the fact that hung


_memos: dict[tuple[int, str], _Memo] = {}
_original_get_fact: Callable[..., Any] | None = None


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def learned_path(host) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    where = str(host.data.get("ssh_hostname") or "")
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{host.name}@{where}")
    return base / "freetoken-infra" / "fact-requests" / f"{name}.json"


def expects_record(host) -> bool:
    """Whether this host's last run on this controller left a converge record (written at its
    release, operations/host_lock.py), so that this run's fast check will likely answer alone.
    A hint only, for how the first round trip is shaped: the host decides."""
    return learned_path(host).with_suffix(".recorded").exists()


def set_expects_record(host, recorded: bool) -> None:
    hint = learned_path(host).with_suffix(".recorded")
    try:
        if recorded:
            hint.parent.mkdir(parents=True, exist_ok=True)
            hint.touch()
        else:
            hint.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only home only costs the next run the facts riding along with its lock


def _load_learned(path: Path) -> list[dict]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(doc, list):
        return []
    # A list an older version wrote may hold what is never written now: it is not used.
    return [d for d in doc if isinstance(d, dict) and not _unfit(d)]


def _unfit(doc: dict) -> bool:
    executor = doc.get("executor")
    return (
        not isinstance(executor, dict)
        or any(executor.get(k) for k in _NEVER_WRITTEN)
        or any("password" in str(k) and v for k, v in executor.items())
    )


def _save_learned(memo: _Memo) -> None:
    if memo.path is None:
        return
    try:
        memo.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo.path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(memo.learned[-MAX_LEARNED:], f, indent=0)
        os.replace(tmp, memo.path)
    except OSError:
        pass  # a read-only home only costs the next run its batch


def _memo_for(state, host) -> _Memo:
    key = (id(state), host.name)
    memo = _memos.get(key)
    if memo is None:
        path = learned_path(host)
        memo = _Memo(path=path, learned=_load_learned(path))
        _memos[key] = memo
    return memo


def _run_first_alone(state, host, first: tuple[str, str | None]) -> FirstResult:
    """``first`` run on its own, as a plain command (batching is off)."""
    executor = dict(_plain_executor(state, host))
    if first[1] is not None:
        executor["_stdin"] = first[1]
    status, output = host.run_shell_command(StringCommand(first[0]), print_output=False, print_input=False, **executor)
    return status, list(output.output_lines)


def _add_learned(state, host, memo: _Memo, requests: dict[str, FactRequest]) -> None:
    """Add what this host's last run asked for to ``requests``; entries that no longer make a
    request are dropped from the memo's list, with one warning per host."""
    plain = _plain_executor(state, host)
    dropped = []
    for doc in memo.learned:
        learned = FactRequest.from_json(doc, plain)
        if isinstance(learned, str):
            dropped.append(learned)
        else:
            requests.setdefault(learned.key, learned)
    if dropped:
        memo.learned = [d for d in memo.learned if not isinstance(FactRequest.from_json(d, plain), str)]
        if not memo.warned:
            memo.warned = True
            click.echo(
                f"    [{host.name}] warning: {len(dropped)} entr{'y' if len(dropped) == 1 else 'ies'} of "
                f"the learned fact list {memo.path} dropped (not run): {'; '.join(dropped[:3])}"
                + (" ..." if len(dropped) > 3 else ""),
                err=True,
            )


def prefetch(
    state, host, wanted: Iterable[tuple[type, dict]] = (), first: tuple[str, str | None] | None = None
) -> FirstResult | None:
    """Read ``wanted`` facts (``(FactClass, kwargs)``) and everything this host's last run
    asked for, in as few commands as there are distinct connector-argument sets (usually one).
    Later ``host.get_fact`` calls for them are answered from the memo until the host runs a
    command that is not a fact read. The first call for a host turns the memo on for it.

    ``first``: ``(command, stdin)`` run before any fact, in the same round trip as the facts
    that run with the host's plain connector arguments; no fact is read unless it exits 0.
    Returns its result (``(exited 0, output lines)``), None without ``first``.
    """
    host = pyinfra_internals.unwrap_context(host)
    state = host.state
    if not enabled():
        return _run_first_alone(state, host, first) if first is not None else None
    install()
    memo = _memo_for(state, host)
    _Forget.of(state)
    requests: dict[str, FactRequest] = {}
    for cls, kwargs in wanted:
        if batchable(cls):
            request = make_request(state, host, cls, (), kwargs)
            requests[request.key] = request
    was_primed = memo.primed
    if not memo.primed:
        memo.primed = True
        _add_learned(state, host, memo, requests)
    groups: dict[str, list[FactRequest]] = {}
    plain_key = json.dumps(list(_plain_executor(state, host)), sort_keys=True, default=repr)
    if first is not None:
        groups[plain_key] = []  # runs first
    for key, request in requests.items():
        if key not in memo.values:
            group_key = json.dumps(list(request.executor), sort_keys=True, default=repr)
            groups.setdefault(group_key, []).append(request)
    first_result = None
    for group_key, group in groups.items():
        if memo.cut is not None and group:
            continue  # a batch was cut: nothing more is read on this host (``cut_short``)
        with _reading(memo):
            values, result = run_batch(state, host, group, first if group_key == plain_key else None)
        memo.values.update(values)
        if result is not None:
            first_result = result
            if not result[0]:  # nothing was read: the next call asks everything again
                memo.primed = was_primed
                break
    return first_result


def _get_fact(self: Any, name_or_cls: Any, *args: Any, **kwargs: Any) -> Any:
    assert _original_get_fact is not None  # install() ran before any host was primed
    state = self.state
    memo = _memos.get((id(state), self.name)) if state is not None else None
    if memo is None or not enabled():  # prefetch() was never called for this host: plain pyinfra
        return _original_get_fact(self, name_or_cls, *args, **kwargs)
    if isinstance(name_or_cls, type):
        read = make_request(state, self, name_or_cls, args, kwargs)
        entry = {"fact": _class_path(read.cls), "kwargs": dict(read.fact_kwargs)}
    else:  # a fact named by a string: nothing facts/inputs.py can know
        entry = {"fact": str(name_or_cls), "kwargs": {}}
    if entry not in memo.read:
        memo.read.append(entry)
    if memo.cut is not None:
        # A batch was cut at its deadline: reading again could hang as long, and the host is
        # stopped with the line that names the fact (``cut_short``). What was read stands.
        cut_request = make_request(state, self, name_or_cls, args, kwargs) if isinstance(name_or_cls, type) else None
        if cut_request is not None and cut_request.key in memo.values:
            return copy.deepcopy(memo.values[cut_request.key])
        default = getattr(name_or_cls, "default", None)
        return default() if callable(default) else None
    if not batchable(name_or_cls):
        with _reading(memo):
            return _original_get_fact(self, name_or_cls, *args, **kwargs)
    request = make_request(state, self, name_or_cls, args, kwargs)
    doc = request.to_json(one_off_values(self))
    if doc is not None and doc not in memo.asked:
        memo.asked.append(doc)
    if doc is not None and doc not in memo.learned:
        memo.learned.append(doc)
        _save_learned(memo)
    if request.key in memo.values:
        return copy.deepcopy(memo.values[request.key])
    with _reading(memo):
        value = _original_get_fact(self, name_or_cls, *args, **kwargs)
    memo.values[request.key] = value
    return copy.deepcopy(value)


def read_this_run(state, host) -> list[dict] | None:
    """Every fact this host's run read, batched or not (``{"fact": "module:Class", "kwargs":
    ...}``), for the converge record (facts/inputs.py); None when it ran without the memo."""
    memo = _memos.get((id(state), host.name))
    if memo is None or not enabled():
        return None
    return list(memo.read)


class _Forget(BaseStateCallback):
    """At the end of a host's run that did not fail, the list kept for its next run becomes
    what this run asked: a question no longer asked (code that changed) leaves it. A failed or
    cut run only adds to it (it may have stopped before asking the rest)."""

    @classmethod
    def of(cls, state) -> None:
        pyinfra_internals.callback_handler(state, cls)

    def host_disconnect(self, state, host) -> None:  # type: ignore[override]  # pyinfra's is static
        memo = _memos.get((id(state), host.name))
        # Not `host in state.failed_hosts`: pyinfra keeps the deploy's context proxies there,
        # which cannot be compared outside the deploy's context; a failed host left active_hosts.
        if memo is None or not memo.asked or not pyinfra_internals.is_active(state, host):
            return
        if memo.learned != memo.asked:
            memo.learned = list(memo.asked)
            _save_learned(memo)


class _reading:
    """Marks the host's remote commands as fact reads (they do not invalidate the memo)."""

    def __init__(self, memo: _Memo):
        self.memo = memo

    def __enter__(self):
        self.memo.reading += 1

    def __exit__(self, *exc):
        self.memo.reading -= 1


def _changing(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a Host method that runs something on the host: unless a fact is being read, the
    host may change, so everything the memo holds for it is forgotten."""

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = getattr(self, "state", None)
        memo = _memos.get((id(state), self.name)) if state is not None else None
        if memo is not None and not memo.reading:
            memo.values.clear()
        return original(self, *args, **kwargs)

    return wrapper


def install() -> None:
    """Route ``Host.get_fact`` through the memo, and make ``Host.run_shell_command``,
    ``put_file`` and ``get_file`` (anything an operation runs) clear it (idempotent). Hosts
    that ``prefetch`` was never called for see plain pyinfra."""
    global _original_get_fact

    if _original_get_fact is None:
        _original_get_fact = pyinfra_internals.host_class().get_fact
        pyinfra_internals.replace_host_method("get_fact", lambda _original: _get_fact)
        for name in pyinfra_internals.HOST_METHODS_THAT_RUN:
            pyinfra_internals.replace_host_method(name, _changing)
