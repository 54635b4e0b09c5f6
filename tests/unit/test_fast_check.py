"""The no-op fast check: the converge record the host lock's script writes at
the end of a converge and reads in the next run's first round trip, run here on temporary files as
on a target; what each fact depends on (facts/inputs.py); the plan's and the fingerprint's part.

The attacks: a file changed and its mtime put back (ctime still shows it), a folder's mode
changed, a new file in the model folder, a record written for other settings or code, a flood of
files under a tree, an engine whose /health says something else. Each must make the next run read
every fact."""

from __future__ import annotations

import base64
import http.server
import importlib
import json
import marshal
import os
import pkgutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pyinfra.api import FactBase

import facts
from facts import batch, registry
from facts._declare import Unknown
from facts.inputs import Inputs, inputs_of, inputs_of_run
from facts.pyinfra_reads import PYINFRA_READS
from freetoken_infra import plan
from operations import host_lock
from tests.unit.test_host_lock import b64, holder, lock

FP = "f" * 64


def take(tmp_path: Path, token: str = "A", fingerprint: str = FP) -> tuple[int, dict]:
    return lock(
        tmp_path,
        "take",
        "--holder",
        b64(holder(token)),
        "--lease",
        "60",
        "--record",
        str(tmp_path / "record.json"),
        "--unchanged-if",
        fingerprint,
    )


def release(
    tmp_path: Path, inputs: dict, token: str = "A", fingerprint: str = FP, outcome: dict | None = None
) -> tuple[int, dict]:
    encoded = base64.b64encode(json.dumps(inputs).encode()).decode()
    more = ["--outcome", base64.b64encode(json.dumps(outcome).encode()).decode()] if outcome else []
    return lock(
        tmp_path,
        "release",
        "--token",
        token,
        "--record",
        str(tmp_path / "record.json"),
        "--fingerprint",
        fingerprint,
        "--inputs",
        encoded,
        *more,
    )


@pytest.fixture
def host(tmp_path):
    """A converged 'host': a unit-like file, a config folder, a model tree; recorded once."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "freetoken.service").write_text("[Service]\nExecStart=/bin/true\n")
    (root / "model").mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors"):
        (root / "model" / name).write_text(name)
    inputs = Inputs(
        paths={str(root / "etc" / "freetoken.service"), str(root / "missing.conf")},
        dirs={str(root / "etc")},
        trees={str(root / "model")},
    ).to_json()
    rc, doc = take(tmp_path)
    assert rc == 0 and doc["taken"] and doc["fast_check"] == "no record of a converge"
    rc, doc = release(tmp_path, inputs)
    assert rc == 0 and doc["released"] and doc["recorded"] >= 5
    return root


def test_nothing_changed_answers_unchanged_and_takes_nothing(tmp_path, host):
    rc, doc = take(tmp_path)
    assert rc == host_lock.UNCHANGED_EXIT and doc == {"unchanged": True, "taken": False, "inputs": doc["inputs"]}
    assert not (tmp_path / "run.lock").exists()  # nothing taken
    assert take(tmp_path)[0] == host_lock.UNCHANGED_EXIT  # and again: reading changed nothing
    record = tmp_path / "record.json"
    assert oct(record.stat().st_mode & 0o777) == "0o600"


def test_a_changed_file_with_its_mtime_put_back_is_found(tmp_path, host):
    unit = host / "etc" / "freetoken.service"
    before = unit.stat()
    time.sleep(0.01)
    unit.write_text("[Service]\nExecStart=/bin/sh -c evil\n"[: before.st_size])  # same size too
    os.utime(unit, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert unit.stat().st_mtime_ns == before.st_mtime_ns and unit.stat().st_size == before.st_size
    rc, doc = take(tmp_path)
    assert rc == 0 and doc["taken"] and f"path {unit}" in doc["fast_check"]
    # The record is gone the moment a run takes the lock: a run cut now leaves a full read next.
    assert not (tmp_path / "record.json").exists()
    lock(tmp_path, "release", "--token", "A")
    assert take(tmp_path, token="B")[1]["fast_check"] == "no record of a converge"


def test_a_file_that_appears_is_found(tmp_path, host):
    (host / "missing.conf").write_text("x")
    assert take(tmp_path)[1]["fast_check"].startswith("changed: path ")


def test_a_folder_counts_its_mode_and_owner_not_its_times(tmp_path, host):
    (host / "etc" / "new-sample.prom").write_text("guard sample")  # the folder's mtime moves
    assert take(tmp_path)[0] == host_lock.UNCHANGED_EXIT
    os.chmod(host / "etc", 0o777)
    assert f"dir {host / 'etc'}" in take(tmp_path)[1]["fast_check"]


def test_a_new_or_changed_file_under_a_tree_is_found(tmp_path, host):
    (host / "model" / "extra.bin").write_text("planted")
    assert "tree " in take(tmp_path)[1]["fast_check"]


def test_a_tree_past_its_cap_is_never_trusted(tmp_path, host, monkeypatch):
    for i in range(40):
        (host / "model" / f"f{i}").write_text("")
    script = Path(host_lock.SCRIPT_SOURCE).read_text().replace("TREE_CAP = 5000", "TREE_CAP = 10")
    patched = tmp_path / "host_lock_small_cap.py"
    patched.write_text(script)
    monkeypatch.setattr("tests.unit.test_host_lock.SCRIPT", patched)
    rc, doc = take(tmp_path)
    assert rc == 0 and doc["fast_check"] == "too many files to check"


def test_another_fingerprint_reads_everything(tmp_path, host):
    rc, doc = take(tmp_path, fingerprint="0" * 64)
    assert rc == 0 and doc["fast_check"] == "settings or code changed"


def test_a_held_lock_is_waited_for_not_answered_unchanged(tmp_path, host):
    assert lock(tmp_path, "take", "--holder", b64(holder("OTHER")), "--lease", "60")[0] == 0
    rc, doc = take(tmp_path)
    assert rc == host_lock.HELD_EXIT and doc["taken"] is False


def test_a_release_that_is_not_ours_writes_no_record(tmp_path):
    assert take(tmp_path)[0] == 0
    assert release(tmp_path, {"paths": ["/etc/hostname"]}, token="B")[1] == {"released": False, "recorded": None}
    assert not (tmp_path / "record.json").exists()


def test_the_units_state_is_read_from_one_systemctl_show(tmp_path, monkeypatch):
    """The units' ActiveState, UnitFileState and LoadState, as ``systemctl show`` prints them
    (a stand-in systemctl here, printing what systemd's does: one block per unit, in order)."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(
        "#!/bin/sh\n"
        '[ "$1 $2" = "show --property=Id,ActiveState,UnitFileState,LoadState" ] || exit 64\n'
        'printf "Id=freetoken.service\\nLoadState=loaded\\nActiveState=%s\\nUnitFileState=enabled\\n\\n" "$(cat '
        + str(state)
        + ')"\n'
        'printf "Id=ssh.service\\nLoadState=loaded\\nActiveState=active\\nUnitFileState=enabled\\n"\n'
    )
    (bin_dir / "systemctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    state.write_text("active")
    assert take(tmp_path)[0] == 0
    assert release(tmp_path, {"units": ["freetoken.service", "ssh.service"]})[1]["recorded"] == 3
    record = marshal.loads((tmp_path / "record.json").read_bytes())
    assert record["digest"]["unit freetoken.service"] == "active enabled loaded"
    assert record["digest"]["unit ssh.service"] == "active enabled loaded"
    assert take(tmp_path)[0] == host_lock.UNCHANGED_EXIT
    state.write_text("failed")
    rc, doc = take(tmp_path)
    assert rc == 0 and doc["fast_check"] == "changed: unit freetoken.service"


def test_the_script_says_what_is_wrong_with_its_command_line(tmp_path):
    for args, said in (
        (["grab"], "the first argument must be one of"),
        (["show", "--color", "x"], "unknown option '--color'"),
        (["show", "--lock-file"], "--lock-file needs a value"),
        (["show", "--lock-file", str(tmp_path / "l")], "--mutex is required"),
        (["take", "--lease", "soon", "--lock-file", "l", "--mutex", "m"], "--lease must be a number"),
    ):
        proc = subprocess.run([sys.executable, str(host_lock.SCRIPT_SOURCE), *args], capture_output=True, text=True)
        assert proc.returncode == 2 and said in proc.stderr and not proc.stdout, (args, proc.stderr)


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("host_lock_script", host_lock.SCRIPT_SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scripts_glob_matches_what_glob_matches(tmp_path):
    """The lock script matches facts/inputs.py's globs without importing glob (and re with it):
    it must find exactly what glob finds, hidden names, links and files on the way included."""
    import glob

    base = tmp_path / "opt"
    for venv in ("0.2.1-a", "0.2.2-b", ".hidden-c"):
        site = base / venv / "lib" / "python3.11" / "site-packages"
        (site / "freetoken-0.2.1.dist-info").mkdir(parents=True)
        (site / "freetoken-0.2.1.dist-info" / "METADATA").write_text("x")
        (base / venv / "pyvenv.cfg").write_text("x")
    (base / "0.2.2-b" / "lib" / "python3.12").mkdir()
    (base / "active").symlink_to(base / "0.2.2-b")
    (base / "dangling").symlink_to(base / "nowhere")
    (base / "file-not-dir").write_text("x")
    (base / "0.2.1-a" / "lib" / "python3.x").write_text("a file where a folder is looked for")
    script = _script()
    for pattern in (
        "*",
        "*/pyvenv.cfg",
        "*/lib/python3*/site-packages",
        "*/lib/python3*/site-packages/freetoken-*.dist-info/METADATA",
        ".*/pyvenv.cfg",
        "0.2*",
        "*-b/lib",
        "nothing-*/x",
        "dangling",
        "*/lib/python3.1[12]",  # glob's own
        "a*b*c",
    ):
        full = f"{base}/{pattern}"
        assert sorted(script._glob(full)) == sorted(glob.glob(full)), pattern


@pytest.mark.parametrize(
    "url, parsed",
    [
        ("http://127.0.0.1:8000/health", ("127.0.0.1", 8000, "/health")),
        ("http://[::1]:8000/health", ("[::1]", 8000, "/health")),
        ("http://10.0.0.5:18000/v1/x_y-z.json", ("10.0.0.5", 18000, "/v1/x_y-z.json")),
        ("http://localhost:8000/health", None),
        ("https://127.0.0.1:8000/health", None),
        ("http://127.0.0.1/health", None),
        ("http://127.0.0.1:80a/health", None),
        ("http://127.0.0.1:8000", None),
        ("http://127.0.0.1:8000/health?x=1", None),
        ("http://127.0.0.1:8000/he alth", None),
        ("http://[]:8000/health", None),
        ("http://user@127.0.0.1:8000/health", None),
    ],
)
def test_the_health_url_is_a_loopback_literal_or_nothing(url, parsed):
    script = _script()
    if parsed is None:
        with pytest.raises(ValueError):
            script._loopback(url)
    else:
        assert script._loopback(url) == parsed


def test_an_unchanged_hosts_answer_imports_nothing_it_does_not_need(tmp_path):
    """The fast check's answer is the whole of a no-op run's cost on the host: it must not pull
    in json, re, glob, argparse, subprocess or socket (a cost figure is bench/converge.py's;
    this guards what made it)."""
    (tmp_path / "venvs" / "0.2.1").mkdir(parents=True)
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/health"
        inputs = {"paths": [str(tmp_path / "venvs")], "globs": [f"{tmp_path}/venvs/*"], "health": [url]}
        assert take(tmp_path)[0] == 0 and release(tmp_path, inputs)[1]["recorded"] == 5
        proc = _take_importtime(tmp_path)
    finally:
        server.shutdown()
    assert proc.returncode == host_lock.UNCHANGED_EXIT, proc.stdout + proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert imported and not imported & {"json", "re", "glob", "argparse", "subprocess", "socket", "base64"}, imported
    assert json.loads(proc.stdout) == {"unchanged": True, "taken": False, "inputs": 5}


def _take_importtime(tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-X",
            "importtime",
            str(host_lock.SCRIPT_SOURCE),
            "take",
            "--holder",
            b64(holder("B")),
            "--record",
            str(tmp_path / "record.json"),
            "--unchanged-if",
            FP,
            "--lock-file",
            str(tmp_path / "run.lock"),
            "--mutex",
            str(tmp_path / "run.lock.mutex"),
        ],
        capture_output=True,
        text=True,
    )


class _Health(http.server.BaseHTTPRequestHandler):
    body: dict = {"status": "ok", "version": "0.2.1", "model": "m", "uptime_s": 1}

    def do_GET(self):
        data = json.dumps(type(self).body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_the_engines_health_counts_by_status_version_and_model_only(tmp_path):
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/health"
        assert take(tmp_path)[0] == 0
        assert release(tmp_path, {"health": [url]})[1]["recorded"] == 2  # boot and health
        _Health.body = {**_Health.body, "uptime_s": 99}  # moves on its own: not counted
        assert take(tmp_path)[0] == host_lock.UNCHANGED_EXIT
        _Health.body = {"model": "m", "status": "ok", "version": "0.2.1", "uptime_s": 7, "queue": 3}
        assert take(tmp_path)[0] == host_lock.UNCHANGED_EXIT  # other text, the same fields: parsed
        _Health.body = {**_Health.body, "status": "loading"}
        assert f"health {url}" in take(tmp_path)[1]["fast_check"]
    finally:
        server.shutdown()
        _Health.body = {"status": "ok", "version": "0.2.1", "model": "m", "uptime_s": 1}


def test_an_engine_that_drips_its_health_answer_holds_the_check_at_most_its_timeout(tmp_path):
    """The engine's user runs what answers /health: an answer sent a byte at a time must not hold
    the lock's mutex (every run on the host waits for it) longer than HEALTH_TIMEOUT_S. The drip
    never ends and each byte comes well within the per-read timeout, so only the answer's total
    deadline can end the read: the release returning at all (lock() bounds a hang), with the
    read recorded as timed out, shows that deadline."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip():
        conn, _ = listener.accept()
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
        while not stop.is_set():
            try:
                conn.sendall(b" ")
            except OSError:
                return
            time.sleep(0.2)

    threading.Thread(target=drip, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/health"
        assert take(tmp_path)[0] == 0
        rc, doc = release(tmp_path, {"health": [url]})
        assert rc == 0 and doc["recorded"] == 2
        record = marshal.loads((tmp_path / "record.json").read_bytes())
        assert record["digest"][f"health {url}"] == "unreachable TimeoutError"
    finally:
        stop.set()
        listener.close()


# --------------------------------------------------------------------------- facts/inputs.py
def _fact_classes_by_name() -> dict[str, type]:
    found = {}
    for info in pkgutil.iter_modules(facts.__path__):
        module = importlib.import_module(f"facts.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, FactBase) and value.__module__ == module.__name__:
                found[f"{module.__name__}:{value.__qualname__}"] = value
    return found


def _declared_inputs() -> dict[str, object]:
    """Every fact's ``fast_check_inputs`` (None: it declares none), found by walking the facts
    package here, not through the registry, and the pyinfra facts' (facts/pyinfra_reads.py)."""
    declared = {name: getattr(cls, "fast_check_inputs", None) for name, cls in _fact_classes_by_name().items()}
    return declared | {name: read.fast_check_inputs for name, read in PYINFRA_READS.items()}


def test_every_fact_the_deploy_may_read_has_its_inputs_declared():
    """A new fact must say beside itself what it depends on (``fast_check_inputs``), or declare
    ``Unknown(why)`` (its runs then record nothing): the fast check never trusts a fact it knows
    nothing of."""
    declared = _declared_inputs()
    assert set(batch.PYINFRA_FACTS) == set(PYINFRA_READS)
    missing = sorted(name for name, value in declared.items() if value is None)
    assert not missing, f"facts that declare no fast_check_inputs: {missing}"
    kwargs = {"path": "/x", "paths": ["/x"], "base_dir": "/x", "state_file": "/x", "model_dir": "/x"}
    kwargs |= {"services": ["u.service"], "account": "a", "cuda_home": "/x", "host": "127.0.0.1", "port": 1}
    for fact, value in sorted(declared.items()):
        if isinstance(value, Unknown):
            assert value.why.strip(), f"{fact}: Unknown inputs without a reason"
        assert (inputs_of(fact, kwargs) is None) == isinstance(value, Unknown), fact


def test_a_fact_without_a_declaration_is_named_and_its_inputs_are_unknown(monkeypatch):
    """A fact class added to a facts module without ``fast_check_inputs``: the check above names
    it, and the registry (walking the package) knows no inputs for it."""

    class Undeclared(FactBase):
        def command(self, path: str) -> str:
            return "true"

    Undeclared.__module__, Undeclared.__qualname__ = "facts.files", "Undeclared"
    monkeypatch.setattr(importlib.import_module("facts.files"), "Undeclared", Undeclared, raising=False)
    registry.fact_classes.cache_clear()
    registry.fast_check_inputs.cache_clear()
    try:
        assert [n for n, v in _declared_inputs().items() if v is None] == ["facts.files:Undeclared"]
        assert "facts.files:Undeclared" in registry.fact_classes()
        assert inputs_of("facts.files:Undeclared", {"path": "/a"}) is None
        assert inputs_of("facts.files:FileText", {"path": "/a"}) is not None
    finally:
        monkeypatch.undo()
        registry.fact_classes.cache_clear()
        registry.fast_check_inputs.cache_clear()


def test_a_run_that_read_an_unknown_fact_has_no_inputs():
    why = inputs_of_run([{"fact": "facts.files:FileText", "kwargs": {"path": "/a"}}, {"fact": "x:Y", "kwargs": {}}])
    assert why == "the run read 'x:Y', whose inputs are not known"


def test_inputs_of_the_deploys_facts():
    merged = inputs_of_run(
        [
            {"fact": "facts.ownership:DirOwnership", "kwargs": {"path": "/var/lib/freetoken", "adopt_from": None}},
            {"fact": "pyinfra.facts.systemd:SystemdStatus", "kwargs": {"services": ["freetoken.service"]}},
            {"fact": "facts.model_manifest:ModelManifest", "kwargs": {"model_dir": "/m"}},
            {"fact": "pyinfra.facts.deb:DebPackages", "kwargs": {}},
            {"fact": "facts.engine:EngineHealth", "kwargs": {"host": "::1", "port": 8000}},
        ]
    )
    assert isinstance(merged, Inputs)
    assert merged.to_json() == {
        "paths": ["/m", "/var/lib/dpkg/status"],
        "dirs": ["/var", "/var/lib", "/var/lib/freetoken"],
        "globs": [],
        "trees": ["/m"],
        "units": ["freetoken.service"],
        "health": ["http://[::1]:8000/health"],
        "nft": [],
    }
    adopting = {"fact": "facts.ownership:DirOwnership", "kwargs": {"path": "/v/m", "adopt_from": "old"}}
    adopted = inputs_of_run([adopting])
    assert isinstance(adopted, Inputs) and adopted.trees == {"/v/m"}  # every entry's owner below


# --------------------------------------------------------------------------- plan
def test_the_plan_of_an_unchanged_host_does_nothing():
    p = plan.converge_plan(plan.Unchanged("ws1", 140), render=None)  # type: ignore[arg-type]
    assert p.unchanged == plan.Unchanged("ws1", 140)
    assert p.stop is None and p.windows is None and p.converge is None


# --------------------------------------------------------------------------- a refused host's record
REFUSED = {"refused": [["wsl_version", "WSL 2.6.1 < 2.7.13", "wsl.exe --update"]]}


def test_a_refusals_record_hands_its_blockers_back_while_it_stands(tmp_path):
    marker = tmp_path / "wsl.conf"
    marker.write_text("[boot]\nsystemd=true\n")
    assert take(tmp_path)[0] == 0
    assert release(tmp_path, {"paths": [str(marker)]}, outcome=REFUSED)[1]["recorded"] == 2
    rc, doc = take(tmp_path)
    assert rc == host_lock.UNCHANGED_EXIT and doc == {
        "unchanged": True,
        "taken": False,
        "inputs": 2,
        "outcome": REFUSED,
    }
    assert host_lock.refusal_of(doc["outcome"]) == (("wsl_version", "WSL 2.6.1 < 2.7.13", "wsl.exe --update"),)
    marker.write_text("[boot]\nsystemd=false\n")  # any input changed: a full read, the refusal decided again
    rc, doc = take(tmp_path)
    assert rc == 0 and doc["taken"] and "outcome" not in doc and not (tmp_path / "record.json").exists()


@pytest.mark.parametrize(
    "outcome",
    [
        {"refused": []},
        {"refused": [["wsl_version", "x"]]},
        {"refused": [["wsl_version", "x", 3]]},
        {"refused": [["Wsl version; rm -rf /", "x", "y"]]},
        {"refused": [["wsl_version", "x" * 2001, "y"]]},
        {"refused": [["wsl_version", "x", "y"]] * 9},
        {"refused": [["wsl_version", "x", "y"]], "converged": True},
        ["wsl_version"],
        "refused",
    ],
)
def test_a_record_outcome_not_of_the_shape_this_controller_writes_is_not_taken_at_its_word(outcome):
    assert host_lock.refusal_of(outcome) is None
    assert host_lock.refusal_of(None) == ()  # a converge's record


def test_a_forged_refusal_makes_the_run_read_every_fact(tmp_path, capsys):
    """The take answers "unchanged" with an outcome this controller never writes: the lock is
    asked for again without the fast check, and the run reads every fact."""
    from tests.unit.test_host_lock import LocalHost, _State

    state, host, commands = _State(), LocalHost("ws1", tmp_path), []

    def run(command, script, elevation):
        commands.append(command)
        if "--unchanged-if" in command:
            return False, [json.dumps({"unchanged": True, "taken": False, "inputs": 3, "outcome": {"refused": "x"}})]
        ok, output = host.run_shell_command(command, _stdin=script)
        return ok, list(output.output_lines)

    assert host_lock.take(state, host, timeout_s=1, run=run, unchanged_if=FP) is None  # taken: a full run
    assert len(commands) == 2 and "--unchanged-if" not in commands[1]
    assert "its record's outcome is not one this deploy writes" in capsys.readouterr().err
    state.callback_handlers[0].host_disconnect(state, host)


def test_the_gate_table_says_which_hosts_their_record_answered():
    """In a run where other hosts gate, a host the fast check answered read nothing: its row says
    so, not "refused at preflight" (which a host answered from a refusal's record says, with why)."""
    from freetoken_infra.core.records import RunRecords
    from freetoken_infra.report import gate_rows

    run = RunRecords()
    run.answered = {
        "ws1": "unchanged since its last converge (its record answered; nothing read)",
        "ws3": "refused at preflight (unchanged since its last full read)",
    }
    rows = gate_rows(run, ["ws1", "ws3", "ws4"], active={"ws1"})
    assert rows["ws1"].stopped == run.answered["ws1"] and rows["ws3"].stopped == run.answered["ws3"]
    assert rows["ws4"].stopped == "refused at preflight (findings above)"


# --------------------------------------------------------------------------- the fingerprint
def _fleet(data: dict[str, dict], groups: dict | None = None):
    from pyinfra.api import Config, Inventory, State

    inventory = Inventory(([(name, d) for name, d in data.items()], {}), **(groups or {}))
    return State(inventory, Config())


def _fingerprints(data: dict[str, dict], groups: dict | None = None) -> dict[str, str]:
    from freetoken_infra.preflight import fingerprint

    state = _fleet(data, groups)
    return {h.name: fingerprint(state, h) for h in state.inventory}


BASE = {"ws1": {"ssh_hostname": "10.0.0.11"}, "ws2": {"ssh_hostname": "10.0.0.12"}}


def test_the_fingerprint_is_stable_per_host_and_moves_with_any_hosts_settings_or_place():
    first = _fingerprints(BASE)
    assert first == _fingerprints(BASE) and first["ws1"] != first["ws2"]
    other_setting = _fingerprints({**BASE, "ws2": {**BASE["ws2"], "listen_port": 8100}})
    assert other_setting["ws1"] != first["ws1"]  # the plan reads other hosts' settings too
    moved = _fingerprints({**BASE, "ws2": {"ssh_hostname": "10.0.0.99"}})
    assert moved["ws1"] != first["ws1"]  # the firewall admits the gateway by its address
    grouped = _fingerprints(BASE, {"gateway": (["ws2"], {})})
    assert grouped["ws1"] != first["ws1"]
    sudo = _fingerprints({**BASE, "ws1": {**BASE["ws1"], "_sudo": True}})
    assert sudo["ws1"] != first["ws1"] and sudo["ws2"] == first["ws2"]


def test_the_fingerprint_moves_with_the_controllers_api_key_and_holds_no_part_of_it(tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-first-secret\n")
    data = {**BASE, "ws1": {**BASE["ws1"], "api_key_source": f"file:{key}"}}
    first = _fingerprints(data)
    key.write_text("sk-second-secret\n")
    assert _fingerprints(data)["ws1"] != first["ws1"]
    assert all(len(v) == 64 and "secret" not in v for v in first.values())


def test_the_fingerprint_moves_with_the_code(monkeypatch):
    from freetoken_infra import preflight

    first = _fingerprints(BASE)
    real = preflight.code_digest()
    monkeypatch.setattr(preflight, "code_digest", lambda: "0" * 64)
    assert _fingerprints(BASE)["ws1"] != first["ws1"]
    assert len(real) == 64


def test_the_lock_script_reads_the_live_nft_table(tmp_path, monkeypatch):
    """A flushed firewall table changes the fast check's reading (its unit still reads `active`),
    so the run reads everything and reloads the table; a table name that is not one is not run."""
    script = _script()
    fake = tmp_path / "nft"
    listing = tmp_path / "listing"
    fake.write_text(f'#!/bin/sh\n[ "$*" = "list table inet freetoken" ] && cat {listing}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    listing.write_text("table inet freetoken {\n\tchain input {\n\t}\n}\n")
    loaded, _ = script.digest({"nft": ["inet freetoken"]})
    assert loaded["nft inet freetoken"].startswith("table inet freetoken")
    listing.write_text("")  # nft flush ruleset
    flushed, _ = script.digest({"nft": ["inet freetoken"]})
    assert flushed["nft inet freetoken"] == "" != loaded["nft inet freetoken"]
    assert script.digest({"nft": ["inet free;token"]})[0]["nft inet free;token"] == "error: not a table"
