"""The stand-ins print what the real tools print: layout, encoding, line endings and error texts
are compared with the real-format fixtures in tests/fixtures/real/ (values differ by profile).
Runs the stand-in programs locally; no containers, no root."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fleet import harness
from tests.fleet.profiles import PROFILES

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
BIN = Path(__file__).resolve().parent / "standins" / "bin"


def real(name: str) -> bytes:
    path = REAL / name
    # A missing fixture is a broken checkout, not a reason to skip the comparison.
    assert path.exists(), f"fixture {name} is missing from {REAL}"
    return path.read_bytes()


@pytest.fixture(params=["ws1", "ws2", "ws3"])
def sim(request, tmp_path):
    """A simulated host's /.sim and C: drive in a temp dir, as the harness writes them."""
    profile = PROFILES[request.param]
    (tmp_path / "profile.json").write_text(json.dumps(profile.to_dict(), ensure_ascii=False))
    (tmp_path / "gpu.conf").write_text(harness.gpu_conf_text(profile))
    drive_c = tmp_path / "c"
    drive_c.mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "FREETOKEN_SIM_DIR": str(tmp_path),
        "FREETOKEN_SIM_DRIVE_C": str(drive_c),
        "FREETOKEN_SIM_GPU_CONF": str(tmp_path / "gpu.conf"),
    }
    return profile, env, drive_c


def tool(env, name, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BIN / name), *args], env=env, cwd=cwd, capture_output=True)


def skeleton(line: str) -> str:
    """A table line with its values blanked: only the frame characters and widths remain."""
    return re.sub(r"[^|+=\-]", " ", line)


def test_nvidia_smi_table_has_the_real_layout(sim):
    profile, env, _ = sim
    ours = tool(env, "nvidia-smi").stdout.decode().split("\n")
    theirs = real("nvidia-smi-5060ti.txt").decode().split("\n")
    assert len(ours) == len(theirs)
    for a, b in zip(ours[1:], theirs[1:], strict=False):  # line 0 is the date
        assert len(a) == len(b), (a, b)
        assert skeleton(a) == skeleton(b), (a, b)
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} {7}", ours[0])
    assert f"Driver Version: {profile.gpu.driver_version}" in ours[2]
    assert f"/  {profile.gpu.memory_total_mib}MiB" in ours[9]
    # labels and frame lines identical to the real ones
    for i in (1, 3, 4, 5, 6, 7, 11, 12, 13, 14, 15, 16, 17, 18, 19):
        assert ours[i] == theirs[i]


@pytest.mark.parametrize(
    "fixture,fmt",
    [("nvidia-smi-query-5060ti.csv", "csv,noheader,nounits"), ("nvidia-smi-query-5060ti-header.csv", "csv,nounits")],
)
def test_nvidia_smi_query_csv_matches_real_format(sim, fixture, fmt):
    profile, env, _ = sim
    fields = "index,name,compute_cap,memory.total,memory.used,memory.free,driver_version"
    ours = tool(env, "nvidia-smi", f"--query-gpu={fields}", f"--format={fmt}")
    assert ours.returncode == 0
    theirs = real(fixture).decode()
    assert ours.stdout.decode().endswith("\n") and "\r" not in ours.stdout.decode()
    o_lines, t_lines = ours.stdout.decode().splitlines(), theirs.splitlines()
    assert len(o_lines) == len(t_lines)
    if "noheader" not in fmt:
        assert o_lines[0] == t_lines[0]
    row = o_lines[-1].split(", ")
    assert len(row) == len(t_lines[-1].split(", "))
    g = profile.gpu
    assert row == [
        "0",
        g.name,
        g.compute_cap,
        str(g.memory_total_mib),
        str(g.memory_used_mib),
        str(g.memory_total_mib - g.memory_used_mib),
        g.driver_version,
    ]


def test_nvidia_smi_units_and_unknown_field(sim):
    _, env, _ = sim
    r = tool(env, "nvidia-smi", "--query-gpu=memory.total,power.draw", "--format=csv")
    head, row = r.stdout.decode().splitlines()
    assert head == "memory.total [MiB], power.draw [W]"
    assert re.fullmatch(r"\d+ MiB, \d+\.\d\d W", row)
    bad = tool(env, "nvidia-smi", "--query-gpu=name,x", "--format=csv")
    assert bad.returncode == 2
    assert bad.stdout.decode().startswith('Field "x" is not a valid field to query.\n')
    listing = tool(env, "nvidia-smi", "-L").stdout.decode()
    assert re.fullmatch(r"GPU 0: .+ \(UUID: GPU-[0-9a-f-]{36}\)\n", listing)


def test_wsl_version_is_utf16le_crlf_with_localised_labels(sim):
    profile, env, _ = sim
    ours = tool(env, "wsl.exe", "--version").stdout
    lang = profile.windows_language
    theirs = real(f"wsl-version-{lang}.utf16le")
    assert not ours.startswith(b"\xff\xfe") and not theirs.startswith(b"\xff\xfe")
    o, t = ours.decode("utf-16-le"), theirs.decode("utf-16-le")
    assert o.endswith("\r\n") and "\n" not in o.replace("\r\n", "")
    labels = lambda text: [line.split(": ")[0] for line in text.split("\r\n") if line]  # noqa
    assert labels(o) == labels(t)
    assert o.split("\r\n")[0].split(": ")[1] == profile.wsl_version + ".0"


def test_wsl_utf8_when_passed_through_wslenv(sim):
    profile, env, _ = sim
    r = tool({**env, "WSL_UTF8": "1", "WSLENV": "WSL_UTF8"}, "wsl.exe", "--version")
    assert r.stdout.decode("utf-8").split("\r\n")[0].endswith(profile.wsl_version + ".0")


def test_wsl_shutdown_is_recorded(sim):
    _, env, drive_c = sim
    assert tool(env, "wsl.exe", "--shutdown").returncode == 0
    calls = [json.loads(x) for x in (drive_c / ".sim" / "calls.jsonl").read_text().splitlines()]
    assert calls[-1]["argv"] == ["--shutdown"]


def test_wslinfo_prints_the_version_like_the_real_one(sim):
    profile, env, _ = sim
    ours = tool(env, "wslinfo", "--wsl-version").stdout
    assert ours == profile.wsl_version.encode() + b"\n"
    if profile.wsl_version == "2.7.13":
        assert ours == real("wslinfo-wsl-version.txt")


def test_cmd_echo_userprofile_is_crlf(sim):
    profile, env, drive_c = sim
    r = tool(env, "cmd.exe", "/c", "echo", "%UserProfile%", cwd=drive_c)
    assert r.stdout == f"C:\\Users\\{profile.windows_user}\r\n".encode()
    if profile.windows_user == "dev":
        assert r.stdout == real("cmd-echo-userprofile.crlf")
    assert r.stderr == b""
    unset = tool(env, "cmd.exe", "/c", "echo", "%NoSuchVar%", cwd=drive_c)
    assert unset.stdout == b"%NoSuchVar%\r\n"


def test_schtasks_create_query_delete(sim):
    _, env, drive_c = sim
    create = tool(env, "schtasks.exe", "/Create", "/TN", "FreeToken", "/TR", "wsl.exe -u root", "/SC", "ONLOGON")
    assert create.stdout == b'SUCCESS: The scheduled task "FreeToken" has successfully been created.\r\n'
    assert tool(env, "schtasks.exe", "/Create", "/TN", "FreeToken", "/TR", "x", "/SC", "ONLOGON").returncode == 1
    assert b"FreeToken" in tool(env, "schtasks.exe", "/Query", "/TN", "FreeToken").stdout
    delete = tool(env, "schtasks.exe", "/Delete", "/TN", "FreeToken", "/F")
    assert delete.stdout == b'SUCCESS: The scheduled task "FreeToken" was successfully deleted.\r\n'
    assert tool(env, "schtasks.exe", "/Query", "/TN", "FreeToken").returncode == 1


def test_wslpath_both_ways(sim):
    _, env, _ = sim
    assert tool(env, "wslpath", "-u", "C:\\Users\\dev").stdout == b"/mnt/c/Users/dev\n"
    assert tool(env, "wslpath", "-w", "/mnt/c/Users/dev").stdout == b"C:\\Users\\dev\n"


def test_proc_version_and_meminfo_have_the_real_layout(sim):
    profile, _, _ = sim
    ours = harness.proc_version_text(profile)
    theirs = real("proc-version-wsl2.txt").decode()
    shape = lambda s: re.sub(r"root@[0-9a-f]+", "root@X", s)  # noqa: E731
    assert shape(ours) == shape(theirs)
    mine = {line.split(":")[0]: line for line in harness.meminfo_text(profile).splitlines()}
    for line in real("proc-meminfo-wsl-24g.txt").decode().splitlines():
        key = line.split(":")[0]
        assert key in mine
    # the kernel's layout (show_val_kb): label padded to 16, value right-aligned in 8, " kB".
    # (Checked on our lines; the transcribed fixture's "Inactive:" line is one column short.)
    for key in ("MemTotal", "MemFree", "MemAvailable", "SwapTotal", "SwapFree"):
        assert mine[key].split()[0] == key + ":"
        assert len(mine[key]) == 27 and mine[key].endswith(" kB"), mine[key]
    fixture_lines = dict((ln.split(":")[0], ln) for ln in real("proc-meminfo-wsl-24g.txt").decode().splitlines())
    assert len(fixture_lines["MemTotal"]) == len(mine["MemTotal"])
    swapped = harness.meminfo_text(profile, swap_used=3 * 1024**3)
    free = int(re.search(r"SwapFree:\s+(\d+) kB", swapped).group(1))
    assert free == profile.swap_total_bytes // 1024 - 3 * 1024**2


def test_nvcc_standin_matches_the_real_nvcc_13():
    nvcc = BIN / "nvcc"
    assert subprocess.run([nvcc, "--version"], capture_output=True).stdout == real("nvcc-13.0-version.txt")
    assert subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True).stdout == real("nvcc-13.0-list-gpu-arch.txt")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_libcuda_healthy_and_allocation_locked(sim, tmp_path, monkeypatch):
    profile, env, _ = sim
    so = tmp_path / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(BIN.parent / "libcuda.c")], check=True)
    script = (
        "import ctypes as c, json\n"
        f"l = c.CDLL({str(so)!r})\n"
        "assert l.cuInit(0) == 0\n"
        "d = c.c_int(); assert l.cuDeviceGet(c.byref(d), 0) == 0\n"
        "name = c.create_string_buffer(100); l.cuDeviceGetName(name, 100, d)\n"
        "ctx = c.c_void_p(); assert l.cuCtxCreate_v2(c.byref(ctx), 0, d) == 0\n"
        "f = c.c_size_t(); t = c.c_size_t(); assert l.cuMemGetInfo_v2(c.byref(f), c.byref(t)) == 0\n"
        "p = c.c_ulonglong(); r = l.cuMemAlloc_v2(c.byref(p), c.c_size_t(32 << 20))\n"
        "s = c.c_char_p(); l.cuGetErrorName(r, c.byref(s))\n"
        "print(json.dumps([name.value.decode(), f.value, t.value, r, s.value.decode()]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    name, free, total, rc, err = json.loads(out.stdout)
    g = profile.gpu
    assert name == g.name and total == g.memory_total_mib * 1024**2
    if g.allocation_locked:
        assert (rc, err) == (2, "CUDA_ERROR_OUT_OF_MEMORY")
        assert free == g.locked_free_mib * 1024**2  # "11.6 GB free" yet nothing allocates
    else:
        assert (rc, err) == (0, "CUDA_SUCCESS")
