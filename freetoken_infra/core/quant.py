"""Which quantisation a model checkpoint uses, and whether FreeToken can run it.

Pure stdlib code: the model facts, the preflight rules and the model downloader
(which runs on the target with the system python3, before any weight is fetched)
all use it, so the decision lives in one place.

Pitfall 2 of the field report: FreeToken's MoE quant registry has none / fp8_block /
mxfp4 / mxfp8 / nvfp4 / gguf; per-tensor or per-channel FP8 experts fail at start
with ``NotImplementedError: no quant method for moe.fp8_tensor``.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Literal

SUPPORTED_EXPERT_SCHEMES = frozenset({"nvfp4", "fp8_block", "mxfp4", "mxfp8", "unquantized", "gguf"})


@dataclass(frozen=True)
class QuantSummary:
    source: Literal["config.json", "hf_quant_config.json"] | None
    method: str | None
    algo: str | None
    expert_schemes: frozenset[str]
    other_schemes: frozenset[str]


# A module path that is (part of) the routed MoE experts: ``...mlp.experts`` or
# ``...mlp.experts.3.down_proj``; not ``shared_expert`` / ``shared_experts`` (dense MLPs).
_EXPERT_RE = re.compile(r"(^|[.*:/])experts($|[.*\\\[])")

_MODELOPT_ALGOS = {
    "NVFP4": "nvfp4",
    "W4A16_NVFP4": "nvfp4",
    "NVFP4_AWQ": "nvfp4",
    "W4A8_NVFP4_FP8": "nvfp4",
    "FP8": "fp8_tensor",
    "FP8_PER_CHANNEL_PER_TOKEN": "fp8_channel",
    "FP8_PB_WO": "fp8_block",
    "FP8_BLOCK": "fp8_block",
    "MXFP4": "mxfp4",
    "MXFP8": "mxfp8",
    "W4A16_AWQ": "w4a16",
    "INT4_AWQ": "w4a16",
    "W4A8_AWQ": "int4",
}


def is_expert_name(name: str) -> bool:
    """Whether a layer name or target pattern refers to routed MoE experts."""
    return bool(_EXPERT_RE.search(name))


def modelopt_scheme(algo: object) -> str:
    if algo is None:
        return "unquantized"
    raw = str(algo)
    return _MODELOPT_ALGOS.get(raw.upper(), f"unknown:{raw}")


def compressed_tensors_scheme(group: dict[str, Any], fmt: str | None) -> str:
    """Name the scheme of one compressed-tensors ``config_groups`` entry."""
    weights = group.get("weights")
    fmt = (group.get("format") or fmt or "").lower()
    if not isinstance(weights, dict):
        return "unquantized"
    bits = weights.get("num_bits")
    kind = str(weights.get("type") or "").lower()
    strategy = str(weights.get("strategy") or "").lower()
    group_size = weights.get("group_size")
    if fmt.startswith("nvfp4"):
        return "nvfp4"
    if fmt.startswith("mxfp4"):
        return "mxfp4"
    if kind == "float" and bits == 4:
        return "mxfp4" if group_size == 32 and strategy == "group" else "nvfp4"
    if kind == "float" and bits == 8:
        if strategy in ("tensor", "channel", "block"):
            return f"fp8_{strategy}"
        if strategy == "group" and group_size == 32:
            return "mxfp8"
        return f"unknown:fp8-{strategy or 'none'}"
    if kind == "int" and bits == 4:
        return "w4a16" if not group.get("input_activations") else "int4"
    return f"unknown:{fmt or kind}{bits}-{strategy}"


def _summarize_modelopt(cfg: dict[str, Any]) -> tuple[str | None, set[str], set[str]]:
    algo = cfg.get("quant_algo")
    expert: set[str] = set()
    other: set[str] = set()
    layers = cfg.get("quantized_layers")
    if str(algo).upper() == "MIXED_PRECISION" or isinstance(layers, dict):
        for name, spec in (layers or {}).items():
            scheme = modelopt_scheme(spec.get("quant_algo") if isinstance(spec, dict) else None)
            (expert if is_expert_name(name) else other).add(scheme)
        if not expert:
            # Experts not listed: modelopt lists every quantised layer, so they stay unquantised.
            expert.add("unquantized")
        return (str(algo) if algo is not None else None), expert, other
    scheme = modelopt_scheme(algo)
    excludes = [str(p) for p in (cfg.get("exclude_modules") or cfg.get("ignore") or [])]
    expert_excluded = any(
        is_expert_name(p) or fnmatch.fnmatch("model.layers.0.mlp.experts.0.down_proj", p) for p in excludes
    )
    expert.add("unquantized" if expert_excluded else scheme)
    other.add(scheme)
    if any(not is_expert_name(p) for p in excludes):
        other.add("unquantized")
    return (str(algo) if algo is not None else None), expert, other


def _summarize_compressed_tensors(cfg: dict[str, Any]) -> tuple[str | None, set[str], set[str]]:
    fmt = cfg.get("format")
    expert: set[str] = set()
    other: set[str] = set()
    generic: set[str] = set()
    for group in (cfg.get("config_groups") or {}).values():
        if not isinstance(group, dict):
            continue
        scheme = compressed_tensors_scheme(group, fmt)
        targets = [str(t) for t in group.get("targets") or []]
        if any(is_expert_name(t) for t in targets):
            expert.add(scheme)
        if any(not is_expert_name(t) for t in targets):
            other.add(scheme)
            if any(t == "Linear" or not t.startswith("re:") for t in targets):
                generic.add(scheme)
    ignores = [str(p) for p in cfg.get("ignore") or []]
    if not expert:
        # Experts covered only by a generic target ("Linear"), unless ignored.
        expert = {"unquantized"} if any(is_expert_name(p) for p in ignores) or not generic else set(generic)
    if ignores and any(not is_expert_name(p) for p in ignores):
        other.add("unquantized")
    return (str(fmt) if fmt is not None else None), expert, other


def _summarize_quantization_config(qc: dict[str, Any]) -> tuple[str | None, str | None, set[str], set[str]]:
    method = qc.get("quant_method")
    method_s = str(method) if method is not None else None
    lowered = (method_s or "").lower()
    if lowered == "compressed-tensors" or "config_groups" in qc and lowered != "modelopt":
        algo, expert, other = _summarize_compressed_tensors(qc)
        return method_s, algo, expert, other
    if lowered == "modelopt" or "quant_algo" in qc:
        algo, expert, other = _summarize_modelopt(qc)
        return method_s or "modelopt", algo, expert, other
    if lowered == "fp8":
        scheme = "fp8_block" if qc.get("weight_block_size") else "fp8_tensor"
        other = {scheme} | ({"unquantized"} if qc.get("modules_to_not_convert") else set())
        return method_s, None, {scheme}, other
    if lowered in ("mxfp4", "mxfp8"):
        # gpt-oss style: experts quantised, the rest listed in modules_to_not_convert.
        return method_s, None, {lowered}, {"unquantized"}
    scheme = f"unknown:{method_s}"
    return method_s, None, {scheme}, {scheme}


def summarize_quant(config: dict[str, Any], hf_quant_config: dict[str, Any] | None) -> QuantSummary:
    """Summarise a checkpoint's quantisation the way FreeToken reads it.

    ``config.json`` → ``quantization_config`` (top level, else under ``text_config``) wins;
    only if absent, ``hf_quant_config.json`` → ``quantization`` (modelopt's legacy file).
    Without either the model is unquantised.
    """
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict):
        text_config = config.get("text_config") if isinstance(config, dict) else None
        qc = text_config.get("quantization_config") if isinstance(text_config, dict) else None
    if isinstance(qc, dict):
        method, algo, expert, other = _summarize_quantization_config(qc)
        return QuantSummary("config.json", method, algo, frozenset(expert), frozenset(other))
    if isinstance(hf_quant_config, dict) and isinstance(hf_quant_config.get("quantization"), dict):
        algo, expert, other = _summarize_modelopt(hf_quant_config["quantization"])
        producer = hf_quant_config.get("producer")
        method = str(producer.get("name")) if isinstance(producer, dict) and producer.get("name") else "modelopt"
        return QuantSummary("hf_quant_config.json", method, algo, frozenset(expert), frozenset(other))
    return QuantSummary(None, None, None, frozenset({"unquantized"}), frozenset({"unquantized"}))


# --------------------------------------------------------------------------- model directory


def unsupported_expert_schemes(quant: QuantSummary) -> set[str]:
    """Expert schemes FreeToken 0.2.1 has no MoE method for (empty when supported)."""
    return {s for s in quant.expert_schemes if s not in SUPPORTED_EXPERT_SCHEMES}
