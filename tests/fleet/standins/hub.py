"""STAND-IN for the Hugging Face hub (huggingface.co or a hub mirror given as the endpoint).

The test hosts reach no hub, so this stdlib-only threaded HTTP server serves the repositories
written by ``hub_repos.py`` over the same HTTP endpoints, headers and error forms that
``huggingface_hub`` 1.x (``snapshot_download``, ``hf_hub_download``, ``HfApi.model_info``,
``list_repo_tree``) and our own downloader read:

* ``GET /api/models/{repo_id}`` and ``/api/models/{repo_id}/revision/{revision}``: repo info
  ``{"id", "modelId", "sha", "siblings": [{"rfilename"}], "private", "gated", "lastModified",
  "tags", ...}``; ``?blobs=true`` adds ``size``, ``blobId`` and ``lfs: {sha256, size,
  pointerSize}`` per sibling.
* ``GET /api/models/{repo_id}/tree/{revision}[/{path}]`` (``?recursive=true``): a list of
  ``{"type": "file", "oid", "size", "path", "lfs": {"oid", "size", "pointerSize"}}``. As on the
  real hub, ``oid`` is the git blob sha1 - for LFS files (``*.safetensors``, ``tokenizer.json``)
  the sha1 of the LFS *pointer* blob, and ``lfs.oid`` the sha256 of the content.
* ``HEAD``/``GET /{repo_id}/resolve/{revision}/{filename}``: ``X-Repo-Commit``, quoted
  ``ETag`` (sha256 for LFS files, git blob sha1 otherwise), ``X-Linked-Etag`` and
  ``X-Linked-Size`` for LFS files, ``Content-Length``, ``Accept-Ranges: bytes``,
  ``Content-Type``. ``Range: bytes=N-``, ``bytes=N-M``, ``bytes=-K`` -> 206 with
  ``Content-Range``; unsatisfiable -> 416. The real hub answers LFS files with a 302 to its
  CDN; this stand-in serves them directly (the client reads the same X-Linked-* headers).
  Revisions: ``main`` or the full commit sha.
* Failure modes, with the real ``X-Error-Code`` header the client maps to its exceptions:
  unknown repo -> 404 ``RepoNotFound`` + ``{"error": "Repository Not Found"}``; unknown
  revision -> 404 ``RevisionNotFound``; unknown file -> 404 ``EntryNotFound`` (with
  ``X-Repo-Commit``); with ``--require-token-file`` a missing/wrong ``Authorization: Bearer``
  token -> 401 ``GatedRepo``. A dropped link is imitated by the cut switch below.

Switches for fault tests and benchmarks (same server, under ``/_standin/``):
  ``POST /_standin/cut`` ``{"after_bytes": N, "times": 1}`` - the next ``times`` file transfers
  close the connection after N body bytes; ``POST /_standin/throttle`` ``{"bytes_per_s": N}``
  (0 = unlimited) - pace file bodies; ``POST /_standin/listing`` ``{"sizes": {"file": N}}`` - a
  hostile listing: the API (siblings and tree) lists these sizes (negative, a float, a string)
  instead of the files' real ones; ``GET /_standin/stats`` -> ``{"bytes_sent", "by_file":
  {"repo/file": bytes}, "requests"}``; ``POST /_standin/reset`` clears stats and switches.

One log line per request goes to stderr (never the Authorization header or token).

Usage: ``python3 -m tests.fleet.standins.hub --bind ADDR --port PORT --repos DIR
[--require-token-file PATH]``
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

MANIFEST = "repos.json"
LFS_PATTERNS = (re.compile(r".*\.safetensors$"), re.compile(r"(^|.*/)tokenizer\.json$"))
CHUNK = 64 * 1024


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _content_type(name: str) -> str:
    if name.endswith(".json"):
        return "application/json"
    if name.endswith(".md") or name.endswith(".txt") or name == ".gitattributes":
        return "text/plain; charset=utf-8"
    return "application/octet-stream"


class FileEntry:
    def __init__(self, path: str, rel: str):
        self.path = path
        self.rel = rel
        with open(path, "rb") as f:
            data = f.read()
        self.size = len(data)
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.is_lfs = any(p.match(rel) for p in LFS_PATTERNS)
        if self.is_lfs:
            pointer = lfs_pointer(self.sha256, self.size)
            self.pointer_size = len(pointer)
            self.oid = git_blob_sha1(pointer)
        else:
            self.pointer_size = None
            self.oid = git_blob_sha1(data)

    @property
    def etag(self) -> str:
        return self.sha256 if self.is_lfs else self.oid


class Repo:
    def __init__(self, root: str, repo_id: str, info: dict):
        self.repo_id = repo_id
        self.sha = info["sha"]
        self.revisions = dict(info.get("revisions") or {"main": self.sha})
        self.last_modified = info.get("lastModified", "2026-01-01T00:00:00.000Z")
        base = os.path.join(root, *repo_id.split("/"))
        self.files: dict[str, FileEntry] = {}
        for dirpath, _dirs, names in os.walk(base):
            for name in names:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, base).replace(os.sep, "/")
                self.files[rel] = FileEntry(full, rel)

    def resolve_revision(self, revision: str) -> str | None:
        if revision in self.revisions:
            return self.revisions[revision]
        if revision == self.sha:
            return self.sha
        return None


class State:
    def __init__(self, repos: dict[str, Repo], tokens: list[str] | None):
        self.repos = repos
        self.tokens = tokens
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.bytes_sent = 0
            self.by_file: dict[str, int] = {}
            self.requests = 0
            self.cut_after: int | None = None
            self.cut_times = 0
            self.bytes_per_s = 0.0
            self.listed_sizes: dict[str, object] = {}  # a hostile listing's sizes, by file name

    def listed_size(self, name: str, real: int) -> object:
        with self.lock:
            return self.listed_sizes.get(name, real)

    def take_cut(self) -> int | None:
        with self.lock:
            if self.cut_after is not None and self.cut_times > 0:
                self.cut_times -= 1
                after = self.cut_after
                if self.cut_times == 0:
                    self.cut_after = None
                return after
            return None

    def count(self, key: str, n: int) -> None:
        with self.lock:
            self.bytes_sent += n
            self.by_file[key] = self.by_file.get(key, 0) + n

    def token_ok(self, header: str | None) -> bool:
        if self.tokens is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        return any(hmac.compare_digest(token.strip().encode(), t.encode()) for t in self.tokens)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hub-standin/1"
    state: State  # set on the subclass by make_server

    # ------------------------------------------------------------ plumbing
    def log_message(self, fmt, *args):  # one line per request, never headers
        sys.stderr.write(f"{self.client_address[0]} - [{self.log_date_time_string()}] {fmt % args}\n")

    def _send_json(self, status: int, obj, headers: dict | None = None, head: bool = False) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str, head: bool = False, extra: dict | None = None):
        headers = dict(extra or {})
        if code:
            headers["X-Error-Code"] = code
        headers["X-Error-Message"] = message
        self._send_json(status, {"error": message}, headers, head=head)

    def _read_json_body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw or b"{}")

    # ------------------------------------------------------------ dispatch
    def do_HEAD(self):
        self._dispatch(head=True)

    def do_GET(self):
        self._dispatch(head=False)

    def do_POST(self):
        path = urlsplit(self.path).path
        if path.startswith("/_standin/"):
            return self._standin(path)
        self._error(405, None, "Method Not Allowed")

    def _dispatch(self, head: bool) -> None:
        parts = urlsplit(self.path)
        path, query = parts.path, parse_qs(parts.query)
        if path.startswith("/_standin/"):
            return self._standin(path)
        with self.state.lock:
            self.state.requests += 1
        m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(?:/(.*))?)?/?$", path)
        if m:
            repo_id, kind, revision, sub = m.group(1), m.group(2), m.group(3), m.group(4)
            revision = unquote(revision) if revision else "main"
            return self._api(repo_id, kind or "revision", revision, unquote(sub or ""), query, head)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._resolve(m.group(1), unquote(m.group(2)), unquote(m.group(3)), head)
        self._error(404, None, "Not Found", head=head)

    def _lookup(self, repo_id: str, revision: str, head: bool):
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository Not Found", head=head)
            return None, None
        if not self.state.token_ok(self.headers.get("Authorization")):
            self._error(
                401,
                "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to it and be "
                "authenticated to access it. Please log in.",
                head=head,
            )
            return None, None
        sha = repo.resolve_revision(revision)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head=head)
            return None, None
        return repo, sha

    # ------------------------------------------------------------ /api/models
    def _api(self, repo_id, kind, revision, sub, query, head):
        repo, sha = self._lookup(repo_id, revision, head)
        if repo is None:
            return
        if kind == "tree":
            return self._tree(repo, sub, query, head)
        blobs = (query.get("blobs") or ["false"])[0].lower() in ("1", "true")
        siblings = []
        for name in sorted(repo.files):
            entry = repo.files[name]
            sib = {"rfilename": name}
            if blobs:
                size = self.state.listed_size(name, entry.size)
                sib["size"] = size
                sib["blobId"] = entry.oid
                if entry.is_lfs:
                    sib["lfs"] = {"sha256": entry.sha256, "size": size, "pointerSize": entry.pointer_size}
            siblings.append(sib)
        used = sum(e.size for e in repo.files.values())
        info = {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": sha,
            "lastModified": repo.last_modified,
            "createdAt": repo.last_modified,
            "private": False,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "library_name": "transformers",
            "pipeline_tag": "text-generation",
            "tags": [],
            "siblings": siblings,
            "spaces": [],
            "usedStorage": used,
        }
        self._send_json(200, info, head=head)

    def _tree(self, repo, sub, query, head):
        recursive = (query.get("recursive") or ["false"])[0].lower() in ("1", "true")
        prefix = sub.strip("/")
        if prefix and prefix in repo.files:
            return self._error(404, "EntryNotFound", f"{prefix} is not a directory", head=head)
        out, dirs = [], set()
        for name in sorted(repo.files):
            if prefix and not name.startswith(prefix + "/"):
                continue
            rest = name[len(prefix) + 1 :] if prefix else name
            if "/" in rest and not recursive:
                d = (prefix + "/" if prefix else "") + rest.split("/")[0]
                if d not in dirs:
                    dirs.add(d)
                    out.append({"type": "directory", "oid": git_blob_sha1(d.encode()), "size": 0, "path": d})
                continue
            entry = repo.files[name]
            size = self.state.listed_size(name, entry.size)
            item = {"type": "file", "oid": entry.oid, "size": size, "path": name}
            if entry.is_lfs:
                item["lfs"] = {"oid": entry.sha256, "size": size, "pointerSize": entry.pointer_size}
            out.append(item)
        if prefix and not out:
            return self._error(404, "EntryNotFound", f"{prefix} does not exist", head=head)
        self._send_json(200, out, head=head)

    # ------------------------------------------------------------ resolve
    def _resolve(self, repo_id, revision, filename, head):
        repo, sha = self._lookup(repo_id, revision, head)
        if repo is None:
            return
        entry = repo.files.get(filename)
        if entry is None:
            return self._error(404, "EntryNotFound", "Entry not found", head=head, extra={"X-Repo-Commit": sha})
        start, end = 0, entry.size - 1
        status = 200
        rng = self.headers.get("Range")
        if rng:
            m = re.match(r"^bytes=(\d*)-(\d*)$", rng.strip())
            ok = False
            if m and (m.group(1) or m.group(2)):
                if m.group(1):
                    start = int(m.group(1))
                    end = min(int(m.group(2)), entry.size - 1) if m.group(2) else entry.size - 1
                else:
                    start = max(0, entry.size - int(m.group(2)))
                ok = start < entry.size and start <= end
            if not ok:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{entry.size}")
                self.send_header("Content-Length", "0")
                self.send_header("X-Repo-Commit", sha)
                self.end_headers()
                return
            status = 206
        length = end - start + 1 if entry.size else 0
        self.send_response(status)
        self.send_header("Content-Type", _content_type(filename))
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", f'"{entry.etag}"')
        if entry.is_lfs:
            self.send_header("X-Linked-Etag", f'"{entry.sha256}"')
            self.send_header("X-Linked-Size", str(entry.size))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{entry.size}")
        self.end_headers()
        if head or length == 0:
            return
        cut = self.state.take_cut()
        key = f"{repo_id}/{filename}"
        remaining = length
        sent = 0
        t0 = time.monotonic()
        with open(entry.path, "rb") as f:
            f.seek(start)
            while remaining > 0:
                n = min(CHUNK, remaining)
                if cut is not None:
                    n = min(n, cut - sent)
                    if n <= 0:
                        break
                chunk = f.read(n)
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                    return
                sent += len(chunk)
                remaining -= len(chunk)
                self.state.count(key, len(chunk))
                bps = self.state.bytes_per_s
                if bps > 0:
                    ahead = sent / bps - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
        if remaining > 0:  # the cut switch: drop the link mid-body
            self.wfile.flush()
            self.close_connection = True
            try:
                import socket

                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ------------------------------------------------------------ switches
    def _standin(self, path: str) -> None:
        st = self.state
        try:
            if path == "/_standin/stats" and self.command == "GET":
                with st.lock:
                    doc = {"bytes_sent": st.bytes_sent, "by_file": dict(st.by_file), "requests": st.requests}
                return self._send_json(200, doc)
            if self.command != "POST":
                return self._error(405, None, "Method Not Allowed")
            body = self._read_json_body()
            if path == "/_standin/reset":
                st.reset()
                return self._send_json(200, {"ok": True})
            if path == "/_standin/cut":
                after = int(body["after_bytes"])
                times = int(body.get("times", 1))
                if after < 0 or times < 0:
                    raise ValueError("after_bytes and times must be >= 0")
                with st.lock:
                    st.cut_after, st.cut_times = (after, times) if times else (None, 0)
                return self._send_json(200, {"ok": True, "after_bytes": after, "times": times})
            if path == "/_standin/throttle":
                bps = float(body.get("bytes_per_s", 0))
                with st.lock:
                    st.bytes_per_s = max(0.0, bps)
                return self._send_json(200, {"ok": True, "bytes_per_s": st.bytes_per_s})
            if path == "/_standin/listing":
                sizes = body["sizes"]
                if not isinstance(sizes, dict):
                    raise ValueError("sizes must be an object of file name -> listed size")
                with st.lock:
                    st.listed_sizes = dict(sizes)
                return self._send_json(200, {"ok": True, "sizes": sizes})
        except (KeyError, ValueError, TypeError) as exc:
            return self._error(400, None, f"bad request: {exc}")
        self._error(404, None, "Not Found")


def load_repos(root: str) -> dict[str, Repo]:
    with open(os.path.join(root, MANIFEST)) as f:
        manifest = json.load(f)
    return {repo_id: Repo(root, repo_id, info) for repo_id, info in manifest["repos"].items()}


def make_server(bind: str, port: int, repos_dir: str, token_file: str | None = None) -> ThreadingHTTPServer:
    tokens = None
    if token_file:
        with open(token_file) as f:
            tokens = [line.strip() for line in f if line.strip()]
    state = State(load_repos(repos_dir), tokens)
    handler = type("BoundHandler", (Handler,), {"state": state})
    server = ThreadingHTTPServer((bind, port), handler)
    server.daemon_threads = True
    server.state = state  # type: ignore[attr-defined]
    return server


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m tests.fleet.standins.hub", description="STAND-IN for the Hugging Face hub's HTTP endpoints."
    )
    parser.add_argument("--bind", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--repos", required=True, help="directory written by hub_repos build")
    parser.add_argument(
        "--require-token-file",
        default=None,
        help="file with accepted tokens (one a line): repos answer 401 GatedRepo without one",
    )
    args = parser.parse_args(argv)
    server = make_server(args.bind, args.port, args.repos, args.require_token_file)
    host, port = server.server_address[:2]
    print(f"hub stand-in serving {len(server.state.repos)} repos on http://{host}:{port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
