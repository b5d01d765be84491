"""The worked examples of the attention-based policies' documentation pages run and print what they say."""

import doctest
import pathlib

import pytest

PAGES = pathlib.Path(__file__).resolve().parents[2] / "docs" / "policies"


@pytest.mark.parametrize("page", ["tova", "h2o", "snapkv", "scissorhands", "caote"])
def test_worked_example(page):
    result = doctest.testfile(str(PAGES / f"{page}.rst"), module_relative=False, verbose=False,
                              optionflags=doctest.NORMALIZE_WHITESPACE, raise_on_error=False)
    assert result.attempted > 0
    assert result.failed == 0, f"docs/policies/{page}.rst: {result.failed} example(s) failed (see above)"
