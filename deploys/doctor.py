"""Read-only preflight: `pyinfra INVENTORY deploys/doctor.py`.

Gathers the facts, prints one findings table per host (check, status, evidence,
remedy) and a fleet summary, and a line for a host held by a deploy run (its host
lock). Changes nothing; exits non-zero when any host has a blocker.
"""

import click
from pyinfra import host
from pyinfra.context import state

from facts.host_lock import HostLock
from freetoken_infra.preflight import run_preflight
from operations.host_lock import describe

lock = host.get_fact(HostLock)
if lock.holder is not None:
    if lock.held:
        status = f"held by {describe(lock.holder)}; lease ends in {lock.lease_left_s:.0f} s"
    else:
        why = "its run is gone" if lock.holder_alive is False else "its lease ran out"
        status = f"left by {describe(lock.holder)} ({why}); the next deploy takes it over"
    click.echo(f"    [{host.name}] deploy lock: {status}", err=True)
elif lock.error and lock.error != "no output":
    click.echo(f"    [{host.name}] deploy lock: cannot tell ({lock.error})", err=True)

# The doctor alone also starts a Windows program as a service would (the host agent does).
run_preflight(state, host, probe_interop=True)
