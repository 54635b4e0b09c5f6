"""
The model: a verified, resumable download into ``settings.model_dir``.

The download runs on the target as ``freetoken-model-fetch.service`` (a oneshot running
``scripts/fetch_model.py`` as its own user, ``fetch_user``, who alone writes the model: the
engine's user only reads it), never as a command of the SSH session: a
22 GB fetch must outlive the connection that started it (field report, pitfall 4A), and a
re-run of the deploy simply waits on the same unit. The script refuses an unsupported
quantisation (pitfall 2) and a full disk before any weight byte, resumes with HTTP Range,
verifies every file and keeps a manifest that the ``ModelManifest`` fact reads.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Mapping, Sequence
from typing import Any

import click
from pyinfra import host as current_host
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.files import File
from pyinfra.operations import apt, files, systemd

from facts.model_manifest import ModelManifest
from freetoken_infra.core import hostio
from freetoken_infra.core.layout import (
    CACHE_NGINX_CONF,
    CACHE_NGINX_PACKAGE,
    CACHE_RUN_DIR,
    CACHE_SCRIPT,
    CACHE_UNIT,
    DEFAULT_DRIVE_ROOT,
    FETCH_SCRIPT,
    FETCH_UNIT,
    HOSTIO_MODULE,
    MANIFEST_MODULE,
    QUANT_MODULE,
    UNIT_DIR,
    HostLayout,
)
from freetoken_infra.core.pyinfra_internals import current_op_elevation
from freetoken_infra.core.settings import Settings
from freetoken_infra.core.text import printable
from freetoken_infra.core.units import Entry, Section, UnitFile, managed_by, no_windows, render, unit_command, unit_word
from operations import managed, ownership
from operations.managed import ManagedFile

TOKEN_CREDENTIAL = "hub-token"
JOURNAL_LINES = 20

_HERE = os.path.dirname(os.path.abspath(__file__))
_LOCAL_QUANT = os.path.join(os.path.dirname(_HERE), "freetoken_infra", "core", "quant.py")
_LOCAL_MANIFEST = os.path.join(os.path.dirname(_HERE), "freetoken_infra", "core", "manifest.py")


def fetch_status_dir(settings: Settings) -> str:
    """Owned by ``fetch_user``: the fetcher rewrites its status file there atomically."""
    return HostLayout.of(settings).fetch_status_dir


def fetch_status_file(settings: Settings) -> str:
    return HostLayout.of(settings).fetch_status_file


def reverify_request_file(settings: Settings) -> str:
    """While this file exists the downloader re-hashes every file (``model_reverify``)."""
    return HostLayout.of(settings).reverify_request_file


def as_fetch_user(settings: Settings, *argv: str) -> str:
    """A shell command running ``argv`` as the download's user, not as root: what root does in a
    folder that user owns (touch the re-verify request, read or remove the fetcher's status)
    must not follow a link planted there to a file of its choosing.
    ``setpriv`` (util-linux) changes the ids without a PAM session or a login shell."""
    user = shlex.quote(settings.fetch_user)
    return " ".join([f"setpriv --reuid={user} --regid={user} --clear-groups --", *(shlex.quote(a) for a in argv)])


def fetch_argv(settings: Settings, sources: Sequence[str] = (), token_file: str | None = None) -> list[str]:
    """The downloader's command line (no token in it: at most the name of its file; an endpoint
    with a user:password comes from the unit's environment file instead, ``fetch_env_path``)."""
    endpoint = [] if endpoint_has_credentials(settings) else ["--endpoint", str(settings.hub_endpoint).rstrip("/")]
    argv = [
        *_fetcher(settings, *endpoint),
        "--status-file",
        fetch_status_file(settings),
        "--disk-margin-gb",
        f"{settings.disk_margin_gb:g}",
        "--reverify-request",
        reverify_request_file(settings),
    ]
    for source in sources:
        argv += ["--source", source]
    if token_file:
        argv += ["--token-file", token_file]
    return argv


def endpoint_has_credentials(settings: Settings) -> bool:
    return bool(settings.hub_endpoint.username or settings.hub_endpoint.password)


def fetch_env_path(settings: Settings) -> str:
    """Root-only (0600) environment file of the fetch unit, holding HF_ENDPOINT when the endpoint
    carries credentials: process arguments (and the 0644 unit file) are readable by every user."""
    return f"{settings.config_dir}/model-fetch.env"


def check_argv(settings: Settings) -> list[str]:
    """``fetch_model.py --check``: exit 0 only when the model directory holds the verified model
    (no network, no hashing). The engine's unit runs it before every start."""
    return _fetcher(settings, "--check")


def _fetcher(settings: Settings, *options: str) -> list[str]:
    """``fetch_model.py`` with ``options``, then the model it is about: repo, revision, folder."""
    repo = ["--repo", settings.model_repo, "--revision", settings.model_revision, "--dest", settings.model_dir]
    return ["/usr/bin/python3", FETCH_SCRIPT, *options, *repo]


def cache_listen(bind: str, port: int) -> str:
    """nginx's ``listen`` address: an IPv6 literal in brackets."""
    return f"[{bind}]:{port}" if ":" in bind else f"{bind}:{port}"


def cache_nginx_conf(settings: Settings, bind: str) -> str:
    """``model-cache-nginx.conf``: Debian's nginx as the LAN model cache, on ``bind`` only.

    nginx's master runs as root only to read this file and the generated includes (the gated
    cache's key map is root's, 0600) and to bind; its workers serve as the service user, which
    only reads the model. Which files it serves comes from the downloader's manifest
    (``model_cache.py files``); a link planted in the model tree is never followed
    (``disable_symlinks on``). Slow or idle clients cost a connection, never a worker: a
    request's line and headers must arrive within 10 s, an idle kept-alive connection is closed
    after 10 s, a client that stops reading after 30 s.
    """
    run = CACHE_RUN_DIR
    gated = bool(settings.hub_token_file)
    user = settings.cache_user
    lines = [
        f"# {managed_by('operations/model.py')}",
        f"# The LAN model cache ({CACHE_UNIT}): the verified model {settings.model_repo}, read-only.",
        "daemon off;",
        "worker_processes 2;",
        "worker_rlimit_nofile 16384;",
        f"pid {run}/nginx.pid;",
        f"user {user} {user};",
        "error_log stderr warn;",
        "events {",
        "    worker_connections 4096;",
        "}",
        "http {",
        "    server_tokens off;",
        "    types { }",
        "    default_type application/octet-stream;",
        "    charset off;",
        "    sendfile on;",
        "    tcp_nopush on;",
        "    disable_symlinks on;",
        "    client_header_timeout 10s;",
        "    client_body_timeout 10s;",
        "    client_max_body_size 1k;",
        "    send_timeout 30s;",
        "    keepalive_timeout 10s;",
        "    reset_timedout_connection on;",
        "    limit_conn_zone $binary_remote_addr zone=per_client:1m;",
        "    limit_conn per_client 32;",
        "    limit_conn_status 429;",
        # No access log: the journal gets nginx's errors (stderr); a request line is never logged.
        "    access_log off;",
        # Debian's defaults lie under /var/lib/nginx, read-only to this unit.
        *(f"    {kind}_temp_path {run}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")),
    ]
    if gated:
        # The key (64 hex digits) is longer than a default map bucket holds.
        lines += ["    map_hash_bucket_size 128;", f"    include {run}/token.conf;"]
    lines += [
        "    server {",
        f"        listen {cache_listen(bind, settings.model_cache_port)};",
        "        server_name _;",
        "        default_type application/json;",
    ]
    if gated:
        lines += [
            "        if ($cache_token_ok = 0) {",
            '            return 401 \'{"error": "this cache serves a gated repository: send X-FreeToken-Cache-Token"}\\n\';',
            "        }",
        ]
    lines += [
        "        location / {",
        '            return 404 \'{"error": "not a verified file of the model this cache holds"}\\n\';',
        "        }",
        f"        include {run}/files.conf;",
        "    }",
        "}",
        "",
    ]
    return "\n".join(lines)


def cache_unit(settings: Settings, bind: str, drive_root: str = DEFAULT_DRIVE_ROOT) -> str:
    """Text of ``freetoken-model-cache.service``: Debian's nginx with ``cache_nginx_conf``, the
    verified model, read-only, to the LAN, on ``bind`` only (the address is in the
    configuration). A gated repository (``hub_token_file``) makes it ask every client for the
    key derived from the hub token: the token comes as a credential, root derives the key map
    into the unit's runtime folder (0700, the file 0600), and nginx's master reads it at start;
    no secret is in an argument or a world-readable file."""
    run = CACHE_RUN_DIR
    # The manifest lies in a folder the downloader writes: read by the download's user, never
    # root. Not by the engine's user either: what this prints is configuration nginx's master
    # (root) parses, and a process of the engine's user could be traced and made to print
    # something else.
    files = (
        as_fetch_user(settings, "/usr/bin/python3", "-I", CACHE_SCRIPT, "files", "--dir", settings.model_dir)
        + f" > {run}/files.conf.new && mv -f {run}/files.conf.new {run}/files.conf"
    )
    pre: list[Entry] = [("ExecStartPre", f"/bin/sh -c {unit_word(files)}")]
    token: list[Entry] = []
    if settings.hub_token_file:
        token = [("LoadCredential", f"{TOKEN_CREDENTIAL}:{unit_word(settings.hub_token_file, variables=False)}")]
        # %d: systemd's credentials folder (root's); every other word is one of our constants.
        derive = f"umask 077 && /usr/bin/python3 -I {CACHE_SCRIPT} token %d/{TOKEN_CREDENTIAL} > {run}/token.conf"
        pre.insert(0, ("ExecStartPre", f'/bin/sh -c "{derive}"'))
    about = Section(
        "Unit",
        (
            ("Description", f"LAN cache of the verified model {settings.model_repo} for the fleet (nginx)"),
            ("Wants", "network-online.target"),
            ("After", "network-online.target"),
        ),
    )
    service = Section(
        "Service",
        (
            # The master stays root (it reads the key map and re-reads on reload); its workers
            # run as the service user (``user`` in the configuration).
            ("RuntimeDirectory", run.rsplit("/", 1)[1]),
            ("RuntimeDirectoryMode", "0700"),
            *token,
            *pre,
            ("ExecStart", f"/usr/sbin/nginx -e stderr -c {CACHE_NGINX_CONF}"),
            # A new revision verified: serve its files (the deploy reloads after a fetch).
            ("ExecReload", f"/bin/sh -c {unit_word(files)}"),
            ("ExecReload", "/bin/kill -HUP $MAINPID"),
            ("Restart", "on-failure"),
            ("RestartSec", "5"),
            ("LimitNOFILE", "16384"),
            ("SyslogIdentifier", "freetoken-model-cache"),
            ("CapabilityBoundingSet", "CAP_CHOWN CAP_SETUID CAP_SETGID CAP_KILL"),
            ("NoNewPrivileges", "yes"),
            ("PrivateTmp", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "read-only"),
            *no_windows(drive_root),
        ),
    )
    install = Section("Install", (("WantedBy", "multi-user.target"),))
    return render(UnitFile(header=managed_by("operations/model.py"), sections=(about, service, install)))


def fetch_unit(settings: Settings, sources: Sequence[str] = (), drive_root: str = DEFAULT_DRIVE_ROOT) -> str:
    """Text of ``freetoken-model-fetch.service``."""
    exec_words = [unit_command(fetch_argv(settings, sources))]
    # Its own user: the only one that writes the model; the engine's user only reads it.
    entries: list[Entry] = [
        ("Type", "oneshot"),
        ("User", settings.fetch_user),
        ("Group", settings.fetch_user),
        ("UMask", "0022"),
    ]
    if settings.hub_token_file:
        # systemd hands the service a private copy of the root-only token file (%d is the
        # credentials folder): the service user never needs read access to the original, and
        # the token never appears on a command line.
        entries.append(("LoadCredential", f"{TOKEN_CREDENTIAL}:{unit_word(settings.hub_token_file, variables=False)}"))
        exec_words += ["--token-file", f"%d/{TOKEN_CREDENTIAL}"]
    if endpoint_has_credentials(settings):
        entries.append(("EnvironmentFile", unit_word(fetch_env_path(settings), variables=False)))
    entries.append(("ExecStart", " ".join(exec_words)))
    if settings.hub_disable_xet:
        # Field report, pitfall 2: Xet answered 401 through a mirror. fetch_model.py never
        # uses Xet; the variable is set for anything else that reads it.
        entries.append(("Environment", "HF_HUB_DISABLE_XET=1"))
    entries += [
        ("Environment", "PYTHONUNBUFFERED=1"),
        ("SyslogIdentifier", "freetoken-model-fetch"),
        # Hours on a slow link are normal; the script retries stalls itself.
        ("TimeoutStartSec", "infinity"),
        ("Nice", "10"),
        ("IOSchedulingClass", "best-effort"),
        ("IOSchedulingPriority", "7"),
        ("NoNewPrivileges", "yes"),
        ("PrivateTmp", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "read-only"),
        # It downloads from the network: it sees no other user's processes (root's commands).
        ("ProtectProc", "invisible"),
        ("ProcSubset", "pid"),
        (
            "ReadWritePaths",
            f"{unit_word(settings.model_dir, variables=False)} {unit_word(fetch_status_dir(settings), variables=False)}",
        ),
        *no_windows(drive_root),
    ]
    about = Section(
        "Unit",
        (
            (
                "Description",
                f"Fetch the FreeToken model {settings.model_repo}@{settings.model_revision} (resumable, verified)",
            ),
            ("Wants", "network-online.target"),
            ("After", "network-online.target"),
        ),
    )
    service = Section("Service", tuple(entries))
    return render(UnitFile(header=managed_by("operations/model.py"), sections=(about, service)))


@operation()
def model_fetcher(settings: Settings, sources: Sequence[str] = (), drive_root: str = DEFAULT_DRIVE_ROOT):
    """
    Install the model downloader: ``fetch_model.py`` and ``quant.py`` under
    ``/usr/local/lib/freetoken/``, its own user (``fetch_user``), the model and status folders
    owned by that user (made without following links; what an earlier layout left owned by the
    engine's user is re-owned, not downloaded again), and ``freetoken-model-fetch.service``
    (oneshot, not enabled: ``model_present`` starts it).
    Yields nothing when all of it is in place.

    + settings: the host's ``Settings``; uses ``model_repo``, ``model_revision``, ``model_dir``,
      ``hub_endpoint`` (a mirror works), ``hub_token_file`` (a root-only file on the target,
      handed to the unit through ``LoadCredential=``), ``hub_disable_xet``, ``disk_margin_gb``,
      ``fetch_user`` (created here), ``service_user`` (whose files from an earlier layout are
      re-owned) and ``state_dir`` (status file in ``state_dir/model-fetch/``)
    + sources: LAN caches speaking the hub's endpoints, tried before ``hub_endpoint``; their
      bytes are verified against the upstream listing, so a wrong cache cannot poison a host

    Run it as root (``_sudo=True``).

    **Example:**

    .. code:: python

        from freetoken_infra.core.settings import settings_for
        from operations.model import model_fetcher, model_present

        settings = settings_for(host)
        model_fetcher(name="Model downloader", settings=settings, _sudo=True)
        model_present(name="Model present and verified", settings=settings, _sudo=True)
    """
    yield from managed.put(
        *(
            ManagedFile(dest, local=src)
            for src, dest in (
                # the modules before the script that imports them
                (_LOCAL_QUANT, QUANT_MODULE),
                (_LOCAL_MANIFEST, MANIFEST_MODULE),
                (hostio.__file__, HOSTIO_MODULE),
                (managed.script_source("fetch_model.py"), FETCH_SCRIPT),
            )
        )
    )
    user = settings.fetch_user
    yield from ownership.system_account(user, home=settings.state_dir)
    yield from ownership.upload_script()
    reclaim = (settings.service_user, user)
    for path in (settings.model_dir, fetch_status_dir(settings)):
        yield from ownership.owned_dir(path, user, user, "755", reclaim, adopt_from=settings.service_user)

    env_file = fetch_env_path(settings)
    written = [ManagedFile(f"{UNIT_DIR}/{FETCH_UNIT}", text=fetch_unit(settings, sources, drive_root), unit=True)]
    if endpoint_has_credentials(settings):  # read by systemd as root, before the unit's User=
        if not current_host.get_fact(File, path=env_file):
            yield f"install -m 600 -o root -g root /dev/null {shlex.quote(env_file)}"
        endpoint = str(settings.hub_endpoint).rstrip("/")
        written.insert(0, ManagedFile(env_file, text=f"HF_ENDPOINT={endpoint}\n", mode="600"))
    else:
        yield from files.file._inner(path=env_file, present=False)
    yield from managed.put(*written)


@operation()
def model_cache(
    settings: Settings, present: bool = True, bind: str | None = None, drive_root: str = DEFAULT_DRIVE_ROOT
):
    """
    Serve this host's verified model to the rest of the fleet: Debian's nginx (``nginx``, from
    the host's apt sources) as ``freetoken-model-cache.service`` on ``settings.model_cache_port``
    with ``cache_nginx_conf``, serving only the files the downloader's manifest vouches for
    (``model_cache.py files``), with HTTP Range; enabled and running. Yields nothing when it
    already is. Install the downloader first (``model_fetcher``: it uploads ``manifest.py``).

    Debian's own ``nginx.service`` is masked before the package is installed, so it never starts
    on every interface; an nginx the host had before is left as it was (ours is a second
    instance with its own configuration).

    + settings: the cache host's ``Settings`` (``model_dir``, ``model_cache_port``,
      ``cache_user``, ``hub_token_file``)
    + present: ``False`` stops, disables and removes the cache (a host that is no longer the
      fleet's cache host; the nginx package stays); nothing is yielded when it is not there
    + bind: the address to listen on (the deploy's plan: ``freetoken_infra.plan.cache_bind_address``);
      required when ``present``

    Under WSL the other hosts reach it only with ``networkingMode=mirrored`` (setting
    ``wslconfig_networking_mode``) and the port open in the Windows firewall.

    **Example:**

    .. code:: python

        from operations.model import model_cache
        model_cache(name="Model: LAN cache", settings=settings, bind="192.168.1.20", _sudo=True)
    """
    unit_path = f"{UNIT_DIR}/{CACHE_UNIT}"
    if not present:
        # Its unit file says whether it was ever set up here (read with the other facts, in the
        # batch); the whole-system unit list would cost each host a `systemctl show --all`.
        if current_host.get_fact(File, path=unit_path):
            yield from systemd.service._inner(service=CACHE_UNIT, running=False, enabled=False)
            for path in (unit_path, CACHE_NGINX_CONF, CACHE_SCRIPT):
                yield from files.file._inner(path=path, present=False)
            yield from systemd.daemon_reload._inner()
        return
    if CACHE_NGINX_PACKAGE not in (current_host.get_fact(DebPackages) or {}):
        # Masked first: the package's postinst starts only an enabled unit, so Debian's default
        # site never listens on every interface, not even for a moment.
        yield from files.link._inner(path=f"{UNIT_DIR}/nginx.service", target="/dev/null")
        yield from systemd.daemon_reload._inner()
        yield from apt.update._inner()
        yield from apt.packages._inner(packages=[CACHE_NGINX_PACKAGE], no_recommends=True)
    if bind is None:
        raise OperationError("model_cache: no bind address given")
    # The workers' own account: the engine's user can neither signal nor trace them.
    yield from ownership.system_account(settings.cache_user, home="/nonexistent")
    changed = yield from managed.put(
        ManagedFile(CACHE_SCRIPT, local=managed.script_source("model_cache.py")),
        ManagedFile(CACHE_NGINX_CONF, text=cache_nginx_conf(settings, bind)),
        ManagedFile(unit_path, text=cache_unit(settings, bind, drive_root), unit=True),
    )
    yield from managed.running(CACHE_UNIT, changed=bool(changed))


@operation()
def model_cache_reload():
    """
    Make the LAN cache serve what the downloader verified since it started: rebuild its list of
    files from the manifest and reload nginx (transfers in flight finish on the old workers).
    The deploy runs it after ``model_present`` changed the cache host's model.

    **Example:**

    .. code:: python

        model_cache_reload(name="Model: LAN cache serves the newly verified files", _sudo=True)
    """
    yield StringCommand("systemctl", "reload-or-restart", CACHE_UNIT)


# --------------------------------------------------------------------------- waiting


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def format_progress(status: Mapping[str, Any]) -> str:
    """One progress line from the fetcher's status file (the service user writes it: its text
    is escaped)."""
    state = printable(status.get("state") or "?")
    done, total = status.get("bytes_done") or 0, status.get("bytes_total") or 0
    pct = f"{100.0 * done / total:.1f} %" if total else "-"
    line = f"model {state}: {hostio.human_bytes(done)} of {hostio.human_bytes(total)} ({pct})"
    if state == "downloading":
        line += f", {hostio.human_bytes(status.get('rate_bps') or 0)}/s, {_duration(status.get('eta_s'))} left"
    if status.get("current_file"):
        line += f", {printable(status['current_file'])}"
    return line


# The callback's probe: the unit's state, then the status file (one line of JSON).
def _probe_command(settings: Settings) -> str:
    return (
        f"systemctl show {FETCH_UNIT} -p ActiveState -p Result -p ExecMainStatus; "
        f"echo jobs=$(systemctl list-jobs --no-legend {FETCH_UNIT} 2>/dev/null | wc -l); "
        f"{as_fetch_user(settings, 'cat', fetch_status_file(settings))} 2>/dev/null || true"
    )


def _parse_probe(lines: list[str]) -> tuple[dict[str, str], dict | None]:
    unit: dict[str, str] = {}
    status = None
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                status = json.loads(line)
            except ValueError:
                status = None
        elif "=" in line:
            key, _, value = line.partition("=")
            unit[key] = value
    return unit, status


def wait_for_fetch(
    state,
    host,
    settings: Settings,
    elevation: Mapping[str, Any] | None = None,
    timeout_s: float = 12 * 3600,
    poll_s: float = 5.0,
    print_every_s: float = 30.0,
) -> dict:
    """Execution-time half of ``model_present``: start the unit, show progress, fail loudly."""
    elevation = dict(elevation or {})
    status_file = fetch_status_file(settings)
    # A finished earlier run's status must not be read as this run's result.
    start = (
        f"systemctl is-active -q {FETCH_UNIT} || {as_fetch_user(settings, 'rm', '-f', status_file)}; "
        f"systemctl start --no-block {FETCH_UNIT}"
    )
    if settings.model_reverify:
        # As the service user, and a fresh file: a link planted under the request's name goes,
        # it is never followed.
        request = reverify_request_file(settings)
        start = (
            f"{as_fetch_user(settings, 'rm', '-f', request)} && {as_fetch_user(settings, 'touch', request)} && {start}"
        )
    ok, output = host.run_shell_command(start, **elevation)
    if not ok:
        raise OperationError(
            f"host {host.name}: cannot start {FETCH_UNIT}: " + " ".join(printable(x) for x in output.output_lines[-3:])
        )
    click.echo(
        f"{host.print_prefix}model: fetching {settings.model_repo}@{settings.model_revision} into "
        f"{settings.model_dir} ({FETCH_UNIT}; it keeps running if this session drops)",
        err=True,
    )
    t0 = time.monotonic()
    last_print = 0.0
    last_state = None
    while True:
        _, output = host.run_shell_command(_probe_command(settings), **elevation)
        unit, status = _parse_probe(output.stdout_lines)
        running = unit.get("ActiveState") in ("active", "activating", "reloading") or unit.get("jobs", "0") != "0"
        now = time.monotonic()
        if status and (status.get("state") != last_state or now - last_print >= print_every_s):
            click.echo(f"{host.print_prefix}{format_progress(status)}", err=True)
            last_print, last_state = now, status.get("state")
        if not running and now - t0 > 1.0:
            break
        if now - t0 > timeout_s:
            raise OperationError(
                f"host {host.name}: the model download is still running after {_duration(timeout_s)} "
                f"({format_progress(status or {})}); it continues in the background as {FETCH_UNIT}: "
                "run the deploy again to wait for it, or `journalctl -u freetoken-model-fetch` to watch it"
            )
        time.sleep(poll_s)

    if status and status.get("state") == "done":
        click.echo(
            f"{host.print_prefix}model: {settings.model_repo} verified in {settings.model_dir} "
            f"({hostio.human_bytes(status.get('bytes_transferred') or 0)} transferred)",
            err=True,
        )
        return status
    _, journal = host.run_shell_command(
        f"journalctl -u {FETCH_UNIT} -n {JOURNAL_LINES} --no-pager -o cat",
        **elevation,
    )
    journal_text = "\n".join("    " + printable(line) for line in journal.output_lines) or "    (no journal lines)"
    exit_status = unit.get("ExecMainStatus", "?")
    what = "refused" if status and status.get("state") == "refused" else "failed"
    error = (status or {}).get(
        "error"
    ) or f"the unit ended with {unit.get('Result', '?')} (exit {exit_status}) before writing a status"
    raise OperationError(
        f"host {host.name}: the model download {what}: {printable(error)}\n"
        f"  last {JOURNAL_LINES} lines of `journalctl -u {FETCH_UNIT}`:\n{journal_text}"
    )


@operation(is_idempotent=True)
def model_present(settings: Settings, wait: bool = True, timeout_s: int = 12 * 3600):
    """
    Make sure ``settings.model_repo`` at ``settings.model_revision`` is fully downloaded and
    verified in ``settings.model_dir``. Yields nothing when the downloader's manifest already
    covers that revision and every file still has its verified size and mtime (the
    ``ModelManifest`` fact; no hashing). Otherwise starts ``freetoken-model-fetch.service``
    (install it first with ``model_fetcher``) and, with ``wait``, follows it at execution time:
    a progress line (bytes, rate, time left) every 30 s, and ``OperationError`` naming the host
    and the fetcher's error (an unsupported quantisation, a full disk, a hub error) with the
    unit's journal when it ends failed or refused.

    + settings: the host's ``Settings`` (``model_repo``, ``model_revision``, ``model_dir``,
      ``state_dir``)
    + wait: follow the download until it ends; ``False`` only starts it (the engine must not
      be started before the model is present)
    + timeout_s: how long to wait; the unit keeps going afterwards, a later deploy waits again

    With ``settings.model_reverify`` it runs the downloader even on a covered model, asking it
    (through a request file that outlives an interrupted run) to re-hash every file; the
    operation then counts as changed, so the engine restarts on the re-verified model.

    Run it as root (``_sudo=True``); the privilege arguments apply to the callback too.

    **Example:**

    .. code:: python

        from operations.model import model_present
        model_present(name="Model present and verified", settings=settings, _sudo=True)
    """
    info = current_host.get_fact(ModelManifest, model_dir=settings.model_dir)
    covered, _why = info.covers(settings.model_repo, settings.model_revision)
    if covered and not settings.model_reverify:
        return
    if not wait:
        yield StringCommand("systemctl", "start", "--no-block", FETCH_UNIT)
        return
    elevation = current_op_elevation(current_host)
    yield FunctionCommand(wait_for_fetch, (settings, elevation), {"timeout_s": timeout_s})
