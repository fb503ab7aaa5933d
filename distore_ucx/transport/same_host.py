"""Peers on the same host: which host this is, and whether a local process
still runs.

Peers with the same `host_id` share memory transports (CMA, a node's
read-only arena mapping: local_map.py) and can check each other's pids; a
reader that reads a same-host node without UCX's peer-failure handling
watches its process with a `ProcessWatch` instead.
"""

from __future__ import annotations

import os
import select


def host_id() -> str:
    """Identifies this host, pid namespace and network namespace: peers with
    the same id share memory transports and can check each other's pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
        net_ns = os.stat("/proc/self/ns/net").st_ino
        return f"{boot}:{pid_ns}:{net_ns}"
    except OSError:
        return ""


class ProcessWatch:
    """Tells whether a local process still runs, cheaply enough to ask per batch.

    Uses a pidfd (readable once the process has exited, zombie or reaped)
    where the kernel has them, else /proc/PID/stat.
    """

    def __init__(self, pid: int):
        self.pid = pid
        self._fd = None
        self._poll = None
        try:
            self._fd = os.pidfd_open(pid)
            self._poll = select.poll()
            self._poll.register(self._fd, select.POLLIN)
        except (AttributeError, OSError):  # old kernel or Python, or already gone
            self._fd = None

    def fileno(self) -> int | None:
        """The pidfd, readable once the process has exited (so that many
        watches can be polled at once); None where alive() reads /proc."""
        return self._fd

    def alive(self) -> bool:
        """True while the process exists and has not exited."""
        if self._fd is not None:
            return not self._poll.poll(0)
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in (b"Z", b"X")

    def close(self) -> None:
        """Release the pidfd."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()
