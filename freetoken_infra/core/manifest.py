"""The model download's manifest (``MODEL_DIR/.freetoken-manifest.json``): when it vouches for a
model directory. Pure and stdlib-only, because the same decision is taken in two places:

- on the controller, by the ``ModelManifest`` fact (``facts/model_manifest.py``), to skip the
  download step without hashing 22 GB;
- on the target, by ``fetch_model.py --check`` (this file is uploaded beside it, like
  ``quant.py``), which the engine's unit runs before every start, and by the LAN model cache,
  which serves only what the manifest vouches for.

A manifest vouches for a directory when it is complete, names the wanted repository and
revision (branch or commit), and every file it lists still has the size and mtime it had
when its hash was verified.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

MANIFEST_NAME = ".freetoken-manifest.json"
PARTIAL_DIR = ".partial"


def load(model_dir: str) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)``; ``(None, None)`` when there is none; ``(None, why)`` when it is
    unreadable or not a download manifest."""
    path = os.path.join(model_dir, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        return None, f"{path} is unreadable: {exc}"
    if not (isinstance(doc, dict) and isinstance(doc.get("files"), dict)):
        return None, f"{path} is not a download manifest"
    return doc, None


def files_on_disk(model_dir: str) -> dict[str, tuple[int, int]]:
    """``{relative name: (size, mtime_ns)}`` of every file under ``model_dir`` (``.partial/``
    and the manifest itself left out)."""
    found: dict[str, tuple[int, int]] = {}
    for root, dirs, names in os.walk(model_dir):
        if root == model_dir:
            dirs[:] = [d for d in dirs if d != PARTIAL_DIR]
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, model_dir)
            if rel == MANIFEST_NAME:
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            found[rel] = (st.st_size, st.st_mtime_ns)
    return found


def verified_files(
    manifest: Mapping[str, Any] | None, on_disk: Mapping[str, tuple[int, int]]
) -> dict[str, Mapping[str, Any]]:
    """The manifest's entries whose file is still exactly as it was when verified."""
    if not manifest or not isinstance(manifest.get("files"), Mapping):
        return {}
    return {
        name: entry
        for name, entry in manifest["files"].items()
        if isinstance(entry, Mapping) and on_disk.get(name) == (entry.get("size"), entry.get("mtime_ns"))
    }


def covers(
    manifest: Mapping[str, Any] | None,
    on_disk: Mapping[str, tuple[int, int]],
    repo: str,
    revision: str,
    where: str,
    error: str | None = None,
) -> tuple[bool, str]:
    """Whether a complete, untouched download of ``repo`` at ``revision`` is in ``where``, and why not."""
    m = manifest
    if m is None:
        return False, error or f"no {MANIFEST_NAME} in {where}"
    if m.get("repo") != repo:
        return False, f"{where} holds {m.get('repo')}, not {repo}"
    if revision not in (m.get("revision"), m.get("commit")):
        return False, f"{where} holds revision {m.get('revision')} ({str(m.get('commit'))[:12]}), not {revision}"
    if m.get("complete") is not True:
        return False, f"the download into {where} is not complete"
    files = m.get("files") or {}
    if not files:
        return False, f"the manifest in {where} lists no files"
    for name, entry in files.items():
        seen = on_disk.get(name)
        if seen is None:
            return False, f"{name} is missing from {where}"
        if not isinstance(entry, Mapping) or (entry.get("size"), entry.get("mtime_ns")) != seen:
            return False, f"{name} changed since it was verified"
    return True, "complete"
