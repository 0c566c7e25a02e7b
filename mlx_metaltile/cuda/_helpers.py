"""A kernel's translated MSL helpers as a file of the on-disk cache, included by path.

MLX hashes a custom kernel's whole source (header and body) on every launch to find its
compiled module, at about 6 GB/s of host time, and copies it into each launch's record. A
kernel's helpers (common.h and the template's own, translated) are 4 to 9 KB of that text;
written to a file once and ``#include``d by absolute path, they leave one line per launch.

The file is an entry of the package's cache (``emulator/_cache.py``, area ``cuda``): a
private folder of the current user, installed atomically, with a record of its SHA-256 that
is checked before the file is used, and rebuilt when it does not match. Its name carries the
digest of its text, so MLX's on-disk PTX cache (keyed by the source's hash, which includes
the path) never serves a module compiled from other helpers. Where the cache cannot be used,
the helpers stay in the source (a warning says why, once per process), as the compat header
does where the package is not a plain folder on disk. A file removed while the process runs
(a cleared cache) is written back when a launch is prepared (``restore``).
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

from ..emulator import _cache

FILE = "helpers.cuh"
# Helpers shorter than this stay in the source: hashing them costs less than the file
# lookup at compile time is worth.
MIN_FILED = 1024

_lock = threading.Lock()
_included: dict[tuple[object, str], str] = {}  # (configured folder, text) -> header text
_filed_texts: dict[str, tuple[Path, str]] = {}  # include line -> (its file, the helpers)
_warned = False


def helpers_header(text: str) -> str:
    """The header text that stands for ``text`` (``translate_helpers``' output) in a
    kernel: ``#include "<cache entry>/helpers.cuh"``, or ``text`` itself where it is short or
    the cache cannot be used."""
    if len(text) < MIN_FILED:
        return text
    key = (_cache.configured_folder("cuda"), text)
    with _lock:
        header = _included.get(key)
        if header is None:
            header = _included[key] = _filed(text)
    return header


def _filed(text: str) -> str:
    global _warned
    try:
        file = _cache_file(text, _cache.folder("", area="cuda"))
    except (_cache.CacheError, OSError) as e:
        if not _warned:
            _warned = True
            warnings.warn(f"[cuda] kernel helpers stay in each kernel's source (hashed by MLX "
                          f"on every launch): the cache cannot be used: {e}", RuntimeWarning,
                          stacklevel=4)
        return text
    path = str(file)
    if any(c in path for c in '"\n\\'):  # not a path an #include line can spell
        return text
    header = f'#include "{path}"\n'
    _filed_texts[header] = (file, text)
    return header


def restore(header: str) -> None:
    """Write back the file ``header`` (``helpers_header``'s) includes if it is gone (the
    cache cleared while the process runs): the same text, checked, at the same path. Called
    when a launch is prepared, before MLX compiles anything that includes it."""
    filed = _filed_texts.get(header)
    if filed is None or filed[0].is_file():
        return
    path, text = filed
    with _lock:
        try:
            again = _cache_file(text, _cache.folder("", area="cuda"))
        except (_cache.CacheError, OSError) as e:
            raise RuntimeError(f"[cuda] the kernel helpers file {path} was removed and cannot "
                               f"be written again: {e}") from None
    if again != path:
        raise RuntimeError(f"[cuda] the kernel helpers file {path} was removed, and the cache "
                           f"folder is now elsewhere ({again}): MLX_METALTILE_CACHE changed "
                           "while the process ran; restart it")


def _cache_file(text: str, parent: Path) -> Path:
    """The checked cache file holding ``text`` in ``parent`` (written if missing or not
    what its record says)."""
    digest = _cache.digest(text)
    entry = _cache.entry(parent, f"helpers-{digest[:24]}", digest,
                         lambda folder: (folder / FILE).write_text(text, encoding="utf-8"))
    return entry / FILE
