"""The ledger (freetoken_infra/ledger.py) against a real Prometheus holding a known load
(tests/unit/promfixture.py): its figures equal the load's, within the grid's rounding; its JSON
and CSV parse; an unreachable or refusing Prometheus is a clear error; untrusted answers are
checked."""

from __future__ import annotations

import csv
import io
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from freetoken_infra import ledger
from freetoken_infra.core.owner import MODES
from operations.gateway import scrape_config
from tests.unit import promfixture
from tests.unit.promfixture import LOAD, SCRAPE_S, SPAN_S, STEP_S, expected, loaded_prometheus  # noqa: F401

HOSTS_WITH_AGENT = ("ws1", "ws2")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = ledger.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def window_args(p) -> list[str]:
    return ["--prometheus", p.url, "--since", f"{SPAN_S}s", "--until", str(p.end), "--step", f"{STEP_S}s"]


@pytest.fixture(scope="module")
def document(loaded_prometheus):
    """The ledger of the whole load, as JSON (the figures every form prints)."""
    out = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(out):
        assert ledger.main([*window_args(loaded_prometheus), "--json"]) == 0
    return json.loads(out.getvalue())


def close(got: float, want: float, tol: float, what: str) -> None:
    assert abs(got - want) <= tol + 1e-9, f"{what}: ledger says {got}, the load {want} (tolerance {tol})"


@pytest.mark.parametrize("host", HOSTS_WITH_AGENT)
def test_hours_per_mode_reason_sleep_and_silence_equal_the_load(document, host):
    e = expected(host)
    got = document["hosts"][host]
    # Each phase boundary may move a figure by one step of the grid.
    tol = e.transitions * STEP_S / 3600
    close(got["seen_h"], e.seen_h, STEP_S / 3600, f"{host} seen")
    for mode in MODES:
        close(got["modes_h"][mode], e.modes_h[mode], tol, f"{host} {mode}")
    for reason in set(e.reasons_h) | set(got["reasons_h"]):
        close(got["reasons_h"].get(reason, 0.0), e.reasons_h.get(reason, 0.0), tol, f"{host} reason {reason}")
    close(got["asleep_h"], e.asleep_h, tol, f"{host} asleep")
    close(got["down_h"], e.down_h, tol, f"{host} down")
    close(got["silent_h"], e.silent_h, tol, f"{host} silent")
    assert got["no_data"] is None


def test_the_load_has_each_kind_of_hour_so_the_test_above_can_fail():
    """The load exercises every figure: a zero expected everywhere would pass a ledger that
    prints zeros."""
    ws1, ws2 = expected("ws1"), expected("ws2")
    assert ws1.modes_h["serving"] > 3 and ws1.modes_h["yielded"] == 1 and ws1.asleep_h == 1
    assert ws1.reasons_h == {"game": 1.0}
    assert ws2.down_h == 0.5 and ws2.silent_h > 0.2 and ws2.modes_h["held"] == 0.5 and ws2.modes_h["starting"] > 0
    assert ws2.reasons_h == {"reboot_pending": 0.5}


@pytest.mark.parametrize("host", HOSTS_WITH_AGENT)
def test_requests_tokens_and_energy_equal_the_load(document, host):
    e = expected(host)
    got = document["hosts"][host]
    rate = max(p.tok_s for p in LOAD[host])
    req_rate = max(p.req_s for p in LOAD[host])
    # A run of the engine loses what it served after its last scrape; the window's two edges
    # one scrape each (Prometheus' extrapolation).
    scrapes = e.runs + 2
    close(got["tokens"], e.tokens, rate * SCRAPE_S * scrapes, f"{host} tokens")
    close(got["requests"], e.requests, req_rate * SCRAPE_S * scrapes, f"{host} requests")
    watts = max(p.watts for p in LOAD[host])
    tol_wh = watts * STEP_S / 3600 * e.transitions
    close(got["wh_serving"], e.wh_serving, tol_wh, f"{host} Wh serving")
    close(got["wh_all"], e.wh_all, tol_wh, f"{host} Wh all")
    close(got["tokens_per_wh"], got["tokens"] / got["wh_serving"], 1e-6, f"{host} tokens/Wh")
    assert got["tokens_per_wh"] == pytest.approx(e.tokens / e.wh_serving, rel=0.02)


def test_a_host_without_the_agent_and_a_host_prometheus_never_saw_say_so(loaded_prometheus, capsys):
    hosts = ("--host", "ws3", "--host", "ws9", "--host", "ws1", "--host", "ws9.lan")  # a dot: escaped in the regex
    code, out, err = run(capsys, *window_args(loaded_prometheus), *hosts)
    assert code == 0, err
    assert "ws3: no agent samples" in out
    assert "ws9: no data: Prometheus has no sample of this host in the window" in out
    assert "ws9.lan: no data" in out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith("ws")]
    assert "ws1" in rows and "ws2" not in rows  # --host narrows the ledger


def test_the_table_is_aligned_and_names_the_window(loaded_prometheus, capsys):
    code, out, _ = run(capsys, *window_args(loaded_prometheus))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("== ledger: hours per host, ") and f"step {STEP_S}s" in lines[0]
    header, rule, *rows = lines[1:4]
    assert header.split() == ["host", "seen", *MODES, "asleep", "down", "silent"]
    assert set(rule) == {"-"}
    # Right-aligned figures: every row of the first table ends where the header does.
    assert all(len(r) == len(header) for r in [lines[3], lines[4]])
    assert "== hours the owner held the GPU, by reason ==" in out and "game" in out and "reboot_pending" in out
    assert "== served ==" in out and "tokens/Wh" in out


def test_csv_parses_one_row_per_host_with_the_json_figures(loaded_prometheus, document, capsys):
    code, out, _ = run(capsys, *window_args(loaded_prometheus), "--csv")
    assert code == 0
    rows = {r["host"]: r for r in csv.DictReader(io.StringIO(out))}
    assert set(rows) == set(document["hosts"]) == {"ws1", "ws2", "ws3"}
    for host in HOSTS_WITH_AGENT:
        assert float(rows[host]["serving_h"]) == pytest.approx(document["hosts"][host]["modes_h"]["serving"], abs=1e-3)
        assert float(rows[host]["tokens"]) == pytest.approx(document["hosts"][host]["tokens"], abs=1e-3)
    assert rows["ws3"]["no_data"].startswith("no agent samples") and rows["ws3"]["tokens"] == ""


def test_json_names_its_window_and_prometheus(document, loaded_prometheus):
    assert document["prometheus"] == loaded_prometheus.url
    assert document["window"] == {
        "start": loaded_prometheus.end - SPAN_S,
        "end": loaded_prometheus.end,
        "seconds": SPAN_S,
        "step_s": STEP_S,
    }


def test_an_unreachable_prometheus_is_an_error_naming_url_and_query(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed
    code, out, err = run(capsys, "--prometheus", f"http://127.0.0.1:{port}", "--since", "1h")
    assert code == 1 and out == ""
    assert f"cannot reach Prometheus at http://127.0.0.1:{port}" in err and "(query: count_over_time(" in err


def test_a_query_prometheus_refuses_is_an_error_with_its_answer(loaded_prometheus):
    prom = ledger.Prometheus(loaded_prometheus.url)
    with pytest.raises(ledger.LedgerError) as caught:
        prom.vector("sum(", loaded_prometheus.end)
    text = str(caught.value)
    assert f"Prometheus at {loaded_prometheus.url} refused the query (HTTP 400, bad_data)" in text
    assert text.endswith("(query: sum()")


class _Hostile(BaseHTTPRequestHandler):
    """A "Prometheus" that answers what the test puts in ``body``."""

    body = b""  # the answer to every instant query
    matrix = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": []}}).encode()
    seen_auth: list[str | None] = []

    def do_GET(self):
        type(self).seen_auth.append(self.headers.get("Authorization"))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(type(self).matrix if self.path.startswith("/api/v1/query_range") else type(self).body)

    def log_message(self, *args):
        pass


@pytest.fixture
def hostile():
    server = HTTPServer(("127.0.0.1", 0), _Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Hostile.seen_auth = []
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _vector(value: object, host: str = "ws1") -> bytes:
    result = [{"metric": {"host": host}, "value": [1, value]}]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-3", "12abc", None, True])
def test_a_value_that_is_not_a_count_is_refused(hostile, capsys, value):
    _, url = hostile
    _Hostile.body = _vector(value)
    code, out, err = run(capsys, "--prometheus", url, "--since", "1h")
    assert code == 1 and "is not a count (query: count_over_time(" in err


def test_a_hostile_host_label_is_printed_escaped(hostile, capsys):
    _, url = hostile
    _Hostile.body = _vector("60", host="ws1\x1b]0;owned\x07\n=cmd")
    code, out, err = run(capsys, "--prometheus", url, "--since", "1h")
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "ws1\\x1b]0;owned\\x07\\n=cmd" in out
    code, out, _ = run(capsys, "--prometheus", url, "--since", "1h", "--csv")
    assert "\x1b" not in out and not any(line.startswith("=") for line in out.splitlines())


def test_an_answer_that_is_not_prometheus_json_is_an_error(hostile, capsys):
    _, url = hostile
    _Hostile.body = b"<html>login</html>"
    code, _, err = run(capsys, "--prometheus", url, "--since", "1h")
    assert code == 1 and f"Prometheus at {url} answered HTTP 200 that is not Prometheus' JSON" in err


def test_the_token_is_read_from_a_file_or_the_environment_and_sent_as_bearer(hostile, capsys, tmp_path, monkeypatch):
    _, url = hostile
    _Hostile.body = _vector("60")
    token = tmp_path / "token"
    token.write_text("sekrit-from-file\n")
    assert run(capsys, "--prometheus", url, "--since", "1h", "--token-file", str(token))[0] == 0
    assert set(_Hostile.seen_auth) == {"Bearer sekrit-from-file"}
    _Hostile.seen_auth.clear()
    monkeypatch.setenv(ledger.TOKEN_ENV, "sekrit-from-env")
    assert run(capsys, "--prometheus", url, "--since", "1h")[0] == 0
    assert set(_Hostile.seen_auth) == {"Bearer sekrit-from-env"}
    # No option takes the token itself.
    assert not any("token" in a.dest and a.dest != "token_file" for a in ledger.build_parser()._actions)


def test_a_bad_host_name_or_duration_is_refused_before_any_query(capsys):
    assert run(capsys, "--prometheus", "http://127.0.0.1:1", "--host", 'ws1"}) or vector(1', "--since", "1h")[0] == 2
    with pytest.raises(SystemExit):
        ledger.main(["--prometheus", "http://127.0.0.1:1", "--since", "7 days"])
    assert ledger.parse_duration("1h30m") == 5400 and ledger.parse_duration("7d") == 7 * 86400


def test_the_ledger_reads_the_job_the_gateway_s_scrape_config_names():
    from freetoken_infra.core.settings import Settings

    text = scrape_config("10.0.0.1", Settings(), {"ws1": ("10.0.0.2", Settings())})
    assert f"job_name: {ledger.GUARD_JOB}\n" in text and "host: ws1" in text


def test_python_dash_m_runs_it():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "freetoken_infra.ledger", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--prometheus" in r.stdout and "--token-file" in r.stdout


def test_without_prometheus_installed_the_tests_fail_naming_the_package(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"promtool is not installed: .*apt-get install prometheus"):
        promfixture._tool("promtool", path=str(tmp_path))


def test_a_url_with_credentials_is_refused_without_printing_them(capsys):
    code, out, err = run(capsys, "--prometheus", "http://admin:hunter2@gateway:9090", "--since", "1h")
    assert code == 1 and "hunter2" not in err and "without credentials" in err
