"""Remote text cannot forge a fact.

An engine's ``/health`` body is the engine's text: here a loopback server answers with a body
that holds our own marker lines, written to re-declare an EARLIER fact of the same batch (the
attack that overrode ``id -u``, the WSL kind and the guard state). The facts run for real:
``sh`` for the batch, pyinfra's local connector for the prefetch.
"""

from __future__ import annotations

import http.server
import subprocess
import threading
from collections.abc import Iterator

import pytest

from facts import batch
from facts.batch import batch_command, split_batch_output
from facts.engine import EngineHealth

GENUINE = "genuine-answer-1000"


def forged_body(target_index: int) -> bytes:
    """A /health body that, printed raw, ends the health fact's section and re-answers fact
    ``target_index`` (the old batch format) or opens a section of the single fact's own."""
    return (
        '{"status": "ok"}\n'
        f"@@ftbatch:rc {target_index + 1} 0\n"
        f"@@ftbatch:{target_index}\n0\n"
        f"@@ftbatch:rc {target_index} 0\n"
        f"@@ftbatch:end {target_index}\n"
        "@@ft:unreachable forged\n"
        "@@ft:http 500\n"
    ).encode()


@pytest.fixture()
def hostile_engine() -> Iterator[tuple[int, dict]]:
    payload = {"body": b""}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload["body"])

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], payload
    server.shutdown()


def sh_lines(command: str) -> list[str]:
    proc = subprocess.run(["sh", "-c", command], capture_output=True, timeout=60)
    lines = proc.stdout.decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def test_a_forged_health_body_cannot_reanswer_an_earlier_fact_of_the_batch(hostile_engine):
    port, payload = hostile_engine
    payload["body"] = forged_body(0)
    health = EngineHealth()
    commands = [f"echo {GENUINE}", health.command("127.0.0.1", port)]
    split = split_batch_output(sh_lines(batch_command(commands)))
    assert split[0] == (0, [GENUINE])
    info = health.process(split[1][1])
    # The body is what the engine sent, whole: not JSON, so no status at all (never "ok").
    assert info.reachable and info.http_status == 200 and info.status is None
    assert "non-JSON" in (info.error or "") and "@@ftbatch" in (info.error or "")


def test_a_forged_health_body_cannot_forge_the_single_facts_own_markers(hostile_engine):
    port, payload = hostile_engine
    payload["body"] = b'{"status": "loading"}\n@@ft:unreachable forged\n'
    health = EngineHealth()
    info = health.process(sh_lines(health.command("127.0.0.1", port)))
    assert info.reachable and info.error and "forged" in info.error and info.status is None
    payload["body"] = b'{"status": "error", "message": "line one\\n@@ft:http 200"}'
    info = health.process(sh_lines(health.command("127.0.0.1", port)))
    assert info.status == "error" and info.message == "line one\n@@ft:http 200"


def test_the_prefetch_keeps_every_other_fact_whatever_the_engine_answers(hostile_engine, tmp_path, monkeypatch):
    """End to end through pyinfra: the facts read after a batch with a hostile body."""
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.connect import connect_all
    from pyinfra.api.state import StateStage
    from pyinfra.facts.server import Command

    port, payload = hostile_engine
    payload["body"] = forged_body(0) + forged_body(1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(batch.ENV_SWITCH, "1")
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    connect_all(state)
    state.set_stage(StateStage.Prepare)
    host = inventory.get_host("@local")
    try:
        wanted = [
            (Command, {"command": f"echo {GENUINE}"}),
            (Command, {"command": "echo second"}),
            (EngineHealth, {"host": "127.0.0.1", "port": port}),
        ]
        batch.prefetch(state, host, wanted)
        assert host.get_fact(Command, command=f"echo {GENUINE}") == GENUINE
        assert host.get_fact(Command, command="echo second") == "second"
        assert host.get_fact(EngineHealth, host="127.0.0.1", port=port).status is None
    finally:
        batch._memos.pop((id(state), host.name), None)


def test_a_section_that_does_not_decode_is_left_to_the_normal_path():
    lines = sh_lines(batch_command(["echo a", "echo b"]))
    start = lines.index("@@ftbatch:1")
    broken = lines[: start + 1] + ["not base64 @@"] + lines[start + 2 :]
    assert split_batch_output(broken) == {0: (0, ["a"])}


def test_a_file_name_cannot_forge_the_model_manifest(tmp_path):
    """The service user (or a hub listing) names a file so that, listed raw, its name opens a
    manifest section of the fact's own: an empty, 'complete' manifest."""
    import base64

    from facts.model import ModelDirectory
    from facts.model_manifest import ModelManifest

    forged = base64.b64encode(b'{"files": {}}').decode()
    assert "/" not in forged
    model = tmp_path / "model"
    model.mkdir()
    name = f"evil\n@@ft:manifest\n{forged}"
    (model / name).write_text("x")
    fact = ModelManifest()
    info = fact.process(sh_lines(fact.command(str(model))))
    assert info.manifest is None
    assert list(info.on_disk) == [name]
    listing = ModelDirectory()
    files = listing.process(sh_lines(listing.command(str(model)))).files
    assert files == {name: 1}
