"""TOVA's own TOVACache.reduce (TOVA@9c7d09bf, tests/authors/tova/PROVENANCE.json) against refkv's
tova: form="authors" identical on every decision without ties, GQA or not; the paper form (group
mean per KV head) differs; at exact ties CPU torch.topk follows neither tie rule."""

from refkv.policies import policy_class, policy_forms

from .checks import check, counts, provenance, strict_tie_heads


def test_tova_authors_form_identical_to_authors_code(capsys):
    rc, report = check(capsys, "tova", "authors")
    assert rc == 0, report
    compared, passed = counts(report)
    assert compared == passed == sum(provenance("tova")["cases_per_configuration"].values()) == 88


def test_tova_paper_form_is_not_the_authors_code(capsys):
    rc, report = check(capsys, "tova", "paper")
    assert rc == 1, report
    assert counts(report) == (88, 7), report  # 81 decisions differ, not at ties


def test_tova_cpu_topk_tie_order(capsys):
    # Positions 3, 5, 7 tie at 0.0 and one is kept: CPU topk kept 7 (GQA case: the paper form's
    # rule) and 5 (MHA case: neither rule); the authors' form (CUDA topk) keeps 3.
    rc, report = check(capsys, "tova", "authors", ties=True)
    assert rc == 1 and strict_tie_heads(report) == 6, report
    rc, report = check(capsys, "tova", "paper", ties=True)
    assert rc == 1 and strict_tie_heads(report) == 4, report
    for form in ("paper", "authors"):
        rc, report = check(capsys, "tova", form, ties=True, strict=False)
        assert rc == 0 and "accepted ties" in report, report


def test_tova_configurations_cover_gqa_mha_oneshot_decoding():
    configs = provenance("tova")["configurations"]
    assert {(c["model"], c["block_size"]) for c in configs} >= {("tiny", None), ("tiny", 1), ("tiny-mha", None),
                                                               ("tiny-mha", 1)}


def test_tova_forms_map_cites_this_proof():
    forms = policy_forms(policy_class("tova"))
    assert provenance("tova")["repository"] in forms["authors"]["source"]
    assert "tests/authors/test_authors_tova.py" in forms["authors"]["proven"]
