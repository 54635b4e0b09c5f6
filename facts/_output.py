"""Shared parsing helpers for the facts in this package.

Fact commands must exit 0 (pyinfra treats a non-zero exit as "could not load fact"), so each
command reports what happened in its own output: marker lines starting with ``@@ft:`` split the
output into sections, and bytes that are not safe as UTF-8 text lines (UTF-16LE from
``wsl.exe``, OEM code pages from ``cmd.exe``, arbitrary file contents) travel base64-encoded.
"""

from __future__ import annotations

import base64
import binascii
import shlex

MARKER = "@@ft:"


def quote(value: str) -> str:
    """Quote a value for the target's POSIX sh."""
    return shlex.quote(value)


def sections(lines: list[str]) -> list[tuple[str, str, list[str]]]:
    """Split fact output into ``(name, argument, body_lines)`` at ``@@ft:NAME ARG`` markers.

    Lines before the first marker land in a section named ``""``. Trailing ``\\r`` is kept in
    bodies (callers that care about CRLF strip it themselves).
    """
    out: list[tuple[str, str, list[str]]] = []
    name, arg = "", ""
    body: list[str] = []
    started = False
    for line in lines:
        if line.startswith(MARKER):
            if started or body:
                out.append((name, arg, body))
            head = line[len(MARKER) :].rstrip("\r")
            name, _, arg = head.partition(" ")
            body = []
            started = True
        else:
            body.append(line)
    if started or body:
        out.append((name, arg, body))
    return out


def section_map(lines: list[str]) -> dict[str, tuple[str, list[str]]]:
    """Like :func:`sections` but keyed by name (the last section of a name wins)."""
    return {name: (arg, body) for name, arg, body in sections(lines)}


def b64decode_lines(lines: list[str]) -> bytes | None:
    """Decode base64 text split over lines (as coreutils ``base64`` wraps it); None if invalid."""
    text = "".join(line.strip() for line in lines)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def nul_records(lines: list[str]) -> list[str]:
    """The NUL-terminated records of base64 text (``find -printf '...\\0' | base64``): names
    that may hold any byte but NUL, newlines included. Undecodable text gives no records."""
    data = b64decode_lines(lines)
    if not data:
        return []
    return [r.decode("utf-8", "surrogateescape") for r in data.split(b"\0") if r]


def parse_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None
