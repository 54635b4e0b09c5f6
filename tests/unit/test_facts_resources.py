import subprocess
from pathlib import Path

from facts.resources import HostResources, parse_df, parse_meminfo, parse_resources_output

FIX = Path(__file__).parent.parent / "fixtures" / "real"


def test_meminfo():
    mem = parse_meminfo((FIX / "proc-meminfo-wsl-24g.txt").read_text())
    assert mem["MemTotal"] == 24567892 * 1024 and mem["HugePages_Total"] == 0


def test_df():
    assert parse_df((FIX / "df-pk-wsl-root.txt").read_text()) == (903301268 * 1024, "/")
    assert parse_df("Filesystem 1024-blocks Used Available Capacity Mounted on\nC:\\ 1 2 3 4% /mnt/c with space\n") == (
        3072,
        "/mnt/c with space",
    )
    assert parse_df("df: /x: No such file or directory\n") == (None, None)


def test_full_output():
    lines = [
        "@@ft:path /home/dev/models",
        "@@ft:meminfo",
        *(FIX / "proc-meminfo-wsl-24g.txt").read_text().splitlines(),
        "@@ft:nproc",
        "8",
        "@@ft:df /home/dev",
        *(FIX / "df-pk-wsl-root.txt").read_text().splitlines(),
    ]
    info = parse_resources_output("/home/dev/models", lines)
    assert info.mem_available_bytes == 22345678 * 1024
    assert info.swap_total_bytes == 4194304 * 1024 and info.swap_used_bytes == (4194304 - 4063232) * 1024
    assert info.cpus == 8 and info.disk_free_bytes == 903301268 * 1024
    assert info.disk_path == "/home/dev/models" and info.disk_checked_path == "/home/dev"


def test_empty():
    info = parse_resources_output("/x", [])
    assert info.mem_total_bytes == 0 and info.disk_free_bytes is None


def test_command_on_this_machine(tmp_path):
    fact = HostResources()
    target = tmp_path / "not" / "yet"
    proc = subprocess.run(["sh", "-c", fact.command(str(target))], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    info = fact.process(proc.stdout.splitlines())
    assert info.disk_path == str(target) and info.disk_checked_path == str(tmp_path)
    assert info.mem_total_bytes > info.mem_available_bytes > 0
    assert info.cpus >= 1 and info.disk_free_bytes and info.disk_free_bytes > 0
