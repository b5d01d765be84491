"""StreamingLLM's own StartRecentKVCache (streaming-llm@2e504260, tests/authors/sink/PROVENANCE.json)
against refkv's sink: identical on every decision of every configuration."""

from refkv.policies import policy_class, policy_forms

from .checks import check, counts, provenance


def test_sink_identical_to_authors_code(capsys):
    rc, report = check(capsys, "sink", "paper")
    assert rc == 0, report
    compared, passed = counts(report)
    assert compared == passed == sum(provenance("sink")["cases_per_configuration"].values()) == 128


def test_sink_configurations_cover_gqa_mha_oneshot_decoding_both_methods():
    configs = provenance("sink")["configurations"]
    assert {c["model"] for c in configs} == {"tiny", "tiny-mha"}
    assert {c["block_size"] for c in configs} == {None, 1, 4}
    assert {c["method"] for c in configs} == {"__call__", "evict_for_space"}
    assert len({(c["start_size"], c["budget"]) for c in configs}) >= 2


def test_sink_forms_map_cites_this_proof():
    entry = policy_forms(policy_class("sink"))["authors"]
    assert provenance("sink")["repository"] in entry["source"]
    assert "tests/authors/test_authors_sink.py" in entry["proven"]
