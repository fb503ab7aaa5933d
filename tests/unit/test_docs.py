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
