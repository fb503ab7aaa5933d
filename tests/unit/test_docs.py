"""Docs that must agree with the code: the settings table of docs/deployment.md."""

from __future__ import annotations

from pathlib import Path

from distore_ucx.config import settings_table

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
