"""Sphinx configuration of the API reference, built from the docstrings.

Build it with `.ci/docs` (warnings are errors). It documents the installed
package: the native extension is only there once built, so this file puts
nothing of the checkout on sys.path.
"""

from __future__ import annotations

project = "distore-ucx"
author = "distore-ucx authors"
copyright = "distore-ucx authors"  # Sphinx's name for it

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]

# Docstrings are Google style (Args:, Returns:, Raises:) around prose in
# which `name` is code, as in the Markdown docs.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
default_role = "literal"

autodoc_member_order = "bysource"
autoclass_content = "class"  # a class's docstring documents its constructor's arguments
python_maximum_signature_line_length = 88  # long signatures: one argument a line

nitpicky = True
# Types from other projects appear in signatures; the build fetches no
# other project's inventory (intersphinx: a network fetch at every build,
# and a failure when a site is down), so their references cannot resolve.
# Only these are let through.
nitpick_ignore_regex = [
    ("py:class", r"(numpy|np)\.(ndarray|dtype)"),
    ("py:class", r"torch\.(Tensor|device)"),
    ("py:class", r"tensordict\..*|TensorDictBase|TensorDict"),
    # The standard library's, for the same reason (builtins resolve anyway).
    ("py:class", r"collections\.abc\.\w+|os\.PathLike|subprocess\.Popen"),
]
nitpick_ignore = [
    # share() is annotated with the mixin that defines it; it returns the buffer.
    ("py:class", "distore_ucx.torchrl.handle.Sharing"),
]

smartquotes = False  # "host:port", --flags: as typed

html_theme = "alabaster"
html_title = "distore-ucx API reference"
html_static_path: list[str] = []
