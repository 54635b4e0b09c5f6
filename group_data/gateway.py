"""The fleet's gateway (deploys/gateway.py): hosts of the inventory group `gateway` run HAProxy
in front of every serving host (README, "One endpoint for the fleet").

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
