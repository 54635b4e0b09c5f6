"""The pyinfra facts the deploy's operations read, with what each declares for the two fact
registries (``facts/_declare.py``): pyinfra's classes are not ours to add attributes to, so
their declarations are here, one entry each.

Reads of a path, a program's name or unit names (files.*, server.user/group, systemd.service,
apt). Never ``Command``, nor any fact that runs what it is given: a learned request for one of
these runs as root on the host (``facts/batch.py``, ``allowed``).
"""

from __future__ import annotations

from dataclasses import dataclass

from facts._declare import (
    ACCOUNT_FILES,
    BOOT_ONLY,
    DPKG_STATUS,
    FALSE,
    NAME,
    NAMES,
    NONE,
    PATH,
    Declared,
    Inputs,
    Shape,
    fixed_paths,
    one_dir,
    one_path,
    units,
)


@dataclass(frozen=True)
class PyinfraFact:
    """One pyinfra fact's declarations, as a fact class of ours carries them."""

    argument_shapes: dict[str, Shape]
    fast_check_inputs: Declared


_SYSTEMD = PyinfraFact(
    argument_shapes={"services": NAMES, "user_mode": FALSE, "machine": NONE, "user_name": NONE},
    fast_check_inputs=units,
)

PYINFRA_READS: dict[str, PyinfraFact] = {
    "pyinfra.facts.files:File": PyinfraFact({"path": PATH}, one_path("path")),
    "pyinfra.facts.files:Directory": PyinfraFact({"path": PATH}, one_dir("path")),
    "pyinfra.facts.files:Link": PyinfraFact({"path": PATH}, one_path("path")),
    "pyinfra.facts.files:Sha1File": PyinfraFact({"path": PATH}, one_path("path")),
    "pyinfra.facts.files:Sha256File": PyinfraFact({"path": PATH}, one_path("path")),
    "pyinfra.facts.deb:DebPackages": PyinfraFact({}, fixed_paths(DPKG_STATUS)),
    "pyinfra.facts.server:Os": PyinfraFact({}, BOOT_ONLY),
    "pyinfra.facts.server:TmpDir": PyinfraFact({}, BOOT_ONLY),
    "pyinfra.facts.server:Users": PyinfraFact({}, Inputs(paths=set(ACCOUNT_FILES))),
    "pyinfra.facts.server:Groups": PyinfraFact({}, fixed_paths("/etc/group")),
    # A program's name, nothing to run.
    "pyinfra.facts.server:Which": PyinfraFact(
        {"command": NAME}, fixed_paths(DPKG_STATUS, "/usr/local/bin", "/usr/bin", "/bin")
    ),
    "pyinfra.facts.systemd:SystemdStatus": _SYSTEMD,
    "pyinfra.facts.systemd:SystemdEnabled": _SYSTEMD,
}
