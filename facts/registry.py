"""The two fact registries, derived from what each fact declares beside itself
(``facts/_declare.py``): the classes of the ``facts`` package, found by walking it, and the
pyinfra facts of ``facts/pyinfra_reads.py``.

- ``argument_shapes()``: argument name -> shape, for the learned list's allow-list
  (``facts/batch.py`` ``ARGUMENT_SHAPES``);
- ``fast_check_inputs()``: "module:Class" -> its declared inputs (``facts/inputs.py``).

A fact that declares no inputs is absent from the second (its inputs are not known; a unit test
names it), an argument without a shape from the first. Both are computed once, on first use:
this module imports every fact module, so no fact module may import it.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any

from pyinfra.api.facts import FactBase

import facts
from facts._declare import Declared, Shape
from facts.pyinfra_reads import PYINFRA_READS


@functools.cache
def fact_classes() -> dict[str, type[FactBase]]:
    """Every fact class of the ``facts`` package ("module:Class" -> class): the classes each
    module defines (not those it imports)."""
    found: dict[str, type[FactBase]] = {}
    for info in sorted(pkgutil.iter_modules(facts.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{facts.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, FactBase) and value.__module__ == module.__name__:
                found[f"{module.__name__}:{value.__qualname__}"] = value
    return found


def _declarations() -> dict[str, Any]:
    """ "module:Class" -> what declares for it (a fact class, or a pyinfra fact's entry)."""
    return {**fact_classes(), **PYINFRA_READS}


@functools.cache
def argument_shapes() -> dict[str, Shape]:
    """Every declared argument name and its shape (``union_of_shapes`` of every fact's)."""
    return union_of_shapes(_declarations())


def union_of_shapes(declarations: dict[str, Any]) -> dict[str, Shape]:
    """The argument shapes ``declarations`` ("module:Class" -> what carries ``argument_shapes``)
    declare. One name is one shape across all facts (the batch checks an argument by its name):
    two facts that disagree are an error naming both."""
    shapes: dict[str, Shape] = {}
    owner: dict[str, str] = {}
    for fact, declares in declarations.items():
        for name, shape in (getattr(declares, "argument_shapes", None) or {}).items():
            if name in shapes and shapes[name] is not shape:
                raise ValueError(
                    f"{fact} declares its argument {name!r} with another shape than {owner[name]} "
                    f"({getattr(shape, '__name__', shape)} and {getattr(shapes[name], '__name__', shapes[name])}): "
                    "an argument's name has one shape in every fact"
                )
            shapes[name] = shape
            owner.setdefault(name, fact)
    return shapes


@functools.cache
def fast_check_inputs() -> dict[str, Declared]:
    """Every fact that declares its inputs ("module:Class" -> ``Inputs``, a function of its
    arguments, or ``Unknown``)."""
    declared: dict[str, Declared] = {}
    for fact, declares in _declarations().items():
        value = getattr(declares, "fast_check_inputs", None)
        if value is not None:
            declared[fact] = value
    return declared
