#!/usr/bin/env python3
"""Serve a verified model directory to the rest of the fleet: the LAN model cache.

Runs ON THE CACHE HOST under the system ``python3`` as ``freetoken-model-cache.service`` (the
service user, read-only file system). The other hosts' ``fetch_model.py --source URL`` asks it
first, so the upstream hub is read once per fleet.

It speaks the one hub endpoint the downloader uses from a source,
``GET|HEAD /<owner>/<name>/resolve/<revision>/<file>`` with ``Range: bytes=N-`` / ``N-M``
(resume), and ``GET /health`` (what it holds, as JSON). It answers only for files that the
downloader's manifest vouches for right now (complete download, same size and mtime as when
their sha256 was verified; ``manifest.py``, uploaded beside this file) and only for the
manifest's repository at its commit or branch name. Anything else is 404, so a consumer falls
back to the next source. Consumers verify every byte against the upstream listing anyway.

Why not a general static server: it would also serve ``.partial/`` files, a half-replaced
revision, or a file edited after it was verified; ``python3 -m http.server`` has no Range.

A network service on a LAN nobody vouches for (issue 13): it listens on ``--bind`` only (the
deploy passes the address the fleet reaches it by, not every interface); a connection waits
for its request in one selector thread, so idle connections hold no worker (at most
``--max-connections``, the oldest idle one closed first; closed after ``--idle-timeout-s``);
a bounded pool of ``--workers`` threads answers requests, each socket operation limited to
``--timeout-s``; one request per connection. Log lines escape every control character. With
``--token-file`` (the repository is gated: the hub token, handed over as a systemd credential)
every request must carry ``X-FreeToken-Cache-Token``, a key derived from that token
(``cache_token``), which the fetcher sends to its sources: gated weights go only to hosts that
hold the token, and the hub token itself never crosses the LAN.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import selectors
import socket
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if TYPE_CHECKING:  # the same module, as the type checker finds it in the checkout
    from freetoken_infra.core import manifest as manifest_rules
else:
    try:  # uploaded beside this script on the target
        import manifest as manifest_rules
    except ImportError:  # run from a checkout of the project
        sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))
        from freetoken_infra.core import manifest as manifest_rules


TOKEN_HEADER = "X-FreeToken-Cache-Token"
_CACHE_TOKEN_CONTEXT = b"freetoken-infra model cache v1"


def cache_token(hub_token: str) -> str:
    """The key a gated cache asks for, derived from the hub token (the fetcher derives the same
    one): knowing it does not give the hub token back."""
    return hmac.new(hub_token.encode("utf-8"), _CACHE_TOKEN_CONTEXT, hashlib.sha256).hexdigest()


def printable(text: str) -> str:
    """``text`` with every control character (C0, DEL, C1) and backslash escaped: a client's
    request line cannot start a forged journal line or colour the terminal."""
    out = []
    for c in text:
        o = ord(c)
        if c == "\\":
            out.append("\\\\")
        elif o < 0x20 or 0x7F <= o <= 0x9F:
            out.append(f"\\x{o:02x}")
        else:
            out.append(c)
    return "".join(out)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """``(first, last)`` of a single byte range; None for no/ignored Range; "unsatisfiable"."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first_s, _, last_s = header[6:].strip().partition("-")
    try:
        if first_s == "":  # suffix: the last N bytes
            n = int(last_s)
            return (max(0, size - n), size - 1) if n > 0 and size else "unsatisfiable"
        first = int(first_s)
        last = int(last_s) if last_s else size - 1
    except ValueError:
        return None
    if first >= size or last < first:
        return "unsatisfiable"
    return first, min(last, size - 1)


class Handler(BaseHTTPRequestHandler):
    server_version = "freetoken-model-cache/1"
    # One request per connection: a kept-alive connection would hold its worker while idle.
    protocol_version = "HTTP/1.0"
    model_dir = "."
    token: str | None = None  # the derived cache token when the repository is gated
    timeout = 30.0  # every socket operation of a request (StreamRequestHandler sets it)

    def log_message(self, fmt, *args):  # one journal line per request, no client headers
        sys.stderr.write(printable(f"{self.address_string()} {fmt % args}") + "\n")
        sys.stderr.flush()

    def _allowed(self) -> bool:
        if self.token is None:
            return True
        given = self.headers.get(TOKEN_HEADER) or ""
        if hmac.compare_digest(given.encode("utf-8", "replace"), self.token.encode("ascii")):
            return True
        self._send_json(401, {"error": f"this cache serves a gated repository: send {TOKEN_HEADER}"})
        return False

    def _send_json(self, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode() + b"\n"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _not_found(self, why: str) -> None:
        self._send_json(404, {"error": why})

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        if not self._allowed():
            return
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        m = manifest_rules.load(self.model_dir)[0]
        if path == "/health":
            return self._send_json(
                200,
                {
                    "repo": (m or {}).get("repo"),
                    "commit": (m or {}).get("commit"),
                    "revision": (m or {}).get("revision"),
                    "complete": bool(m and m.get("complete")),
                    "files": len((m or {}).get("files") or {}),
                },
            )
        parts = path.lstrip("/").split("/", 4)
        if len(parts) != 5 or parts[2] != "resolve":
            return self._not_found("not a /<owner>/<name>/resolve/<revision>/<file> path")
        repo, revision, name = f"{parts[0]}/{parts[1]}", parts[3], parts[4]
        if m is None or m.get("repo") != repo or revision not in (m.get("commit"), m.get("revision")):
            return self._not_found(f"this cache does not hold {repo}@{revision}")
        entry = (m.get("files") or {}).get(name)
        full = os.path.join(self.model_dir, name)
        if not isinstance(entry, dict) or os.path.relpath(full, self.model_dir).startswith(".."):
            return self._not_found(f"{name} is not a verified file of {repo}")
        try:
            f = open(full, "rb")
        except OSError:
            return self._not_found(f"{name} is not a verified file of {repo}")
        with f:
            st = os.fstat(f.fileno())
            if (st.st_size, st.st_mtime_ns) != (entry.get("size"), entry.get("mtime_ns")):
                return self._not_found(f"{name} changed since it was verified")
            rng = parse_range(self.headers.get("Range"), st.st_size)
            if rng == "unsatisfiable":
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{st.st_size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            first, last = rng if isinstance(rng, tuple) else (0, st.st_size - 1)
            self.send_response(206 if isinstance(rng, tuple) else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(last - first + 1))
            if isinstance(rng, tuple):
                self.send_header("Content-Range", f"bytes {first}-{last}/{st.st_size}")
            digest = entry.get("sha256")
            if digest:
                self.send_header("ETag", f'"{digest}"')
            self.end_headers()
            if self.command != "HEAD" and last >= first:
                try:
                    self.connection.sendfile(f, first, last - first + 1)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True


class CacheServer:
    """Accepts connections and waits for their first bytes in one thread (a selector), then
    hands each ready connection to a bounded pool of workers; idle connections cost a file
    descriptor, never a worker, and are closed after ``idle_timeout_s``."""

    def __init__(
        self,
        bind: str,
        port: int,
        handler: type,
        workers: int = 8,
        idle_timeout_s: float = 30.0,
        max_connections: int = 512,
    ):
        info = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        self.listener = socket.socket(info[0], socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(info[4])
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.server_address = self.listener.getsockname()
        self.handler = handler
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="model-cache")
        self.selector = selectors.DefaultSelector()
        self.waiting: dict[socket.socket, tuple[float, object]] = {}  # conn -> (since, address)
        self._stop = threading.Event()

    def _close(self, conn: socket.socket) -> None:
        self.waiting.pop(conn, None)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: try again on the next event
                sys.stderr.write(printable(f"model_cache: accept failed: {exc}") + "\n")
                return
            if len(self.waiting) >= self.max_connections:
                oldest = min(self.waiting, key=lambda c: self.waiting[c][0])
                self._close(oldest)
            conn.setblocking(False)
            self.waiting[conn] = (time.monotonic(), address)
            self.selector.register(conn, selectors.EVENT_READ)

    def _serve_one(self, conn: socket.socket, address) -> None:
        try:
            conn.setblocking(True)
            self.handler(conn, address, self)
        except Exception as exc:
            sys.stderr.write(printable(f"model_cache: {address[0]}: {type(exc).__name__}: {exc}") + "\n")
        finally:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def serve_forever(self) -> None:
        self.selector.register(self.listener, selectors.EVENT_READ)
        while not self._stop.is_set():
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self.listener:
                    self._accept()
                    continue
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                entry = self.waiting.pop(conn, None)
                if entry is None:  # closed this round to make room (``_accept``): its event is stale
                    continue
                _, address = entry
                self.selector.unregister(conn)
                self.pool.submit(self._serve_one, conn, address)
            deadline = time.monotonic() - self.idle_timeout_s
            for conn in [c for c, (since, _) in self.waiting.items() if since < deadline]:
                self._close(conn)

    def shutdown(self) -> None:
        self._stop.set()


def read_token(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as exc:
        raise SystemExit(f"model_cache: cannot read the token file {path}: {exc.strerror}") from None
    if not token:
        raise SystemExit(f"model_cache: the token file {path} is empty")
    return token


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="model_cache.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the verified model directory (with its manifest)")
    p.add_argument("--bind", required=True, help="address to listen on: the one the fleet reaches this host by")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--workers", type=int, default=8, help="requests answered at once")
    p.add_argument(
        "--max-connections",
        type=int,
        default=512,
        help="connections waiting for their request; the oldest is closed beyond it",
    )
    p.add_argument(
        "--idle-timeout-s", type=float, default=30.0, help="close a connection that sent no request for this long"
    )
    p.add_argument("--timeout-s", type=float, default=30.0, help="limit of each socket read or write")
    p.add_argument(
        "--token-file",
        help="the hub token (gated repository): ask every client for the "
        f"key derived from it ({TOKEN_HEADER}); never pass the token itself",
    )
    args = p.parse_args(argv)
    Handler.model_dir = os.path.abspath(args.dir)
    Handler.timeout = args.timeout_s
    Handler.token = cache_token(read_token(args.token_file)) if args.token_file else None
    server = CacheServer(
        args.bind,
        args.port,
        Handler,
        workers=args.workers,
        idle_timeout_s=args.idle_timeout_s,
        max_connections=args.max_connections,
    )
    gated = "; gated: clients must send the cache token" if Handler.token else ""
    sys.stderr.write(
        printable(
            f"model_cache: serving the verified files of {Handler.model_dir} on "
            f"{args.bind}:{server.server_address[1]}{gated}"
        )
        + "\n"
    )
    sys.stderr.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
