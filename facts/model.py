"""Fact about a model directory: its files and the quantisation its config files declare.

The quantisation summary itself is pure code in ``freetoken_infra.core.quant`` (the downloader
uses it on the target too); this module only reads the directory. The rules decide.

The directory is the download's user's (``freetoken-fetch``, which talks to the hub), and this
fact runs as root: no link in it is followed (``find -P``), and ``config.json`` and
``hf_quant_config.json`` are read through ``hostio`` (``_hostread``): only a regular file of at
most ``hostio.MODEL_FILE_CAP`` bytes, reached without a link. Anything else is a one-line
refusal in ``error``: the rules warn and the deploy fetches the model again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pyinfra.api import FactBase

from freetoken_infra.core import hostio
from freetoken_infra.core.quant import QuantSummary, summarize_quant

from ._declare import PATH, tree
from ._hostread import parse_read_output, read_command
from ._output import MARKER, nul_records, parse_int, quote, sections

__all__ = ["ModelDirInfo", "ModelDirectory", "QuantSummary", "parse_model_dir_output", "summarize_quant"]


@dataclass(frozen=True)
class ModelDirInfo:
    path: str
    exists: bool
    files: dict[str, int] = field(default_factory=dict)
    quant: QuantSummary | None = None
    error: str | None = None
    # config.json as parsed (None when absent or broken): architectures, model_type, ...
    config: dict | None = None


CONFIG_FILES = ("config.json", "hf_quant_config.json")


def _load_json(name: str, data: bytes) -> tuple[dict | None, str | None]:
    try:
        value = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError) as exc:
        return None, f"{name} is not valid JSON: {exc}"
    if not isinstance(value, dict):
        return None, f"{name} is not a JSON object"
    return value, None


def parse_model_dir_output(path: str, lines: list[str]) -> ModelDirInfo:
    files: dict[str, int] = {}
    exists = False
    config = hf_quant = None
    errors: list[str] = []
    for name, arg, body in sections(lines):
        if name == "dir":
            exists = True
            path = path or arg
        elif name == "names0":
            # NUL-terminated records, base64 over the wire: file names are the hub's text.
            for record in nul_records(body):
                size, sep, rel = record.partition("\t")
                if sep and parse_int(size) is not None:
                    files[rel] = int(size)
        elif name == "absent":
            path = path or arg
    if exists:
        seen = parse_read_output(lines)
        if seen.folder != "ok":
            # A folder on the way that is a link (refused), or gone since the listing.
            errors.append(seen.refused or f"{path} was not read")
        for config_name in CONFIG_FILES:
            got = seen.files.get(config_name)
            if got is None or (got.data is None and got.refused is None):
                continue
            if got.refused is not None:
                errors.append(got.refused)  # one line naming the path: a link, a FIFO, too large
                continue
            assert got.data is not None
            value, error = _load_json(config_name, got.data)
            if error:
                errors.append(error)
            elif config_name == "config.json":
                config = value
            else:
                hf_quant = value
    if not exists:
        return ModelDirInfo(path, False, {}, None, None)
    quant = None
    # No config.json yet (a download that stopped early) is not an error: the downloader
    # fetches the config files first and checks the quantisation before any weight.
    if "config.json" in files and config is not None and not errors:
        quant = summarize_quant(config, hf_quant)
    return ModelDirInfo(path, True, files, quant, "; ".join(errors) or None, config)


class ModelDirectory(FactBase[ModelDirInfo]):
    """
    Returns ``ModelDirInfo``: the regular files (name -> size, two levels, dot-dirs such as
    ``.cache`` skipped, no link followed: the downloader writes none) and the quantisation
    summary from ``config.json`` / ``hf_quant_config.json``, read without following a link (a
    link, FIFO or oversize file there is refused in ``error``, naming it).

    + path: the model directory
    """

    argument_shapes = {"path": PATH}
    fast_check_inputs = tree("path")

    def command(self, path: str) -> str:
        self._path = path
        return (
            f'P={quote(path)}; if [ -d "$P" ]; then echo "{MARKER}dir $P"; echo \'{MARKER}names0\'; '
            "find -P \"$P\" -mindepth 1 -maxdepth 2 \\( -type d -name '.*' -prune \\) "
            "-o -type f -printf '%s\\t%P\\0' 2>/dev/null | base64; "
            f"{read_command(path, CONFIG_FILES, hostio.MODEL_FILE_CAP)}; "
            f'else echo "{MARKER}absent $P"; fi; true'
        )

    @staticmethod
    def default() -> ModelDirInfo:
        return ModelDirInfo("", False, {}, None, "no output")

    def process(self, output: list[str]) -> ModelDirInfo:
        return parse_model_dir_output(getattr(self, "_path", ""), output)
