"""docs/snapkv_passkey.py's cache repair: the lost tokens come back with the dense keys and
values, every head keeps its size and its position order, nothing else changes."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def _script():
    spec = importlib.util.spec_from_file_location("snapkv_passkey", DOCS / "snapkv_passkey.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["snapkv_passkey"] = module
    spec.loader.exec_module(module)
    return module


def test_put_back_restores_the_lost_digits_with_their_dense_vectors():
    from refkv.experiments.models import load_model
    from refkv.experiments.prefill import prefill_or_skip

    script = _script()
    model, _ = load_model("tiny", "float32")
    tokens, _, _, regions = script.filler_prompt("tiny", 300, 0.5)
    dense, _, _ = prefill_or_skip({"policy": "full", "budget": None, "block": None}, model, tokens[:-1])
    engine, _, _ = prefill_or_skip({"policy": "snapkv", "budget": 64, "block": None}, model, tokens[:-1])
    digits = np.concatenate([regions[f"digit{i}"] for i in range(1, 6)])
    before = [cache.positions.copy() for cache in engine.caches]
    lost = sum(int((~np.isin(digits, heads)).sum()) for positions in before for heads in positions)
    assert lost > 0                                       # the tiny model's SnapKV loses some digits here
    assert script.put_back(engine, dense, digits, np.concatenate(list(regions.values()))) == lost
    for cache, full, old in zip(engine.caches, dense.caches, before):
        for h, positions in enumerate(cache.positions):
            assert len(positions) == len(old[h]) and np.all(np.diff(positions) > 0)
            assert np.all(np.isin(digits, positions))
            kept_before = np.setdiff1d(positions, digits)
            assert np.all(np.isin(kept_before, old[h]))  # only digits came in
            # one-shot prefill: every kept key and value is the dense run's at that position
            np.testing.assert_array_equal(cache.keys[h], full.keys[h][positions])
            np.testing.assert_array_equal(cache.values[h], full.values[h][positions])
