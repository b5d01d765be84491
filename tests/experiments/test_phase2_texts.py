"""Phase two's text grids (perplexity2, attention_loss2, geometry2): their cells as registered,
the --policies subsets, and one cell of each kind on the tiny model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from refkv.experiments import phase2_texts as texts
from refkv.experiments.documents import document_window
from refkv.experiments.models import load_model
from refkv.experiments.perplexity import token_nll
from refkv.experiments.registry import get_experiment, suite
from refkv.experiments.settings import Settings

TINY = Settings(model="tiny")


def test_grids_are_the_registered_ones():
    ppl = texts.perplexity_cells(TINY)
    assert {(c["document"], c["window"]) for c in ppl} == {(c["document"], c["window"]) for c in ppl
                                                          if c["policy"] == "full"}
    assert len({(c["document"], c["window"]) for c in ppl}) == 42 and {c["window"] for c in ppl} == {0, 1}
    assert {(c["budget"], c["block"]) for c in ppl if c["policy"] in texts.BLOCKED} == {(128, 32)}
    assert {(c["budget"], c["block"]) for c in ppl if c["policy"] in texts.TOKEN_BY_TOKEN} == {(128, 1)}
    assert len(ppl) == 42 * 14 and {c["length"] for c in ppl} == {1024}
    loss = texts.attention_cells(TINY)
    assert len(loss) == 42 * 6 and {(c["length"], c["budget"], c["block"]) for c in loss} == {(512, 256, 1)}
    geo = texts.geometry_cells(TINY)
    assert sum(c["kind"] == "cosine" for c in geo) == 42 and sum(c["kind"] == "retention" for c in geo) == 42 * 5
    assert {(c["length"], c["budget"], c["block"]) for c in geo if c["kind"] == "retention"} == {(1024, 256, 128)}
    for name in ("perplexity2", "attention_loss2", "geometry2"):
        assert get_experiment(name).phase == 2 and get_experiment(name) not in suite()


def test_policies_subset_in_priority_order():
    cheap = texts.perplexity_cells(Settings(model="tiny", policies=("keydiff", "caote:base=h2o")))
    assert {c["policy"] for c in cheap} == {"full", "keydiff", "caote:base=h2o"}
    seeds = texts.attention_cells(Settings(model="tiny", policies=("hashevict",)))
    assert {c["policy"] for c in seeds} == set(texts.HASHEVICT_SEEDS)
    with pytest.raises(ValueError, match="policies must name policies of this registered grid"):
        texts.perplexity_cells(Settings(model="tiny", policies=("snapkv:window=8",)))
    with pytest.raises(ValueError, match="budgets and blocks are fixed"):
        texts.geometry_cells(Settings(model="tiny", budgets=(64,)))
    parts = {row["part"]: row["cells"] for row in texts.cost_table()}
    assert sum(v for k, v in parts.items() if k.startswith("perplexity2")) == 42 * 14
    assert next(iter(parts)) == "perplexity2: L1, C1"


def test_full_cache_perplexity_is_the_dense_models():
    """The full cache's cell streams in blocks of 32: every token's loss is the dense forward's."""
    cell = next(c for c in texts.perplexity_cells(TINY) if c["policy"] == "full")
    result = texts.run_perplexity(cell)
    model, _ = load_model("tiny", "float32")
    tokens = document_window("tiny", "float32", cell["document"], 1024, cell["window"])
    expected = token_nll(model.forward_full(tokens)[:-1], tokens[1:])
    assert result["tokens"] == 1023 and np.allclose(result["nll"], expected, atol=1e-4)
    assert result["ppl"] == pytest.approx(math.exp(np.mean(result["nll"])))


def test_one_cell_of_each_other_kind():
    step = next(c for c in texts.attention_cells(TINY) if c["policy"] == "h2o")
    loss = texts.run_step_loss(step)
    assert 0.0 <= loss["mean_loss"] <= 1.0 and loss["steps"] == 256 and len(loss["loss_by_layer"]) == 4
    cosine = next(c for c in texts.geometry_cells(TINY) if c["kind"] == "cosine")
    result = texts.run_geometry(cosine)
    assert np.asarray(result["common_queries"]["spearman"]).shape == (4, 2)      # layers x KV heads
    assert np.asarray(result["spearman_anchor"]).shape == (4, 2)
    mat = next(c for c in texts.perplexity_cells(TINY) if c["policy"] == texts.MAT_SPEC)
    assert "shallow_layers" in texts.run_perplexity(mat)["skipped"]              # the tiny model has 4 layers
