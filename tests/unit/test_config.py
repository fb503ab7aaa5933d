"""Configuration parsing."""

import pytest

import distore_ucx as ds
from distore_ucx.config import NodeConfig, parse_size, runtime_config
from distore_ucx.errors import ConfigError
from distore_ucx.spec import TableSpec


@pytest.mark.parametrize(
    "text, value",
    [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1k", 1000), ("2M", 2_000_000), ("1024", 1024),
     (77, 77), ("1.5GiB", 3 << 29), ("64 KiB", 64 << 10), ("3GB", 3_000_000_000)],
)
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "GiB", "-1", "4XB", "four"])
def test_bad_sizes_say_what_is_expected(bad):
    with pytest.raises(ConfigError, match="is not a size"):
        parse_size(bad)


def test_tiny_arena_is_refused():
    with pytest.raises(ConfigError, match="too small"):
        NodeConfig(control="127.0.0.1:1", arena_bytes=1000)


def test_negative_reconnect_timeout_is_refused():
    # The check used to sit after a `return` and never ran.
    with pytest.raises(ConfigError, match="reconnect_timeout=-1"):
        NodeConfig(control="127.0.0.1:1", arena_bytes=1 << 20, reconnect_timeout=-1)


def test_role_configurations_take_their_defaults_from_the_settings_table():
    # The settings table is the one place a default is written: each field of
    # a process's configuration that a setting feeds reads its default there.
    from dataclasses import MISSING, fields

    from distore_ucx.config import BY_NAME, SETTINGS, ControlConfig, UcxConfig
    from distore_ucx.config.roles import setting_of

    # A control plane or node a program makes serves no metrics unless asked.
    library = {("ControlConfig", "metrics_port"): 0, ("NodeConfig", "metrics_port"): 0}
    not_settings = {"heartbeat_interval", "metrics_optional", "control"}  # derived or required
    fed = set()
    for cls in (ControlConfig, NodeConfig, UcxConfig):
        for f in fields(cls):
            name = setting_of(f)
            if name is None:
                assert f.name in not_settings, f"{cls.__name__}.{f.name} is fed by no setting"
                continue
            fed.add(name)
            default = f.default if f.default_factory is MISSING else f.default_factory()
            assert default == library.get((cls.__name__, f.name), BY_NAME[name].default), f.name
    # Every setting reaches a process's configuration, or is the command line's own.
    assert {s.name for s in SETTINGS} - fed == {"control.address", "auth.insecure", "log.level"}
    assert UcxConfig().options is not UcxConfig().options  # a mutable default is copied


def test_resolved_settings_fill_every_field_they_feed():
    from dataclasses import fields

    from distore_ucx.config.roles import setting_of

    s = resolve({"node.arena": "2GiB", "control.port": "7701", "ucx.tls": "tcp",
                 "node.reconnect_timeout": "5"}, {"DISTORE_CONTROL": "h:1"})
    for config in (s.control(), s.node(), s.ucx()):
        for f in fields(config):
            if setting_of(f):
                assert getattr(config, f.name) == s[setting_of(f)], f.name
    assert s.node().arena_bytes == 2 << 30 and s.node().reconnect_timeout == 5.0
    assert s.control().port == 7701 and s.ucx().tls == "tcp"
    # What is not a setting: derived from one, or from where a value came.
    assert s.control().heartbeat_interval == 0.5 and s.control().metrics_optional
    assert s.node().control == "h:1" and s.node().metrics_port == 9771


# -- distore.toml, DISTORE_* and flags ---------------------------------------

from distore_ucx.config import UcxConfig, check_file, resolve  # noqa: E402

GOOD = """
[control]
address = "10.1.2.3:7700"
port = 7711
heartbeat_timeout = 1.5

[node]
arena = "2GiB"
hugepages = false

[ucx]
tls = "rc,sm,self"
net_devices = "mlx5_0:1"
system_library = true
options = { RNDV_THRESH = "65536" }

[[tables]]
name = "replay"
capacity = 100000
spec = { obs = [[4, 84, 84], "uint8"], reward = [[], "float32"] }

[[tables]]
name = "flat"
capacity = 10
spec = [[16], "uint8"]
sampler = "uniform"
remover = "fifo"
"""


def write(tmp_path, text, name="distore.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_good_file_checks_clean_and_gives_typed_configs(tmp_path):
    path = write(tmp_path, GOOD)
    assert check_file(path) == []
    s = resolve({}, {}, path)
    node = s.node()
    assert node.control == "10.1.2.3:7700" and node.arena_bytes == 2 << 30
    assert node.hugepages is False
    ctl = s.control()
    assert ctl.port == 7711 and ctl.heartbeat_timeout == 1.5 and ctl.heartbeat_interval == 0.375
    assert [t.name for t in ctl.tables] == ["replay", "flat"]
    assert ctl.tables[0].spec == TableSpec.parse({"obs": ((4, 84, 84), "uint8"),
                                                  "reward": ((), "float32")})
    assert ctl.tables[1].spec == TableSpec.parse(((16,), "uint8"))
    assert s.ucx().environment() == {
        "UCX_RNDV_THRESH": "65536", "UCX_TLS": "rc,sm,self", "UCX_NET_DEVICES": "mlx5_0:1",
        "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY": "true",
    }
    assert s.source("node.arena") == "file" and s.source("control.lease_timeout") == "default"


def test_precedence_is_flag_then_env_then_file_then_default(tmp_path):
    path = write(tmp_path, GOOD)
    env = {"DISTORE_ARENA": "3GiB", "DISTORE_PORT": "7722", "DISTORE_UCX_TLS": "tcp"}
    s = resolve({"node.arena": "1GiB"}, env, path)
    assert s["node.arena"] == 1 << 30 and s.source("node.arena") == "flag"
    assert s["control.port"] == 7722 and s.source("control.port") == "env"
    assert s["ucx.tls"] == "tcp" and s.source("ucx.tls") == "env"
    assert s["control.heartbeat_timeout"] == 1.5 and s.source("control.heartbeat_timeout") == "file"
    assert s["control.lease_timeout"] == 30.0
    # An empty variable counts as not set.
    assert resolve({}, {"DISTORE_ARENA": ""}, path)["node.arena"] == 2 << 30


def test_every_problem_is_reported_with_file_line_and_key(tmp_path):
    path = write(tmp_path, """[control]
address = "nowhere"
prot = 7700
heartbeat_timeout = "soon"

[node]
arena = "lots"

[nodes]
x = 1

[[tables]]
name = "ok"
capacity = 5
spec = [[4], "uint8"]

[[tables]]
name = "bad"
capacity = -1
spec = [[4], "uint8"]

[[tables]]
name = "ok"
capacity = 5
spec = [[4], "uint8"]
sampler = "psychic"
""")
    problems = [str(p) for p in check_file(path)]
    assert f"{path}:2 [control] address: address 'nowhere' is not HOST:PORT" in problems[0]
    assert problems[1] == f"{path}:3 [control] prot: unknown key; did you mean 'port'?"
    assert problems[2].startswith(f"{path}:4 [control] heartbeat_timeout: expected a number")
    assert problems[3].startswith(f"{path}:7 [node] arena: 'lots' is not a size")
    assert problems[4] == f"{path}:9 [nodes]: unknown section; did you mean [node]?"
    assert problems[5].startswith(f"{path}:17 [[tables]] #2: table 'bad': capacity must be")
    assert problems[6].startswith(f"{path}:22 [[tables]] #3: table 'ok': sampler 'psychic'")
    assert len(problems) == 7
    with pytest.raises(ConfigError, match="7 problem"):
        resolve({}, {}, path)


def test_syntax_errors_and_missing_files_are_reported(tmp_path):
    path = write(tmp_path, "[node]\narena = \n")
    (problem,) = check_file(path)
    assert "not valid TOML" in str(problem) and "line 2" in str(problem)
    (problem,) = check_file(str(tmp_path / "missing.toml"))
    assert "cannot read the configuration file" in str(problem)


def test_bad_env_and_flags_name_their_source():
    with pytest.raises(ConfigError) as info:
        resolve({"control.port": "seventy"},
                {"DISTORE_ARENA": "huge", "DISTORE_NODE_HUGEPAGES": "maybe"})
    text = str(info.value)
    assert "--port: expected an integer, got 'seventy'" in text
    assert "DISTORE_ARENA: 'huge' is not a size" in text
    assert "DISTORE_NODE_HUGEPAGES: expected true or false" in text


def test_token_file_must_be_readable_and_not_empty(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        resolve({"auth.token_file": str(empty)}, {})
    with pytest.raises(ConfigError, match="cannot read token file"):
        resolve({}, {"DISTORE_TOKEN_FILE": str(tmp_path / "nope")})
    good = tmp_path / "token"
    good.write_text("s3cret-of-24-bytes-long\n")
    s = resolve({}, {"DISTORE_TOKEN_FILE": str(good), "DISTORE_CONTROL": "h:1"})
    assert s.node().token_file == str(good) and s.control().token_file == str(good)


def test_node_without_a_control_address_says_how_to_give_one():
    with pytest.raises(ConfigError, match="--control HOST:PORT, set DISTORE_CONTROL"):
        resolve({}, {}).node()


def test_tables_from_json_in_a_flag_or_variable():
    tables = '[{"name": "r", "capacity": 8, "spec": [[2, 3], "float32"]}]'
    (t,) = resolve({}, {"DISTORE_TABLES": tables}).control().tables
    assert (t.name, t.capacity, t.spec, t.sampler) == (
        "r", 8, TableSpec.parse(((2, 3), "float32")), ds.Uniform())
    with pytest.raises(ConfigError, match=r"--tables: \[\[tables\]\] #1: missing 'capacity'"):
        resolve({"tables": '[{"name": "r", "spec": [[2], "uint8"]}]'}, {})


def test_ucx_config_sets_only_what_was_given():
    assert UcxConfig().environment() == {}
    assert UcxConfig(system_library=False).environment() == {
        "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY": "false"}


def test_the_example_distore_toml_is_valid(tmp_path):
    """Valid once its token file exists (the check names it until then)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "cluster", "distore.toml")).read()
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    path = tmp_path / "distore.toml"
    path.write_text(text.replace("/etc/distore/token", str(token))
                    .replace("/var/lib/distore", str(tmp_path / "state")))
    assert check_file(str(path)) == []


def test_a_token_file_others_can_read_is_warned_about(tmp_path, caplog):
    from distore_ucx.config import read_token

    path = tmp_path / "token"
    path.write_bytes(b"s" * 32)
    path.chmod(0o600)
    with caplog.at_level("WARNING", logger="distore_ucx.config"):
        assert read_token(str(path)) == b"s" * 32
    assert not caplog.records
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="distore_ucx.config"):
        assert read_token(str(path)) == b"s" * 32
    (record,) = caplog.records
    assert "accessible to its group and others (mode 0644)" in record.getMessage()
    assert f"chmod 600 {path}" in record.getMessage()


def test_per_connection_limits_are_settings_with_clear_errors(tmp_path):
    from distore_ucx.config import ControlConfig

    toml = tmp_path / "distore.toml"
    toml.write_text("[control]\nmax_sample = 512\nmax_leased_items = 4096\n"
                    "max_writer_ids = 8\nmax_frame = \"64MiB\"\nmax_pending = 4\n")
    cfg = resolve({"control.max_pending": "16"}, {"DISTORE_CONTROL_MAX_WRITER_IDS": "9"},
                  str(toml)).control()
    assert (cfg.max_sample, cfg.max_leased_items, cfg.max_writer_ids, cfg.max_frame,
            cfg.max_pending) == (512, 4096, 9, 64 << 20, 16)
    with pytest.raises(ConfigError, match="max_sample is 70000"):
        ControlConfig(max_sample=70_000)
    with pytest.raises(ConfigError, match="max_leased_items .100. must be at least"):
        ControlConfig(max_sample=200, max_leased_items=100)
    with pytest.raises(ConfigError, match="max_frame"):
        ControlConfig(max_frame=100)


def test_config_check_loads_no_ucx(tmp_path):
    """`distore config check` runs where UCX cannot load (a login node): neither
    ucxx nor libucp may be loaded by it."""
    import subprocess
    import sys

    path = write(tmp_path, GOOD)
    probe = (
        "import sys\n"
        "from distore_ucx import cli\n"
        f"assert cli.main(['config', 'check', {path!r}]) == 0\n"
        "loaded = [m for m in sys.modules\n"
        "          if m.startswith(('ucxx', 'libucx', 'distore_ucx._native'))]\n"
        "assert not loaded, loaded\n"
        "assert 'libucp' not in open('/proc/self/maps').read()\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # the installed package, not the checkout
    assert done.returncode == 0, done.stderr


def test_the_log_level_in_the_file_is_applied(tmp_path):
    import logging

    from distore_ucx import cli

    path = write(tmp_path, '[log]\nlevel = "warning"\n')
    root = logging.getLogger()
    before = root.level
    try:
        args = cli.build_parser().parse_args(["status", "--config", path])
        cli.apply_log_level(cli.settings_from(args, environ={}))
        assert root.level == logging.WARNING
        # the flag still wins over the file
        args = cli.build_parser().parse_args(["--log-level", "DEBUG", "status", "--config", path])
        cli.apply_log_level(cli.settings_from(args, environ={}))
        assert root.level == logging.DEBUG
    finally:
        root.setLevel(before)


def test_config_check_refuses_a_token_the_processes_refuse(tmp_path):
    short = tmp_path / "short"
    short.write_text("only12bytes!")
    short.chmod(0o600)
    path = write(tmp_path, f'[auth]\ntoken_file = "{short}"\n')
    (problem,) = check_file(path)
    assert "12 bytes; use at least 16" in str(problem)


def test_switches_and_sizes_from_the_environment_are_parsed_or_refused_clearly(monkeypatch):
    from distore_ucx.config import size_from_env, switch_from_env

    monkeypatch.delenv("DISTORE_TEST_SWITCH", raising=False)
    assert switch_from_env("DISTORE_TEST_SWITCH") is True
    assert switch_from_env("DISTORE_TEST_SWITCH", default=False) is False
    for off in ("0", "false", "No", " off "):
        monkeypatch.setenv("DISTORE_TEST_SWITCH", off)
        assert switch_from_env("DISTORE_TEST_SWITCH") is False
    monkeypatch.setenv("DISTORE_TEST_SWITCH", "yes")
    assert switch_from_env("DISTORE_TEST_SWITCH", default=False) is True
    monkeypatch.setenv("DISTORE_TEST_SWITCH", "maybe")
    with pytest.raises(ConfigError, match="DISTORE_TEST_SWITCH must be 0 or 1"):
        switch_from_env("DISTORE_TEST_SWITCH")

    monkeypatch.delenv("DISTORE_TEST_SIZE", raising=False)
    assert size_from_env("DISTORE_TEST_SIZE", 123) == 123
    monkeypatch.setenv("DISTORE_TEST_SIZE", "64KiB")
    assert size_from_env("DISTORE_TEST_SIZE", 123) == 65536
    monkeypatch.setenv("DISTORE_TEST_SIZE", "4096")
    assert size_from_env("DISTORE_TEST_SIZE", 123) == 4096
    monkeypatch.setenv("DISTORE_TEST_SIZE", "lots")
    with pytest.raises(ConfigError, match="DISTORE_TEST_SIZE"):
        size_from_env("DISTORE_TEST_SIZE", 123)


def test_runtimes_lock_their_workers_with_a_mutex_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv("UCX_USE_MT_MUTEX", raising=False)
    monkeypatch.delenv("UCX_RNDV_SCHEME", raising=False)
    assert runtime_config() == {"RNDV_SCHEME": "put_zcopy", "USE_MT_MUTEX": "y"}
    monkeypatch.setenv("UCX_USE_MT_MUTEX", "n")  # UCX reads it itself
    assert runtime_config() == {"RNDV_SCHEME": "put_zcopy"}


def test_ucx_takes_the_runtime_options(monkeypatch):
    from distore_ucx.transport import UcxRuntime

    monkeypatch.delenv("UCX_USE_MT_MUTEX", raising=False)
    # An option UCX does not know would fail the context.
    with UcxRuntime(config={**runtime_config(), "TLS": "tcp"}) as rt:
        assert rt.config["USE_MT_MUTEX"] == "y"
