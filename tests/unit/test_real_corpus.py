"""Every file of the public corpus in tests/fixtures/real/ (sources in its README) through every
fact it applies to, each with the value the real tool (or WSL itself) means, read off the output.

.wslconfig / wsl.conf values are what WSL's own parser reads (microsoft/WSL
src/shared/configfile/configfile.cpp; freetoken_infra/core/wsl_ini.py says how): first occurrence
wins, inline comments and quotes removed, keys before the first header ignored.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from facts.cuda import parse_nvcc_version
from facts.gpu import TableGpu, parse_cuda_version, parse_driver_version, parse_table_gpus
from facts.windows import parse_ini
from facts.wsl import parse_wsl_exe_version
from freetoken_infra.core import wsl_ini
from freetoken_infra.core.layout import drive_path
from operations.scripts import guard

FIX = Path(__file__).parent.parent / "fixtures" / "real"
W, C = wsl_ini.WSLCONFIG, wsl_ini.WSLCONF

# file -> {section: {key: value}} as WSL reads it (lower-case names, first occurrence).
WSLCONFIG_FILES: dict[str, dict[str, dict[str, str]]] = {
    "wslconfig-inline-comments-wsl12161.ini": {
        "wsl2": {
            "autoproxy": "false",
            "dnstunneling": "false",
            "firewall": "true",
            "guiapplications": "true",
            "ipv6": "true",
            "localhostforwarding": "true",
            "memory": "4GB",
            "nestedvirtualization": "true",
            "networkingmode": "mirrored",
        }
    },
    "wslconfig-quoted-values-mimikun1841.ini": {
        "wsl2": {
            "memory": "8GB",
            "processors": "4",
            "localhostforwarding": "true",
            "safemode": "false",
            "swap": "0",
            "pagereporting": "true",
            "guiapplications": "true",
            "debugconsole": "false",
            "nestedvirtualization": "true",
            "vmidletimeout": "60000",
            "dnsproxy": "true",
            "networkingmode": "mirrored",
            "firewall": "true",
            "dnstunneling": "true",
            "autoproxy": "true",
            "defaultvhdsize": "1TB",
        },
        "experimental": {
            "automemoryreclaim": "dropCache",
            "sparsevhd": "false",
            "besteffortdnsparsing": "false",
            "dnstunnelingipaddress": "10.255.255.254",
            "initialautoproxytimeout": "1000",
            "hostaddressloopback": "false",
        },
    },
    "wslconfig-no-section-wsl11540.ini": {},
    "wslconfig-experimental-only-docs1967.ini": {"experimental": {"networkingmode": "mirrored"}},
    "wslconfig-wsl2-networking-luckyyyyy79.ini": {
        "wsl2": {"dnstunneling": "true", "firewall": "true", "autoproxy": "true", "networkingmode": "mirrored"},
        "experimental": {"automemoryreclaim": "gradual", "sparsevhd": "true"},
    },
    "wslconfig-experimental-networking-wsl11090.ini": {
        "wsl2": {"memory": "4G"},
        "experimental": {
            "automemoryreclaim": "gradual",
            "sparsevhd": "true",
            "networkingmode": "mirrored",
            "dnstunneling": "true",
            "firewall": "true",
            "autoproxy": "true",
        },
    },
    "wslconfig-comments-trailing-space-wsl11228.ini": {
        "wsl2": {"memory": "4GB", "processors": "2"},
        "experimental": {"networkingmode": "mirrored"},
    },
    "wslconfig-experimental-wsl12006.ini": {"experimental": {"networkingmode": "mirrored"}},
    "wslconfig-experimental-autoproxy-wsl10583.ini": {
        "experimental": {"networkingmode": "mirrored", "dnstunneling": "true", "firewall": "true", "autoproxy": "true"}
    },
    "wslconfig-experimental-reclaim-wsl10794.ini": {
        "experimental": {
            "automemoryreclaim": "gradual",
            "networkingmode": "mirrored",
            "dnstunneling": "true",
            "firewall": "true",
            "autoproxy": "true",
        }
    },
    "wslconfig-wsl2-mirrored-wsl1350.ini": {
        "wsl2": {"networkingmode": "mirrored", "firewall": "true", "dnstunneling": "true", "autoproxy": "true"}
    },
    "wslconfig-large-vm-moss328.ini": {
        "wsl2": {"memory": "480GB", "swap": "32GB", "processors": "56", "localhostforwarding": "true"}
    },
}

# The networking mode WSL runs with, as WSL reads it: [wsl2] or (WSL 2.0's place) [experimental].
NETWORKING_MODE = {
    "wslconfig-inline-comments-wsl12161.ini": "mirrored",
    "wslconfig-quoted-values-mimikun1841.ini": "mirrored",
    "wslconfig-no-section-wsl11540.ini": None,  # no header: WSL ignores both keys (and NAT it was)
    "wslconfig-experimental-only-docs1967.ini": "mirrored",
    "wslconfig-wsl2-networking-luckyyyyy79.ini": "mirrored",
    "wslconfig-experimental-networking-wsl11090.ini": "mirrored",
    "wslconfig-comments-trailing-space-wsl11228.ini": "mirrored",
    "wslconfig-experimental-wsl12006.ini": "mirrored",
    "wslconfig-experimental-autoproxy-wsl10583.ini": "mirrored",
    "wslconfig-experimental-reclaim-wsl10794.ini": "mirrored",
    "wslconfig-wsl2-mirrored-wsl1350.ini": "mirrored",
    "wslconfig-large-vm-moss328.ini": None,
}

# wsl.conf files: (sections, [boot] systemd on?, where C: is mounted)
WSLCONF_FILES: dict[str, tuple[dict[str, dict[str, str]], bool, str]] = {
    "wsl-conf-commented-headers-wsl10100.conf": ({}, False, "/mnt/c"),
    "wsl-conf-crlf-xxd-wsl12502.conf": ({"boot": {"systemd": "true"}}, True, "/mnt/c"),
    "wsl-conf-lf-xxd-wsl12502.conf": ({"boot": {"systemd": "true"}}, True, "/mnt/c"),
    "wsl-conf-automount-root-metadata-wsl4774.conf": ({"automount": {"root": "/", "options": "metadata"}}, False, "/c"),
    "wsl-conf-automount-root-uid-wsl4774.conf": (
        {"automount": {"root": "/", "enabled": "true", "options": "uid=1000,gid=1000,umask=022,fmask=11,metadata"}},
        False,
        "/c",
    ),
    "wsl-conf-automount-root-wsl3155.conf": ({"automount": {"root": "/"}}, False, "/c"),
    "wsl-conf-automount-windir-wsl3597.conf": (
        {"automount": {"enabled": "true", "root": "/windir/"}},
        False,
        "/windir/c",
    ),
    "wsl-conf-automount-options-wsl6258.conf": ({"automount": {"options": "metadata,case=dir"}}, False, "/mnt/c"),
    "wsl-conf-automount-disabled-wsl7906.conf": ({"automount": {"enabled": "false"}}, False, "/mnt/c"),
    "wsl-conf-boot-systemd-centos23.conf": ({"boot": {"systemd": "true"}}, True, "/mnt/c"),
}

WSL_VERSION_FILES = {
    "wsl-version-1.2.5-en-usbipd727.txt": (1, 2, 5, 0),
    "wsl-version-0.68.4-en-wsl9001.txt": (0, 68, 4, 0),
}

# file -> (driver version, CUDA version, GPUs as the table shows them)
SMI_TABLES = {
    "nvidia-smi-610-b200x2-kmd-sglang27487.txt": (
        "610.43.02",
        "13.3",
        (TableGpu(0, "NVIDIA B200", 0, 183359), TableGpu(1, "NVIDIA B200", 0, 183359)),
    ),
    "nvidia-smi-610-rtx3080-kmd-finpilot160.txt": (
        "610.43.03",
        "13.3",
        (TableGpu(0, "NVIDIA GeForce RTX 3080 ...", 14, 16384),),
    ),
    "nvidia-smi-610-rtx5070-laptop-kmd-mistralrs2287.txt": (
        "610.43.02",
        "13.3",
        (TableGpu(0, "NVIDIA GeForce RTX 5070 ...", 273, 12227),),
    ),
    "nvidia-smi-570-rtx5090-wsl-flashattn1563.txt": (
        "572.70",
        "12.8",
        (TableGpu(0, "NVIDIA GeForce RTX 5090", 4735, 32607),),
    ),
    "nvidia-smi-545-rtx3060-laptop-cuda-err-wsl11589.txt": (
        "546.80",
        None,
        (TableGpu(0, "NVIDIA GeForce RTX 3060 ...", 816, 6144),),
    ),
    "nvidia-smi-545-rtx4090-wsl-wsl11050.txt": (
        "546.33",
        "12.3",
        (TableGpu(0, "NVIDIA GeForce RTX 4090", 1528, 24564),),
    ),
    "nvidia-smi-535-gtx1650-laptop-wsl-wsl11277.txt": (
        "537.13",
        "12.2",
        (TableGpu(0, "NVIDIA GeForce GTX 1650 ...", 128, 4096),),
    ),
    "nvidia-smi-517-2gpu-windows-wsl9134.txt": (
        "517.48",
        "11.7",
        (TableGpu(0, "NVIDIA GeForce ...", 576, 11264), TableGpu(1, "NVIDIA GeForce ...", 2152, 11264)),
    ),
    "nvidia-smi-460-rtx2070-laptop-wddm-wsl6014.txt": (
        "460.15",
        "11.1",
        (TableGpu(0, "GeForce RTX 207...", 176, 8192),),
    ),
    "nvidia-smi-515-a100x2-miniweather12.txt": (
        "515.65.01",
        "11.7",
        (TableGpu(0, "NVIDIA A100-SXM...", 0, 40960), TableGpu(1, "NVIDIA A100-SXM...", 0, 40960)),
    ),
}

NVCC_FILES = {
    "nvcc-11.1-version-pytorch-builder580.txt": ((11, 1), "11.1.105"),
    "nvcc-11.0-version-pytorch-builder580.txt": ((11, 0), "11.0.221"),
    "nvcc-11.0-windows-version-wsl2kernel118.txt": ((11, 0), "11.0.167"),
    "nvcc-12.1-version-wsl-up2you10.txt": ((12, 1), "12.1.105"),
    "nvcc-12.8-version-whispercpp2892.txt": ((12, 8), "12.8.93"),
}

# CUDA out-of-memory reports as PyTorch prints them: the guard must see each one.
OOM_FILES = [
    "oom-torch-16gb-framepack87.txt",
    "oom-torch-cuda-wsl-sonar360.txt",
    "oom-runtime-error-wsl-taskmatrix160.txt",
    "oom-cuda-error-moss328.txt",
]


def read(name: str) -> bytes:
    return (FIX / name).read_bytes()


@pytest.mark.parametrize("name", sorted(WSLCONFIG_FILES))
def test_wslconfig_as_wsl_reads_it(name):
    info = parse_ini("/mnt/c/Users/u/.wslconfig", read(name))
    assert info.error is None and info.problems == ()
    assert info.sections == WSLCONFIG_FILES[name]
    assert info.ini is not None
    assert info.ini.value("wsl2", "networkingMode") == NETWORKING_MODE[name]


@pytest.mark.parametrize("name", sorted(WSLCONFIG_FILES))
def test_wslconfig_merge_of_what_wsl_already_reads_writes_nothing(name):
    """Setting every [wsl2] value to what WSL already reads changes no byte."""
    ini = wsl_ini.parse(read(name), W)
    same = {key: ini.value("wsl2", key) or "" for key in ini.sections().get("wsl2", {})}
    assert wsl_ini.merge(read(name), W, "wsl2", same).data == read(name)


@pytest.mark.parametrize("name", sorted(WSLCONFIG_FILES))
def test_wslconfig_merge_of_new_values_keeps_every_other_line(name):
    want = {"memory": "24GB", "networkingMode": "mirrored", "vmIdleTimeout": "0"}
    result = wsl_ini.merge(read(name), W, "wsl2", want)
    assert result.problem is None
    after = wsl_ini.parse(result.data, W)
    assert all(after.value("wsl2", k) == v for k, v in want.items())
    # One networkingMode WSL reads, no duplicate for it to warn about.
    assert len(after.duplicates("wsl2", "networkingMode")) == 1
    changed = {
        e.line
        for e in wsl_ini.parse(read(name), W).entries
        if e.section.lower() == "wsl2" and e.key.lower() in {k.lower() for k in want}
    }
    before = [line for number, line in enumerate(read(name).decode("utf-8").splitlines(), 1) if number not in changed]
    lines = result.data.decode("utf-8").splitlines()
    kept = [line for line in before if line in lines or f"# {line}" in lines]
    assert kept == before  # every other line is still there (a superseded duplicate commented out)
    for section, values in WSLCONFIG_FILES[name].items():
        for key, value in values.items():
            managed = key in ("memory", "networkingmode", "vmidletimeout")
            if not (section in ("wsl2", "experimental") and managed):
                assert after.sections()[section][key] == value


@pytest.mark.parametrize("name", sorted(WSLCONF_FILES))
def test_wsl_conf_as_wsl_reads_it(name):
    sections, systemd, drive_c = WSLCONF_FILES[name]
    info = parse_ini("/etc/wsl.conf", read(name))
    assert info.error is None and info.problems == () and info.ini is not None
    assert info.sections == sections
    assert wsl_ini.same_value(info.ini.value("boot", "systemd"), "true") is systemd
    assert drive_path(wsl_ini.drive_root(info.ini)) == drive_c


@pytest.mark.parametrize("name", sorted(WSLCONF_FILES))
def test_wsl_conf_systemd_merge_keeps_the_file(name):
    data = read(name)
    result = wsl_ini.merge(data, C, "boot", {"systemd": "true"})
    assert result.problem is None
    _, systemd, _ = WSLCONF_FILES[name]
    if systemd:
        assert result.data == data and not result.changed
    else:
        assert result.data.startswith(data.rstrip(b"\n")) and result.changed == ("systemd",)
        assert wsl_ini.parse(result.data, C).value("boot", "systemd") == "true"
        assert wsl_ini.parse(result.data, C).sections() | {"boot": {"systemd": "true"}} == WSLCONF_FILES[name][0] | {
            "boot": {"systemd": "true"}
        }


@pytest.mark.parametrize("name", sorted(WSL_VERSION_FILES))
def test_wsl_exe_version(name):
    text = read(name).decode("utf-8")
    # Published as text; wsl.exe writes UTF-16LE with CRLF (and UTF-8 under WSL_UTF8=1).
    for data in (text.replace("\n", "\r\n").encode("utf-16-le"), text.encode("utf-8")):
        info = parse_wsl_exe_version(data, 0)
        assert (info.status, info.version) == ("ok", WSL_VERSION_FILES[name])


@pytest.mark.parametrize("name", sorted(SMI_TABLES))
def test_nvidia_smi_table(name):
    driver, cuda, gpus = SMI_TABLES[name]
    table = read(name).decode("utf-8")
    assert parse_driver_version(table) == driver
    assert parse_cuda_version(table) == cuda
    assert parse_table_gpus(table) == gpus


@pytest.mark.parametrize("name", sorted(NVCC_FILES))
def test_nvcc_banner(name):
    assert parse_nvcc_version(read(name).decode("utf-8")) == NVCC_FILES[name]


@pytest.mark.parametrize("name", OOM_FILES)
def test_guard_reads_a_real_oom_traceback_line_as_the_engine_s_oom_once_its_worker_died(name):
    """The first line is a traceback's last line as PyTorch prints it; the guard stops the engine
    for it only as the end of the worker's own traceback, together with the engine's own record
    that this worker died; the line alone is text."""
    oom_line = read(name).decode("utf-8").splitlines()[0]
    died = (
        "\x1b[1m[2026-01-01|00:00:00|FrontendAPI]\x1b[0m \x1b[31mERROR   \x1b[0m "
        "Backend supervisor: backend worker freetoken-TP0-scheduler exited"
    )
    block = [
        "Process freetoken-TP0-scheduler:",
        "Traceback (most recent call last):",
        '  File "freetoken/scheduler/scheduler.py", line 318, in run_forever',
        "    data = self.overlap_loop(data)",
        oom_line,
    ]
    assert guard.find_ooms([oom_line, died]) == ([], None)
    found, pending = guard.find_ooms(block)
    assert found == [] and pending == {"worker": "freetoken-TP0-scheduler", "line": oom_line.strip()}
    found, pending = guard.find_ooms([*block, died])
    assert len(found) == 1 and found[0].startswith(oom_line.strip()) and pending is None


def test_every_corpus_file_has_a_test_and_a_readme_row():
    covered = {*WSLCONFIG_FILES, *WSLCONF_FILES, *WSL_VERSION_FILES, *SMI_TABLES, *NVCC_FILES, *OOM_FILES}
    readme = (FIX / "README.md").read_text(encoding="utf-8")
    assert len(covered) >= 40
    for name in covered:
        assert (FIX / name).is_file(), name
        assert f"`{name}`" in readme, f"{name} has no row in tests/fixtures/real/README.md"
