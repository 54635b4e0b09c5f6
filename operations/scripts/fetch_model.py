#!/usr/bin/env python3
"""Fetch a model snapshot from a hub (or a hub mirror), resumably and verified.

Runs ON THE TARGET under the system ``python3`` (3.10+), as a systemd oneshot unit so a
22 GB download outlives the SSH session that started it (field report, pitfall 4A). Stdlib
only, plus ``quant.py`` (freetoken_infra/core/quant.py, uploaded beside this file) so the decision
"can FreeToken run this checkpoint" is the same code as in the preflight rules.

Why not huggingface_hub: >= 1.31 no longer resumes partial downloads (huggingface_hub#4196), and a
22 GB fetch that dies at 90 % must not start over. Here every file goes to
``DEST/.partial/<name>.part``, continues with an HTTP Range request from the partial's size,
is verified against the hub's listing (sha256 for LFS files, the git blob sha1 for small
files), then renamed into place (fsync + os.replace).

Order of work (nothing heavy happens before the cheap refusals):
  1. list the revision on the upstream endpoint: commit sha, files, sizes, hashes;
  2. config.json (+ hf_quant_config.json) first; refuse an unsupported expert quantisation
     (exit 3) before any weight byte is fetched (pitfall 2);
  3. refuse when DEST's file system lacks the missing bytes + margin (exit 4);
  4. fetch what is missing, from each ``--source`` (a LAN cache speaking the hub endpoints)
     first, then the endpoint; a source's bytes are checked against the UPSTREAM listing, so
     a cache cannot serve wrong bytes;
  5. ``DEST/.freetoken-manifest.json`` records each verified file with its size and mtime; a
     re-run trusts entries whose size and mtime still match and hashes nothing
     (``--reverify``, or ``--reverify-request FILE`` while FILE exists, re-hashes everything).

Exit codes: 0 every file verified; 1 failed (network, hub error, verification); 2 usage;
3 refused: unsupported quantisation; 4 refused: not enough disk.

Xet: ``HF_HUB_DISABLE_XET=1`` is honoured trivially - this downloader only ever uses the
plain ``/resolve/`` HTTP endpoints and never speaks the Xet protocol (which answered 401
through a mirror in the field report).

The hub token is read from ``--token-file`` only, sent as ``Authorization: Bearer`` to the
upstream endpoint only (never to a ``--source``), never printed, and dropped on redirects to
another host.

``--check`` (no network): exit 0 when DEST's manifest vouches for REPO at REVISION (complete,
every file still with its verified size and mtime; ``manifest.py``), else 1 naming what is
wrong. The engine's unit runs it before every start.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import http.client
import json
import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any

HERE = os.path.dirname(os.path.abspath(__file__))
# The core modules: uploaded beside this script on the target, else the package of its checkout.
sys.path.insert(0, HERE if os.path.isfile(f"{HERE}/hostio.py") else os.path.dirname(os.path.dirname(HERE)))
if TYPE_CHECKING or sys.path[0] != HERE:  # the type checker, or a checkout
    from freetoken_infra.core import hostio, quant
    from freetoken_infra.core import manifest as manifest_rules
else:
    import hostio
    import manifest as manifest_rules
    import quant

MANIFEST = manifest_rules.MANIFEST_NAME
PARTIAL_DIR = manifest_rules.PARTIAL_DIR
CONFIG_FILES = ("config.json", "hf_quant_config.json")
SUPPORTED_REPO = "nvidia/Qwen3.6-35B-A3B-NVFP4"
CHUNK = 1024 * 1024
USER_AGENT = "freetoken-infra-fetch-model/1"

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED_QUANT, EXIT_REFUSED_DISK = 0, 1, 2, 3, 4


class Failed(Exception):
    """A failure that ends the run; the message is for the user."""

    exit_code = EXIT_FAILED
    state = "failed"


class Refused(Failed):
    state = "refused"

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Transient(Exception):
    """A dropped or stalled connection, or a 5xx: retry and resume."""


class BadSource(Exception):
    """A source cannot serve this file (404, wrong bytes, no such repo): try the next one."""


class SourceDown(BadSource):
    """A source cannot be reached at all: drop it for the rest of the run."""


def log(msg: str) -> None:
    msg = re.sub(r"(\w+://)[^/\s@]*@", r"\1", msg)  # an endpoint's user:password never reaches the journal
    sys.stderr.write(f"fetch_model: {msg}\n")
    sys.stderr.flush()


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- HTTP


class _SameOriginAuthRedirect(urllib.request.HTTPRedirectHandler):
    """Follow redirects (the hub sends LFS files to its CDN) without leaking the token."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            old_origin = urllib.parse.urlsplit(req.full_url)[:2]
            new_origin = urllib.parse.urlsplit(new.full_url)[:2]
            if old_origin != new_origin:
                new.remove_header("Authorization")
                new.remove_header(CACHE_TOKEN_HEADER.capitalize())  # as add_header stored it
        return new


# A LAN cache serving a gated repository asks for this key, derived from the hub token
# (model_cache.py cache_token: the same derivation, kept identical by a test).
CACHE_TOKEN_HEADER = "X-FreeToken-Cache-Token"
_CACHE_TOKEN_CONTEXT = b"freetoken-infra model cache v1"


def cache_token(hub_token: str) -> str:
    return hmac.new(hub_token.encode("utf-8"), _CACHE_TOKEN_CONTEXT, hashlib.sha256).hexdigest()


class Http:
    def __init__(self, token: str | None, timeout: float, token_origin: str | None = None):
        self._token = token
        # The token goes to the upstream endpoint only: a LAN cache is often plain HTTP on a
        # shared network. A source gets the key derived from it instead (a gated cache asks).
        self._token_origin = urllib.parse.urlsplit(token_origin)[:2] if token_origin else None
        self._cache_token = cache_token(token) if token and token_origin else None
        self.timeout = timeout
        self._opener = urllib.request.build_opener(_SameOriginAuthRedirect())

    def open(self, url: str, headers: dict | None = None):
        req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, **(headers or {})})
        if self._token and (self._token_origin is None or urllib.parse.urlsplit(url)[:2] == self._token_origin):
            req.add_header("Authorization", f"Bearer {self._token}")
        elif self._cache_token:
            req.add_header(CACHE_TOKEN_HEADER, self._cache_token)
        return self._opener.open(req, timeout=self.timeout)

    def get_json(self, url: str):
        try:
            with self.open(url) as resp:
                return json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            raise Failed(hub_error(exc, url)) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise Transient(f"{strip_query(url)}: {reason(exc)}") from None


def strip_query(url: str) -> str:
    return url.split("?", 1)[0]


def reason(exc: BaseException) -> str:
    r = getattr(exc, "reason", None)
    return f"{type(exc).__name__}: {r if r is not None else exc}"


def hub_error(exc: urllib.error.HTTPError, url: str) -> str:
    code = exc.headers.get("X-Error-Code") if exc.headers else None
    message = exc.headers.get("X-Error-Message") if exc.headers else None
    where = strip_query(url)
    if exc.code == 401 or code == "GatedRepo":
        return (
            f"{where}: HTTP 401 ({code or 'unauthorized'}): the hub wants a token; put an accepted "
            "token in the file named by --token-file (setting hub_token_file)"
        )
    if code == "RepoNotFound":
        return f"{where}: repository not found (check model_repo, or the token for a private repo)"
    if code == "RevisionNotFound":
        return f"{where}: revision not found (check model_revision)"
    return f"{where}: HTTP {exc.code} {code or ''} {message or exc.reason}".strip()


# --------------------------------------------------------------------------- listing


class RemoteFile:
    def __init__(self, name: str, size: int, sha256: str | None, oid: str | None):
        self.name = name
        self.size = size
        self.sha256 = sha256  # LFS files: sha256 of the content
        self.oid = oid  # small files: git blob sha1 of the content

    @property
    def digest_key(self) -> tuple[str, str]:
        return ("sha256", self.sha256) if self.sha256 else ("oid", self.oid or "")

    def hasher(self):
        if self.sha256:
            return hashlib.sha256()
        h = hashlib.sha1()
        h.update(b"blob %d\0" % self.size)
        return h


def _safe_name(name: object) -> bool:
    """A file name from the hub's listing we will create: relative, no empty, ``.`` or ``..``
    component, not our own files, no control character (a newline in a name splits every
    line-based record it reaches: status, journal, the fact protocol) nor backslash."""
    if not isinstance(name, str) or not name or name.startswith("/"):
        return False
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c == "\\" for c in name):
        return False
    parts = name.split("/")
    return all(p not in ("", ".", "..") for p in parts) and parts[0] not in (PARTIAL_DIR, MANIFEST)


def _hex(value: object, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and all(c in "0123456789abcdef" for c in value)


def list_revision(http: Http, endpoint: str, repo: str, revision: str) -> tuple[str, list[RemoteFile]]:
    base = endpoint.rstrip("/")
    rev = urllib.parse.quote(revision, safe="")
    info = http.get_json(f"{base}/api/models/{repo}/revision/{rev}?blobs=true")
    commit = info.get("sha")
    if not _hex(commit, 40):
        raise Failed(f"{base}: the hub did not resolve revision {revision!r} to a commit sha")
    siblings = info.get("siblings") or []
    entries: dict[str, dict] = {}
    if siblings and all(isinstance(s, dict) and isinstance(s.get("size"), int) for s in siblings):
        for s in siblings:
            lfs = s.get("lfs") or {}
            entries[str(s.get("rfilename"))] = {"size": s["size"], "sha256": lfs.get("sha256"), "oid": s.get("blobId")}
            if not _safe_name(s.get("rfilename")):
                raise Failed(f"the hub listed an unsafe file name {s.get('rfilename')!r}; refusing to write it")
    else:  # a mirror without ?blobs=true: the tree API has the same data
        tree = http.get_json(f"{base}/api/models/{repo}/tree/{commit}?recursive=true")
        for item in tree:
            if item.get("type") != "file":
                continue
            lfs = item.get("lfs") or {}
            if not _safe_name(item.get("path")):
                raise Failed(f"the hub listed an unsafe file name {item.get('path')!r}; refusing to write it")
            entries[item["path"]] = {"size": item.get("size"), "sha256": lfs.get("oid"), "oid": item.get("oid")}
    files = []
    for name, e in sorted(entries.items()):
        if not _safe_name(name):
            raise Failed(f"the hub listed an unsafe file name {name!r}; refusing to write it")
        if not (e["sha256"] or e["oid"]):
            raise Failed(f"the hub listing has no size/hash for {name}; cannot verify it")
        # A negative size would cancel others in the disk check and leave a manifest that never
        # covers; a bool is an int to Python, JSON's true is no size.
        size = e["size"]
        if type(size) is not int or size < 0:
            raise Failed(f"the hub listed {name} with the size {size!r}, not a byte count; refusing the listing")
        sha256, oid = e["sha256"], None if e["sha256"] else e["oid"]
        if sha256 is not None and not _hex(sha256, 64) or oid is not None and not _hex(oid, 40):
            raise Failed(f"the hub listed {name} with a malformed hash; refusing the listing")
        files.append(RemoteFile(name, size, sha256, oid))
    if not files:
        raise Failed(f"{repo}@{revision} lists no files")
    return commit, files


# --------------------------------------------------------------------------- status


class Status:
    """The JSON status file, rewritten atomically at least every second by a thread."""

    def __init__(self, path: str | None, repo: str):
        self.path = path
        self.lock = threading.Lock()
        self.doc: dict[str, Any] = {
            "state": "checking",
            "repo": repo,
            "commit": None,
            "bytes_total": 0,
            "bytes_missing_at_start": 0,
            "bytes_done": 0,
            "bytes_transferred": 0,
            "bytes_hashed": 0,
            "files_total": 0,
            "files_trusted": 0,
            "rate_bps": 0.0,
            "eta_s": None,
            "current_file": None,
            "error": None,
            "pid": os.getpid(),
            "started_at": now_iso(),
            "updated_at": now_iso(),
        }
        self._samples: list[tuple[float, int]] = [(time.monotonic(), 0)]
        self._stop = threading.Event()
        self._thread = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.flush()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()

    def set(self, **kw) -> None:
        with self.lock:
            self.doc.update(kw)

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                self.doc[k] += v

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.flush()
            except OSError:
                pass

    def flush(self) -> None:
        with self.lock:
            t = time.monotonic()
            self._samples.append((t, self.doc["bytes_transferred"]))
            # rate over the last ~10 s
            while len(self._samples) > 2 and t - self._samples[0][0] > 10:
                self._samples.pop(0)
            t0, b0 = self._samples[0]
            rate = (self.doc["bytes_transferred"] - b0) / (t - t0) if t > t0 else 0.0
            self.doc["rate_bps"] = round(rate, 1)
            left = self.doc["bytes_total"] - self.doc["bytes_done"]
            if self.doc["state"] in ("done",):
                self.doc["eta_s"] = 0
            elif rate > 0 and self.doc["state"] == "downloading":
                self.doc["eta_s"] = round(left / rate, 1)
            else:
                self.doc["eta_s"] = None
            self.doc["updated_at"] = now_iso()
            data = json.dumps(self.doc, sort_keys=True).encode() + b"\n"
        if self.path:
            hostio.write_atomic(self.path, data)

    def close(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self.path:
            self.flush()


# --------------------------------------------------------------------------- the fetcher


class Fetcher:
    def __init__(self, args):
        self.args = args
        self.repo = args.repo
        self.dest = os.path.abspath(args.dest)
        self.partial_dir = os.path.join(self.dest, PARTIAL_DIR)
        self.manifest_path = os.path.join(self.dest, MANIFEST)
        self.endpoint = args.endpoint.rstrip("/")
        self.sources = [s.rstrip("/") for s in args.source or []]
        self.http = Http(None, args.timeout_s)
        self.status = Status(args.status_file, args.repo)
        self.manifest: dict = {}
        self.commit = ""
        self.files: list[RemoteFile] = []

    # ---------------------------------------------------------------- manifest
    def load_manifest(self) -> dict:
        return manifest_rules.load(self.dest)[0] or {}

    def save_manifest(self) -> None:
        hostio.write_atomic(self.manifest_path, json.dumps(self.manifest, indent=1, sort_keys=True).encode() + b"\n")

    def record(self, f: RemoteFile) -> None:
        st = os.stat(os.path.join(self.dest, f.name))
        key, value = f.digest_key
        self.manifest["files"][f.name] = {
            "size": f.size,
            key: value,
            "verified_at": now_iso(),
            "mtime_ns": st.st_mtime_ns,
        }
        self.save_manifest()

    def trusted(self, f: RemoteFile, old_files: dict) -> bool:
        """The manifest vouches for this file: same hash as the listing, same size and mtime."""
        entry = old_files.get(f.name)
        if not isinstance(entry, dict) or self.args.reverify:
            return False
        key, value = f.digest_key
        if entry.get(key) != value or entry.get("size") != f.size:
            return False
        try:
            st = os.stat(os.path.join(self.dest, f.name))
        except OSError:
            return False
        return st.st_size == f.size and st.st_mtime_ns == entry.get("mtime_ns")

    # ---------------------------------------------------------------- hashing
    def hash_file(self, path: str, f: RemoteFile, upto: int | None = None):
        h = f.hasher()
        left = f.size if upto is None else upto
        with open(path, "rb") as fh:
            while left > 0:
                block = fh.read(min(CHUNK * 8, left))
                if not block:
                    break
                h.update(block)
                left -= len(block)
                self.status.add(bytes_hashed=len(block))
        return h

    def matches(self, f: RemoteFile, h) -> bool:
        return h.hexdigest() == f.digest_key[1]

    # ---------------------------------------------------------------- transfers
    def part_path(self, f: RemoteFile) -> str:
        return os.path.join(self.partial_dir, f.name + ".part")

    def partial_size(self, f: RemoteFile) -> int:
        try:
            n = os.path.getsize(self.part_path(f))
        except OSError:
            return 0
        return n if n <= f.size else 0

    def _transfer(self, source: str, f: RemoteFile, part: str, h, have: int) -> tuple[int, object]:
        """Append the rest of ``f`` from ``source`` to ``part``. Returns (bytes now present, hasher)."""
        url = f"{source}/{self.repo}/resolve/{self.commit}/{urllib.parse.quote(f.name)}"
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            resp = self.http.open(url, headers)
        except urllib.error.HTTPError as exc:
            if exc.code == 416 and have == f.size:
                return have, h
            if exc.code >= 500 or exc.code == 429:
                raise Transient(f"HTTP {exc.code} from {source}") from None
            if source != self.endpoint:
                raise BadSource(f"{source} answered HTTP {exc.code}") from None
            raise Failed(hub_error(exc, url)) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            if source != self.endpoint:
                raise SourceDown(f"{source} is unreachable ({reason(exc)})") from None
            raise Transient(f"{source}: {reason(exc)}") from None
        with resp:
            if have and resp.status == 200:  # the server ignored Range: start over
                have, h = 0, f.hasher()
                mode = "wb"
            else:
                mode = "ab" if have else "wb"
            expected = f.size - have
            got = 0
            with open(part, mode) as out:
                try:
                    while got < expected:
                        block = resp.read1(min(CHUNK, expected - got))
                        if not block:
                            break
                        out.write(block)
                        h.update(block)
                        got += len(block)
                        self.status.add(bytes_transferred=len(block), bytes_done=len(block))
                except (OSError, http.client.HTTPException) as exc:
                    out.flush()
                    os.fsync(out.fileno())
                    raise Transient(
                        f"{source}: link dropped after {hostio.human_bytes(have + got)} of {f.name} ({reason(exc)})"
                    ) from None
                out.flush()
                os.fsync(out.fileno())
            if got < expected:
                raise Transient(f"{source}: link dropped after {hostio.human_bytes(have + got)} of {f.name}")
            return have + got, h

    def download(self, f: RemoteFile) -> str:
        """Bring ``f`` into ``.partial/`` verified; returns the partial's path."""
        part = self.part_path(f)
        os.makedirs(os.path.dirname(part), exist_ok=True)
        sources = self.sources + [self.endpoint]
        errors = []
        t0 = time.monotonic()
        moved_from = None
        for source in sources:
            failures = 0
            while True:
                have = self.partial_size(f)
                if have == 0 and os.path.exists(part):
                    os.unlink(part)  # larger than the file: not ours to resume
                self.status.set(current_file=f.name, state="verifying" if have else "downloading")
                h = self.hash_file(part, f, have) if have else f.hasher()
                self.status.set(state="downloading")
                try:
                    have, h = self._transfer(source, f, part, h, have)
                except Transient as exc:
                    failures += 1
                    if failures > self.args.retries:
                        errors.append(str(exc))
                        if source == self.endpoint:
                            raise Failed(f"{f.name}: giving up after {failures} failed attempts: {exc}") from None
                        log(f"{f.name}: {exc}; giving up on {source}")
                        break
                    delay = min(self.args.backoff_s * 2 ** (failures - 1), 30.0)
                    log(f"{f.name}: {exc}; retry {failures}/{self.args.retries} in {delay:.1f} s, resuming")
                    time.sleep(delay)
                    continue
                except BadSource as exc:
                    errors.append(str(exc))
                    if isinstance(exc, SourceDown) and source in self.sources:
                        self.sources.remove(source)
                        log(f"{f.name}: {exc}; not asking it again in this run")
                    else:
                        log(f"{f.name}: {exc}; trying the next source")
                    break
                if self.matches(f, h):
                    moved_from = source
                    break
                # Wrong bytes: the whole partial is suspect. A cache is dropped for this file.
                self.status.add(bytes_done=-have)
                os.unlink(part)
                msg = f"{source} served {f.name} with a hash that does not match the upstream listing"
                errors.append(msg)
                log(f"{f.name}: {msg}; discarded")
                if source != self.endpoint:
                    break
                failures += 1
                if failures > self.args.retries:
                    raise Failed(f"{f.name}: {msg}")
            if moved_from:
                break
        if not moved_from:
            raise Failed(f"{f.name}: no source could serve it: " + "; ".join(errors))
        dt = max(time.monotonic() - t0, 1e-6)
        where = "cache " + moved_from if moved_from != self.endpoint else moved_from
        log(f"{f.name}: {hostio.human_bytes(f.size)} verified, from {where} in {dt:.1f} s")
        return part

    def finalize(self, f: RemoteFile, part: str) -> None:
        target = os.path.join(self.dest, f.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(part, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(part, 0o644)
        os.replace(part, target)
        fsync_dir(os.path.dirname(target))
        self.record(f)

    # ---------------------------------------------------------------- checks
    def check_quant(self, docs: dict[str, dict | None]) -> None:
        config = docs.get("config.json")
        if not isinstance(config, dict):
            raise Failed("config.json is missing or not a JSON object; cannot tell the quantisation")
        summary = quant.summarize_quant(config, docs.get("hf_quant_config.json"))
        bad = quant.unsupported_expert_schemes(summary)
        if bad:
            schemes = ", ".join(sorted(bad))
            raise Refused(
                f"refusing {self.repo}: its routed MoE experts use {schemes} "
                f"({summary.method or 'unknown method'}, from {summary.source}); FreeToken has no MoE "
                f"quant method for it (NotImplementedError: no quant method for moe.{sorted(bad)[0]}). "
                f"Remedy: use {SUPPORTED_REPO} (setting model_repo). No weights were downloaded.",
                EXIT_REFUSED_QUANT,
            )
        log(f"quantisation ok: experts {', '.join(sorted(summary.expert_schemes))} ({summary.method})")

    def check_disk(self, missing: int) -> None:
        st = os.statvfs(self.dest)
        free = st.f_bavail * st.f_frsize
        margin = int(self.args.disk_margin_gb * 1e9)
        if free < missing + margin:
            raise Refused(
                f"not enough disk on the file system of {self.dest}: {hostio.human_bytes(free)} free, "
                f"{hostio.human_bytes(missing)} still to download + {hostio.human_bytes(margin)} margin needed. Free "
                f"{hostio.human_bytes(missing + margin - free)} or point model_dir elsewhere (disk_margin_gb sets the margin).",
                EXIT_REFUSED_DISK,
            )

    # ---------------------------------------------------------------- main
    def list_files(self) -> None:
        """The revision's commit and files, retried with backoff while the hub answers transiently."""
        for attempt in range(self.args.retries + 1):
            try:
                self.commit, self.files = list_revision(self.http, self.endpoint, self.repo, self.args.revision)
                return
            except Transient as exc:
                if attempt == self.args.retries:
                    raise Failed(f"cannot list {self.repo}: {exc}") from None
                time.sleep(min(self.args.backoff_s * 2**attempt, 30.0))

    def sort_out(self, config_first: list[RemoteFile], old_files: dict, ok: set[str]) -> int:
        """Sort out what is already here: trusted (manifest), verified now (hash), or missing.
        Adds the names that need no download to ``ok``; returns how many the manifest vouched for."""
        st = self.status
        trusted = 0
        for f in self.files:
            if self.trusted(f, old_files):
                ok.add(f.name)
                trusted += 1
                continue
            self.manifest["files"].pop(f.name, None)
        st.set(files_trusted=trusted, bytes_done=sum(f.size for f in self.files if f.name in ok))
        for f in config_first:
            if f.name in ok:
                continue
            path = os.path.join(self.dest, f.name)
            if os.path.isfile(path) and os.path.getsize(path) == f.size:
                st.set(state="verifying", current_file=f.name)
                if self.matches(f, self.hash_file(path, f)):
                    ok.add(f.name)
                    self.record(f)
                    st.add(bytes_done=f.size)
                    log(f"{f.name}: already present, verified")
                else:
                    log(f"{f.name}: on disk but corrupt (hash mismatch); fetching it again")
            elif os.path.exists(path):
                log(f"{f.name}: on disk with the wrong size; fetching it again")
        return trusted

    def fetch_configs(self, config_first: list[RemoteFile], ok: set[str]) -> None:
        """Quantisation first, from the small config files, before any weight (pitfall 2)."""
        st = self.status
        docs: dict[str, dict | None] = {}
        pending: list[tuple[RemoteFile, str]] = []
        for f in config_first:
            if f.name not in CONFIG_FILES:
                continue
            path = os.path.join(self.dest, f.name)
            if f.name not in ok:
                st.set(state="downloading")
                path = self.download(f)
                pending.append((f, path))
            try:
                with open(path, "rb") as fh:
                    docs[f.name] = json.loads(fh.read().decode("utf-8-sig"))
            except ValueError as exc:
                raise Failed(f"{f.name} is not valid JSON: {exc}") from None
        st.set(state="checking", current_file=None)
        self.check_quant(docs)
        for f, path in pending:
            self.finalize(f, path)
            ok.add(f.name)

    def remove_unlisted(self, old_files: dict, listed: set[str]) -> None:
        """Files of an older revision that this manifest once vouched for are ours to remove."""
        for name in sorted(set(old_files) - listed):
            try:
                os.unlink(os.path.join(self.dest, name))
                log(f"{name}: not in {self.commit[:12]}, removed")
            except OSError:
                pass

    def run(self) -> None:
        st = self.status
        os.makedirs(self.dest, exist_ok=True)
        log(f"{self.repo}@{self.args.revision}: listing on {self.endpoint}")
        self.list_files()
        total = sum(f.size for f in self.files)
        st.set(commit=self.commit, bytes_total=total, files_total=len(self.files))

        old = self.load_manifest()
        old_files = old.get("files", {}) if isinstance(old.get("files"), dict) else {}
        listed = {f.name for f in self.files}
        self.manifest = {
            "repo": self.repo,
            "revision": self.args.revision,
            "commit": self.commit,
            "complete": False,
            "files": {k: v for k, v in old_files.items() if k in listed},
        }

        ok: set[str] = set()
        config_first = sorted(self.files, key=lambda f: (f.name not in CONFIG_FILES, f.name))
        trusted = self.sort_out(config_first, old_files, ok)
        self.save_manifest()

        missing_files = [f for f in config_first if f.name not in ok]
        missing = sum(f.size - self.partial_size(f) for f in missing_files)
        st.set(
            bytes_missing_at_start=missing,
            bytes_done=total - sum(f.size for f in missing_files) + (sum(f.size for f in missing_files) - missing),
        )

        self.fetch_configs(config_first, ok)

        rest = [f for f in missing_files if f.name not in ok]
        self.check_disk(sum(f.size - self.partial_size(f) for f in rest))

        for f in rest:
            st.set(state="downloading", current_file=f.name)
            part = self.download(f)
            self.finalize(f, part)
            ok.add(f.name)

        self.remove_unlisted(old_files, listed)
        self.manifest["complete"] = True
        self.manifest["completed_at"] = now_iso()
        self.save_manifest()
        try:
            os.rmdir(self.partial_dir)
        except OSError:
            pass
        doc = st.doc
        st.set(state="done", current_file=None, bytes_done=total)
        log(
            f"done: {self.repo}@{self.commit[:12]}: {len(self.files)} files, {hostio.human_bytes(total)} verified; "
            f"transferred {hostio.human_bytes(doc['bytes_transferred'])}, hashed {hostio.human_bytes(doc['bytes_hashed'])}, "
            f"{trusted} trusted from the manifest"
        )


def read_token(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise Failed(f"cannot read the token file {path}: {exc.strerror}") from None
    return token or None


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="fetch_model.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--endpoint",
        default=os.environ.get("HF_ENDPOINT"),
        help="hub or hub mirror (default: $HF_ENDPOINT, which keeps a user:password out of the "
        "process arguments; required unless --check)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="no download: exit 0 only if DEST holds a verified, untouched REPO@REVISION",
    )
    p.add_argument("--repo", required=True, help="owner/name")
    p.add_argument("--revision", default="main", help="branch, tag or commit sha")
    p.add_argument("--dest", required=True, help="model directory")
    p.add_argument("--token-file", help="file holding the hub token (never pass the token itself)")
    p.add_argument("--status-file", help="JSON progress, atomically rewritten at least every second")
    p.add_argument("--reverify", action="store_true", help="re-hash every file, trusting no manifest entry")
    p.add_argument(
        "--reverify-request",
        metavar="FILE",
        help="act as --reverify while FILE exists; removed once every file verified (a "
        "re-verify asked for by the deploy survives an interrupted run)",
    )
    p.add_argument("--disk-margin-gb", type=float, default=5.0, help="free space to keep beyond the download")
    p.add_argument(
        "--source",
        action="append",
        default=[],
        help="LAN cache with the hub's endpoints, tried before --endpoint (repeatable)",
    )
    p.add_argument("--retries", type=int, default=8, help="attempts per file and source after a failure")
    p.add_argument("--backoff-s", type=float, default=2.0, help="first retry delay, doubled each time (max 30)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="socket timeout: a stalled link is retried")
    args = p.parse_args(argv)
    if not args.check and not args.endpoint:
        p.error("--endpoint is required")
    if args.repo.count("/") != 1 or any(c in args.repo for c in " ?#") or ".." in args.repo:
        p.error("--repo must be owner/name")
    return args


def check(args) -> int:
    """``--check``: the manifest's verdict on DEST, without hashing or network."""
    dest = os.path.abspath(args.dest)
    doc, error = manifest_rules.load(dest)
    ok, why = manifest_rules.covers(doc, manifest_rules.files_on_disk(dest), args.repo, args.revision, dest, error)
    if ok:
        log(f"{args.repo}@{args.revision} in {dest}: verified")
        return EXIT_OK
    log(
        f"NOT VERIFIED: {why}; the engine must not start on it. Run the deploy (or "
        f"`systemctl start freetoken-model-fetch`) to fetch and verify the model."
    )
    return EXIT_FAILED


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check:
        return check(args)
    if args.reverify_request and os.path.exists(args.reverify_request):
        args.reverify = True
    socket.setdefaulttimeout(args.timeout_s)
    fetcher = None
    try:
        fetcher = Fetcher(args)
        fetcher.http = Http(read_token(args.token_file), args.timeout_s, token_origin=fetcher.endpoint)
        fetcher.run()
        code = EXIT_OK
        if args.reverify and args.reverify_request:
            try:
                os.unlink(args.reverify_request)
            except FileNotFoundError:
                pass
    except Failed as exc:
        log(("REFUSED: " if isinstance(exc, Refused) else "FAILED: ") + str(exc))
        if fetcher:
            fetcher.status.set(state=exc.state, error=str(exc), current_file=None)
        code = exc.exit_code
    except KeyboardInterrupt:
        if fetcher:
            fetcher.status.set(state="failed", error="interrupted")
        code = EXIT_FAILED
    except Exception as exc:  # report, never a bare traceback with no status
        msg = f"unexpected {type(exc).__name__}: {exc}"
        log("FAILED: " + msg)
        if fetcher:
            fetcher.status.set(state="failed", error=msg)
        code = EXIT_FAILED
    finally:
        if fetcher:
            fetcher.status.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
