"""The emulator's on-disk cache: where it is, who may write it, and entries that are checked
before anything in them is loaded.

Module names are computable by anyone, and loading a module runs its code, so:

* the cache folder, every entry and every file in it must belong to the current user and
  must not be writable by group or others (as SSH and Python's own caches require); anything
  else is refused with an error naming the folder and the fix;
* every entry is a folder built in a private ``build-*`` folder and renamed into place
  (atomic, so concurrent processes share the cache), holding a record written at build time:
  the full hash of what it was built from and a content hash of each file. An entry is
  loaded only after the record and every hash check; one that fails (truncated, overwritten,
  another entry under this name) is rebuilt, with a warning;
* ``build-*`` folders left by killed processes are removed once they are older than
  STALE_AFTER_S and no build holds their lock;
* a cache folder this process cannot write falls back to a private temporary cache (with a
  warning, once).

The folder is ``$MLX_METALTILE_CACHE/emulator``, by default the user cache folder
(platformdirs: ``~/.cache/mlx_metaltile`` or ``$XDG_CACHE_HOME`` on Linux,
``~/Library/Caches/mlx_metaltile`` on macOS). The CUDA layer keeps its kernels' helper
headers under the same rules in the sibling area ``cuda`` (``mlx_metaltile/cuda/_helpers.py``).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import platformdirs

from ._errors import EmulatorError

STALE_AFTER_S = 600
RECORD = "record.json"
_LOCK = ".lock"


class CacheError(EmulatorError):
    """The cache cannot be used safely (a folder or file others can write, or not ours), or
    a build failed for a reason outside the kernel (a full disk)."""


def configured_folder(area: str = "emulator") -> Path:
    """The cache folder of ``area`` (emulator, cuda) as configured (MLX_METALTILE_CACHE, or
    the user cache)."""
    base = os.environ.get("MLX_METALTILE_CACHE")
    root = Path(base) if base else Path(platformdirs.user_cache_dir("mlx_metaltile"))
    return root / area


def check_private(path: Path) -> None:
    """Refuse a cache folder or file that is not the current user's or that group or others
    may write."""
    st = os.stat(path)
    kind = "folder" if stat.S_ISDIR(st.st_mode) else "file"
    if st.st_uid != os.geteuid():
        raise CacheError(f"[mlx_metaltile] the cache {kind} {path} belongs to user id {st.st_uid}, "
                         f"not to this process's user ({os.geteuid()}): code planted there "
                         f"would run as you. Remove it, or set MLX_METALTILE_CACHE to a folder "
                         f"of your own.")
    if st.st_mode & 0o022:
        raise CacheError(f"[mlx_metaltile] the cache {kind} {path} is writable by group or others "
                         f"(mode {stat.S_IMODE(st.st_mode):o}): code planted there would run "
                         f"as you. Run `chmod go-w {path}`, or set MLX_METALTILE_CACHE to a "
                         f"private folder.")


def disk_full(folder: Path) -> CacheError:
    return CacheError(f"[mlx_metaltile] no space left on the device holding the cache folder "
                      f"{folder}: free some space (or set MLX_METALTILE_CACHE to another "
                      f"folder) and run again")


_lock = threading.Lock()
_roots: dict[Path, Path] = {}  # configured folder -> folder in use


def root(area: str = "emulator") -> Path:
    """The cache folder of ``area`` in use, created and checked (once per configured
    folder)."""
    want = configured_folder(area)
    with _lock:
        got = _roots.get(want)
        if got is None:
            got = _open(want, area)
            _roots[want] = got
    return got


def _open(want: Path, area: str) -> Path:
    try:
        want.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=want, prefix="probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise disk_full(want) from None
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        private = Path(tempfile.mkdtemp(prefix=f"mlx_metaltile-{area}-"))
        atexit.register(shutil.rmtree, private, ignore_errors=True)
        warnings.warn(f"[{area}] the cache folder {want} cannot be written ({e.strerror}); "
                      f"this process builds into the private temporary folder {private}, "
                      f"removed at exit. Set MLX_METALTILE_CACHE to a writable folder to keep "
                      f"builds.", RuntimeWarning, stacklevel=3)
        return private
    if os.environ.get("MLX_METALTILE_CACHE"):
        check_private(want.parent)  # the folder named by the user
    check_private(want)
    return want


def folder(name: str, area: str = "emulator") -> Path:
    """A subfolder of ``area``'s cache (created private, checked, stale builds removed).
    Made again, parents too, if the cache was cleared while the process runs."""
    path = root(area) / name if name else root(area)
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(path)
    _clean_stale(path)
    return path


_cleaned: set[Path] = set()


def _clean_stale(path: Path) -> None:
    """Remove build folders that killed processes left behind (once per folder and process)."""
    if path in _cleaned:
        return
    _cleaned.add(path)
    now = time.time()
    for tmp in path.glob("build-*"):
        try:
            if now - tmp.stat().st_mtime < STALE_AFTER_S:
                continue
            fd = os.open(tmp / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a running build holds it
        except OSError:
            os.close(fd)
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


def digest(*parts: str | bytes) -> str:
    """The full hash of what an entry is built from (its name is a prefix of it)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _problem(entry: Path, source: str) -> str | None:
    """Why an entry must not be used (None: it is what its record says). Raises CacheError
    for an entry others can write."""
    check_private(entry)
    try:
        record = json.loads((entry / RECORD).read_text())
        files = record["files"]
        if record["source"] != source:
            return "it was built from other source"
    except (OSError, ValueError, KeyError, TypeError):
        return "its build record is missing or unreadable"
    present = {p.name for p in entry.iterdir()} - {RECORD}
    if not isinstance(files, dict) or present != set(files):
        return "its files differ from its build record"
    check_private(entry / RECORD)
    for name, want in files.items():
        check_private(entry / name)
        if _file_hash(entry / name) != want:
            return f"{name} differs from the file that was built"
    return None


def entry(parent: Path, name: str, source: str, build: Callable[[Path], None]) -> Path:
    """The checked cache entry `parent/name` built from `source` (a digest): reused when its
    record and hashes check out, else built by `build(folder)` (which writes its files into
    the folder it is given) and installed."""
    final = parent / name
    if final.exists():
        problem = _problem(final, source)
        if problem is None:
            return final
        warnings.warn(f"[mlx_metaltile] rebuilding the cache entry {final}: {problem}",
                      RuntimeWarning, stacklevel=3)
        _discard(final)
    try:
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix="build-"))
    except OSError as e:
        raise disk_full(parent) if e.errno == errno.ENOSPC else e from None
    lock = os.open(tmp / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            build(tmp)
            os.unlink(tmp / _LOCK)
            files = {p.name: _file_hash(p) for p in tmp.iterdir()}
            (tmp / RECORD).write_text(json.dumps({"source": source, "files": files}))
        except OSError as e:
            raise disk_full(parent) if e.errno == errno.ENOSPC else e from None
        try:
            os.rename(tmp, final)
        except OSError:
            # another process installed it first
            if not final.exists() or _problem(final, source) is not None:
                raise
    finally:
        os.close(lock)
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _discard(entry_path: Path) -> None:
    """Take a failed entry out of the way (renamed first, so no process sees half of it)."""
    trash = Path(tempfile.mkdtemp(dir=entry_path.parent, prefix="build-discard-"))
    try:
        os.rename(entry_path, trash / "entry")
    except OSError:
        pass  # another process moved it already
    shutil.rmtree(trash, ignore_errors=True)
