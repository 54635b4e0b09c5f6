# STAND-IN support module (not a real Windows tool): shared helpers of the Windows stand-ins
# (wsl.exe, cmd.exe, schtasks.exe, wslinfo, wslpath). Reads the simulated host's profile from
# $FREETOKEN_SIM_DIR/profile.json (default /.sim/profile.json) and records calls under the
# simulated C: drive ($FREETOKEN_SIM_DRIVE_C, default: where /etc/wsl.conf's [automount] root puts
# it, /mnt/c unless moved) in .sim/, where tests read them.
import json
import os
import re
import time

SIM_DIR = os.environ.get("FREETOKEN_SIM_DIR", "/.sim")


def drive_root(path="/etc/wsl.conf"):
    """Where WSL mounts the drives: wsl.conf's `[automount] root`, default /mnt/ (ending in /).

    The stand-in's own small reading (one `[automount]` section, `root = VALUE`, quotes and an
    inline comment dropped), enough for the simulated hosts; the deploy reads the file with
    freetoken_infra/core/wsl_ini.py."""
    section, root = "", "/mnt/"
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                header = re.fullmatch(r"\[([A-Za-z][A-Za-z0-9]*)\]\s*(#.*)?", line)
                if header:
                    section = header.group(1).lower()
                    continue
                match = re.fullmatch(r"root\s*=\s*\"?([^\"#]*?)\"?\s*(#.*)?", line, re.I)
                if section == "automount" and match and match.group(1):
                    root = match.group(1)
                    break
    except OSError:
        pass
    return root if root.endswith("/") else root + "/"


DRIVE_C = os.environ.get("FREETOKEN_SIM_DRIVE_C") or drive_root() + "c"
CALLS_DIR = os.path.join(DRIVE_C, ".sim")


def profile():
    with open(os.path.join(SIM_DIR, "profile.json"), encoding="utf-8") as f:
        return json.load(f)


def record(tool, argv):
    """Append one call to /mnt/c/.sim/calls.jsonl (tests read it)."""
    os.makedirs(CALLS_DIR, exist_ok=True)
    with open(os.path.join(CALLS_DIR, "calls.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"tool": tool, "argv": argv, "time": time.time()}) + "\n")


def windows_out(text, encoding):
    """Write text with CRLF line endings in a Windows encoding to stdout (bytes)."""
    import sys

    sys.stdout.buffer.write(text.replace("\n", "\r\n").encode(encoding))
    sys.stdout.buffer.flush()


# The simulated PC's network adapter (powershell.exe's Get-NetAdapter, powercfg.exe).
ADAPTER = "Intel(R) Ethernet Controller I225-V"


def wol_armed():
    """Wake-on-LAN switched on in Windows (the adapter's magic packet, armed to wake the PC)."""
    return os.path.exists(os.path.join(CALLS_DIR, "wol-armed")) or bool(profile().get("wake_on_lan", False))
