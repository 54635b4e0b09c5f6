"""Each pyinfra internal we rely on (freetoken_infra.core.pyinfra_internals.INTERNALS) is still
what we expect in the installed pyinfra; a release that changes one fails here, by name."""

import subprocess
import sys

import pytest

from freetoken_infra.core import pyinfra_internals


@pytest.mark.parametrize("name", sorted(pyinfra_internals.INTERNALS))
def test_pyinfra_internal_is_as_we_use_it(name):
    # In a child: importing pyinfra_cli monkey-patches the interpreter for gevent.
    code = ("import sys; from freetoken_infra.core import pyinfra_internals as p\n"
            "try:\n    p.INTERNALS[sys.argv[1]]()\n"
            "except (AssertionError, ImportError, AttributeError, TypeError, ValueError) as exc:\n"
            "    sys.exit(repr(exc))\n")
    result = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (f"pyinfra changed an internal we rely on: {name} ({result.stderr.strip()}); "
                                    "see freetoken_infra/core/pyinfra_internals.py")


def test_a_changed_internal_fails_naming_it(monkeypatch):
    import pyinfra.api.facts

    def renamed(state, host, fact_cls, args, kwargs):  # a release renaming one parameter
        raise AssertionError("unused")

    monkeypatch.setattr(pyinfra.api.facts, "_handle_fact_kwargs", renamed)
    name = next(n for n in pyinfra_internals.INTERNALS if "_handle_fact_kwargs" in n)
    with pytest.raises(AssertionError):
        pyinfra_internals.INTERNALS[name]()

