"""PyramidKV (Cai et al. 2024): per-layer budgets in an arithmetic pyramid, over a base score."""

import doctest
import itertools
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refkv.engine import Engine
from refkv.model import TINY
from refkv.policies import get
from refkv.policies.pyramidkv import kvpress_schedule, pyramid_schedule

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "policies" / "pyramidkv.rst"


def real_schedule(total, n_layers, beta):
    """The paper's real-valued k^l, in floats (another route than the code's fractions)."""
    if n_layers == 1:
        return [float(total)]
    top = total / beta
    bottom = 2 * total - top
    return [bottom - (bottom - top) * layer / (n_layers - 1) for layer in range(n_layers)]


@given(st.integers(0, 500), st.integers(1, 40), st.one_of(st.integers(1, 40), st.floats(1.0, 50.0)))
@settings(max_examples=200, deadline=None)
def test_schedule_sums_to_the_total_and_decreases(total, n_layers, beta):
    budgets = pyramid_schedule(total, n_layers, beta)
    assert len(budgets) == n_layers and sum(budgets) == total * n_layers
    assert all(a >= b for a, b in itertools.pairwise(budgets))
    assert min(budgets) >= 0
    for got, want in zip(budgets, real_schedule(total, n_layers, beta)):
        assert want - 1 - 1e-9 < got < want + 1 + 1e-9
    if n_layers > 1 and beta > 1 and total * (1 - 1 / beta) >= 1:
        assert budgets[0] > budgets[-1]  # a pyramid, not a column


@given(st.integers(0, 300), st.integers(1, 30))
def test_beta_one_is_uniform(total, n_layers):
    assert pyramid_schedule(total, n_layers, 1) == [total] * n_layers


def test_schedule_by_hand():
    # M = 8, beta = 20, L = 4: k = 15.6, 10.53, 5.47, 0.4 -> floors 15, 10, 5, 0, two left over
    assert pyramid_schedule(8, 4, 20) == [16, 11, 5, 0]
    # SnapKV's window w = 32 in every layer, the schedule above for the N - w = 8 left
    assert get("pyramidkv").layer_budgets(40, 4) == [48, 43, 37, 32]
    # w = 4, M = 12, beta = 4: min = 48 / 16 = 3, max = 2 M - min = 21, step 6: 21, 15, 9, 3 (+ w)
    assert get("pyramidkv", base_params={"window": 4, "kernel": 3}, beta=4).layer_budgets(16, 4) == [25, 19, 13, 7]


@pytest.mark.parametrize("budget, n_layers, beta, window", [
    (64, 4, 20, 1), (256, 30, 20, 8), (128, 30, 4, 16), (40, 4, 20, 32), (512, 24, 3, 64), (96, 1, 20, 8)])
def test_kvpress_form_matches_pyramidkvpress(budget, n_layers, beta, window):
    """kvpress's own get_layer_budget, for a prompt of 1024 tokens (long enough not to cap it)."""
    pytest.importorskip("torch")
    from kvpress.presses.pyramidkv_press import PyramidKVPress

    q_len = 1024
    press = PyramidKVPress(compression_ratio=1 - budget / q_len, window_size=window, beta=beta)  # exact in binary
    want = [press.get_layer_budget(SimpleNamespace(config=SimpleNamespace(num_hidden_layers=n_layers),
                                                   layer_idx=layer), q_len) for layer in range(n_layers)]
    assert kvpress_schedule(budget, n_layers, beta, window) == want


def test_engine_layers_hold_their_budgets(tiny64):
    policy = get("pyramidkv", base_params={"window": 4, "kernel": 3}, beta=4)
    budgets = policy.layer_budgets(16, TINY.n_layers)
    assert sum(budgets) == 16 * TINY.n_layers
    engine = Engine(tiny64, policy, 16, record="views")
    engine.prefill(np.random.default_rng(0).integers(0, TINY.vocab_size, 60), 6)
    for cache, budget in zip(engine.caches, budgets):
        assert len(cache) == budget and not cache.uneven
    # each eviction is the base's own choice at the layer's budget
    for event in engine.trace.evictions:
        assert event.view.budget == event.view.keep == budgets[event.layer]
        np.testing.assert_array_equal(event.kept, policy.base_policy.keep_indices(event.view))
        np.testing.assert_array_equal(policy.score(event.view), policy.base_policy.score(event.view))


def test_uniform_when_beta_is_one(tiny64):
    prompt = np.random.default_rng(1).integers(0, TINY.vocab_size, 50)
    base = Engine(tiny64, get("snapkv", window=4, kernel=3), 12)
    pyramid = Engine(tiny64, get("pyramidkv", base_params={"window": 4, "kernel": 3}, beta=1), 12)
    np.testing.assert_array_equal(base.prefill(prompt, 5), pyramid.prefill(prompt, 5))
    for a, b in zip(base.caches, pyramid.caches):
        np.testing.assert_array_equal(a.positions, b.positions)


def test_check_refuses_a_budget_the_base_refuses():
    with pytest.raises(ValueError, match="window must be < budget"):
        get("pyramidkv").check(32, TINY)
    get("pyramidkv").check(33, TINY)


@pytest.mark.parametrize("params, match", [
    (dict(beta=0.5), "beta"), (dict(form="torch"), "form"), (dict(base="adakv"), "not allowed"),
    (dict(base="mat"), "evicts before attention"), (dict(base="full"), "never evicts"),
])
def test_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        get("pyramidkv", **params)


def test_schedule_bad_input():
    with pytest.raises(ValueError, match="beta"):
        pyramid_schedule(8, 4, 0.9)
    with pytest.raises(ValueError, match="n_layers"):
        pyramid_schedule(8, 0, 2)


def test_page_worked_example():
    result = doctest.testfile(str(PAGE), module_relative=False, optionflags=doctest.NORMALIZE_WHITESPACE,
                              raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0
