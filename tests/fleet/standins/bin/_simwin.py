# STAND-IN support module (not a real Windows tool): shared helpers of the Windows stand-ins
# (wsl.exe, cmd.exe, schtasks.exe, wslinfo, wslpath). Reads the simulated host's profile from
# $FREETOKEN_SIM_DIR/profile.json (default /.sim/profile.json) and records calls under the
# simulated C: drive ($FREETOKEN_SIM_DRIVE_C, default /mnt/c) in .sim/, where tests read them.
import json
import os
import time

SIM_DIR = os.environ.get("FREETOKEN_SIM_DIR", "/.sim")
DRIVE_C = os.environ.get("FREETOKEN_SIM_DRIVE_C", "/mnt/c")
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
