"""CAOTE / FastCAOTE (CAOTE Eqs. 8, 19-22): eviction error from base scores and values."""

from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_views import make_view, random_view

from refkv.attention import softmax
from refkv.cli import main
from refkv.engine import Engine
from refkv.model import TINY
from refkv.policies import Policy, available, get, policy_class
from refkv.policies.caote import Caote, caote_scores, fast_caote_scores, normalise
from refkv.policies.h2o import FIELD as H2O_FIELD
from refkv.policies.h2o import H2O
from refkv.policies.snapkv import SnapKV

# Three tokens, d = 2. Base scores (5, 2, 3) normalise to a = (0.5, 0.2, 0.3).
BASE = np.array([[5.0, 2.0, 3.0]])
VALUES = np.array([[[0.0, 0.0], [4.0, 0.0], [1.0, 1.0]]])
# V a = 0.2 (4, 0) + 0.3 (1, 1) = (1.1, 0.3). By hand, c_j = a_j / (1 - a_j) ||V a - v_j||:
#   c_0 = 1    * ||(1.1, 0.3)||  = sqrt(1.30)
#   c_1 = 1/4  * ||(-2.9, 0.3)|| = sqrt(8.50) / 4
#   c_2 = 3/7  * ||(0.1, -0.7)|| = 3/7 sqrt(0.50)
CAOTE = np.array([[np.sqrt(1.3), np.sqrt(8.5) / 4, 3 / 7 * np.sqrt(0.5)]])
# FastCAOTE: mean value (5/3, 1/3):
#   c_0 = ||(5/3, 1/3)|| = sqrt(26)/3;  c_1 = 1/4 ||(-7/3, 1/3)|| = sqrt(50)/12;
#   c_2 = 3/7 ||(2/3, -2/3)|| = 2 sqrt(2)/7
FAST = np.array([[np.sqrt(26) / 3, np.sqrt(50) / 12, 2 * np.sqrt(2) / 7]])


def test_normalise_by_hand():
    np.testing.assert_allclose(normalise(BASE), [[0.5, 0.2, 0.3]], rtol=1e-15)
    np.testing.assert_array_equal(normalise(np.zeros((2, 4))), np.full((2, 4), 0.25))    # zero sum: uniform
    np.testing.assert_array_equal(normalise(np.array([[0, 3, 1]])), [[0.0, 0.75, 0.25]])  # ints -> float64
    assert normalise(np.array([1, 3], np.float32)).dtype == np.float32
    for bad, match in [([1.0, -0.5], "non-negative"), ([1.0, np.nan], "finite"), ([np.inf, 1.0], "finite")]:
        with pytest.raises(ValueError, match=match):
            normalise(np.array(bad))


def test_scores_by_hand_and_the_choice_they_change():
    np.testing.assert_allclose(caote_scores(BASE, VALUES), CAOTE, rtol=1e-14)
    np.testing.assert_allclose(fast_caote_scores(BASE, VALUES), FAST, rtol=1e-14)
    # With room for two tokens, the base evicts token 1 (lowest score); CAOTE evicts token 2,
    # whose value is closest to the output (CAOTE Fig. 1's point).
    view = make_view(n=3, values=VALUES, budget=2)
    assert np.argmin(BASE) == 1 and np.argmin(caote_scores(BASE, VALUES)) == 2
    for fast in (False, True):
        policy = Caote(base=_Fixed(BASE), fast=fast)
        np.testing.assert_array_equal(policy.keep_indices(replace(view, keep=2)), [[0, 1]])


def test_all_mass_on_one_token_is_kept():
    """a_j = 1: every other a_i = 0 (their c_i = 0), and c_j = +inf (evicting j leaves nothing)."""
    values = np.array([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    for rule in (caote_scores, fast_caote_scores):
        c = rule(np.array([[0.0, 7.0, 0.0]]), values)
        assert c[0, 1] == np.inf and c[0, 0] == 0.0 and c[0, 2] == 0.0
        assert rule(np.array([[2.0]]), np.ones((1, 1, 2)))[0, 0] == np.inf      # a single token


def test_zero_base_scores_give_uniform_weights():
    c = caote_scores(np.zeros((1, 3)), VALUES)
    a = 1 / 3
    mean = VALUES[0].mean(axis=0)
    np.testing.assert_allclose(c[0], a / (1 - a) * np.linalg.norm(mean - VALUES[0], axis=-1), rtol=1e-14)


def test_dtypes():
    f32 = caote_scores(BASE.astype(np.float32), VALUES.astype(np.float32))
    assert f32.dtype == np.float32
    np.testing.assert_allclose(f32, CAOTE, rtol=1e-6)
    assert caote_scores(BASE, VALUES.astype(np.float32)).dtype == np.float64    # the wider of the two
    with pytest.raises(ValueError, match="values must have shape"):
        caote_scores(BASE, VALUES[:, :2])


@pytest.mark.parametrize("magnitude", [1e-25, 1.0, 1e25])
def test_float32_norm_neither_underflows_nor_overflows(magnitude):
    """Squares of 1e-25 underflow and of 1e25 overflow in float32; the scores must not."""
    values = (VALUES * magnitude).astype(np.float32)
    for rule, expected in ((caote_scores, CAOTE), (fast_caote_scores, FAST)):
        c = rule(BASE.astype(np.float32), values)
        np.testing.assert_allclose(c, expected * magnitude, rtol=1e-6)



@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 12), d=st.integers(1, 6))
@settings(max_examples=80)
def test_caote_of_attention_is_the_eviction_error(seed, n, d):
    """Theorem 3.2, by an independent route: with a = one query's attention weights, c_j equals
    the change of the attention output when key j is removed and the softmax recomputed."""
    rng = np.random.default_rng(seed)
    q, keys, values = rng.standard_normal(d), rng.standard_normal((n, d)), rng.standard_normal((n, d))
    logits = keys @ q / np.sqrt(d)
    a = softmax(logits)
    output = a @ values
    c = caote_scores(a[None], values[None])[0]
    for j in range(n):
        rest = np.delete(np.arange(n), j)
        without_j = softmax(logits[rest]) @ values[rest]
        np.testing.assert_allclose(c[j], np.linalg.norm(output - without_j), rtol=1e-9, atol=1e-12)


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 10), d=st.integers(1, 5),
       scale=st.floats(1e-3, 1e3), fast=st.booleans())
@settings(max_examples=80)
def test_symmetries(seed, n, d, scale, fast):
    """Unchanged by scaling the base scores (Eq. 21) and by shifting every value by one vector
    (the weights sum to 1); permuting the tokens permutes the scores."""
    rng = np.random.default_rng(seed)
    rule = fast_caote_scores if fast else caote_scores
    scores = rng.random((2, n)) + 0.01
    values = rng.standard_normal((2, n, d))
    c = rule(scores, values)
    np.testing.assert_allclose(rule(scale * scores, values), c, rtol=1e-10, atol=1e-13)
    shift = rng.standard_normal((2, 1, d)) * 5
    np.testing.assert_allclose(rule(scores, values + shift), c, rtol=1e-8, atol=1e-11)
    perm = rng.permutation(n)
    np.testing.assert_allclose(rule(scores[:, perm], values[:, perm]), c[:, perm], rtol=1e-12, atol=1e-14)
    assert np.all(c >= 0)


@dataclass(frozen=True)
class _Fixed(Policy):
    """Unregistered helper: fixed scores, declared non-negative (run time checks the claim)."""

    name = "_fixed"
    nonnegative_scores = True
    scores: object = None

    def score(self, view):
        return np.asarray(self.scores)


@dataclass(frozen=True)
class _Signed(Policy):
    name = "_signed"          # nonnegative_scores undeclared: Policy's default, False

    def score(self, view):
        return -np.ones(view.positions.shape)


def test_construction():
    assert Caote() == get("caote") and Caote().base_policy == H2O()
    assert Caote().needs == frozenset({"attention", "values"})
    policy = get("caote", base="snapkv", fast=True, base_params={"window": 4})
    assert policy.base_policy == SnapKV(window=4) and policy.fast
    assert Caote(base=SnapKV(window=4)).base_policy == SnapKV(window=4)
    assert get("caote", base="sink").needs == frozenset({"positions", "values"})
    assert "caote(base='snapkv', fast=True, base_params={'window': 4})" == policy.describe()
    from_object = Caote(base=SnapKV(window=4, pooling="max"), fast=True)
    params = from_object.params()
    assert params == {"base": "snapkv", "fast": True,
                      "base_params": {"window": 4, "kernel": 7, "pooling": "max", "form": "paper"}}
    assert get("caote", **params).base_policy == from_object.base_policy


@pytest.mark.parametrize(("params", "match"), [
    ({"base": "nope"}, "unknown policy"),
    ({"base": 3}, "base must be a policy name"),
    ({"base": "h2o", "base_params": [1]}, "base_params must be a dict"),
    ({"base": H2O(), "base_params": {"recent": 2}}, "base_params must be empty"),
    ({"base": Caote()}, "must not itself be caote"),
    ({"base": _Signed()}, "signed scores"),
    ({"base": "h2o", "base_params": {"recent": -1}}, "recent"),
    ({"fast": "yes"}, "fast"),
])
def test_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        Caote(**params)


@pytest.mark.parametrize("name", ["keydiff", "knorm", "hashevict", "mat"])
def test_signed_registered_bases_are_refused(name):
    if name not in available():
        pytest.skip(f"{name} is not registered")
    with pytest.raises(ValueError, match="signed scores"):
        Caote(base=name)


def test_registry_declarations_decide_the_bases():
    for name in available():
        if name == "caote" or not policy_class(name).evicts:  # full: refused for never evicting
            continue
        if policy_class(name).nonnegative_scores:
            assert Caote(base=name).base_policy.name == name
        else:
            with pytest.raises(ValueError, match="signed scores"):
                Caote(base=name)


def test_negative_scores_at_run_time():
    policy = Caote(base=_Fixed(np.array([[0.5, -0.1, 0.2]])))      # a false declaration: refused when seen
    with pytest.raises(ValueError, match="negative"):
        policy.score(make_view(n=3, values=VALUES))


def test_state_and_protection_are_the_base_s(rng):
    base = H2O(recent=2)
    policy = Caote(base=base)
    assert policy.fields(TINY) == base.fields(TINY)
    view = random_view(rng, n=10, b=3, budget=6, fields={H2O_FIELD: rng.random((2, 10))})
    np.testing.assert_array_equal(policy.observe(view)[H2O_FIELD], base.observe(view)[H2O_FIELD])
    np.testing.assert_array_equal(policy.protected(view), base.protected(view))
    np.testing.assert_array_equal(policy.score(view), caote_scores(base.score(view), view.values))
    Caote(base=SnapKV(window=4)).check(5, TINY)
    with pytest.raises(ValueError, match="window"):
        Caote(base=SnapKV(window=4)).check(4, TINY)


BASES = [("h2o", {}), ("tova", {}), ("snapkv", {"window": 4, "kernel": 3}),
         ("scissorhands", {"history": 8, "sink": 1, "recent": 2}), ("sink", {"sink": 2})]


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize(("base", "params"), BASES)
def test_engine_runs(tiny64, base, params, fast):
    tokens = np.random.default_rng(10).integers(0, 512, 40)
    policy = get("caote", base=base, base_params=params, fast=fast)
    for block in (1, 5, None):
        engine = Engine(tiny64, policy, 12)
        engine.prefill(tokens, block)
        assert all(len(cache) == 12 for cache in engine.caches)
        if "attention" not in policy.needs:
            assert engine.stats.attention_materialised == 0


def test_no_eviction_when_budget_covers_prompt(tiny64):
    tokens = np.random.default_rng(8).integers(0, 512, 25)
    engine = Engine(tiny64, Caote(base="tova", fast=True), 25)
    logits = engine.prefill(tokens, 4, all_logits=True)
    np.testing.assert_allclose(logits, tiny64.forward_full(tokens), rtol=0, atol=1e-10)
    assert engine.stats.evictions == 0


def test_from_the_command_line(capsys):
    args = ["run", "--policy", "caote", "--param", "base=snapkv", "--param", "base_params={'window': 4}",
            "--param", "fast=True", "--budget", "12", "--block", "4", "--prompt-len", "40", "--new-tokens", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "policy: caote(base='snapkv', fast=True, base_params={'window': 4})" in out
    assert "layer 0 head 0: 12 kept:" in out
    assert main(["run", "--policy", "caote", "--param", "base=nope", "--budget", "12"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
