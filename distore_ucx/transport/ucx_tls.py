"""What a UCX_TLS value allows: peer-failure detection, shared memory, and
the transports that let a same-host peer write this process's memory.

Read from the string alone, before or without a UCX context: the runtime
skips an endpoint mode UCX would refuse (runtime.py), and a storage node
leaves out the direct-write transports (storage/guard.py).
"""

from __future__ import annotations

# UCX transports that cannot detect a peer's failure (no
# UCP_ERR_HANDLING_MODE_PEER). Only used to skip an attempt that would fail
# and log an error; any other failure falls back at run time.
NO_PEER_FAILURE = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self"}


def shared_memory_only(tls: str) -> bool:
    """Whether `tls` names only transports that cannot detect a peer's failure."""
    names = {t.strip() for t in tls.split(",") if t.strip()}
    return bool(names) and names <= NO_PEER_FAILURE


def allows_shared_memory(tls: str) -> bool:
    """Whether UCX may use shared-memory transports under UCX_TLS=`tls`
    ('all' when unset)."""
    names = {t.strip().lstrip("^") for t in tls.split(",") if t.strip()}
    if tls.startswith("^") or "all" in names:
        return True
    return bool(names & NO_PEER_FAILURE - {"self"})


# Transports through which a same-host peer writes straight into this
# process's memory, past any UCX handler: cma (process_vm_writev, as the
# kernel lets any process that may ptrace this one), knem, xpmem. A storage
# node leaves them out: its arena reaches same-host learners through the
# sealed read-only mapping (transport/local_map.py) or their own
# process_vm_readv, not through them.
_DIRECT_WRITE = ("cma", "knem", "xpmem")
_SHARED_MEMORY_ALIASES = {"sm", "shm"}


def without_direct_writes(env_tls: str | None) -> str:
    """UCX_TLS (`env_tls` as the environment sets it, config.ucx_tls(), or
    "all") without the transports that let a same-host peer write this
    process's memory directly (see _DIRECT_WRITE): "^cma,knem,xpmem" for
    all, "tcp,posix,sysv" for "tcp,sm"."""
    tls = (env_tls or "").strip() or "all"
    names = [t.strip() for t in tls.lstrip("^").split(",") if t.strip()]
    if tls.startswith("^"):
        return "^" + ",".join(names + [t for t in _DIRECT_WRITE if t not in names])
    if "all" in names:
        return "^" + ",".join(_DIRECT_WRITE)
    out = []
    for name in names:
        expanded = ["posix", "sysv"] if name in _SHARED_MEMORY_ALIASES else [name]
        out += [t for t in expanded if t not in _DIRECT_WRITE and t not in out]
    return ",".join(out) or tls
