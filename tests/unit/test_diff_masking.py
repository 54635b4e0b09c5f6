"""``--dry --diff`` prints no secret, in any file the deploy writes.

The masking itself (freetoken_infra/core/redact.py), then the real pyinfra CLI in ``--dry --diff``
on this machine (@local) running our real operations over files that already hold older
secrets: pip.conf with index credentials, the API key file, the model fetch unit with a hub
endpoint's credentials, a file holding the controller's engine key. Nothing is written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from freetoken_infra.core import redact

ROOT = Path(__file__).resolve().parents[2]


def test_mask_text_hides_every_kind_of_secret_and_keeps_the_rest():
    text = (
        "index-url = https://builder:PW-index@mirror.example/simple\n"
        "extra-index-url = https://a:PW-x1@one.example/s https://b:PW-x2@two.example/s\n"
        "HF_ENDPOINT=https://hub:PW-hub@hub.example\n"
        "FREETOKEN_API_KEY=PW-engine-key\n"
        'http-request set-header Authorization "Bearer PW-bearer"\n'
        "ExecStart=/usr/bin/python3 fetch_model.py --endpoint https://hub:PW-argv@hub.example\n"
        "LOG_LEVEL=info\n"
    )
    masked = redact.mask_text(text)
    assert "PW-" not in masked, masked
    assert "LOG_LEVEL=info\n" in masked and "https://builder:********@mirror.example/simple" in masked


def test_a_remembered_secret_is_masked_wherever_it_lands():
    redact.remember("k3y-read-on-the-controller")
    assert redact.mask_text("ws1 k3y-read-on-the-controller\n") == "ws1 ********\n"


def test_a_changed_secret_still_shows_as_a_change():
    before, after = redact.mask_lines(
        ["index-url = https://u:OLD-pw@m.example/s\n"], ["index-url = https://u:NEW-pw@m.example/s\n"]
    )
    assert before == ["index-url = https://u:********@m.example/s\n"]
    assert after == ["index-url = https://u:********@m.example/s (secret changed)\n"]


def test_redact_argv_masks_password_options_urls_and_secret_data():
    argv = ["/x/pyinfra", "--ssh-password", "PW1", "--ssh-key-password=PW2", "--data", "hub_token=PW3",
            "--data", "hub_endpoint=https://u:PW4@h.example", "inv.py", "--limit", "ws1"]  # fmt: skip
    out = redact.redact_argv(argv)
    assert out[0] == "pyinfra" and not any("PW" in w for w in out), out
    assert out[-2:] == ["--limit", "ws1"] and "inv.py" in out


DIFF_DEPLOY = """
import io, os
from pyinfra.operations import files
from freetoken_infra.core.settings import Settings
from operations import engine, model, service
tmp = os.environ["FT_TMP"]
settings = Settings(
    engine_base_dir=f"{tmp}/opt", config_dir=f"{tmp}/etc", state_dir=f"{tmp}/state",
    model_dir=f"{tmp}/state/models/m", api_key_source="env:FT_ENGINE_KEY",
    pip_index_url="https://builder:NEW-pip-pw@mirror.example/simple",
    hub_endpoint="https://hubuser:NEW-hub-pw@hub.example",
)
# engine.environment puts this text with files.put once the venv is built (pyinfra's dry run
# shows an operation's changes up to its first command, the venv's creation, so it is put here)
files.put(name="pip.conf", src=io.StringIO(engine.pip_conf(settings)), dest=os.environ["FT_PIP_CONF"])
service.api_key(name="key", settings=settings)
files.put(name="fetch unit", src=io.StringIO(model.fetch_unit(settings)), dest=f"{tmp}/fetch.service")
files.put(name="a file with the engine key", src=io.StringIO("ws1 " + os.environ["FT_ENGINE_KEY"] + "\\n"),
          dest=f"{tmp}/engine-keys.map")
"""


def test_dry_diff_of_real_operations_prints_no_secret_old_or_new(tmp_path):
    from freetoken_infra.core.layout import HostLayout
    from freetoken_infra.core.settings import Settings

    venv = Path(HostLayout.of(Settings(engine_base_dir=f"{tmp_path}/opt")).engine_venv_for("0.2.1"))
    venv.mkdir(parents=True)
    (venv / "pip.conf").write_text("[global]\nindex-url = https://builder:OLD-pip-pw@mirror.example/simple\n")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "api-key.env").write_text("FREETOKEN_API_KEY=OLD-engine-key-0123\n")
    (tmp_path / "fetch.service").write_text("ExecStart=/x --endpoint https://hubuser:OLD-hub-pw@hub.example\n")
    (tmp_path / "engine-keys.map").write_text("ws1 OLD-engine-key-0123\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    deploy = tmp_path / "diff_deploy.py"
    deploy.write_text(DIFF_DEPLOY)
    env = {
        **os.environ,
        "FT_TMP": str(tmp_path),
        "FT_PIP_CONF": str(venv / "pip.conf"),
        "FT_ENGINE_KEY": "NEW-engine-key-4567",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    run = subprocess.run(
        [str(Path(sys.executable).with_name("pyinfra")), "--dry", "--diff", "@local", str(deploy)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=env,
        timeout=300,
    )
    out = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout + run.stderr)
    print(out)
    assert run.returncode == 0, out
    for shown in ("pip.conf", "api-key.env", "fetch.service", "engine-keys.map"):
        assert f"Will modify {tmp_path}" in out and shown in out, shown
    for secret in ("OLD-pip-pw", "NEW-pip-pw", "OLD-engine-key", "NEW-engine-key", "OLD-hub-pw", "NEW-hub-pw"):
        assert secret not in out, secret
    assert "(secret changed)" in out  # the change of a masked value still shows
    assert {p: p.read_bytes() for p in before} == before


def test_hub_endpoint_credentials_are_in_no_process_argument_and_no_journal_line(monkeypatch, capsys):
    """The fetch unit's ExecStart= becomes the downloader's process arguments, readable by every
    local user in /proc: an endpoint with a user:password reaches it through the unit's root-only
    environment file instead, and the downloader's log lines drop it."""
    import importlib.util

    from freetoken_infra.core.settings import Settings
    from operations import model

    s = Settings(hub_endpoint="https://hubuser:PW-hub@hub.example")
    unit = model.fetch_unit(s)
    exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert "PW-hub" not in unit and "--endpoint" not in exec_line
    assert f"EnvironmentFile={model.fetch_env_path(s)}" in unit.splitlines()
    plain = model.fetch_unit(Settings(hub_endpoint="https://hub.example"))
    assert "--endpoint https://hub.example " in plain and "model-fetch.env" not in plain

    spec = importlib.util.spec_from_file_location("fetch_model_script", ROOT / "operations/scripts/fetch_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setenv("HF_ENDPOINT", "https://hubuser:PW-hub@hub.example")
    assert script.parse_args(["--repo", "o/n", "--dest", "/tmp/m"]).endpoint == "https://hubuser:PW-hub@hub.example"
    script.log("listing on https://hubuser:PW-hub@hub.example/api")
    assert capsys.readouterr().err == "fetch_model: listing on https://hub.example/api\n"
