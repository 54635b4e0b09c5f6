"""The two fact registries (``facts/batch.py`` ``ARGUMENT_SHAPES`` and the fast check's inputs,
``facts/inputs.py``) against a frozen copy of what they answered when each fact's declaration
moved beside the fact (``tests/fixtures/fact_registries_frozen.json``, written once from the
registries as they were then, never from the code under test).

Both registries are read here only through what the rest of the code uses: ``batch.allowed`` /
``ARGUMENT_SHAPES[name](value)`` for each argument name and a set of probe values, and
``inputs_of(fact, kwargs)`` for every fact and a set of probe arguments. Any difference (a shape
that accepts another value, an input more or fewer, a fact whose inputs became known or unknown)
fails, naming the argument or the fact. A deliberate change of a declaration updates the frozen
copy in the same commit (``write_frozen``), so the diff shows it. A new fact or argument name is
an addition, not a difference: the enforcement tests (``test_fast_check.py``,
``test_facts_batch.py``) see that it declares what it must.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path
from typing import Any

from pyinfra.api import FactBase

import facts
from facts import batch
from facts.inputs import inputs_of

FROZEN = Path(__file__).resolve().parents[1] / "fixtures" / "fact_registries_frozen.json"

# Values each argument shape is asked about: of every type, good and bad paths, names,
# addresses and ports, lists of them.
SHAPE_PROBES: list[Any] = [
    None,
    False,
    True,
    0,
    1,
    8000,
    65535,
    65536,
    -1,
    1.5,
    "",
    "/",
    "/x",
    "/var/lib/freetoken",
    "/mnt/c/Users/dev/.wslconfig",
    "/a b/c+d@e:f,g=h~i",
    "/x;rm -rf /",
    "/x\n/y",
    "/$(id)",
    "relative/path",
    "x",
    "a.service",
    "freetoken@1.service",
    "-flag",
    "bad name!",
    "n" * 128,
    "n" * 129,
    "127.0.0.1",
    "::1",
    "[::1]",
    "localhost",
    "999.1.1.1",
    "/" + "p" * 4095,
    "/" + "p" * 4096,
    [],
    ["/x"],
    ["/x", "y"],
    ["u.service"],
    ["u.service", "bad name!"],
    ["x", 3],
    {"path": "/x"},
    ("/x",),
]

# Arguments every fact is asked with: none, each argument name the deploy uses, good and bad.
INPUT_PROBES: list[dict[str, Any]] = [
    {},
    {"path": "/x"},
    {"path": "relative"},
    {"path": 3},
    {"path": "/var/lib/freetoken/models", "adopt_from": "olduser"},
    {"path": "/var/lib/freetoken/models", "adopt_from": None},
    {"path": "/mnt/c/Users/dev/Desktop"},
    {"paths": ["/a", "/b"]},
    {"paths": ["/a", "b"]},
    {"paths": "/a"},
    {"base_dir": "/opt/freetoken/engine"},
    {"base_dir": "opt"},
    {"state_file": "/var/lib/freetoken/guard.json"},
    {"model_dir": "/models/m"},
    {"cuda_home": "/usr/local/cuda-12.4"},
    {"cuda_home": None},
    {"cuda_home": "cuda"},
    {"host": "127.0.0.1", "port": 8000},
    {"host": "::1", "port": 8001},
    {"host": "[::1]", "port": 8001},
    {"host": "10.0.0.2"},
    {"port": True},
    {"port": "8000"},
    {"host": 3, "port": 1},
    {"services": ["freetoken.service", "nvidia-persistenced.service"]},
    {"services": ["a.service", 3]},
    {"services": "a.service"},
    {"services": ["a.service"], "user_mode": True},
    {"services": ["a.service"], "user_mode": False, "machine": None, "user_name": None},
    {"services": ["a.service"], "machine": "m"},
    {"account": "freetoken"},
    {"task_name": "FreeTokenWake"},
    {"drive_root": "/mnt/c"},
    {"command": "nvidia-smi"},
    {
        "path": "/x",
        "paths": ["/x"],
        "base_dir": "/x",
        "state_file": "/x",
        "model_dir": "/x",
        "services": ["u.service"],
        "account": "a",
        "cuda_home": "/x",
        "host": "127.0.0.1",
        "port": 1,
    },
]


def _fact_names() -> list[str]:
    found = set(batch.PYINFRA_FACTS)
    for info in pkgutil.iter_modules(facts.__path__):
        module = importlib.import_module(f"facts.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, FactBase) and value.__module__ == module.__name__:
                found.add(f"{module.__name__}:{value.__qualname__}")
    return sorted(found | {"x:Y", "pyinfra.facts.server:Command"})


def _probe_key(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, tuple) else f"tuple {json.dumps(list(value))}"
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def observed() -> dict[str, Any]:
    """What the registries answer now, in the frozen copy's form."""
    shapes = {
        name: sorted(_probe_key(v) for v in SHAPE_PROBES if batch.ARGUMENT_SHAPES[name](v))
        for name in sorted(batch.ARGUMENT_SHAPES)
    }
    inputs = {}
    for fact in _fact_names():
        answers = {}
        for kwargs in INPUT_PROBES:
            found = inputs_of(fact, dict(kwargs))
            answers[json.dumps(kwargs, sort_keys=True)] = (
                None if found is None else {k: v for k, v in found.to_json().items() if v}
            )
        inputs[fact] = answers
    return {
        "pyinfra_facts": sorted(batch.PYINFRA_FACTS),
        "argument_shapes": shapes,
        "inputs": inputs,
    }


def write_frozen() -> None:
    """Write the frozen copy from the registries as they are (done once, before the change it
    guards): one line per argument name and per fact and arguments, so that a diff shows each."""
    now = observed()
    lines = ['{\n "pyinfra_facts": ' + json.dumps(now["pyinfra_facts"]) + ',\n "argument_shapes": {']
    lines.append(",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in now["argument_shapes"].items()))
    lines.append(' },\n "inputs": {')
    facts_text = []
    for fact, answers in now["inputs"].items():
        rows = ",\n".join(f"   {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in answers.items())
        facts_text.append(f"  {json.dumps(fact)}: {{\n{rows}\n  }}")
    lines.append(",\n".join(facts_text))
    lines.append(" }\n}\n")
    FROZEN.write_text("\n".join(lines))


def test_the_batch_accepts_exactly_the_argument_shapes_it_accepted():
    """Every frozen argument name has its shape still (a new fact's new name is an addition the
    enforcement tests check, not a change)."""
    frozen, now = json.loads(FROZEN.read_text()), observed()
    assert now["pyinfra_facts"] == frozen["pyinfra_facts"]
    assert not set(frozen["argument_shapes"]) - set(now["argument_shapes"]), "argument names no longer accepted"
    for name, accepted in frozen["argument_shapes"].items():
        assert now["argument_shapes"][name] == accepted, name


def test_the_fast_check_records_exactly_the_inputs_it_recorded():
    """Every frozen fact has the same inputs still, for every probe (a new fact is an addition)."""
    frozen, now = json.loads(FROZEN.read_text()), observed()
    assert not set(frozen["inputs"]) - set(now["inputs"]), "facts no longer found"
    for fact, answers in frozen["inputs"].items():
        for kwargs, expected in answers.items():
            assert now["inputs"][fact][kwargs] == expected, (fact, kwargs)
