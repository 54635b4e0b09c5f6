"""STAND-IN for the Python package index the engine is installed from (PyPI or a PyPI mirror).

Test hosts reach no package registry, so this builds a static PEP 503 "simple" index that the
harness serves over HTTP: pip sees the same `pip install --index-url URL/simple
'freetoken[accel]==X' ninja` contract as against PyPI.

* ``freetoken`` wheels are built from the engine stand-in (tests/fleet/standins/engine) with the
  stdlib alone (a wheel is a zip: METADATA, WHEEL, entry_points.txt, RECORD), no network, no
  build backend: 0.2.1 (healthy), 0.2.2 (healthy, for upgrade tests) and 0.2.3 (built broken:
  health turns error after loading and the process exits, for rollback tests). The extras
  accel/fi/sgl/dev exist with no requirements, the console script is ``ft``.
* the real ``ninja`` wheel (the engine's JIT needs it) is fetched once with
  ``pip download ninja --only-binary=:all:`` for the running Python and cached under
  $FREETOKEN_SIM_CACHE (default /var/cache/freetoken-sim/), so rebuilding does not refetch.
* ``simple/index.html`` and ``simple/<normalized-name>/index.html`` link to ``packages/<file>``
  with ``#sha256=`` fragments, as PEP 503 indexes do.

Usage: ``python3 -m tests.fleet.standins.wheelhouse build DIR [--no-ninja]``
"""

from __future__ import annotations

import argparse
import base64
import glob
import hashlib
import html
import os
import re
import shutil
import subprocess
import sys
import zipfile

ENGINE_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine")
VERSIONS = {"0.2.1": False, "0.2.2": False, "0.2.3": True}  # version -> built broken
EXTRAS = ("accel", "fi", "sgl", "dev")
ZIP_DATE = (2026, 1, 1, 0, 0, 0)


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def build_engine_wheel(version: str, broken: bool, out_dir: str) -> str:
    """Write freetoken-<version>-py3-none-any.whl from the stand-in source; returns its path."""
    files: dict[str, bytes] = {}
    pkg_root = os.path.join(ENGINE_SRC, "freetoken")
    for dirpath, dirs, names in os.walk(pkg_root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            full = os.path.join(dirpath, name)
            arc = os.path.relpath(full, ENGINE_SRC).replace(os.sep, "/")
            with open(full, "rb") as f:
                files[arc] = f.read()
    files["freetoken/version.py"] = (
        '"""STAND-IN for freetoken/version.py, written by tests/fleet/standins/wheelhouse.py."""\n'
        f'__version__ = "{version}"\nBROKEN = {broken!r}\n'
    ).encode()
    dist = f"freetoken-{version}.dist-info"
    meta = [
        "Metadata-Version: 2.1",
        "Name: freetoken",
        f"Version: {version}",
        "Summary: STAND-IN for the FreeToken inference engine (CLI and HTTP API only, no GPU)"
        + (" - built broken" if broken else ""),
        "Requires-Python: >=3.10",
    ] + [f"Provides-Extra: {e}" for e in EXTRAS]
    files[f"{dist}/METADATA"] = ("\n".join(meta) + "\n").encode()
    files[f"{dist}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: freetoken-standin-wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files[f"{dist}/entry_points.txt"] = b"[console_scripts]\nft = freetoken.cli:main\n"
    files[f"{dist}/top_level.txt"] = b"freetoken\n"
    record = [f"{arc},sha256={_b64(hashlib.sha256(data).digest())},{len(data)}" for arc, data in files.items()]
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = os.path.join(out_dir, f"freetoken-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files.items():
            info = zipfile.ZipInfo(arc, ZIP_DATE)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return path


def cache_dir() -> str:
    return os.environ.get("FREETOKEN_SIM_CACHE") or "/var/cache/freetoken-sim"


def fetch_ninja(out_dir: str) -> str:
    """The real ninja wheel for this Python, from the cache or else `pip download` once."""
    cache = os.path.join(cache_dir(), "wheels")
    os.makedirs(cache, exist_ok=True)
    found = sorted(glob.glob(os.path.join(cache, "ninja-*.whl")))
    if not found:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "ninja",
                "-d",
                cache,
            ],
            check=True,
        )
        found = sorted(glob.glob(os.path.join(cache, "ninja-*.whl")))
        if not found:
            raise RuntimeError("pip download ninja produced no wheel")
    dst = os.path.join(out_dir, os.path.basename(found[-1]))
    shutil.copyfile(found[-1], dst)
    return dst


def write_index(root: str, wheels: list[str]) -> None:
    by_project: dict[str, list[str]] = {}
    for w in wheels:
        by_project.setdefault(normalize(os.path.basename(w).split("-")[0]), []).append(w)
    simple = os.path.join(root, "simple")
    os.makedirs(simple, exist_ok=True)
    links = "".join(f'    <a href="{p}/">{p}</a>\n' for p in sorted(by_project))
    with open(os.path.join(simple, "index.html"), "w") as f:
        f.write(f"<!DOCTYPE html>\n<html>\n  <body>\n{links}  </body>\n</html>\n")
    for project, files in by_project.items():
        os.makedirs(os.path.join(simple, project), exist_ok=True)
        rows = []
        for w in sorted(files):
            with open(w, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
            name = os.path.basename(w)
            rows.append(
                f'    <a href="../../packages/{html.escape(name)}#sha256={digest}" '
                f'data-requires-python="&gt;=3.7">{html.escape(name)}</a><br/>\n'
            )
        with open(os.path.join(simple, project, "index.html"), "w") as f:
            f.write(
                f"<!DOCTYPE html>\n<html>\n  <body>\n    <h1>Links for {project}</h1>\n{''.join(rows)}  </body>\n</html>\n"
            )


def build(root: str, ninja: bool = True) -> list[str]:
    packages = os.path.join(root, "packages")
    os.makedirs(packages, exist_ok=True)
    wheels = [build_engine_wheel(v, broken, packages) for v, broken in VERSIONS.items()]
    if ninja:
        wheels.append(fetch_ninja(packages))
    write_index(root, wheels)
    return wheels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m tests.fleet.standins.wheelhouse",
        description="Build the stand-in package index (PEP 503) under DIR.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir")
    b.add_argument("--no-ninja", action="store_true", help="skip the real ninja wheel (no download)")
    args = parser.parse_args(argv)
    for w in build(args.dir, ninja=not args.no_ninja):
        print(w)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
