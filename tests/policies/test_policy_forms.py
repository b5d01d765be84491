"""Policy forms (paper, authors', kvpress): the map every class declares, the tie order of the
authors' forms of H2O and TOVA, and ``refkv policies --forms``."""

import numpy as np
import pytest

from refkv import policies
from refkv.cli import main
from refkv.policies import View, get, policy_class, policy_forms, select
from refkv.policies.h2o import FIELD

#: Filled by the helper of issue 34 part A (the others are filled by the SnapKV/HashEvict helper).
MINE = ("caote", "expected_attention", "full", "h2o", "keydiff", "knorm", "mat", "scissorhands", "sink", "tova")


def test_every_policy_has_a_paper_form_first_and_every_entry_names_source_and_proof():
    for name in policies.available():
        forms = policy_forms(policy_class(name))
        assert next(iter(forms)) == "paper", name
        for form, entry in forms.items():
            assert set(entry) == {"source", "proven"}, (name, form)
            assert entry["source"], (name, form)
            assert entry["proven"] is None or isinstance(entry["proven"], str)


def test_the_policies_of_this_change_declare_their_forms_themselves():
    for name in MINE:
        assert "forms" in vars(policy_class(name)), name


def test_a_form_parameter_is_declared_in_the_map():
    """Every value a policy's ``form`` parameter accepts appears in its forms map."""
    for name in ("h2o", "tova"):
        module = __import__(f"refkv.policies.{name}", fromlist=["FORMS"])
        assert set(module.FORMS) <= set(policy_forms(policy_class(name))), name
        with pytest.raises(ValueError, match="form must be one of"):
            get(name, form="nope")


def test_select_older_ties_keep_the_older_token_and_recent_the_newer():
    scores = np.array([[1.0, 0.0, 1.0, 0.0, 1.0]])
    positions = np.array([[3, 5, 8, 9, 12]])
    assert select(scores, positions, 2).tolist() == [[2, 4]]
    assert select(scores, positions, 2, ties="older").tolist() == [[0, 2]]
    # protected tokens first whatever the tie order
    protected = np.array([[False, False, False, False, True]])
    assert select(scores, positions, 2, protected, ties="older").tolist() == [[0, 4]]
    with pytest.raises(ValueError, match="ties must be one of"):
        select(scores, positions, 2, ties="random")


def _tova_view(last_rows):
    """A view with two KV heads of two query heads each, one query, five tokens."""
    a = np.asarray(last_rows, dtype=np.float64).reshape(2, 2, 1, 5)
    hkv, n, d = 2, 5, 2
    return View(layer=0, n_layers=1, keys=np.zeros((hkv, n, d)), values=np.zeros((hkv, n, d)),
                positions=np.tile(np.arange(n), (hkv, 1)), fields={}, queries=np.zeros((4, 1, d)),
                query_positions=np.array([4]), block_keys=np.zeros((hkv, 1, d)),
                block_values=np.zeros((hkv, 1, d)), attention=a, budget=2)


def test_tova_authors_form_averages_all_heads_and_keeps_the_older_of_a_tie():
    # Head means over all four query heads: (0.3, 0.1, 0.3, 0.1, 0.2) by hand.
    rows = [[0.6, 0.1, 0.1, 0.1, 0.1], [0.0, 0.1, 0.5, 0.1, 0.3],
            [0.3, 0.1, 0.3, 0.1, 0.2], [0.3, 0.1, 0.3, 0.1, 0.2]]
    view = _tova_view(rows)
    paper = get("tova")
    authors = get("tova", form="authors")
    np.testing.assert_allclose(authors.score(view), np.tile([0.3, 0.1, 0.3, 0.1, 0.2], (2, 1)))
    assert authors.keep_indices(view).tolist() == [[0, 2], [0, 2]]
    # Budget 1: tokens 0 and 2 tie at 0.3; the authors' form keeps 0, all_heads=True keeps 2.
    one = View(**{**view.__dict__, "budget": 1, "keep": 1})
    assert authors.keep_indices(one).tolist() == [[0], [0]]
    assert get("tova", all_heads=True).keep_indices(one).tolist() == [[2], [2]]
    # The paper form's group means differ per KV head: head 0 (0.3, 0.1, 0.3, 0.1, 0.2) too,
    # by construction, but its tie goes to the recent token.
    assert paper.keep_indices(one).tolist()[1] == [2]


def test_h2o_authors_form_breaks_heavy_hitter_ties_to_the_older_token():
    hkv, n = 1, 6
    acc = np.array([[2.0, 1.0, 2.0, 0.5, 0.1, 0.1]])
    view = View(layer=0, n_layers=1, keys=np.zeros((hkv, n, 2)), values=np.zeros((hkv, n, 2)),
                positions=np.arange(n)[None], fields={FIELD: acc}, queries=np.zeros((1, 1, 2)),
                query_positions=np.array([5]), block_keys=np.zeros((hkv, 1, 2)),
                block_values=np.zeros((hkv, 1, 2)), budget=3)
    # recent=2 protects tokens 4, 5; one heavy hitter among tokens 0..3, where 0 and 2 tie.
    assert get("h2o", recent=2).keep_indices(view).tolist() == [[2, 4, 5]]
    assert get("h2o", recent=2, form="authors").keep_indices(view).tolist() == [[0, 4, 5]]


def test_refkv_policies_forms_lists_every_form(capsys):
    assert main(["policies", "--forms"]) == 0
    out = capsys.readouterr().out
    for name in policies.available():
        for form, entry in policy_forms(policy_class(name)).items():
            assert f"{form}" in out and entry["source"] in out, (name, form)
    assert "schwartz-lab-NLP/TOVA@9c7d09bf" in out and "FMInference/H2O@ac75c2a8" in out


def test_the_docs_forms_table_is_the_registry_and_is_on_the_index_page():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("policy_tables", root / "docs" / "policy_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    table = tables.forms_table()
    n_rows = sum(len(policy_forms(policy_class(name))) for name in policies.available())
    assert table.count("\n   * - ``") == n_rows
    assert table in (root / "docs" / "policies" / "index.rst").read_text(encoding="utf-8")
