"""Preflight rules: each pitfall of the field report, pass and fail, without a host."""

import re
from dataclasses import replace
from pathlib import Path

import pytest

from facts.cuda import CudaToolchainInfo, NvccInfo
from facts.engine import EngineHealthInfo, EngineInstallInfo
from facts.gpu import GpuInfo, GpuProcess, GpuReport, parse_compute_apps
from facts.gpu_memory import GpuMemoryProbeResult
from facts.init import InitInfo
from facts.model import ModelDirInfo, QuantSummary
from facts.resources import ResourcesInfo
from facts.windows import IniFileInfo, WindowsProfileInfo
from facts.wsl import WslKernelInfo, WslVersionInfo
from freetoken_infra import rules
from freetoken_infra.core.launch import derive_plan, engine_command
from freetoken_infra.core.settings import Settings

GiB = 1024**3
FIX_REAL = Path(__file__).parent.parent / "fixtures" / "real"
ARCHS_13 = ("compute_75", "compute_80", "compute_86", "compute_89", "compute_90", "compute_100", "compute_120")
ARCHS_12 = ("compute_50", "compute_75", "compute_80", "compute_86", "compute_89", "compute_90")
RTX5060TI = GpuInfo(0, "NVIDIA GeForce RTX 5060 Ti", (12, 0), 16311, 1021, 15290, "581.80")
RTX5090 = GpuInfo(0, "NVIDIA GeForce RTX 5090", (12, 0), 32607, 1500, 31107, "581.80")


def healthy(**changes) -> rules.Observations:
    """The field report's workstation after its fixes."""
    obs = rules.Observations(
        kernel=WslKernelInfo("wsl2", "6.6.87.2-microsoft-standard-WSL2", "Linux version ..."),
        wsl=WslVersionInfo("ok", (2, 7, 13), "wslinfo", "2.7.13"),
        init=InitInfo("systemd", "running"),
        gpus=GpuReport((RTX5060TI,), "13.0", "/usr/lib/wsl/lib/nvidia-smi", None),
        cuda=CudaToolchainInfo(
            (NvccInfo("/usr/local/cuda-13.0/bin/nvcc", "CUDA_HOME", (13, 0), ARCHS_13),),
            "/usr/local/cuda-13.0",
            "1.13.0",
        ),
        resources=ResourcesInfo(24 * GiB, 20 * GiB, 4 * GiB, 0, 8, "/var/lib", 200 * 10**9),
        wslconf=IniFileInfo("/etc/wsl.conf", True, {"boot": {"systemd": "true"}}),
        windows_profile=WindowsProfileInfo("/mnt/c/Users/dev", "C:\\Users\\dev", None),
        wslconfig=IniFileInfo(
            "/mnt/c/Users/dev/.wslconfig",
            True,
            {
                "wsl2": {
                    "memory": "24GB",
                    "processors": "8",
                    "swap": "4GB",
                    "localhostforwarding": "true",
                    "vmidletimeout": "0",
                }
            },
        ),
        gpu_memory=GpuMemoryProbeResult("healthy", 15 * GiB, 16 * GiB, True, True, 1 * GiB, None),
        engine=EngineInstallInfo("/opt/freetoken", {}, None),
        model=ModelDirInfo("/var/lib/freetoken/models/x", False, {}, None, None),
    )
    return replace(obs, **changes)


def finding(check: str, obs=None, settings=None) -> rules.Finding:
    found = [f for f in rules.evaluate(settings or Settings(), obs or healthy()) if f.check == check]
    assert len(found) == 1
    return found[0]


def test_the_fixed_field_report_machine_has_no_blocker_and_no_warning():
    findings = rules.evaluate(Settings(), healthy())
    assert [f for f in findings if f.status != "pass"] == []


@pytest.mark.parametrize(
    "kind,status,words",
    [("wsl2", "pass", "kernel"), ("wsl1", "block", "--set-version"), ("none", "block", "WSL2 distro")],
)
def test_wsl2_required(kind, status, words):
    f = finding("wsl2", healthy(kernel=WslKernelInfo(kind, "4.4.0-19041-Microsoft", "")))
    assert f.status == status
    assert words in f.evidence + f.remedy


@pytest.mark.parametrize(
    "wsl,status",
    [
        (WslVersionInfo("ok", (2, 7, 13), "wslinfo", ""), "pass"),
        (WslVersionInfo("ok", (2, 7, 13, 0), "wsl.exe", ""), "pass"),
        (WslVersionInfo("ok", (2, 10, 0), "wslinfo", ""), "pass"),
        (WslVersionInfo("ok", (2, 7, 12), "wslinfo", ""), "block"),
        (WslVersionInfo("ok", (2, 6, 1, 0), "wsl.exe", ""), "block"),
        (WslVersionInfo("no_version_flag", None, "wsl.exe", "usage"), "block"),
        (WslVersionInfo("unavailable", None, "none", ""), "block"),
    ],
)
def test_wsl_version_floor(wsl, status):
    f = finding("wsl_version", healthy(wsl=wsl))
    assert f.status == status
    if status == "block":
        assert "wsl.exe --update" in f.remedy


def test_wsl_floor_is_a_setting():
    obs = healthy(wsl=WslVersionInfo("ok", (2, 7, 13), "wslinfo", ""))
    assert finding("wsl_version", obs, Settings(wsl_min_version="2.8.0")).status == "block"


def test_systemd_not_pid1_is_fixed_by_the_deploys_windows_side_step():
    obs = healthy(init=InitInfo("init", None), wslconf=IniFileInfo("/etc/wsl.conf", False))
    f = finding("systemd", obs)
    assert (f.status, f.deploy_fixes) == ("block", True)
    assert "systemd=true" in f.remedy and "wsl.exe --shutdown" in f.remedy
    assert rules.only_deploy_fixable(rules.evaluate(Settings(), obs))


def test_systemd_enabled_but_not_running_needs_only_the_restart():
    f = finding("systemd", healthy(init=InitInfo("init", None)))
    assert (f.status, f.deploy_fixes) == ("block", False)
    assert "wsl.exe --shutdown" in f.remedy


@pytest.mark.parametrize("state,status", [("running", "pass"), ("degraded", "pass"), ("starting", "block")])
def test_systemd_running_and_degraded_both_count_as_up(state, status):
    assert finding("systemd", healthy(init=InitInfo("systemd", state))).status == status


def test_wslconfig_difference_is_a_restart_warning_naming_the_keys():
    obs = healthy(wslconfig=IniFileInfo("/mnt/c/Users/dev/.wslconfig", True, {"wsl2": {"memory": "16GB"}}))
    f = finding("wslconfig", obs)
    assert f.status == "warn" and f.deploy_fixes
    assert "memory=16GB (want 24GB)" in f.evidence
    assert "vmIdleTimeout=<unset> (want 0)" in f.evidence
    assert "restart required" in f.remedy


def test_no_gpu_and_driver_errors_block():
    f = finding("gpu", healthy(gpus=GpuReport((), None, None, "nvidia-smi not found")))
    assert f.status == "block" and "nvidia-smi not found" in f.evidence
    assert "never a Linux driver" in f.remedy


def test_compute_capability_below_ampere_blocks():
    turing = replace(RTX5060TI, name="NVIDIA GeForce RTX 2080", compute_cap=(7, 5))
    f = finding("compute_capability", healthy(gpus=GpuReport((turing,), "13.0", "x", None)))
    assert f.status == "block" and "7.5 < 8.0" in f.evidence


def test_allocation_locked_gpu_memory_is_the_fake_oom():
    locked = GpuMemoryProbeResult(
        "allocation_locked", int(11.6 * GiB), 16 * GiB, False, False, GiB, "CUDA_ERROR_OUT_OF_MEMORY (2)"
    )
    f = finding("gpu_memory", healthy(gpu_memory=locked))
    assert f.status == "block"
    assert "pitfall 4B" in f.evidence and "11.6 GiB free" in f.evidence
    assert "wsl.exe --update" in f.remedy


def test_a_genuinely_full_card_is_not_blamed_on_wsl():
    full = GpuMemoryProbeResult("allocation_locked", 0, 16 * GiB, False, False, GiB, "no free GPU memory reported")
    f = finding("gpu_memory", healthy(gpu_memory=full))
    assert f.status == "block" and "full" in f.evidence
    assert "pitfall 4B" not in f.evidence and "wsl.exe --update" not in f.remedy


def test_no_cuda_blocks():
    f = finding(
        "gpu_memory",
        healthy(gpu_memory=GpuMemoryProbeResult("no_cuda", None, None, None, None, None, "libcuda.so.1 not found")),
    )
    assert f.status == "block" and "libcuda" in f.evidence


@pytest.mark.parametrize(
    "nvcc,status,words",
    [
        ((), "warn", "no nvcc"),
        ((NvccInfo("/usr/bin/nvcc", "PATH", (12, 0), ARCHS_12),), "warn", "wrong major"),
        ((NvccInfo("/usr/local/cuda-13.0/bin/nvcc", "usr_local", (13, 0), ARCHS_12),), "warn", "compute_120"),
        (
            (
                NvccInfo("/usr/bin/nvcc", "PATH", (12, 0), ARCHS_12),
                NvccInfo("/usr/local/cuda-13.0/bin/nvcc", "usr_local", (13, 0), ARCHS_13),
            ),
            "pass",
            "compute_120",
        ),
    ],
)
def test_nvcc_must_be_13_and_list_the_gpu_arch(nvcc, status, words):
    f = finding("nvcc", healthy(cuda=CudaToolchainInfo(nvcc, None, None)))
    assert f.status == status
    assert words in f.evidence
    if status == "warn":
        assert "cuda-nvcc-13-0" in f.remedy


def test_ram_too_small_for_experts_plus_margin():
    small = healthy(resources=ResourcesInfo(16 * GiB, 14 * GiB, 4 * GiB, 0, 8, "/var/lib", 200 * 10**9))
    f = finding("ram", small)
    assert f.status == "block" and "wslconfig_memory" in f.remedy
    assert finding("ram").status == "pass"


def test_disk_counts_only_what_is_still_missing():
    tight = ResourcesInfo(24 * GiB, 20 * GiB, 0, 0, 8, "/var/lib", 30 * 10**9)
    assert finding("disk", healthy(resources=tight)).status == "block"
    # With 20 GB of the model already there and the engine installed, 30 GB is plenty.
    model = ModelDirInfo("/m", True, {"model-00001-of-00003.safetensors": 20 * 10**9}, None, None)
    engine = EngineInstallInfo("/opt/freetoken", {"0.2.1": "0.2.1"}, "0.2.1")
    assert finding("disk", healthy(resources=tight, model=model, engine=engine)).status == "pass"


def test_unsupported_quantisation_is_refused_from_the_config_alone():
    fp8 = QuantSummary(
        "config.json", "compressed-tensors", None, frozenset({"fp8_tensor", "nvfp4"}), frozenset({"fp8_tensor"})
    )
    f = finding("model_quant", healthy(model=ModelDirInfo("/m", True, {"config.json": 100}, fp8, None)))
    assert f.status == "block" and "fp8_tensor" in f.evidence and "nvidia/Qwen3.6-35B-A3B-NVFP4" in f.remedy
    for scheme in ("fp8_channel",):
        q = replace(fp8, expert_schemes=frozenset({scheme}))
        assert rules.check_model_quantisation(q, "/m").status == "block"
    modelopt = QuantSummary(
        "config.json", "modelopt", "MIXED_PRECISION", frozenset({"nvfp4"}), frozenset({"fp8_tensor"})
    )
    # FP8 attention is fine: only the experts go through the MoE quant registry.
    assert rules.check_model_quantisation(modelopt, "/m").status == "pass"


def test_a_broken_or_missing_model_config_never_blocks_the_deploy_that_refetches_it():
    f = finding(
        "model_quant", healthy(model=ModelDirInfo("/m", True, {"config.json": 3}, None, "config.json: invalid JSON"))
    )
    assert f.status == "warn" and "invalid JSON" in f.evidence and "fetches it again" in f.remedy
    # A download that stopped before its first file: an empty model directory.
    assert finding("model_quant", healthy(model=ModelDirInfo("/m", True, {}, None, None))).status == "pass"


def test_launch_plan_for_16gb_blackwell_is_the_field_report_command():
    plan = derive_plan(Settings(), RTX5060TI.memory_total_mib, (12, 0))
    cmd = engine_command(Settings(), plan)
    assert cmd[:3] == ["/opt/freetoken/active/bin/python", "-m", "freetoken"]
    assert " ".join(cmd[3:]) == (
        "--model-path /var/lib/freetoken/models/Qwen3.6-35B-A3B-NVFP4-nvidia "
        "--moe-strategy offload --moe-cache-size 256 --num-tokens 4096 "
        "--kv-reserve-tokens 8192 --max-prefill-length 8192 --max-running-requests 1 "
        "--moe-cpu-layers auto --attention-backend triton --host 127.0.0.1 --port 8000"
    )
    assert not any("key" in a for a in cmd), "the API key must never be a process argument"


def test_launch_plan_scales_with_vram_by_one_rule():
    plan = derive_plan(Settings(), RTX5090.memory_total_mib, (12, 0))
    assert (plan.moe_cache_size, plan.num_tokens, plan.max_running_requests) == (512, 8192, 2)
    ada = derive_plan(Settings(), 24564, (8, 9))
    assert (ada.moe_cache_size, ada.num_tokens, ada.attention_backend) == (384, 6144, "auto")


# (nvidia-smi's memory.total in MiB, compute capability) -> the derived plan, by the rule in
# docs/deploy.md, "Launch plan": cache 16*g, num_tokens 256*g, kv_reserve max(8192, 256*g),
# max_running max(1, g // 16).
CARDS = [
    (16311, (12, 0), (16, 256, 4096, 8192, 1, "triton")),  # RTX 5060 Ti: the field report
    (24564, (8, 9), (24, 384, 6144, 8192, 1, "auto")),  # RTX 4090
    (32607, (12, 0), (32, 512, 8192, 8192, 2, "triton")),  # RTX 5090
    (49140, (8, 9), (48, 768, 12288, 12288, 3, "auto")),  # RTX 6000 Ada
    (97887, (12, 0), (96, 1536, 24576, 24576, 6, "triton")),  # RTX PRO 6000 Blackwell
]


@pytest.mark.parametrize("mib,cc,want", CARDS, ids=[f"{c[2][0]}gb" for c in CARDS])
def test_every_derived_plan_passes_its_own_launch_plan_rule(mib, cc, want):
    from freetoken_infra.core.hardware import nominal_vram_gb

    g, cache, tokens, reserve, running, backend = want
    assert nominal_vram_gb(mib) == g
    plan = derive_plan(Settings(), mib, cc)
    assert (
        plan.moe_cache_size,
        plan.num_tokens,
        plan.kv_reserve_tokens,
        plan.max_running_requests,
        plan.attention_backend,
    ) == (cache, tokens, reserve, running, backend)
    assert plan.num_tokens <= plan.kv_reserve_tokens
    gpu = GpuInfo(0, "a card", cc, mib, 1000, mib - 1000, "581.80")
    obs = healthy(gpus=GpuReport((gpu,), "13.0", "/usr/lib/wsl/lib/nvidia-smi", None))
    f = finding("launch_plan", obs)
    assert f.status == "pass", f


@pytest.mark.parametrize(
    "overrides,status",
    [
        ({}, "pass"),
        ({"launch_num_tokens": 32768}, "block"),  # past the derived reserve (24576)
        ({"launch_num_tokens": 32768, "launch_kv_reserve_tokens": 32768}, "pass"),
        ({"launch_kv_reserve_tokens": 8192}, "block"),  # a reserve below the derived capacity
        ({"launch_moe_cache_size": 16384}, "block"),  # ~88 GB of cache does not fit 96 GB
    ],
)
def test_overrides_on_a_96gb_card_are_still_validated(overrides, status):
    gpu = GpuInfo(0, "NVIDIA RTX PRO 6000 Blackwell", (12, 0), 97887, 1000, 96887, "581.80")
    obs = healthy(gpus=GpuReport((gpu,), "13.0", "/usr/lib/wsl/lib/nvidia-smi", None))
    assert finding("launch_plan", obs, Settings(**overrides)).status == status


@pytest.mark.parametrize(
    "overrides,status",
    [
        ({}, "pass"),
        ({"launch_moe_cache_size": "auto"}, "block"),
        ({"launch_moe_cache_size": 2048}, "block"),
        ({"launch_moe_cache_size": 512}, "pass"),
        ({"launch_num_tokens": 16384}, "block"),
    ],
)
def test_launch_plan_that_cannot_fit_a_16gb_card_blocks(overrides, status):
    assert finding("launch_plan", settings=Settings(**overrides)).status == status


def test_moe_cache_auto_becomes_its_own_flag():
    plan = derive_plan(Settings(launch_moe_cache_size="auto"), RTX5090.memory_total_mib, (12, 0))
    cmd = engine_command(Settings(), plan)
    assert "--moe-cache-auto" in cmd and "--moe-cache-size" not in cmd


def test_declared_hardware_profile_must_match_the_gpu():
    assert finding("hardware_profile", settings=Settings(hardware_profile="rtx5060ti_16gb")).status == "pass"
    f = finding("hardware_profile", settings=Settings(hardware_profile="rtx5090_32gb"))
    assert f.status == "block" and "16 GB" in f.evidence


def test_tripped_guard_is_reported():
    f = finding("guard", healthy(guard_state={"tripped": True, "reason": "swap 2.6 GB > 2.0 GB", "time": "t"}))
    assert f.status == "warn" and "swap 2.6 GB" in f.evidence


# --- .wslconfig / wsl.conf as WSL reads them (freetoken_infra/core/wsl_ini.py) ---------------------

from facts.windows import parse_ini  # noqa: E402

WSLCONFIG_PATH = "/mnt/c/Users/dev/.wslconfig"


def test_wslconfig_with_inline_comments_and_quotes_equal_to_the_settings_passes():
    data = (
        b'[wsl2]   # mine\r\nmemory = "24GB"   # limit\r\nprocessors=8 # cores\r\nswap=4GB\r\n'
        b'localhostForwarding = "true"\r\nvmIdleTimeout=0 # never\r\n'
    )
    f = finding("wslconfig", healthy(wslconfig=parse_ini(WSLCONFIG_PATH, data)))
    assert f.status == "pass", f.evidence


def test_networking_mode_where_wsl_2_0_read_it_counts():
    data = (
        b"[wsl2]\nmemory=24GB\nprocessors=8\nswap=4GB\nlocalhostForwarding=true\nvmIdleTimeout=0\n"
        b"[experimental]\nnetworkingMode=mirrored\n"
    )
    settings = Settings(wslconfig_networking_mode="mirrored")
    f = finding("wslconfig", healthy(wslconfig=parse_ini(WSLCONFIG_PATH, data)), settings)
    assert f.status == "pass" and "networkingMode=mirrored ([experimental] line 8)" in f.evidence


def test_wslconfig_keys_before_any_section_are_not_counted():
    data = b"memory=24GB\nprocessors=8\nswap=4GB\nlocalhostForwarding=true\nvmIdleTimeout=0\n"
    f = finding("wslconfig", healthy(wslconfig=parse_ini(WSLCONFIG_PATH, data)))
    assert f.status == "warn" and f.deploy_fixes and "memory=<unset>" in f.evidence


def test_systemd_key_before_any_section_is_not_enabled_and_the_deploy_fixes_it():
    obs = healthy(init=InitInfo("init", None), wslconf=parse_ini("/etc/wsl.conf", b"systemd=true\n# [boot]\n"))
    f = finding("systemd", obs)
    assert (f.status, f.deploy_fixes) == ("block", True)


def test_wsl_conf_that_cannot_be_merged_is_a_blocker_naming_the_line():
    data = b"[network]\nhostname=ws1\n; not a comment for WSL\n"
    f = finding("systemd", healthy(init=InitInfo("init", None), wslconf=parse_ini("/etc/wsl.conf", data)))
    assert (f.status, f.deploy_fixes) == ("block", False)
    assert "line 3" in f.evidence and "by hand" in f.remedy


# ---- gpu_free: the plan against what the card has free now. The H200 numbers
# are the real capture's (tests/fixtures/real/nvidia-smi-580-h200-query-20g.txt); 136 GiB held is
# the second capture's doctor line ("2.7 GiB free of 139.8 GiB"), which then still passed its plan.

H200_20G = GpuInfo(0, "NVIDIA H200", (9, 0), 143771, 21099, 122058, "580.159.04")
H200_136G = replace(H200_20G, memory_used_mib=143771 - 2765, memory_free_mib=2765)


def on_card(gpu, processes=(), **changes):
    return healthy(gpus=GpuReport((gpu,), "13.0", "/usr/bin/nvidia-smi", None, "580.159.04", processes), **changes)


def test_a_card_held_by_another_process_blocks_and_names_it():
    held = (GpuProcess(0, 821, "python3", 143771 - 2765 - 10),)
    f = finding("gpu_free", on_card(H200_136G, held))
    assert f.status == "block"
    assert "137.7 GiB of 140.4 GiB in use, held by python3 (pid 821, 137.7 GiB)" in f.evidence
    assert "needs ~19.4 GB" in f.evidence and "0.0 left to it" in f.evidence
    assert "re-run" in f.remedy
    # ...while the card's own size still fits the plan: the rule that passed on the real host
    assert finding("launch_plan", on_card(H200_136G, held)).status == "pass"


def test_twenty_gib_held_on_an_h200_leaves_room_for_the_plan():
    f = finding("gpu_free", on_card(H200_20G, (GpuProcess(0, 821, "python3", 21090),)))
    assert f.status == "pass"
    assert f.evidence.startswith("20.6 GiB of 140.4 GiB in use, held by python3 (pid 821, 20.6 GiB)")
    assert f.evidence.endswith("of 105.8 left to it")


@pytest.mark.parametrize("used_mib,status", [(1021, "pass"), (7 * 1024, "pass"), (9 * 1024, "block")])
def test_a_game_on_a_16gb_card_under_wsl(used_mib, status):
    # Under WSL nvidia-smi lists no Windows process: the rule says so rather than naming none.
    gpu = replace(RTX5060TI, memory_used_mib=used_mib, memory_free_mib=16311 - used_mib)
    f = finding("gpu_free", on_card(gpu))
    assert f.status == status
    if used_mib >= 1024:  # under WSL nvidia-smi lists no Windows process: the rule says so
        assert "in use, held by Windows-side processes (not listed under WSL); the plan needs" in f.evidence
    else:
        assert "in use, none of it by a listed process; the plan needs" in f.evidence


def test_a_larger_memory_ratio_leaves_more_room():
    gpu = replace(RTX5060TI, memory_used_mib=9 * 1024)
    assert finding("gpu_free", on_card(gpu), Settings(launch_memory_ratio=1.0)).status == "pass"


@pytest.mark.parametrize("status", ["ok", "loading"])
def test_an_engine_of_ours_holding_the_card_is_not_judged(status):
    health = EngineHealthInfo(True, status, None, None, None, "0.2.1", None, None, None)
    findings = rules.evaluate(Settings(), on_card(H200_136G, health=health))
    assert [f for f in findings if f.check == "gpu_free"] == []


def test_unknown_used_memory_is_not_judged():
    gpu = replace(H200_136G, unavailable_fields=("memory.used",))
    assert [f for f in rules.evaluate(Settings(), on_card(gpu)) if f.check == "gpu_free"] == []


def test_a_held_card_stops_the_converge_before_anything_changes():
    findings = rules.evaluate(Settings(), on_card(H200_136G))
    assert [f.check for f in findings if f.status == "block"] == ["gpu_free"]


# ---- who holds the card, in the doctor's gpu_memory and launch_plan findings too.
# The real case (tests/fixtures/real/doctor-h200-2.7gib-free.txt, a Linux H200): 136 GiB held by
# another process, and gpu_memory and launch_plan passed saying nothing of it.

DOCTOR_2_7 = (FIX_REAL / "doctor-h200-2.7gib-free.txt").read_text()


def _probe_from_the_real_doctor():
    free, total = re.search(r"gpu_memory\s+pass\s+([\d.]+) GiB free of ([\d.]+) GiB", DOCTOR_2_7).groups()
    return GpuMemoryProbeResult("healthy", int(float(free) * GiB), int(float(total) * GiB), True, True, GiB, None)


LINUX = WslKernelInfo("none", "6.18.44-fc-v1252-gpu", "Linux version 6.18.44-fc-v1252-gpu")


def test_the_real_doctor_said_nothing_of_who_held_the_card():
    # the bug as captured: both passed without a word of the 136 GiB held
    assert re.search(r"^gpu_memory\s+pass\s+2\.7 GiB free of 139\.8 GiB; 32 MiB", DOCTOR_2_7, re.M)
    assert re.search(
        r"^launch_plan\s+pass\s+cache 2240, 35840 tokens: ~19\.4 GB of 125\.4 GB usable$", DOCTOR_2_7, re.M
    )


def test_on_linux_the_doctor_names_the_process_in_each_finding():
    apps = parse_compute_apps((FIX_REAL / "nvidia-smi-580-h200-query-compute-apps-20g.csv").read_text())
    assert apps == (GpuProcess(None, 821, "python3", 21090),)
    held = (replace(apps[0], used_mib=143771 - 2765 - 10),)
    obs = replace(on_card(H200_136G, kernel=LINUX, gpu_memory=_probe_from_the_real_doctor()))
    obs = replace(obs, gpus=replace(obs.gpus, compute_apps=held))
    by = {f.check: f for f in rules.evaluate(Settings(), obs)}
    who = "137.7 GiB held by python3 (pid 821, 137.7 GiB)"
    assert by["gpu_memory"].evidence == f"2.7 GiB free of 139.8 GiB; {who}; 32 MiB and large allocations succeed"
    assert by["launch_plan"].status == "pass"  # sized to the card: the same plan on every re-run
    assert by["launch_plan"].evidence == (
        "cache 2240, 35840 tokens: ~19.4 GB of 125.4 GB usable on the card; 137.7 GiB of it "
        "held by python3 (pid 821, 137.7 GiB) now (see gpu_free)"
    )
    assert by["gpu_free"].status == "block" and "held by python3 (pid 821, 137.7 GiB);" in by["gpu_free"].evidence


def test_under_wsl_the_doctor_says_windows_side_processes_hold_it():
    obs = on_card(H200_136G, gpu_memory=_probe_from_the_real_doctor())
    obs = replace(obs, gpus=replace(obs.gpus, compute_apps=()))  # WSL lists nobody (microsoft/WSL#7162)
    by = {f.check: f for f in rules.evaluate(Settings(), obs)}
    assert "; 137.7 GiB held by Windows-side processes (not listed under WSL); 32 MiB" in by["gpu_memory"].evidence
    assert "; 137.7 GiB of it held by Windows-side processes (not listed under WSL) now" in by["launch_plan"].evidence
    assert by["gpu_free"].status == "block"


def test_listed_and_unlisted_holders_are_both_said():
    gpu = replace(H200_20G, memory_used_mib=21099 + 10 * 1024)
    obs = on_card(gpu, processes=(GpuProcess(0, 821, "python3", 21090),))
    assert rules.holders_of(obs, gpu) == (
        "held by python3 (pid 821, 20.6 GiB) and Windows-side processes (not listed under WSL) (10.0 GiB)"
    )
    assert rules.holders_of(replace(obs, kernel=LINUX), gpu).endswith(
        "and processes nvidia-smi does not list (10.0 GiB)"
    )


def test_the_table_rows_name_holders_when_compute_apps_were_not_read():
    obs = on_card(H200_20G, processes=(GpuProcess(0, 821, "python3", 21090), GpuProcess(1, 9, "other", 5)))
    assert rules.holders_of(obs, H200_20G) == "held by python3 (pid 821, 20.6 GiB)"


def test_an_idle_card_and_a_serving_engine_name_nobody():
    assert rules.holders_of(on_card(RTX5060TI), RTX5060TI) is None  # 1 GiB: the desktop's own
    assert "held by" not in finding("launch_plan", on_card(RTX5060TI)).evidence
    health = EngineHealthInfo(True, "ok", None, None, None, "0.2.1", None, None, None)
    assert rules.holders_of(on_card(H200_136G, health=health), H200_136G) is None
    assert "held by" not in finding("launch_plan", on_card(H200_136G, health=health)).evidence


# --- interop as a service sees it (the doctor) ------------------------------------------

REAL_INTEROP = Path(__file__).resolve().parents[1] / "fixtures" / "real"


def service_probe(fixture: str | None, rc: int, text: bytes = b""):
    """The InteropAsService fact's answer for what systemd-run printed (a real capture)."""
    import base64

    from facts.wsl import InteropAsService

    data = (REAL_INTEROP / fixture).read_bytes() if fixture else text
    raw = base64.b64encode(data + f"\n@@rc:{rc}".encode()).decode()
    return InteropAsService().process(["@@ft:svc", raw])


@pytest.mark.parametrize(
    "fixture, rc, reason, fix",
    [
        ("interop-exec-format-bash.txt", 126, "Exec format error", "/etc/binfmt.d/WSLInterop.conf"),
        ("interop-run-detectors.txt", 2, "run-detectors: no interpreter", "update-binfmts --disable"),
        ("interop-connect-failed-111.txt", 1, "interop socket: connect failed 111", "wsl.exe --shutdown"),
        ("interop-accept4-failed-110.txt", 1, "Windows never connected back", "Windows unlocked"),
        (None, 124, "timed out after 30 s", "Windows unlocked"),
    ],
)
def test_the_doctor_names_interop_broken_as_a_service_sees_it_and_the_signals_off(fixture, rc, reason, fix):
    obs = healthy(interop=service_probe(fixture, rc))
    f = finding("interop", obs, Settings(owner_apps=["eldenring.exe"]))
    assert f.status == "warn"
    assert f"as a service: {reason}" in f.evidence
    assert f"owner signals: VRAM only (interop: {reason})" in f.evidence
    assert fix in f.remedy


def test_interop_that_works_as_a_service_passes_and_names_other_handlers():
    from facts.wsl import InteropBinfmt

    ok = service_probe(None, 0, b"freetoken-interop-ok\r\n")
    assert finding("interop", healthy(interop=ok)).status == "pass"
    taken = healthy(interop=ok, interop_binfmt=InteropBinfmt(True, True, ("cli",)))
    assert "other handlers of Windows programs: cli" in finding("interop", taken).evidence
    # Something that ran but did not answer as cmd.exe does is not taken for a working interop.
    assert finding("interop", healthy(interop=service_probe(None, 0, b"hello\n"))).status == "warn"
    # The deploy does not probe: no finding at all.
    assert all(f.check != "interop" for f in rules.evaluate(Settings(), healthy()))
