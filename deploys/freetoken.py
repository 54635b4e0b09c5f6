"""Converge a workstation into a FreeToken endpoint:
`pyinfra inventories/home.py deploys/freetoken.py`.

Step 1 is the doctor's preflight: a host with a blocker is stopped before any
change, with its findings printed; the other hosts go on.
"""

from pyinfra import host
from pyinfra.context import state

from freetoken_infra.preflight import run_preflight

settings, observations, findings, ok = run_preflight(state, host)
