"""Fact: the model downloader's manifest (``MODEL_DIR/.freetoken-manifest.json``) and the size
and mtime of each file it names, so a converge can tell "the model is here" without hashing
22 GB. The downloader (operations/scripts/fetch_model.py) stays the authority: when this fact
has any doubt, the deploy starts it, and it hashes only the files that changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from pyinfra.api import FactBase

from freetoken_infra.core import manifest

from ._output import MARKER, b64decode_lines, nul_records, quote, sections

MANIFEST_NAME = manifest.MANIFEST_NAME


@dataclass(frozen=True)
class ModelManifestInfo:
    path: str
    manifest: dict | None = None
    # file name (relative, as in the manifest) -> (size, mtime_ns) on disk now
    on_disk: dict[str, tuple[int, int]] = field(default_factory=dict)
    error: str | None = None

    def covers(self, repo: str, revision: str) -> tuple[bool, str]:
        """Whether a complete, untouched download of ``repo`` at ``revision`` is here, and why not."""
        return manifest.covers(self.manifest, self.on_disk, repo, revision, self.path, self.error)


def parse_model_manifest_output(path: str, lines: list[str]) -> ModelManifestInfo:
    manifest = None
    error = None
    on_disk: dict[str, tuple[int, int]] = {}
    for name, _arg, body in sections(lines):
        if name == "manifest":
            data = b64decode_lines(body)
            try:
                doc = json.loads(data.decode("utf-8")) if data is not None else None
            except (UnicodeDecodeError, ValueError):
                doc = None
            if isinstance(doc, dict) and isinstance(doc.get("files"), dict):
                manifest = doc
            else:
                error = f"{path}/{MANIFEST_NAME} is unreadable"
        elif name == "files0":
            # NUL-terminated records, base64 over the wire: a file name is the hub's (or the
            # service user's) text and may hold a newline or a marker line.
            for record in nul_records(body):
                size, _, rest = record.partition("\t")
                mtime, _, rel = rest.partition("\t")
                try:
                    on_disk[rel] = (int(size), int(Decimal(mtime) * 1_000_000_000))
                except (ValueError, InvalidOperation):
                    continue
    return ModelManifestInfo(path, manifest, on_disk, error)


class ModelManifest(FactBase[ModelManifestInfo]):
    """
    Returns ``ModelManifestInfo`` for a model directory: the downloader's manifest (None when
    absent) and ``(size, mtime_ns)`` of every file under the directory (``.partial/`` left
    out). ``info.covers(repo, revision)`` says whether the download is complete and untouched.

    + model_dir: e.g. ``/var/lib/freetoken/models/Qwen3.6-35B-A3B-NVFP4-nvidia``
    """

    def command(self, model_dir: str) -> str:
        self._path = model_dir
        d = quote(model_dir)
        m = quote(f"{model_dir}/{MANIFEST_NAME}")
        return (
            f"if [ -f {m} ] && [ ! -L {m} ]; then echo '{MARKER}manifest'; base64 < {m}; fi; "
            f"if [ -d {d} ]; then echo '{MARKER}files0'; "
            f"find {d} -path {quote(model_dir + '/.partial')} -prune -o -type f -printf '%s\\t%T@\\t%P\\0' "
            "| base64; fi; true"
        )

    @staticmethod
    def default() -> ModelManifestInfo:
        return ModelManifestInfo("")

    def process(self, output: list[str]) -> ModelManifestInfo:
        return parse_model_manifest_output(getattr(self, "_path", ""), output)
