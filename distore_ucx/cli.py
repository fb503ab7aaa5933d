"""The `distore` command. The command line and the environment (DISTORE_*,
DISTORE_CONFIG) are read here, and only here, resolved against distore.toml
by config.resolve and passed down as typed configuration.

    distore control --config distore.toml
    distore node --control HOST:7700 --arena 4GiB
    distore status --control HOST:7700 --watch
    distore checkpoint --control HOST:7700
    distore config check distore.toml
    distore demo --seconds 20
    distore doctor
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import sys

from .config import SETTINGS, Settings, check_exposure, check_file, resolve, switches_shown
from .errors import ConfigError, DistoreError

log = logging.getLogger(__name__)

_SERVICES = ("control", "node", "status")


def _add_settings(parser: argparse.ArgumentParser, command: str) -> None:
    """The flags of every setting this subcommand takes (default None = not given)."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="distore.toml to read (env DISTORE_CONFIG)")
    for s in SETTINGS:
        if command not in s.commands:
            continue
        where = f"[{s.section}] {s.key}" if "." in s.name else "[[tables]]"
        text = f"{s.help} (env {s.variable}; {where} in distore.toml)"
        if s.name == "node.hugepages":
            parser.add_argument("--hugepages", dest=s.name, action="store_const", const=True,
                                default=None, help=text)
            parser.add_argument("--no-hugepages", dest=s.name, action="store_const",
                                const=False, help="never use 2 MiB pages")
        elif s.name == "node.prefault":
            parser.add_argument("--prefault", dest=s.name, action="store_const", const=True,
                                default=None, help=text)
            parser.add_argument("--no-prefault", dest=s.name, action="store_const",
                                const=False, help="take the arena's pages as items arrive")
        elif s.name == "node.write_protect":
            parser.add_argument("--write-protect", dest=s.name, action="store_const",
                                const=True, default=None, help=text)
            parser.add_argument("--no-write-protect", dest=s.name, action="store_const",
                                const=False, help="register the arena through its writable "
                                "mapping (transparent hugepages can back it, but software "
                                "transports then accept remote writes)")
        elif s.name in ("control.restore", "auth.insecure", "ucx.system_library"):
            parser.add_argument(s.flag, dest=s.name, action="store_const", const=True,
                                default=None, help=text)
        else:
            parser.add_argument(s.flag, dest=s.name, default=None, metavar="VALUE", help=text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(
        prog="distore", description="distore-ucx replay store",
        epilog="Precedence of every setting: flag > DISTORE_* variable > distore.toml > default.",
    )
    p.add_argument("--log-level", dest="log.level", default=None,
                   help="DEBUG, INFO, WARNING, ERROR (env DISTORE_LOG_LEVEL; [log] level)")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("control", help="run the control plane")
    _add_settings(c, "control")
    c.add_argument("--ready-file", help=argparse.SUPPRESS)

    n = sub.add_parser("node", help="run a storage node")
    _add_settings(n, "node")
    n.add_argument("--ready-file", help=argparse.SUPPRESS)

    s = sub.add_parser("status", help="show nodes, memory and tables with rates")
    _add_settings(s, "status")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--watch", action="store_true", help="refresh every --interval s until ^C")
    s.add_argument("--interval", type=float, default=1.0,
                   help="seconds between the two looks that rates come from (default 1; "
                        "0 = no rates)")

    ck = sub.add_parser("checkpoint", help="make the control plane write a checkpoint now")
    _add_settings(ck, "checkpoint")
    ck.add_argument("--json", action="store_true", help="print JSON")

    _add_config_command(sub)

    d = sub.add_parser("demo", help="run a local cluster with a writer and a verifying learner")
    d.add_argument("--seconds", type=float, default=20.0, help="how long to sample (default 20)")
    d.add_argument("--nodes", type=int, default=2, help="storage nodes (default 2)")
    d.add_argument("--arena", default="1GiB", help="arena per node (default 1GiB)")
    d.add_argument("--batch-size", type=int, default=32, help="items per batch (default 32)")
    d.add_argument("--capacity", type=int, default=8000, help="table capacity (default 8000)")
    d.add_argument("--insert-rate", type=float, default=400.0,
                   help="writer items/s (default 400, DQN on Atari's rate; 0 = flat out)")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")

    b = sub.add_parser("bench", help="run the perf suite (needs a source checkout's perf/)")
    b.add_argument("--out", help="results folder (default ./bench-results/<timestamp>)")
    b.add_argument("--quick", action="store_true", help="short runs of every script")
    b.add_argument("--only", help="comma-separated subset of replay,bandwidth,latency")
    b.add_argument("--perf-dir", help="the perf/ folder (default: beside the package)")

    doc = sub.add_parser("doctor", help="check UCX, GPUs, NICs and hugepages for the sample path")
    doc.add_argument("--json", action="store_true", help="print JSON")
    return p


def _add_config_command(sub) -> None:
    """`distore config check|show [FILE]`."""
    cfg = sub.add_parser("config", help="check or show configuration")
    csub = cfg.add_subparsers(dest="config_command", required=True)
    chk = csub.add_parser("check", help="validate a distore.toml; say what is wrong and where")
    chk.add_argument("file", nargs="?", default=None,
                     help="the distore.toml to check (or --config FILE; default DISTORE_CONFIG)")
    show = csub.add_parser("show", help="print every setting's resolved value and its source")
    show.add_argument("file", nargs="?", default=None,
                      help="a distore.toml (or --config FILE; default: DISTORE_CONFIG, if set)")
    for sp in (chk, show):  # both spellings, as the other subcommands take --config
        sp.add_argument("--config", metavar="FILE", default=None,
                        help="the distore.toml (same as the positional FILE)")


def settings_from(args: argparse.Namespace, environ=None) -> Settings:
    """Resolve every setting from parsed flags, the environment and the config file."""
    environ = os.environ if environ is None else environ
    flags = {k: v for k, v in vars(args).items() if "." in k or k == "tables"}
    path = getattr(args, "config", None) or getattr(args, "file", None) \
        or environ.get("DISTORE_CONFIG") or None
    return resolve(flags, environ, path)


def apply_log_level(settings: Settings) -> None:
    """Set this process's log level from `log.level` (flag, DISTORE_LOG_LEVEL,
    or ``[log] level`` in distore.toml); logging was set up from the flag and
    the variable before the file could be read."""
    logging.getLogger().setLevel(settings["log.level"])


_PREFER_SYSTEM = "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"


def _apply_ucx(settings: Settings, argv: list[str] | None) -> None:
    """Put the configured UCX settings into this process's environment before
    UCX makes a context (children inherit them).

    Which UCX library loads is decided when UCX is first loaded: importing
    distore_ucx and reading the configuration load none (the control plane
    never does), so the variable is in place before a node or a client loads
    it. Should UCX be loaded already, the command runs itself again (same
    pid) with the variable set.
    """
    env = settings.ucx().environment()
    for name, value in env.items():
        if os.environ.get(name) not in (None, value):
            log.info("%s=%s from the configuration replaces %s", name, value, os.environ[name])
    reload = _PREFER_SYSTEM in env and os.environ.get(_PREFER_SYSTEM) != env[_PREFER_SYSTEM]
    os.environ.update(env)
    if reload and "libucx" in sys.modules:
        if argv is not None:
            log.warning("%s=%s takes effect only in a new process (UCX is already loaded)",
                        _PREFER_SYSTEM, env[_PREFER_SYSTEM])
            return
        log.info("running again with %s=%s so that UCX loads from there", _PREFER_SYSTEM,
                 env[_PREFER_SYSTEM])
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", "distore_ucx", *sys.argv[1:]])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `distore` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    level = vars(args).get("log.level") or os.environ.get("DISTORE_LOG_LEVEL") or "INFO"
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
    try:
        if args.command == "config":
            return _config(args)
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(args)
        if args.command == "doctor":
            return _doctor(args)
        if args.command == "bench":
            from .bench import run_bench

            return run_bench(args)
        settings = settings_from(args)
        apply_log_level(settings)
        _apply_ucx(settings, argv)
        if args.command == "control":
            return _control(settings, args)
        if args.command == "node":
            return _node(settings, args)
        if args.command == "status":
            address = settings["control.address"] or "127.0.0.1:7700"
            from .status import run_status

            return run_status(address, args, settings["auth.token_file"] or None)
        if args.command == "checkpoint":
            address = settings["control.address"] or "127.0.0.1:7700"
            return _checkpoint(address, args, settings["auth.token_file"] or None)
    except DistoreError as exc:
        print(f"distore {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # ^C: one line, no traceback
        print(f"distore {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (distore config show | head): stop quietly, as
        # other tools do, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    return 1


def _control(settings: Settings, args) -> int:
    """`distore control`: run the control plane until it is stopped."""
    from .control.server import main as control_main

    config = settings.control()
    _refuse_exposure("control plane", config.host, settings)
    _make_checkpoint_folder(config.checkpoint)
    with _listening("control plane", config.host, config.port, "--port"):
        return control_main(config, args.ready_file)


def _node(settings: Settings, args) -> int:
    """`distore node`: run a storage node until it is stopped."""
    # Loading UCX patches mmap, munmap and brk in place, then spins a
    # grace period per function patched (50 ms) for other threads
    # running them to move on: 0.4 s of a core per node start. No
    # thread here runs them yet (numpy's BLAS pool idles), so none.
    os.environ.setdefault("UCX_MEM_BISTRO_GRACE_DURATION", "0")
    from .storage.node import main as node_main
    from .storage.node import route_address
    from .transport.rpc import parse_address

    config = settings.node()
    host = config.host or route_address(parse_address(config.control)[0])
    _refuse_exposure("storage node", host, settings)
    with _listening("storage node", host, config.port, "--port"):
        return node_main(config, args.ready_file)


def _refuse_exposure(role: str, host: str, settings: Settings) -> None:
    """A process listening beyond loopback needs a token or --insecure (then
    says so loudly in its log)."""
    warning = check_exposure(role, host, settings["auth.token_file"], settings["auth.insecure"])
    if warning:
        for _ in range(3):  # hard to miss in a log
            log.warning("%s", warning)


@contextlib.contextmanager
def _listening(role: str, host: str, port: int, flag: str):
    """A port that cannot be listened on (taken, not ours, no such address)
    is one line, like every other CLI error, not an OSError traceback."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            raise  # only a bind fails with these
        why = {errno.EADDRINUSE: "another process (another control plane or node?) "
                                 f"listens there: stop it, or pass {flag} N (0 = any free "
                                 "port)",
               errno.EADDRNOTAVAIL: "this host has no such address: pass --host with one "
                                    "of its own addresses"}
        raise ConfigError(f"the {role} cannot listen on {host}:{port}: {exc.strerror}; "
                          f"{why[exc.errno]}") from None


def _make_checkpoint_folder(path: str) -> None:
    """The checkpoint file's folder exists before the control plane starts:
    made here when missing (said in the log), or a plain error saying why not."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(folder):
        return
    try:
        os.makedirs(folder)
    except OSError as exc:
        raise ConfigError(f"the checkpoint folder {folder} does not exist and cannot be made "
                          f"({exc.strerror}): create it, or give --checkpoint a path in a "
                          "folder this user can write") from None
    log.info("made the checkpoint folder %s", folder)


def _doctor(args) -> int:
    from .doctor import diagnose, format_report

    report = diagnose()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print("\n".join(format_report(report)))
    return 0


# -- distore config ---------------------------------------------------------

def _config(args) -> int:
    if args.file and args.config and args.file != args.config:
        raise ConfigError(f"two files given ({args.file} and --config {args.config}): "
                          "give one")
    if args.config_command == "check":
        path = args.file or args.config or os.environ.get("DISTORE_CONFIG")
        if not path:
            raise ConfigError("which file? distore config check FILE (or --config FILE, "
                              "or DISTORE_CONFIG)")
        problems = check_file(path, os.environ)
        if problems:
            print(f"{path}: {len(problems)} problem(s)", file=sys.stderr)
            for p in problems:
                print(f"  {p}", file=sys.stderr)
            return 1
        print(f"{path}: ok")
        return 0
    settings = settings_from(args)
    shown = {}
    for name, entry in settings.as_dict().items():
        value = entry["value"]
        if name == "tables":
            value = [t.__dict__ for t in value]
        shown[name] = {"value": value, "source": entry["source"]}
    shown.update(switches_shown(os.environ))  # read where used, not resolved: listed here too
    print(json.dumps(shown, indent=2, default=str))
    return 0


# -- distore checkpoint -----------------------------------------------------

def _checkpoint(address: str, args, token_file: str | None) -> int:
    from .client import connect
    from .status import format_size

    with connect(address, timeout=600, token_file=token_file) as client:
        result = client.checkpoint()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"checkpoint written to {result['path']}: {result['items']} items in "
              f"{result['tables']} tables, {format_size(result['bytes'])}, "
              f"{result['seconds']:.2f} s")
    return 0
