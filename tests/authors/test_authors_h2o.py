"""H2O's own real-drop cache (H2O@ac75c2a8, tests/authors/h2o/PROVENANCE.json) against refkv's h2o:
kept sets and accumulated scores identical in both forms on every decision without ties (no GQA:
the authors' cache raises on GQA); at exact ties CPU torch.topk follows neither tie rule."""

from refkv.policies import policy_class, policy_forms

from .checks import check, counts, provenance, strict_tie_heads


def test_h2o_both_forms_identical_to_authors_code(capsys):
    total = sum(provenance("h2o")["cases_per_configuration"].values())
    for form in ("paper", "authors"):
        rc, report = check(capsys, "h2o", form)
        assert rc == 0, report
        assert counts(report) == (total, total) == (72, 72)


def test_h2o_authors_cache_raises_on_gqa():
    errors = provenance("h2o")["authors_code_errors"]
    assert len(errors) == 2 and all(label.startswith("tiny,") for label in errors)
    assert all(text.startswith("IndexError") for text in errors.values())


def test_h2o_cpu_topk_tie_order(capsys):
    # Positions 3, 5, 7 tie at 0.0 and one is kept. CPU topk kept 7 in heads 0, 2, 3 (the paper
    # form's rule) and 3 in head 1 (the authors' form's, modelled on CUDA topk).
    rc, report = check(capsys, "h2o", "paper", ties=True)
    assert rc == 1 and strict_tie_heads(report) == 1, report
    rc, report = check(capsys, "h2o", "authors", ties=True)
    assert rc == 1 and strict_tie_heads(report) == 3, report
    for form in ("paper", "authors"):
        rc, report = check(capsys, "h2o", form, ties=True, strict=False)
        assert rc == 0 and "accepted ties" in report, report


def test_h2o_forms_map_cites_this_proof():
    forms = policy_forms(policy_class("h2o"))
    assert provenance("h2o")["repository"] in forms["authors"]["source"]
    assert "tests/authors/test_authors_h2o.py" in forms["authors"]["proven"]
