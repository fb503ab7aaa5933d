"""The library's log lines where the application configured no logging
(distore_ucx/logs.py): time, level, logger and process, once; none of ours
once the application configures its own."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tempfile.gettempdir())
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_a_warning_with_no_logging_configured_says_when_what_and_who():
    err = run("import logging, distore_ucx\n"
              "logging.getLogger('distore_ucx.client.writer.send').warning('lost node 2; "
              "resending')\n"
              "logging.getLogger('distore_ucx.x').info('not shown: below WARNING')\n")
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ WARNING "
                    r"distore_ucx\.client\.writer\.send\[\d+\]: lost node 2; resending$",
                    lines[0]), lines[0]


def test_an_application_that_configures_logging_gets_each_line_once_in_its_format():
    err = run("import logging, distore_ucx\n"
              "logging.basicConfig(format='APP %(levelname)s %(message)s')\n"
              "logging.getLogger('distore_ucx.x').warning('hello')\n")
    assert err.strip().splitlines() == ["APP WARNING hello"], err
