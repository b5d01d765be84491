"""PyramidKV's ``form="kvpress"`` with kvpress's cap on the bottom layer (issue 33, D and item 3).

kvpress's ``PyramidKVPress.get_layer_budget`` caps the largest budget (layer 0) at the tokens
the layer holds less the window and gives the difference to the top layers. refkv's
:func:`~refkv.policies.pyramidkv.kvpress_schedule` takes that token count (``tokens``) and the
engine hands it each layer's. Compared here with kvpress's own function (skipped without
kvpress) and with values worked out by hand.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from refkv.engine import Engine
from refkv.model.config import ModelConfig
from refkv.policies import get
from refkv.policies.pyramidkv import kvpress_schedule


def kvpress_budgets(n_layers, q_len, ratio, window, beta):
    """kvpress's own per-layer budgets: ``PyramidKVPress.get_layer_budget`` called on each layer."""
    pytest.importorskip("torch")
    kvpress = pytest.importorskip("kvpress")
    press = kvpress.PyramidKVPress(compression_ratio=ratio, window_size=window, kernel_size=5, beta=beta)
    return [press.get_layer_budget(SimpleNamespace(config=SimpleNamespace(num_hidden_layers=n_layers),
                                                   layer_idx=layer), q_len) for layer in range(n_layers)]


@pytest.mark.parametrize("ratio", [0.25, 0.4, 0.5])
@pytest.mark.parametrize("n_layers, beta, window", [(30, 20, 16), (4, 20, 64), (24, 3, 32), (32, 20, 8), (1, 20, 16)])
def test_long_prompt_matches_kvpress(ratio, n_layers, beta, window):
    """q = 4096: the budget N = int(q (1 - ratio)) and the ratio the adapter gives the press, 1 - N / q
    (exact in binary: q is a power of two)."""
    q_len = 4096
    budget = int(q_len * (1 - ratio))
    want = kvpress_budgets(n_layers, q_len, 1 - budget / q_len, window, beta)
    assert kvpress_schedule(budget, n_layers, beta, window, q_len) == want


@pytest.mark.parametrize("q_len, budget, n_layers, beta, window", [
    (48, 16, 4, 2, 2), (64, 32, 4, 20, 4), (64, 48, 30, 20, 16), (40, 20, 4, 2, 2), (96, 72, 4, 20, 4),
    (32, 8, 4, 20, 1), (128, 96, 30, 4, 8), (24, 12, 3, 4, 1), (48, 36, 4, 2, 2), (64, 60, 4, 4, 4)])
def test_short_prompt_matches_kvpress(q_len, budget, n_layers, beta, window):
    """Short prompts, capped or falling back, the press given the ratio the adapter gives it (1 - N / q)."""
    ratio = 1 - budget / q_len
    assert kvpress_schedule(budget, n_layers, beta, window, q_len) == kvpress_budgets(n_layers, q_len, ratio,
                                                                                         window, beta)


def test_cap_by_hand():
    """q = 4096, ratio 0.25 (N = 3072), 30 layers, beta 20, window 16: uncapped, max = 2N - N/beta =
    6144 - 153.6 = 5990.4 > q - w = 4080, so max = 4080, min = 2N - max = 2064, step (4080 - 2064) / 29 =
    69.517...: layer 1 keeps round(4010.48) = 4010, the top layer 2064."""
    capped = kvpress_schedule(3072, 30, 20, 16, 4096)
    assert capped[0] == 4080 and capped[1] == 4010 and capped[-1] == 2064
    assert kvpress_schedule(3072, 30, 20, 16)[0] == 5990  # no token count: no cap (above the prompt)
    assert capped == sorted(capped, reverse=True)


@pytest.mark.parametrize("budget, n_layers, beta, window, want", [
    # min = 40 / 20 = 2 >= window 2 (kvpress's >=, not >): max = 78, step 76 / 3: 78, 52.67, 27.33, 2
    (40, 4, 20, 2, [78, 53, 27, 2]),
    # min = 2.5, max = 17.5, step 7.5: round(17.5) = 18 and round(2.5) = 2 (half to even, not half up)
    (10, 3, 4, 1, [18, 10, 2]),
])
def test_pinned_by_hand(budget, n_layers, beta, window, want):
    assert kvpress_schedule(budget, n_layers, beta, window) == want
    assert kvpress_schedule(budget, n_layers, beta, window, 1024) == want  # a long prompt: no cap


@pytest.mark.parametrize("budget, n_layers, beta, window", [(40, 4, 20, 2), (10, 3, 4, 1)])
def test_pinned_cases_are_kvpress_own(budget, n_layers, beta, window):
    q_len = 1024
    assert kvpress_schedule(budget, n_layers, beta, window, q_len) == kvpress_budgets(
        n_layers, q_len, 1 - budget / q_len, window, beta)


def _config(n_layers):
    return ModelConfig(vocab_size=32, d_model=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, d_head=8, d_ff=32)


def test_check_refuses_a_layer_budget_of_zero():
    # the paper's form over a base without a window: M = 8, beta = 20, L = 4 -> [16, 11, 5, 0]
    policy = get("pyramidkv", base="tova")
    assert policy.layer_budgets(8, 4) == [16, 11, 5, 0]
    with pytest.raises(ValueError, match="at least one token"):
        policy.check(8, _config(4))
    # kvpress's form: min = 8 / 20 = 0.4 >= window 0, the top layer keeps round(0.4) = 0
    policy = get("pyramidkv", base="tova", form="kvpress")
    assert policy.layer_budgets(8, 4)[-1] == 0
    with pytest.raises(ValueError, match="at least one token"):
        policy.check(8, _config(4))
    get("pyramidkv", base="tova").check(40, _config(4))  # [..., 2]: accepted


def test_engine_caps_each_layer_at_its_prompt(tiny64):
    """One-shot prefill of q = 96 tokens to N = 72 (ratio 0.25), window 4, beta 20 on the 4-layer model:
    uncapped max = 144 - 3.6 = 140.4 >= 92, so max = 92, min = 52, step 40 / 3: 92, 78.67, 65.33, 52."""
    policy = get("pyramidkv", base_params={"window": 4, "kernel": 3}, form="kvpress")
    assert policy.layer_budgets(72, 4, tokens=96) == [92, 79, 65, 52]
    engine = Engine(tiny64, policy, 72, record="views")
    engine.prefill(np.random.default_rng(0).integers(0, tiny64.config.vocab_size, 96), None)
    assert [len(cache) for cache in engine.caches] == [92, 79, 65, 52]
    assert {e.view.budget for e in engine.trace.evictions if e.layer == 0} == {92}
