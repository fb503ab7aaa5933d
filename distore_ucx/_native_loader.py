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

from . import _native  # noqa: E402

__all__ = ["_native"]
