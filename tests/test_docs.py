"""The documentation builds with warnings as errors (Sphinx -W --keep-going)."""

import pathlib
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.docs
def test_sphinx_build_has_no_warnings(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(tmp_path)],
        capture_output=True, text=True)
    assert result.returncode == 0, f"sphinx-build failed:\n{result.stdout}\n{result.stderr}"
