"""A user's class named 'module:Class' (`--backend`, `--forward`), loaded as `python -m` would
find it: modules in the current directory included.

`class_spec` is the inverse: the 'module:Class' a dump records for a class or an instance, which
`load_class` loads back (a nested class as 'module:Outer.Inner').
"""

from __future__ import annotations

import importlib
import os
import sys


def load_class(spec: str, what: str) -> type:
    """The class `spec` ('package.module:Class', or 'module:Outer.Inner') names; a ValueError that
    starts with `what` (the option it came from, e.g. "backend") and says which part failed: a
    malformed spec, a module that cannot be imported, a missing attribute, or one that is not a
    class."""
    if not isinstance(spec, str):
        raise TypeError(f"{what}: expected 'module:Class', got {spec!r} ({type(spec).__name__})")
    module_name, sep, qualname = spec.partition(":")
    names = qualname.split(".")
    if not sep or not module_name or not all(n.isidentifier() for n in names):
        raise ValueError(f"{what}: expected 'module:Class', got {spec!r}")
    if os.getcwd() not in sys.path:  # a user's module in the current directory
        sys.path.insert(0, os.getcwd())
    try:
        found: object = importlib.import_module(module_name)
    except ImportError as exc:  # also an import that fails inside the user's module
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0]:
            hint = (
                f"; modules are looked up in the current directory ({os.getcwd()}) and on "
                "PYTHONPATH: run from the directory that holds it, or add that to PYTHONPATH"
            )
        raise ValueError(
            f"{what} {spec!r}: cannot load it (import {module_name}: {exc}){hint}"
        ) from exc
    for i, name in enumerate(names):
        if not hasattr(found, name):
            owner = ".".join([module_name, *names[:i]])
            raise ValueError(f"{what} {spec!r}: cannot load it ({owner} has no {name!r})")
        found = getattr(found, name)
    if not isinstance(found, type):
        raise ValueError(
            f"{what} {spec!r}: expected a class, got {type(found).__name__} {found!r:.80}"
        )
    return found


def class_spec(obj: object) -> str:
    """'module:Class' of a class, or of an instance's class (what `load_class` takes back)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"
