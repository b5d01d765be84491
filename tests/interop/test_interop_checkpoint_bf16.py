"""bfloat16 and float16 on a real checkpoint (issue 33 B): the check rejects wrong presses and passes right ones.

SmolLM2-135M-Instruct, goldens from the CLI (``refkv golden generate --model smollm2``), presses
run through the public adapter, verdicts from ``refkv golden check``: the regime GPU backends
ship. Before each decision was judged on the candidate's own state, a press returning random
scores passed here ("90 ties accepted"). ``bench/oracle_variants.py`` runs the whole table of
variants and dtypes; these are the ones CI runs.
"""

import contextlib
import io

import pytest

torch = pytest.importorskip("torch", reason="needs torch: pip install 'refkv[interop]'")
kvpress = pytest.importorskip("kvpress", reason="needs kvpress: pip install 'refkv[interop]'")

from refkv.cli import main  # noqa: E402
from refkv.interop.kvpress import write_candidates  # noqa: E402
from refkv.interop.kvpress.variants import VARIANTS  # noqa: E402

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def goldens(smollm2, tmp_path_factory):
    """KeyDiff's schedule golden on SmolLM2: a 64-token prompt, then every 8 tokens down to 32, three rounds."""
    out = tmp_path_factory.mktemp("smollm2-goldens")
    assert main(["golden", "generate", "--model", "smollm2", "--policies", "keydiff", "--budget", "32",
                 "--interval", "8", "--new-tokens", "24", "--prompt-length", "64", "--out", str(out), "--quiet"]) == 0
    return out


def check(press, goldens, tmp_path, dtype):
    write_candidates(press, goldens, tmp_path / dtype, policy="keydiff", dtype=dtype, progress=None)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = main(["golden", "check", str(tmp_path / dtype), "--against", str(goldens), "--dtype", dtype,
                     "--verbose"])
    return code, report.getvalue()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_correct_decoding_press_passes_with_every_round_judged(goldens, tmp_path, dtype):
    code, report = check(VARIANTS["correct KeyDiff"].make(), goldens, tmp_path, dtype)
    assert code == 0, report
    assert "90 (round, layer) decisions judged" in report
    for r in range(3):
        assert f"round {r}: 30 decisions judged on the candidate's own state (30 evicting)" in report


@pytest.mark.parametrize("name", ["random scores", "KeyDiff anchor over the wrong window"])
def test_a_wrong_press_fails_in_bfloat16(goldens, tmp_path, name):
    code, report = check(VARIANTS[name].make(), goldens, tmp_path, "bfloat16")
    assert code == 1, report
    assert "first diverged at round 0" in report
