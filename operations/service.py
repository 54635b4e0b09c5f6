"""`freetoken.service`: the engine as a hardened systemd unit, its environment file and
its API key (field report: run the engine under systemd, never from a terminal,
so it depends on no `wsl.exe` session - pitfall 4A).
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import operation
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.files import File
from pyinfra.operations import files

from freetoken_infra.core import gpu_room, redact
from freetoken_infra.core.launch import LaunchPlan, engine_command, estimated_vram_gb
from freetoken_infra.core.layout import (
    DEFAULT_DRIVE_ROOT,
    ENGINE_UNIT,
    GPU_FREE_SCRIPT,
    GPU_ROOM_MODULE,
    KEY_VAR,
    UNIT_DIR,
    HostLayout,
)
from freetoken_infra.core.settings import ControllerSourceError, Settings, controller_key
from freetoken_infra.core.units import Comment, Entry, Section, UnitFile, no_windows, render, unit_command, unit_word
from operations import managed
from operations.managed import ManagedFile
from operations.model import check_argv

UNIT_PATH = f"{UNIT_DIR}/{ENGINE_UNIT}"


def env_path(settings: Settings) -> str:
    return f"{settings.config_dir}/engine.env"


def key_path(settings: Settings) -> str:
    return f"{settings.config_dir}/api-key.env"


def engine_environment(settings: Settings) -> str:
    """The service's environment (no secrets: the key has its own file)."""
    cache = settings.cache_dir
    values = {
        # Its only writable folder (the passwd home, state_dir, is root's): CUDA's JIT cache
        # (~/.nv) and anything else that writes under HOME land there.
        "HOME": cache,
        "CUDA_HOME": settings.cuda_home,
        "PATH": f"{HostLayout.of(settings).engine_active_link}/bin:{settings.cuda_home}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        # Persistent kernel caches turn a 2-3 minute cold start into ~34 s.
        "TVM_FFI_CACHE_DIR": f"{cache}/tvm-ffi",
        "TRITON_CACHE_DIR": f"{cache}/triton",
        "FREETOKEN_KERNEL_CACHE_DIR": f"{cache}/kernels",
        "HF_HOME": f"{cache}/huggingface",
        "HF_ENDPOINT": str(settings.hub_endpoint).rstrip("/"),
        "LOG_LEVEL": settings.log_level,
    }
    if settings.hub_disable_xet:
        values["HF_HUB_DISABLE_XET"] = "1"
    return "".join(f"{k}={v}\n" for k, v in values.items())


def gpu_free_argv(plan: LaunchPlan) -> list[str] | None:
    """The engine's start-time check that the plan fits what is free of the GPU (None: the plan
    has no estimate, ``--moe-cache-auto``, and the engine sizes itself)."""
    need = estimated_vram_gb(plan)
    if need is None:
        return None
    ratio = [] if plan.memory_ratio is None else ["--ratio", str(plan.memory_ratio)]
    return ["/usr/bin/python3", GPU_FREE_SCRIPT, "--need-gb", f"{need:.2f}", *ratio]


def engine_unit(settings: Settings, plan: LaunchPlan, drive_root: str = DEFAULT_DRIVE_ROOT) -> str:
    """The unit file, from settings and the launch plan; ``drive_root`` (wsl.conf's automount
    root) names the Windows drives the engine never sees (``core.units.no_windows``)."""
    # The model is read under /home too; the engine's own folder must stay visible to be written.
    model_home = any(p.startswith("/home/") for p in (settings.model_dir, settings.cache_dir))
    # No '-': a missing key file must stop the start (fail closed), never start an engine that
    # answers without authentication. Only api_key_source = "none" runs without a key.
    key: tuple[Entry, ...] = () if settings.api_key_source == "none" else (("EnvironmentFile", key_path(settings)),)
    gpu_argv = gpu_free_argv(plan)
    gpu_check: tuple[Entry, ...] = (
        ()
        if gpu_argv is None
        else (
            Comment(
                "Nor into GPU memory the owner's apps and games hold (at boot, after a crash): it waits,\n"
                "tried again after RestartSec, until they let go."
            ),
            ("ExecStartPre", unit_command(gpu_argv)),
        )
    )
    unit = UnitFile(
        header="Managed by freetoken-infra; local edits are overwritten on the next deploy.",
        sections=(
            Section(
                "Unit",
                (
                    ("Description", f"FreeToken OpenAI-compatible LLM endpoint ({settings.served_model_name})"),
                    ("After", "network-online.target"),
                    ("Wants", "network-online.target"),
                ),
            ),
            Section(
                "Service",
                (
                    ("Type", "simple"),
                    ("User", settings.service_user),
                    ("Group", settings.service_user),
                    ("WorkingDirectory", settings.cache_dir),
                    ("EnvironmentFile", env_path(settings)),
                    *key,
                    Comment(
                        "The engine never starts on a model whose download did not verify (complete, and every\n"
                        "file as it was when its hash was checked)."
                    ),
                    ("ExecStartPre", unit_command(check_argv(settings))),
                    *gpu_check,
                    ("ExecStart", unit_command(engine_command(settings, plan))),
                    ("Restart", "on-failure"),
                    Comment(
                        "FreeToken 0.2.1 ends itself with SIGTERM when a backend worker dies, which\n"
                        "on-failure alone would take for a clean stop."
                    ),
                    ("RestartForceExitStatus", "SIGTERM"),
                    ("RestartSec", "5"),
                    Comment("Cold start: experts 45 s + CUDA graphs 42 s + warm-up 16 s, up to 3 min on first JIT."),
                    ("TimeoutStartSec", str(settings.start_timeout_s)),
                    ("TimeoutStopSec", "30"),
                    Comment(
                        "Hardening: a dedicated user, no privilege gain, read-only system (the model too: it belongs\n"
                        "to the download's user), its caches the only folder it writes, no sight of other users'\n"
                        "processes (root's commands), and only the GPU's paravirtual device (/dev/dxg) among devices.\n"
                        "No ProcSubset=pid: torch and the engine read /proc/meminfo and /proc/cpuinfo (system-wide, not\n"
                        "per-process files), which it would hide."
                    ),
                    ("NoNewPrivileges", "yes"),
                    ("ProtectSystem", "strict"),
                    ("ProtectHome", "read-only" if model_home else "yes"),
                    ("ReadWritePaths", unit_word(settings.cache_dir, variables=False)),
                    ("ProtectProc", "invisible"),
                    ("PrivateTmp", "yes"),
                    ("DevicePolicy", "closed"),
                    ("DeviceAllow", "/dev/dxg rw"),
                    ("ProtectKernelTunables", "yes"),
                    ("ProtectKernelModules", "yes"),
                    ("ProtectControlGroups", "yes"),
                    ("RestrictSUIDSGID", "yes"),
                    ("LockPersonality", "yes"),
                    *no_windows(drive_root),
                    Comment(
                        "Its own two ports only (the API, and port+1 for its gloo group): never the host agent's\n"
                        "(which systemd holds from boot anyway). Enforced where the kernel has systemd's BPF hooks."
                    ),
                    ("SocketBindAllow", f"tcp:{settings.listen_port}"),
                    ("SocketBindAllow", f"tcp:{settings.listen_port + 1}"),
                    ("SocketBindDeny", "any"),
                ),
            ),
            Section("Install", (("WantedBy", "multi-user.target"),)),
        ),
    )
    return render(unit)


def key_from_controller(settings: Settings) -> str:
    """Read a key named by `api_key_source` on the controller (file: or env:)."""
    try:
        key = controller_key(settings.api_key_source)
    except ControllerSourceError as exc:
        raise OperationError(f"{host.name}: api_key_source {settings.api_key_source}: {exc}") from None
    redact.remember(key)  # masked in every diff and line of this run, whatever file it lands in
    return key


@operation()
def api_key(settings: Settings):
    """
    The API key file (`<config_dir>/api-key.env`, mode 0600, root): generated on the
    host once (`generate`), copied from the controller (`file:` / `env:`), or absent
    (`none`). The key never appears in a process argument or a log line.

    + settings: the host's Settings (api_key_source, config_dir)
    """
    path = key_path(settings)
    source = settings.api_key_source
    if source == "none":
        yield from files.file._inner(path=path, present=False)
        return
    if source == "generate":
        if host.get_fact(File, path=path):
            yield from files.file._inner(path=path, user="root", group="root", mode="600")
            return
        # printf is a shell builtin: the key is in no process's argv.
        yield (
            f"umask 077 && key=$(head -c 32 /dev/urandom | base64 | tr -d '/+=\\n') && "
            f"printf '{KEY_VAR}=%s\\n' \"$key\" > {path}.tmp && mv {path}.tmp {path}"
        )
        return
    content = f"{KEY_VAR}={key_from_controller(settings)}\n"  # secret: --diff says it changes, never its value
    yield from managed.put(ManagedFile(path, text=content, mode="600", secret=True))


@operation()
def unit(settings: Settings, plan: LaunchPlan, drive_root: str = DEFAULT_DRIVE_ROOT):
    """
    The engine's environment file (0600) and unit file, each written atomically, with a
    daemon-reload when the unit changed (the deploy restarts the engine when either did).

    + settings: the host's Settings
    + plan: the launch plan (freetoken_infra.core.launch.derive_plan)
    + drive_root: wsl.conf's automount root (the drives the engine never sees)
    """
    yield from managed.put(
        # the start-time GPU check and its formula, before the unit that runs them
        ManagedFile(GPU_ROOM_MODULE, local=gpu_room.__file__),
        ManagedFile(GPU_FREE_SCRIPT, local=managed.script_source("gpu_free.py")),
        ManagedFile(env_path(settings), text=engine_environment(settings), mode="600", atomic=True, secret=True),
        ManagedFile(UNIT_PATH, text=engine_unit(settings, plan, drive_root), atomic=True, unit=True),
    )
