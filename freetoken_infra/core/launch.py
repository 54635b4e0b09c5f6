"""The launch plan: engine flags derived from the hardware, and the one function
that turns a plan into FreeToken's command line.

The rule (documented in docs/deploy.md, "Launch plan"):
- a 16 GB Blackwell card gets the field report's command exactly;
- other cards scale with nominal VRAM in GB (`g`): `--moe-cache-size 16*g`,
  `--num-tokens 256*g`, `--kv-reserve-tokens max(8192, 256*g)` (the reserve always
  covers the KV capacity, which rules.check_launch_plan requires),
  `--max-running-requests max(1, g // 16)`;
- always `--moe-strategy offload` (experts live in system RAM), `--moe-cpu-layers
  auto` (stays inside the WSL pin budget), `--max-prefill-length 8192`, and
  `--attention-backend triton` on 12.x GPUs (`fa` is refused there) or `auto` elsewhere;
- any value can be overridden with a `launch_*` setting; overrides are validated
  by rules.check_launch_plan: the plan must fit the card (which is also what refuses
  `--moe-cache-size auto` on a 16 GB card, pitfall 1: it ran out of GPU memory) and
  `num_tokens` must not exceed `kv_reserve_tokens` (so raising launch_num_tokens past
  the card's reserve needs launch_kv_reserve_tokens too: every derived plan passes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from freetoken_infra.core import gpu_room
from freetoken_infra.core.hardware import nominal_vram_gb
from freetoken_infra.core.layout import HostLayout
from freetoken_infra.core.settings import Settings

# VRAM model fitted to the field report (peak 5.9 GB at cache 256 / 4096 tokens on
# a 16 GB card; cache 2048 or `auto` ran out of memory): dense weights, graphs and
# activations, one expert cache slot, one KV token.
VRAM_BASE_GB = 3.9
VRAM_PER_CACHE_SLOT_GB = 5.5 / 1024
VRAM_PER_TOKEN_GB = 0.1 / 1024
# The field report's KV reserve (16 GB card); larger cards reserve their whole KV capacity.
KV_RESERVE_TOKENS_MIN = 8192


@dataclass(frozen=True)
class LaunchPlan:
    moe_strategy: str
    moe_cache_size: int | str
    num_tokens: int
    kv_reserve_tokens: int
    max_prefill_length: int
    max_running_requests: int
    moe_cpu_layers: str
    attention_backend: str
    memory_ratio: float | None


def running_requests(nominal_gb: int) -> int:
    """Streams the engine runs at once on a card of `nominal_gb` (its slots; the gateway sends
    each host no more than this: operations/gateway.py)."""
    return max(1, nominal_gb // 16)


def derive_plan(settings: Settings, vram_total_mib: int, compute_cap: tuple[int, int]) -> LaunchPlan:
    """The plan for this GPU, with the host's `launch_*` overrides applied."""
    g = nominal_vram_gb(vram_total_mib)
    plan = LaunchPlan(
        moe_strategy="offload",
        moe_cache_size=16 * g,
        num_tokens=256 * g,
        kv_reserve_tokens=max(KV_RESERVE_TOKENS_MIN, 256 * g),
        max_prefill_length=8192,
        max_running_requests=running_requests(g),
        moe_cpu_layers="auto",
        attention_backend="triton" if compute_cap[0] == 12 else "auto",
        memory_ratio=None,
    )
    overrides = {
        field: getattr(settings, f"launch_{field}")
        for field in LaunchPlan.__dataclass_fields__
        if getattr(settings, f"launch_{field}") is not None
    }
    return replace(plan, **overrides)


def estimated_vram_gb(plan: LaunchPlan) -> float | None:
    """Peak GPU memory the plan needs; None when the engine sizes the cache itself."""
    if not isinstance(plan.moe_cache_size, int):
        return None
    return VRAM_BASE_GB + plan.moe_cache_size * VRAM_PER_CACHE_SLOT_GB + plan.num_tokens * VRAM_PER_TOKEN_GB


def usable_vram_gb(plan: LaunchPlan, vram_total_mib: int) -> float:
    """What the plan may use of an otherwise empty card (``gpu_room.room_gb``)."""
    return gpu_room.room_gb(vram_total_mib, 0, plan.memory_ratio)


def engine_command(settings: Settings, plan: LaunchPlan) -> list[str]:
    """FreeToken's command line for this host: the one place the flags are spelled.

    Pitfall 1: the flag is `--attention-backend` (0.2.1 still accepts `--attn` as
    an alias, but older releases did not). The API
    key is never a flag (it would show in `ps`); the engine reads it from
    FREETOKEN_API_KEY in the service's environment file.
    """
    args = [
        f"{HostLayout.of(settings).engine_active_link}/bin/python",
        "-m",
        "freetoken",
        "--model-path",
        settings.model_dir,
        "--moe-strategy",
        plan.moe_strategy,
        # 0.2.1's --moe-cache-size takes an int; "auto" is its own flag.
        *(["--moe-cache-auto"] if plan.moe_cache_size == "auto" else ["--moe-cache-size", str(plan.moe_cache_size)]),
        "--num-tokens",
        str(plan.num_tokens),
        "--kv-reserve-tokens",
        str(plan.kv_reserve_tokens),
        "--max-prefill-length",
        str(plan.max_prefill_length),
        "--max-running-requests",
        str(plan.max_running_requests),
        "--moe-cpu-layers",
        plan.moe_cpu_layers,
        "--attention-backend",
        plan.attention_backend,
    ]
    if plan.memory_ratio is not None:
        args += ["--memory-ratio", str(plan.memory_ratio)]
    args += ["--host", str(settings.listen_host), "--port", str(settings.listen_port)]
    return args
