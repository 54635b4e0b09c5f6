"""pyinfra inventory of the simulated test fleet (tests/fleet): the hosts that
`python -m tests.fleet up` started, read from the harness's state.json, reached over real SSH.

    sudo python -m tests.fleet up --hosts 3
    pyinfra inventories/sim.py deploys/freetoken.py

Hosts are grouped by hardware class (the group_data/<class>.py files apply); the group `sim`
carries the settings that point the deploy at the stand-in services on the bridge instead of
NVIDIA's repository, PyPI and the model hub. When the gateway host runs (`up --gateway`), it
is the group `gateway` (deploys/gateway.py), a plain Debian host that runs no engine.
"""

import ipaddress
import json
import os
from pathlib import Path

STATE = Path(os.environ.get("FREETOKEN_SIM_STATE", "/run/freetoken-sim")) / "state.json"

if not STATE.exists():
    raise SystemExit(f"simulated fleet not running: python -m tests.fleet up  (no {STATE})")
_state = json.loads(STATE.read_text())
_services = _state["services"]


def _url(service, key="url"):
    return (_services.get(service) or {}).get(key)


# Sim-wide overrides of our settings: every URL points at a stand-in served on the bridge.
# (Setting names follow group_data/all.py; keep them all in this one dict.)
SIM_DATA = {
    "cuda_repo_url": _url("cuda_repo"),
    "cuda_keyring_url": _url("cuda_repo", "keyring_url"),
    "pip_index_url": _url("wheelhouse"),
    "hub_endpoint": _url("hub"),
}


def _host(h, **data):
    if h.get("wake_on_lan_mac"):  # tests/fleet/harness.py set_wake_on_lan: its eth0's MAC
        data["wake_on_lan_mac"] = h["wake_on_lan_mac"]
    return (
        h["name"],
        {
            **data,
            "ssh_hostname": h["address"],
            "ssh_user": h.get("ssh_user", "root"),
            "ssh_key": h["ssh_key"],
            "ssh_known_hosts_file": _state["known_hosts"],
            "ssh_strict_host_key_checking": "yes",
        },
    )


_hosts = sorted(_state["hosts"].values(), key=lambda h: h["name"])
rtx5060ti_16gb = [_host(h) for h in _hosts if h["hardware_class"] == "rtx5060ti_16gb"]
rtx5090_32gb = [_host(h) for h in _hosts if h["hardware_class"] == "rtx5090_32gb"]
sim = ([h["name"] for h in _hosts], SIM_DATA)
# The fleet's gateway (deploys/gateway.py), only while it runs: not a workstation.
if _state.get("gateway"):
    # Its magic packets go to the bridge's broadcast address (the hosts have no default route).
    _bridge = ipaddress.ip_network(f"{_state['bridge']['address']}/{_state['bridge']['prefix']}", strict=False)
    gateway = [_host(_state["gateway"], wake_on_lan_broadcast=str(_bridge.broadcast_address))]
