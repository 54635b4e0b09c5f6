"""Text the engine (or a host, or the hub) controls reaches the operator's
terminal only escaped. The attack: a hostile engine answers ``/health`` with an OSC escape that
retitles the terminal (``ESC ] 0 ; pwned BEL``) and a CSI escape that clears the screen
(``ESC [ 2 J``) in its phase, version, model and message, its journal holds them, and the
fetcher's status file (written by the service user) holds them; every place that prints or
reports such text is run on it and must put out no control character at all.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pyinfra.api.exceptions import OperationError

from freetoken_infra.core.records import HostRow
from freetoken_infra.core.text import printable, printable_block
from freetoken_infra.fleet import ServerStatus, format_status
from freetoken_infra.report import ending_line, findings_table, format_fleet_report, format_gate_report
from freetoken_infra.rules import Finding
from operations.health import run_gate
from operations.model import format_progress, wait_for_fetch
from tests.unit.test_fetch_model import FakeHost
from tests.unit.test_health_gate import KEY, SCRIPT, LocalHost, _State, settings_for

ROOT = Path(__file__).resolve().parents[2]
OSC = "\x1b]0;pwned\x07"
CLEAR = "\x1b[2J"
HOSTILE = f"{OSC}phase{CLEAR}\r\x9b31m\u202eevil\x7f"


def assert_inert(text: str) -> None:
    """Nothing a terminal acts on: no C0 (but the line breaks between lines), DEL, C1, bidi."""
    bad = [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F or c in "\u202e\u2066"]
    assert not bad, (bad, text)
    assert "\\x1b]0;pwned\\x07" in text or "\\x1b[2J" in text, text  # escaped, still readable


def test_printable_escapes_controls_and_keeps_text_readable():
    assert printable(HOSTILE) == "\\x1b]0;pwned\\x07phase\\x1b[2J\\r\\x9b31m\\u202eevil\\x7f"
    assert printable("Qwen3.6 · 日本語 C:\\Users\\me 22.7 %") == "Qwen3.6 · 日本語 C:\\Users\\me 22.7 %"
    assert printable(None) == "None" and printable(0.5) == "0.5"
    assert printable("a\nb\tc") == "a\\nb\\tc"
    assert printable_block(f"one {OSC}\ntwo {CLEAR}") == "one \\x1b]0;pwned\\x07\ntwo \\x1b[2J"


def test_the_gate_scripts_copy_is_the_core_function():
    """health_gate.py carries a copy (only its schema is uploaded beside it): the same on every input."""
    spec = importlib.util.spec_from_file_location("health_gate_copy", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    samples = [HOSTILE, "plain", "", "\u2028\u2029\ufeff\u200e", "".join(chr(i) for i in range(0x00, 0x2100))]
    for sample in samples:
        assert module.printable(sample) == printable(sample)


class HostileEngine:
    """STAND-IN for a hostile engine: ``/health`` answers ``loading`` with an escape-laden phase,
    then ``error`` (or ``ok``) with escapes in its message, version and model."""

    def __init__(self, final: dict):
        calls = {"n": 0}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                calls["n"] += 1
                doc = (
                    {"status": "loading", "phase": HOSTILE, "progress": {"done_bytes": 1, "total_bytes": 2}}
                    if calls["n"] < 3
                    else final
                )
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    "final",
    [
        {"status": "error", "message": f"worker died {OSC}{CLEAR}"},
        {"status": "ok", "uptime_s": 1, "version": f"0.2.1{OSC}", "model": f"m{CLEAR}"},
    ],
    ids=["error", "ok"],
)
def test_the_health_gate_prints_a_hostile_engines_text_escaped(tmp_path, capsys, final):
    engine = HostileEngine(final)
    key_file = tmp_path / "api.env"
    key_file.write_text(f"FREETOKEN_API_KEY={KEY}\n")
    host = LocalHost("ws1", journal=[f"FreeToken log {OSC}", f"{CLEAR}more"])
    state = _State([], set())
    try:
        with pytest.raises(OperationError) as failure:
            run_gate(state, host, settings_for(engine.port, health_timeout_s=10), str(key_file), str(SCRIPT))
    finally:
        engine.close()
    streamed = capsys.readouterr().out  # the gate script's progress lines, as pyinfra streams them
    assert_inert(streamed)
    assert_inert(str(failure.value))
    from freetoken_infra.core.records import RunRecords

    assert_inert(format_gate_report(RunRecords.of(state).gates))


def test_the_fetchers_status_and_journal_print_escaped(capsys):
    status = {"state": f"downloading{OSC}", "bytes_done": 1, "bytes_total": 2, "current_file": f"x{CLEAR}.bin"}
    assert_inert(format_progress(status))
    refused = {"state": "refused", "error": f"refusing {OSC}{CLEAR}", "current_file": f"x{CLEAR}.bin"}
    host = FakeHost([({"ActiveState": "failed", "Result": "exit-code", "ExecMainStatus": "3", "jobs": "0"}, refused)])
    from freetoken_infra.core.settings import Settings

    with pytest.raises(OperationError) as failure:
        wait_for_fetch(None, host, Settings(), poll_s=0.6)
    assert_inert(str(failure.value))
    assert_inert(capsys.readouterr().err)  # the progress line printed on the way


def test_reports_and_tables_escape_what_hosts_said():
    row = HostRow(
        host="ws1",
        gpu="RTX",
        engine_version=f"0.2.1{OSC}",
        model=f"m{CLEAR}",
        health=f"failed ({OSC})",
        result="failed",
        reason=f"health gate failed in the {HOSTILE} phase",
    )
    assert_inert(format_fleet_report([row]))
    assert_inert(ending_line(row))
    assert_inert(findings_table("ws1", [Finding("gpu", "block", f"nvidia-smi said {OSC}", f"fix {CLEAR}")]))
    table = format_status([ServerStatus("ws1", "in service", 0, f"L7OK/200 {OSC}{CLEAR}", "UP")], {"ws1": None})
    assert_inert(table)


def test_the_cli_modules_import_the_one_function():
    """One function: every printing module takes it from the core, none keeps its own."""
    for module in (
        "operations/health.py",
        "operations/model.py",
        "freetoken_infra/report.py",
        "freetoken_infra/fleet.py",
    ):
        text = (ROOT / module).read_text()
        assert "from freetoken_infra.core.text import printable" in text, module
        assert "def printable" not in text, module
    assert sys.modules["freetoken_infra.core.text"].printable is printable
