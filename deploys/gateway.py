"""Converge the fleet's gateway: `pyinfra -y INVENTORY deploys/gateway.py --limit gateway`.

The hosts of the inventory group `gateway` (any Debian/Ubuntu machine, a WSL host too) run
HAProxy from the distribution in front of every host of the inventory that runs an engine
(`runs_engine`), each given no more streams than its engine's slots and weighted by its measured
decode tok/s: one OpenAI base URL for the fleet, health-checked on `/health`'s JSON, keys
checked at the gateway (docs/gateway.md), HTTPS with `gateway_tls_cert_file`.
Every value that reaches haproxy.cfg or the scrape config (addresses, names, keys) is validated
before any host is touched; an engine that takes no key on a LAN address is refused. Backends,
keys and ports come from the same settings the engines' deploy uses; a second run changes
nothing; a changed config is validated (`haproxy -c`) and reloaded without dropping
connections. Other hosts are left alone.

The alert rules (docs/alerts.md) are written beside the scrape config; with `alerting_enabled`
the gateway host also runs Debian's Prometheus and Alertmanager (loopback only) with them, its
receivers from the `alert_*` settings, each config checked (`promtool`, `amtool`) before it
replaces the running one.
"""

from typing import Any

from pyinfra import host
from pyinfra.api.exceptions import PyinfraError
from pyinfra.context import state

from freetoken_infra import plan
from freetoken_infra.core import addresses, redact
from freetoken_infra.core.layout import GATEWAY_GROUP
from freetoken_infra.preflight import fleet_settings
from freetoken_infra.rollout import measured_decode_tps
from operations import cuda, gateway, host_lock, waker

every = fleet_settings(state)  # every host's settings, validated before any host is touched

if GATEWAY_GROUP in host.groups:
    host_lock.private_uploads(state, host)  # the key maps never pass through a guessable /tmp name
    settings = every[host.name]
    try:
        if settings.gateway_keys_source is None:
            raise gateway.GatewayError(
                f"host {host.name}: set gateway_keys_source (file:/path or env:VAR on the controller, "
                "one client key per line) for the gateway's clients"
            )
        hosts = {h.name: (every[h.name], h.data.get("ssh_hostname")) for h in state.inventory}
        # Each engine's slots from its launch plan, its weight from its last gate's tok/s.
        backends = gateway.backends_for(host.name, hosts, measured_decode_tps())
        engine_key = gateway.fleet_engine_key(backends, every)
        client_keys = gateway.keys_map(gateway.read_source(settings.gateway_keys_source, "gateway_keys_source"))
        # /metrics and /stats take their own keys only (unset: none opens them).
        metrics_source = settings.gateway_metrics_keys_source
        metrics_keys = gateway.metrics_keys_map(
            None if metrics_source is None else gateway.read_source(metrics_source, "gateway_metrics_keys_source"),
            client_keys,
        )
        address = addresses.fleet_address(host.name, host.data.get("ssh_hostname"))
        tls = None
        if settings.gateway_tls_cert_file is not None:
            tls = gateway.tls_pem(host.name, settings.gateway_tls_cert_file)
        sleepers = waker.targets(every)  # hosts with wake_on_lan_mac
        scrape = gateway.scrape_config(
            address, settings, {b.name: (b.address, every[b.name]) for b in backends}, tls=tls is not None
        )
        # One alert per failure, none for an owner's choice (docs/alerts.md).
        rules = gateway.alert_rules(
            host.name,
            settings,
            gateway.alert_targets(
                {b.name: every[b.name] for b in backends},
                firewall={b.name for b in backends if plan.firewall_needed(every[b.name])},
            ),
        )
        alerting: dict[str, Any] | None = None  # the alerting operation's arguments
        if settings.alerting_enabled:
            key = gateway.scrape_key(metrics_keys)
            if key is None:
                raise gateway.GatewayError(
                    f"host {host.name}: alerting_enabled needs gateway_metrics_keys_source (Prometheus "
                    "scrapes HAProxy's /metrics with its first key)"
                )
            smtp_password = None
            if settings.alert_email_password_source is not None:
                smtp_password = gateway.read_source(
                    settings.alert_email_password_source, "alert_email_password_source"
                ).strip()
                if not smtp_password or "\n" in smtp_password:
                    raise gateway.GatewayError(
                        f"host {host.name}: alert_email_password_source gives an empty or multi-line password"
                    )
                redact.remember(smtp_password)  # masked in every diff and line of this run
            webhook = None if settings.alert_webhook_url is None else str(settings.alert_webhook_url)
            if webhook is not None:
                redact.remember(webhook)  # a chat's webhook URL is its credential
            receivers = [r for r, on in (("webhook", webhook), ("mail", settings.alert_email_to)) if on]
            alerting = {
                "name": "Gateway: Prometheus and Alertmanager on loopback (checked, reloaded); receivers: "
                + (", ".join(receivers) or "none (Alertmanager's API only)"),
                "prometheus": gateway.prometheus_config(scrape, settings),
                "alertmanager": gateway.alertmanager_config(settings, smtp_password is not None),
                "rules": rules,
                "scrape_key": key,
                "smtp_password": smtp_password,
                "webhook_url": webhook,
            }
    except (gateway.GatewayError, addresses.AddressError, ValueError) as exc:
        raise PyinfraError(f"gateway on {host.name}: {exc}") from None

    cuda.packages_present(name="Gateway: HAProxy and socat (Debian packages)", packages=["haproxy", "socat"])
    if sleepers:  # before HAProxy's config names it for the waker's socket
        waker.user(name="Gateway: the waker's system user")
    gateway.gateway(
        name="Gateway: HAProxy in front of "
        + ", ".join(f"{b.name} ({b.slots} slot{'s' if b.slots > 1 else ''}, weight {b.weight})" for b in backends)
        + " (validated, reloaded)"
        + ("" if metrics_source else "; /metrics and /stats closed: no gateway_metrics_keys_source"),
        config=gateway.haproxy_config(
            settings, backends, engine_key is not None, tls=tls is not None, waker=bool(sleepers)
        ),
        client_keys=client_keys,
        engine_keys=gateway.engine_key_map(engine_key),
        metrics_keys=metrics_keys,
        scrape=scrape,
        tls=tls,
        rules=rules,
    )
    if alerting is not None:
        cuda.packages_present(
            name="Gateway: Prometheus and Alertmanager (Debian packages)",
            packages=["prometheus", "prometheus-alertmanager"],
        )
        gateway.alerting(**alerting)
    waker.waker(
        name="Gateway: the waker (Wake-on-LAN for " + (", ".join(t["name"] for t in sleepers) or "no host") + ")",
        gw=settings,
        hosts=sleepers,
    )
