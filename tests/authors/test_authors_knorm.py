"""L2 compress's own l2_compress (l2compress@f93d6ca2, tests/authors/knorm/PROVENANCE.json) against
refkv's knorm: identical without ties; at an exact tie of key norms their stable argsort keeps the
older token where refkv keeps the more recent one."""

from refkv.policies import policy_class, policy_forms

from .checks import check, counts, provenance, strict_tie_heads


def test_knorm_identical_to_authors_code(capsys):
    rc, report = check(capsys, "knorm", "paper")
    assert rc == 0, report
    compared, passed = counts(report)
    assert compared == passed == sum(provenance("knorm")["cases_per_configuration"].values()) == 60


def test_knorm_tie_order_differs_only_at_the_exact_tie(capsys):
    rc, report = check(capsys, "knorm", "paper", ties=True)
    assert rc == 1 and strict_tie_heads(report) == 2, report  # both heads keep position 2, refkv position 8
    rc, report = check(capsys, "knorm", "paper", ties=True, strict=False)
    assert rc == 0 and "accepted ties" in report, report


def test_knorm_forms_map_cites_this_proof():
    entry = policy_forms(policy_class("knorm"))["authors"]
    assert provenance("knorm")["repository"] in entry["source"]
    assert "tests/authors/test_authors_knorm.py" in entry["proven"]
