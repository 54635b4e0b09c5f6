"""Settings: defaults are the field report's, bad input names host and field."""

import runpy
from pathlib import Path

import pytest

from freetoken_infra.core.settings import Settings, SettingsError, build_settings

ROOT = Path(__file__).resolve().parents[2]


def group_data(name: str) -> dict:
    data = runpy.run_path(str(ROOT / "group_data" / f"{name}.py"))
    return {k: v for k, v in data.items() if not k.startswith("__")}


def test_the_defaults_are_the_field_report():
    s = Settings()
    assert s.engine_requirement == "freetoken[accel]==0.2.1"
    assert s.served_model_name == "Qwen3.6-35B-A3B-NVFP4-nvidia"
    assert s.wslconfig_values() == {
        "memory": "24GB",
        "processors": "8",
        "swap": "4GB",
        "localhostForwarding": "true",
        "vmIdleTimeout": "0",
    }


def test_group_data_holds_only_choices_that_differ_from_the_defaults():
    """Each default has one home (Settings): a group_data value equal to it is a second copy."""
    defaults = Settings()
    for path in sorted((ROOT / "group_data").glob("*.py")):
        data = group_data(path.stem)
        build_settings("ws1", data)
        copies = [k for k, v in data.items() if getattr(build_settings("ws1", {k: v}), k) == getattr(defaults, k)]
        assert not copies, f"{path.name} repeats the default of {copies}"


def test_every_setting_has_a_one_line_description():
    for name, field in Settings.model_fields.items():
        assert field.description and "\n" not in field.description, name


def test_the_readme_settings_table_is_current():
    from freetoken_infra.core.settings import readme_with_table

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme_with_table(readme) == readme, (
        "README.md's settings table is stale: run `.venv/bin/python -m freetoken_infra.core.settings`"
    )


@pytest.mark.parametrize("name", ["rtx5060ti_16gb", "rtx5090_32gb"])
def test_every_hardware_class_file_validates(name):
    build_settings("ws1", {**group_data("all"), **group_data(name)})


def test_pyinfra_connector_and_operation_keys_are_not_ours_to_reject():
    s = build_settings("ws1", {"ssh_hostname": "10.0.0.1", "ssh_user": "root", "_sudo": True, "listen_port": 8001})
    assert s.listen_port == 8001


MALFORMED = [
    ({"listen_port": "eighty"}, "listen_port", "'eighty'"),
    ({"listen_port": 70000}, "listen_port", "65534"),
    ({"lisen_port": 8000}, "lisen_port", "did you mean 'listen_port'"),
    ({"model_size_gb": -22}, "model_size_gb", "greater than 0"),
    ({"guard_swap_limit_gb": -1}, "guard_swap_limit_gb", "greater than 0"),
    ({"hub_endpoint": "not a url"}, "hub_endpoint", "URL"),
    ({"pip_index_url": "ftp//mirror"}, "pip_index_url", "URL"),
    ({"hardware_profile": "rtx9090_64gb"}, "hardware_profile", "rtx5060ti_16gb"),
    ({"wslconfig_memory": "24 gigs"}, "wslconfig_memory", "24GB"),
    ({"engine_version": "latest"}, "engine_version", "0.2.1"),
    ({"model_repo": "Qwen3.6"}, "model_repo", "owner/name"),
    ({"model_dir": "models/qwen"}, "model_dir", "absolute path"),
    ({"cuda_packages": ["cuda-nvcc-13-0", "cuda-drivers"]}, "cuda_packages", "never be installed inside WSL"),
    ({"service_user": "root"}, "service_user", "non-root"),
    ({"launch_moe_cache_size": "lots"}, "launch_moe_cache_size", "'lots'"),
    ({"launch_attention_backend": "attn"}, "launch_attention_backend", "triton"),
    ({"api_key_source": "sk-123"}, "api_key_source", "generate"),
    ({"wslconfig_processors": 2.5}, "wslconfig_processors", "integer"),
    # Across two fields: the error names the field and its value, not every setting.
    ({"model_expert_ram_gb": 30}, "model_expert_ram_gb", "cannot exceed model_size_gb (22)"),
    ({"model_size_gb": 10}, "model_expert_ram_gb", "= 16.9 is invalid: cannot exceed model_size_gb (10)"),
]


@pytest.mark.parametrize("data,field,allowed", MALFORMED, ids=[m[1] for m in MALFORMED])
def test_malformed_setting_gives_one_clear_error_naming_host_and_field(data, field, allowed):
    with pytest.raises(SettingsError) as exc:
        build_settings("ws7", {**group_data("all"), **data})
    problems = exc.value.problems
    assert len(problems) == 1, problems
    line = problems[0]
    assert line.startswith("host ws7: ")
    assert f"'{field}'" in line
    assert allowed in line
    assert "(settings)" not in line and "{" not in line, "one field and its value, not the whole dict"
    assert "nothing was changed" in str(exc.value)


def test_every_malformed_setting_of_a_host_is_reported_at_once():
    """The table's single-field cases together in one host's data: one line for each field,
    each naming it, not only the first found (the cross-field cases each need the others right)."""
    first: dict[str, dict] = {}
    for data, field, _ in MALFORMED:
        if field != "model_expert_ram_gb":
            first.setdefault(field, data)  # one value per field
    single = list(first.items())
    together = {k: v for _, data in single for k, v in data.items()}
    assert len(together) == len(single) >= 8, "each case sets its own field alone"
    with pytest.raises(SettingsError) as exc:
        build_settings("ws7", {**group_data("all"), **together})
    problems = exc.value.problems
    assert len(problems) == len(single), problems
    for field, _ in single:
        assert sum(1 for line in problems if f"'{field}'" in line.split(" = ", 1)[0]) == 1, (field, problems)


def test_an_error_line_echoes_no_secret_it_was_given():
    # A password in an index URL that is invalid for another reason (here: not http or https).
    with pytest.raises(SettingsError) as exc:
        build_settings("ws1", {"pip_index_url": "ftp://builder:hunter2-pw@mirror.lan/simple"})
    assert "pip_index_url" in str(exc.value) and "hunter2-pw" not in str(exc.value), exc.value
    # A secret under an unknown secret-like name (a token put in the inventory): named, value masked.
    with pytest.raises(SettingsError) as exc:
        build_settings("ws1", {"hf_token": "hf_live_secret_123456"})
    assert "'hf_token'" in str(exc.value) and "hf_live_secret_123456" not in str(exc.value), exc.value
    # Values that only say where a secret is stay readable, so the line still helps.
    with pytest.raises(SettingsError) as exc:
        build_settings("ws1", {"api_key_source": "file:relative/key"})
    assert "file:relative/key" in str(exc.value)


def test_launch_overrides_are_validated():
    s = build_settings("ws1", {"launch_moe_cache_size": 128, "launch_num_tokens": 2048})
    assert (s.launch_moe_cache_size, s.launch_num_tokens) == (128, 2048)
    with pytest.raises(SettingsError):
        build_settings("ws1", {"launch_num_tokens": 0})


def _inventory(hosts):
    from pyinfra.api import Inventory

    return Inventory((hosts, {}))


def test_model_cache_host_must_be_a_host_of_the_inventory():
    from freetoken_infra.core.settings import validate_inventory

    good = _inventory([("ws1", {"model_cache_host": "ws1"}), ("ws2", {"model_cache_host": "ws1"})])
    assert set(validate_inventory(good)) == {"ws1", "ws2"}
    bad = _inventory([("ws1", {}), ("ws2", {"model_cache_host": "wsl"})])
    with pytest.raises(SettingsError) as exc:
        validate_inventory(bad)
    assert exc.value.problems == [
        "host ws2: setting 'model_cache_host' = 'wsl' is invalid: not a host of this inventory (hosts: ws1, ws2)"
    ]
