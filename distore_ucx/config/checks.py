"""What the processes refuse at start, checked before they start.

:func:`check_exposure` is the rule both processes apply (no listening beyond
loopback without a token, unless told); :func:`check_file` is
`distore config check`: a distore.toml's problems, including what start
would refuse with it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .settings import BY_NAME
from .toml_file import Problem, load_file, locate


def is_loopback(host: str) -> bool:
    """Whether listening on `host` is reachable from this machine only
    ("" and 0.0.0.0 mean every interface; a name counts when every address it
    resolves to is loopback)."""
    import ipaddress
    import socket

    if host in ("", "0.0.0.0", "::", "*"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_exposure(role: str, host: str, token_file: str, insecure: bool) -> str | None:
    """Refuse to listen beyond loopback without a token, unless `insecure`.

    Returns the warning to log loudly when a non-loopback address is served
    without a token because `insecure` was given; None when all is well.
    Raises ConfigError otherwise, saying what to pass.
    """
    if is_loopback(host) or token_file:
        return None
    where = host or "every interface"
    if not insecure:
        raise ConfigError(
            f"refusing to run the {role} on {where} without a token: anyone who can reach "
            "it could read and overwrite the store. Pass --token-file FILE (the same file "
            "to every process; make one with: "
            "(umask 077; head -c 32 /dev/urandom | base64 > FILE)), "
            "or --insecure on a trusted, isolated network, or listen on loopback "
            "(--host 127.0.0.1)"
        )
    return (f"INSECURE: the {role} listens on {where} without a token (--insecure): anyone "
            "who can reach this address can read, insert and delete data. Use --token-file "
            "FILE outside trusted, isolated networks")


# What a process refuses at start depends on these, from the file or DISTORE_*.
_START_SETTINGS = ("auth.token_file", "auth.insecure", "control.host", "node.host",
                   "control.checkpoint")


def check_file(path: str, environ: Mapping[str, str] | None = None) -> list[Problem]:
    """Problems of a distore.toml (empty when it is valid); for `distore config check`.

    Besides each value on its own, it reports what `distore control` and
    `distore node` would refuse at start with this file and `environ` (the
    DISTORE_* variables the CLI passes; none by default): listening beyond
    loopback without a token, a checkpoint folder that cannot be made.
    """
    values, problems = load_file(path)
    if problems:
        return problems
    for name in _START_SETTINGS:
        s = BY_NAME[name]
        if (environ or {}).get(s.variable, "") != "":
            try:
                values[name] = s.parse(environ[s.variable])
            except ValueError as exc:
                problems.append(Problem(s.variable, str(exc)))
    return problems or _refused_at_start(path, values)


def _refused_at_start(path: str, values: dict[str, Any]) -> list[Problem]:
    """What the processes refuse at start given these values (flags may still
    supply what is missing: this file is meant to be enough)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        lines = []

    def where(section: str, key: str) -> str:
        line = locate(lines, section, key)
        return f"{path}:{line} [{section}] {key}" if line else f"{path} [{section}] {key}"

    def value(name: str) -> Any:
        return values.get(name, BY_NAME[name].default)

    problems = []
    token, insecure = value("auth.token_file"), value("auth.insecure")
    for role, section in (("control plane", "control"), ("storage node", "node")):
        host = values.get(f"{section}.host")
        if not host:  # the default, or a flag's: loopback, or not this file's to say
            continue
        try:
            check_exposure(role, host, token, insecure)
        except ConfigError:
            problems.append(Problem(
                where(section, "host"),
                f"the {role} would listen on {host} and refuses to without a token: set "
                "token_file under [auth] (the same file on every host; make one with "
                "(umask 077; head -c 32 /dev/urandom | base64 > FILE)), or insecure = true "
                "under [auth] on a trusted, isolated network"))
    checkpoint = value("control.checkpoint")
    if checkpoint:
        folder = os.path.dirname(os.path.abspath(checkpoint))
        parent = folder
        while not os.path.isdir(parent):
            parent = os.path.dirname(parent)
        if parent != folder and not os.access(parent, os.W_OK | os.X_OK):
            problems.append(Problem(
                where("control", "checkpoint"),
                f"the folder {folder} does not exist and this user cannot make it ({parent} "
                "is not writable): create it, or choose a checkpoint path in a folder "
                "this user can write (distore control makes a missing folder when it can)"))
        elif parent == folder and not os.access(folder, os.W_OK | os.X_OK):
            problems.append(Problem(
                where("control", "checkpoint"),
                f"this user cannot write in {folder}: the control plane could not write "
                "its checkpoints there"))
    return problems
