"""Facts about the FreeToken engine: what is installed (one venv per engine version under a
base dir, an ``active`` symlink choosing one) and what ``GET /health`` answers."""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api import FactBase

from ._declare import ADDRESS, PATH, PORT, Inputs, path_arg
from ._output import MARKER, b64decode_lines, parse_int, quote, sections

# --------------------------------------------------------------------------- install


@dataclass(frozen=True)
class EngineInstallInfo:
    base_dir: str
    versions: dict[str, str | None] = field(default_factory=dict)
    active: str | None = None
    # What the ``active`` link literally points to (None when it is absent or not a link).
    active_target: str | None = None


def parse_engine_install_output(base_dir: str, lines: list[str]) -> EngineInstallInfo:
    versions: dict[str, str | None] = {}
    active = None
    active_target = None
    dirs: set[str] = set()
    for name, arg, body in sections(lines):
        if name == "base" and not base_dir:
            base_dir = arg
        elif name == "venv":
            dirs.add(arg)
            values = [line.partition(":")[2].strip() for line in body if line.startswith("Version:")]
            versions[arg] = values[0] if values else None
        elif name == "dir":
            dirs.add(arg)
        elif name == "active":
            active_target = arg or None
            if active_target:
                candidate = posixpath.basename(active_target.rstrip("/"))
                active = candidate if candidate in dirs or candidate in versions else None
    return EngineInstallInfo(base_dir, versions, active, active_target)


def _install_inputs(kwargs: dict[str, Any]) -> Inputs | None:
    base = path_arg(kwargs, "base_dir")
    if base is None:
        return None
    return Inputs(
        paths={base, f"{base}/active"},
        globs={
            f"{base}/*",
            f"{base}/*/pyvenv.cfg",
            f"{base}/*/lib/python3*/site-packages",
            f"{base}/*/lib/python3*/site-packages/freetoken-*.dist-info/METADATA",
        },
    )


class EngineInstall(FactBase[EngineInstallInfo]):
    """
    Returns ``EngineInstallInfo``: for each venv under ``base_dir`` (``/opt/freetoken/0.2.1``),
    the freetoken version its dist-info declares (None when not installed), and which version
    dir the ``active`` symlink points to. Reads metadata files only; never runs the venv.

    + base_dir: e.g. ``/opt/freetoken``
    """

    argument_shapes = {"base_dir": PATH}
    fast_check_inputs = _install_inputs

    def command(self, base_dir: str) -> str:
        self._base_dir = base_dir
        return (
            f'B={quote(base_dir)}; if [ -d "$B" ]; then echo "{MARKER}base $B"; '
            'for D in "$B"/*/; do D=${D%/}; [ -d "$D" ] && [ ! -L "$D" ] || continue; '
            "N=${D##*/}; "
            'if [ -f "$D/pyvenv.cfg" ]; then '
            f'echo "{MARKER}venv $N"; '
            'for M in "$D"/lib/python3*/site-packages/freetoken-*.dist-info/METADATA; do '
            '[ -f "$M" ] && awk \'/^Version:/{print; exit} /^$/{exit}\' "$M" && break; done; '
            f'else echo "{MARKER}dir $N"; fi; done; '
            f'if [ -L "$B/active" ]; then echo "{MARKER}active $(readlink "$B/active")"; fi; '
            "fi; true"
        )

    @staticmethod
    def default() -> EngineInstallInfo:
        return EngineInstallInfo("", {}, None)

    def process(self, output: list[str]) -> EngineInstallInfo:
        return parse_engine_install_output(getattr(self, "_base_dir", ""), output)


# --------------------------------------------------------------------------- health


@dataclass(frozen=True)
class EngineHealthInfo:
    reachable: bool
    status: str | None
    phase: str | None
    done_bytes: int | None
    total_bytes: int | None
    version: str | None
    model: str | None
    message: str | None
    error: str | None
    http_status: int | None = None
    uptime_s: float | None = None

    @classmethod
    def not_reached(cls, error: str) -> EngineHealthInfo:
        """Nothing answered at ``/health`` (or the check could not run): why, in ``error``."""
        return cls(False, None, None, None, None, None, None, None, error)

    @classmethod
    def unreadable(cls, http_status: int | None, error: str) -> EngineHealthInfo:
        """Something answered at ``/health`` but its body says nothing we can read: why, in ``error``."""
        return cls(True, None, None, None, None, None, None, None, error, http_status)


# python3 is always on the targets; urllib with proxies disabled (http_proxy in the
# environment must not capture a loopback health check). The body is the engine's text, not
# ours: it travels base64-encoded (``@@ft:body``) and an error text JSON-encoded, so that no
# line of it can pass for a marker, here or in a batch.
HEALTH_SCRIPT = r"""
import base64, json, sys, urllib.request, urllib.error
url = sys.argv[1]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    resp = opener.open(url, timeout=5)
    code, body = resp.status, resp.read()
except urllib.error.HTTPError as e:
    code, body = e.code, e.read()
except Exception as e:
    print("@@ft:unreachable " + json.dumps("%s: %s" % (type(e).__name__, getattr(e, "reason", e))))
    sys.exit(0)
print("@@ft:http %d" % code)
print("@@ft:body " + base64.b64encode(body).decode("ascii"))
"""


def _opt_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opt_str(value) -> str | None:
    return None if value is None else str(value)


def parse_health_body(http_status: int | None, body: str) -> EngineHealthInfo:
    """Parse ``GET /health``'s JSON; the status code says nothing (it is always 200)."""
    try:
        data = json.loads(body)
    except ValueError:
        return EngineHealthInfo.unreadable(http_status, f"non-JSON /health body: {body.strip()[:200]!r}")
    if not isinstance(data, dict):
        return EngineHealthInfo.unreadable(http_status, f"unexpected /health JSON: {body.strip()[:200]!r}")
    raw_progress = data.get("progress")
    progress: dict[str, Any] = raw_progress if isinstance(raw_progress, dict) else {}
    uptime = data.get("uptime_s")
    return EngineHealthInfo(
        reachable=True,
        status=_opt_str(data.get("status")),
        phase=_opt_str(data.get("phase")),
        done_bytes=_opt_int(progress.get("done_bytes")),
        total_bytes=_opt_int(progress.get("total_bytes")),
        version=_opt_str(data.get("version")),
        model=_opt_str(data.get("model")),
        message=_opt_str(data.get("message")),
        error=None,
        http_status=http_status,
        uptime_s=float(uptime) if isinstance(uptime, (int, float)) and not isinstance(uptime, bool) else None,
    )


def parse_health_output(lines: list[str]) -> EngineHealthInfo:
    """The ``EngineHealth`` command's output: ``@@ft:http CODE`` then ``@@ft:body BASE64``, or
    ``@@ft:unreachable "JSON text"``, or ``@@ft:no-python``. Anything else is not ours (the
    interpreter's own traceback) and is never read as a marker."""
    http_status = None
    for line in lines:
        if line.startswith(MARKER + "unreachable "):
            try:
                why = json.loads(line[len(MARKER + "unreachable ") :])
            except ValueError:
                why = None
            return EngineHealthInfo.not_reached(str(why) if why else "unreachable")
        if line.startswith(MARKER + "no-python"):
            return EngineHealthInfo.not_reached("python3 not found")
        if line.startswith(MARKER + "http "):
            http_status = parse_int(line.split()[1])
        elif line.startswith(MARKER + "body") and http_status is not None:
            raw = b64decode_lines([line[len(MARKER + "body") :]])
            if raw is None:
                return EngineHealthInfo.unreadable(http_status, "the /health body did not arrive intact (bad base64)")
            return parse_health_body(http_status, raw.decode("utf-8", "replace"))
    return EngineHealthInfo.not_reached("no output")


def _health_inputs(kwargs: dict[str, Any]) -> Inputs | None:
    host, port = kwargs.get("host", "127.0.0.1"), kwargs.get("port", 8000)
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
        return None
    netloc = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return Inputs(health={f"http://{netloc}:{port}/health"})


class EngineHealth(FactBase[EngineHealthInfo]):
    """
    Returns ``EngineHealthInfo`` from ``GET http://HOST:PORT/health``: ``reachable`` False when
    nothing listens; otherwise the JSON's ``status`` (loading / ok / error) and its details.

    + host: address the engine listens on (default 127.0.0.1)
    + port: engine port (default 8000)
    """

    argument_shapes = {"host": ADDRESS, "port": PORT}
    fast_check_inputs = _health_inputs

    def command(self, host: str = "127.0.0.1", port: int = 8000) -> str:
        port = int(port)
        netloc = f"[{host}]" if ":" in host and not host.startswith("[") else host
        url = f"http://{netloc}:{port}/health"
        return (
            "if command -v python3 >/dev/null 2>&1; then "
            f"python3 -c {quote(HEALTH_SCRIPT)} {quote(url)} 2>&1 </dev/null; "
            f"else echo '{MARKER}no-python'; fi; true"
        )

    @staticmethod
    def default() -> EngineHealthInfo:
        return EngineHealthInfo.not_reached("no output")

    def process(self, output: list[str]) -> EngineHealthInfo:
        return parse_health_output(output)
