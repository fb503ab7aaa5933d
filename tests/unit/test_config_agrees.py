"""`distore config check` refuses what the processes refuse, reports every
problem, and the CLI takes the spellings the docs use; listening beyond
loopback needs a token or --insecure."""

from __future__ import annotations

import json

import pytest

from distore_ucx import cli
from distore_ucx.config import MIN_TOKEN_BYTES, check_exposure, check_file, is_loopback, resolve
from distore_ucx.errors import ConfigError


def write(tmp_path, text, name="distore.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("key, value, message", [
    ("heartbeat_timeout", "-1", "must be > 0"),
    ("heartbeat_timeout", "0", "must be > 0"),
    ("lease_timeout", "-5", "must be > 0"),
    ("checkpoint_interval", "-1", "must be >= 0"),
    ("restore_grace", "0", "must be > 0"),
    ("port", "70000", "a port is 0-65535"),
])
def test_config_check_refuses_control_values_the_control_plane_refuses(tmp_path, key, value,
                                                                       message):
    path = write(tmp_path, f"[control]\n{key} = {value}\n")
    (problem,) = check_file(path)
    assert f"{path}:2 [control] {key}: " in str(problem) and message in str(problem)


def test_config_check_refuses_node_values_the_node_refuses(tmp_path):
    path = write(tmp_path, '[node]\narena = "1000"\nreconnect_timeout = -2\n')
    problems = [str(p) for p in check_file(path)]
    assert "[node] arena: an arena must be >= 1MiB" in problems[0]
    assert "[node] reconnect_timeout: a time must be >= 0" in problems[1]


def test_config_check_refuses_a_token_shorter_than_the_processes_accept(tmp_path):
    short = tmp_path / "token"
    short.write_text("x" * (MIN_TOKEN_BYTES - 1) + "\n")
    path = write(tmp_path, f'[auth]\ntoken_file = "{short}"\n')
    (problem,) = check_file(path)
    assert f"is {MIN_TOKEN_BYTES - 1} bytes; use at least {MIN_TOKEN_BYTES}" in str(problem)
    short.write_text("x" * MIN_TOKEN_BYTES)
    assert check_file(path) == []


def test_config_check_reports_every_problem_of_a_tables_entry(tmp_path):
    path = write(tmp_path, """[[tables]]
name = "bad"
capacity = 0
spec = [[4], "complex-ish"]
sampler = "psychic"
remover = "never"
colour = "blue"
""")
    problems = [str(p) for p in check_file(path)]
    assert all(p.startswith(f"{path}:1 [[tables]] #1: ") for p in problems), problems
    text = "\n".join(problems)
    for part in ("unknown key(s) colour", "capacity must be a positive integer",
                 "spec:", "sampler 'psychic' unknown", "remover 'never' unknown"):
        assert part in text
    assert len(problems) == 5


def test_config_show_takes_the_file_as_docs_write_it(tmp_path, capsys):
    path = write(tmp_path, "[control]\nport = 7799\n")
    for argv in (["config", "show", "--config", path], ["config", "show", path]):
        assert cli.main(argv) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["control.port"] == {"value": 7799, "source": "file"}
    assert cli.main(["config", "check", "--config", path]) == 0
    assert capsys.readouterr().out.strip() == f"{path}: ok"


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.5", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("", False), ("::", False), ("10.1.2.3", False),
])
def test_what_counts_as_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_listening_beyond_loopback_needs_a_token_or_insecure():
    assert check_exposure("control plane", "127.0.0.1", "", False) is None
    assert check_exposure("control plane", "0.0.0.0", "/etc/token", False) is None
    with pytest.raises(ConfigError, match="refusing to run the storage node on 10.1.2.3 "
                                          "without a token.*--token-file FILE.*--insecure"):
        check_exposure("storage node", "10.1.2.3", "", False)
    warning = check_exposure("control plane", "0.0.0.0", "", True)
    assert warning.startswith("INSECURE: the control plane listens on 0.0.0.0 without a token")


def test_the_control_plane_listens_on_loopback_unless_told_otherwise():
    s = resolve({}, {})
    assert s.control().host == "127.0.0.1" and s["auth.insecure"] is False
    s = resolve({"control.host": "0.0.0.0", "auth.insecure": True}, {})
    assert s.control().host == "0.0.0.0" and s["auth.insecure"] is True
    assert resolve({}, {"DISTORE_AUTH_INSECURE": "true"})["auth.insecure"] is True


def test_config_check_refuses_a_host_the_processes_refuse_without_a_token(tmp_path):
    path = write(tmp_path, '[control]\nhost = "0.0.0.0"\n\n[node]\nhost = "10.1.2.3"\n')
    problems = [str(p) for p in check_file(path)]
    assert len(problems) == 2
    assert problems[0].startswith(f"{path}:2 [control] host: the control plane would listen "
                                  "on 0.0.0.0 and refuses to without a token")
    assert problems[1].startswith(f"{path}:5 [node] host: the storage node would listen on "
                                  "10.1.2.3")
    token = tmp_path / "token"
    token.write_text("t" * MIN_TOKEN_BYTES)
    assert check_file(path, {"DISTORE_TOKEN_FILE": str(token)}) == []  # as start reads it
    assert check_file(path, {"DISTORE_AUTH_INSECURE": "true"}) == []
    insecure = write(tmp_path, '[control]\nhost = "0.0.0.0"\n[auth]\ninsecure = true\n', "b.toml")
    assert check_file(insecure) == []


def test_config_check_accepts_a_checkpoint_folder_start_will_make(tmp_path):
    path = write(tmp_path, f'[control]\ncheckpoint = "{tmp_path}/new/dir/store.ckpt"\n')
    assert check_file(path) == []
