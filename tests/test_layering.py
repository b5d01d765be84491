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
