"""The shared secret ([auth] in distore.toml): reading the token file every
connection proves."""

from __future__ import annotations

import logging
import os
import stat

from ..errors import ConfigError

# The package's logger, so that its lines name distore_ucx.config as they always have.
log = logging.getLogger(__package__)

MIN_TOKEN_BYTES = 16


def token_path(path: str | None) -> str | None:
    """The token file a connection reads: `path`, else $DISTORE_TOKEN_FILE,
    else None (no token). A client remembers it, so that what it hands to
    other processes (a pickled replay buffer) names the file it read."""
    return path or os.environ.get("DISTORE_TOKEN_FILE") or None


def read_token(path: str | None) -> bytes | None:
    """The shared secret in `path` (or in $DISTORE_TOKEN_FILE when path is
    None); None when neither is set. Surrounding whitespace is ignored.

    The environment is read here in config, as everywhere below the
    command-line programs, so that library users get the same token the
    command line would use.

    Like ssh with a private key, it warns (logger ``distore_ucx.config``)
    when the file is readable or writable by its group or by others: anyone
    who can read the token can join the store.
    """
    path = token_path(path)
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            token = fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path!r}: {exc.strerror}") from None
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(
            f"the token in {path!r} is {len(token)} bytes; use at least {MIN_TOKEN_BYTES} "
            "(e.g. (umask 077; head -c 32 /dev/urandom | base64 > FILE))"
        )
    if stat.S_ISREG(mode) and mode & 0o077:
        who = " and ".join(w for w, bits in (("its group", 0o070), ("others", 0o007))
                           if mode & bits)
        log.warning("the token file %s is accessible to %s (mode %04o): anyone who can read "
                    "it can join the store. Run: chmod 600 %s", path, who,
                    stat.S_IMODE(mode), path)
    return token
