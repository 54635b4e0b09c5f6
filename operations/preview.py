"""What ``pyinfra --dry --diff`` shows of our managed files, where pyinfra's own ``files.put``
diff cannot be used as it is.

pyinfra's ``--diff`` makes ``files.put`` print ``Will modify PATH`` and a
unified diff of the file on the host against the new text. Two of our files must not go
through that as it is:

* ``.wslconfig`` may be UTF-16 with a BOM (Windows editors write it so): pyinfra decodes the
  new bytes as UTF-8 and the host's file through ``cat``, so it fails or prints noise;
* environment files hold secrets (the API key file, credentials in a URL): pyinfra would print
  the old and the new value.

For those, the operation prints the diff itself with pyinfra's own formatter
(``generate_color_diff``) on decoded, masked text, and runs ``files.put`` with pyinfra's diff
held off (``put_without_pyinfra_diff``). Every other managed file (units, apt sources, the
pin, pip.conf) keeps pyinfra's own diff.

Every diff, ours and pyinfra's, goes through one mask first (``core.redact.mask_lines``:
secret-named values, URL passwords, bearer tokens, keys the run read on the controller):
importing this module routes pyinfra's files operations' diff formatter through it
(``pyinfra_internals.mask_file_diffs``), so no file the deploy writes shows a secret.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from typing import Any

from pyinfra import host, logger, state
from pyinfra.operations import files
from pyinfra.operations.util.files import generate_color_diff

from freetoken_infra.core import pyinfra_internals, redact
from freetoken_infra.core.redact import MASK, SECRET_NAME

pyinfra_internals.mask_file_diffs(redact.mask_lines)


def diff_wanted() -> bool:
    return pyinfra_internals.diff_enabled(state)


def _env_pairs(text: str | None) -> dict[str, str]:
    pairs = {}
    for line in (text or "").splitlines():
        name, sep, value = line.partition("=")
        if sep:
            pairs[name.strip()] = value
    return pairs


def mask_env_lines(text: str | None, before: str | None = None) -> list[str]:
    """The lines of an environment file (``NAME=value``) with secret values masked: the value
    of a secret-looking name, and a password in a URL. With `before` (the host's text), a
    secret that differs from it is marked ``(changed)`` or ``(new)``, so a diff still says
    that it changes, never what it was or becomes."""
    old = _env_pairs(before) if before is not None else None
    out = []
    for line in (text or "").splitlines():
        name, sep, value = line.partition("=")
        if sep and SECRET_NAME.search(name):
            mark = ""
            if old is not None and old.get(name.strip()) != value:
                mark = " (new)" if name.strip() not in old else " (changed)"
            line = f"{name}={MASK}{mark}"
        else:
            line = redact.mask_text(line)
        out.append(line + "\n")
    return out


def diff_lines(current: list[str] | None, desired: list[str]) -> list[str]:
    """pyinfra's unified diff lines (colour codes included) of two lists of lines, secrets
    masked (``core.redact.mask_lines``)."""
    before, after = redact.mask_lines(current, desired)
    return list(generate_color_diff(before or [], after))


def log_diff(path: str, current: list[str] | None, desired: list[str]) -> None:
    """Print ``Will create``/``Will modify PATH`` and the diff, as pyinfra's files.put does."""
    if not diff_wanted() or current == desired:
        return
    host.log(f"Will {'create' if current is None else 'modify'} {path}", logger.info)
    for line in diff_lines(current, desired):
        logger.info("  %s", line)
    logger.info("")


def text_lines(text: str) -> list[str]:
    return [line.rstrip("\r\n") + "\n" for line in text.splitlines()]


def log_env_diff(path: str, current: str | None, desired: str) -> None:
    """The diff of an environment file, secret values masked (see ``mask_env_lines``)."""
    if not diff_wanted():
        return
    before = None if current is None else mask_env_lines(current)
    after = mask_env_lines(desired, before=current if current is not None else "")
    if current is not None and current != desired and before == after:
        after = [line.rstrip("\n") + " (changed)\n" for line in after]  # a change masking hid
    log_diff(path, before, after)


class _DiffHold:
    """Hold pyinfra's ``--diff`` off while any put of ours runs (gevent greenlets of other
    hosts may run in between: a count, so the last one out restores it)."""

    depth = 0
    saved = False

    def __enter__(self) -> None:
        if _DiffHold.depth == 0:
            _DiffHold.saved = pyinfra_internals.diff_enabled(state)
            pyinfra_internals.set_diff(state, False)
        _DiffHold.depth += 1

    def __exit__(self, *exc: Any) -> None:
        _DiffHold.depth -= 1
        if _DiffHold.depth == 0:
            pyinfra_internals.set_diff(state, _DiffHold.saved)


def put_without_pyinfra_diff(**put_args: Any) -> Generator[Any, None, None]:
    """``files.put._inner(**put_args)`` with pyinfra's own diff held off (we printed ours)."""
    commands: Iterable[Any]
    with _DiffHold():
        commands = list(files.put._inner(**put_args))
    yield from commands
