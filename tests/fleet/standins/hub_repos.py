"""STAND-IN for the Hugging Face hub's model repositories of the model the field report deploys.

The real repositories hold ~22 GB (NVIDIA modelopt build) and ~26.5 GB (unsloth
compressed-tensors build) of weights; they cannot be fetched on CI machines or test hosts.
This module writes tiny, byte-for-byte deterministic look-alikes of them (same file names,
same config/quantisation JSON shapes, valid safetensors shards with real headers) so that
the downloader, the model checks and the engine stand-in see the same *format* as on a
real workstation:

* ``nvidia/Qwen3.6-35B-A3B-NVFP4`` - the supported build. NVIDIA ModelOpt export,
  ``quant_algo: MIXED_PRECISION``: routed experts ``W4A16_NVFP4`` (group size 16),
  attention projections ``FP8`` (per tensor, with input scale). The quantisation is in
  ``config.json`` -> ``quantization_config`` (``quant_method: modelopt``) and in the older
  sidecar ``hf_quant_config.json`` -> ``quantization`` (``producer: modelopt``).
* ``unsloth/Qwen3.6-35B-A3B-NVFP4`` - the unsupported build of the field report's pitfall 2.
  llm-compressor ``compressed-tensors`` export, ``format: mixed-precision``: the experts'
  ``down_proj`` are FP8 *per tensor* (``strategy: tensor``) and ``gate_proj``/``up_proj`` NVFP4
  (``strategy: tensor_group``, group 16). FreeToken 0.2.1 refuses it with
  ``NotImplementedError: no quant method for moe.fp8_tensor``.

Each repository has one fixed commit sha for revision ``main`` (``REPOS[...]["sha"]``), written
with the files into ``DIR/repos.json`` for the hub stand-in (hub.py) to serve.

Usage: ``python3 -m tests.fleet.standins.hub_repos build DIR``   (stdlib only)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys

SUPPORTED_REPO = "nvidia/Qwen3.6-35B-A3B-NVFP4"
UNSUPPORTED_REPO = "unsloth/Qwen3.6-35B-A3B-NVFP4"

# Fixed commit shas for revision "main" (sha1 of "freetoken-standin:<repo>@main").
REPOS = {
    SUPPORTED_REPO: {"sha": "5325a0a3e6268ff7f3f96210e660009f1496209e", "seed": 1919},
    UNSUPPORTED_REPO: {"sha": "23ffb9c866524f5f1b01f7a3f49b6f5d8cd2c59b", "seed": 2626},
}
MANIFEST = "repos.json"
LAST_MODIFIED = "2026-03-02T10:00:00.000Z"

# Tiny Qwen3-MoE geometry: big enough for shards of a few MiB, small enough to build in <1 s.
HIDDEN = 512
MOE_INTER = 256
NUM_EXPERTS = 8
NUM_LAYERS = 2
VOCAB = 2048
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 128
NUM_SHARDS = 3

_DTYPE_SIZE = {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()


def qwen_config(quantization_config: dict) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 2040,
        "eos_token_id": 2041,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": MOE_INTER * 2,
        "max_position_embeddings": 262144,
        "max_window_layers": NUM_LAYERS,
        "mlp_only_layers": [],
        "moe_intermediate_size": MOE_INTER,
        "norm_topk_prob": True,
        "num_attention_heads": HEADS,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": KV_HEADS,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "5.18.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
        "quantization_config": quantization_config,
    }


def _expert_names(layer: int):
    for e in range(NUM_EXPERTS):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield f"model.layers.{layer}.mlp.experts.{e}.{proj}", proj


def _attn_names(layer: int):
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        yield f"model.layers.{layer}.self_attn.{proj}", proj


def _proj_shape(proj: str) -> tuple[int, int]:
    return {
        "gate_proj": (MOE_INTER, HIDDEN),
        "up_proj": (MOE_INTER, HIDDEN),
        "down_proj": (HIDDEN, MOE_INTER),
        "q_proj": (HEADS * HEAD_DIM, HIDDEN),
        "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "o_proj": (HIDDEN, HEADS * HEAD_DIM),
    }[proj]


# ---------------------------------------------------------------- nvidia (modelopt)
MODELOPT_VERSION = "0.37.0"


def modelopt_quantized_layers() -> dict:
    layers = {}
    for layer in range(NUM_LAYERS):
        for name, _ in _attn_names(layer):
            layers[name] = {"quant_algo": "FP8"}
        for name, _ in _expert_names(layer):
            layers[name] = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    return layers


def modelopt_quant_config() -> dict:
    return {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                "targets": ["Linear"],
            },
            "group_1": {
                "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                "targets": ["Linear"],
            },
        },
        "ignore": ["lm_head", "model.layers.*.mlp.gate"],
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_scheme": None,
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quant_method": "modelopt",
        "quantized_layers": modelopt_quantized_layers(),
    }


def modelopt_hf_quant_config() -> dict:
    return {
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"],
            "quantized_layers": modelopt_quantized_layers(),
        },
    }


def modelopt_tensors(layer: int):
    """(name, dtype, shape) of one decoder layer in ModelOpt's storage names."""
    yield f"model.layers.{layer}.input_layernorm.weight", "BF16", [HIDDEN]
    yield f"model.layers.{layer}.post_attention_layernorm.weight", "BF16", [HIDDEN]
    yield f"model.layers.{layer}.self_attn.q_norm.weight", "BF16", [HEAD_DIM]
    yield f"model.layers.{layer}.self_attn.k_norm.weight", "BF16", [HEAD_DIM]
    for name, proj in _attn_names(layer):
        out, inp = _proj_shape(proj)
        yield f"{name}.weight", "F8_E4M3", [out, inp]
        yield f"{name}.weight_scale", "F32", []
        yield f"{name}.input_scale", "F32", []
    yield f"model.layers.{layer}.mlp.gate.weight", "BF16", [NUM_EXPERTS, HIDDEN]
    for name, proj in _expert_names(layer):
        out, inp = _proj_shape(proj)
        yield f"{name}.weight", "U8", [out, inp // 2]
        yield f"{name}.weight_scale", "F8_E4M3", [out, inp // 16]
        yield f"{name}.weight_scale_2", "F32", []


# ---------------------------------------------------------------- unsloth (compressed-tensors)
def compressed_tensors_quant_config() -> dict:
    return {
        "config_groups": {
            "group_0": {
                "format": "float-quantized",
                "input_activations": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": True,
                    "group_size": None,
                    "num_bits": 8,
                    "observer": None,
                    "observer_kwargs": {},
                    "strategy": "token",
                    "symmetric": True,
                    "type": "float",
                },
                "output_activations": None,
                "targets": [r"re:.*mlp\.experts\.\d+\.down_proj$"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": None,
                    "num_bits": 8,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": "tensor",
                    "symmetric": True,
                    "type": "float",
                },
            },
            "group_1": {
                "format": "nvfp4-pack-quantized",
                "input_activations": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": "local",
                    "group_size": 16,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": "tensor_group",
                    "symmetric": True,
                    "type": "float",
                },
                "output_activations": None,
                "targets": [r"re:.*mlp\.experts\.\d+\.(gate|up)_proj$"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": 16,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": "tensor_group",
                    "symmetric": True,
                    "type": "float",
                },
            },
        },
        "format": "mixed-precision",
        "global_compression_ratio": None,
        "ignore": ["lm_head", r"re:.*self_attn.*", r"re:.*mlp\.gate$"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.12.2",
    }


def compressed_tensors_tensors(layer: int):
    yield f"model.layers.{layer}.input_layernorm.weight", "BF16", [HIDDEN]
    yield f"model.layers.{layer}.post_attention_layernorm.weight", "BF16", [HIDDEN]
    yield f"model.layers.{layer}.self_attn.q_norm.weight", "BF16", [HEAD_DIM]
    yield f"model.layers.{layer}.self_attn.k_norm.weight", "BF16", [HEAD_DIM]
    for name, proj in _attn_names(layer):
        yield f"{name}.weight", "BF16", list(_proj_shape(proj))
    yield f"model.layers.{layer}.mlp.gate.weight", "BF16", [NUM_EXPERTS, HIDDEN]
    for name, proj in _expert_names(layer):
        out, inp = _proj_shape(proj)
        if proj == "down_proj":
            yield f"{name}.weight", "F8_E4M3", [out, inp]
            yield f"{name}.weight_scale", "F32", [1]
        else:
            yield f"{name}.weight_packed", "U8", [out, inp // 2]
            yield f"{name}.weight_scale", "F8_E4M3", [out, inp // 16]
            yield f"{name}.weight_global_scale", "F32", [1]
            yield f"{name}.input_global_scale", "F32", [1]


# ---------------------------------------------------------------- common files
def _shard_plan(layer_tensors) -> list[list[tuple[str, str, list[int]]]]:
    shards: list[list] = [[] for _ in range(NUM_SHARDS)]
    shards[0].append(("model.embed_tokens.weight", "BF16", [VOCAB, HIDDEN]))
    shards[0].extend(layer_tensors(0))
    shards[1].extend(layer_tensors(1))
    shards[2].append(("model.norm.weight", "BF16", [HIDDEN]))
    shards[2].append(("lm_head.weight", "BF16", [VOCAB, HIDDEN]))
    return shards


def safetensors_bytes(tensors, rng: random.Random) -> bytes:
    """A valid safetensors file: u64-LE header length, JSON header, then the raw data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        n = _DTYPE_SIZE[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)  # pad like the reference writer, to 8-byte alignment
    return struct.pack("<Q", len(hjson)) + hjson + rng.randbytes(offset)


def tokenizer_files() -> dict[str, bytes]:
    vocab = {}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = i
    words = ["Hello", "world", "token", "free", "model", "the", "a", "is", "of", "and"]
    i = 256
    for w in words:
        for form in (w, "Ġ" + w, w.lower(), "Ġ" + w.lower()):
            if form not in vocab:
                vocab[form] = i
                i += 1
    specials = [
        ("<|endoftext|>", 2040),
        ("<|im_start|>", 2041),
        ("<|im_end|>", 2042),
        ("<think>", 2043),
        ("</think>", 2044),
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": tid,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for text, tid in specials
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tid): {
                "content": text,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for text, tid in specials
        },
        "bos_token": None,
        "chat_template": (
            "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content"
            " + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
            "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        ),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    return {"tokenizer.json": _json_bytes(tokenizer), "tokenizer_config.json": _json_bytes(tokenizer_config)}


def generation_config() -> bytes:
    return _json_bytes(
        {
            "bos_token_id": 2040,
            "do_sample": True,
            "eos_token_id": [2042, 2040],
            "pad_token_id": 2040,
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
            "transformers_version": "5.18.0",
        }
    )


def repo_files(repo_id: str) -> dict[str, bytes]:
    """All files of one stand-in repository, name -> bytes (deterministic)."""
    spec = REPOS[repo_id]
    rng = random.Random(spec["seed"])
    if repo_id == SUPPORTED_REPO:
        quant, layer_tensors = modelopt_quant_config(), modelopt_tensors
    else:
        quant, layer_tensors = compressed_tensors_quant_config(), compressed_tensors_tensors
    files: dict[str, bytes] = {
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
        b"tokenizer.json filter=lfs diff=lfs merge=lfs -text\n",
        "README.md": (
            f"---\nlicense: apache-2.0\nbase_model: Qwen/Qwen3.6-35B-A3B\n---\n# {repo_id}\n\n"
            "STAND-IN repository generated by tests/fleet/standins/hub_repos.py "
            "(tiny random weights, real file layout).\n"
        ).encode(),
        "config.json": _json_bytes(qwen_config(quant)),
        "generation_config.json": generation_config(),
    }
    if repo_id == SUPPORTED_REPO:
        files["hf_quant_config.json"] = _json_bytes(modelopt_hf_quant_config())
    files.update(tokenizer_files())
    weight_map = {}
    total = 0
    for i, tensors in enumerate(_shard_plan(layer_tensors), start=1):
        shard = f"model-{i:05d}-of-{NUM_SHARDS:05d}.safetensors"
        data = safetensors_bytes(tensors, rng)
        files[shard] = data
        for name, dtype, shape in tensors:
            weight_map[name] = shard
            n = _DTYPE_SIZE[dtype]
            for d in shape:
                n *= d
            total += n
    files["model.safetensors.index.json"] = _json_bytes(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    )
    return files


def build(dest: str) -> dict:
    """Write every stand-in repository under DEST/<org>/<name>/ plus DEST/repos.json."""
    manifest = {"repos": {}}
    for repo_id, spec in REPOS.items():
        root = os.path.join(dest, *repo_id.split("/"))
        os.makedirs(root, exist_ok=True)
        files = repo_files(repo_id)
        for name, data in files.items():
            path = os.path.join(root, name)
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        manifest["repos"][repo_id] = {
            "sha": spec["sha"],
            "revisions": {"main": spec["sha"]},
            "lastModified": LAST_MODIFIED,
            "files": sorted(files),
        }
    with open(os.path.join(dest, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m tests.fleet.standins.hub_repos", description="Build the stand-in hub repositories."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the repositories under DIR")
    b.add_argument("dir")
    args = parser.parse_args(argv)
    manifest = build(args.dir)
    for repo_id, info in manifest["repos"].items():
        print(f"{repo_id} @ {info['sha']}: {len(info['files'])} files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
