"""facts/batch.py: a batch hands every fact exactly the stdout lines it would have got alone
(real sh, real pyinfra local connector), leaves failures to the normal path, and answers
repeated reads in the prepare stage from one round trip."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from facts import batch
from facts.batch import batch_command, split_batch_output

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real"


def pyinfra_lines(command: str) -> tuple[int, list[str]]:
    """Run as pyinfra's connectors do: ``sh -c``, stdout split into lines, ``\\n`` stripped."""
    proc = subprocess.run(["sh", "-c", command], capture_output=True)
    text = proc.stdout.decode("utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return proc.returncode, lines


COMMANDS = [
    "echo one; echo two",
    "printf 'no final newline'",
    "true",
    "printf 'a\\n\\n\\n'",
    "printf 'crlf line\\r\\nsecond\\r\\n'",
    "echo before; exit 0; echo never",  # facts that end early (WslVersion does)
    "echo partial; exit 3",
    "echo to stderr >&2; echo out",
    f"base64 < {FIXTURES / 'wsl-version-zh.utf16le'}",
    f"cat {FIXTURES / 'nvidia-smi-5060ti.txt'}",
]


def test_every_command_gets_the_lines_and_status_it_gets_alone():
    _, lines = pyinfra_lines(batch_command(COMMANDS))
    split = split_batch_output(lines)
    assert sorted(split) == list(range(len(COMMANDS)))
    for index, command in enumerate(COMMANDS):
        assert split[index] == pyinfra_lines(command), command


def test_a_batch_cut_short_leaves_the_unfinished_commands_out():
    _, lines = pyinfra_lines(batch_command(["echo a", "echo b"]))
    cut = lines[: lines.index("@@ftbatch:1") + 2]  # the second command's status never came
    assert split_batch_output(cut) == {0: (0, ["a"])}


def test_a_first_command_gates_the_facts_and_cannot_forge_its_own_status():
    script = "read line; echo got $line"  # the first command reads the batch's stdin
    proc = subprocess.run(
        ["sh", "-c", batch_command(["echo fact"], first=script)], input=b"lock\n", capture_output=True
    )
    split = split_batch_output(proc.stdout.decode().splitlines())
    assert split == {1: (0, ["got lock"]), 0: (0, ["fact"])}
    # It fails, having printed what its own status line looks like: no fact runs.
    forged = "echo; echo '@@ftbatch:rc 0'; exit 3"
    _, lines = pyinfra_lines(batch_command(["echo fact"], first=forged))
    assert split_batch_output(lines) == {1: (3, ["", "@@ftbatch:rc 0"])}
    _, lines = pyinfra_lines(batch_command(["echo fact"], first="exit 10"))
    assert split_batch_output(lines) == {1: (10, [])}


@pytest.fixture()
def local_prepare(tmp_path, monkeypatch):
    """A real pyinfra State on @local in its prepare stage, counting remote commands."""
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.connect import connect_all
    from pyinfra.api.state import StateStage

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(batch.ENV_SWITCH, "1")
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    connect_all(state)
    state.set_stage(StateStage.Prepare)
    host = inventory.get_host("@local")
    calls = []
    original = host.connector.run_shell_command

    def counting(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(host.connector, "run_shell_command", counting)
    yield state, host, calls
    batch._memos.pop((id(state), host.name), None)


def test_prefetched_facts_equal_unbatched_ones_in_one_command(local_prepare, tmp_path):
    from pyinfra.facts.files import Directory, File
    from pyinfra.facts.server import Command

    from facts.engine import EngineInstall
    from facts.gpu import NvidiaGpus
    from facts.init import InitSystem
    from facts.wsl import WslKernel, WslVersion

    state, host, calls = local_prepare
    (tmp_path / "ft" / "0.2.1").mkdir(parents=True)
    wanted = [
        (WslKernel, {}),
        (WslVersion, {}),
        (NvidiaGpus, {}),
        (InitSystem, {}),
        (EngineInstall, {"base_dir": str(tmp_path / "ft")}),
        (Command, {"command": "id -u"}),
        (File, {"path": "/etc/hostname"}),
        (Directory, {"path": str(tmp_path)}),
        (File, {"path": str(tmp_path / "absent")}),
    ]
    plain = [host.get_fact(cls, **kwargs) for cls, kwargs in wanted]
    assert len(calls) == len(wanted)
    calls.clear()
    batch.prefetch(state, host, wanted)
    batched = [host.get_fact(cls, **kwargs) for cls, kwargs in wanted]
    assert len(calls) == 1
    assert batched == plain
    # Read twice in the prepare stage: still one command, and a copy the caller may change.
    again = host.get_fact(Directory, path=str(tmp_path))
    again["mode"] = "changed"
    assert host.get_fact(Directory, path=str(tmp_path)) == plain[7]
    assert len(calls) == 1


def test_next_run_asks_for_what_this_run_asked_in_its_first_command(local_prepare, tmp_path):
    from pyinfra.facts.files import File

    from facts.resources import HostResources

    state, host, calls = local_prepare
    batch.prefetch(state, host, [])
    host.get_fact(File, path="/etc/hostname")  # not prefetched: its own command, then learned
    host.get_fact(HostResources, path=str(tmp_path))
    assert len(calls) == 2
    learned = batch._load_learned(batch.learned_path(host))
    assert {d["fact"] for d in learned} == {"pyinfra.facts.files:File", "facts.resources:HostResources"}

    batch._memos.pop((id(state), host.name))  # a new run
    calls.clear()
    batch.prefetch(state, host, [])
    host.get_fact(File, path="/etc/hostname")
    host.get_fact(HostResources, path=str(tmp_path))
    assert len(calls) == 1


def test_failed_and_unbatchable_facts_take_the_normal_path(local_prepare):
    from pyinfra.facts.server import Command

    from facts.gpu_memory import GpuMemoryProbe

    state, host, calls = local_prepare
    assert not batch.batchable(GpuMemoryProbe)
    batch.prefetch(state, host, [(GpuMemoryProbe, {}), (Command, {"command": "exit 4"})])
    assert len(calls) == 1 and "python3" not in str(calls[0])  # the probe was not in the batch
    key = batch.make_request(state, host, Command, (), {"command": "exit 4"}).key
    assert key not in batch._memos[(id(state), host.name)].values


def test_a_command_run_on_the_host_makes_the_next_reads_live(local_prepare):
    from pyinfra.api.state import StateStage
    from pyinfra.facts.server import Command

    state, host, calls = local_prepare
    batch.prefetch(state, host, [(Command, {"command": "date +%N"})])
    state.set_stage(StateStage.Execute)
    calls.clear()
    first = host.get_fact(Command, command="date +%N")
    assert calls == []  # nothing ran since the batch: the batch's answer
    host.run_shell_command("true")  # what an operation does
    second = host.get_fact(Command, command="date +%N")
    third = host.get_fact(Command, command="date +%N")
    assert len(calls) == 2 and second != first and third == second


def test_switched_off_it_is_plain_pyinfra(local_prepare, monkeypatch):
    from pyinfra.facts.server import Command

    state, host, calls = local_prepare
    monkeypatch.setenv(batch.ENV_SWITCH, "0")
    batch.prefetch(state, host, [(Command, {"command": "id -u"})])
    assert calls == []
    host.get_fact(Command, command="id -u")
    host.get_fact(Command, command="id -u")
    assert len(calls) == 2


def test_an_unbatchable_read_does_not_end_the_memo(local_prepare):
    from pyinfra.facts.server import Command

    from facts.gpu_memory import GpuMemoryProbe

    state, host, calls = local_prepare
    batch.prefetch(state, host, [(Command, {"command": "id -u"})])
    host.get_fact(GpuMemoryProbe)
    host.get_fact(Command, command="id -u")
    assert len(calls) == 2  # the batch and the probe


def test_a_request_with_a_password_is_never_written_down(local_prepare):
    from pyinfra.facts.files import File

    state, host, _ = local_prepare
    plain = batch.make_request(state, host, File, (), {"path": "/etc/hostname"})
    assert plain.to_json() is not None
    secret = batch.FactRequest(
        plain.cls, plain.fact_kwargs, tuple(sorted({**dict(plain.executor), "_sudo_password": "hunter2"}.items()))
    )
    assert secret.to_json() is None


def test_prefetch_runs_the_first_command_and_the_facts_in_one_round_trip(local_prepare, tmp_path):
    from pyinfra.facts.server import Command

    state, host, calls = local_prepare
    gate = tmp_path / "gate"
    result = batch.prefetch(state, host, [(Command, {"command": "id -u"})], first=(f"cat > {gate}; exit 3", "held\n"))
    assert result == (False, []) and gate.read_text() == "held\n" and len(calls) == 1
    key = batch.make_request(state, host, Command, (), {"command": "id -u"}).key
    assert key not in batch._memos[(id(state), host.name)].values  # gated: no fact was read
    calls.clear()
    result = batch.prefetch(state, host, [(Command, {"command": "id -u"})], first=("echo taken", None))
    assert result == (True, ["taken"]) and len(calls) == 1
    host.get_fact(Command, command="id -u")
    assert len(calls) == 1  # answered by that same round trip


class _Transport:
    """paramiko's transport as its thread leaves it: channels closed first, ``active`` a moment later."""

    def __init__(self, inactive_after_s: float | None):
        self.inactive_at = None if inactive_after_s is None else time.monotonic() + inactive_after_s

    def is_active(self):
        return self.inactive_at is None or time.monotonic() < self.inactive_at


def _cut_while_writing_stdin(monkeypatch, host, inactive_after_s):
    class Client:
        transport = _Transport(inactive_after_s)

        def get_transport(self):
            return self.transport

    def socket_closed(*args, **kwargs):  # what paramiko's Channel.sendall raises on a closed channel
        raise OSError("Socket is closed")

    monkeypatch.setattr(host.connector, "client", Client(), raising=False)
    monkeypatch.setattr(host.connector, "run_shell_command", socket_closed)


def test_a_session_cut_while_the_lock_script_is_written_is_a_lost_connection(local_prepare, monkeypatch):
    """The session ended while pyinfra still wrote the first command's stdin: "Socket is closed"
    is the same outcome as a session cut a moment later (nothing read, the host lock not held),
    not a traceback; the caller then finds the connection gone (tests/fleet/test_interrupted.py)."""
    from pyinfra.facts.server import Command

    from freetoken_infra.core.pyinfra_internals import connection_lost

    state, host, _ = local_prepare
    _cut_while_writing_stdin(monkeypatch, host, inactive_after_s=0.2)
    result = batch.prefetch(state, host, [(Command, {"command": "id -u"})], first=("cat >/dev/null", "script\n"))
    assert result == (False, []) and connection_lost(host)


def test_a_closed_socket_on_a_live_connection_is_not_taken_for_a_cut(local_prepare, monkeypatch):
    from pyinfra.facts.server import Command

    state, host, _ = local_prepare
    _cut_while_writing_stdin(monkeypatch, host, inactive_after_s=None)
    with pytest.raises(OSError, match="Socket is closed"):
        batch.prefetch(state, host, [(Command, {"command": "id -u"})], first=("cat >/dev/null", "script\n"))


def test_a_question_no_longer_asked_leaves_the_list_after_a_run_that_did_not_fail(local_prepare, tmp_path):
    from pyinfra.facts.files import File

    state, host, calls = local_prepare

    def a_run(paths, failed=False):
        batch._memos.pop((id(state), host.name), None)
        batch.prefetch(state, host, [])
        for path in paths:
            host.get_fact(File, path=path)
        if failed:  # as pyinfra fails a host from the deploy: its context proxy in failed_hosts
            from pyinfra import host as proxy
            from pyinfra.context import ctx_host

            with ctx_host.use(host):
                state.failed_hosts.add(proxy)
            state.active_hosts.discard(host)
        for handler in state.callback_handlers:
            handler.host_disconnect(state, host)
        state.active_hosts.add(host)
        state.failed_hosts.clear()
        return [d["kwargs"]["path"] for d in batch._load_learned(batch.learned_path(host))]

    assert a_run(["/etc/hostname", "/etc/passwd"]) == ["/etc/hostname", "/etc/passwd"]
    assert a_run(["/etc/hostname"], failed=True) == ["/etc/hostname", "/etc/passwd"]  # it may have stopped early
    assert a_run(["/etc/hostname"]) == ["/etc/hostname"]
    calls.clear()
    a_run(["/etc/hostname"])
    assert len(calls) == 1  # the pruned list still answers the run in one command


# ---------------------------------------------------------------------------- a tampered learned list
def test_a_tampered_learned_list_runs_nothing_of_what_it_added(local_prepare, tmp_path, capsys):
    """Whoever can write the controller's learned list adds a Command (any command, as root in the
    next run's first batch), a fact of ours with an argument of an odd shape, a name our facts
    module only imports, and a known fact with another shell: none of it runs, the run reads
    the genuine entries in one batch, and one warning line says what was dropped."""
    from pyinfra.facts.files import File

    state, host, calls = local_prepare
    batch.prefetch(state, host, [])
    host.get_fact(File, path="/etc/hostname")  # a genuine entry, learned
    genuine = batch._load_learned(batch.learned_path(host))
    assert [d["fact"] for d in genuine] == ["pyinfra.facts.files:File"]
    proof = tmp_path / "pwned"
    executor = genuine[0]["executor"]
    hostile = [
        {"fact": "pyinfra.facts.server:Command", "kwargs": {"command": f"touch {proof}"}, "executor": executor},
        {"fact": "facts.batch:Command", "kwargs": {"command": f"touch {proof}"}, "executor": executor},
        {"fact": "facts.files:FileText", "kwargs": {"path": f"/etc/hostname; touch {proof}"}, "executor": executor},
        {"fact": "pyinfra.facts.server:Which", "kwargs": {"command": f"$(touch {proof})"}, "executor": executor},
        {"fact": "facts.files:FileText", "kwargs": {"path": "/etc/hostname", "extra": 1}, "executor": executor},
        {
            "fact": "facts.engine:EngineHealth",
            "kwargs": {"host": "127.0.0.1", "port": "8000; id"},
            "executor": executor,
        },
        {
            "fact": "pyinfra.facts.files:File",
            "kwargs": {"path": "/etc/passwd"},
            "executor": {**executor, "_shell_executable": str(tmp_path / "evil-shell")},
        },
    ]
    batch.learned_path(host).write_text(json.dumps(genuine + hostile))

    batch._memos.pop((id(state), host.name))  # the next run
    calls.clear()
    capsys.readouterr()
    batch.prefetch(state, host, [])
    assert host.get_fact(File, path="/etc/hostname") is not None
    assert len(calls) == 1  # the genuine entry was read in the first batch
    sent = "\n".join(str(c) for c in calls)
    assert "touch" not in sent and "evil-shell" not in sent and "passwd" not in sent, sent
    assert not proof.exists()
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "learned fact list" in line]
    assert len(warnings) == 1 and "7 entries" in warnings[0] and "dropped (not run)" in warnings[0], err


def test_the_allow_list_takes_what_a_real_run_learns_and_nothing_that_runs_a_command():
    assert batch.allowed("facts.files:FileText", {"path": "/mnt/c/Users/John Doe/.wslconfig"}) is None
    assert (
        batch.allowed(
            "pyinfra.facts.systemd:SystemdStatus",
            {"services": ["freetoken.service"], "user_mode": False, "machine": None, "user_name": None},
        )
        is None
    )
    assert batch.allowed("facts.engine:EngineHealth", {"host": "127.0.0.1", "port": 8000}) is None
    assert batch.allowed("facts.restart:RestartPending", {"paths": ["/etc/wsl.conf"]}) is None
    for fact, kwargs in [
        ("pyinfra.facts.server:Command", {"command": "id"}),
        ("pyinfra.facts.server:Which", {"command": "a;b"}),
        ("facts.files:FileText", {"path": "relative"}),
        ("facts.files:FileText", {"path": "/x\n"}),
        ("facts.engine:EngineHealth", {"host": "attacker.example", "port": 8000}),
        ("facts.engine:EngineHealth", {"host": "127.0.0.1", "port": True}),
        ("os:system", {}),
    ]:
        assert batch.allowed(fact, kwargs) is not None, (fact, kwargs)


def _argument_declarations() -> list[tuple[str, list[str], dict]]:
    """``(fact, its command's argument names, its declared argument_shapes)`` for every fact of
    the facts package (found by walking it here, not through the registry) and every pyinfra
    fact of facts/pyinfra_reads.py."""
    import importlib
    import inspect
    import pkgutil

    from pyinfra.api import FactBase

    import facts
    from facts.pyinfra_reads import PYINFRA_READS

    found = []
    for info in pkgutil.iter_modules(facts.__path__):
        module = importlib.import_module(f"facts.{info.name}")
        for cls in vars(module).values():
            if isinstance(cls, type) and issubclass(cls, FactBase) and cls.__module__ == module.__name__:
                arguments = list(inspect.signature(cls.command).parameters)[1:]
                found.append((f"{module.__name__}:{cls.__name__}", arguments, getattr(cls, "argument_shapes", {})))
    for fact, read in PYINFRA_READS.items():
        module_name, _, name = fact.partition(":")
        cls = getattr(importlib.import_module(module_name), name)
        found.append((fact, list(inspect.signature(cls.command).parameters)[1:], read.argument_shapes))
    return found


def test_every_argument_of_our_own_facts_has_a_shape_in_the_allow_list():
    """A fact whose argument has no shape is never learned: every no-op run would read it in a
    round trip of its own. Each fact declares its arguments' shapes beside itself
    (``argument_shapes``), and the allow-list holds each of them."""
    missing, stray = [], []
    for fact, arguments, shapes in _argument_declarations():
        for name in arguments:
            if name not in shapes or batch.ARGUMENT_SHAPES.get(name) is not shapes[name]:
                missing.append(f"{fact}({name})")
        stray += [f"{fact}({name})" for name in shapes if name not in arguments]
    assert not missing, f"arguments without a declared shape: {missing}"
    assert not stray, f"shapes declared for arguments the fact does not have: {stray}"


def test_two_facts_that_give_one_argument_two_shapes_are_refused_naming_both():
    from types import SimpleNamespace

    from facts import registry
    from facts._declare import NAME, PATH

    one, other = SimpleNamespace(argument_shapes={"path": PATH}), SimpleNamespace(argument_shapes={"path": NAME})
    assert registry.union_of_shapes({"facts.a:One": one, "facts.b:Same": one}) == {"path": PATH}
    with pytest.raises(ValueError, match=r"facts\.b:Other declares its argument 'path' .* than facts\.a:One"):
        registry.union_of_shapes({"facts.a:One": one, "facts.b:Other": other})


def test_a_fact_that_never_ends_is_cut_at_the_deadline_naming_it_and_the_lock_is_released(
    local_prepare, tmp_path, monkeypatch
):
    """A fact blocked on a FIFO (or any hung program) held the batch, the run
    and the host lock for ever. The batch is cut at its deadline (here 2 s), says which fact was
    running, reads nothing more on the host, and the lock taken in the same round trip is held
    by this run, so that its disconnect releases it."""
    from pyinfra.facts.server import Command

    from operations import host_lock

    state, host, calls = local_prepare
    monkeypatch.setenv(batch.DEADLINE_ENV, "2")
    monkeypatch.setattr(host_lock, "HOST_LOCK_FILE", str(tmp_path / "run.lock"))
    monkeypatch.setattr(host_lock, "HOST_LOCK_MUTEX", str(tmp_path / "run.lock.mutex"))
    wanted = [
        (Command, {"command": "echo before"}),
        (Command, {"command": "sleep 60"}),  # for ever, as far as the run can tell
        (Command, {"command": "echo after"}),
    ]

    def lock_then_facts(command, script, elevation):
        return batch.prefetch(state, host, wanted, first=(command, script))

    # No clock bound (shared machines are noisy): without the deadline the batch ends after its
    # 60 s sleep and nothing below says it was cut.
    assert host_lock.take(state, host, timeout_s=5, run=lock_then_facts) is None
    assert batch.cut_short(state, host) == (
        "the fact batch was cut at its 2 s deadline (FREETOKEN_FACT_BATCH_DEADLINE_S): "
        "pyinfra.facts.server:Command(command='sleep 60') did not finish"
    )
    assert (tmp_path / "run.lock").exists()
    calls.clear()
    assert host.get_fact(Command, command="echo before") == "before"  # read before the cut
    assert host.get_fact(Command, command="sleep 60") is None  # not read again: it could hang
    assert host.get_fact(Command, command="echo after") is None
    batch.prefetch(state, host, [(Command, {"command": "echo later"})])
    assert calls == []
    host_lock.HostLockKeeper.of(state).host_disconnect(state, host)
    assert not (tmp_path / "run.lock").exists()


def test_a_cut_batch_says_which_command_was_running():
    command = batch_command(["echo a", "sleep 60", "echo c"], deadline=1)
    _, lines = pyinfra_lines(command)
    assert batch.batch_cut(lines) == (1, 1)  # cut: a whole run would have ended with its marker
    assert split_batch_output(lines) == {0: (0, ["a"])}
    _, whole = pyinfra_lines(batch_command(["echo a", "echo b"], deadline=5))
    assert batch.batch_cut(whole) is None and split_batch_output(whole) == {0: (0, ["a"]), 1: (0, ["b"])}
