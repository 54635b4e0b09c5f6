"""What the checks read on a target, through testinfra, reusing the project's own probes:

- ``Facts``: any pyinfra fact of ``facts/`` (or ``pyinfra.facts``) run over a testinfra host -
  the fact's own command, the fact's own parser - so the suite reads WSL, GPU, CUDA, engine and
  model state exactly as the deploy's preflight does;
- ``health_gate``: ``operations/scripts/health_gate.py`` (the deploy's last step) run on the
  target with a short wait: the chat completion and the decode tokens/s;
- ``model_hash_mismatches``, ``key_exposure``, ``listeners``: small stdlib scripts run by the
  target's python3 for what no fact reads yet.

The API key never leaves the target: it is read there from its file and compared there; only
counts and process ids come back.
"""

from __future__ import annotations

import base64
import json
import re
import textwrap
from dataclasses import dataclass
from typing import Any

from facts._hostread import HOSTIO_SOURCE
from freetoken_infra.core.gate_record import GateRecordError, parse_output
from freetoken_infra.core.layout import KEY_VAR
from operations.health import GATE_RECORD_SOURCE, GATE_SCRIPT_SOURCE, gate_command


class ProbeError(AssertionError):
    """A probe could not run on the target (reported as the check's failure)."""


class Facts:
    """Run pyinfra facts through a testinfra host: ``Facts(host).get(WslVersion)``."""

    def __init__(self, host):
        self.host = host

    def get(self, fact_cls, **kwargs):
        fact = fact_cls()
        command = fact.command(**kwargs)
        if not isinstance(command, str):
            command = command.get_raw_value()
        result = self.host.run(command)
        if result.rc != 0:
            # The project's facts always exit 0; anything else is a broken connection or sudo.
            raise ProbeError(
                f"fact {fact_cls.__name__} exited {result.rc}: {(result.stderr or result.stdout).strip()[-500:]}"
            )
        return fact.process(result.stdout.splitlines())


def run_python(host, source: str, *args: str) -> Any:
    """Run a stdlib script with the target's python3; it prints one JSON document."""
    result = host.run("python3 -c %s " + " ".join(["%s"] * len(args)), textwrap.dedent(source), *args)
    if result.rc != 0:
        raise ProbeError(f"probe exited {result.rc}: {(result.stderr or result.stdout).strip()[-800:]}")
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ProbeError(f"probe printed no JSON: {result.stdout[-500:]!r} {result.stderr[-500:]!r}") from None


# --------------------------------------------------------------------------- health gate


def health_gate(host, settings, key_file: str | None, wait_s: float) -> dict:
    """The deploy's health gate script, shipped from this checkout with its schema beside it
    (as the deploy uploads them) into a fresh folder, run by the target's python3, waiting at
    most ``wait_s`` for ``/health`` ok. Returns its JSON result (``ok``, ``phase``,
    ``decode_tps``, ``error``)."""
    script = base64.b64encode(GATE_SCRIPT_SOURCE.read_bytes()).decode()
    schema = base64.b64encode(GATE_RECORD_SOURCE.read_bytes()).decode()
    quick = settings.model_copy(update={"health_timeout_s": max(1, int(wait_s))})
    command = (
        'd="$(mktemp -d)" && cd "$d" && '
        f"echo {script} | base64 -d > health_gate.py && echo {schema} | base64 -d > {GATE_RECORD_SOURCE.name} && "
        + gate_command(quick, key_file, script_path="health_gate.py")
        + '; rc=$?; cd / && rm -rf "$d"; exit $rc'
    )
    result = host.run(command)
    try:
        doc = parse_output(result.stdout.splitlines())
    except GateRecordError as exc:
        return {"ok": False, "phase": "health", "decode_tps": None, "error": str(exc)}
    if doc is None:
        return {
            "ok": False,
            "phase": "health",
            "decode_tps": None,
            "error": f"the gate printed no result (exit {result.rc}): "
            f"{(result.stderr or result.stdout).strip()[-500:]}",
        }
    return doc.to_dict()


# --------------------------------------------------------------------------- model files

# The model folder is the download's user's and this probe runs as root: every file is reached
# without following a link and read only when it is a regular file (``hostio``: a link or a FIFO
# planted as a shard is a line in ``bad``, never read nor waited on).
MODEL_HASH_MAIN = r"""
import hashlib, json, os, sys
# Hashes as the hub defines them: sha256 of an LFS file's content; a small file's git blob id
# (sha1 of "blob <size>\0" + content). Computed here, independently of the downloader's code.
model_dir = sys.argv[1]
manifest = model_dir.rstrip("/") + "/.freetoken-manifest.json"
try:
    folder = open_folder(model_dir)
    raw = read_at(folder, ".freetoken-manifest.json", manifest, MODEL_FILE_CAP)
    files = json.loads(raw)["files"] if raw is not None else None
except Refused as exc:
    print(json.dumps({"error": "manifest not read: %s" % exc}))
    sys.exit(0)
except (OSError, ValueError, KeyError, TypeError) as exc:
    print(json.dumps({"error": "manifest unreadable: %s" % exc}))
    sys.exit(0)
if not isinstance(files, dict):
    print(json.dumps({"error": "manifest unreadable: %s" % ("missing" if raw is None else "no files")}))
    sys.exit(0)
bad = []
for name, entry in sorted(files.items()):
    shown = model_dir.rstrip("/") + "/" + name
    try:
        fd = open_below(folder, name, shown)
    except Refused as exc:
        bad.append(str(exc))
        continue
    except OSError as exc:
        bad.append("%s: %s" % (name, exc.strerror))
        continue
    if fd is None:
        bad.append("%s: missing" % name)
        continue
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != entry.get("size"):
            bad.append("%s: %d bytes, the manifest says %s" % (name, size, entry.get("size")))
            continue
        if entry.get("sha256"):
            h, want = hashlib.sha256(), entry["sha256"]
        elif entry.get("oid"):
            h, want = hashlib.sha1(b"blob %d\0" % size), entry["oid"]
        else:
            bad.append("%s: no hash in the manifest" % name)
            continue
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != want:
        bad.append("%s: content hash %s, the manifest says %s" % (name, h.hexdigest()[:16], want[:16]))
print(json.dumps({"files": len(files), "bad": bad}))
"""
MODEL_HASH_SCRIPT = HOSTIO_SOURCE + "\n" + MODEL_HASH_MAIN


def model_hash_mismatches(host, model_dir: str) -> dict:
    """``{"files": N, "bad": [...]}``: every file of the manifest re-hashed on the target."""
    return run_python(host, MODEL_HASH_SCRIPT, model_dir)


# --------------------------------------------------------------------------- the API key

KEY_EXPOSURE_SCRIPT = r"""
import json, os, subprocess, sys
key_file, var = sys.argv[1], sys.argv[2]
key = None
try:
    with open(key_file, encoding="utf-8") as f:
        for line in f:
            name, sep, value = line.strip().partition("=")
            if sep and name.strip() == var:
                key = value.strip().strip("'\"").encode()
except OSError as exc:
    print(json.dumps({"error": "cannot read %s: %s" % (key_file, exc.strerror)}))
    sys.exit(0)
if not key:
    print(json.dumps({"error": "no %s= line in %s" % (var, key_file)}))
    sys.exit(0)
me = os.getpid()
in_ps = []
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == me:
        continue
    try:
        with open("/proc/%s/cmdline" % pid, "rb") as f:
            if key in f.read():
                in_ps.append(int(pid))
    except OSError:
        pass
journal = subprocess.Popen(["journalctl", "--no-pager", "-o", "cat"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL)
lines = sum(1 for line in journal.stdout if key in line)
journal.wait()
print(json.dumps({"ps": sorted(in_ps), "journal_lines": lines, "journal_rc": journal.returncode}))
"""


def key_exposure(host, key_file: str) -> dict:
    """Where the key shows: ``{"ps": [pids whose command line holds it], "journal_lines": N}``.
    Read on the target (as root) from the key file; never sent back."""
    return run_python(host, KEY_EXPOSURE_SCRIPT, key_file, KEY_VAR)


# --------------------------------------------------------------------------- dpkg and apt

DPKG_QUERY = "dpkg-query -W -f='${db:Status-Abbrev} ${Package}\\n'"


def present_packages(text: str) -> list[str]:
    """Packages on disk from ``DPKG_QUERY`` output (``ii  cuda-nvcc-13-0``): the status's second
    letter is not n (not installed) nor c (configuration files only)."""
    present = []
    for line in text.splitlines():
        status, _, name = line.strip().partition(" ")
        if len(status) >= 2 and status[1] not in "nc" and name.strip():
            present.append(name.strip())
    return present


_POLICY_VERSION = re.compile(r"^ +(\*\*\* +)?(\S+) +(-?\d+)$")


def apt_policy(text: str) -> dict[str, list[tuple[str, int, bool, list[str]]]]:
    """``apt-cache policy PKG...`` -> package: [(version, its priority, installed, origins)].

    A version line (``     580.95.05-1 -1``, `` *** 13.0.88-1 500`` when installed) carries the
    version's own priority, which pins change; the origin lines below it (8 spaces) name where
    it comes from (``/var/lib/dpkg/status`` for what is installed)."""
    table: dict[str, list[tuple[str, int, bool, list[str]]]] = {}
    rows: list = []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if line and indent == 0 and line.endswith(":"):
            rows = table.setdefault(line[:-1], [])
        elif indent >= 8 and rows:
            rows[-1][3].append(line.split(None, 1)[-1])
        elif (m := _POLICY_VERSION.match(line)) and indent < 8:
            rows.append((m.group(2), int(m.group(3)), bool(m.group(1)), []))
    return table


# --------------------------------------------------------------------------- listening sockets


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    pids: tuple[int, ...]

    @property
    def loopback(self) -> bool:
        return self.address in ("127.0.0.1", "::1") or self.address.startswith(("127.", "::ffff:127."))


def parse_ss(text: str) -> list[Listener]:
    """``ss -Hltnp`` lines: ``LISTEN 0 2048 127.0.0.1:8000 0.0.0.0:* users:(("python",pid=9,fd=5))``."""
    out = []
    for line in text.splitlines():
        cols = line.split()
        if len(cols) < 5:
            continue
        local = cols[3]
        address, _, port = local.rpartition(":")
        address = address.strip("[]")
        if "%" in address:  # fe80::1%eth0
            address = address.split("%", 1)[0]
        if address == "*":
            address = "0.0.0.0"
        try:
            number = int(port)
        except ValueError:
            continue
        pids = []
        rest = " ".join(cols[5:])
        for part in rest.split("pid=")[1:]:
            digits = part.split(",", 1)[0]
            if digits.isdigit():
                pids.append(int(digits))
        out.append(Listener(address, number, tuple(sorted(set(pids)))))
    return out


def listeners(host) -> list[Listener]:
    """Every listening TCP socket of the target with its owning processes (``ss``, as root)."""
    result = host.run("ss -Hltnp")
    if result.rc != 0:
        raise ProbeError(f"ss -Hltnp exited {result.rc}: {result.stderr.strip()[:300]}")
    return parse_ss(result.stdout)


def unit_pids(host, unit: str) -> set[int]:
    """The processes of a systemd unit (its cgroup), or just its main PID."""
    cgroup = host.run("systemctl show -p ControlGroup --value %s", unit).stdout.strip()
    pids: set[int] = set()
    if cgroup:
        procs = host.run("cat %s", f"/sys/fs/cgroup{cgroup}/cgroup.procs")
        if procs.rc == 0:
            pids = {int(p) for p in procs.stdout.split() if p.isdigit()}
    main = host.run("systemctl show -p MainPID --value %s", unit).stdout.strip()
    if main.isdigit() and int(main):
        pids.add(int(main))
    return pids
