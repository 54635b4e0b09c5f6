"""The fleet's gateway: HAProxy from the distribution in front of every serving host, so a fleet
of part-time PCs is one OpenAI base URL (docs/gateway.md).

A proven proxy, not ours: active HTTP checks that read `/health`'s JSON (FreeToken answers 200
while loading, so only `"status": "ok"` counts), `retry-on` + `redispatch` for requests no host
has answered yet, consistent hashing on the session header, a runtime API for drain / ready
(`python -m freetoken_infra.fleet`), seamless reloads and a built-in Prometheus exporter.

The pure parts (`haproxy_config`, `keys_map`, `metrics_keys_map`, `scrape_config`, `backends_for`)
are unit-tested; `gateway` converges the files and validates (`haproxy -c`) before it reloads.
"""

from __future__ import annotations

import hashlib
import io
import ipaddress
import json
import math
import re
import shlex
import ssl
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import yaml
from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.files import Sha256File
from pyinfra.operations import files, systemd

from facts.files import FileText
from freetoken_infra.core import redact
from freetoken_infra.core.addresses import AddressError, fleet_address
from freetoken_infra.core.hardware import HARDWARE_PROFILES
from freetoken_infra.core.launch import running_requests
from freetoken_infra.core.layout import (
    AGENT_UNIT,
    ALERTMANAGER_CONFIG,
    ALERTMANAGER_DEFAULTS,
    ALERTMANAGER_LISTEN,
    ALERTMANAGER_SMTP_PASSWORD,
    ALERTMANAGER_UNIT,
    ENGINE_UNIT,
    GATEWAY_ALERT_RULES,
    GATEWAY_BACKEND,
    GATEWAY_CONFIG,
    GATEWAY_ENGINE_KEY_MAP,
    GATEWAY_KEYS_MAP,
    GATEWAY_METRICS_KEYS_MAP,
    GATEWAY_RUNTIME_SOCKET,
    GATEWAY_SCRAPE_CONFIG,
    GATEWAY_SERVER_STATE,
    GATEWAY_TLS_PEM,
    PROMETHEUS_CONFIG,
    PROMETHEUS_DEFAULTS,
    PROMETHEUS_LISTEN,
    PROMETHEUS_SCRAPE_KEY,
    PROMETHEUS_UNIT,
    PROMETHEUS_USER,
    SERVED_BY_HEADER,
    SESSION_HEADER,
    WAKER_SOCKET,
    WAKER_USER,
    HostLayout,
)
from freetoken_infra.core.settings import ControllerSourceError, Settings, read_controller_source
from operations import preview
from operations.node_exporter import listen_address, scrape_address

# Health checks: every second; out after 2 failed checks in a row (a refused connection also
# marks it down at once: `observe layer4`), back in after 3 passed ones (the goal: out within
# 5 s, rejoin only after a few good intervals). A parked PC is probed every 2 s.
CHECK = "check inter 1s fastinter 500ms downinter 2s fall 2 rise 3"
# The host agent (operations/owner.py) is read this often: it answers `drain 0%` while its host
# yields to the owner, `ready 100%` when it is back, else `up` (an operator's drain stays). An
# agent that does not answer changes nothing: the health checks above decide.
AGENT_INTER = "2s"
# Only a request no host has answered yet is retried (HAProxy never retries once a response has
# started); 503 is FreeToken's "still loading" / "maintenance failed" before any work is done.
# junk-response: an engine killed while it wrote its status line and headers leaves a partial
# header block, which HAProxy never forwards; for the client that is as unanswered as an empty
# response (a CI run saw one such 502 under load while ws1's engine was killed and restarted).
RETRY_ON = "conn-failure empty-response junk-response response-timeout 503"
# A retried request must fit one buffer (retry-on); chat requests with a long history are
# forwarded all the same, just not retried.
BUFSIZE = 65536
# Streams of a slow 16 GB host can pause for a long prefill: no shorter server timeout.
SERVER_TIMEOUT = "10m"
# What a client is told to wait when the fleet is full (HAProxy's own 503s: queue full, no slot
# freed within gateway_queue_timeout_s, no host in service); the openai clients honour it.
RETRY_AFTER_S = 5
# HAProxy's server weights are 1..256: one per decode token per second. A host nothing is known
# of weighs what the field report's card decodes (about 24 tok/s).
UNKNOWN_WEIGHT = 24
# Matched over the whole string (fullmatch): `$` also accepts a final newline.
_SERVER_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_KEY_RE = re.compile(r"[A-Za-z0-9._~+/=-]{16,256}")
_LABEL_RE = re.compile(r"[A-Za-z0-9._@-]{1,64}")
# FreeToken's /health JSON, compact (FastAPI) or with spaces (json.dumps).
HEALTH_OK_REGEX = '"status" *: *"ok"'


class GatewayError(Exception):
    """A gateway that cannot be configured from these settings; the message says what to do."""


@dataclass(frozen=True)
class GatewayBackend:
    """One serving host as the gateway reaches it, with its engine's slots (HAProxy's `maxconn`:
    no more streams than the engine runs at once) and its weight (its decode tok/s)."""

    name: str  # the inventory's host name, also the HAProxy server name
    address: str
    port: int
    slots: int = 1
    weight: int = UNKNOWN_WEIGHT
    agent_port: int | None = None  # its host agent's agent-check port (agent_enabled)


def backend_capacity(settings: Settings, measured_tps: float | None) -> tuple[int, int]:
    """(slots, weight) of a host's engine as the gateway weighs it.

    Slots: the launch plan's running-request limit (`launch_max_running_requests`, else the
    declared `hardware_profile`'s card; a host whose card the controller cannot know
    (`hardware_profile` auto) gets 1, the least any plan runs). Weight: the decode tok/s its
    last passed health gate measured (`measured_tps`, from the rollout reports), else its class's
    `decode_floor_tps`, else UNKNOWN_WEIGHT; bounded to HAProxy's 1..256, so a host that reports
    a forged speed can take at most its slots, never another host's."""
    if settings.launch_max_running_requests is not None:
        slots = settings.launch_max_running_requests
    elif settings.hardware_profile in HARDWARE_PROFILES:
        slots = running_requests(HARDWARE_PROFILES[settings.hardware_profile])
    else:
        slots = 1
    tps = measured_tps if measured_tps is not None and math.isfinite(measured_tps) else settings.decode_floor_tps
    weight = UNKNOWN_WEIGHT if tps is None else min(256, max(1, round(tps)))
    return slots, weight


def backend_address(name: str, settings: Settings, hostname: str | None, gateway: str) -> str:
    """Where the gateway reaches `name`'s engine: its `listen_host`, or its inventory address
    when the engine listens on every address; loopback only from the gateway host itself."""
    ip = ipaddress.ip_address(str(settings.listen_host))
    if ip.is_unspecified:
        try:
            return fleet_address(name, hostname)
        except AddressError as exc:
            raise GatewayError(str(exc)) from None
    if ip.is_loopback and name != gateway:
        raise GatewayError(
            f"host {name}: its engine listens on {ip} only, which the gateway on {gateway} cannot "
            "reach: set listen_host to its LAN address or 0.0.0.0 (under WSL with "
            "networkingMode=mirrored and the port open in the Windows firewall)"
        )
    return str(ip)


def backends_for(
    gateway: str, hosts: Mapping[str, tuple[Settings, str | None]], measured_tps: Mapping[str, float] | None = None
) -> list[GatewayBackend]:
    """The gateway's backends: every host of the inventory whose `runs_engine` is set, in name
    order. `hosts`: name -> (settings, ssh_hostname or None); `measured_tps`: name -> the decode
    tok/s of its last passed gate (backend_capacity)."""
    out, problems = [], []
    for name in sorted(hosts, key=_natural):
        settings, hostname = hosts[name]
        if not settings.runs_engine:
            continue
        if not _SERVER_NAME_RE.fullmatch(name):
            problems.append(f"host {name}: a gateway backend's name may hold only letters, digits, '.', '_', '-'")
            continue
        try:
            address = backend_address(name, settings, hostname, gateway)
            slots, weight = backend_capacity(settings, (measured_tps or {}).get(name))
            agent = settings.agent_port if settings.agent_enabled else None
            out.append(GatewayBackend(name, address, settings.listen_port, slots, weight, agent))
        except GatewayError as exc:
            problems.append(str(exc))
    if problems:
        raise GatewayError("\n".join(problems))
    if not out:
        raise GatewayError("no host of the inventory runs an engine (runs_engine): the gateway has no backend")
    return out


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def read_source(source: str, what: str) -> str:
    """The text a `file:` / `env:` source names on the controller."""
    try:
        return read_controller_source(source)
    except ControllerSourceError as exc:
        raise GatewayError(f"{what} {source}: {exc}") from None


def fleet_engine_key(backends: Sequence[GatewayBackend], settings: Mapping[str, Settings]) -> str | None:
    """The one engine key the gateway sends to every backend (None: the engines take none, which
    only engines on loopback may: a keyless engine on a LAN address is refused)."""
    sources = {b.name: settings[b.name].api_key_source for b in backends}
    keyless = [
        b.name
        for b in backends
        if sources[b.name] == "none" and not ipaddress.ip_address(str(settings[b.name].listen_host)).is_loopback
    ]
    if keyless:
        raise GatewayError(
            "\n".join(
                f"host {name}: api_key_source 'none' with listen_host {settings[name].listen_host}: the "
                "gateway stands in front of no engine that takes no key on a LAN address; set "
                "api_key_source to the fleet's 'file:...' or 'env:...' key"
                for name in keyless
            )
        )
    if all(s == "none" for s in sources.values()):
        return None
    bad = sorted(n for n, s in sources.items() if s in ("none", "generate"))
    if bad:
        raise GatewayError(
            f"host(s) {', '.join(bad)}: api_key_source {sources[bad[0]]!r}; behind a gateway every "
            "engine takes the fleet's one key: set api_key_source to the same 'file:...' or 'env:...' "
            "for all of them"
        )
    keys = {n: read_source(s, f"host {n}: api_key_source").strip() for n, s in sources.items()}
    if len(set(keys.values())) != 1:
        raise GatewayError(
            f"hosts {', '.join(sorted(keys))}: their api_key_source give different keys; "
            "the gateway sends one engine key to all of them"
        )
    key = next(iter(keys.values()))
    if not _KEY_RE.fullmatch(key):
        raise GatewayError("the fleet's engine key must be 16-256 characters of A-Z a-z 0-9 . _ ~ + / = -")
    redact.remember(key)  # masked in every diff and line of this run, whatever file it lands in
    return key


def keys_map(
    text: str,
    source: str = "gateway_keys_source",
    taken: Collection[str] = (),
    taken_by: str = "",
    what: str = "the gateway's client keys",
) -> str:
    """The clients' keys as an HAProxy map: ``KEY LABEL`` per line. Input: one key per line,
    optionally followed by a label (the client's name in the log); '#' starts a comment.
    A key in `taken` (another map's, named by `taken_by`) is refused. Errors name the line,
    never the key."""
    lines, seen = [], set()
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        key, label = words[0], (words[1] if len(words) > 1 else f"client{number}")
        if len(words) > 2 or not _KEY_RE.fullmatch(key) or not _LABEL_RE.fullmatch(label):
            raise GatewayError(
                f"{source}, line {number}: expected 'KEY [LABEL]', the key 16-256 "
                "characters of A-Z a-z 0-9 . _ ~ + / = -, the label letters, digits, . _ @ -"
            )
        if key in seen:
            raise GatewayError(f"{source}, line {number}: this key is listed twice")
        if key in taken:
            raise GatewayError(f"{source}, line {number}: this key is also {taken_by}")
        seen.add(key)
        redact.remember(key)
        lines.append(f"{key} {label}\n")
    if not lines:
        raise GatewayError(f"{source}: no key; give at least one")
    return f"# Managed by freetoken-infra: {what} (KEY LABEL).\n" + "".join(lines)


def map_keys(text: str) -> set[str]:
    """The keys of a map ``keys_map`` wrote."""
    return {words[0] for words in (line.split() for line in text.splitlines()) if words and words[0][0] != "#"}


METRICS_CLOSED = (
    "# Managed by freetoken-infra: no metrics key (gateway_metrics_keys_source unset):\n"
    "# /metrics and /stats answer 401 to every request.\n"
)


def metrics_keys_map(text: str | None, client_map: str) -> str:
    """The map of the gateway's stats frontend (`/metrics`, `/stats`): the keys of
    ``gateway_metrics_keys_source`` (`text`; None: unset, and the map holds no key, so both
    answer 401 to everyone). Its own map, never the clients': a scrape credential, which sits in
    a file on the Prometheus host, buys metrics only, and a client key opens no metrics. A key
    that is also a client key (`client_map`) is refused: it would open both."""
    if text is None:
        return METRICS_CLOSED
    return keys_map(
        text,
        "gateway_metrics_keys_source",
        taken=map_keys(client_map),
        taken_by="a client key (gateway_keys_source); a metrics key must open /metrics and /stats only",
        what="the keys of /metrics and /stats only",
    )


def tls_pem(host_name: str, path: str) -> str:
    """The PEM that ``gateway_tls_cert_file`` names on the controller, checked by Python's ssl as
    HAProxy's `crt` will load it: a certificate (chain) and its private key, matching and not
    encrypted. Errors name host and field, never the key."""
    what = f"host {host_name}: gateway_tls_cert_file {path}"
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError as exc:
        raise GatewayError(f"{what}: {exc.strerror} on the controller") from None
    except UnicodeDecodeError:
        raise GatewayError(f"{what}: not a PEM file (PEM is ASCII text)") from None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(path, password=lambda: b"")
    except (ssl.SSLError, ValueError):
        raise GatewayError(
            f"{what}: expected a PEM certificate (chain) and its private key, unencrypted, in one file "
            "(cat cert.pem key.pem)"
        ) from None
    return text


def masked_map(text: str | None, secret: int, before: str | None = None) -> list[str] | None:
    """The lines of a key map with the key masked (``KEY LABEL``: `secret` 0; ``engine KEY``:
    `secret` 1) for ``--dry --diff``; with `before` (the host's text) a key that differs is
    marked ``(changed)`` or ``(new)``. Any other line that is not a comment is masked whole."""
    if text is None:
        return None
    old: dict[str, str] | None = None
    if before is not None:
        old = {w[1 - secret]: w[secret] for w in (line.split() for line in before.splitlines()) if len(w) == 2}
    out = []
    for line in text.splitlines():
        words = line.split()
        if line.startswith("#") or not words:
            out.append(line + "\n")
            continue
        if len(words) != 2:
            out.append(preview.MASK + "\n")
            continue
        mark = ""
        name = words[1 - secret]
        if old is not None and old.get(name) != words[secret]:
            mark = " (new)" if name not in old else " (changed)"
        words[secret] = preview.MASK
        out.append(" ".join(words) + mark + "\n")
    return out


def masked_pem(text: str | None, before: str | None = None) -> list[str] | None:
    """A PEM holding a private key, for ``--dry --diff``: one masked line."""
    if text is None:
        return None
    return [
        preview.MASK + " (certificate and private key)" + (" (changed)" if before and before != text else "") + "\n"
    ]


def engine_key_map(key: str | None) -> str:
    return "# Managed by freetoken-infra: the fleet's engine key.\n" + (f"engine {key}\n" if key else "")


def _key_rules(keys: str) -> list[str]:
    """Accept `Authorization: Bearer KEY` or `x-api-key: KEY` (FreeToken's own two forms) when
    KEY is in the map `keys` (each frontend its own map: a key opens only its own door)."""
    return [
        "http-request set-var(txn.api_key) req.hdr(x-api-key) if { req.hdr(x-api-key) -m found }",
        "http-request set-var(txn.api_key) req.hdr(authorization),bytes(7) "
        'if { req.hdr(authorization) -m beg -i "bearer " }',
        f"acl key_ok var(txn.api_key),map_str({keys}) -m found",
        "http-request return status 401 content-type application/json "
        'string \'{"error": "Unauthorized"}\' unless key_ok',
    ]


# Conversations are spread over this many buckets; each bucket has one preferred host.
AFFINITY_BUCKETS = 64
# Buckets in one `use-server` line: with its 20 other words, within HAProxy's 64 a line.
BUCKETS_PER_LINE = 32


def affinity_buckets(backends: Sequence[GatewayBackend]) -> dict[str, list[int]]:
    """Each backend's buckets, by weighted rendezvous hashing: a bucket goes to the host with the
    highest ``weight / -ln(u)``, `u` uniform from a hash of host and bucket. A host's share
    follows its weight, and a host that joins or leaves moves only the buckets it takes or held
    (every other conversation keeps its host)."""
    out: dict[str, list[int]] = {b.name: [] for b in backends}

    def score(b: GatewayBackend, bucket: int) -> float:
        digest = hashlib.sha256(f"{b.name}\0{bucket}".encode()).digest()
        u = (int.from_bytes(digest[:8], "big") + 1) / (2**64 + 2)  # in (0, 1)
        return b.weight / -math.log(u)

    for bucket in range(AFFINITY_BUCKETS):
        out[max(backends, key=lambda b: score(b, bucket)).name].append(bucket)
    return out


def haproxy_config(
    gw: Settings, backends: Sequence[GatewayBackend], engine_key: bool, tls: bool = False, waker: bool = False
) -> str:
    """/etc/haproxy/haproxy.cfg of the gateway host; with `tls`, both frontends speak HTTPS only
    (HAProxy's own TLS, the certificate and key in GATEWAY_TLS_PEM); with `waker`, a read-only
    stats socket for the waker's user (operations/waker.py)."""
    ssl = f" ssl crt {GATEWAY_TLS_PEM}" if tls else ""
    session = SESSION_HEADER.lower()
    servers = "\n".join(
        f"    server {b.name} {b.address}:{b.port} maxconn {b.slots} weight {b.weight}"
        + (f" agent-check agent-port {b.agent_port} agent-inter {AGENT_INTER}" if b.agent_port else "")
        for b in backends
    )
    busy = json.dumps({"error": "the fleet is busy: every engine slot and the gateway queue are full"})
    prefix = gw.gateway_prefix_affinity_bytes
    # The bucket a request's conversation falls in: its session, else (prefix affinity) the
    # first bytes of its body (model, system prompt); neither: no bucket.
    affinity = [
        f"http-request set-var(txn.bucket) req.hdr({session}),xxh32,mod({AFFINITY_BUCKETS}) "
        f"if {{ req.hdr({session}) -m found }}",
        *(
            [
                f"http-request set-var(txn.bucket) req.body,bytes(0,{prefix}),xxh32,mod({AFFINITY_BUCKETS}) "
                "if !{ var(txn.bucket) -m found } { req.body_size gt 0 }",
            ]
            if prefix
            else []
        ),
    ]
    # A bucket's host takes it while that host is in service (not drained) with a free slot;
    # else the request goes where any request goes.
    placed = affinity_buckets(backends)
    # HAProxy 2.6 reads at most 64 words a line: a host's buckets go in lines of BUCKETS_PER_LINE.
    prefer = "\n".join(
        f"    use-server {b.name} if {{ var(txn.bucket) -m int {' '.join(map(str, chunk))} }} "
        f"{{ srv_conn_free({GATEWAY_BACKEND}/{b.name}) gt 0 }} {{ srv_weight({GATEWAY_BACKEND}/{b.name}) gt 0 }} "
        f"{{ srv_is_up({GATEWAY_BACKEND}/{b.name}) }}"
        for b in backends
        for buckets in [placed[b.name]]
        for chunk in (buckets[i : i + BUCKETS_PER_LINE] for i in range(0, len(buckets), BUCKETS_PER_LINE))
    )
    engine_auth = (
        f'http-request set-header Authorization "Bearer %[str(engine),map_str({GATEWAY_ENGINE_KEY_MAP})]"'
        if engine_key
        else "http-request del-header Authorization"
    )
    front = "\n    ".join(
        [
            "# The gateway's own /health (no key, like the engines'): ok while a host is in service.",
            'http-request return status 200 content-type application/json string \'{"status": "ok"}\' '
            f"if {{ path /health }} {{ nbsrv({GATEWAY_BACKEND}) gt 0 }}",
            "http-request return status 503 content-type application/json "
            'string \'{"status": "error", "message": "no engine in service"}\' if { path /health }',
            *_key_rules(GATEWAY_KEYS_MAP),
            "# The whole request (up to tune.bufsize) before a host is picked: HAProxy retries only a",
            "# request it holds entirely, and a client's body often follows its headers in another",
            "# packet (the openai client's does). Without it, an engine killed under load left one such",
            "# request unretried: HAProxy's own 502, retries 0, SH in its log.",
            "option http-buffer-request",
            "# The log names the client by its label, never by its key.",
            f"http-request set-var(txn.client) var(txn.api_key),map_str({GATEWAY_KEYS_MAP})",
            "http-request capture var(txn.client) len 64",
            "http-request del-header x-api-key",
            engine_auth,
            "# Which host answered (clients and the fleet tests see their sessions stay put).",
            f"http-response set-header {SERVED_BY_HEADER} %s",
            "# Every engine slot busy and the queue full: a 503 at once, never a hang.",
            f"http-request return status 503 content-type application/json hdr Retry-After {RETRY_AFTER_S} "
            f"string '{busy}' if {{ queue({GATEWAY_BACKEND}) ge {gw.gateway_queue_max} }}",
            *affinity,
            f"default_backend {GATEWAY_BACKEND}",
        ]
    )
    stats = "\n    ".join(
        [
            "# Its own keys (gateway_metrics_keys_source): a client key gets 401 here, a metrics key on /v1.",
            *_key_rules(GATEWAY_METRICS_KEYS_MAP),
            "http-request use-service prometheus-exporter if { path /metrics }",
            "stats enable",
            "stats uri /stats",
            "stats refresh 10s",
        ]
    )
    retry = f"retry-on {RETRY_ON}\n    retries 3\n    option redispatch 1"
    waker_socket = (
        "\n    # The waker (Wake-on-LAN when the queue builds): read-only, its own user only.\n"
        f"    stats socket {WAKER_SOCKET} mode 600 user {WAKER_USER} level user"
        if waker
        else ""
    )
    return f"""# Managed by freetoken-infra (deploys/gateway.py); local edits are overwritten.
global
    log /dev/log local0
    chroot /var/lib/haproxy
    user haproxy
    group haproxy
    daemon
    maxconn 2048
    tune.bufsize {BUFSIZE}
    # The runtime API (python -m freetoken_infra.fleet drain/ready/status): root only.
    stats socket {GATEWAY_RUNTIME_SOCKET} mode 600 level admin expose-fd listeners{waker_socket}
    stats timeout 30s
    # Drained hosts stay drained across a reload: the deploy dumps the states here first.
    server-state-file {GATEWAY_SERVER_STATE}

defaults
    log global
    mode http
    option httplog
    option dontlognull
    timeout connect 2s
    timeout client {SERVER_TIMEOUT}
    timeout server {SERVER_TIMEOUT}
    timeout http-request 15s
    timeout http-keep-alive 30s
    # A request waits this long for a free engine slot, then gets HAProxy's 503 (below).
    timeout queue {gw.gateway_queue_timeout_s}s
    # A silent host (asleep, network gone) fails a check after 1.5 s: out within 5 s in all.
    timeout check 1500ms
    load-server-state-from-file global
    # HAProxy's own 503s (no slot freed in time, no host in service) in the engines' JSON shape,
    # with the time to wait before trying again.
    http-error status 503 content-type application/json hdr Retry-After {RETRY_AFTER_S} string '{{"error": "no engine slot became free in time"}}'

frontend freetoken_api
    bind :{gw.gateway_port}{ssl}
    {front}

frontend freetoken_stats
    bind :{gw.gateway_stats_port}{ssl}
    {stats}

# Each host takes at most its engine's slots (maxconn: its launch plan's running requests);
# the rest wait here for the first slot that frees on any host (leastconn per weight, the
# weight its decode tok/s). A conversation ({SESSION_HEADER}) keeps its host (its KV cache)
# while that host has a free slot: never more streams than the engine runs, never a wait on a
# busy host while another has room.
backend {GATEWAY_BACKEND}
    balance leastconn
    {retry}
    option httpchk
    http-check send meth GET uri /health ver HTTP/1.1 hdr Host freetoken-gateway
    http-check expect rstring '{HEALTH_OK_REGEX}'
    default-server {CHECK} observe layer4 error-limit 1 on-error mark-down
    # A host that vanished (powered off, asleep: no reset comes) would hold its streams' slots
    # for the server timeout; TCP keep-alives close those connections within about 11 s.
    option srvtcpka
    srvtcpka-idle 5s
    srvtcpka-intvl 2s
    srvtcpka-cnt 3
{prefer}
{servers}
"""


def scrape_config(
    gateway_address: str, gw: Settings, workstations: Mapping[str, tuple[str, Settings]], tls: bool = False
) -> str:
    """A Prometheus scrape config for the fleet: the gateway's exporter and each serving host's
    guard metrics (node_exporter's textfile collector, where operations/node_exporter.py makes
    it listen; hosts with ``node_exporter_enabled`` False are left out). Written by the YAML
    library: an address is data in it, never a line of its own."""
    gateway_job: dict = {
        "job_name": "freetoken-gateway",
        "metrics_path": "/metrics",
        **({"scheme": "https"} if tls else {}),
        "authorization": {"type": "Bearer", "credentials_file": PROMETHEUS_SCRAPE_KEY},
        "static_configs": [{"targets": [listen_address(gateway_address, gw.gateway_stats_port)]}],
    }
    guard_job = {
        "job_name": "freetoken-guard",
        "static_configs": [
            {
                "targets": [listen_address(scrape_address(s, address), s.node_exporter_port)],
                "labels": {"host": name, "textfile_dir": HostLayout.of(s).guard_textfile_dir},
            }
            for name, (address, s) in sorted(workstations.items())
            if s.node_exporter_enabled
        ],
    }
    head = (
        "# Generated by freetoken-infra (deploys/gateway.py): Prometheus scrape config for the fleet.\n"
        "# Put one metrics key (gateway_metrics_keys_source, never a client key) in the credentials file\n"
        "# (mode 0600) and merge this into prometheus.yml.\n"
        "# freetoken-guard: node_exporter on each serving host, its textfile collector reading the\n"
        "# guard's samples (RAM, swap, GPU memory); its firewall admits the gateway host(s) and\n"
        "# firewall_metrics_from only.\n"
    )
    return head + yaml.safe_dump(
        {"scrape_configs": [gateway_job, guard_job]}, sort_keys=False, default_flow_style=False
    )


# --------------------------------------------------------------------------- alerts
# The agent's modes in which the owner holds the GPU (core/owner.py): a host that went away in
# one of these went by its owner's choice (a yield, a snooze, off schedule, a pending reboot).
OWNER_MODES = ("yielding", "yielded", "held")
GUARD_JOB, GATEWAY_JOB = "freetoken-guard", "freetoken-gateway"
HOST_DOWN = "FreetokenHostDown"
OUT_OF_SERVICE = "FreetokenHostOutOfService"
QUEUE_BUILDING = "FreetokenQueueBuilding"
ENGINE_STOPPED_FOR_MEMORY = "FreetokenEngineStoppedForMemory"
FIREWALL_TABLE_GONE = "FreetokenFirewallTableGone"
AGENT_SILENT = "FreetokenAgentSilent"
# The guard latches `tripped` until the deploy starts the engine again; one more sample to be sure.
GUARD_FOR_S = 60
FIREWALL_FOR_S = 60
AGENT_FOR_S = 60


@dataclass(frozen=True)
class AlertTarget:
    """A serving host as the alert rules see it: whether it runs the host agent, whether its
    firewall table must be loaded (plan.firewall_needed), whether the waker may wake it
    (wake_on_lan_mac: asleep is then the owner's choice, not a failure)."""

    name: str
    agent: bool
    firewall: bool
    wakeable: bool


def alert_targets(hosts: Mapping[str, Settings], firewall: Collection[str]) -> list[AlertTarget]:
    """The rules' view of the hosts node_exporter is scraped on (`hosts`: name -> settings of
    each backend; `firewall`: the names whose firewall table must be live)."""
    return [
        AlertTarget(name, s.agent_enabled, name in firewall, s.wake_on_lan_mac is not None)
        for name, s in sorted(hosts.items(), key=lambda item: _natural(item[0]))
        if s.node_exporter_enabled
    ]


def _hosts_regex(names: Sequence[str]) -> str:
    # Names are HAProxy server names ([A-Za-z0-9._-], backends_for): only '.' means more in RE2,
    # and a PromQL string takes its backslash escaped.
    return "|".join(name.replace(".", "\\\\.") for name in names)


def _duration(seconds: int) -> str:
    return f"{seconds}s"


def alert_rules(gateway_name: str, gw: Settings, targets: Sequence[AlertTarget]) -> str:
    """The fleet's Prometheus alert rules (docs/alerts.md), from the gateway's settings and the
    serving hosts: one alert per failure, none for what an owner chose (a yield, a snooze, off
    schedule, a pending reboot; a wakeable PC asleep, which the waker wakes when the queue
    builds). Series: node_exporter of each host (job freetoken-guard, label `host`: the guard's
    and the host agent's textfile samples) and HAProxy's own exporter (job freetoken-gateway,
    label `server`: the host). A rule that concerns no host (no agent, no firewall) is left out."""
    owner = f'freetoken_agent_mode{{mode=~"{"|".join(OWNER_MODES)}"}}'
    host = "{{ $labels.host }}"
    down_filter = _hosts_regex([t.name for t in targets if t.wakeable])
    up_selector = f'up{{job="{GUARD_JOB}"' + (f', host!~"{down_filter}"' if down_filter else "") + "}"
    rules: list[dict] = [
        {
            "alert": HOST_DOWN,
            "expr": f"{up_selector} == 0\nunless on(host)\n"
            f"last_over_time({owner}[{_duration(gw.alert_yield_memory_s)}]) == 1",
            "for": _duration(gw.alert_host_down_for_s),
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": f"{host} is down (node_exporter unreachable), and its owner had not yielded it",
                "description": f"{host} answers no scrape: powered off, crashed, or off the network, while it "
                "served (its host agent's last mode was not yielding, yielded or held). Check that the PC is on "
                "and on the LAN; a PC taken out on purpose: `python -m freetoken_infra.fleet remove "
                f"{host}`.",
            },
        },
        {
            "alert": OUT_OF_SERVICE,
            "expr": "(\n  label_replace("
            f'haproxy_server_status{{job="{GATEWAY_JOB}", proxy="{GATEWAY_BACKEND}", state="DOWN"}}, '
            '"host", "$1", "server", "(.+)") == 1\n)\n'
            f'unless on(host) up{{job="{GUARD_JOB}"}} == 0\n'
            f"unless on(host) {owner} == 1",
            "for": _duration(gw.alert_out_of_service_for_s),
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": f"{host} is out of service at the gateway though it is on and not yielded",
                "description": f"HAProxy has kept {host} DOWN: its engine fails the /health checks (not "
                "running, not loading, or refused by its last deploy) while the PC answers and its owner has "
                "not claimed it. `python -m freetoken_infra.fleet status` shows the last check; "
                f"`journalctl -u {ENGINE_UNIT}` on {host} says why; converge it again.",
            },
        },
        {
            "alert": QUEUE_BUILDING,
            "expr": f'haproxy_backend_current_queue{{job="{GATEWAY_JOB}", proxy="{GATEWAY_BACKEND}"}} > 0',
            "for": _duration(gw.alert_queue_for_s),
            "labels": {"severity": "warning", "host": gateway_name},
            "annotations": {
                "summary": f"requests have queued at the gateway {gateway_name} without a break",
                "description": f"Every engine slot behind {gateway_name} has been busy and requests waited "
                "for one the whole time: the fleet is too small for its load, or hosts are out (a sleeping "
                "PC the waker could not wake). `python -m freetoken_infra.fleet status`.",
            },
        },
        {
            "alert": ENGINE_STOPPED_FOR_MEMORY,
            "expr": "freetoken_guard_tripped == 1",
            "for": _duration(GUARD_FOR_S),
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": f"the memory guard stopped the engine on {host}",
                "description": f"The guard on {host} stopped its engine: swap passed guard_swap_limit_gb or "
                "the engine recorded a CUDA out-of-memory. It stays stopped until the next deploy; the "
                f"doctor and `journalctl -t freetoken-guard` on {host} say why.",
            },
        },
    ]
    firewall = _hosts_regex([t.name for t in targets if t.firewall])
    if firewall:
        rules.append(
            {
                "alert": FIREWALL_TABLE_GONE,
                "expr": f'freetoken_firewall_table_loaded{{host=~"{firewall}"}} == 0',
                "for": _duration(FIREWALL_FOR_S),
                "labels": {"severity": "critical"},
                "annotations": {
                    "summary": f"the firewall table of {host} is gone",
                    "description": f"The freetoken nftables table on {host} is not loaded: its engine and "
                    "node_exporter ports are open to the whole LAN. Converge the host again "
                    "(deploys/freetoken.py), which loads it, and find what flushed it.",
                },
            }
        )
    agents = _hosts_regex([t.name for t in targets if t.agent])
    if agents:
        loop = f'freetoken_agent_last_loop_timestamp_seconds{{host=~"{agents}"}}'
        rules.append(
            {
                "alert": AGENT_SILENT,
                "expr": f"time() - {loop} > {gw.alert_agent_silent_s}\n"
                f'or on(host) (up{{job="{GUARD_JOB}", host=~"{agents}"}} == 1 unless on(host) {loop})',
                "for": _duration(AGENT_FOR_S),
                "labels": {"severity": "warning"},
                "annotations": {
                    "summary": f"the host agent of {host} is silent",
                    "description": f"The host agent on {host} has not finished a decision loop for "
                    f"{gw.alert_agent_silent_s} s, or writes no samples while node_exporter answers: the "
                    "gateway gets no drain/ready from it and the owner's games are not yielded to. "
                    f"`systemctl status {AGENT_UNIT}` on {host}.",
                },
            }
        )
    head = (
        "# Generated by freetoken-infra (deploys/gateway.py): the fleet's alert rules (docs/alerts.md).\n"
        "# Load it from prometheus.yml (rule_files) beside the scrape config; check: promtool check rules.\n"
    )
    return head + _readable_yaml({"groups": [{"name": "freetoken", "rules": rules}]})


class _ReadableDumper(yaml.SafeDumper):
    """safe_dump with a multi-line string as a literal block (a PromQL expression reads as written)."""


def _str_style(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_ReadableDumper.add_representer(str, _str_style)


def _readable_yaml(doc: dict) -> str:
    return yaml.dump(doc, Dumper=_ReadableDumper, sort_keys=False, default_flow_style=False, width=4096)


def scrape_key(metrics_map: str) -> str | None:
    """The key Prometheus scrapes HAProxy with: the first of the metrics key map (None: none)."""
    for line in metrics_map.splitlines():
        words = line.split()
        if words and not words[0].startswith("#"):
            return words[0]
    return None


def prometheus_config(scrape: str, gw: Settings) -> str:
    """prometheus.yml of the gateway host (alerting_enabled): the fleet's scrape config, the alert
    rules and the local Alertmanager. Written by the YAML library, like the scrape config."""
    doc = yaml.safe_load(scrape)
    interval = _duration(gw.alert_evaluation_interval_s)
    config = {
        "global": {
            "scrape_interval": interval,
            "evaluation_interval": interval,
            # A scrape must end before the next one starts.
            "scrape_timeout": f"{max(1, gw.alert_evaluation_interval_s * 3 // 4)}s"
            if gw.alert_evaluation_interval_s < 10
            else "10s",
        },
        "rule_files": [GATEWAY_ALERT_RULES],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [ALERTMANAGER_LISTEN]}]}]},
        "scrape_configs": doc["scrape_configs"],
    }
    head = "# Managed by freetoken-infra (deploys/gateway.py, alerting_enabled); local edits are overwritten.\n"
    return head + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


ALERTMANAGER_RECEIVER = "freetoken"


def alertmanager_config(gw: Settings, smtp_password: bool) -> str:
    """alertmanager.yml of the gateway host: every alert to the receivers the settings name (a
    webhook, mail), grouped per alert and host, resolutions sent too. The smarthost's password
    is never in it: `smtp_password` says a password file is there (smtp_auth_password_file).
    No receiver set: the alerts show in Alertmanager's API and `amtool alert` only."""
    receiver: dict = {"name": ALERTMANAGER_RECEIVER}
    config: dict = {}
    if gw.alert_webhook_url is not None:
        receiver["webhook_configs"] = [{"url": str(gw.alert_webhook_url), "send_resolved": True}]
    if gw.alert_email_to:
        smtp: dict = {
            "smtp_smarthost": gw.alert_email_smarthost,
            "smtp_from": gw.alert_email_from,
            "smtp_require_tls": True,
        }
        if smtp_password:
            smtp["smtp_auth_username"] = gw.alert_email_username or gw.alert_email_from
            smtp["smtp_auth_password_file"] = ALERTMANAGER_SMTP_PASSWORD
        config["global"] = smtp
        receiver["email_configs"] = [{"to": ", ".join(gw.alert_email_to), "send_resolved": True}]
    config["route"] = {
        "receiver": ALERTMANAGER_RECEIVER,
        "group_by": ["alertname", "host"],
        "group_wait": "30s",
        "group_interval": "5m",
        "repeat_interval": "4h",
    }
    config["receivers"] = [receiver]
    head = "# Managed by freetoken-infra (deploys/gateway.py, alerting_enabled); local edits are overwritten.\n"
    return head + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def service_defaults(args: Sequence[str]) -> str:
    """/etc/default/ of a Debian Prometheus package: its ARGS (words without spaces or quotes)."""
    return "# Managed by freetoken-infra (deploys/gateway.py).\n" + f'ARGS="{" ".join(args)}"\n'


# Both listen on loopback only: their APIs take no key (anyone reaching Alertmanager could
# silence every alert); Alertmanager's cluster port (0.0.0.0:9094 by default) is off.
PROMETHEUS_ARGS = (f"--web.listen-address={PROMETHEUS_LISTEN}",)
ALERTMANAGER_ARGS = (f"--web.listen-address={ALERTMANAGER_LISTEN}", "--cluster.listen-address=")


def masked_secret(text: str | None, before: str | None = None) -> list[str] | None:
    """A one-line secret file (the scrape key, the smarthost's password) for ``--dry --diff``."""
    if text is None:
        return None
    return [preview.MASK + (" (changed)" if before and before != text else "") + "\n"]


def _alerting_secret(path: str, text: str, unit: str, reload: set[str]):
    """One secret file of the alerting services (root's, group prometheus, 0640); ``unit`` is
    added to ``reload`` when it changes."""
    if host.get_fact(Sha256File, path=path) == _sha256(text):
        yield from files.file._inner(path=path, user="root", group=PROMETHEUS_USER, mode="640")
        return
    if preview.diff_wanted():
        current = host.get_fact(FileText, path=path)
        preview.log_diff(path, masked_secret(current), masked_secret(text, current or "") or [])
    if host.get_fact(Sha256File, path=path) is None:
        # Created 0640 first: the upload writes into it, never a world-readable copy.
        yield f"install -m 640 -o root -g {PROMETHEUS_USER} /dev/null {shlex.quote(path)}"
    yield from preview.put_without_pyinfra_diff(
        src=io.StringIO(text), dest=path, user="root", group=PROMETHEUS_USER, mode="640"
    )
    reload.add(unit)


def _alerting_configs(prometheus: str, alertmanager: str, reload: set[str]):
    """prometheus.yml and alertmanager.yml, each checked by its tool before it replaces the
    running one; the unit of each that changes is added to ``reload``."""
    # (path, text, mode, group, check, unit)
    for path, text, mode, group, check, unit in (
        (PROMETHEUS_CONFIG, prometheus, "644", "root", "promtool check config", PROMETHEUS_UNIT),
        (ALERTMANAGER_CONFIG, alertmanager, "640", PROMETHEUS_USER, "amtool check-config", ALERTMANAGER_UNIT),
    ):
        if host.get_fact(Sha256File, path=path) != _sha256(text):
            new = path + ".new"
            if mode == "640" and host.get_fact(Sha256File, path=new) is None:
                yield f"install -m 640 -o root -g {group} /dev/null {shlex.quote(new)}"
            yield from files.put._inner(src=io.StringIO(text), dest=new, user="root", group=group, mode=mode)
            # Checked before it replaces the running config: a bad one fails here, the old one runs on.
            yield f"{check} {shlex.quote(new)} && mv -f {shlex.quote(new)} {shlex.quote(path)}"
            reload.add(unit)


@operation()
def alerting(
    prometheus: str,
    alertmanager: str,
    rules: str,
    scrape_key: str,
    smtp_password: str | None,
    webhook_url: str | None = None,
):
    """
    Prometheus and Alertmanager (Debian's packages, installed by the deploy) on the gateway host:
    their configs, the scrape key and the smarthost's password (root's, group prometheus, 0640),
    both listening on loopback only. A changed prometheus.yml is checked with `promtool check
    config` (its rule file too), a changed alertmanager.yml with `amtool check-config`, before
    either replaces the running one; then the service reloads. Nothing changes when every file
    is as given; ``--dry --diff`` shows the secrets and the webhook URL masked.

    + prometheus: prometheus.yml text (prometheus_config)
    + alertmanager: alertmanager.yml text (alertmanager_config)
    + rules: the alert rules the gateway operation writes (alert_rules): Prometheus reloads when they change
    + scrape_key: the bearer token of HAProxy's /metrics (scrape_key)
    + smtp_password: the smarthost's password, None: no password file
    + webhook_url: the webhook URL in `alertmanager`, masked in its diff

    **Example:**

    .. code:: python

        gateway.alerting(name="Gateway: alerts", prometheus=prom, alertmanager=am,
                         rules=rules, scrape_key=key, smtp_password=None)
    """
    if webhook_url:
        redact.remember(webhook_url)  # masked in every diff and line of this run
    secrets = [(PROMETHEUS_SCRAPE_KEY, scrape_key + "\n", PROMETHEUS_UNIT)]
    if smtp_password is not None:
        secrets.append((ALERTMANAGER_SMTP_PASSWORD, smtp_password + "\n", ALERTMANAGER_UNIT))
    restart: set[str] = set()
    reload: set[str] = set()
    for path, text, unit in secrets:
        yield from _alerting_secret(path, text, unit, reload)
    if smtp_password is None:
        yield from files.file._inner(path=ALERTMANAGER_SMTP_PASSWORD, present=False)
    for path, args, unit in (
        (PROMETHEUS_DEFAULTS, PROMETHEUS_ARGS, PROMETHEUS_UNIT),
        (ALERTMANAGER_DEFAULTS, ALERTMANAGER_ARGS, ALERTMANAGER_UNIT),
    ):
        text = service_defaults(args)
        if host.get_fact(Sha256File, path=path) != _sha256(text):
            yield from files.put._inner(src=io.StringIO(text), dest=path, user="root", group="root", mode="644")
            restart.add(unit)
    yield from _alerting_configs(prometheus, alertmanager, reload)
    if PROMETHEUS_UNIT not in reload and host.get_fact(Sha256File, path=GATEWAY_ALERT_RULES) != _sha256(rules):
        # The gateway operation (before this one) wrote them: checked before Prometheus reads them.
        yield f"promtool check rules {shlex.quote(GATEWAY_ALERT_RULES)}"
        reload.add(PROMETHEUS_UNIT)
    for unit in (PROMETHEUS_UNIT, ALERTMANAGER_UNIT):
        if unit in restart:
            yield f"systemctl restart {unit}"
        elif unit in reload:
            yield f"if systemctl is-active -q {unit}; then systemctl reload {unit}; else systemctl restart {unit}; fi"
        yield from systemd.service._inner(service=unit, running=True, enabled=True)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# Dump the servers' states (drain, maintenance, health), then reload: HAProxy's master starts a
# new worker on the same sockets and the old one finishes its streams (no connection dropped).
RELOAD = (
    f"if systemctl is-active -q haproxy; then "
    f"echo 'show servers state' | socat stdio {GATEWAY_RUNTIME_SOCKET} > {GATEWAY_SERVER_STATE}.tmp "
    f"&& mv -f {GATEWAY_SERVER_STATE}.tmp {GATEWAY_SERVER_STATE}; systemctl reload haproxy; "
    "else systemctl restart haproxy; fi"
)


@operation()
def gateway(
    config: str,
    client_keys: str,
    engine_keys: str,
    metrics_keys: str,
    scrape: str,
    tls: str | None = None,
    rules: str | None = None,
):
    """
    HAProxy's config, the three key maps and the TLS PEM (0600 root), the scrape config and the alert
    rules; a changed
    config is validated with `haproxy -c` before it replaces the running one, then HAProxy
    reloads without dropping connections. Nothing changes when every file is as given.
    ``--dry --diff`` shows the key maps and the PEM masked (``********``), never a key.

    + config: haproxy.cfg text (haproxy_config)
    + client_keys: the clients' key map (keys_map)
    + engine_keys: the engine key map (engine_key_map)
    + metrics_keys: the key map of /metrics and /stats (metrics_keys_map)
    + scrape: the Prometheus scrape config (scrape_config)
    + tls: the PEM of HTTPS on the gateway's ports (tls_pem), None: plain HTTP (the PEM removed)
    + rules: the Prometheus alert rules (alert_rules), written beside the scrape config

    **Example:**

    .. code:: python

        gateway.gateway(name="Gateway: HAProxy", config=cfg, client_keys=keys,
                        engine_keys=engine, metrics_keys=metrics, scrape=scrape, tls=None)
    """
    # (path, text, mode, masked view for --diff or None: pyinfra's own diff)
    managed = [
        (GATEWAY_KEYS_MAP, client_keys, "600", lambda t, b=None: masked_map(t, 0, b)),
        (GATEWAY_ENGINE_KEY_MAP, engine_keys, "600", lambda t, b=None: masked_map(t, 1, b)),
        (GATEWAY_METRICS_KEYS_MAP, metrics_keys, "600", lambda t, b=None: masked_map(t, 0, b)),
        *([(GATEWAY_TLS_PEM, tls, "600", masked_pem)] if tls is not None else []),
        (GATEWAY_SCRAPE_CONFIG, scrape, "644", None),
        *([(GATEWAY_ALERT_RULES, rules, "644", None)] if rules is not None else []),
    ]
    changing = {path: host.get_fact(Sha256File, path=path) != _sha256(text) for path, text, _, _ in managed}
    if preview.diff_wanted():
        # Every masked diff first: pyinfra reads an operation only up to its first change.
        for path, text, _, masked in managed:
            if masked is not None and changing[path]:
                current = host.get_fact(FileText, path=path)
                preview.log_diff(path, masked(current), masked(text, current if current is not None else "") or [])
    changed = False
    for path, text, mode, masked in managed:
        if changing[path]:
            if mode == "600" and host.get_fact(Sha256File, path=path) is None:
                # A new secret file is created 0600 first: the upload then writes into it and
                # never leaves a world-readable copy at its final path.
                yield f"install -m 600 -o root -g root /dev/null {shlex.quote(path)}"
            put = preview.put_without_pyinfra_diff if masked is not None else files.put._inner
            yield from put(src=io.StringIO(text), dest=path, user="root", group="root", mode=mode)
            changed = changed or path != GATEWAY_ALERT_RULES  # HAProxy reads no rule
        else:
            yield from files.file._inner(path=path, user="root", group="root", mode=mode)
    if host.get_fact(Sha256File, path=GATEWAY_CONFIG) != _sha256(config):
        new = GATEWAY_CONFIG + ".new"
        yield from files.put._inner(src=io.StringIO(config), dest=new, user="root", group="root", mode="644")
        # Validated before it replaces the running config: a bad one fails here, HAProxy serves on.
        yield f"haproxy -c -q -f {shlex.quote(new)} && mv -f {shlex.quote(new)} {shlex.quote(GATEWAY_CONFIG)}"
        changed = True
    if changed:
        yield RELOAD
    yield from systemd.service._inner(service="haproxy", running=True, enabled=True)
    if tls is None:
        # Plain HTTP again: the certificate's key leaves the host once no config names it.
        yield from files.file._inner(path=GATEWAY_TLS_PEM, present=False)
