"""Read-only preflight: `pyinfra INVENTORY deploys/doctor.py`.

Gathers the facts, prints one findings table per host (check, status, evidence,
remedy) and a fleet summary. Changes nothing; exits non-zero when any host has a
blocker.
"""

from pyinfra import host
from pyinfra.context import state

from freetoken_infra.preflight import run_preflight

run_preflight(state, host)
