# STAND-IN mirror of the REAL parser: freetoken 0.2.1, freetoken/server/args.py, parse_args().
# Same flag names and aliases, order, defaults, choices, types' validation messages, the two
# (optional, not required) mutually exclusive groups --num-pages|--num-tokens and
# --moe-cache-size|--moe-cache-rate|--moe-cache-mem|--moe-cache-auto, and the parser.error()
# checks that run after parsing. argparse itself gives the same errors as the real one
# (unknown flag -> "error: unrecognized arguments: ...", exit 2). Note: the real 0.2.1 accepts
# `--attn` as an alias of `--attention-backend`. Torch-dependent resolution (dtype, TP info,
# multimodal config) is left out. Checked against REAL_FLAGS_0.2.1.txt by the unit tests.
from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field

API_KEY_ENV = "FREETOKEN_API_KEY"

MOE_STRATEGIES = ("fused", "offload", "cpu", "hybrid")
OFFLOAD_MOE_STRATEGIES = frozenset({"offload", "cpu", "hybrid"})
SCOPES = ("unified", "per-layer")
ATTENTION_BACKENDS = ("trtllm", "fi", "fa", "triton", "dsv4_sparse", "dsv41_sparse", "dsa", "m3_sparse", "qsa_sparse")
CACHE_MANAGERS = ["naive", "radix"]
ENCODER_KINDS = ("vision", "audio")

logger = logging.getLogger("freetoken.server.args")


@dataclass
class ServerArgs:
    """The parsed namespace the stand-in runs with (a plain record; the real one is frozen)."""

    model_path: str
    served_model_name: str
    server_host: str = "127.0.0.1"
    server_port: int = 1919
    api_key: str | None = field(default=None, repr=False)
    extra: dict = field(default_factory=dict)


class _DeprecatedAlias(argparse.Action):
    def __init__(self, *args, new_flag: str, convert=None, **kwargs):
        self.new_flag, self.convert = new_flag, convert
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        logger.warning("%s is deprecated; use %s", option_string, self.new_flag)
        setattr(namespace, self.dest, self.convert(values) if self.convert else values)


def _nvfp4_entry(value: str) -> str:
    if value == "auto":
        return ""
    return "moe.nvfp4=" + {"flashinfer": "b12x"}.get(value, value)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _validate_attn_backend(backend: str) -> str:
    if backend != "auto":
        parts = backend.split(",")
        if len(parts) > 2:
            raise argparse.ArgumentTypeError(
                f"At most two comma-separated attention backends are allowed (prefill,decode), got {backend!r}"
            )
        for name in parts:
            if name not in ATTENTION_BACKENDS:
                raise argparse.ArgumentTypeError(
                    f"Unsupported Attention Backend: {name}. Supported items: {list(ATTENTION_BACKENDS)}"
                )
    return backend


def _parse_quant_backend(value: str) -> str:
    for entry in value.split(","):
        key, sep, name = entry.partition("=")
        if not sep or not key.strip() or not name.strip():
            raise argparse.ArgumentTypeError(f"bad --quant-backend entry {entry!r}: expected layer[.kind]=name")
    return value


def _parse_moe_cache_rate(value: str) -> float:
    try:
        rate = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError("must be a number in [0, 1]") from exc
    if not 0 <= rate <= 1:
        raise argparse.ArgumentTypeError("must be in [0, 1]")
    return rate


def _parse_mem_size(value: str) -> int:
    units = {
        "b": 1,
        "k": 1 << 10,
        "kb": 1 << 10,
        "kib": 1 << 10,
        "m": 1 << 20,
        "mb": 1 << 20,
        "mib": 1 << 20,
        "g": 1 << 30,
        "gb": 1 << 30,
        "gib": 1 << 30,
    }
    text = value.strip().lower()
    number = text.rstrip("abgikm")
    unit = text[len(number) :]
    try:
        size = int(float(number) * units[unit])
    except (KeyError, ValueError, OverflowError) as exc:
        raise argparse.ArgumentTypeError("must be a size with a unit, e.g. 12GiB or 800MiB") from exc
    if size <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return size


def _parse_cache_split(value: str) -> str:
    if value == "equal" or (value.startswith("profile:") and len(value) > len("profile:")):
        return value
    raise argparse.ArgumentTypeError("must be equal or profile:<path>")


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError("must be a positive integer") from exc
    if n < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return n


def _gpu_arg(value: str) -> tuple[str, ...]:
    entries = tuple(v.strip() for v in value.split(",") if v.strip())
    if not entries:
        raise argparse.ArgumentTypeError("expected a GPU index or UUID")
    return entries


TOOL_CALL_PARSERS = [
    "auto",
    "llama3",
    "qwen",
    "qwen25",
    "qwen3_coder",
    "mistral",
    "deepseekv32",
    "deepseekv41",
    "gemma4",
    "glm47",
    "minimax",
    "minimax_m3",
    "muse_glimmer",
    "gpt_oss",
    "gpt-oss",
]
REASONING_PARSERS = [
    "auto",
    "off",
    "deepseekv32",
    "gpt_oss",
    "qwen3",
    "glm",
    "minimax",
    "minimax_m3",
    "muse_glimmer",
    "gemma4",
    "flint",
]


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="FreeToken Server Arguments")
    a = p.add_argument
    a(
        "--model-path",
        "--model",
        type=str,
        required=True,
        help="The path of the model weights. This can be a local folder or a Hugging Face repo ID.",
    )
    a("--dtype", type=str, default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    a("--hf-overrides", type=_json_object, default=None, metavar="JSON")
    a("--tensor-parallel-size", "--tp-size", type=int, default=1)
    a("--gpu", type=_gpu_arg, default=())
    a("--max-running-requests", type=int, dest="max_running_req", default=4)
    a("--max-seq-len-override", type=int, default=None)
    a("--max-output-tokens", type=_positive_int, default=None)
    a("--memory-ratio", type=float, default=0.9)
    a("--dummy-weight", action="store_true", dest="use_dummy_weight")
    a("--disable-pynccl", action="store_false", dest="use_pynccl")
    a("--host", type=str, dest="server_host", default="127.0.0.1")
    a("--port", type=int, dest="server_port", default=1919)
    a(
        "--api-key",
        type=str,
        default=None,
        help="Require this key on every route except /health. Defaults to $FREETOKEN_API_KEY.",
    )
    a("--cuda-graph-max-bs", "--graph", type=int, default=None)
    a("--num-tokenizer", "--tokenizer-count", type=int, default=0)
    a("--max-prefill-length", "--max-extend-length", type=int, dest="max_extend_tokens", default=8192)
    a("--decode-log-interval", type=_positive_int, default=40)
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-pages", dest="num_page_override", type=int, default=None)
    kv.add_argument("--num-tokens", dest="num_token_override", type=int, default=None)
    a("--page-size", type=int, default=1)
    a("--attention-backend", "--attn", type=_validate_attn_backend, default="auto")
    a("--model-source", type=str, default="huggingface", choices=["huggingface", "modelscope"])
    a("--cache-type", type=str, default="radix", choices=CACHE_MANAGERS)
    a("--text-model-only", action="store_true", default=False)
    a("--mm-disable", nargs="+", choices=list(ENCODER_KINDS), default=[], metavar="{vision,audio}")
    a("--mmproj", type=str, default=None, metavar="FILE")
    a("--image-min-tokens", type=_positive_int, default=None)
    a("--image-max-tokens", type=_positive_int, default=None)
    a("--mm-processor-kwargs", type=_json_object, default=None, metavar="JSON")
    a("--mm-embed-cache-device", choices=["cpu", "cuda"], default="cpu")
    a("--mm-encoder-weights", choices=["gpu", "host"], default="host")
    a("--allowed-media-domains", type=str, default="")
    a("--allowed-local-media-path", type=str, default="")
    a("--enable-cache-report", action="store_true", default=False)
    a("--anthropic-inline-system", choices=("auto", "preserve", "fold"), default="auto")
    a("--sampling-defaults", type=str, default="model", choices=["model", "none"])
    a(
        "--served-model-name",
        type=str,
        default=None,
        help="Model id returned by /v1/models. Defaults to the basename of --model.",
    )
    a("--tool-call-parser", type=str, default="auto", choices=TOOL_CALL_PARSERS)
    a("--reasoning-parser", type=str, default="auto", choices=REASONING_PARSERS)
    a("--moe-strategy", default="auto", choices=["auto", *MOE_STRATEGIES])
    a(
        "--moe-backend",
        dest="moe_strategy",
        action=_DeprecatedAlias,
        new_flag="--moe-strategy",
        default=argparse.SUPPRESS,
        choices=["auto", *MOE_STRATEGIES],
        help="[Deprecated] Use --moe-strategy.",
    )
    a("--quant-backend", default=None, type=_parse_quant_backend)
    a("--ple-backend", default="disk", choices=["pinned", "disk"])
    a("--embed-weights", default="gpu", choices=["gpu", "host"])
    a("--swa-decoder-replay", default="bounded", choices=["bounded", "exact"])
    a(
        "--nvfp4-backend",
        action=_DeprecatedAlias,
        new_flag="--quant-backend moe.nvfp4=<marlin|b12x|triton>",
        convert=_nvfp4_entry,
        default=argparse.SUPPRESS,
        choices=["auto", "marlin", "flashinfer", "triton"],
    )
    a("--expert-load", default="auto", choices=["auto", "serial", "parallel"])
    mc = p.add_mutually_exclusive_group()
    mc.add_argument("--moe-cache-size", type=int, default=0, help="The number of unified MoE expert slots on GPU.")
    mc.add_argument("--moe-cache-rate", type=_parse_moe_cache_rate, default=None)
    mc.add_argument("--moe-cache-mem", type=_parse_mem_size, default=None)
    mc.add_argument("--moe-cache-auto", action="store_true", default=False)
    a("--kv-reserve-tokens", type=int, default=8192)
    a("--moe-cache-scope", choices=SCOPES, default="unified")
    a("--moe-cache-split", type=_parse_cache_split, default="equal")
    a("--moe-cache-policy", default="lru", choices=["lru"])
    a("--moe-cpu-threads", type=int, default=0)
    a("--moe-cpu-layers", type=str, default=None)
    a("--moe-hybrid-max-fetch", type=int, default=-1)
    a("--moe-locked-fetch", type=float, default=-1.0)
    a("--moe-locked-max-fetch", type=int, default=8)
    a("--disable-moe-prefill-overlap", action="store_false", dest="moe_prefill_overlap", default=True)
    a("--enable-special-token-ckpt", action="store_true", dest="special_token_ckpt", default=False)
    a("--moe-collect-stats", action="store_true", default=False)
    a("--moe-prefill-hit-d2d", action="store_true", dest="moe_prefill_hit_d2d", default=False)
    a("--shell-mode", action="store_true", help="Run the server in shell mode.")
    a("--cors-origins", type=str, default="tauri://localhost,http://tauri.localhost,http://localhost:1420")
    return p


def parse_args(args: list[str], prog: str | None = None) -> ServerArgs:
    parser = build_parser(prog)
    kwargs = parser.parse_args(args).__dict__.copy()

    if len(kwargs["gpu"]) not in (0, kwargs["tensor_parallel_size"]):
        if kwargs["tensor_parallel_size"] == 1 and len(kwargs["gpu"]) > 1:
            parser.error("tensor parallelism is not supported yet: --gpu takes one entry")
        parser.error(
            f"--gpu has {len(kwargs['gpu'])} entries but --tensor-parallel-size is "
            f"{kwargs['tensor_parallel_size']}; give one entry per TP rank"
        )
    entry = kwargs.pop("nvfp4_backend", None)
    if entry is not None:
        if kwargs["quant_backend"] is not None:
            parser.error(
                "--nvfp4-backend cannot be combined with --quant-backend; write --quant-backend moe.nvfp4=... instead"
            )
        if entry:
            kwargs["quant_backend"] = entry
    if kwargs["api_key"] == "":
        parser.error("--api-key is empty; omit it to serve without authentication")
    kwargs["api_key"] = kwargs["api_key"] or os.environ.get(API_KEY_ENV) or None
    if kwargs["model_path"].startswith("~"):
        kwargs["model_path"] = os.path.expanduser(kwargs["model_path"])
    if kwargs["mmproj"] is not None and not kwargs["model_path"].endswith(".gguf"):
        parser.error("--mmproj needs a .gguf model file")
    if kwargs["allowed_local_media_path"]:
        media_root = os.path.realpath(os.path.expanduser(kwargs["allowed_local_media_path"]))
        if not os.path.isdir(media_root):
            parser.error(f"--allowed-local-media-path {media_root} is not a directory")
    if kwargs["served_model_name"] is None:
        kwargs["served_model_name"] = os.path.basename(os.path.normpath(kwargs["model_path"])) or kwargs["model_path"]
    no_cache_flag = (
        kwargs["moe_cache_size"] == 0
        and not kwargs["moe_cache_auto"]
        and kwargs["moe_cache_mem"] is None
        and not kwargs["moe_cache_rate"]
    )
    if kwargs["moe_strategy"] in OFFLOAD_MOE_STRATEGIES and no_cache_flag:
        kwargs["moe_cache_auto"] = True
    if (
        kwargs["image_min_tokens"] is not None
        and kwargs["image_max_tokens"] is not None
        and kwargs["image_min_tokens"] > kwargs["image_max_tokens"]
    ):
        parser.error(
            f"--image-min-tokens {kwargs['image_min_tokens']} exceeds --image-max-tokens {kwargs['image_max_tokens']}"
        )
    core = {k: kwargs.pop(k) for k in ("model_path", "served_model_name", "server_host", "server_port", "api_key")}
    return ServerArgs(**core, extra=kwargs)
