"""Docs that must agree with the code: the settings and switches tables of
docs/deployment.md."""

from __future__ import annotations

import re
from pathlib import Path

import distore_ucx.config.environment as environment
from distore_ucx.config import SWITCHES, settings_table, switches_table

DOCS = Path(__file__).parents[2] / "docs"
BEGIN = "<!-- settings: generated from distore_ucx.config.SETTINGS"
END = "<!-- end of settings -->"


def test_the_settings_table_in_the_deployment_guide_is_the_one_settings_make():
    text = (DOCS / "deployment.md").read_text()
    start = text.index("\n", text.index(BEGIN)) + 1
    table = text[start:text.index(END)]
    assert table == settings_table(), (
        "docs/deployment.md's settings table differs from config.SETTINGS: paste the output "
        "of  python -c \"from distore_ucx.config import settings_table as t; print(t(), end='')\"  "
        "between its markers")


def test_the_switches_table_lists_every_variable_read_where_used():
    text = (DOCS / "deployment.md").read_text()
    begin = text.index("<!-- switches: generated from distore_ucx.config.SWITCHES")
    start = text.index("\n", begin) + 1
    assert text[start:text.index("<!-- end of switches -->")] == switches_table(), (
        "docs/deployment.md's switches table differs from config.SWITCHES: paste the output "
        "of  python -c \"from distore_ucx.config import switches_table as t; print(t(), end='')\"  "
        "between its markers")
    # Every variable config/environment.py reads (DISTORE_*) is declared a switch.
    source = Path(environment.__file__).read_text()
    read = set(re.findall(r'(?:_from_env|environ\.get)\(\s*"(DISTORE_[A-Z_]+)"', source))
    assert read and read == {s.variable for s in SWITCHES}


def test_install_hints_work_from_a_checkout_too():
    # The README installs from the checkout: a hint naming only the index
    # spelling ('distore-ucx[cupy]') left a reader without a command that works.
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    offenders = []
    for path in [*root.joinpath("distore_ucx").rglob("*.py"), *root.joinpath("perf").glob("*.py")]:
        text = path.read_text()
        if "'distore-ucx[" in text.replace("(or 'distore-ucx[", "") and path.name != "errors.py":
            offenders.append(str(path.relative_to(root)))
    assert not offenders, f"install hints not made by errors.install_hint: {offenders}"
    from distore_ucx.errors import install_hint

    assert install_hint("cupy") == ("pip install 'distore-ucx[cupy]' (from a source checkout: "
                                    "pip install '.[cupy]')")
