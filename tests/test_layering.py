"""The library's layers: nothing under refkv/ imports the command line but the entry points."""

import ast
import importlib.util
import pathlib

import refkv

PACKAGE = pathlib.Path(refkv.__file__).parent


def _graph_tool():
    """docs/import_graph.py, the maintainers' drawing of the house: its resolver is the one this
    test trusts (a package importing its own submodules is no circle; TYPE_CHECKING never runs)."""
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "docs" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROOT = pathlib.Path(__file__).resolve().parents[1]
GRAPH = _graph_tool()
import_graph, find_cycle = GRAPH.import_graph, GRAPH.find_cycle
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
            target = GRAPH.absolute_target(node, package)
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
