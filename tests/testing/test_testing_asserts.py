"""refkv.testing: the assertions' verdicts, their messages, and their hidden frames."""

import pathlib
import re
import textwrap

import numpy as np
import pytest

from refkv import policies
from refkv.oracle.tolerance import score_tolerance
from refkv.testing import assert_case, assert_same_retention, assert_scores_close, load_cases

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"
pytest_plugins = ["pytester"]


def test_assert_scores_close_passes_within_tolerance_and_fails_outside():
    desired = np.array([[1.0, -2.0], [0.5, 0.0]])
    assert_scores_close(desired * (1 + 1e-9), desired, rtol=1e-8)
    with pytest.raises(AssertionError) as err:
        assert_scores_close(desired + np.array([[0, 0], [0, 1e-3]]), desired, rtol=1e-8, atol=1e-6,
                            positions=np.array([[0, 7], [0, 9]]), err_msg="my kernel")
    msg = str(err.value)
    assert msg.splitlines()[0] == "scores differ (my kernel)"
    assert "values differ: 1 of 4 elements (25%) beyond rtol=1e-08, atol=1e-06" in msg
    assert "first at head 1, position 9 (column 1): actual 0.001, desired 0, |diff| 0.001 > allowed 1e-06" in msg


def test_assert_scores_close_checks_shape_then_dtype():
    with pytest.raises(AssertionError, match=r"shape mismatch: actual \(2,\), desired \(3,\)"):
        assert_scores_close(np.zeros(2, dtype=np.int32), np.zeros(3))
    with pytest.raises(AssertionError, match=r"dtype mismatch: actual int32 .integer., desired float64 .float."):
        assert_scores_close(np.zeros(3, dtype=np.int32), np.zeros(3))
    assert_scores_close(np.zeros(3, dtype=np.float32), np.zeros(3))
    with pytest.raises(AssertionError, match="dtype mismatch: actual float32, desired float64"):
        assert_scores_close(np.zeros(3, dtype=np.float32), np.zeros(3), check_dtype=True)


def test_assert_same_retention_returns_ties_and_explains_failures():
    scores = np.array([[3.0, 1.0, 1.0 + 1e-12, 0.0]])
    positions = np.array([[0, 5, 6, 8]])
    ties = assert_same_retention(np.array([[0, 1]]), np.array([[0, 2]]), scores, positions=positions, atol=1e-9)
    assert len(ties) == 1 and (ties[0].kept_position, ties[0].dropped_position) == (5, 6)
    assert assert_same_retention(np.array([[0, 2]]), np.array([[0, 2]]), scores) == []
    with pytest.raises(AssertionError) as err:
        assert_same_retention(np.array([[2, 3]]), np.array([[0, 2]]), scores, positions=positions, rtol=0.0,
                              atol=1e-9)
    assert str(err.value) == (
        "kept tokens differ from the reference\n"
        "head 0: candidate keeps position 8 (reference score 0) instead of position 0 (reference score 3); "
        "|difference| 3 > tolerance 1e-09 [rtol=0, atol=1e-09]\n"
        "  head 0: candidate keeps positions 6,8\n"
        "  head 0: reference keeps positions 0,6\n"
        "  only the candidate keeps [8]; only the reference keeps [0]")
    with pytest.raises(AssertionError, match=r"by ties .strict_ties=True."):
        assert_same_retention(np.array([[0, 1]]), np.array([[0, 2]]), scores, atol=1e-9, strict_ties=True)


def test_load_cases_filters_and_assert_case_uses_the_dtype_derived_tolerance():
    cases = load_cases(GOLDEN, policy="keydiff", dtype="float32")
    assert cases and all(c.dtype == "float32" and c.policy_name == "keydiff" for c in cases)
    assert all("near-tie" in c.flags for c in load_cases(GOLDEN / "vectors" / "keydiff.json", flags=["near-tie"]))
    defaults = load_cases(GOLDEN, policy="keydiff", params={"anchor": "unit_mean", "metric": "cosine",
                                                            "reserve": 0.0, "eps": 1e-8})
    assert defaults and len(defaults) < len(load_cases(GOLDEN, policy="keydiff"))
    knorm = load_cases(GOLDEN, policy="knorm", params=policies.get("knorm").params())
    assert knorm and all(c.params["skip_layers"] == [] for c in knorm)  # a tuple matches its JSON list
    case = cases[0]
    out = case.outputs
    # Tolerances derive from the candidate's dtype (the case's own, float32, by default) at
    # each score's own scale, not from the case's stored rtol/atol (issue 12 B).
    tol = score_tolerance(case)
    assert assert_case(case, scores=out["scores"] + tol / 2, kept=out["kept"]) == []
    with pytest.raises(AssertionError, match=r"^scores differ \(" + re.escape(case.label) + r".*\nvalues differ"):
        assert_case(case, scores=out["scores"] + 3 * tol)
    # bfloat16 tolerances are wider by about 2**16 (the ratio of unit roundoffs).
    assert assert_case(case, scores=out["scores"] + 3 * tol, kept=out["kept"], dtype="bfloat16") == []
    with pytest.raises(ValueError, match="at least one"):
        assert_case(case)


def test_assertions_hide_their_frames_from_pytest_tracebacks(pytester):
    pytester.makepyfile(test_hidden=textwrap.dedent("""
        import numpy as np
        from refkv.testing import assert_same_retention, assert_scores_close

        def test_scores():
            assert_scores_close(np.array([1.0]), np.array([2.0]))

        def test_retention():
            assert_same_retention(np.array([[1]]), np.array([[0]]), np.array([[1.0, 0.0]]))
    """))
    result = pytester.runpytest("-p", "no:cacheprovider", "--tb=long")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "test_hidden.py:5: AssertionError" in out and "test_hidden.py:8: AssertionError" in out
    assert "refkv/testing" not in out and "__tracebackhide__" not in out


# -- array-likes: what kernels return -----------------------------------------------------------------
class FakeTensor:
    """Duck-typed like a torch bfloat16 tensor: np.asarray fails, .float().numpy() works."""

    dtype = "fake.bfloat16"

    def __init__(self, values, *, low=True):
        self._values, self._low = np.asarray(values), low

    def __array__(self, dtype=None, copy=None):
        if self._low:
            raise TypeError("Got unsupported ScalarType BFloat16")
        return self._values if dtype is None else self._values.astype(dtype)

    def detach(self):
        return self

    def cpu(self):
        return self

    def float(self):
        return FakeTensor(self._values.astype(np.float32), low=False)

    def numpy(self):
        if self._low:
            raise TypeError("Got unsupported ScalarType BFloat16")
        return self._values


def test_assertions_accept_lists_and_duck_typed_tensors_without_importing_their_library():
    case = load_cases(GOLDEN, policy="keydiff", dtype="float32")[0]
    out = case.outputs
    assert assert_case(case, scores=out["scores"].tolist(), kept=out["kept"].tolist()) == []
    assert assert_case(case, scores=FakeTensor(out["scores"]), kept=FakeTensor(out["kept"], low=False),
                       dtype="bfloat16") == []
    with pytest.raises(AssertionError, match="scores differ"):
        assert_case(case, scores=FakeTensor(out["scores"] + 1.0), dtype="bfloat16")
    assert_scores_close(FakeTensor([[1.0, 2.0]]), [[1.0, 2.0]])

    class FakeJaxBfloat16:  # np.asarray gives a dtype NumPy cannot compute with; astype works
        dtype = "bfloat16"

        def __init__(self, values):
            self._values = np.asarray(values)

        def __array__(self, dtype=None, copy=None):
            return np.array([object()] * self._values.size, dtype=object).reshape(self._values.shape)

        def astype(self, dtype):
            return self._values.astype(dtype)

    assert assert_case(case, scores=FakeJaxBfloat16(out["scores"]), dtype="bfloat16") == []
    with pytest.raises(TypeError, match="actual: cannot convert object to a NumPy array"):
        assert_scores_close(object(), [[1.0]])


@pytest.mark.slow  # importing torch takes several seconds
def test_assertions_accept_torch_bfloat16_tensors():
    torch = pytest.importorskip("torch")
    case = load_cases(GOLDEN, policy="tova", dtype="float32")[0]
    out = case.outputs
    scores = torch.from_numpy(out["scores"]).to(torch.bfloat16)  # what a bf16 kernel returns
    kept = torch.from_numpy(out["kept"])
    with pytest.raises(TypeError):
        np.asarray(scores)  # NumPy has no bfloat16: the reason for the conversion
    assert assert_case(case, scores=scores, kept=kept, dtype="bfloat16") == []
    with pytest.raises(AssertionError, match="scores differ"):
        assert_case(case, scores=scores.float() * 1.5, dtype="bfloat16")
    ties = assert_same_retention(kept, out["kept"], torch.from_numpy(out["scores"]))
    assert ties == []


def test_the_one_shot_example_of_the_testing_page_runs():
    page = (pathlib.Path(__file__).parents[2] / "docs" / "oracle" / "testing.rst").read_text()
    block = next(b for b in page.split(".. code-block:: python")[1:] if b.lstrip().startswith("# oneshot-example"))
    body = []
    for line in block.splitlines()[1:]:
        if line and not line.startswith("   "):
            break
        body.append(line[3:])
    code = textwrap.dedent("\n".join(body))
    exec(compile(code, "testing.rst one-shot example", "exec"), {"__name__": "docs_example"})
    # The example's kernel is right; the same loop with the group's max must fail.
    wrong = code.replace("a[:, :, -1, :].mean(axis=1)", "a[:, :, -1, :].max(axis=1)")
    assert wrong != code
    with pytest.raises(AssertionError, match="scores differ"):
        exec(compile(wrong, "testing.rst one-shot example, wrong", "exec"), {"__name__": "docs_example"})
