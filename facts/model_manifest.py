"""Fact: the model downloader's manifest (``MODEL_DIR/.freetoken-manifest.json``) and the size
and mtime of each file it names, so a converge can tell "the model is here" without hashing
22 GB. The downloader (operations/scripts/fetch_model.py) stays the authority: when this fact
has any doubt, the deploy starts it, and it hashes only the files that changed.

The folder is the download's user's and this fact runs as root: the manifest
is read through ``hostio`` (``_hostread``: reached without a link, a regular file of at most
``hostio.MODEL_FILE_CAP`` bytes; a link, FIFO or larger file is one line in ``error``, and the
model counts as not verified), and the listing follows no link (``find -P``; a link where a file
should be is not listed, so that file is missing). The manifest's sha256 (``sha256``, what the
health gate records) is taken from the bytes read here, never by ``sha256sum PATH``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from pyinfra.api import FactBase

from freetoken_infra.core import hostio, manifest

from ._declare import PATH, tree
from ._hostread import parse_read_output, read_command
from ._output import MARKER, nul_records, quote, sections

MANIFEST_NAME = manifest.MANIFEST_NAME


@dataclass(frozen=True)
class ModelManifestInfo:
    path: str
    manifest: dict | None = None
    # file name (relative, as in the manifest) -> (size, mtime_ns) on disk now
    on_disk: dict[str, tuple[int, int]] = field(default_factory=dict)
    error: str | None = None
    sha256: str | None = None  # of the manifest's bytes, as read (None: none, or not read)

    def covers(self, repo: str, revision: str) -> tuple[bool, str]:
        """Whether a complete, untouched download of ``repo`` at ``revision`` is here, and why not."""
        return manifest.covers(self.manifest, self.on_disk, repo, revision, self.path, self.error)


def parse_model_manifest_output(path: str, lines: list[str]) -> ModelManifestInfo:
    manifest = None
    error = None
    sha256 = None
    on_disk: dict[str, tuple[int, int]] = {}
    if any(name == "absent" for name, _, _ in sections(lines)):
        return ModelManifestInfo(path)  # no folder: no manifest (``covers`` says so)
    seen = parse_read_output(lines)
    got = seen.files.get(MANIFEST_NAME)
    if seen.folder == "refused":
        error = seen.refused or f"{path} was not read"
    elif got is not None and got.refused is not None:
        error = got.refused  # one line naming the path and why: a link, a FIFO, too large
    elif got is not None and got.data is not None:
        sha256 = hashlib.sha256(got.data).hexdigest()
        try:
            doc = json.loads(got.data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("files"), dict):
            manifest = doc
        else:
            error = f"{path}/{MANIFEST_NAME} is unreadable"
    for name, _arg, body in sections(lines):
        if name == "files0":
            # NUL-terminated records, base64 over the wire: a file name is the hub's (or the
            # service user's) text and may hold a newline or a marker line.
            for record in nul_records(body):
                size, _, rest = record.partition("\t")
                mtime, _, rel = rest.partition("\t")
                try:
                    on_disk[rel] = (int(size), int(Decimal(mtime) * 1_000_000_000))
                except (ValueError, InvalidOperation):
                    continue
    return ModelManifestInfo(path, manifest, on_disk, error, sha256)


class ModelManifest(FactBase[ModelManifestInfo]):
    """
    Returns ``ModelManifestInfo`` for a model directory: the downloader's manifest (None when
    absent), its sha256, and ``(size, mtime_ns)`` of every regular file under the directory
    (``.partial/`` left out, no link followed). ``info.covers(repo, revision)`` says whether
    the download is complete and untouched; a manifest root refused to read (a link, a FIFO,
    over the cap) is none, and ``covers`` says why.

    + model_dir: e.g. ``/var/lib/freetoken/models/Qwen3.6-35B-A3B-NVFP4-nvidia``
    """

    argument_shapes = {"model_dir": PATH}
    fast_check_inputs = tree("model_dir")

    def command(self, model_dir: str) -> str:
        self._path = model_dir
        d = quote(model_dir)
        return (
            f"if [ -d {d} ]; then {read_command(model_dir, [MANIFEST_NAME], hostio.MODEL_FILE_CAP)}; "
            f"echo '{MARKER}files0'; "
            f"find -P {d} -path {quote(model_dir + '/.partial')} -prune -o -type f -printf '%s\\t%T@\\t%P\\0' "
            f"| base64; else echo '{MARKER}absent'; fi; true"
        )

    @staticmethod
    def default() -> ModelManifestInfo:
        return ModelManifestInfo("")

    def process(self, output: list[str]) -> ModelManifestInfo:
        return parse_model_manifest_output(getattr(self, "_path", ""), output)
