"""A package's public names imported on first use (a module ``__getattr__``, PEP 562).

A package whose ``__init__`` imported its submodules' names eagerly would import torch for whoever imports
any one of its modules; ``dsv4cp sweep SPEC --dry-run`` reads torch-free ones only (:mod:`dsv4cp.choices`,
the row-split checks of :mod:`dsv4cp.cp.partition`). A public name must not be a submodule's name too (a
submodule, once imported, is an attribute of its package that hides the lazy name). Standard library only.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, public: Mapping[str, str]) -> Callable[[str], object]:
    """The ``__getattr__`` of ``package`` (its ``__name__``, while it is being imported): each name of
    ``public`` (-> the module defining it) is imported on first use, then kept in the package."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> object:
        if name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(public[name]), name)
        return value

    return __getattr__
