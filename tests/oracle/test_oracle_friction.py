"""Issue 22 G: the friction a kvpress developer met, each fixed and pinned.

* :func:`refkv.testing.assert_case` takes what :func:`refkv.oracle.encode.encode_case` returns;
* kept tokens given as positions are accepted with ``kept_as="positions"``, and given where
  column indices are expected they fail with one line saying which was expected (never an
  ``IndexError``);
* ``refkv golden check`` exits 1 when nothing was compared, as ``docs/oracle/ci.rst`` says;
* ``docs/oracle/format.rst``'s text on the stored state of a stateful policy agrees with
  what the code stores (H2O's accumulators include the current block).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from refkv import policies
from refkv.cli import main
from refkv.oracle.cases import compare_case
from refkv.oracle.encode import candidate_document, encode_case, vectors_document
from refkv.oracle.io import write_json
from refkv.oracle.synthetic import random_tokens, replay
from refkv.oracle.vectors import as_vector_case, json_params, read_vectors
from refkv.policies.h2o import FIELD as H2O_FIELD
from refkv.testing import assert_case

DOCS = Path(__file__).resolve().parents[2] / "docs" / "oracle"


def _block_case(name="tova", seed=0, n_tokens=40, block=8, budget=16, **params):
    """A block-mode case (several evictions before it): its positions are not its columns."""
    policy = policies.get(name, **params)
    tokens = random_tokens(np.random.default_rng(seed), 4, 2, 8, n_tokens, np.float32)
    view = replay(policy, tokens, block_size=block, budget=budget)
    return policy, encode_case(policy, view, case_id=seed + 1, comment=f"{name}, blocks of {block}")


# -- assert_case takes what encode_case returns --------------------------------------------------
def test_assert_case_accepts_what_encode_case_returns():
    _, encoded = _block_case()
    case = as_vector_case(encoded)
    out = case.outputs
    assert assert_case(encoded, scores=out["scores"], kept=out["kept"]) == []
    assert compare_case({"scores": out["scores"], "kept": out["kept"]}, encoded).ok
    # ... and still judges: a wrong kept set fails with the case's label.
    wrong = out["kept"].copy()
    wrong[0, 0] = next(c for c in range(case.sizes["n"]) if c not in wrong[0])
    wrong.sort(axis=1)
    with pytest.raises(AssertionError, match=r"kept tokens differ from the reference \(tova case 1 \["):
        assert_case(encoded, kept=wrong)


def test_encoded_case_is_written_as_the_plain_json_object(tmp_path):
    policy, encoded = _block_case()
    assert json.loads(json.dumps(encoded)) == dict(encoded)  # nothing but the case's JSON object
    assert "policy" not in encoded and "params" not in encoded
    path = tmp_path / "tova.json"
    write_json(path, vectors_document("tova", [(json_params(policy.params()), [encoded])]))
    from_file = read_vectors(path).cases[0]
    decoded = as_vector_case(encoded)
    assert (decoded.label, decoded.params, decoded.budget) == (from_file.label, from_file.params, from_file.budget)
    for name in ("scores", "protected", "kept"):
        np.testing.assert_array_equal(decoded.outputs[name], from_file.outputs[name])


def test_a_plain_case_dict_needs_its_policy():
    policy, encoded = _block_case()
    plain = json.loads(json.dumps(encoded))
    with pytest.raises(ValueError, match="does not name its policy"):
        assert_case(plain, kept=[[0]])
    assert as_vector_case(plain, policy).label == as_vector_case(encoded).label
    with pytest.raises(ValueError, match="case must be a VectorCase"):
        assert_case([1, 2], kept=[[0]])


# -- positions or columns --------------------------------------------------------------------------
def test_kept_positions_are_accepted_by_keyword():
    _, encoded = _block_case()
    case = as_vector_case(encoded)
    positions = np.take_along_axis(case.inputs["positions"], case.outputs["kept"], axis=1)
    assert not np.array_equal(positions, case.outputs["kept"])  # the case tells them apart
    assert assert_case(encoded, kept=positions, kept_as="positions") == []
    # Positions in any order name the same set.
    assert assert_case(encoded, kept=positions[:, ::-1], kept_as="positions") == []


def _one_line_error(encoded, kept, kept_as="columns") -> str:
    with pytest.raises(AssertionError) as info:
        assert_case(encoded, kept=kept, kept_as=kept_as)
    lines = str(info.value).splitlines()
    return lines[1]


def test_positions_where_columns_are_expected_fail_with_one_line_naming_columns():
    _, encoded = _block_case()
    case = as_vector_case(encoded)
    positions = np.take_along_axis(case.inputs["positions"], case.outputs["kept"], axis=1)
    n = case.sizes["n"]
    assert positions.max() >= n  # the raw IndexError this used to give
    line = _one_line_error(encoded, positions)
    assert re.fullmatch(rf"head \d: candidate keeps column \d+, outside \[0, {n - 1}\]: kept must hold column "
                        rf"indices into the case's {n} candidates, not token positions \(they look like token "
                        rf"positions: pass kept_as='positions'\)", line), line


def test_in_range_positions_where_columns_are_expected_get_a_hint():
    # Positions that all happen to be < n are valid columns of other tokens: the comparison
    # fails on the kept sets and says the values are the reference's kept positions. Knorm
    # keeps the lowest key norms; position 1 (norm 100) and 11 (90) are evicted at block 2,
    # positions 12-15 (50) at block 3, so the last decision keeps positions 0, 2-10 < n = 14.
    from refkv.oracle.synthetic import Tokens

    rng = np.random.default_rng(0)
    norms = np.array([1, 100, 1, 1, 1, 1, 1, 1, 1, 1, 1, 90, 50, 50, 50, 50], dtype=np.float64)
    directions = rng.standard_normal((1, 16, 8))
    keys = directions / np.linalg.norm(directions, axis=-1, keepdims=True) * norms[:, None]
    tokens = Tokens(rng.standard_normal((2, 16, 8)), keys, rng.standard_normal((1, 16, 8)))
    policy = policies.get("knorm")
    encoded = encode_case(policy, replay(policy, tokens, block_size=4, budget=10), case_id=1, comment="")
    case = as_vector_case(encoded)
    positions = np.take_along_axis(case.inputs["positions"], case.outputs["kept"], axis=1)
    assert positions.tolist() == [[0, 2, 3, 4, 5, 6, 7, 8, 9, 10]] and case.sizes["n"] == 14
    with pytest.raises(AssertionError, match="pass kept_as='positions' if they are positions"):
        assert_case(encoded, kept=positions)
    assert assert_case(encoded, kept=positions, kept_as="positions") == []


def test_columns_where_positions_are_expected_fail_with_one_line_naming_positions():
    _, encoded = _block_case()
    case = as_vector_case(encoded)
    columns = case.outputs["kept"]
    line = _one_line_error(encoded, columns + 1000, kept_as="positions")
    assert re.fullmatch(r"head 0: candidate keeps position \d+, which is not among the case's candidates: with "
                        r"kept_as='positions' kept must hold token positions \(inputs\['positions'\]\), not "
                        r"column indices", line), line
    with pytest.raises(ValueError, match="kept_as must be one of"):
        assert_case(encoded, kept=columns, kept_as="rows")


def test_assert_same_retention_out_of_range_column_is_one_line():
    from refkv.testing import assert_same_retention

    with pytest.raises(AssertionError) as info:
        assert_same_retention([[0, 7]], [[0, 1]], np.array([[3.0, 2.0, 1.0]]))
    assert str(info.value).splitlines()[1] == "head 0: candidate keeps column 7, outside [0, 2]"


# -- golden check on an empty comparison -------------------------------------------------------------
@pytest.fixture
def variant_folder(tmp_path):
    """A folder of one-shot H2O cases with a non-default parameter, and a correct candidate."""
    policy = policies.get("h2o", recent=2)
    cases, outputs = [], {}
    for seed in (0, 1):
        tokens = random_tokens(np.random.default_rng(seed), 4, 2, 8, 20, np.float32)
        encoded = encode_case(policy, replay(policy, tokens, budget=8), case_id=seed, comment="one-shot, recent=2")
        cases.append(encoded)
        out = as_vector_case(encoded).outputs
        outputs[seed] = {"scores": out["scores"], "kept": out["kept"]}
    write_json(tmp_path / "ref" / "h2o.json", vectors_document("h2o", [(json_params(policy.params()), cases)]))
    write_json(tmp_path / "cand" / "h2o.json", candidate_document("h2o", outputs))
    return tmp_path


def _check(capsys, *args):
    code = main(["golden", "check", *map(str, args)])
    return code, capsys.readouterr().out


def test_golden_check_exits_1_when_default_params_leave_nothing_to_compare(variant_folder, capsys):
    ref, cand = variant_folder / "ref", variant_folder / "cand"
    code, out = _check(capsys, cand, "--against", ref)
    assert code == 0 and out.rstrip().endswith("PASS")
    code, out = _check(capsys, cand, "--against", ref, "--default-params")
    assert code == 1, out
    assert "PASS" not in out
    assert out.rstrip().endswith("FAIL (nothing was compared: no reference case matched the selection -- "
                                 "--default-params, --case-dtype or --dtype)")
    assert "warning: nothing compared: no reference case matches the selection (default parameters only)" in out


def test_golden_check_exits_1_when_the_case_dtype_leaves_nothing_to_compare(variant_folder, capsys):
    code, out = _check(capsys, variant_folder / "cand", "--against", variant_folder / "ref", "--dtype", "float64")
    assert code == 1 and "(case dtype float64)" in out and "nothing was compared" in out


def test_an_empty_file_beside_a_compared_one_does_not_fail_the_check(variant_folder, capsys):
    # Only an entirely empty comparison fails: a policy whose variants are filtered out
    # beside one whose cases are compared is a pass.
    policy = policies.get("tova")
    tokens = random_tokens(np.random.default_rng(5), 4, 2, 8, 20, np.float32)
    encoded = encode_case(policy, replay(policy, tokens, budget=8), case_id=1, comment="one-shot")
    write_json(variant_folder / "ref" / "tova.json",
               vectors_document("tova", [(json_params(policy.params()), [encoded])]))
    write_json(variant_folder / "cand" / "tova.json",
               candidate_document("tova", {1: {"kept": as_vector_case(encoded).outputs["kept"]}}))
    code, out = _check(capsys, variant_folder / "cand", "--against", variant_folder / "ref", "--default-params")
    assert code == 0 and out.rstrip().endswith("PASS"), out


# -- the stored state of a stateful policy, as format.rst says ---------------------------------------
def _state_paragraph() -> str:
    text = (DOCS / "format.rst").read_text(encoding="utf-8")
    start = text.index("* For a stateful policy ``fields``")
    return " ".join(text[start:text.index("\n\n", start)].split())


def test_format_page_says_the_state_includes_the_current_block_after_attention():
    paragraph = _state_paragraph()
    assert "including the current block" in paragraph and "earlier blocks only" in paragraph, paragraph


@pytest.mark.parametrize("block", [None, 6])
def test_h2o_stored_state_includes_the_current_block(block):
    # The page's claim, checked on the code: H2O's stored accumulators minus the current
    # block's column sums (group mean, summed over the block's queries) is what the earlier
    # blocks left -- zero for a one-shot case, which has no earlier block.
    policy = policies.get("h2o")
    tokens = random_tokens(np.random.default_rng(3), 4, 2, 8, 24, np.float64)
    case = as_vector_case(encode_case(policy, replay(policy, tokens, block_size=block, budget=10),
                                      case_id=1, comment=""))
    state = case.fields[H2O_FIELD]                                   # (Hkv, n)
    this_block = case.inputs["attention"].mean(axis=1).sum(axis=1)   # (Hkv, g, B, n) -> (Hkv, n)
    np.testing.assert_array_equal(case.outputs["scores"], state)
    earlier = state - this_block
    if block is None:
        np.testing.assert_allclose(earlier, 0.0, atol=1e-12)
    else:
        # Tokens of the current block were seen by no earlier query.
        b = case.sizes["block"]
        np.testing.assert_allclose(earlier[:, -b:], 0.0, atol=1e-12)
        assert (earlier[:, :-b] > 0).all()


# -- the docs' PyTorch workflow drives the press's own compress ------------------------------------
def _kvpress_example() -> str:
    text = (DOCS / "kvpress.rst").read_text(encoding="utf-8")
    block = text[text.index(".. begin-example\n"):text.index(".. end-example\n")]
    return "\n".join(line[3:] for line in block.splitlines()[4:])  # under ".. code-block:: python"


def test_kvpress_example_selects_with_the_press_compress_not_its_own_top_k():
    code = _kvpress_example()
    assert "press.compress(" in code and "topk" not in code


def test_kvpress_example_fails_when_the_press_compress_is_wrong(tmp_path, monkeypatch):
    # The example checks kvpress's selection, not a copy of it: a compress that keeps the
    # lowest scores instead of the highest makes it fail.
    pytest.importorskip("kvpress")
    from kvpress.presses.scorer_press import ScorerPress

    def keeps_the_lowest(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = int(keys.shape[2] * (1 - self.compression_ratio))
        indices = scores.topk(n_kept, dim=-1, largest=False).indices
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
        return keys.gather(2, indices), values.gather(2, indices)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ScorerPress, "compress", keeps_the_lowest)
    with pytest.raises(AssertionError, match="kept tokens differ from the reference"):
        exec(compile(_kvpress_example(), "kvpress.rst example", "exec"), {"__name__": "kvpress_example"})
