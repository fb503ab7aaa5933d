"""Starting a distore role (control plane, storage node) as a child process
and knowing when it serves: one helper for LocalCluster, the Ray launcher and
the roles themselves.

The child is `python -m distore_ucx ROLE ... --ready-file PATH`; once it
serves it writes PATH (atomically, `write_ready`) with what its parent needs
(address, node id, pid); the parent polls for it with a deadline
(`wait_ready`) and, if the child exits first, raises with the child's log.
The child is killed by the kernel if its parent dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConnectionFailed, Timeout


def _die_with_parent() -> None:
    # Runs in the child before exec: SIGKILL it if the parent goes away.
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


@dataclass
class Process:
    """One process of the cluster, as `spawn` started it.

    Attributes:
        role: Its name: "control", "node0", ...
        popen: Its `subprocess.Popen`.
        log_path: The file its output goes to.
        ready_file: The file it writes once it serves.
        info: What it wrote there (address, node id, pid), once read.
    """

    role: str
    popen: subprocess.Popen
    log_path: str
    ready_file: str
    info: dict | None = None

    @property
    def pid(self) -> int:
        """Its process id."""
        return self.popen.pid

    def alive(self) -> bool:
        """Whether it is still running."""
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        """The last `lines` lines of its log ("" when it cannot be read)."""
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return ""


def spawn(role: str, args: list[str], directory: str,
          env: Mapping[str, str] | None = None) -> Process:
    """Start `python -m distore_ucx ARGS --ready-file DIR/ROLE.ready`, its
    output to DIR/ROLE.log, in DIR (never a source checkout, whose
    uncompiled package would shadow the installed one)."""
    log_path = os.path.join(directory, f"{role}.log")
    ready = os.path.join(directory, f"{role}.ready")
    cmd = [sys.executable, "-m", "distore_ucx", *args, "--ready-file", ready]
    with open(log_path, "wb") as out:
        popen = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
            cwd=directory,
            preexec_fn=_die_with_parent,
        )
    return Process(role, popen, log_path, ready)


def wait_ready(proc: Process, timeout: float) -> dict:
    """Wait until `proc` writes its ready file; its contents. Raises with the
    process's log if it exits first or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while time.monotonic() < deadline:
        if os.path.exists(proc.ready_file):
            with open(proc.ready_file) as fh:
                return json.load(fh)
        if not proc.alive():
            raise ConnectionFailed(
                f"{proc.role} exited with code {proc.popen.returncode} while starting; "
                f"its log ({proc.log_path}):\n{proc.log_tail()}"
            )
        time.sleep(delay)  # polling a file with a deadline; backs off to 50 ms
        delay = min(delay * 2, 0.05)
    raise Timeout(
        f"{proc.role} did not become ready within {timeout} s; its log:\n"
        f"{proc.log_tail()}"
    )


def write_ready(path: str, info: dict) -> None:
    """Tell the parent this process serves: `info` as JSON in `path`,
    written atomically so that the parent never reads half of it."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(info, fh)
    os.replace(tmp, path)


__all__ = ["Process", "spawn", "wait_ready", "write_ready"]
