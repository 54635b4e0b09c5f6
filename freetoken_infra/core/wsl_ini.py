"""``.wslconfig`` and ``/etc/wsl.conf`` as WSL itself reads them, and an edit that keeps the rest.

Core module: no pyinfra. The facts, the rules, the merge operation and the testinfra checks all
read these files through :func:`parse`, so they agree with each other and with WSL.

WSL's parser is ``ParseConfigFile`` in microsoft/WSL ``src/shared/configfile/configfile.cpp``
(one parser for both files); what it does, and so what this module does:

- A line is a comment when its first non-blank character is ``#``; ``#`` outside double quotes
  also ends a value (``memory=4GB   # limit`` is ``4GB``). ``;`` is *not* a comment: such a line
  is an invalid key line.
- ``[name]``: a letter, then letters and digits, then ``]``; only blanks or a ``#`` comment may
  follow. Section and key names match case-insensitively (``ConfigKey::Matches``: strcasecmp on
  ``section.key``).
- ``key = value``: a letter, then letters and digits (no ``_``, ``-`` or ``.``), blanks, ``=``.
  Blanks around the value are dropped; double quotes are removed wherever they are and protect
  ``#`` and blanks; backslash escapes ``\\\\ \\" \\b \\n \\t``; a backslash before the line end
  continues the value on the next line; any other escape (``C:\\Users``) makes the line invalid.
- A key before the first section header has no section: WSL warns "unknown key" and ignores it.
- A key given twice (also under its old name, e.g. ``[experimental] networkingMode`` after
  ``[wsl2] networkingMode``): the **first** one counts, later ones are warned about
  (``ConfigKey::Parse``).
- An invalid line: ``.wslconfig`` is parsed with ``CFG_SKIP_INVALID_LINES`` (WslCoreConfig.cpp):
  the line is skipped. ``/etc/wsl.conf`` is parsed without it (src/linux/init: main.cpp,
  WslDistributionConfig.cpp): WSL stops reading at the first invalid line and the rest of the
  file is ignored.
- Encoding: Windows opens ``.wslconfig`` with ``_wfopen(path, "rt,ccs=UTF-8")``: a UTF-8 or
  UTF-16LE byte-order mark picks the encoding, text mode turns CRLF into LF. The Linux side reads
  ``/etc/wsl.conf`` byte by byte (musl, C locale): a byte-order mark is an invalid first line, so
  WSL reads nothing from that file; CR before LF is skipped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Dialect = Literal["wslconfig", "wslconf"]
Encoding = Literal["utf-8", "utf-8-sig", "utf-16-le"]

WSLCONFIG: Dialect = "wslconfig"  # %UserProfile%\.wslconfig, read by Windows
WSLCONF: Dialect = "wslconf"  # /etc/wsl.conf, read by the distro's init

# Keys WSL still reads under their pre-2.0 [experimental] names (WslCoreConfig.cpp: "Features that
# were previously experimental (the old header is maintained for compatibility)").
LEGACY_NAMES: Mapping[str, tuple[str, ...]] = {
    "wsl2.networkingmode": ("experimental.networkingMode",),
    "wsl2.dnstunneling": ("experimental.dnsTunneling",),
    "wsl2.firewall": ("experimental.firewall",),
    "wsl2.autoproxy": ("experimental.autoProxy",),
}

_HSPACE = " \t"
_ESCAPES = {"\\": "\\", '"': '"', "b": "\b", "n": "\n", "t": "\t"}
# Values that WSL reads back unchanged when written bare.
_BARE_VALUE = re.compile(r"[A-Za-z0-9._:/+,@%-]*")


def _alpha(ch: str) -> bool:
    return ("a" <= ch <= "z") or ("A" <= ch <= "Z")


def _alnum(ch: str) -> bool:
    return _alpha(ch) or ("0" <= ch <= "9")


@dataclass(frozen=True)
class IniProblem:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass(frozen=True)
class IniEntry:
    """One ``key = value`` line WSL parsed (also the ones it then ignores)."""

    section: str  # as spelt in its header; "" before the first header (WSL ignores the key)
    key: str  # as spelt
    value: str  # the value as WSL reads it
    line: int
    line_start: int  # offsets into WslIniFile.text
    value_start: int
    value_end: int  # end of the value's text, before trailing blanks and a comment
    line_end: int  # after the line's end of line (or end of text)
    continued: bool = False  # a backslash carried the value over a line end

    @property
    def name(self) -> str:
        """``section.key`` in lower case, as WSL matches it; ``key`` alone before any section."""
        return f"{self.section}.{self.key}".lower() if self.section else self.key.lower()


@dataclass(frozen=True)
class IniHeader:
    name: str
    line: int
    line_start: int
    line_end: int


@dataclass(frozen=True)
class WslIniFile:
    """A parsed file: what WSL reads from it, and where each piece is in the text."""

    dialect: Dialect
    text: str = ""
    encoding: Encoding = "utf-8"
    entries: tuple[IniEntry, ...] = ()
    headers: tuple[IniHeader, ...] = ()
    problems: tuple[IniProblem, ...] = ()
    # wsl.conf only: WSL stops at this line (invalid); nothing from it on is read.
    stopped_at: int | None = None
    # The bytes could not be decoded the way WSL decodes them: WSL reads no key.
    error: str | None = None

    def first(self, section: str, key: str) -> IniEntry | None:
        """The entry WSL uses for ``[section] key`` (or one of its legacy names), or None."""
        names = _names(section, key)
        for entry in self.entries:
            if entry.section and entry.name in names:
                return entry
        return None

    def value(self, section: str, key: str) -> str | None:
        entry = self.first(section, key)
        return entry.value if entry else None

    def duplicates(self, section: str, key: str) -> tuple[IniEntry, ...]:
        """Every entry of the key WSL reads (first) and warns about (the rest)."""
        names = _names(section, key)
        return tuple(e for e in self.entries if e.section and e.name in names)

    def sections(self) -> dict[str, dict[str, str]]:
        """``{section: {key: value}}`` in lower case, first occurrence winning, as WSL reads it;
        keys before the first header are left out (WSL ignores them)."""
        out: dict[str, dict[str, str]] = {}
        for entry in self.entries:
            if entry.section:
                out.setdefault(entry.section.lower(), {}).setdefault(entry.key.lower(), entry.value)
        return out

    @property
    def newline(self) -> str:
        return "\r\n" if "\r\n" in self.text else "\n"


def _names(section: str, key: str) -> set[str]:
    name = f"{section}.{key}".lower()
    return {name, *(alias.lower() for alias in LEGACY_NAMES.get(name, ()))}


# --------------------------------------------------------------------------- decoding


def decode(data: bytes, dialect: Dialect) -> tuple[str, Encoding, str | None]:
    """``(text, encoding, error)``: the bytes as WSL's side of the file decodes them."""
    if dialect == WSLCONF:
        # Byte by byte (musl's C locale maps every byte to one character); surrogateescape keeps
        # bytes that are not UTF-8 so that an edit writes them back unchanged. A BOM stays in the
        # text: the parser then finds the invalid first line WSL finds.
        return data.decode("utf-8", errors="surrogateescape"), "utf-8", None
    if data.startswith(b"\xff\xfe"):
        try:
            return data[2:].decode("utf-16-le"), "utf-16-le", None
        except UnicodeDecodeError as exc:
            return "", "utf-16-le", f"not valid UTF-16LE: {exc}"
    if data.startswith(b"\xfe\xff"):
        return "", "utf-8", "UTF-16 big-endian: WSL only reads UTF-8 or UTF-16LE with a byte-order mark"
    if data.startswith(b"\xef\xbb\xbf"):
        body, encoding = data[3:], "utf-8-sig"
    else:
        body, encoding = data, "utf-8"
    if len(body) >= 2 and body[1:2] == b"\x00" and body[:1] != b"\x00":
        return "", "utf-8", "UTF-16 without a byte-order mark: WSL reads it as UTF-8 and finds no key"
    try:
        return body.decode("utf-8"), encoding, None  # type: ignore[return-value]
    except UnicodeDecodeError as exc:
        return "", "utf-8", f"not valid UTF-8: {exc}"


def encode(text: str, encoding: Encoding, dialect: Dialect) -> bytes:
    if encoding == "utf-16-le":
        return b"\xff\xfe" + text.encode("utf-16-le")
    if encoding == "utf-8-sig":
        return b"\xef\xbb\xbf" + text.encode("utf-8")
    errors = "surrogateescape" if dialect == WSLCONF else "strict"
    return text.encode("utf-8", errors=errors)


# --------------------------------------------------------------------------- parsing


class _Invalid(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def parse(data: bytes | None, dialect: Dialect) -> WslIniFile:
    """Parse the bytes of a ``.wslconfig`` (``WSLCONFIG``) or ``/etc/wsl.conf`` (``WSLCONF``)."""
    if data is None:
        return WslIniFile(dialect)
    text, encoding, error = decode(data, dialect)
    if error:
        return WslIniFile(dialect, "", encoding, error=error, problems=(IniProblem(1, error),))
    return _Parser(text, dialect).run(encoding)


class _Parser:
    def __init__(self, text: str, dialect: Dialect) -> None:
        self.text = text
        self.n = len(text)
        self.dialect = dialect
        self.i = 0
        self.line = 1
        # WSL keeps the section name and the last key in one buffer; a key's section is the
        # buffer cut to the length of the last valid header (an invalid header line can change
        # the buffer without changing that length).
        self.buffer = ""
        self.section_length = 0
        self.entries: list[IniEntry] = []
        self.headers: list[IniHeader] = []
        self.problems: list[IniProblem] = []

    def ch(self, offset: int = 0) -> str:
        j = self.i + offset
        return self.text[j] if j < self.n else ""

    def at_line_end(self) -> bool:
        return self.ch() in ("", "\n", "\r")

    def end_line(self) -> None:
        """Consume the rest of this line and its line end."""
        while not self.at_line_end():
            self.i += 1
        self.newline()

    def newline(self) -> None:
        if self.ch() == "\r":
            self.i += 1
        if self.ch() == "\n":
            self.i += 1
        self.line += 1

    def skip_blanks(self) -> None:
        while self.ch() in ("\t", " ") and self.ch():
            self.i += 1

    def run(self, encoding: Encoding) -> WslIniFile:
        stopped: int | None = None
        while self.i < self.n:
            start, line = self.i, self.line
            self.skip_blanks()
            c = self.ch()
            try:
                if c in ("", "\n", "\r"):
                    self.newline()
                elif c == "#":
                    self.end_line()
                elif c == "[":
                    self.header(start, line)
                elif _alpha(c):
                    self.key_value(start, line)
                elif c == "\ufeff":
                    raise _Invalid(
                        "a UTF-8 byte-order mark: WSL's Linux side reads it as an invalid "
                        "first line (save the file as UTF-8 without BOM)"
                    )
                else:
                    raise _Invalid("invalid key: a key starts with a letter a-z")
            except _Invalid as bad:
                self.problems.append(IniProblem(line, bad.message))
                if self.dialect == WSLCONF:
                    self.problems.append(
                        IniProblem(line, "WSL stops reading /etc/wsl.conf at this line: it ignores the rest")
                    )
                    stopped = line
                    break
                # WSL skips the rest of the line it is on (after a continuation: the later line).
                self.end_line()
        return WslIniFile(
            self.dialect,
            self.text,
            encoding,
            tuple(self.entries),
            tuple(self.headers),
            tuple(self.problems),
            stopped,
        )

    def header(self, start: int, line: int) -> None:
        self.i += 1
        if not _alpha(self.ch()):
            raise _Invalid("invalid section name: it starts with a letter a-z")
        name_start = self.i
        while _alnum(self.ch()):
            self.i += 1
        self.buffer = self.text[name_start : self.i]
        if self.ch() != "]":
            raise _Invalid("expected ']' (a section name has only letters and digits)")
        self.i += 1
        self.skip_blanks()
        if not (self.at_line_end() or self.ch() == "#"):
            raise _Invalid("expected the end of the line after ']'")
        self.section_length = len(self.buffer)
        self.end_line()
        self.headers.append(IniHeader(self.buffer, line, start, self.i))

    def key_value(self, start: int, line: int) -> None:
        prefix = self.buffer[: self.section_length]
        # A shorter buffer is padded with NULs in WSL: such a key matches nothing.
        section = prefix if len(prefix) == self.section_length else "\0"
        key_start = self.i
        while _alnum(self.ch()):
            self.i += 1
        key = self.text[key_start : self.i]
        self.buffer = f"{prefix}.{key}" if self.section_length else key
        self.skip_blanks()
        if self.ch() != "=":
            raise _Invalid("expected '=' (a key has only letters and digits)")
        self.i += 1
        self.skip_blanks()
        value_start = self.i
        value_end = self.i
        chars: list[str] = []
        kept = 0  # length of the value without trailing blanks
        in_quote = False
        continued = False
        while not self.at_line_end():
            c = self.ch()
            if c == '"':
                in_quote = not in_quote
                self.i += 1
            elif c == "\\":
                nxt = self.ch(1)
                if nxt in _ESCAPES:
                    chars.append(_ESCAPES[nxt])
                    self.i += 2
                elif nxt == "\n":
                    self.i += 2
                    self.line += 1
                    continued = True
                elif nxt == "\r":
                    if self.dialect == WSLCONFIG and self.ch(2) == "\n":
                        self.i += 3  # Windows text mode read CRLF as LF: a continuation
                        self.line += 1
                        continued = True
                    else:
                        self.i += 2  # the Linux side skips the CR; the LF then ends the value
                else:
                    raise _Invalid(
                        f"invalid escaped character {nxt!r} (write a backslash as \\\\)"
                        if nxt
                        else "a backslash at the end of the file"
                    )
            elif c == "#" and not in_quote:
                break
            else:
                chars.append(c)
                self.i += 1
                if c in _HSPACE:
                    continue
            kept = len(chars)
            value_end = self.i
        if in_quote:
            raise _Invalid("expected '\"' (a quote is not closed)")
        self.end_line()
        self.entries.append(
            IniEntry(
                section=section,
                key=key,
                value="".join(chars[:kept]),
                line=line,
                line_start=start,
                value_start=value_start,
                value_end=value_end,
                line_end=self.i,
                continued=continued,
            )
        )


# --------------------------------------------------------------------------- editing


@dataclass(frozen=True)
class MergeResult:
    """What :func:`merge` would write: ``data`` is the original bytes when nothing in WSL's
    reading changes, and also when ``problem`` says the file cannot be merged safely."""

    data: bytes
    changed: tuple[str, ...] = ()  # keys whose value WSL reads changes
    problem: IniProblem | None = None
    notes: tuple[str, ...] = field(default=())  # e.g. an old-name duplicate commented out

    @property
    def writes(self) -> bool:
        return self.problem is None and bool(self.changed)


def format_value(value: str) -> str:
    """The value as written so that WSL reads exactly ``value`` back."""
    if _BARE_VALUE.fullmatch(value):
        return value
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def same_value(seen: str | None, want: str) -> bool:
    """WSL reads booleans, enums (``Mirrored``) and sizes (``24gb``) without regard to case."""
    return seen is not None and seen.strip().lower() == want.strip().lower()


def merge(original: bytes | None, dialect: Dialect, section: str, values: Mapping[str, str]) -> MergeResult:
    """Make WSL read ``values`` in ``[section]``, changing nothing else it reads.

    ``original`` None: the file does not exist (it is created with just that section).

    Keeps every byte that need not change: comments, foreign keys, blank lines, key spelling,
    the blanks and comment around a value, encoding, BOM and line ends. A key whose value WSL
    already reads as wanted is not touched. A key WSL reads from its old ``[experimental]`` place
    moves to ``[section]`` (the old line is commented out, so WSL warns about no duplicate); a
    later duplicate of a key that changes is commented out as well.
    """
    ini = parse(original, dialect) if original is not None else WslIniFile(dialect)
    return merge_parsed(ini, section, values, original)


def merge_parsed(
    ini: WslIniFile, section: str, values: Mapping[str, str], original: bytes | None = None
) -> MergeResult:
    """:func:`merge` on a file already parsed (``original``: its bytes, when at hand)."""
    dialect = ini.dialect
    if original is not None:
        raw = original
    else:
        raw = b"" if ini.error else encode(ini.text, ini.encoding, dialect)
    if ini.error:
        return MergeResult(raw, problem=IniProblem(1, ini.error))
    try:
        plan = _plan_edits(ini, section, values)
    except _Unsafe as unsafe:
        return MergeResult(raw, problem=unsafe.problem)
    if not plan.changed:
        return MergeResult(raw)
    out = _apply_edits(ini.text, plan, section, ini.newline)
    problem = _unread_after_merge(ini, out, section, values, plan.changed)
    if problem is not None:
        return MergeResult(raw, problem=problem)
    return MergeResult(encode(out, ini.encoding, dialect), tuple(plan.changed), None, tuple(plan.notes))


@dataclass
class _EditPlan:
    """What a merge changes in the text: ``edits`` are (offset, order, end, replacement), applied
    back to front; ``appended`` are lines for a new ``[section]`` at the end."""

    edits: list[tuple[int, int, int, str]] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    appended: list[str] = field(default_factory=list)

    def comment_out(self, entry: IniEntry, why: str) -> None:
        if entry.continued:
            raise _Unsafe(IniProblem(entry.line, f"{entry.key} continues over lines: edit it by hand"))
        self.edits.append((entry.line_start, 0, entry.line_start, "# "))
        self.notes.append(f"line {entry.line}: commented out [{entry.section}] {entry.key} ({why})")


def _insert_point(ini: WslIniFile, section: str) -> int | None:
    """Where a new key of ``[section]`` goes: after the section's last entry before the next
    header (None: the file has no such section)."""
    target = next((h for h in ini.headers if h.name.lower() == section.lower()), None)
    if target is None:
        return None
    last = target.line_end
    for entry in ini.entries:
        if entry.section.lower() == section.lower() and entry.line_start >= target.line_end:
            following = [h for h in ini.headers if target.line_end <= h.line_start < entry.line_start]
            if following:
                break
            last = entry.line_end
    return last


def _plan_edits(ini: WslIniFile, section: str, values: Mapping[str, str]) -> _EditPlan:
    """The edits that make WSL read ``values``; raises :class:`_Unsafe` where it cannot be done safely."""
    plan = _EditPlan()
    text, nl = ini.text, ini.newline
    for order, (key, want) in enumerate(values.items(), start=1):
        found = ini.duplicates(section, key)
        if found and same_value(found[0].value, want):
            continue
        plan.changed.append(key)
        in_place = [e for e in found if e.name == f"{section}.{key}".lower()]
        keep = in_place[0] if in_place else None
        if keep is not None and keep.continued:
            raise _Unsafe(IniProblem(keep.line, f"{key} continues over lines: edit it by hand"))
        for entry in found:
            if entry is not keep:
                plan.comment_out(entry, f"superseded by [{section}] {key}")
        if keep is not None:
            plan.edits.append((keep.value_start, order, keep.value_end, format_value(want)))
            continue
        point = _insert_point(ini, section)
        if point is None:
            plan.appended.append(f"{key}={format_value(want)}{nl}")
            continue
        prefix = "" if point == 0 or text[point - 1] in "\r\n" else nl
        plan.edits.append((point, order, point, f"{prefix}{key}={format_value(want)}{nl}"))
    return plan


def _apply_edits(text: str, plan: _EditPlan, section: str, nl: str) -> str:
    out = text
    for start, _, end, replacement in sorted(plan.edits, key=lambda e: (e[0], e[1]), reverse=True):
        out = out[:start] + replacement + out[end:]
    if plan.appended:
        if out and not out.endswith(("\n", "\r")):
            out += nl
        if out.strip():
            out += nl
        out += f"[{section}]{nl}" + "".join(plan.appended)
    return out


def _unread_after_merge(
    ini: WslIniFile, out: str, section: str, values: Mapping[str, str], changed: list[str]
) -> IniProblem | None:
    """Why WSL would not read ``values`` from the merged text ``out`` (None: it would)."""
    dialect = ini.dialect
    if ini.stopped_at is not None:
        # wsl.conf: WSL ignores everything from its first invalid line on.
        problem = IniProblem(
            ini.stopped_at, next((p.message for p in ini.problems if p.line == ini.stopped_at), "invalid line")
        )
        check = parse(encode(out, ini.encoding, dialect), dialect)
        if any(not same_value(check.value(section, k), v) for k, v in values.items()):
            return IniProblem(
                problem.line,
                f"{problem.message}; WSL stops reading the file there, so "
                f"[{section}] {', '.join(changed)} added after it would be ignored: fix that line",
            )
    check = parse(encode(out, ini.encoding, dialect), dialect)
    wrong = [k for k, v in values.items() if not same_value(check.value(section, k), v)]
    if wrong:  # never write a file WSL would not read as asked
        line = check.stopped_at or 1
        return IniProblem(line, f"after the merge WSL would not read {', '.join(wrong)}")
    return None


class _Unsafe(Exception):
    def __init__(self, problem: IniProblem) -> None:
        super().__init__(str(problem))
        self.problem = problem


def differences(ini: WslIniFile, section: str, values: Mapping[str, str]) -> dict[str, str | None]:
    """``{key: value WSL reads now}`` for each key whose reading differs from ``values``."""
    return {k: ini.value(section, k) for k, want in values.items() if not same_value(ini.value(section, k), want)}


def drive_root(wslconf: WslIniFile) -> str:
    """Where WSL mounts Windows drives (``[automount] root``, default ``/mnt/``), ending in ``/``."""
    root = wslconf.value("automount", "root") or "/mnt/"
    return root if root.endswith("/") else root + "/"
