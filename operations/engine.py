"""The engine: a dedicated system user, one virtual environment per engine version
(`/opt/freetoken/<version>`), and an `active` link to the version in service.

Versions side by side make an upgrade a link switch and a rollback another one.
A run cut at any point leaves no half-built environment in service: an environment counts as
built only once its completion marker (``layout.ENGINE_COMPLETE_MARKER``) is written, after pip
finished, and until then the next run builds it again (pip resumes); the ``active`` link is
switched only to a built one, atomically (a new link beside it renamed over it), so it never
dangles or is missing.
ninja is not a declared dependency of FreeToken but its JIT needs it (docs/engine.md),
so it is installed into the same environment.
"""

from __future__ import annotations

import io
import shlex

from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.files import File
from pyinfra.operations import files

from facts.engine import EngineInstall
from facts.files import FileText
from freetoken_infra.core.layout import DEPLOY_STATE_DIR, DEPLOY_STATE_MODE, HostLayout
from freetoken_infra.core.settings import Settings
from operations import ownership

PIP_CONF_MODE = "600"


def pip_conf(settings: Settings) -> str:
    """The venv's own pip.conf (`<venv>/pip.conf`): index and mirrors from settings."""
    lines = ["[global]", "disable-pip-version-check = true"]
    if settings.pip_index_url:
        lines.append(f"index-url = {settings.pip_index_url}")
    if settings.pip_extra_index_urls:
        lines.append("extra-index-url = " + " ".join(str(u) for u in settings.pip_extra_index_urls))
    # pip ignores a plain-http index unless trusted; configuring one is the user's trust.
    plain = [u for u in [settings.pip_index_url, *settings.pip_extra_index_urls] if u and u.scheme == "http"]
    if plain:
        lines.append("trusted-host = " + " ".join(sorted({u.host for u in plain if u.host})))
    return "\n".join(lines) + "\n"


@operation()
def service_user(settings: Settings):
    """
    The engine's system user and the folders root keeps: ``cache_dir`` (the only folder the
    engine writes: its kernel caches, ``HOME`` and working directory) owned by it; ``state_dir``
    (where the model lives, written by the download's own user), ``config_dir`` and root's own
    state (``DEPLOY_STATE_DIR``) owned by root. Every folder is made by ``own_dir.py``, which
    follows no link; a folder above one of them that an earlier layout gave to the engine's
    user goes back to root.

    + settings: the host's Settings (service_user, fetch_user, state_dir, cache_dir, config_dir)
    """
    # Its passwd home stays state_dir (usermod refuses to move the home of a user with running
    # processes); the unit's environment sets HOME to cache_dir, the folder it may write.
    yield from ownership.system_account(settings.service_user, home=settings.state_dir)
    yield from ownership.upload_script()
    reclaim = (settings.service_user, settings.fetch_user)
    user = settings.service_user
    yield from ownership.owned_dir(settings.state_dir, "root", "root", "755", reclaim)
    yield from ownership.owned_dir(settings.cache_dir, user, user, "755", reclaim)
    yield from ownership.owned_dir(settings.config_dir, "root", "root", "755", reclaim)
    yield from ownership.owned_dir(DEPLOY_STATE_DIR, "root", "root", DEPLOY_STATE_MODE, reclaim)


@operation()
def environment(settings: Settings, version: str | None = None, activate: bool = True):
    """
    A virtual environment holding the pinned engine and ninja, and (optionally) the
    `active` link pointing at it.

    + settings: the host's Settings (engine_package, engine_extras, engine_base_dir, pip_*)
    + version: the engine version (default: settings.engine_version)
    + activate: point `<engine_base_dir>/active` at this version

    **Example:**

    .. code:: python

        environment(name="FreeToken 0.2.2 beside 0.2.1", settings=s, version="0.2.2", activate=False)
    """
    version = version or settings.engine_version
    layout = HostLayout.of(settings)
    venv = layout.engine_venv_for(version)
    extras = f"[{','.join(settings.engine_extras)}]" if settings.engine_extras else ""
    requirement = f"{settings.engine_package}{extras}=={version}"
    installed = host.get_fact(EngineInstall, base_dir=settings.engine_base_dir)
    marker = layout.engine_complete_marker(version)
    marked = bool(host.get_fact(File, path=marker)) and installed.versions.get(version) == version
    has_ninja = bool(host.get_fact(File, path=f"{venv}/bin/ninja"))
    built = marked and has_ninja
    # Whole but for ninja's program (removed by hand): pip, finding ninja's dist-info, would call
    # it installed, so it is installed again by itself (the engine is not rebuilt).
    ninja_only = marked and not has_ninja

    if not built and not ninja_only:
        yield from files.directory._inner(path=settings.engine_base_dir, mode="755")
        # Also on an existing folder: it repairs a venv whose creation was cut off.
        yield f"python3 -m venv {shlex.quote(venv)}"
    # 0600 root: an index URL may carry credentials (user:password@), which must be readable by
    # root's pip only; pip reads the file, so they are never in an argument either.
    conf = f"{venv}/pip.conf"
    if host.get_fact(FileText, path=conf) != pip_conf(settings):
        yield from files.put._inner(
            src=io.StringIO(pip_conf(settings)), dest=conf, user="root", group="root", mode=PIP_CONF_MODE
        )
    else:
        yield from files.file._inner(path=conf, user="root", group="root", mode=PIP_CONF_MODE)
    if ninja_only:
        yield f"{shlex.quote(venv)}/bin/pip install --progress-bar off --force-reinstall --no-deps ninja"
    elif not built:
        # pip reads <venv>/pip.conf, so mirrors apply without arguments; the marker comes last.
        yield (
            f"rm -f {shlex.quote(marker)} && {shlex.quote(venv)}/bin/pip install --progress-bar off "
            f"{shlex.quote(requirement)} ninja && "
            f"printf '%s\\n' {shlex.quote(requirement)} > {shlex.quote(marker)}"
        )
    if activate:
        yield from switch_active(settings, version, installed)


def switch_active(settings: Settings, version: str, installed=None):
    """Point the ``active`` link at ``version``'s environment atomically (a new link beside it,
    renamed over it): at every instant the link names a whole environment. Yields nothing when
    it already does."""
    installed = installed or host.get_fact(EngineInstall, base_dir=settings.engine_base_dir)
    venv = HostLayout.of(settings).engine_venv_for(version)
    if installed.active_target == venv:
        return
    yield active_link_command(settings, version)


def active_link_command(settings: Settings, version: str) -> str:
    """The shell command that switches ``active`` to ``version`` in one rename."""
    layout = HostLayout.of(settings)
    link = shlex.quote(layout.engine_active_link)
    tmp = shlex.quote(f"{layout.engine_active_link}.new")
    return f"ln -sfn {shlex.quote(layout.engine_venv_for(version))} {tmp} && mv -Tf {tmp} {link}"
