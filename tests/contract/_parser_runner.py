"""Runs command lines through a FreeToken parser and writes its verdicts as JSON.

Run by the contract test in a subprocess, with the interpreter whose `freetoken` is
to be judged: the real 0.2.1 wheel in the contract venv, or the fleet tests' stand-in
(PYTHONPATH=tests/fleet/standins/engine). Stdlib only; no pytest.

    python _parser_runner.py CASES.json RESULTS.json

CASES.json: [{"name": str, "argv": [str, ...] (what follows `python -m freetoken`),
              "env": {VAR: value or null (= unset)}}, ...]
RESULTS.json: {"freetoken_version": str, "parser_module": str, "results": {name: result}}
where a result is {"verdict": "accepted", "fields": {...}} (the parsed ServerArgs'
fields, non-JSON values as repr), {"verdict": "rejected", "exit_code": int, "stderr": str}
(argparse's or parse_args' own usage error) or {"verdict": "crashed", "error": str}.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import traceback


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def _fields(parsed) -> dict:
    if isinstance(parsed, tuple):  # the real parse_args returns (ServerArgs, run_shell)
        parsed = parsed[0]
    out = {f.name: getattr(parsed, f.name) for f in dataclasses.fields(parsed)}
    out.update(out.pop("extra", None) or {})  # the stand-in keeps most fields in `extra`
    return {k: _jsonable(v) for k, v in out.items()}


def main(cases_path: str, results_path: str) -> int:
    from freetoken.server.args import parse_args
    from freetoken.version import __version__

    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    results = {}
    for case in cases:
        saved = {k: os.environ.get(k) for k in case.get("env", {})}
        for k, v in case.get("env", {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parsed = parse_args(list(case["argv"]), prog="python -m freetoken")
            results[case["name"]] = {"verdict": "accepted", "fields": _fields(parsed)}
        except SystemExit as exc:
            results[case["name"]] = {
                "verdict": "rejected",
                "exit_code": exc.code if isinstance(exc.code, int) else 1,
                "stderr": err.getvalue(),
            }
        except Exception:
            results[case["name"]] = {"verdict": "crashed", "error": traceback.format_exc()}
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    with open(results_path, "w", encoding="utf-8") as f:
        json.dump(
            {
                "freetoken_version": __version__,
                "parser_module": sys.modules[parse_args.__module__].__file__,
                "results": results,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
