"""Loads UCX, then the native extension (which is built without an rpath).

`libucx.load_library()` dlopens the wheel's UCX, or a system UCX (with
InfiniBand verbs) first when RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true; the
extension then binds to whichever libucp.so.0 is already loaded.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import libucx  # noqa: E402

# Loading UCX patches the memory functions (mmap, munmap, mremap, brk,
# madvise, shmat, shmdt) in place, then spins a grace period per function
# patched (UCX_MEM_BISTRO_GRACE_DURATION, 50 ms) for threads that were
# inside one to leave it: 0.4 s of a core in every process that imports
# distore (256 actors: 100 s of CPU). When no other thread of this process
# can be inside one (each is asleep in another system call: numpy's and
# torch's idle thread pools), there is nobody to wait for and it loads with
# none; otherwise, or where that cannot be told, with UCX's default. A
# value the user set is kept, and the one set here is not passed on to
# child processes (they decide for themselves).
_GRACE = "UCX_MEM_BISTRO_GRACE_DURATION"
# The system calls behind the patched functions, by machine (Linux).
_PATCHED = {"x86_64": {9, 11, 12, 25, 28, 30, 67},
            "aarch64": {222, 215, 214, 216, 233, 196, 197}}


def _no_thread_inside_memory_calls() -> bool:
    """Whether every other thread of this process sleeps in a system call
    other than the patched ones (Linux /proc; False where it cannot tell
    or a thread runs)."""
    import platform
    import threading

    patched = _PATCHED.get(platform.machine())
    if patched is None:
        return False
    me = str(threading.get_native_id())
    try:
        for tid in os.listdir("/proc/self/task"):
            if tid == me:
                continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/self/task/{tid}/syscall") as f:
                call = f.read().split()[0]
            if state not in ("S", "D") or not call.isdigit() or int(call) in patched:
                return False
    except (OSError, IndexError):  # a thread that ended meanwhile, or no /proc
        return False
    return True


def _quiet_within(seconds: float) -> bool:
    """_no_thread_inside_memory_calls(), asked again for up to `seconds`: a
    thread pool started a moment ago (numpy's, at its import) is still
    allocating its threads' memory, and asleep soon after."""
    import time

    end = time.monotonic() + seconds
    while not _no_thread_inside_memory_calls():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


_no_grace = _GRACE not in os.environ and _quiet_within(0.05)
if _no_grace:
    os.environ[_GRACE] = "0"
try:
    libucx.load_library()
finally:
    if _no_grace:
        del os.environ[_GRACE]

try:
    from . import _native  # noqa: E402
except ImportError as exc:  # pragma: no cover - depends on how it was installed
    raise ImportError(
        f"distore_ucx's native extension could not be loaded ({exc}). If you are running "
        "from a source checkout, install the package (pip install .) and run from another "
        "directory; if UCX failed to load, check RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"
    ) from exc

__all__ = ["_native"]
