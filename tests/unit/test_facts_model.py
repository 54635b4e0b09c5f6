import json
import shutil
import subprocess
from pathlib import Path

import pytest

from facts.model import ModelDirectory, parse_model_dir_output
from freetoken_infra.core.quant import summarize_quant

MODELS = Path(__file__).parent.parent / "fixtures" / "real" / "models"


def load(name):
    d = MODELS / name
    cfg = json.loads((d / "config.json").read_text())
    hf = d / "hf_quant_config.json"
    return cfg, (json.loads(hf.read_text()) if hf.exists() else None)


def test_nvidia_modelopt_mixed_precision():
    q = summarize_quant(*load("nvidia-Qwen3.6-35B-A3B-NVFP4"))
    assert (q.source, q.method, q.algo) == ("config.json", "modelopt", "MIXED_PRECISION")
    assert q.expert_schemes == {"nvfp4"}
    assert q.other_schemes == {"nvfp4", "fp8_tensor"}  # shared_expert/lm_head W4A16_NVFP4, attention FP8


def test_mixed_precision_from_legacy_sidecar_only():
    cfg, hf = load("nvidia-Qwen3.6-35B-A3B-NVFP4")
    del cfg["quantization_config"]
    q = summarize_quant(cfg, hf)
    assert (q.source, q.method, q.algo) == ("hf_quant_config.json", "modelopt", "MIXED_PRECISION")
    assert q.expert_schemes == {"nvfp4"}


def test_nvidia_legacy_nvfp4():
    q = summarize_quant(*load("nvidia-Qwen3-30B-A3B-NVFP4"))
    assert (q.source, q.algo) == ("hf_quant_config.json", "NVFP4")
    assert q.expert_schemes == {"nvfp4"} and q.other_schemes == {"nvfp4", "unquantized"}


def test_unsloth_compressed_tensors_has_fp8_tensor_experts():
    q = summarize_quant(*load("unsloth-Qwen3.6-35B-A3B-NVFP4"))
    assert (q.source, q.method, q.algo) == ("config.json", "compressed-tensors", "mixed-precision")
    assert q.expert_schemes == {"fp8_tensor", "nvfp4"}
    assert q.other_schemes == {"unquantized"}


def test_compressed_tensors_fp8_channel_linear():
    q = summarize_quant(*load("RedHatAI-Qwen3-30B-A3B-FP8-dynamic"))
    assert q.expert_schemes == {"fp8_channel"} and q.other_schemes == {"fp8_channel", "unquantized"}


def test_fine_grained_fp8():
    q = summarize_quant(*load("Qwen-Qwen3-30B-A3B-FP8"))
    assert q.method == "fp8" and q.expert_schemes == {"fp8_block"}


def test_mxfp4():
    q = summarize_quant(*load("openai-gpt-oss-20b"))
    assert q.expert_schemes == {"mxfp4"} and q.other_schemes == {"unquantized"}


def test_unquantized():
    q = summarize_quant(*load("Qwen-Qwen3-30B-A3B"))
    assert q.source is None and q.expert_schemes == {"unquantized"}


def test_text_config_location_and_precedence():
    cfg = {"text_config": {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}}
    hf = {"quantization": {"quant_algo": "NVFP4"}}
    q = summarize_quant(cfg, hf)
    assert q.source == "config.json" and q.expert_schemes == {"fp8_tensor"}


def test_unknown_scheme_kept_raw():
    q = summarize_quant({"quantization_config": {"quant_method": "awq", "bits": 4}}, None)
    assert q.expert_schemes == {"unknown:awq"}
    q = summarize_quant(
        {"quantization_config": {"quant_method": "modelopt", "quant_algo": "W8A8_SQ_PER_CHANNEL"}}, None
    )
    assert q.expert_schemes == {"unknown:W8A8_SQ_PER_CHANNEL"}


@pytest.mark.parametrize(
    "name,expected",
    [
        ("model.layers.0.mlp.experts", True),
        ("model.layers.0.mlp.experts.7.down_proj", True),
        (r"re:.*mlp\.experts\.\d+\.down_proj$", True),
        ("model.layers.*.mlp.experts*", True),
        ("model.layers.0.mlp.shared_expert.up_proj", False),
        ("model.layers.0.mlp.shared_experts.up_proj", False),
        ("model.layers.0.mlp.gate", False),
        ("lm_head", False),
    ],
)
def test_expert_names(name, expected):
    # Routed experts only: shared_expert(s) are dense MLPs, mlp.gate is the router.
    cfg = {
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "MIXED_PRECISION",
            "quantized_layers": {name: {"quant_algo": "FP8"}},
        }
    }
    q = summarize_quant(cfg, None)
    assert ("fp8_tensor" in q.expert_schemes) is expected
    assert ("fp8_tensor" in q.other_schemes) is (not expected)


def run_fact(path):
    fact = ModelDirectory()
    proc = subprocess.run(["sh", "-c", fact.command(str(path))], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return fact.process(proc.stdout.splitlines())


def test_command_on_model_dir(tmp_path):
    model = tmp_path / "Qwen3.6-35B-A3B-NVFP4-nvidia"
    shutil.copytree(MODELS / "nvidia-Qwen3.6-35B-A3B-NVFP4", model)
    (model / "model-00001-of-00003.safetensors").write_bytes(b"\0" * 100)
    (model / ".cache" / "huggingface").mkdir(parents=True)
    (model / ".cache" / "huggingface" / "x.lock").write_text("")
    (model / "sub").mkdir()
    (model / "sub" / "a.bin").write_bytes(b"12345")
    info = run_fact(model)
    assert info.exists and info.error is None
    assert info.files["model-00001-of-00003.safetensors"] == 100 and info.files["sub/a.bin"] == 5
    assert not any(name.startswith(".cache") for name in info.files)
    assert info.quant.expert_schemes == {"nvfp4"}
    assert info.config["model_type"] == "qwen3_5_moe"


def test_command_broken_json(tmp_path):
    shutil.copytree(MODELS / "broken-config", tmp_path / "m")
    info = run_fact(tmp_path / "m")
    assert info.exists and info.quant is None and "config.json is not valid JSON" in info.error


def test_command_missing_dir_and_missing_config(tmp_path):
    info = run_fact(tmp_path / "absent")
    assert not info.exists and info.error is None and info.path == str(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    info = run_fact(tmp_path / "empty")
    assert info.exists and info.files == {} and info.error is None and info.quant is None


def test_empty_output():
    assert ModelDirectory.default().error == "no output"
    assert parse_model_dir_output("/m", []).exists is False
