"""Building and loading the id maps' C library (``idhash.c``, called from ``native.py``).

The library is built once per source version with the system C compiler (``$CC``, else ``cc``)
into this package's directory, or where that is not writable into ``$XDG_CACHE_HOME`` (default
``~/.cache``) ``/dlrm-disagg``; ``make setup`` and the Docker image build it ahead. Without a
compiler the maps run their torch code (same results, slower) and say so once in the log.
``DLRM_IDMAP_KERNEL``: ``auto`` (default: C when it builds), ``torch`` (never C), ``native``
(C or an error: CI sets it, so that a broken build cannot pass unnoticed).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from dlrm_core.errors import ConfigError

log = logging.getLogger(__name__)

_P = ctypes.c_void_p
_I = ctypes.c_int64
SOURCE = Path(__file__).with_name("idhash.c")
ENV = "DLRM_IDMAP_KERNEL"
BUILD_TIMEOUT_S = 120.0
"""The longest a compile may take (it takes about a second)."""


def _candidates(tag: str) -> list[Path]:
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlrm-disagg"
    return [SOURCE.with_name(f"_idhash-{tag}.so"), cache_root / f"_idhash-{tag}.so"]


def _compile(target: Path) -> None:
    """Build the library at ``target`` (a temporary file renamed into place: concurrent builds
    never load a half-written file)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc, gcc or $CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, "-O3", "-std=c99", "-shared", "-fPIC", "-o", tmp, str(SOURCE)],
            check=True,
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
        )
        os.replace(tmp, target)
    except subprocess.CalledProcessError as e:
        raise OSError(f"{cc} failed: {e.stderr.decode(errors='replace')[-500:]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build() -> Path:
    """The library's path, compiled now unless a build of this source exists.

    Raises:
        OSError: no compiler, a failed compile, or no writable place for the library.
    """
    tag = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:12]
    places = _candidates(tag)
    for path in places:
        if path.exists():
            return path
    errors = []
    for path in places:
        try:
            _compile(path)
            for old in path.parent.glob("_idhash-*.so"):  # builds of earlier sources
                if old != path:
                    old.unlink(missing_ok=True)
            return path
        except (OSError, subprocess.TimeoutExpired) as e:
            errors.append(f"{path.parent}: {e}")
    raise OSError("; ".join(errors))


@cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None where ``DLRM_IDMAP_KERNEL`` says torch or (auto) it cannot
    be built.

    Raises:
        ConfigError: ``DLRM_IDMAP_KERNEL`` is not auto / torch / native, or is native and the
            library cannot be built.
    """
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "torch", "native"):
        raise ConfigError(f"{ENV}={mode!r}: expected auto, torch or native")
    if mode == "torch":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except OSError as e:
        if mode == "native":
            raise ConfigError(
                f"{ENV}=native but the id maps' C kernel cannot be built: {e}"
            ) from None
        log.warning(
            "id maps: the C kernel cannot be built (%s); using the torch version (slower)", e
        )
        return None
    lib.idhash_probe.argtypes = [_P, _P, _P, _I, _P, _I, _P, _I, _P, _P]
    lib.idhash_probe.restype = None
    lib.idhash_place.argtypes = [_P, _P, _P, _P, _P, _I, _I, _P, _P]
    lib.idhash_place.restype = _I
    lib.idhash_victims.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P]
    lib.idhash_victims.restype = _I
    lib.idhash_sketch_add.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _P]
    lib.idhash_sketch_add.restype = None
    lib.idhash_find_touch.argtypes = [_P, _P, _P, _P, _I, _P, _P, _P, _P, _P, _I, _P, _P]
    lib.idhash_find_touch.restype = _I
    lib.idhash_release.argtypes = [
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        _I,
        _I,
        _I,
        _P,
        _P,
        _P,
        _I,
        _I,
        _I,
        _I,
    ]
    lib.idhash_release.restype = _I
    lib.idhash_take.argtypes = [_P, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P]
    lib.idhash_take.restype = _I
    for name in ("rows_gather", "rows_scatter"):
        getattr(lib, name).argtypes = [_P, _I, _I, _P, _I, _P]
        getattr(lib, name).restype = _I
    lib.idhash_rebuild.argtypes = [_P, _P, _P, _I, _I, _I, _P, _P, _P, _P]
    lib.idhash_rebuild.restype = _I
    lib.rows_copy.argtypes = [_P, _I, _I, _P, _P, _I]
    lib.rows_copy.restype = _I
    lib.rows_fill_f32.argtypes = [_P, _I, _I, _P, _I, ctypes.c_float]
    lib.rows_fill_f32.restype = _I
    return lib
