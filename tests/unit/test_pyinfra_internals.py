"""Each pyinfra internal we rely on (freetoken_infra.core.pyinfra_internals.INTERNALS) is still
what we expect in the installed pyinfra; a release that changes one fails here, by name."""

import subprocess
import sys

import pytest

from freetoken_infra.core import pyinfra_internals


@pytest.mark.parametrize("name", sorted(pyinfra_internals.INTERNALS))
def test_pyinfra_internal_is_as_we_use_it(name):
    # In a child: importing pyinfra_cli monkey-patches the interpreter for gevent.
    code = (
        "import sys; from freetoken_infra.core import pyinfra_internals as p\n"
        "try:\n    p.INTERNALS[sys.argv[1]]()\n"
        "except (AssertionError, ImportError, AttributeError, TypeError, ValueError) as exc:\n"
        "    sys.exit(repr(exc))\n"
    )
    result = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (
        f"pyinfra changed an internal we rely on: {name} ({result.stderr.strip()}); "
        "see freetoken_infra/core/pyinfra_internals.py"
    )


def test_a_changed_internal_fails_naming_it(monkeypatch):
    import pyinfra.api.facts

    def renamed(state, host, fact_cls, args, kwargs):  # a release renaming one parameter
        raise AssertionError("unused")

    monkeypatch.setattr(pyinfra.api.facts, "_handle_fact_kwargs", renamed)
    name = next(n for n in pyinfra_internals.INTERNALS if "_handle_fact_kwargs" in n)
    with pytest.raises(AssertionError):
        pyinfra_internals.INTERNALS[name]()


def _code_only(path):
    """The file's code without its comments and strings (which may name an internal)."""
    import io
    import tokenize

    with open(path, encoding="utf-8") as f:
        tokens = [t for t in tokenize.generate_tokens(f.readline) if t.type not in (tokenize.COMMENT, tokenize.STRING)]
    return tokenize.untokenize(tokens) if tokens else io.StringIO().getvalue()


def test_no_other_module_touches_a_pyinfra_internal():
    """Private pyinfra names (`pyinfra... _x`), Host patching, the running operation's arguments, the
    State's host sets and operations, Config.DIFF and anything of pyinfra's CLI package
    (`pyinfra_cli`: its inventory loader, errors, value parsing) appear only in the internals
    module."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in [
        *root.glob("facts/*.py"),
        *root.glob("operations/*.py"),
        *root.glob("freetoken_infra/**/*.py"),
        *root.glob("deploys/*.py"),
        root / "config.py",
    ]:
        if path.name == "pyinfra_internals.py":
            continue
        text = _code_only(path)
        if re.search(
            r"from pyinfra[\w.]* import _\w|pyinfra_cli\.cli\.|Host\.\w+ = |setattr\(Host"
            r"|current_op_global_arguments|\.activated_hosts|\.active_hosts|\.failed_hosts|state\.ops\b"
            r"|config\.DIFF|pyinfra_cli",
            text,
        ):
            offenders.append(str(path.relative_to(root)))
    assert not offenders, offenders


def test_files_operations_print_their_diff_through_our_mask():
    """pyinfra's files.put prints its ``--diff`` with ``generate_color_diff``, looked up by name in
    pyinfra.operations.files at call time: after ``mask_file_diffs`` it sees masked lines only."""
    code = (
        "from freetoken_infra.core import pyinfra_internals as p\n"
        "import pyinfra.operations.files as f\n"
        "p.mask_file_diffs(lambda cur, new: ([l.replace('old', 'A') for l in cur], [l.replace('new', 'B') for l in new]))\n"
        "p.mask_file_diffs(lambda cur, new: (cur, new))  # once per process: a second call changes nothing\n"
        "print('|'.join(f.generate_color_diff(['k=old\\n'], ['k=new\\n'])))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (
        "old" not in result.stdout and "new" not in result.stdout and "k=A" in result.stdout and "k=B" in result.stdout
    )


def test_operation_introspection_gives_what_pyinfra_computes(tmp_path):
    """After ``cache_operation_introspection`` pyinfra places each operation where it did before
    (order from the deploy file's line numbers, a frame pyinfra executes from a file that is no
    module, as the CLI does), each call from its own line (nothing kept from an earlier call),
    and ``all_global_arguments`` is pyinfra's own answer, a fresh list at each call."""
    deploy = tmp_path / "deploy.py"
    deploy.write_text(
        "def op_at(depth):\n"
        "    if depth:\n"
        "        return op_at(depth - 1)\n"
        "    return util.get_operation_order_from_stack(state), util.get_call_location(frame_offset=0)\n"
        "def first():\n"
        "    return op_at(2)\n"
        "def second():\n"
        "    return op_at(3)\n"
    )
    code = (
        "import sys, typing, pyinfra\n"
        "from pyinfra.api import Config, Inventory, State, util, arguments\n"
        "from freetoken_infra.core import pyinfra_internals as p\n"
        "state = State(Inventory((['ws1'], {})), Config())\n"
        "pyinfra.is_cli = True\n"
        f"path = {str(deploy)!r}\n"
        "state.current_deploy_filename = path\n"
        "g = {'util': util, 'state': state}\n"
        "exec(compile(open(path).read(), path, 'exec'), g)\n"
        "before = [g['first'](), g['second']()]\n"
        "assert before[0] != before[1], before\n"
        "p.cache_operation_introspection()\n"
        "p.cache_operation_introspection()  # once per process: a second call changes nothing\n"
        "after = [g['first'](), g['second'](), g['first']()]\n"
        "assert after == [*before, before[0]], (before, after)\n"
        "hints = list(typing.get_type_hints(arguments.AllArguments).items())\n"
        "got = arguments.all_global_arguments()\n"
        "assert got == hints and len(got) > 20\n"
        "got.clear()\n"
        "assert arguments.all_global_arguments() == hints  # a caller's change is its own\n"
        "print(before)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "deploy.py" in result.stdout


def test_connector_data_keys_are_the_installed_connectors_own():
    """Computed once per process: the same keys the connectors declare, and no caller can change
    what the next caller gets."""
    from pyinfra.api.connectors import get_all_connectors

    fresh = set()
    for connector in get_all_connectors().values():
        fresh.update(getattr(connector, "data_meta", {}) or {})
    keys = pyinfra_internals.connector_data_keys()
    assert keys == fresh and isinstance(keys, frozenset)
    assert pyinfra_internals.connector_data_keys() is keys
