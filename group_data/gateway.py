"""The fleet's gateway (deploys/gateway.py): hosts of the inventory group `gateway` run HAProxy
in front of every serving host (docs/gateway.md).

A machine that is only a gateway runs no engine: the rollout skips it and it is no backend. A
workstation that is also the gateway sets `runs_engine = True` in its own host data.
"""

runs_engine = False

# The fleet's one OpenAI base URL is http://GATEWAY:8080/v1 (gateway_port; clients use a gateway
# key); /metrics and /stats are on gateway_stats_port (8404), a metrics key required.
# The clients' keys, on the controller: one key per line, optionally followed by a label.
# gateway_keys_source = "file:/home/me/freetoken-gateway-keys"
# The keys of /metrics and /stats only (Prometheus' scrape key; never a client key, never /v1);
# unset: no key opens them.
# gateway_metrics_keys_source = "file:/home/me/freetoken-metrics-keys"

# HTTPS on both ports (HAProxy's own TLS): the certificate chain, then its unencrypted key, in one
# PEM on the controller (`cat cert.pem key.pem`); clients then use https://GATEWAY:8080/v1.
# gateway_tls_cert_file = "/home/me/freetoken-gateway.pem"

# Alerts (docs/alerts.md): the rules are always written beside the scrape config
# (/etc/haproxy/freetoken-alerts.yml). With alerting_enabled the gateway host runs Debian's
# Prometheus and Alertmanager too (both on loopback: `ssh -L 9093:127.0.0.1:9093 GATEWAY`), scraping
# HAProxy with the first key of gateway_metrics_keys_source (required then).
# alerting_enabled = True
# How long each failure lasts before it alerts (defaults: 300, 900, 300 s; an agent silent 120 s),
# and how long a host's last yield is remembered once it is gone (3 days).
# alert_host_down_for_s = 300
# alert_out_of_service_for_s = 900
# alert_queue_for_s = 300
# alert_agent_silent_s = 120
# alert_yield_memory_s = 259200
# Where alerts go (none set: only Alertmanager's API and `amtool alert` show them). The webhook
# URL is masked in diffs; the smarthost's password is read on the controller and kept root-only.
# alert_webhook_url = "https://chat.example.org/hooks/freetoken"
# alert_email_to = ["me@example.org"]
# alert_email_from = "freetoken@example.org"
# alert_email_smarthost = "smtp.example.org:587"
# alert_email_password_source = "file:/home/me/freetoken-smtp-password"
