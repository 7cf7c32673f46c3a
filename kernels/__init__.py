"""Compute kernels: one op per file, each with a public launcher, private Triton kernels and
a `*_ref` torch implementation that is its spec (and the CPU path).

Imports only torch and triton.
"""

import sys as _sys

if __name__ == "kernels":  # pragma: no cover - exercised through transformers in a subprocess
    # This directory is `pagebus.kernels`. Run from the checkout (`python -m ...`, sys.path[0] is the
    # repo root) it is also found as a top-level `kernels`, the import name of Hugging Face's
    # `kernels` distribution, which transformers >= 5.25 depends on and imports: hand that name
    # over to the installed distribution (where there is none, stay an empty stand-in, as before).
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(
        "kernels", [p for p in _sys.path if _os.path.abspath(p or ".") != _root]
    )
    if _spec is not None and _spec.loader is not None:
        _real = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _real
        _spec.loader.exec_module(_real)
