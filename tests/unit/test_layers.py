"""The import graph has no arrow from a lower layer up, read from the source.

errors, protocol and transport/ are the bottom of the package: they never
import control/, client/, storage/ or config, not even inside a function
(a function-local import is how a hidden cycle hides). table_definition (with
the selectors and rate limiters it declares), spec and slot_format sit under
config, control, storage and client. The three roles, control/, storage/ and
client/, never import each other; inside client/, the writer (client/writer/)
and the learner (client/learner/) never import each other, nor client.py,
which makes them. Only the config package and the command-line programs
read the environment.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "distore_ucx"  # the sources, not an installed copy
UPPER = ("distore_ucx.control", "distore_ucx.client", "distore_ucx.storage",
         "distore_ucx.config", "distore_ucx.cluster", "distore_ucx.cli", "distore_ucx.ray")

# module (or package prefix) -> what it must never import
RULES = {
    "distore_ucx.errors": UPPER,
    "distore_ucx.protocol": UPPER,
    "distore_ucx.transport": UPPER,
    "distore_ucx.spec": UPPER,
    "distore_ucx.slot_format": UPPER + ("distore_ucx._native_loader",),
    # a table definition uses the selector and rate limiter values, nothing of the server
    "distore_ucx.table_definition": UPPER + ("distore_ucx._native_loader",),
    "distore_ucx.selectors": UPPER + ("distore_ucx._native_loader",),
    "distore_ucx.rate_limiters": UPPER + ("distore_ucx._native_loader",),
    # the client's two sides share only what sits beside them (lifecycle.py)
    "distore_ucx.client.writer": ("distore_ucx.client.learner", "distore_ucx.client.client"),
    "distore_ucx.client.learner": ("distore_ucx.client.writer", "distore_ucx.client.client"),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, name: str | None = None) -> set[str]:
    """Every module `path` (module `name`) imports, anywhere in it, as absolute names."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def test_no_import_arrow_from_a_lower_layer_up():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        for low, forbidden in RULES.items():
            if name != low and not name.startswith(low + "."):
                continue
            for imported in imports(path):
                if any(imported == f or imported.startswith(f + ".") for f in forbidden):
                    bad.append(f"{name} imports {imported}")
    assert not bad, "\n".join(bad)


def test_every_rule_names_a_module_that_exists():
    # A rule about a module that moved away would pass without checking anything.
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    for name, forbidden in RULES.items():
        for m in (name, *forbidden):
            assert m in modules, f"{m} (in RULES) is no module of the package"


def test_the_checker_sees_function_local_and_relative_imports(tmp_path):
    # The rule is only as good as the parser: a function-local relative import counts.
    path = tmp_path / "rpc.py"
    path.write_text("from .. import errors\n\ndef f():\n    from ..control.tables import Table\n")
    found = imports(path, "distore_ucx.transport.rpc")
    assert {"distore_ucx.errors", "distore_ucx.control.tables"} <= found


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (function-local ones too)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported in imports(path):
            # "from . import checkpoint" names a module; "from .x import f" a name in x
            target = imported if imported in modules else imported.rpartition(".")[0]
            if target in modules and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_modules():
    # A package's __init__ importing its children is not a cycle of concern;
    # anything else that imports in a circle (even through a function-local
    # import) is.
    graph = {k: {w for w in v if not (k.startswith(w + ".") and w != "distore_ucx")}
             for k, v in import_graph().items()}
    found = cycles(graph)
    assert not found, found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


ROLES = ("distore_ucx.control", "distore_ucx.storage", "distore_ucx.client")


def role_of(name: str) -> str | None:
    """The role package (control, storage, client) module `name` is in, if any."""
    return next((r for r in ROLES if name == r or name.startswith(r + ".")), None)


def test_roles_never_import_each_other():
    # The control plane, the storage nodes and the client share only what
    # sits below them (protocol, slot_format, spec, selectors, config, ...).
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        role = role_of(name)
        if role is None:
            continue
        for imported in imports(path):
            other = role_of(imported)
            if other is not None and other != role:
                bad.append(f"{name} imports {imported}")
    assert not bad, "\n".join(bad)


# Only these read the process environment: the configuration layer, the
# command-line programs and launchers, and the native loader (which sets a
# UCX default before UCX loads). Everything else gets its settings passed
# down, or calls a function of config that reads them. A name stands for a
# module or a package: every module of the config package may read it.
READS_ENVIRONMENT = {f"distore_ucx.{m}" for m in (
    "config", "cli", "cluster", "demo", "bench", "doctor", "ray", "_native_loader")}
# config's readers of a variable by name are for config's own functions
ENV_READERS = ("switch_from_env", "size_from_env")


def may_read_environment(name: str) -> bool:
    """Whether module `name` is one of READS_ENVIRONMENT, or in one that is a package."""
    return any(name == m or name.startswith(m + ".") for m in READS_ENVIRONMENT)


def imports_an_env_reader(imported: str) -> bool:
    """Whether `imported` names switch_from_env or size_from_env of the config
    package (re-exported by it, or from the module that defines them)."""
    module, _, attr = imported.rpartition(".")
    return attr in ENV_READERS and (module == "distore_ucx.config"
                                    or module.startswith("distore_ucx.config."))


def environment_reads(path: Path) -> list[str]:
    """Where `path` touches the environment: `os.environ`, `os.getenv`,
    `os.putenv`, or a name imported from os as one of them."""
    names = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"{path.parent.name}/{path.name}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{path.parent.name}/{path.name}:{node.lineno} from os import {a.name}"
                      for a in node.names if a.name in names]
    return found


def test_only_the_configuration_layer_reads_the_environment():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if may_read_environment(name):
            continue
        bad += environment_reads(path)
        bad += [f"{name} imports {i}" for i in imports(path) if imports_an_env_reader(i)]
    assert not bad, "\n".join(bad)


def test_the_environment_rule_covers_the_config_package_and_nothing_beside_it():
    assert may_read_environment("distore_ucx.config")
    assert may_read_environment("distore_ucx.config.environment")
    assert not may_read_environment("distore_ucx.configuration")
    assert not may_read_environment("distore_ucx.control.server")
    assert imports_an_env_reader("distore_ucx.config.switch_from_env")
    assert imports_an_env_reader("distore_ucx.config.environment.size_from_env")
    assert not imports_an_env_reader("distore_ucx.config.am_inserts_enabled")
    assert not imports_an_env_reader("distore_ucx.other.switch_from_env")


def test_the_environment_checker_sees_every_way_in(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("import os\nfrom os import getenv\n\ndef f():\n"
                    "    return os.environ.get('A'), os.getenv('B'), environ\n")
    found = environment_reads(path)
    assert len(found) == 3 and any("from os import getenv" in f for f in found), found
