"""Root's reads in the model folder never follow what the download's user planted.

``model_dir`` belongs to ``freetoken-fetch``, the account that talks to the hub; the facts that
read it, the health gate's manifest hash and the verify suite's re-hash run as root. A temporary
folder stands in for it, and the attacks are what that account could plant: a link to a root
secret as ``config.json``, a FIFO as the manifest, a link as a shard. The host-side commands run
as the hosts run them (the facts' commands under ``sh``, the verify probe under ``python3 -c``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pyinfra.api.command import StringCommand
from pyinfra.connectors.util import CommandOutput, OutputLine

from facts.model import ModelDirectory
from facts.model_manifest import MANIFEST_NAME, ModelManifest
from freetoken_infra import rules
from freetoken_infra.core.settings import Settings
from operations.health import GateInputs, HostGate
from tests.verify.probes import MODEL_HASH_SCRIPT

SECRET = b'{"api_key": "sk-ROOT-ONLY-7f3a", "architectures": ["LeakedModel"]}\n'
REPO, REVISION = "nvidia/Qwen3.6-35B-A3B-NVFP4", "main"
SHARD = "model-00001-of-00001.safetensors"


def sh(command: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=timeout)


def fact_answer(fact, **kwargs):
    """The fact's command run under sh as on a host (promptly, or the test fails): its raw
    output and its answer."""
    run = sh(fact.command(**kwargs))
    assert run.returncode == 0, run.stderr
    return run.stdout + run.stderr, fact.process(run.stdout.splitlines())


def appears(secret: bytes, text: str) -> bool:
    """The secret, or its base64 (as a fact's output carries bytes), or its hash, in ``text``."""
    flat = text.replace("\n", "")
    return any(
        needle in flat
        for needle in (
            secret.decode(),
            base64.b64encode(secret).decode(),
            hashlib.sha256(secret).hexdigest()[:16],
        )
    )


@pytest.fixture
def model(tmp_path):
    """A complete, verified download as the downloader leaves it, and a root-only secret beside."""
    folder = tmp_path / "models" / "Qwen3.6-35B-A3B-NVFP4-nvidia"
    folder.mkdir(parents=True)
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    (folder / "config.json").write_text(json.dumps(config))
    shard = folder / SHARD
    shard.write_bytes(b"\0" * 4096)
    files = {}
    for path in (folder / "config.json", shard):
        data = path.read_bytes()
        files[path.name] = {
            "size": len(data),
            "mtime_ns": path.stat().st_mtime_ns,
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    doc = {"repo": REPO, "revision": REVISION, "commit": "c" * 40, "complete": True, "files": files}
    (folder / MANIFEST_NAME).write_text(json.dumps(doc))
    secret = tmp_path / "root-only-key"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    assert os.path.realpath(tmp_path) == str(tmp_path), "the test's own folder must have no link on the way"
    return folder, secret


def test_the_untouched_model_reads_as_before(model):
    folder, _ = model
    _, info = fact_answer(ModelDirectory(), path=str(folder))
    assert info.error is None and info.config["model_type"] == "qwen3_moe" and info.files[SHARD] == 4096
    _, seen = fact_answer(ModelManifest(), model_dir=str(folder))
    assert seen.covers(REPO, REVISION) == (True, "complete")
    assert seen.sha256 == hashlib.sha256((folder / MANIFEST_NAME).read_bytes()).hexdigest()


def test_a_link_as_config_json_brings_no_secret_and_is_refused_naming_it(model):
    folder, secret = model
    for name in ("config.json", "hf_quant_config.json"):
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(secret)
    raw, info = fact_answer(ModelDirectory(), path=str(folder))
    assert not appears(SECRET, raw) and not appears(SECRET, repr(info))
    assert info.config is None and info.quant is None
    assert f"{folder}/config.json is a symbolic link" in (info.error or "")
    assert f"{folder}/hf_quant_config.json is a symbolic link" in (info.error or "")
    # The preflight warns naming it, and the deploy fetches the model again (not covered).
    finding = rules.check_model(Settings(model_dir=str(folder)), _observations(info))
    assert finding.status == "warn" and "config.json is a symbolic link" in finding.evidence
    _, seen = fact_answer(ModelManifest(), model_dir=str(folder))
    assert seen.covers(REPO, REVISION) == (False, f"config.json is missing from {folder}")


def test_a_fifo_as_the_manifest_answers_promptly_and_says_fifo(model):
    folder, _ = model
    (folder / MANIFEST_NAME).unlink()
    os.mkfifo(folder / MANIFEST_NAME)
    started = time.monotonic()
    _, seen = fact_answer(ModelManifest(), model_dir=str(folder))
    assert time.monotonic() - started < 20
    assert seen.manifest is None and seen.sha256 is None
    assert seen.error == f"{folder}/{MANIFEST_NAME} is a FIFO"
    assert seen.covers(REPO, REVISION) == (False, f"{folder}/{MANIFEST_NAME} is a FIFO")
    # The health gate's record hashes the manifest the same way: none, and no wait.
    gate = HostGate(None, _LocalHost(), GateInputs(Settings(model_dir=str(folder)), None))
    assert gate.manifest_hash() is None


def test_a_link_as_the_manifest_is_neither_read_nor_hashed(model):
    folder, secret = model
    (folder / MANIFEST_NAME).unlink()
    (folder / MANIFEST_NAME).symlink_to(secret)
    raw, seen = fact_answer(ModelManifest(), model_dir=str(folder))
    assert not appears(SECRET, raw) and seen.sha256 is None
    assert seen.covers(REPO, REVISION) == (False, f"{folder}/{MANIFEST_NAME} is a symbolic link")
    gate = HostGate(None, _LocalHost(), GateInputs(Settings(model_dir=str(folder)), None))
    assert gate.manifest_hash() is None


def test_a_link_as_a_shard_is_neither_listed_nor_hashed(model, tmp_path):
    folder, secret = model
    (folder / SHARD).unlink()
    (folder / SHARD).symlink_to(secret)
    raw, info = fact_answer(ModelDirectory(), path=str(folder))
    assert SHARD not in info.files and not appears(SECRET, raw)
    _, seen = fact_answer(ModelManifest(), model_dir=str(folder))
    assert seen.covers(REPO, REVISION) == (False, f"{SHARD} is missing from {folder}")
    hashed = _verify_hash(folder)
    assert hashed["bad"] == [f"{folder}/{SHARD} is a symbolic link"]
    assert not appears(SECRET, json.dumps(hashed))
    # A FIFO there is refused too, and never waited on.
    (folder / SHARD).unlink()
    os.mkfifo(folder / SHARD)
    assert _verify_hash(folder)["bad"] == [f"{folder}/{SHARD} is a FIFO"]


def test_the_verify_probe_still_finds_a_changed_shard(model):
    folder, _ = model
    (folder / SHARD).write_bytes(b"\1" * 4096)
    bad = _verify_hash(folder)["bad"]
    assert len(bad) == 1 and bad[0].startswith(f"{SHARD}: content hash ")


def _verify_hash(folder: Path) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", MODEL_HASH_SCRIPT, str(folder)], capture_output=True, text=True, timeout=20
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def _observations(model_info) -> rules.Observations:
    from tests.unit.test_rules import healthy

    return healthy(model=model_info)


class _LocalHost:
    """Just enough of a pyinfra Host for the gate's manifest hash: this machine's shell, with a
    timeout (a hash that waits on a FIFO fails the test instead of hanging it)."""

    name = "ws1"
    print_prefix = "[ws1] "

    def run_shell_command(self, command, **_arguments):
        text = command.get_raw_value() if isinstance(command, StringCommand) else str(command)
        proc = subprocess.run(["sh", "-c", text], capture_output=True, text=True, timeout=20)
        lines = [OutputLine("stdout", line) for line in proc.stdout.splitlines()]
        return proc.returncode == 0, CommandOutput(lines)
