"""Loads UCX, then the native extension (which is built without an rpath).

`libucx.load_library()` dlopens the wheel's UCX, or a system UCX (with
InfiniBand verbs) first when RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true; the
extension then binds to whichever libucp.so.0 is already loaded.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import libucx  # noqa: E402

libucx.load_library()

try:
    from . import _native  # noqa: E402
except ImportError as exc:  # pragma: no cover - depends on how it was installed
    raise ImportError(
        f"distore_ucx's native extension could not be loaded ({exc}). If you are running "
        "from a source checkout, install the package (pip install .) and run from another "
        "directory; if UCX failed to load, check RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"
    ) from exc

__all__ = ["_native"]
