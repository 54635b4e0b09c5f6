#!/usr/bin/env python3
"""Health gate for one FreeToken endpoint, run ON THE TARGET by the system python3.

Standard library only (the target's system Python has nothing else), Python >= 3.8.

Usage:
    health_gate.py --url http://127.0.0.1:8000 --timeout 600 --model NAME
                   [--key-file /etc/freetoken/api.env] [--max-tokens 64] [--json-out F]
                   [--expect-version 0.2.2]

Phases, each must pass before the next:

1. health - poll ``GET /health`` until its JSON says ``status: ok``. FreeToken answers 200 from
   the moment it binds, with ``status: loading`` (phase + byte progress) while weights load, so
   readiness is read from the JSON, never from the status code. ``status: error`` fails at once
   with the engine's message; no ``ok`` within --timeout (connection refused included) fails.
   A progress line is printed at most every 2 s.
   version - with --expect-version, the version /health reports once ok must be that one: the
   engine serving is the one this run installed (not one another run switched to meanwhile).
2. chat - one non-streamed ``POST /v1/chat/completions`` at temperature 0 asks a question with
   one right answer (the sum of two random two-digit numbers) and must return a choice with text.
   answer - the last number in that text must be the sum: an engine that streams garbage
   (broken kernels, a bad shard) answers wrongly although it answers.
3. stream - one streamed chat completion measures decode speed:
   (completion tokens - 1) / (time of last token - time of first token), so that the prompt's
   prefill and the first token's latency are left out. Completion tokens come from the usage
   chunk (``stream_options.include_usage``) when the engine sends one, else from the number of
   content chunks.

The API key is read from --key-file (an env-style file with ``FREETOKEN_API_KEY=...``, the one
the service reads), never from the command line (which ``ps`` shows to every user) and it is
never printed.

Output: progress lines, then ONE final JSON line (also written to --json-out), a
``GateResult`` of ``freetoken_infra/core/gate_record.py`` (uploaded beside this script, the one
schema the controller reads it with):
    {"ok": bool, "phase": "health"|"version"|"chat"|"answer"|"stream"|"done", "load_wait_s": float|null,
     "decode_tps": float|null, "completion_tokens": int|null, "error": str|null,
     "version": str|null, ...}
``version`` is the engine version ``/health`` reported once ok (null before that); ``question``
and ``answer`` what was asked and answered (answer: its first 200 characters).
``phase`` is where the gate stopped ("done" when everything passed). Exit 0 only when ok.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

HERE = os.path.dirname(os.path.abspath(__file__))
# The core modules: uploaded beside this script on the target, else the package of its checkout.
sys.path.insert(0, HERE if os.path.isfile(f"{HERE}/gate_record.py") else os.path.dirname(os.path.dirname(HERE)))
if TYPE_CHECKING or sys.path[0] != HERE:  # the type checker, or a checkout
    from freetoken_infra.core import gate_record
else:
    import gate_record

KEY_VARIABLE = "FREETOKEN_API_KEY"
POLL_INTERVAL_S = 0.5
PROGRESS_EVERY_S = 2.0
# One inference request may take this long (a cold first request compiles kernels).
REQUEST_TIMEOUT_S = 180.0
PROMPT = "Reply with one short sentence: are you ready?"
# Room for a model that thinks aloud before it answers (a few tokens for the number itself).
ANSWER_MAX_TOKENS = 256
QUESTION = "What is {a} + {b}? Answer with the number only."
_NUMBER = re.compile(r"-?\d+")


# The gate talks to the engine on this host (loopback or the host's own LAN address) only: an
# http_proxy in the environment must never see the request, which carries the API key.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# freetoken_infra/core/text.py ``printable``, copied (the deploy uploads only the gate record's
# schema beside this script). A test keeps the two the same.
_FORMAT_CONTROLS = frozenset(
    [0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C, 0xFEFF]
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: object) -> str:
    """Untrusted text with every control character written as a visible escape."""
    text = text if isinstance(text, str) else str(text)
    if text.isprintable():
        return text
    out = []
    for c in text:
        o = ord(c)
        if c in _NAMED:
            out.append(_NAMED[c])
        elif o < 0x20 or 0x7F <= o <= 0x9F:
            out.append(f"\\x{o:02x}")
        elif o in _FORMAT_CONTROLS:
            out.append(f"\\u{o:04x}")
        else:
            out.append(c)
    return "".join(out)


class GateFailure(Exception):
    """A phase failed; the message says why (never contains the key)."""


def read_key(path: str) -> str:
    """The FREETOKEN_API_KEY value of an env-style file (systemd EnvironmentFile syntax)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise GateFailure(f"cannot read the key file {path}: {exc.strerror or exc}") from None
    for line in lines:
        line = line.strip()
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        name, sep, value = line.partition("=")
        if sep and name.strip() == KEY_VARIABLE:
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            if not value:
                raise GateFailure(f"{KEY_VARIABLE} is empty in {path}")
            return value
    raise GateFailure(f"no {KEY_VARIABLE}= line in the key file {path}")


def _size_pair(done: int, total: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if total >= scale:
            return f"{done / scale:.1f}/{total / scale:.1f} {unit}"
    return f"{done}/{total} B"


def describe_loading(doc: dict) -> str:
    """``loading: expert_banks 45% (9.9/22.0 GB)`` from a /health loading document."""
    phase = doc.get("phase") or "starting"
    progress = doc.get("progress") or {}
    try:
        done = int(progress.get("done_bytes") or 0)
        total = int(progress.get("total_bytes") or 0)
    except (TypeError, ValueError):
        done = total = 0
    if total > 0:
        return f"loading: {phase} {100 * done // total}% ({_size_pair(done, total)})"
    return f"loading: {phase}"


def _http_error_text(exc: urllib.error.HTTPError) -> str:
    try:
        body = exc.read().decode("utf-8", "replace").strip()
    except Exception:
        body = ""
    text = f"HTTP {exc.code} {exc.reason}"
    return f"{text}: {body[:300]}" if body else text


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def check_answer(question: str, expected: int, text: str) -> None:
    """The answer phase: the last number in the reply must be ``expected``."""
    numbers = _NUMBER.findall(text)
    if not numbers or int(numbers[-1]) != expected:
        raise GateFailure(
            f"wrong answer: asked {question!r}, expected {expected}, the engine answered {text.strip()[:120]!r}"
        )


class Gate:
    def __init__(self, url: str, model: str, key: str | None, timeout_s: float, max_tokens: int, out=sys.stdout):
        self.url = url.rstrip("/")
        self.model = model
        self.key = key
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self.out = out
        self.version: str | None = None  # the engine's version from /health once ok

    def say(self, line: str) -> None:
        # The engine's phase, version, model and message reach the operator's terminal.
        print(printable(line), file=self.out, flush=True)

    # ------------------------------------------------------------------ phase 1
    def wait_healthy(self) -> float:
        """Seconds until /health said ok; GateFailure on error status or timeout."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        last_print = None
        last_seen = "no answer yet"
        while True:
            now = time.monotonic()
            try:
                with _OPENER.open(self.url + "/health", timeout=5) as resp:
                    raw = resp.read()
                doc = json.loads(raw.decode("utf-8", "replace"))
                if not isinstance(doc, dict):
                    raise ValueError("not a JSON object")
            except urllib.error.HTTPError as exc:
                # FreeToken always answers 200; anything else is something in between.
                last_seen = _http_error_text(exc)
                doc = None
            except ValueError as exc:
                last_seen = f"/health did not answer JSON ({exc})"
                doc = None
            except (OSError, urllib.error.URLError) as exc:
                last_seen = _reason(exc)
                doc = None
            if doc is not None:
                status = doc.get("status")
                if status == "ok":
                    waited = time.monotonic() - start
                    version = doc.get("version")
                    self.version = str(version) if version is not None else None
                    self.say(
                        f"ready after {waited:.1f} s"
                        + (f" (freetoken {version}, model {doc.get('model')})" if version else "")
                    )
                    return waited
                if status == "error":
                    raise GateFailure(f"engine reports error: {doc.get('message') or '(no message)'}")
                last_seen = describe_loading(doc) if status == "loading" else f"/health status {status!r}"
            if now >= deadline:
                raise GateFailure(f"not ready after {self.timeout_s:g} s (last seen: {last_seen})")
            if last_print is None or now - last_print >= PROGRESS_EVERY_S:
                self.say(
                    f"{last_seen} [{now - start:.0f} s]"
                    if doc is not None
                    else f"waiting: {last_seen} [{now - start:.0f} s]"
                )
                last_print = now
            time.sleep(max(0.0, min(POLL_INTERVAL_S, deadline - time.monotonic())))

    # ------------------------------------------------------------------ requests
    def _request(self, body: dict):
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.key is not None:
            headers["Authorization"] = "Bearer " + self.key
        req = urllib.request.Request(
            self.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            return _OPENER.open(req, timeout=REQUEST_TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            raise GateFailure(f"POST /v1/chat/completions: {_http_error_text(exc)}") from None
        except (OSError, urllib.error.URLError) as exc:
            raise GateFailure(f"POST /v1/chat/completions: {_reason(exc)}") from None

    def _messages(self) -> list:
        return [{"role": "user", "content": PROMPT}]

    # ------------------------------------------------------------------ phase 2
    def chat(self, question: str) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": ANSWER_MAX_TOKENS,
            "temperature": 0,
            "stream": False,
        }
        try:
            with self._request(body) as resp:
                doc = json.loads(resp.read().decode("utf-8", "replace"))
        except ValueError as exc:
            raise GateFailure(f"chat completion is not JSON ({exc})") from None
        except (OSError, urllib.error.URLError) as exc:
            raise GateFailure(f"chat completion: {_reason(exc)}") from None
        choices = doc.get("choices") if isinstance(doc, dict) else None
        if not choices or not isinstance(choices[0], dict):
            raise GateFailure(f"chat completion has no choices: {json.dumps(doc)[:300]}")
        message = choices[0].get("message") or {}
        # The answer is the content; a thinking model's reasoning is not an answer.
        text = message.get("content") or ""
        if not isinstance(text, str) or not text.strip():
            raise GateFailure(f"chat completion returned no content: {json.dumps(choices[0])[:300]}")
        self.say(f"chat ok: {text.strip()[:60]!r}")
        return text

    # ------------------------------------------------------------------ phase 3
    def stream(self) -> tuple:
        """(decode tok/s or None, completion tokens)."""
        body = {
            "model": self.model,
            "messages": self._messages(),
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        first = last = None
        chunks = 0
        usage_tokens = None
        done = False
        try:
            with self._request(body) as resp:
                for raw in resp:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        doc = json.loads(data)
                    except ValueError:
                        raise GateFailure(f"stream chunk is not JSON: {data[:200]}") from None
                    if not isinstance(doc, dict):
                        continue
                    if doc.get("error"):
                        raise GateFailure(f"stream error: {json.dumps(doc['error'])[:300]}")
                    usage = doc.get("usage")
                    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                        usage_tokens = usage["completion_tokens"]
                    for choice in doc.get("choices") or []:
                        delta = choice.get("delta") or {}
                        if delta.get("content") or delta.get("reasoning_content"):
                            t = time.monotonic()
                            first = t if first is None else first
                            last = t
                            chunks += 1
        except (OSError, urllib.error.URLError) as exc:
            raise GateFailure(f"stream broke after {chunks} chunks: {_reason(exc)}") from None
        if chunks == 0:
            raise GateFailure("streamed chat completion returned no tokens")
        if not done and usage_tokens is None:
            raise GateFailure(f"stream ended after {chunks} chunks without [DONE]")
        tokens = usage_tokens if usage_tokens else chunks
        span = (last - first) if first is not None and last is not None else 0.0
        tps = (tokens - 1) / span if tokens > 1 and span > 0 else None
        self.say(
            f"stream ok: {tokens} tokens, decode "
            + (f"{tps:.1f} tok/s" if tps is not None else "not measurable (fewer than 2 tokens)")
        )
        return tps, tokens


def run(args, out=sys.stdout, rng: random.Random | None = None) -> gate_record.GateResult:
    result: dict = {"ok": False, "phase": "health"}
    rng = rng or random.Random()
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    try:
        key = read_key(args.key_file) if args.key_file else None
        gate = Gate(args.url, args.model, key, args.timeout, args.max_tokens, out=out)
        result["load_wait_s"] = round(gate.wait_healthy(), 2)
        result["version"] = gate.version
        result["phase"] = "version"
        expect = getattr(args, "expect_version", None)
        if expect and gate.version != expect:
            raise GateFailure(
                f"the engine serving reports version {gate.version}, not {expect} that this "
                "run installed (another run or a person changed the host meanwhile)"
            )
        result["phase"] = "chat"
        question = result["question"] = QUESTION.format(a=a, b=b)
        text = gate.chat(question)
        result["answer"] = text.strip()[:200]
        result["phase"] = "answer"
        check_answer(question, a + b, text)
        result["phase"] = "stream"
        tps, tokens = gate.stream()
        result["decode_tps"] = round(tps, 2) if tps is not None else None
        result["completion_tokens"] = tokens
        result["phase"] = "done"
        result["ok"] = True
    except GateFailure as exc:
        result["error"] = str(exc)
    except KeyboardInterrupt:
        result["error"] = "interrupted"
    return gate_record.GateResult(**result)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Wait for a FreeToken endpoint and check it serves.")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of the engine")
    parser.add_argument("--timeout", type=float, required=True, help="seconds to wait for /health ok")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--key-file", help=f"env-style file with {KEY_VARIABLE}=... (no key: no auth)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of the measured stream")
    parser.add_argument("--json-out", help="also write the final JSON result to this file")
    parser.add_argument("--expect-version", help="fail unless /health reports this engine version")
    args = parser.parse_args(argv)
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2 to measure decode speed")
    result = run(args)
    line = result.to_json()
    print(line, flush=True)
    if args.json_out:
        try:
            with open(args.json_out, "w", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as exc:
            print(f"cannot write {args.json_out}: {exc}", file=sys.stderr)
            return 1
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
