"""Root's reads of files a less-trusted account can plant, for the facts: ``hostio.read_report``
run by the host's ``python3 -c`` (a fact runs before anything is uploaded), and its answer parsed.

Used for the owner's Windows files (below the drive root every Linux account writes) and for
the model folder (the download's user's): the folder is walked from ``/`` with ``O_NOFOLLOW``
descriptors and a file is read only when it is a regular file of at most its cap. A link, FIFO,
socket, device, folder or larger file comes back as one line naming the path and why
(``refused``, ``kind``), never as content.
"""

from __future__ import annotations

import ast
import base64
import binascii
import json
from dataclasses import dataclass, field

from freetoken_infra.core import hostio

from ._output import MARKER, quote, section_map


def _compact(source: str) -> str:
    """``source`` without its docstrings and comments: every fact that reads this way carries it
    in the batch's one command line (``ast.unparse`` keeps the code, drops the prose)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body[:] = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


# hostio's source, run by the facts with python3 -c.
with open(hostio.__file__, encoding="utf-8") as _source:
    HOSTIO_SOURCE = _compact(_source.read())
_READ_MAIN = "\nimport sys\nprint(read_report(sys.argv[1], sys.argv[3:], int(sys.argv[2])))\n"


def read_command(folder: str, names: tuple[str, ...] | list[str], cap: int = hostio.WINDOWS_FILE_CAP) -> str:
    """Shell printing ``hostio.read_report`` for ``names`` in ``folder``: the folder walked from
    ``/`` without following a link, each file read only when it is a regular file of at most
    ``cap`` bytes. Without python3: a ``no-python`` section."""
    args = " ".join(quote(a) for a in (folder, str(cap), *names))
    return (
        "if command -v python3 >/dev/null 2>&1; then "
        f"python3 -c {quote(HOSTIO_SOURCE + _READ_MAIN)} {args} 2>&1 </dev/null; "
        f"else echo '{MARKER}no-python'; fi"
    )


@dataclass(frozen=True)
class ReadFile:
    """A file read this way: its bytes (None: there is none), or why root did not read it
    (``refused``, one line naming the path; ``kind`` as ``hostio.Refused``)."""

    data: bytes | None
    refused: str | None = None
    kind: str | None = None


@dataclass(frozen=True)
class ReadFolder:
    """``hostio.read_folder``'s answer: ``folder`` is ``ok``, ``missing`` or ``refused``."""

    folder: str
    refused: str | None = None
    kind: str | None = None
    files: dict[str, ReadFile] = field(default_factory=dict)


def parse_read_output(lines: list[str]) -> ReadFolder:
    secs = section_map(lines)
    if "no-python" in secs:
        return ReadFolder("refused", "python3 not found", "error")
    if "read" not in secs:
        return ReadFolder("refused", "no output", "error")
    try:
        doc = json.loads(base64.b64decode(secs["read"][0].strip(), validate=True))
    except (binascii.Error, ValueError):
        return ReadFolder("refused", "unreadable fact output", "error")
    if not isinstance(doc, dict) or doc.get("folder") not in ("ok", "missing", "refused"):
        return ReadFolder("refused", "unreadable fact output", "error")
    if doc["folder"] != "ok":
        return ReadFolder(doc["folder"], _text(doc.get("refused")), _text(doc.get("kind")))
    files: dict[str, ReadFile] = {}
    entries = doc.get("files")
    for name, entry in (entries if isinstance(entries, dict) else {}).items():
        if entry is None:
            files[name] = ReadFile(None)
        elif isinstance(entry, dict) and isinstance(entry.get("data"), str):
            try:
                files[name] = ReadFile(base64.b64decode(entry["data"], validate=True))
            except (binascii.Error, ValueError):
                files[name] = ReadFile(None, f"{name}: unreadable fact output", "error")
        elif isinstance(entry, dict):
            files[name] = ReadFile(None, _text(entry.get("refused")) or name, _text(entry.get("kind")))
    return ReadFolder("ok", files=files)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None
