"""Fact about a model directory: its files and the quantisation its config files declare.

The quantisation summary itself is pure code in ``freetoken_infra.core.quant`` (the downloader
uses it on the target too); this module only reads the directory. The rules decide.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pyinfra.api import FactBase

from freetoken_infra.core.quant import QuantSummary, summarize_quant

from ._output import MARKER, b64decode_lines, nul_records, parse_int, quote, sections

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


def _load_json(name: str, body: list[str]) -> tuple[dict | None, str | None]:
    data = b64decode_lines(body)
    if data is None:
        return None, f"{name}: undecodable transport"
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
        elif name == "json":
            value, error = _load_json(arg, body)
            if error:
                errors.append(error)
            elif arg == "config.json":
                config = value
            elif arg == "hf_quant_config.json":
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
    Returns ``ModelDirInfo``: the files (name -> size, two levels, dot-dirs such as ``.cache``
    skipped, symlinks followed as in a hub snapshot) and the quantisation summary from
    ``config.json`` / ``hf_quant_config.json``.

    + path: the model directory
    """

    def command(self, path: str) -> str:
        self._path = path
        return (
            f'P={quote(path)}; if [ -d "$P" ]; then echo "{MARKER}dir $P"; echo \'{MARKER}names0\'; '
            "find -L \"$P\" -mindepth 1 -maxdepth 2 \\( -type d -name '.*' -prune \\) "
            "-o -type f -printf '%s\\t%P\\0' 2>/dev/null | base64; "
            "for F in config.json hf_quant_config.json; do "
            f'if [ -f "$P/$F" ]; then echo "{MARKER}json $F"; base64 < "$P/$F"; fi; done; '
            f'else echo "{MARKER}absent $P"; fi; true'
        )

    @staticmethod
    def default() -> ModelDirInfo:
        return ModelDirInfo("", False, {}, None, "no output")

    def process(self, output: list[str]) -> ModelDirInfo:
        return parse_model_dir_output(getattr(self, "_path", ""), output)
