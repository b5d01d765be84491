"""The documentation builds with warnings as errors, and its reference parts stay complete.

The build runs on a copy of ``docs/`` and ``tutorials/`` in a temporary folder, because
sphinx-gallery writes its generated pages into the source tree; the checkout stays clean.
It passes ``-D plot_gallery=0``: the tutorials are rendered but not executed here, since
``tests/test_tutorials.py`` runs each of them already. A full build (without that flag)
executes them as well.
"""

import importlib
import importlib.util
import os
import pathlib
import pkgutil
import re
import shutil
import subprocess
import sys

import pytest

import refkv

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _load_inventory_script():
    spec = importlib.util.spec_from_file_location("make_inventories", DOCS / "_inventories" / "make_inventories.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def public_modules() -> list[str]:
    """Every importable module of the refkv package whose name has no leading underscore."""
    names = ["refkv"]
    for info in pkgutil.walk_packages(refkv.__path__, prefix="refkv."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def test_api_reference_covers_every_public_module():
    """docs/api.rst documents each public module (a new module must be added to it)."""
    documented = set(re.findall(r"^\.\. automodule:: ([\w.]+)", (DOCS / "api.rst").read_text(), re.M))
    missing = [m for m in public_modules() if m not in documented]
    assert not missing, f"add these modules to docs/api.rst: {missing}"
    stale = sorted(documented - set(public_modules()))
    assert not stale, f"docs/api.rst documents modules that do not exist: {stale}"


def test_intersphinx_inventories_list_every_numpy_and_scipy_reference():
    """The shipped inventories cover every numpy/scipy name the docs use (else rerun the script)."""
    script = _load_inventory_script()
    gaps = script.missing()
    assert not any(gaps.values()), (f"rerun `python docs/_inventories/make_inventories.py`; missing: "
                                    f"{ {k: sorted(v) for k, v in gaps.items() if v} }")


def test_intersphinx_inventories_are_readable_by_sphinx():
    from sphinx.util.inventory import InventoryFile

    for project, base in (("numpy", "https://numpy.org/doc/stable/"),
                          ("scipy", "https://docs.scipy.org/doc/scipy/")):
        with open(DOCS / "_inventories" / f"{project}.inv", "rb") as f:
            inventory = InventoryFile.load(f, base, lambda a, b: a + b)
        names = {name for domain in inventory.data.values() for name in domain} if hasattr(inventory, "data") \
            else {name for domain in inventory.values() for name in domain}
        assert all(n.startswith(project + ".") for n in names)
    # The one reference the foundation's own pages make must be there, pointing at numpy.org.
    with open(DOCS / "_inventories" / "numpy.inv", "rb") as f:
        inventory = InventoryFile.load(f, "https://numpy.org/doc/stable/", lambda a, b: a + b)
    functions = inventory.data["py:function"] if hasattr(inventory, "data") else inventory["py:function"]
    entry = functions["numpy.lexsort"]
    uri = entry.uri if hasattr(entry, "uri") else entry[2]
    assert uri == "https://numpy.org/doc/stable/reference/generated/numpy.lexsort.html#numpy.lexsort"


@pytest.mark.docs
def test_sphinx_build_has_no_warnings(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(DOCS, src / "docs", ignore=shutil.ignore_patterns("_build", "tutorials", "__pycache__"))
    shutil.copytree(ROOT / "tutorials", src / "tutorials", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               MPLBACKEND="Agg")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-D", "plot_gallery=0", "-b", "html",
         str(src / "docs"), str(tmp_path / "html")],
        capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"sphinx-build failed:\n{result.stdout}\n{result.stderr}"
    html = tmp_path / "html"
    for page in ("index", "api", "changelog", "guide/concepts", "tutorials/index",
                 "tutorials/01_kv_cache_from_scratch"):
        assert (html / f"{page}.html").exists(), f"{page}.html was not built"
