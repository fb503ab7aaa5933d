"""Progress: a bar on a terminal, plain lines elsewhere and with --json;
`distore bench` keeps stdout free of bars when piped and draws one on a
terminal."""

from __future__ import annotations

import io
import logging
import os
import pty
import subprocess
import sys

from distore_ucx.progress import Progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_gives_plain_lines():
    out = io.StringIO()
    with Progress("copying", total=4, unit="items", stream=out, every=0) as p:
        for _ in range(4):
            p.update(1)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert lines[0].startswith("copying: 1 of 4 items (25%)")
    assert lines[-1].startswith("copying: 4 of 4 items (100%)")
    assert len(lines) == 4  # closing adds no duplicate of the last line


def test_lines_are_rate_limited():
    out = io.StringIO()
    p = Progress("work", total=1000, stream=out, every=3600)
    for _ in range(999):
        p.update(1)
    p.close()
    assert len(out.getvalue().splitlines()) == 2  # the first update, and the close


def test_a_terminal_gets_a_bar_unless_plain():
    tty = Tty()
    with Progress("copying", total=10, unit="items", stream=tty) as p:
        assert p.is_bar
        p.update(10, note="done")
    assert "\r" in tty.getvalue() and "100%" in tty.getvalue()
    plain = Tty()
    with Progress("copying", total=10, stream=plain, plain=True) as p:  # --json
        assert not p.is_bar
        p.update(10)
    assert "\r" not in plain.getvalue()


def test_services_log_their_lines(caplog):
    log = logging.getLogger("distore_ucx.test_progress")
    with caplog.at_level(logging.INFO, logger=log.name):
        with Progress(
            "re-sending table 't'", total=3, unit="items", logger=log, stream=io.StringIO(), every=0
        ) as p:
            p.update(3)
    assert "re-sending table 't': 3 of 3 items (100%)" in caplog.text


FAKE_SCRIPT = """\
import argparse, json, sys
p = argparse.ArgumentParser()
p.add_argument("--json-out"); p.add_argument("--plot")
p.add_argument("--quick", action="store_true")
a = p.parse_args()
print("working", file=sys.stderr)
open(a.json_out, "w").close()
print("table")
"""


def _fake_perf(tmp_path):
    perf = tmp_path / "perf"
    perf.mkdir()
    for name in ("replay_bench.py", "bandwidth.py", "latency.py"):
        (perf / name).write_text(FAKE_SCRIPT)
    return perf


def test_bench_prints_plain_lines_when_piped(tmp_path):
    perf = _fake_perf(tmp_path)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "distore_ucx",
            "bench",
            "--perf-dir",
            str(perf),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "\r" not in out.stdout + out.stderr
    assert "distore bench: 3 of 3 scripts (100%)" in out.stderr
    assert "[bandwidth] working" in out.stderr


def test_bench_draws_a_bar_on_a_terminal(tmp_path):
    perf = _fake_perf(tmp_path)
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distore_ucx",
            "bench",
            "--perf-dir",
            str(perf),
            "--out",
            str(tmp_path / "out"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=child,
        stderr=child,
        cwd=tmp_path,
    )
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert proc.wait(timeout=120) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "\r" in text and "3/3" in text  # tqdm's bar, redrawn in place
