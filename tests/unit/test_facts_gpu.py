import os
import shutil
import subprocess
from pathlib import Path

from facts.gpu import (
    GpuProcess,
    NvidiaGpus,
    parse_compute_apps,
    parse_cuda_version,
    parse_nvidia_smi_output,
    parse_query_csv,
    parse_table_processes,
    safe_process_name,
)

FIX = Path(__file__).parent.parent / "fixtures" / "real"


def smi_lines(query_fixture, query_rc, table_fixture=None, table_rc=0):
    lines = [
        "@@ft:path /usr/lib/wsl/lib/nvidia-smi",
        "@@ft:query",
        *(FIX / query_fixture).read_text().splitlines(),
        f"@@ft:query-rc {query_rc}",
        "@@ft:table",
    ]
    if table_fixture:
        lines += (FIX / table_fixture).read_text().splitlines()
    return lines + [f"@@ft:table-rc {table_rc}"]


def test_5060ti():
    report = parse_nvidia_smi_output(smi_lines("nvidia-smi-query-5060ti.csv", 0, "nvidia-smi-5060ti.txt"))
    assert report.error is None
    assert report.cuda_version == "13.0"
    assert report.smi_path == "/usr/lib/wsl/lib/nvidia-smi"
    (gpu,) = report.gpus
    assert gpu.index == 0 and gpu.name == "NVIDIA GeForce RTX 5060 Ti"
    assert gpu.compute_cap == (12, 0)
    assert (gpu.memory_total_mib, gpu.memory_used_mib, gpu.memory_free_mib) == (16311, 1043, 14979)
    assert gpu.driver_version == "581.29" and gpu.unavailable_fields == ()


def test_with_header_same_result():
    a, _ = parse_query_csv((FIX / "nvidia-smi-query-5060ti.csv").read_text())
    b, err = parse_query_csv((FIX / "nvidia-smi-query-5060ti-header.csv").read_text())
    assert err is None and a == b


def test_units_tolerated():
    gpus, err = parse_query_csv("0, NVIDIA GeForce RTX 5060 Ti, 12.0, 16311 MiB, 1043 MiB, 14979 MiB, 581.29\n")
    assert err is None and gpus[0].memory_free_mib == 14979


def test_two_gpus():
    gpus, err = parse_query_csv((FIX / "nvidia-smi-query-2gpu.csv").read_text())
    assert [g.compute_cap for g in gpus] == [(12, 0), (8, 6)]


def test_na_values():
    gpus, err = parse_query_csv((FIX / "nvidia-smi-query-na.csv").read_text())
    assert err is None
    assert gpus[0].compute_cap is None and gpus[0].memory_used_mib == 0
    assert set(gpus[0].unavailable_fields) == {"compute_cap", "memory.used", "memory.free"}
    assert gpus[0].memory_total_mib == 16311


def test_no_devices():
    report = parse_nvidia_smi_output(smi_lines("nvidia-smi-no-devices.txt", 6, "nvidia-smi-no-devices.txt", 6))
    assert report.gpus == () and "No devices were found" in report.error
    assert report.cuda_version is None


def test_no_driver():
    report = parse_nvidia_smi_output(smi_lines("nvidia-smi-no-driver.txt", 9, "nvidia-smi-no-driver.txt", 9))
    assert report.gpus == () and "couldn't communicate with the NVIDIA driver" in report.error


def test_gpu_access_blocked():
    report = parse_nvidia_smi_output(smi_lines("nvidia-smi-gpu-blocked.txt", 255))
    assert "GPU access blocked by the operating system" in report.error


def test_missing_and_empty():
    assert parse_nvidia_smi_output(["@@ft:missing"]).error == "nvidia-smi not found"
    assert NvidiaGpus.default().error
    assert parse_nvidia_smi_output(["@@ft:path /x", "@@ft:query", "@@ft:query-rc 0"]).error


def test_cuda_version_from_table():
    assert parse_cuda_version((FIX / "nvidia-smi-5060ti.txt").read_text()) == "13.0"
    assert parse_cuda_version("") is None


def run_sh(command, env=None):
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_command_on_this_machine():
    """Holds on any machine: no nvidia-smi reads as "not found"; with one, the fact names it and
    lists GPUs, or says why it could not (a driver error is a value, not an exception)."""
    path = "/usr/bin:/bin"
    report = NvidiaGpus().process(run_sh(NvidiaGpus().command(), env=dict(os.environ, PATH=path)))
    smi = shutil.which("nvidia-smi", path=path)
    if smi is None and os.access("/usr/lib/wsl/lib/nvidia-smi", os.X_OK):
        smi = "/usr/lib/wsl/lib/nvidia-smi"
    if smi is None:
        assert report.gpus == () and report.error == "nvidia-smi not found"
    else:
        assert report.smi_path == smi
        assert report.gpus or report.error, report
        for gpu in report.gpus:
            assert gpu.name and gpu.memory_total_mib > 0


def test_command_with_fake_nvidia_smi(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        f"case \"$1\" in --query-gpu=*) cat '{FIX / 'nvidia-smi-query-5060ti.csv'}';; "
        f"*) cat '{FIX / 'nvidia-smi-5060ti.txt'}';; esac\n"
    )
    smi.chmod(0o755)
    report = NvidiaGpus().process(
        run_sh(NvidiaGpus().command(), env=dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin"))
    )
    assert report.smi_path == str(smi) and report.cuda_version == "13.0"
    assert report.gpus[0].compute_cap == (12, 0)


# ---- the 600-series header: "KMD Version:" / "CUDA UMD Version:" (nvidia-smi docs deprecate
# "Driver Version" and "CUDA Version"); both forms read the same.


def test_kmd_header_gives_driver_and_cuda_version():
    table = (FIX / "nvidia-smi-610-rtx5070-laptop-kmd-mistralrs2287.txt").read_text()
    lines = [
        "@@ft:path /usr/bin/nvidia-smi",
        "@@ft:query",
        "0, NVIDIA GeForce RTX 5070 Laptop GPU, 12.0, 12227, 273, 11954, 610.43.02",
        "@@ft:query-rc 0",
        "@@ft:table",
        *table.splitlines(),
        "@@ft:table-rc 0",
    ]
    report = parse_nvidia_smi_output(lines)
    assert report.cuda_version == "13.3" and report.driver_version == "610.43.02"


def test_old_header_gives_driver_and_cuda_version():
    report = parse_nvidia_smi_output(smi_lines("nvidia-smi-query-5060ti.csv", 0, "nvidia-smi-5060ti.txt"))
    assert report.cuda_version == "13.0" and report.driver_version == "581.29"


# ---- who holds the card: the table's "Processes:" rows, on real H200 captures (Linux, 580.159.04;
# tests/fixtures/real/README.md). Under WSL the rows stay empty (microsoft/WSL#7162).


def h200_lines(table_fixture: str) -> list[str]:
    query = (FIX / "nvidia-smi-580-h200-query-20g.txt").read_text().splitlines()
    gpu_line = next(line for line in query if line.startswith("0, NVIDIA H200"))
    lines = ["@@ft:path /usr/bin/nvidia-smi", "@@ft:query", gpu_line, "@@ft:query-rc 0", "@@ft:table"]
    return lines + (FIX / table_fixture).read_text().splitlines() + ["@@ft:table-rc 0"]


def test_a_process_holding_the_card_is_named_with_its_memory():
    report = parse_nvidia_smi_output(h200_lines("nvidia-smi-580-h200-process-20g.txt"))
    (gpu,) = report.gpus
    assert (gpu.memory_total_mib, gpu.memory_used_mib, gpu.memory_free_mib) == (143771, 21099, 122058)
    assert report.processes == (GpuProcess(gpu=0, pid=821, name="python3", used_mib=21090),)


def test_no_running_processes_is_an_empty_list():
    report = parse_nvidia_smi_output(h200_lines("nvidia-smi-580-h200.txt"))
    assert report.error is None and report.processes == ()
    assert parse_table_processes((FIX / "nvidia-smi-5060ti.txt").read_text()) == ()


def test_process_rows_of_other_layouts():
    # Windows' WDDM rows report no memory ("N/A", XuehaiPan/nvitop#55); a name with spaces stays whole.
    table = "\n".join(
        [
            "| Processes:                                                                              |",
            "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
            "|=========================================================================================|",
            "|    0   N/A  N/A            4824    C+G   ...ShellExperienceHost.exe            N/A      |",
            "|    1   N/A  N/A           13048      C   my trainer                             512MiB |",
        ]
    )
    assert parse_table_processes(table) == (
        GpuProcess(0, 4824, "...ShellExperienceHost.exe", None),
        GpuProcess(1, 13048, "my trainer", 512),
    )
    assert parse_table_processes(table.replace("| Processes:", "| Other:")) == ()


# ---- --query-compute-apps: whole names, parsed strictly; names are any process's text


def test_the_real_compute_apps_capture_with_and_without_its_header():
    # tests/fixtures/real/nvidia-smi-580-h200-query-compute-apps-20g.csv: header, "821, python3, 21090 MiB"
    text = (FIX / "nvidia-smi-580-h200-query-compute-apps-20g.csv").read_text()
    assert parse_compute_apps(text) == (GpuProcess(None, 821, "python3", 21090),)
    assert parse_compute_apps("821, python3, 21090\n") == (GpuProcess(None, 821, "python3", 21090),)
    # the other capture's first row: a different pid, the same process
    query = (FIX / "nvidia-smi-580-h200-query-20g.txt").read_text()
    assert parse_compute_apps(query)[0] == GpuProcess(None, 443, "python3", 21090)


def test_compute_apps_rows_are_strict_and_names_made_safe():
    text = "\n".join(
        [
            "No running processes found",
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
            "12, a, name, with, commas, 100",  # the first and the last comma split it
            "13, \x1b]2;pwned\x07\x1b[2Jclear, 200 MiB",  # terminal escapes
            "14, game.exe, [N/A]",
            "x15, bad pid, 1",
            "0, pid zero, 1",
            "16, huge, 99999999999",
            "17, " + "n" * 300 + ", 5",
        ]
    )
    assert parse_compute_apps(text) == (
        GpuProcess(None, 12, "a, name, with, commas", 100),
        GpuProcess(None, 13, "?]2;pwned??[2Jclear", 200),
        GpuProcess(None, 14, "game.exe", None),
        GpuProcess(None, 17, "n" * 77 + "...", 5),
    )
    assert safe_process_name("  \t ") == "?"
    many = "\n".join(f"{pid}, p, 1" for pid in range(1, 100))
    assert len(parse_compute_apps(many)) == 32


def test_a_process_name_cannot_forge_the_facts_own_sections(tmp_path):
    """A process names itself: a name with newlines and "@@ft:" lines, printed by nvidia-smi in the
    table and the compute apps, must not replace the GPU's query section (its memory figures)."""
    forged = "evil\n@@ft:query\n0, FORGED, 9.0, 999999, 0, 999999, 1.0\n@@ft:query-rc 0\n@@ft:missing"
    smi = tmp_path / "nvidia-smi"
    (tmp_path / "forged").write_text(forged)
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"--query-gpu=*) grep '^0, NVIDIA H200' '{FIX / 'nvidia-smi-580-h200-query-20g.txt'}';;\n"
        f"--query-compute-apps=*) printf '821, '; cat '{tmp_path / 'forged'}'; printf ', 21090\\n';;\n"
        f"*) cat '{FIX / 'nvidia-smi-580-h200-process-20g.txt'}'; cat '{tmp_path / 'forged'}';;\n"
        "esac\n"
    )
    smi.chmod(0o755)
    report = NvidiaGpus().process(
        run_sh(NvidiaGpus().command(), env=dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin"))
    )
    assert report.error is None and [g.name for g in report.gpus] == ["NVIDIA H200"]
    assert report.gpus[0].memory_used_mib == 21099
    assert report.processes == (GpuProcess(0, 821, "python3", 21090),)
    # its lines are only rows or not: "821, evil" has no memory, the forged GPU line a pid 0
    assert report.compute_apps == ()
    assert report.cuda_version == "13.0"


def test_compute_apps_unreadable_or_failed_is_none():
    base = h200_lines("nvidia-smi-580-h200.txt")
    assert parse_nvidia_smi_output(base).compute_apps is None
    failed = base + ["@@ft:apps64", "RmFpbGVkCg==", "@@ft:apps-rc 2"]
    assert parse_nvidia_smi_output(failed).compute_apps is None
    garbled = base + ["@@ft:apps64", "not base64!", "@@ft:apps-rc 0"]
    assert parse_nvidia_smi_output(garbled).compute_apps is None
    empty = base + ["@@ft:apps64", "Cg==", "@@ft:apps-rc 0"]
    assert parse_nvidia_smi_output(empty).compute_apps == ()
