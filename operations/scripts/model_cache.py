#!/usr/bin/env python3
"""What the LAN model cache's nginx may serve, and the key it asks for: two nginx includes.

The LAN model cache is Debian's nginx (``freetoken-model-cache.service``, its configuration from
``cache_nginx_conf`` in operations/model.py): it does Range, sendfile, timeouts and connection
limits, which our own HTTP code did not survive (slow clients held every
worker). This script holds no HTTP code. It runs ON THE CACHE HOST under the system
``python3`` from the unit's ``ExecStartPre=``/``ExecReload=`` lines and prints one include file
on stdout, which the unit writes into its runtime folder (root's, 0700):

``files --dir MODEL_DIR`` (run as the download's user, never root nor the engine's user: what it prints
is data read from a folder the downloader writes, never a path root opens)
    one exact ``location`` per file the downloader's manifest vouches for now (a regular file
    with the size and mtime it had when its sha256 was verified; ``manifest.py``, uploaded
    beside this file), under ``/<repo>/resolve/<commit>/`` and ``/<repo>/resolve/<revision>/``
    as the hub names them, and ``location = /health`` with what the cache holds (JSON). A name
    nginx's configuration could not hold verbatim (anything but letters, digits and
    ``._+-=,@/``) is left out: nginx answers 404 and the fetcher takes that file from the next
    source. Every byte is verified by the fetcher against the upstream listing anyway.

``token CREDENTIAL`` (run as root, stdout to a 0600 file that nginx's master reads at start)
    ``map $http_x_freetoken_cache_token $cache_token_ok``: the key derived from the hub token
    (``cache_token``; the fetcher derives the same one and sends it to its sources), so gated
    weights go only to hosts that hold the token, and the hub token never crosses the LAN nor
    appears in an argument or a world-readable file.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import re
import stat
import sys
from typing import TYPE_CHECKING

HERE = os.path.dirname(os.path.abspath(__file__))
# The core modules: uploaded beside this script on the target, else the package of its checkout.
sys.path.insert(0, HERE if os.path.isfile(f"{HERE}/manifest.py") else os.path.dirname(os.path.dirname(HERE)))
if TYPE_CHECKING or sys.path[0] != HERE:  # the type checker, or a checkout
    from freetoken_infra.core import manifest as manifest_rules
else:
    import manifest as manifest_rules


TOKEN_HEADER = "X-FreeToken-Cache-Token"
_CACHE_TOKEN_CONTEXT = b"freetoken-infra model cache v1"

# What nginx's configuration holds verbatim inside double quotes: no quote, backslash, ``$``
# (a variable), ``{``/``}``/``;``, whitespace or control character can reach it.
_NAME = re.compile(r"[A-Za-z0-9._+\-=,@]+(?:/[A-Za-z0-9._+\-=,@]+)*")
_WORD = re.compile(r"[A-Za-z0-9._\-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# The downloader's own entries in the model directory (fetch_model.py PARTIAL_DIR, MANIFEST).
_OWN = (".partial", ".freetoken-manifest.json")


def cache_token(hub_token: str) -> str:
    """The key a gated cache asks for, derived from the hub token (the fetcher derives the same
    one): knowing it does not give the hub token back."""
    return hmac.new(hub_token.encode("utf-8"), _CACHE_TOKEN_CONTEXT, hashlib.sha256).hexdigest()


def _servable(name: object) -> bool:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return False
    parts = name.split("/")
    return parts[0] not in _OWN and all(p not in (".", "..") for p in parts)


def _verified_now(model_dir: str, name: str, entry: object) -> bool:
    """A regular file (never a link) with the size and mtime it had when it was verified."""
    if not isinstance(entry, dict):
        return False
    try:
        st = os.lstat(os.path.join(model_dir, name))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (st.st_size, st.st_mtime_ns) == (entry.get("size"), entry.get("mtime_ns"))


def files_conf(model_dir: str) -> str:
    """The ``server``-level include: one exact location per verified file, and ``/health``."""
    model_dir = os.path.abspath(model_dir)
    if not _NAME.fullmatch(model_dir.strip("/")):
        raise SystemExit(f"model_cache: the model directory {model_dir!r} is not a path nginx can hold verbatim")
    m = manifest_rules.load(model_dir)[0] or {}
    repo, commit, revision = m.get("repo"), m.get("commit"), m.get("revision")
    if not (isinstance(repo, str) and repo.count("/") == 1 and all(_WORD.fullmatch(p) for p in repo.split("/"))):
        repo = None
    commit = commit if repo and isinstance(commit, str) and _COMMIT.fullmatch(commit) else None
    revision = revision if commit and isinstance(revision, str) and _WORD.fullmatch(revision) else None
    listed = m.get("files")
    files: dict = listed if commit and isinstance(listed, dict) else {}
    served = sorted(n for n, e in files.items() if _servable(n) and _verified_now(model_dir, n, e))
    prefixes = sorted({f"/{repo}/resolve/{rev}/" for rev in (commit, revision) if rev})
    health = {
        "repo": repo,
        "commit": commit,
        "revision": revision,
        "complete": bool(m.get("complete")) and len(served) == len(files) > 0,
        "files": len(served),
    }
    # ``_servable``/``_WORD``/``_COMMIT`` keep every quote, backslash and ``$`` out of these
    # values; the JSON then only needs its own quotes kept inside nginx's single quotes.
    body = json.dumps(health) + "\n"
    lines = [
        "# Generated by model_cache.py files from the downloader's manifest; rewritten at every start.",
        "location = /health {",
        "    default_type application/json;",
        "    return 200 '" + body.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "';",
        "}",
    ]
    model_root = model_dir.rstrip("/")
    for prefix in prefixes:
        for name in served:
            lines += [
                f'location = "{prefix}{name}" {{',
                "    default_type application/octet-stream;",
                f'    alias "{model_root}/{name}";',
                "}",
            ]
    return "\n".join(lines) + "\n"


def token_conf(credential: str) -> str:
    """The ``http``-level include of a gated cache: which key opens it."""
    try:
        with open(credential, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as exc:
        raise SystemExit(f"model_cache: cannot read the token file {credential}: {exc.strerror}") from None
    if not token:
        raise SystemExit(f"model_cache: the token file {credential} is empty")
    header = "$http_" + TOKEN_HEADER.lower().replace("-", "_")
    return "\n".join(
        [
            "# Generated by model_cache.py token from the hub token (a credential); 0600 root.",
            f"map {header} $cache_token_ok {{",
            "    default 0;",
            f'    "{cache_token(token)}" 1;',
            "}",
            "",
        ]
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="model_cache.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    f = sub.add_parser("files", help="locations of the verified files and /health (server level)")
    f.add_argument("--dir", required=True, help="the verified model directory (with its manifest)")
    t = sub.add_parser("token", help="the key map of a gated cache (http level)")
    t.add_argument("credential", help="the hub token's file (a systemd credential); never the token itself")
    args = p.parse_args(argv)
    sys.stdout.write(files_conf(args.dir) if args.what == "files" else token_conf(args.credential))
    return 0


if __name__ == "__main__":
    sys.exit(main())
