"""Sphinx configuration for refkv's documentation.

Built with warnings as errors (``python -m sphinx -W --keep-going -b html docs docs/_build/html``),
which the test suite runs (tests/test_docs.py).
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import refkv  # noqa: E402

project = "refkv"
author = "the refkv developers"
copyright = "2026, the refkv developers"
release = refkv.__version__
version = refkv.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "numpydoc",
]

# numpydoc: do not list every class attribute as a separate stub page.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
autosummary_generate = False
autodoc_typehints = "none"
autodoc_member_order = "bysource"

# MathJax is loaded from the reader's browser; the build itself needs no network.
templates_path = []
exclude_patterns = ["_build", "**/example_*.py"]
html_theme = "alabaster"
html_static_path = ["_static"]
html_theme_options = {"description": "KV-cache eviction, exactly, in NumPy", "fixed_sidebar": True}
nitpicky = False
