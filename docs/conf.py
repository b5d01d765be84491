"""Sphinx configuration for refkv's documentation.

Build (warnings are errors; this is what ``tests/docs/test_docs.py`` runs)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

A full build executes every tutorial in ``tutorials/`` through sphinx-gallery (about
twelve minutes of CPU on a shared 2-core machine, each tutorial's time on the tutorials
page; it needs the ``plot``, ``test`` and ``models`` extras and the model wheel,
like the tutorials themselves). ``-D plot_gallery=0`` renders the tutorials' text and code
without running them; the docs test uses it because ``tests/docs/test_tutorials.py`` already
runs each tutorial in its own process.

The build needs no network, and neither does the built site. Intersphinx reads the small
numpy and scipy inventories in ``docs/_inventories/`` (written by
``docs/_inventories/make_inventories.py``). MathJax is served from the build itself: the
``sphinx-mathjax-offline`` extension (in the ``docs`` extra) copies MathJax 3 and its fonts
into ``_static/mathjax/``, so formulas render offline, in CI artefacts and on lab machines
without internet. ``tests/docs/test_docs.py`` fails if a built page references a remote script,
stylesheet or font.
"""

import importlib.util
import os
import pathlib
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
    "sphinx-mathjax-offline",  # MathJax 3 served from _static/mathjax, not a CDN
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
# The kvpress adapter (refkv.interop.kvpress, the interop extra) imports kvpress, torch and
# transformers at the top; the docs build without them (the first-hour install line has no
# interop extra), so autodoc imports the adapter against stand-ins for those three.
autodoc_mock_imports = ["kvpress", "torch", "transformers"]

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
#
# The student edition (``tutorials/make_student_edition.py``: the same scripts without
# their solutions) is a second gallery, written into ``docs/_student_tutorials/`` (ignored
# by git) at each build and rendered but never executed: ``filename_pattern`` matches only
# the numbered tutorials of ``tutorials/`` itself.
_edition = importlib.util.spec_from_file_location(
    "make_student_edition", pathlib.Path(__file__).parent.parent / "tutorials" / "make_student_edition.py")
_module = importlib.util.module_from_spec(_edition)
_edition.loader.exec_module(_module)
_module.write_edition(pathlib.Path(__file__).parent / "_student_tutorials", suffix="_student")
sphinx_gallery_conf = {
    "examples_dirs": ["../tutorials", "_student_tutorials"],
    "gallery_dirs": ["tutorials", "tutorials_student"],
    "filename_pattern": r"/tutorials/\d\d_",  # execute every numbered tutorial, not the copies
    "ignore_pattern": r"__init__\.py|make_student_edition\.py",
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
    # Print what a page should show; never the repr of a block's last expression (the
    # closing save_figures() call would otherwise end every page with a stray "[]").
    "capture_repr": (),
}

templates_path = []
# the authors' tables are included by the policies index, not pages of their own
exclude_patterns = ["_build", "_inventories", "**/example_*.py", "_student_tutorials", "policies/authors_table_*.rst"]
html_theme = "alabaster"
html_static_path = ["_static"]
# Code blocks scroll sideways instead of being cut, tables scroll inside the column, the
# column is wider than alabaster's 940 px (see _static/refkv.css).
html_css_files = ["refkv.css"]
html_theme_options = {"description": "KV-cache eviction, exactly, in NumPy", "fixed_sidebar": True,
                      "page_width": "1180px", "sidebar_width": "230px", "font_family": "Georgia, serif",
                      "head_font_family": "Georgia, serif"}
# The experiment data under _static/experiments is published as downloads, not pages.
mathjax_path = "mathjax/tex-chtml.js"  # relative to _static/: the copy the offline extension writes


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


# -- condensed experiment tables ---------------------------------------------------------
# ``.. rounded-csv:: PATH`` shows a published experiment table with its numbers rounded to
# 3 significant digits (``:digits:``), only the ``:columns:`` given (default: all but the
# bookkeeping ones), and a download link to the full CSV beneath it. The CSV stays the
# record; the page stays readable.
def _round_cell(text: str, digits: int) -> str:
    try:
        value = float(text)
    except ValueError:
        return text
    if "." not in text and "e" not in text.lower():
        return text  # an integer count stays exact
    if value == 0:
        return "0"
    return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"


def _rounded_csv_directive():
    import csv
    import typing

    from docutils.parsers.rst import directives
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective

    hidden = {"wall_time_s", "cpu_time_s", "skipped", "segments", "prompts"}

    class RoundedCSV(SphinxDirective):
        required_arguments = 1
        option_spec: typing.ClassVar[dict] = {"caption": directives.unchanged, "columns": directives.unchanged,
                       "digits": directives.positive_int}

        def run(self):
            relative, absolute = self.env.relfn2path(self.arguments[0])
            self.env.note_dependency(relative)
            with open(absolute, newline="", encoding="utf-8") as f:
                rows = list(csv.reader(f))
            header, body = rows[0], rows[1:]
            wanted = ([c.strip() for c in self.options["columns"].split(",")] if "columns" in self.options
                      else [c for c in header if c not in hidden])
            missing = [c for c in wanted if c not in header]
            if missing:
                raise self.error(f"{relative} has no column(s) {missing}; it has {header}")
            index = [header.index(c) for c in wanted]
            digits = self.options.get("digits", 3)

            def quoted(cell):
                return '"' + cell.replace('"', '""') + '"'

            lines = [f".. csv-table:: {self.options.get('caption', '')}", "   :header-rows: 1", ""]
            lines.append("   " + ",".join(quoted(c) for c in wanted))
            for row in body:
                lines.append("   " + ",".join(quoted(_round_cell(row[i], digits) if i < len(row) else "")
                                              for i in index))
            name = self.arguments[0].rsplit("/", 1)[-1]
            lines += ["", f"Rounded to {digits} significant digits; all columns, full precision: "
                          f":download:`{name} <{self.arguments[0]}>`.", ""]
            container = StringList(lines, source=relative)
            from docutils import nodes

            node = nodes.container()
            self.state.nested_parse(container, self.content_offset, node)
            return node.children

    return RoundedCSV


def setup(app):
    app.connect("missing-reference", _resolve_reexport)
    app.add_directive("rounded-csv", _rounded_csv_directive())
