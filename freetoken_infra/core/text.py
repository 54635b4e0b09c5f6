"""Untrusted text made printable: what the engine, a host or a report file said, shown to the
operator as data.

Engine-controlled text (``/health`` phase, version, model and message, the fetcher's status,
journal lines) reached the terminal raw: an OSC escape retitles the window or writes the
clipboard, a CSI escape clears the screen or hides lines, a carriage return overwrites the start
of the line. Every such value goes through ``printable`` where it is printed
or put in a report; one function, so that every place escapes the same way.
"""

from __future__ import annotations

# Beyond the control characters: the bidirectional overrides and isolates, which reorder what
# the operator reads ("Trojan Source"), and the Unicode line and paragraph separators.
_FORMAT_CONTROLS = frozenset(
    [0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C, 0xFEFF]
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: object) -> str:
    """``text`` (``str()`` of any value) with every C0 control, ESC, DEL, C1 control, bidi
    control and Unicode line separator written as a visible escape (``\\x1b``, ``\\n``,
    ``\\u202e``); everything else, backslashes and non-ASCII letters included, is kept as it is,
    so ordinary text reads unchanged. The result holds no character a terminal acts on."""
    text = text if isinstance(text, str) else str(text)
    if text.isprintable():  # the common case: nothing to do (isprintable() is False for all of them)
        return text
    out = []
    for c in text:
        o = ord(c)
        if c in _NAMED:
            out.append(_NAMED[c])
        elif o < 0x20 or 0x7F <= o <= 0x9F:
            out.append(f"\\x{o:02x}")
        elif o in _FORMAT_CONTROLS:
            out.append(f"\\u{o:04x}")
        else:
            out.append(c)
    return "".join(out)


def printable_lines(text: object) -> list[str]:
    """Multi-line untrusted text (a journal tail, an error with its details) as printable lines:
    split on line ends only, each line escaped."""
    return [printable(line) for line in str(text).splitlines()]


def printable_block(text: object) -> str:
    """``printable_lines`` joined again with newlines: a multi-line message kept multi-line."""
    return "\n".join(printable_lines(text))
