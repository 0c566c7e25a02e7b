"""One module per op: checks, launcher, reference and public function.

Every module of this package not starting with ``_`` is an op module, imported here
without being listed: importing it registers its kernels (mlx_metaltile._registry), and
the names in its ``__all__`` (the op, named as the module, and its reference) are
exported from this package; the op itself also from ``mlx_metaltile``.
"""

from __future__ import annotations

import importlib
import pkgutil

OPS: dict = {}  # op name -> the public op function
__all__ = ["OPS"]

for _info in pkgutil.iter_modules(__path__):
    if _info.name.startswith("_"):
        continue
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    OPS[_info.name] = getattr(_module, _info.name)
    for _name in _module.__all__:
        globals()[_name] = getattr(_module, _name)
    __all__ += _module.__all__
