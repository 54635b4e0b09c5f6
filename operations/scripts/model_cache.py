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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:  # uploaded beside this script on the target
    import manifest as manifest_rules
except ImportError:  # run from a checkout of the project
    sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))
    from freetoken_infra.core import manifest as manifest_rules  # type: ignore[no-redef]


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
    protocol_version = "HTTP/1.1"
    model_dir = "."

    def log_message(self, fmt, *args):  # one journal line per request, no client headers
        sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))

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
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        m = manifest_rules.load(self.model_dir)[0]
        if path == "/health":
            return self._send_json(200, {
                "repo": (m or {}).get("repo"), "commit": (m or {}).get("commit"),
                "revision": (m or {}).get("revision"), "complete": bool(m and m.get("complete")),
                "files": len((m or {}).get("files") or {}),
            })
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="model_cache.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the verified model directory (with its manifest)")
    p.add_argument("--bind", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8090)
    args = p.parse_args(argv)
    Handler.model_dir = os.path.abspath(args.dir)
    server = ThreadingHTTPServer((args.bind, args.port), Handler)
    server.daemon_threads = True
    sys.stderr.write(f"model_cache: serving the verified files of {Handler.model_dir} on "
                     f"{args.bind}:{server.server_address[1]}\n")
    sys.stderr.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
