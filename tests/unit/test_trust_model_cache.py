"""The LAN model cache is Debian's nginx, configured by us.

What nginx does with slow and idle clients, Range requests and links is tested where nginx runs,
on the simulated cache host (tests/fleet/test_model.py). Here: what we hand it. The list of
served files is written by model_cache.py (run as the target runs it: a subprocess, the system-
style interpreter) from a manifest the download user writes, so it is attacked with a hostile
manifest and planted links; the key map of a gated cache and the unit are checked for secrets.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken_infra.core.layout import CACHE_NGINX_CONF, CACHE_RUN_DIR, CACHE_SCRIPT
from freetoken_infra.core.settings import Settings, SettingsError, build_settings
from operations.model import cache_nginx_conf, cache_unit
from tests.fleet.standins import hub_repos
from tests.unit.test_fetch_model import (  # noqa: F401 - fixtures
    ROOT,
    SHARD1,
    SHARD2,
    SUPPORTED,
    TOKEN,
    _clean_env,
    complete_model,
    fetch,
    fresh,
    hub,
    model_bytes,
    repos,
    script_dir,
)

COMMIT = hub_repos.REPOS[SUPPORTED]["sha"]
MANIFEST = ".freetoken-manifest.json"


def model_cache(script_dir: Path, *args: str) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "operations" / "scripts" / "model_cache.py", script_dir / "model_cache.py")
    return subprocess.run(
        [sys.executable, "-I", str(script_dir / "model_cache.py"), *args],
        cwd="/",
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def served(conf: str) -> dict[str, str]:
    """URI -> file of every exact location in a files list (each one checked for its form)."""
    out = {}
    for uri, path in re.findall(
        r'^location = "([^"]*)" \{\n    default_type [^\n]*\n    alias "([^"]*)";\n\}$', conf, re.M
    ):
        out[uri] = path
    return out


def health(conf: str) -> dict:
    body = re.search(r"^    return 200 '(.*)';$", conf, re.M)
    assert body, conf
    return json.loads(body.group(1).replace("\\n", "\n"))


# Every line model_cache.py may write: anything else would be nginx configuration of someone's
# choosing (a name from the manifest ending a string, a block or a directive).
_LINE = re.compile(
    r"#[^\n]*|location = /health \{|    default_type application/(json|octet-stream);|    return 200 \'\{[^\'\\$;]*\}\\n\';"
    r'|location = "/[A-Za-z0-9._+\-=,@/]+" \{|    alias "/[A-Za-z0-9._+\-=,@/]+";|\}'
)


def assert_only_our_forms(conf: str) -> None:
    for line in conf.splitlines():
        assert _LINE.fullmatch(line), line


def test_the_list_names_every_verified_file_under_the_commit_and_the_revision(script_dir, repos, complete_model):
    run = model_cache(script_dir, "files", "--dir", str(complete_model))
    assert run.returncode == 0, run.stderr
    assert_only_our_forms(run.stdout)
    names = model_bytes(repos)
    want = {f"/{SUPPORTED}/resolve/{rev}/{n}": f"{complete_model}/{n}" for rev in (COMMIT, "main") for n in names}
    assert served(run.stdout) == want
    assert health(run.stdout) == {
        "repo": SUPPORTED,
        "commit": COMMIT,
        "revision": "main",
        "complete": True,
        "files": len(names),
    }


def test_a_hostile_manifest_and_planted_links_do_not_reach_nginx(script_dir, complete_model, tmp_path):
    """The download user writes the model folder and its manifest: it lists names that would end
    nginx's string or block (a quote, ``$``, ``;``, ``}``, a newline), its own partial files and
    manifest, a path out of the folder, and swaps a verified file for a link to a secret with the
    same size and mtime. None of it is served; the verified files still are."""
    secret = tmp_path / "engine-key"
    secret.write_text("x" * 10)
    manifest = json.loads((complete_model / MANIFEST).read_text())
    victim = complete_model / SHARD2
    st = victim.stat()
    victim.unlink()
    victim.symlink_to(secret)
    os.utime(secret, ns=(st.st_atime_ns, st.st_mtime_ns))
    manifest["files"][SHARD2] = {**manifest["files"][SHARD2], "size": 10, "mtime_ns": st.st_mtime_ns}
    hostile = [
        'a" { return 200 "pwned"; } location = "/x',
        "b$uri",
        "c;d",
        "e}",
        "f\nlocation /",
        ".partial/x.part",
        MANIFEST,
        "../../etc/passwd",
        "g/../../h",
        "i\\x",
    ]
    for name in hostile:
        manifest["files"][name] = {"size": 1, "mtime_ns": 1, "sha256": "0" * 64}
    (complete_model / MANIFEST).write_text(json.dumps(manifest))
    run = model_cache(script_dir, "files", "--dir", str(complete_model))
    assert run.returncode == 0, run.stderr
    assert_only_our_forms(run.stdout)
    files = {uri.rsplit("/", 1)[1] for uri in served(run.stdout)}
    assert SHARD1 in files and SHARD2 not in files
    assert not any(name.rsplit("/", 1)[-1] in files for name in hostile)
    assert health(run.stdout)["complete"] is False


@pytest.mark.parametrize(
    "field, value",
    [("repo", 'o/n"; }'), ("repo", "o/n/x"), ("commit", "main$x"), ("revision", "ma in"), ("revision", "a/b")],
)
def test_a_hostile_repo_or_revision_in_the_manifest_is_not_served_under(script_dir, complete_model, field, value):
    manifest = json.loads((complete_model / MANIFEST).read_text())
    manifest[field] = value
    (complete_model / MANIFEST).write_text(json.dumps(manifest))
    run = model_cache(script_dir, "files", "--dir", str(complete_model))
    assert run.returncode == 0, run.stderr
    assert_only_our_forms(run.stdout)
    assert value not in run.stdout
    if field == "revision":  # the commit still names the same verified files
        assert all(f"/resolve/{COMMIT}/" in uri for uri in served(run.stdout))


def test_an_empty_or_missing_model_serves_only_health(script_dir, tmp_path):
    run = model_cache(script_dir, "files", "--dir", str(tmp_path / "none"))
    assert run.returncode == 0, run.stderr
    assert served(run.stdout) == {} and health(run.stdout)["complete"] is False


def test_the_key_map_holds_the_derived_key_never_the_token(script_dir, tmp_path):
    sys.path.insert(0, str(ROOT / "operations" / "scripts"))
    try:
        import fetch_model
        import model_cache as cache_script
    finally:
        sys.path.pop(0)
    key = cache_script.cache_token(TOKEN)
    assert key == fetch_model.cache_token(TOKEN) and TOKEN not in key
    credential = tmp_path / "hub-token"
    credential.write_text(TOKEN + "\n")
    run = model_cache(script_dir, "token", str(credential))
    assert run.returncode == 0, run.stderr
    assert TOKEN not in run.stdout
    assert run.stdout.splitlines()[1:] == [
        "map $http_x_freetoken_cache_token $cache_token_ok {",
        "    default 0;",
        f'    "{key}" 1;',
        "}",
    ]
    credential.write_text("\n")
    empty = model_cache(script_dir, "token", str(credential))
    assert empty.returncode != 0 and "is empty" in empty.stderr and empty.stdout == ""


# --------------------------------------------------------------------------- the unit


def test_the_unit_binds_where_the_fleet_reaches_the_host_never_everywhere():
    s = Settings(model_cache_host="ws1")
    conf = cache_nginx_conf(s, "10.213.0.11")
    assert re.findall(r"^\s*listen .*$", conf, re.M) == ["        listen 10.213.0.11:8090;"]
    assert "listen [fd00::11]:8090;" in cache_nginx_conf(s, "fd00::11")
    unit = cache_unit(s, "10.213.0.11")
    assert f"ExecStart=/usr/sbin/nginx -e stderr -c {CACHE_NGINX_CONF}" in unit.splitlines()
    assert "LoadCredential" not in unit and " token " not in unit and "cache_token_ok" not in conf


def test_nginx_is_told_to_cut_slow_clients_and_never_follow_links():
    conf = cache_nginx_conf(Settings(model_cache_host="ws1", service_user="freetoken"), "10.213.0.11")
    for line in (
        "user freetoken-cache freetoken-cache;",  # workers: their own account, which only reads the model
        "disable_symlinks on;",
        "client_header_timeout 10s;",
        "keepalive_timeout 10s;",
        "send_timeout 30s;",
        "worker_connections 4096;",
        "limit_conn per_client 32;",
        "sendfile on;",
        f"include {CACHE_RUN_DIR}/files.conf;",
    ):
        assert re.search(rf"^\s*{re.escape(line)}$", conf, re.M), line


def test_a_gated_repositorys_cache_gets_the_token_as_a_credential_and_its_key_in_a_root_only_file():
    s = Settings(model_cache_host="ws1", hub_token_file="/etc/freetoken/hub-token")
    unit = cache_unit(s, "10.213.0.11").splitlines()
    assert "LoadCredential=hub-token:/etc/freetoken/hub-token" in unit
    assert f"RuntimeDirectory={CACHE_RUN_DIR.rsplit('/', 1)[1]}" in unit and "RuntimeDirectoryMode=0700" in unit
    token_line = next(line for line in unit if " token " in line)
    assert token_line == (
        'ExecStartPre=/bin/sh -c "umask 077 && /usr/bin/python3 -I '
        f'{CACHE_SCRIPT} token %d/hub-token > {CACHE_RUN_DIR}/token.conf"'
    )
    assert not any(line.startswith("User=") for line in unit)  # the master reads it as root
    # The model folder is read by the download's user: never by root, and never by the engine's
    # user, whose processes could be traced into printing the configuration root's nginx parses.
    files_line = next(line for line in unit if line.startswith("ExecStartPre=") and " files " in line)
    assert "setpriv --reuid=freetoken-fetch --regid=freetoken-fetch --clear-groups -- /usr/bin/python3 -I" in files_line
    assert "--reuid=freetoken " not in files_line
    conf = cache_nginx_conf(s, "10.213.0.11")
    assert f"include {CACHE_RUN_DIR}/token.conf;" in conf and "if ($cache_token_ok = 0) {" in conf
    assert "hub-token" not in conf


@pytest.mark.parametrize("bad", ["every", "10.0.0.1; id", "10.0.0.300"])
def test_the_bind_setting_is_an_address(bad):
    with pytest.raises(SettingsError, match="model_cache_bind"):
        build_settings("ws1", {"model_cache_bind": bad})
