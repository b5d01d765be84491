"""Sphinx configuration for refkv's documentation.

Build (warnings are errors; this is what ``tests/test_docs.py`` runs)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

A full build executes every tutorial in ``tutorials/`` through sphinx-gallery (about a
minute of CPU; it needs the ``plot``, ``test`` and ``models`` extras and the model wheel,
like the tutorials themselves). ``-D plot_gallery=0`` renders the tutorials' text and code
without running them; the docs test uses it because ``tests/test_tutorials.py`` already
runs each tutorial in its own process.

The build needs no network. Intersphinx reads the small numpy and scipy inventories in
``docs/_inventories/`` (written by ``docs/_inventories/make_inventories.py``), and MathJax
is loaded by the reader's browser.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import refkv

project = "refkv"
author = "the refkv developers"
copyright = "2026, the refkv developers"
release = refkv.__version__
version = refkv.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "numpydoc",
    "sphinx_gallery.gen_gallery",
]

# numpydoc: do not list every class attribute as a separate stub page.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
autosummary_generate = False
autodoc_typehints = "none"
autodoc_member_order = "bysource"

# -- cross-references to numpy and scipy, offline -------------------------------------
# The inventories are local files (this machine and CI have no internet); the URLs are
# where the links point in the rendered pages. ``make_inventories.py`` lists every numpy
# and scipy object the docs, docstrings and tutorials name, and the nitpicky setting
# below turns a reference missing from them into a build error.
intersphinx_mapping = {
    "numpy": ("https://numpy.org/doc/stable/", "_inventories/numpy.inv"),
    "scipy": ("https://docs.scipy.org/doc/scipy/", "_inventories/scipy.inv"),
}
intersphinx_cache_limit = -1
intersphinx_timeout = 1

# Nitpicky only for numpy and scipy targets: those must resolve (through the shipped
# inventories); refkv's own docstrings name shapes and dtypes in prose, not as targets.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?s)(?!(numpy|scipy)\.).*")]

# -- tutorials: sphinx-gallery ----------------------------------------------------------
# The tutorials are plain Python scripts (``tutorials/NN_name.py``) whose comment blocks
# are reStructuredText. The same file is run by the test suite, rendered here, and offered
# as a script and a notebook download: there is one copy of every tutorial.
sphinx_gallery_conf = {
    "examples_dirs": "../tutorials",
    "gallery_dirs": "tutorials",
    "filename_pattern": r"/\d\d_",           # execute every numbered tutorial
    "within_subsection_order": "FileNameSortKey",
    "abort_on_example_error": True,           # a tutorial that raises fails the build
    "download_all_examples": False,
    "write_computation_times": False,
    "remove_config_comments": True,
    "show_signature": False,
    "min_reported_time": 1,
    "reset_modules": ("matplotlib",),
    "image_scrapers": ("matplotlib",),
    "matplotlib_animations": False,
}

templates_path = []
exclude_patterns = ["_build", "_inventories", "**/example_*.py"]
html_theme = "alabaster"
html_static_path = ["_static"]
html_theme_options = {"description": "KV-cache eviction, exactly, in NumPy", "fixed_sidebar": True}


# -- re-exported names ------------------------------------------------------------------
# ``refkv.Engine``, ``refkv.policies.select`` and ``refkv.model.Model`` are the names users
# type, but each object is documented once, in the module that defines it
# (``refkv.engine.Engine``, ...). This resolves a reference to a re-exported or imported
# name to the defining module's entry, so docstrings may use the short public path, or a
# bare name imported into their module.
def _resolve_reexport(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    module = node.get("py:module") or ""
    if not target.startswith("refkv.") and module.startswith("refkv."):
        # A short name in a docstring (``select`` in refkv.policies.mat): the object that
        # name is bound to in the docstring's module, wherever it is defined.
        target = f"{module}.{target}"
    if not target.startswith("refkv."):
        return None
    import importlib

    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                parent, obj = obj, getattr(obj, attr)
        except AttributeError:
            return None
        break
    else:
        return None
    owner = obj if hasattr(obj, "__module__") and hasattr(obj, "__qualname__") else parent
    if not (hasattr(owner, "__module__") and hasattr(owner, "__qualname__")):
        return None
    canonical = f"{owner.__module__}.{owner.__qualname__}"
    if owner is not obj:  # a data attribute: keep its own name under the defining class/module
        canonical = f"{canonical}.{parts[-1]}" if not isinstance(parent, type(importlib)) \
            else f"{parent.__name__}.{parts[-1]}"
    if canonical == target:
        return None
    domain = env.domains["py"]
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], canonical, node, contnode)


def setup(app):
    app.connect("missing-reference", _resolve_reexport)
