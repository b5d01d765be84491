"""The registered passkey design: natural-text prompts, their draws, and the grid."""

from __future__ import annotations

import numpy as np
import pytest

from refkv.experiments import haystack, passkey
from refkv.experiments.models import load_model
from refkv.experiments.settings import Settings
from refkv.experiments.text import prose_tail


def test_draws_are_reproducible_and_calibration_never_shares_a_test_prompt():
    a = haystack.draw(0, 1024, 3, "test")
    assert a == haystack.draw(0, 1024, 3, "test")
    calibration = {tuple(haystack.draw(0, 1024, s, "calibration").values()) for s in range(60)}
    test = {tuple(haystack.draw(0, 1024, s, "test").values()) for s in range(60)}
    assert not calibration & test
    depths = [haystack.draw(0, 1024, s, "test")["depth"] for s in range(200)]
    assert 0.05 <= min(depths) and max(depths) <= 0.95 and np.std(depths) > 0.2   # spread, not five fixed depths
    sources = [haystack.draw(0, 1024, s, "test")["source"] for s in range(4)]
    assert sources[0] != sources[1] and sources[0] == sources[2]                  # alternating sources
    with pytest.raises(ValueError, match="purpose"):
        haystack.draw(0, 1024, 0, "pilot")


def test_a_text_prompt_holds_one_needle_at_a_sentence_end():
    _, tokenizer = load_model("tiny", "float32")
    source = prose_tail("tiny", "float32", "kjv_narrative", haystack.RESERVED_SEGMENTS * 1024)
    tokens, key_at = haystack.build_text_prompt(tokenizer, source, 400, 0.5, 12345, 0.3)
    text = tokenizer.decode(tokens)
    needle = haystack.NEEDLE.format(key=12345)
    assert text.count(needle) == 1 and text.count("12345") == 1
    before = text[:text.index(needle)]
    assert before.rstrip()[-1] in ".!?\"')]" and before[-1].isspace()            # after a sentence end
    assert abs(len(tokens) - 400) <= 8
    assert tokenizer.decode(tokens[key_at:key_at + 4]) == "2345"
    assert text.endswith(f"{haystack.QUESTION} {haystack.ANSWER_PREFIX}")
    # the haystack is not a perplexity text: it comes from beyond the reserved segments
    reserved = tokenizer.decode(prose_tail("tiny", "float32", "kjv_narrative", 0)[:haystack.RESERVED_SEGMENTS * 1024])
    window = text[text.index("\n\n") + 2:text.index(needle)][-60:]
    assert window and window not in reserved


def test_the_registered_grid():
    calibration = passkey.cells(Settings(model="tiny", registered=True))
    assert len(calibration) == 60 * len(haystack.CALIBRATION_LENGTHS)
    assert {c["policy"] for c in calibration} == {"full"} and {c["purpose"] for c in calibration} == {"calibration"}
    grid = passkey.cells(Settings(model="tiny", registered=True, options={"passkey_lengths": (1024,)}))
    assert len(grid) == 60 * (1 + 2 * len(passkey.REGISTERED_POLICIES))
    assert {(c["budget"], c["block"]) for c in grid if c["policy"] != "full"} == {(128, 128), (128, None)}
    small = passkey.cells(Settings(model="tiny", registered=True, options={"passkey_lengths": (512,)}))
    assert {(c["budget"], c["block"]) for c in small if c["policy"] != "full"} == {(64, 64), (64, None)}
    with pytest.raises(ValueError, match="one calibrated length"):
        passkey.cells(Settings(model="tiny", registered=True, options={"passkey_lengths": (512, 1024)}))
    with pytest.raises(ValueError, match="registered"):
        Settings(registered=True, quick=True)


def test_a_registered_cell_runs():
    params = {"model": "tiny", "dtype": "float32", "seed": 0, "design": "registered", "purpose": "test",
              "length": 256, "sample": 1, "policy": "full", "budget": None, "block": 64, "max_new_tokens": 4}
    result = passkey.run_cell(params)
    assert result["key"] == haystack.draw(0, 256, 1, "test")["key"]
    assert 0.0 <= result["needle_distinctiveness"] <= 1.0 and result["needle_retention"] == 1.0
    evicting = passkey.run_cell({**params, "policy": "keydiff", "budget": 32, "block": 32})
    assert evicting["key"] == result["key"] and "needle_distinctiveness" not in evicting
    assert 0.0 <= evicting["needle_retention"] <= 1.0


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_the_needle_lands_near_its_depth(depth):
    _, tokenizer = load_model("tiny", "float32")
    source = prose_tail("tiny", "float32", "pydoc_prose", haystack.RESERVED_SEGMENTS * 1024)
    tokens, _ = haystack.build_text_prompt(tokenizer, source, 3000, depth, 54321, 0.6)  # ~30 sentences
    text = tokenizer.decode(tokens)
    start, end = text.index("\n\n") + 2, text.rindex("\n\n")
    needle = text.index(haystack.NEEDLE.format(key=54321))
    assert abs((needle - start) / (end - start) - depth) < 0.1


def test_the_registered_perplexity_grid():
    from refkv.experiments import perplexity

    grid = perplexity.cells(Settings(model="smollm2", registered=True))
    verdict = {(c["text"], c["segment"]) for c in grid if c["policy"] == "keydiff"}
    selection = {(c["text"], c["segment"]) for c in grid if c["policy"].startswith("mat")}
    assert len(verdict) == 16 and len(selection) == 4 and not verdict & selection   # MAT chosen on other texts
    assert {(c["text"], c["segment"]) for c in grid if c["policy"] == "full"} == verdict | selection
    assert {t for t, _ in verdict} == {"pydoc_prose", "kjv_narrative"}
    by_policy = {}
    for c in grid:
        by_policy.setdefault((c["policy"], c["block"]), set()).add((c["text"], c["segment"]))
    for policy in perplexity.REGISTERED_BLOCKED:
        assert by_policy[(policy, 32)] == verdict
    assert {p for p, b in by_policy if b == 1} == {"sink", "knorm:recent=10,sink=4", "hashevict:seed=0",
                                                   "hashevict:seed=1", "hashevict:seed=2"}
    chosen = perplexity.cells(Settings(model="smollm2", registered=True, policies=("mat:beta=32,shallow_layers=2",)))
    assert {(c["text"], c["segment"]) for c in chosen} == verdict and {c["block"] for c in chosen} == {1}
    with pytest.raises(ValueError, match="one MAT spec"):
        perplexity.cells(Settings(model="smollm2", registered=True, policies=("keydiff",)))
