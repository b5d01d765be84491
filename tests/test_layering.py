"""The library's layers: nothing under refkv/ imports the command line but the entry points."""

import ast
import pathlib

import refkv

PACKAGE = pathlib.Path(refkv.__file__).parent
ENTRY_POINTS = {PACKAGE / "cli.py", PACKAGE / "__main__.py"}


def _imported_modules(source: str, module: str) -> set[str]:
    """Absolute names of every module that ``source`` (the module named ``module``) imports, at
    module level or inside a function. ``module`` of a package's ``__init__`` ends in ``.__init__``."""
    package = module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = node.module or ""
            if node.level:
                target = f"{base}.{target}" if target else base
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)  # `from refkv import cli`
    return names


def _module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_the_resolver_sees_every_form_of_import():
    # The check below is only as good as this resolver: each form must come out as refkv.cli.
    for module, source in [("refkv.engine", "from .cli import main"), ("refkv.engine", "from . import cli"),
                           ("refkv.policies.base", "def f():\n    import refkv.cli\n"),
                           ("refkv.policies.base", "from ..cli import main"),
                           ("refkv.oracle.__init__", "from ..cli import main"),
                           ("refkv.oracle.checker", "def g():\n    from refkv.cli import main\n")]:
        assert "refkv.cli" in _imported_modules(source, module), (module, source)
    # ... and a sub-package's own cli module is not the top-level one.
    assert "refkv.cli" not in _imported_modules("from .cli import add_golden_command", "refkv.oracle.generate")


def test_no_library_module_imports_the_cli():
    offenders = sorted(_module_name(path) for path in PACKAGE.rglob("*.py") if path not in ENTRY_POINTS
                       and "refkv.cli" in _imported_modules(path.read_text(encoding="utf-8"), _module_name(path)))
    assert offenders == [], f"these modules import refkv.cli: {offenders}"


def test_no_core_module_imports_the_interop_adapters():
    """refkv.interop needs torch, transformers and kvpress (the interop extra): the core never imports it."""
    interop = PACKAGE / "interop"
    offenders = sorted(_module_name(path) for path in PACKAGE.rglob("*.py") if interop not in path.parents
                       and any(name == "refkv.interop" or name.startswith("refkv.interop.")
                               for name in _imported_modules(path.read_text(encoding="utf-8"), _module_name(path))))
    assert offenders == [], f"these core modules import refkv.interop: {offenders}"
    assert "refkv.interop" in _imported_modules("from ..interop import kvpress", "refkv.oracle.cli")


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:`` (imports there never run)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST):
    """Every Import/ImportFrom node of ``tree`` that can run: at module level, in a class or in a
    function body, but not in the body of an ``if TYPE_CHECKING:`` block (its ``else`` counts)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph(sources: dict[str, str], packages=frozenset()) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports, anywhere in its code (``TYPE_CHECKING`` aside).

    ``sources`` maps each module's name to its code, a package's ``__init__`` under the
    package's own name (``refkv.oracle``); ``packages`` names those. ``from X import name``
    imports the module ``X.name`` when that is one of ``sources``, else ``X`` itself. Only
    edges between modules of ``sources`` are kept. The implicit import of a module's parent
    package is no edge: Python runs ``refkv/oracle/__init__.py`` before
    ``refkv/oracle/vectors.py``, but a package importing its own submodules is no circle.
    """
    graph: dict[str, set[str]] = {}
    for module, source in sources.items():
        package = module if module in packages else module.rpartition(".")[0]
        targets = set()
        for node in _runtime_imports(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = node.module or ""
            if node.level:
                target = f"{base}.{target}" if target else base
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                targets.add(sub if sub in sources else target)
        graph[module] = {t for t in targets if t in sources and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path of the depth-first search, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _library_graph() -> dict[str, set[str]]:
    sources, packages = {}, set()
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path).removesuffix(".__init__")
        if path.name == "__init__.py":
            packages.add(name)
        sources[name] = path.read_text(encoding="utf-8")
    return import_graph(sources, packages)


def test_the_cycle_finder_sees_a_circle_through_a_function_body():
    # A hand-made circle: a imports b at the top, b imports a inside a function.
    sources = {"pkg": "", "pkg.a": "from .b import g\n",
               "pkg.b": "def g():\n    from . import a\n    return a\n", "pkg.c": "import pkg.a\n"}
    assert find_cycle(import_graph(sources, {"pkg"})) == ["pkg.a", "pkg.b", "pkg.a"]
    # ... but none behind `if TYPE_CHECKING:`, nor a package importing its own submodules.
    sources["pkg.b"] = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
    sources["pkg"] = "from .a import g\n"
    assert find_cycle(import_graph(sources, {"pkg"})) is None
    # A package's __init__ and a module that imports the package (not one of its modules).
    sources["pkg.c"] = "def h():\n    from pkg import g\n"
    sources["pkg"] = "from .c import h\n"
    assert find_cycle(import_graph(sources, {"pkg"})) == ["pkg", "pkg.c", "pkg"]


def test_no_import_circle():
    """No refkv module imports another that (through any chain) imports it back, counting
    imports inside functions: an import placed in a function to dodge a circle is still one."""
    cycle = find_cycle(_library_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)
