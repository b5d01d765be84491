"""Invariants every registered policy satisfies, run over ``refkv.policies.available()``.

A policy added to the registry is covered here without any edit: default parameters, the
built-in model, block sizes 1, 3 and the whole prompt. Names starting with ``_`` are
test-only policies registered by other test modules and are left out.

* the budget is respected after every block: each layer holds exactly
  ``min(N_l, tokens seen) * Hkv`` tokens over its heads (``N_l = policy.layer_budget(N, l, L)``,
  ``N`` but for PyramidKV), and every head exactly ``min(N_l, tokens seen)`` unless the
  policy allocates per head (``head_budgets``, AdaKV);
* protected tokens are never evicted; kept positions are unique and sorted; empty slots
  (uneven heads) follow a head's real tokens;
* a rerun is bit-identical;
* with ``N >= T`` nothing is evicted and the logits are those of a full forward pass;
* attention-free policies (no ``"attention"`` in ``needs``) never materialise attention;
* float32 runs stay float32;
* ``refkv policies`` lists the policy with its summary and paper.
"""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refkv import policies
from refkv.cache import EMPTY
from refkv.cli import main
from refkv.engine import Engine, blocks
from refkv.model import TINY
from refkv.policies import Policy, available, get, policy_class

POLICIES = [name for name in available() if not name.startswith("_")]
#: Policies that never evict; they run with ``budget=None``.
UNBOUNDED = {"full"}
BOUNDED = [name for name in POLICIES if name not in UNBOUNDED]
T = 80


def smallest_budget(name: str) -> int:
    """The smallest ``N`` the default policy accepts on the built-in model."""
    policy = get(name)
    for budget in range(1, 500):
        try:
            policy.check(budget, TINY)
        except ValueError:
            continue
        return budget
    raise AssertionError(f"{name} accepts no budget below 500")


def budget_for(name: str) -> int:
    """A budget that leaves the default policy room to choose (its smallest, plus 8)."""
    return smallest_budget(name) + 8


def prompt(length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY.vocab_size, length)


def spy_on(policy) -> list:
    """Record (protected, kept) at every eviction by wrapping this instance's keep_indices."""
    records = []
    original = policy.keep_indices

    def keep_indices(view):
        kept = original(view)
        records.append((policy.protected(view), kept))
        return kept

    object.__setattr__(policy, "keep_indices", keep_indices)   # a fresh instance; frozen dataclasses allow this
    return records


def check_run(name, model, tokens, budget, block):
    """Run block by block and assert the invariants; return the engine."""
    policy = get(name)
    records = spy_on(policy)
    engine = Engine(model, policy, budget)
    seen = 0
    for chunk in blocks(tokens, block):
        engine.forward(chunk)
        seen += len(chunk)
        for layer, cache in enumerate(engine.caches):
            n_layers = len(engine.caches)
            expected = seen if budget is None else min(policy.layer_budget(budget, layer, n_layers), seen)
            assert cache.total == expected * cache.n_kv_heads
            if type(policy).head_budgets is Policy.head_budgets:  # an even policy keeps its heads even
                assert len(cache) == expected and not cache.uneven
            for row, length in zip(cache.positions, cache.head_lengths):
                assert np.all(np.diff(row[:length]) > 0)          # unique and sorted
                assert np.all(row[length:] == EMPTY)
                assert row[:length].max(initial=-1) < seen
    for protected, kept in records:
        for head, row in enumerate(kept):
            assert np.all(np.diff(row) > 0)
            assert set(np.flatnonzero(protected[head])) <= set(row.tolist()), "a protected token was evicted"
    if "attention" not in policy.needs:
        assert engine.stats.attention_materialised == 0
    return engine


@pytest.mark.parametrize("name", POLICIES)
def test_listed_by_refkv_policies(name, capsys):
    cls = policy_class(name)
    assert cls.card.summary and cls.card.paper
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    index = next(i for i, line in enumerate(lines) if line.split() and line.split()[0] == name)
    assert cls.card.summary in lines[index] and cls.card.paper in lines[index + 1]


@pytest.mark.parametrize("block", [1, 3, None])
@pytest.mark.parametrize("name", POLICIES)
def test_runs_through_the_engine(name, block, tiny64):
    tokens = prompt(T)
    budget = None if name in UNBOUNDED else budget_for(name)
    if get(name).evict_before_attention and block is None:
        with pytest.raises(ValueError, match=r"block size must be <= .* with budget="):
            Engine(tiny64, get(name), budget).prefill(tokens, block)
        return
    engine = check_run(name, tiny64, tokens, budget, block)
    if budget is not None:
        assert engine.stats.evictions > 0


@pytest.mark.parametrize("name", POLICIES)
def test_bit_identical_on_rerun(name, tiny64):
    tokens = prompt(T, seed=1)
    budget = None if name in UNBOUNDED else budget_for(name)
    runs = []
    for _ in range(2):
        engine = Engine(tiny64, get(name), budget)
        runs.append((engine.prefill(tokens, 3, all_logits=True), engine.caches))
    (logits_a, caches_a), (logits_b, caches_b) = runs
    np.testing.assert_array_equal(logits_a, logits_b)
    for a, b in zip(caches_a, caches_b):
        np.testing.assert_array_equal(a.positions, b.positions)
        np.testing.assert_array_equal(a.keys, b.keys)
        np.testing.assert_array_equal(a.values, b.values)
        assert a.fields.keys() == b.fields.keys()
        for field in a.fields:
            np.testing.assert_array_equal(a.fields[field], b.fields[field])


@pytest.mark.parametrize("block", [1, 5])
@pytest.mark.parametrize("name", POLICIES)
def test_no_eviction_when_budget_covers_prompt(name, block, tiny64):
    budget = None if name in UNBOUNDED else budget_for(name)
    # the smallest layer's budget (PyramidKV's top layer; N for the others) covers the prompt
    length = min(get(name).layer_budget(budget, layer, tiny64.config.n_layers)
                 for layer in range(tiny64.config.n_layers)) if budget else 30
    tokens = prompt(length, seed=2)
    engine = Engine(tiny64, get(name), budget)
    logits = engine.prefill(tokens, block, all_logits=True)
    np.testing.assert_allclose(logits, tiny64.forward_full(tokens), rtol=0, atol=1e-10)
    assert engine.stats.evictions == 0
    for cache in engine.caches:
        np.testing.assert_array_equal(cache.positions, np.broadcast_to(np.arange(length), cache.positions.shape))


@pytest.mark.parametrize("name", POLICIES)
def test_float32_stays_float32(name, tiny32):
    budget = None if name in UNBOUNDED else budget_for(name)
    engine = Engine(tiny32, get(name), budget)
    logits = engine.prefill(prompt(60, seed=3), 4)
    assert logits.dtype == np.float32
    specs = get(name).fields(TINY)
    for cache in engine.caches:
        assert cache.keys.dtype == cache.values.dtype == np.float32
        for field, spec in specs.items():
            assert cache.fields[field].dtype == np.dtype(spec.dtype)


@pytest.mark.parametrize("name", BOUNDED)
@given(data=st.data(), length=st.integers(1, 70), seed=st.integers(0, 2**16))
@settings(max_examples=12)
def test_invariants_for_any_budget_and_block(name, tiny64, data, length, seed):
    low = smallest_budget(name)
    budget = data.draw(st.integers(low, low + 20), label="budget")
    limit = get(name).max_block(budget, tiny64.config)
    if limit is not None:
        # Evicting before attention needs room for the block next to the protected tokens:
        # the policy states the largest block it supports.
        block = data.draw(st.integers(1, limit), label="block")
    else:
        block = data.draw(st.one_of(st.none(), st.integers(1, 12)), label="block")
    check_run(name, tiny64, prompt(length, seed), budget, block)


@pytest.mark.slow
@pytest.mark.parametrize("name", BOUNDED)
def test_runs_on_the_real_model(name, smollm2):
    """SmolLM2-135M (30 layers, 9 query heads over 3 KV heads): the same invariants, one short run."""
    budget = budget_for(name)
    tokens = np.random.default_rng(4).integers(0, smollm2.config.vocab_size, budget + 8)
    engine = check_run(name, smollm2, tokens, budget, 8)
    assert engine.stats.evictions > 0


# -- the protocol -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", available())
def test_no_policy_overrides_keep_indices(name):
    """The view says how many to keep (view.keep); select() applies the shared rule: no policy
    needs its own keep_indices (HashEvict and MAT once had one to work around the budget)."""
    assert policies.policy_class(name).keep_indices is policies.Policy.keep_indices


@pytest.mark.parametrize("name", available())
def test_every_protocol_attribute_is_declared_on_the_base(name):
    cls = policies.policy_class(name)
    declared = {k for k, v in vars(policies.Policy).items() if not k.startswith("_")}
    own = {k for klass in cls.__mro__[:-1] if klass is not policies.Policy and issubclass(klass, policies.Policy)
           for k in vars(klass) if not k.startswith("_") and k not in getattr(klass, "__dataclass_fields__", {})}
    public_api = own - declared
    # What a policy adds beyond the protocol are its own helpers (methods, properties), never
    # a class-level fact that other modules would read with getattr.
    for attr in public_api:
        assert callable(getattr(cls, attr)) or isinstance(getattr(cls, attr), property), (name, attr)


def test_view_budget_is_n_and_keep_defaults_to_it():
    from policy_views import make_view

    view = make_view(n=6, budget=4)
    assert (view.budget, view.keep) == (4, 4)
    before = replace(view, keep=2)
    assert (before.budget, before.keep) == (4, 2)
