"""Secrets masked before text leaves the controller's hands: one place for every mask.

Used by the host lock (the operator's command line, written on the target and shown to whoever
waits for the lock), the doctor, and every diff ``--dry --diff`` prints (operations/preview.py
routes pyinfra's own diff formatter through ``mask_lines``). What counts as a secret:

* the value of an option or ``NAME=value`` whose name says password, key, token, secret or
  credential (``--ssh-password PW``, ``--ssh-key-password=PW``, ``--data hub_token=X``,
  ``FREETOKEN_API_KEY=...``);
* the password of a URL (``https://user:PW@host``);
* an ``Authorization: Bearer X`` value;
* a value the run itself knows is a secret (``remember``: the engine key read on the controller).

The mask is ``MASK`` (``********``), as docs/fleet.md and docs/security.md promise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

MASK = "********"
# Names whose values are secrets: FREETOKEN_API_KEY, HF_TOKEN, --ssh-password, pip_index_password...
SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSW(OR)?D|PASSPHRASE|CREDENTIAL|AUTH)", re.IGNORECASE)
# A password in a URL: scheme://user:password@host (the user stays, the password goes).
URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+@")
BEARER = re.compile(r"(\bBearer\s+)[^\s\"']+", re.IGNORECASE)
# NAME=value or NAME = value (env files, ini files such as pip.conf), value to the line's end.
_ASSIGNMENT = re.compile(r"^(\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_.-]*)\s*[=:]\s*)(.*?)(\s*)$")

# Values known to be secrets in this run (read on the controller to be sent to a host).
_known: set[str] = set()


def remember(value: str) -> None:
    """Mask ``value`` wherever it shows from now on in this process (values under 6 characters
    are not taken: they would mask ordinary words)."""
    if isinstance(value, str) and len(value.strip()) >= 6:
        _known.add(value.strip())


def mask_text(text: str) -> str:
    """``text`` (one line or many) with every secret above masked."""
    lines = text.splitlines(keepends=True) or [text]
    return "".join(_mask_line(line) for line in lines)


def _mask_line(line: str) -> str:
    for value in sorted(_known, key=len, reverse=True):
        if value in line:
            line = line.replace(value, MASK)
    body = line.rstrip("\r\n")
    end = line[len(body) :]
    m = _ASSIGNMENT.match(body)
    if m and SECRET_NAME.search(m.group(2)) and m.group(3) and not m.group(3).startswith(MASK):
        body = m.group(1) + MASK + m.group(4)
    body = URL_PASSWORD.sub(lambda u: u.group(1) + MASK + "@", body)
    body = BEARER.sub(lambda b: b.group(1) + MASK, body)
    return body + end


def mask_lines(current: Sequence[str] | None, desired: Sequence[str]) -> tuple[list[str] | None, list[str]]:
    """Both sides of a diff, masked. A desired line that differs from every current line but
    masks to one of them gets `` (secret changed)``: the diff says that a secret changes, never
    what it was or becomes."""
    # Where a desired line holds a known secret, the current line of the same shape holds the
    # old one (a host's file read back): its value at that place is masked too.
    shapes = _secret_shapes(desired)
    before = None if current is None else [_mask_line(_mask_shaped(line, shapes)) for line in current]
    raw_before = set(current or ())
    masked_before = set(before or ())
    after = []
    for line in desired:
        masked = _mask_line(line)
        if masked != line and line not in raw_before and masked in masked_before:
            body = masked.rstrip("\r\n")
            masked = body + " (secret changed)" + masked[len(body) :]
        after.append(masked)
    return before, after


def _secret_shapes(lines: Sequence[str]) -> list[re.Pattern[str]]:
    shapes = []
    for line in lines:
        found = sorted((v for v in _known if v in line), key=len, reverse=True)
        if found:
            parts = re.split("(" + "|".join(re.escape(v) for v in found) + ")", line.rstrip("\r\n"))
            shapes.append(re.compile("".join(r"(\S+)" if p in found else re.escape(p) for p in parts)))
    return shapes


def _mask_shaped(line: str, shapes: Sequence[re.Pattern[str]]) -> str:
    body = line.rstrip("\r\n")
    for shape in shapes:
        m = shape.fullmatch(body)
        if m:
            for start, end in sorted(
                (m.span(i) for i in range(1, m.lastindex + 1 if m.lastindex else 1)), reverse=True
            ):
                body = body[:start] + MASK + body[end:]
            return body + line[len(line.rstrip("\r\n")) :]
    return line


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line with its secrets masked: the value of a secret-named option (the next word,
    or after ``=``), ``--data KEY=VALUE`` with a secret-like KEY, URL passwords, known secrets.
    The program is shown by its name only."""
    out: list[str] = []
    mask_next = False
    for index, word in enumerate(argv):
        if index == 0:
            out.append(Path(word).name)
            continue
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        if word.startswith("-"):
            name, sep, _ = word.partition("=")
            if SECRET_NAME.search(name.lstrip("-")):
                if sep:
                    out.append(f"{name}={MASK}")
                else:
                    out.append(word)
                    mask_next = True
                continue
        else:
            name, sep, value = word.partition("=")
            if sep and value and SECRET_NAME.search(name):
                out.append(f"{name}={MASK}")
                continue
        out.append(_mask_line(word))
    return out


def redact_command(argv: Iterable[str]) -> str:
    """``redact_argv`` joined as a shell would read it."""
    import shlex

    return " ".join(shlex.quote(w) for w in redact_argv(list(argv)))
