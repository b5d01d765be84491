"""CAOTE's theorems (caote.txt: Thm 3.1, Thm 3.2, Thm B.1, App. B.2, Eq. 22) as property tests.

The closed forms come from the policy (:mod:`refkv.policies.caote`, :mod:`refkv.policies.h2o`);
the quantities they claim to equal are recomputed by :mod:`refkv.theory.caote` (attention over the
cache without token ``j``) or, in the near-degenerate cases, by 50-digit arithmetic (mpmath).
See docs/theory/caote.rst for the statements, verdicts and precision findings.
"""

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from refkv.attention import attention_weights, softmax
from refkv.engine import Engine
from refkv.model import Model, ModelConfig, random_weights
from refkv.policies.caote import caote_scores, fast_caote_scores, normalise
from refkv.policies.h2o import FIELD, accumulated_attention
from refkv.theory.caote import attention_after_eviction, attention_only_logits, eviction_errors

EPS64 = float(np.finfo(np.float64).eps)
EPS32 = float(np.finfo(np.float32).eps)


def bounded(low, high, width=64):
    return st.floats(low, high, allow_nan=False, allow_infinity=False, width=width)


@st.composite
def logits_and_values(draw, logit_bound=15.0, value_bound=100.0, max_n=12, max_d=6, width=64):
    n = draw(st.integers(2, max_n))
    d = draw(st.integers(1, max_d))
    dtype = np.float64 if width == 64 else np.float32
    logits = draw(arrays(dtype, n, elements=bounded(-logit_bound, logit_bound, width)))
    values = draw(arrays(dtype, (n, d), elements=bounded(-value_bound, value_bound, width)))
    return logits, values


def _norm_bound(values):
    """max_i ||v_i|| bounded from above without squaring (np.linalg.norm underflows below 1e-162)."""
    return float(np.abs(values).max()) * float(np.sqrt(values.shape[-1]))


def closed_form_tolerance(a, values, errors, eps):
    """Rounding budget of the closed form (measured constant ~3, allowed 4 n).

    ``c_j = a_j / (1 - a_j) ||V a - v_j||`` subtracts nearly equal numbers twice when
    ``a_j`` is close to 1: ``1 - a_j`` (absolute error ~eps) and ``V a - v_j`` (absolute
    error ~eps max||v||). Both are amplified by ``1 / (1 - a_j)``. The recomputed error
    itself carries an absolute error ~eps max||v||.
    """
    n = a.shape[-1]
    vmax = _norm_bound(values)
    # Below the normal range (1e-308 in float64) rounding is absolute, not relative: a floor.
    floor = 1e-300 if eps == EPS64 else 1e-36
    return 4.0 * n * eps * ((vmax * a + errors) / (1.0 - a) + vmax) + floor


# -- Theorem 3.1 ---------------------------------------------------------------------------------

@given(data=logits_and_values(), j=st.integers(0, 11))
def test_thm31_weights_after_eviction_are_renormalised(data, j):
    """Thm 3.1: after evicting j, alpha'_i = alpha_i / (1 - alpha_j), for every i != j."""
    logits, _ = data
    j = j % logits.shape[0]
    a = softmax(logits)
    assume(a[j] < 1.0)
    recomputed = attention_after_eviction(logits, j)
    formula = a / (1.0 - a[j])
    formula[j] = 0.0
    # Relative error of the formula: eps (1 + spread) from the softmax, eps / (1 - a_j) from 1 - a_j.
    n = logits.shape[0]
    spread = float(np.ptp(logits))
    tol = 4.0 * n * EPS64 * (1.0 + spread + 1.0 / (1.0 - a[j])) * formula
    assert np.all(np.abs(recomputed - formula) <= tol)
    assert recomputed[j] == 0.0
    assert abs(recomputed.sum() - 1.0) <= 4 * n * EPS64


@given(data=logits_and_values(logit_bound=300.0), j=st.integers(0, 11))
@example(data=(np.array([40.0, 0.0, -1.0]), np.zeros((3, 1))), j=0)
def test_thm31_stable_form_holds_to_rounding_even_when_alpha_j_rounds_to_one(data, j):
    """Writing 1 - alpha_j as sum_{i != j} alpha_i keeps Thm 3.1 accurate to a few ulps.

    In the pinned example alpha_0 = 1 / (1 + e^-40 + e^-41) rounds to exactly 1.0, so the
    printed formula alpha_i / (1 - alpha_j) divides by zero, while the sum of the others
    is ~5.8e-18 and exact to rounding.
    """
    logits, _ = data
    n = logits.shape[0]
    j = j % n
    a = softmax(logits)
    rest = np.delete(np.arange(n), j)
    others = a[rest].sum()
    assume(others > 0.0)  # every other weight underflowed: nothing left to renormalise
    assume(a[rest].min() > 1e-290)  # subnormal weights carry only a few significant bits
    recomputed = attention_after_eviction(logits, j)
    stable = a[rest] / others
    # exp(x - max) carries a relative error ~ eps |x - max| from rounding the difference.
    spread = float(np.ptp(logits))
    np.testing.assert_allclose(recomputed[rest], stable, rtol=8 * n * EPS64 * (1.0 + spread), atol=0)


# -- Theorem 3.2 ---------------------------------------------------------------------------------

@given(data=logits_and_values())
@settings(max_examples=80)
def test_thm32_closed_form_equals_recomputed_eviction_error(data):
    """Thm 3.2: c_j (Eq. 8, the policy's closed form) = ||X_attn - X'_attn,j|| (Eq. 9, recomputed)."""
    logits, values = data
    a = softmax(logits)
    assume(a.max() < 1.0)
    closed = caote_scores(a, values)
    errors = eviction_errors(logits, values)
    tol = closed_form_tolerance(a, values, errors, EPS64)
    assert np.all(np.abs(closed - errors) <= tol)


@given(data=logits_and_values(logit_bound=8.0, value_bound=10.0, width=32))
def test_thm32_in_float32(data):
    """The same identity with float32 weights and values (truth recomputed in float64)."""
    logits, values = data
    a = softmax(logits)
    assert a.dtype == np.float32
    closed = caote_scores(a, values)
    assert closed.dtype == np.float32
    errors = eviction_errors(logits.astype(np.float64), values.astype(np.float64))
    tol = closed_form_tolerance(a.astype(np.float64), values.astype(np.float64), errors, EPS32)
    assert np.all(np.abs(closed - errors) <= tol)


def exact_eviction_errors(logits, values, digits=50):
    """Eq. 9 in 50-digit arithmetic, from the float64 logits and values taken as exact."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(digits):
        n, d = values.shape
        weights = [mpmath.exp(mpmath.mpf(float(x))) for x in logits]
        vals = [[mpmath.mpf(float(x)) for x in row] for row in values]

        def output(keep):
            total = mpmath.fsum(weights[i] for i in keep)
            return [mpmath.fsum(weights[i] * vals[i][c] for i in keep) / total for c in range(d)]

        full = output(range(n))
        errors = []
        for j in range(n):
            other = output([i for i in range(n) if i != j])
            errors.append(float(mpmath.sqrt(mpmath.fsum((full[c] - other[c]) ** 2 for c in range(d)))))
    return np.array(errors)


NEAR_ONE = [1e-2, 1e-4, 1e-6, 1e-8, 1e-10, 1e-12, 1e-14]


@pytest.mark.parametrize("gap", NEAR_ONE)
def test_thm32_near_degenerate_alpha_close_to_one(gap):
    """alpha_0 = 1 - gap: the closed form loses about log10(1/gap) digits; recomputation does not.

    Measured relative error of the closed form for the dominant token (values ~N(0,1), n = 4):
    about eps / gap (1e-14 at gap 1e-2 ... 1e-2 at gap 1e-14). The bound asserted is the
    rounding budget of :func:`closed_form_tolerance`, checked against 50-digit truth.
    """
    n = 4
    rng = np.random.default_rng(7)
    values = rng.standard_normal((n, 3))
    logits = np.zeros(n)
    logits[0] = np.log((1.0 - gap) * (n - 1) / gap)  # softmax(logits)[0] = 1 - gap
    a = softmax(logits)
    truth = exact_eviction_errors(logits, values)
    closed = caote_scores(a, values)
    recomputed = eviction_errors(logits, values)
    tol = closed_form_tolerance(a, values, truth, EPS64)
    assert np.all(np.abs(closed - truth) <= tol)
    # Recomputation stays accurate for the dominant token whatever the gap.
    assert abs(recomputed[0] - truth[0]) <= 16 * EPS64 * truth[0]
    # The closed form for the dominant token degrades like eps / gap, not worse.
    assert abs(closed[0] - truth[0]) <= 64 * n * EPS64 / gap * truth[0]


def test_thm32_alpha_rounding_to_one_gives_infinite_closed_form_but_keeps_the_ranking():
    """alpha_0 == 1.0 exactly (e^-800 underflows): the closed form is +inf by the policy's rule,
    the true error is finite; the token is kept either way, and the others score 0 both ways."""
    logits = np.array([800.0, 0.0, 0.0])
    values = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    a = softmax(logits)
    assert a[0] == 1.0 and a[1] == 0.0
    closed = caote_scores(a, values)
    errors = eviction_errors(logits, values)
    assert closed[0] == np.inf
    # Evicting token 0 leaves the mean of v1 and v2 = (0, 0): the output moves by ||v0|| = 1.
    assert errors[0] == pytest.approx(1.0, abs=1e-15)
    np.testing.assert_array_equal(closed[1:], [0.0, 0.0])
    np.testing.assert_array_equal(errors[1:], [0.0, 0.0])
    assert np.argmax(closed) == np.argmax(errors) == 0


@pytest.mark.parametrize("offset", [1e3, 1e6, 1e9, -1e9])
def test_thm32_huge_logits_are_shift_invariant(offset):
    """Huge logits with moderate differences: softmax subtracts the max, so nothing overflows
    and both routes agree to the usual budget (they see the same rounded logits)."""
    rng = np.random.default_rng(3)
    logits = offset + rng.uniform(-5, 5, 6)
    values = rng.standard_normal((6, 4))
    a = softmax(logits)
    assert np.all(np.isfinite(a))
    closed = caote_scores(a, values)
    errors = eviction_errors(logits, values)
    assert np.all(np.abs(closed - errors) <= closed_form_tolerance(a, values, errors, EPS64))


# -- Theorem B.1 ---------------------------------------------------------------------------------

@given(kv_heads=st.integers(1, 2), group=st.integers(1, 3), m=st.integers(1, 8), cached=st.integers(0, 8),
       d=st.integers(2, 8), scale=bounded(0.1, 10.0), seed=st.integers(0, 2**16))
def test_thmB1_h2o_scores_of_a_causal_block_sum_to_m(kv_heads, group, m, cached, d, scale, seed):
    """Thm B.1, generalised: a block of m queries over (cache + block) adds exactly m to the H2O
    scores (each causal softmax row sums to 1), with or without a cache in front; the paper's
    case is cached = 0, m = b + 1 (sum b + 1 > 1 whenever b >= 1)."""
    rng = np.random.default_rng(seed)
    n = cached + m
    q = rng.standard_normal((kv_heads * group, m, d)) * scale
    k = rng.standard_normal((kv_heads, n, d)) * scale
    q_pos = np.arange(cached, n)
    k_pos = np.broadcast_to(np.arange(n), (kv_heads, n))
    by_kv_head = attention_weights(q, k, q_pos, k_pos).mean(axis=1)  # GQA: group average
    scores = accumulated_attention(by_kv_head)
    assert scores.shape == (kv_heads, n)
    np.testing.assert_allclose(scores.sum(axis=-1), m, rtol=0, atol=4 * n * m * EPS64)
    # Causality: block token r (0-based) is seen only by the m - r queries at or after it.
    for r in range(m):
        assert np.all(scores[:, cached + r] <= (m - r) * (1 + 4 * n * EPS64))


def test_thmB1_over_blocks_in_the_engine(tiny64):
    """Without eviction, H2O's accumulated field sums to T (one per query) in every layer and
    KV head after block prompt processing, whatever the block size."""
    tokens = np.random.default_rng(5).integers(0, tiny64.config.vocab_size, 19)
    for block in (1, 4, 19):
        engine = Engine(tiny64, "h2o", budget=None)
        engine.prefill(tokens, block)
        for cache in engine.caches:
            np.testing.assert_allclose(cache.fields[FIELD].sum(axis=-1), 19.0, rtol=0, atol=1e-12)


# -- Appendix B.2, cases 1 and 2 --------------------------------------------------------------------

def attention_only_model(heads, kv_heads, seed, dtype=np.float64):
    config = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, d_head=8,
                         d_ff=8, name="b2")
    return Model(config, random_weights(config, seed=seed, dtype=dtype))


@given(heads=st.sampled_from([(1, 1), (2, 1), (2, 2)]), length=st.integers(2, 10), j=st.integers(0, 9),
       seed=st.integers(0, 2**16))
@settings(max_examples=40)
def test_appB2_logit_error_is_WH_WO_times_attention_output_error(heads, length, j, seed):
    """App. B.2 case 1 (one head) and case 2 (several heads, Delta_A concatenated): for a
    one-layer decoder without norms or MLP, l-hat - l = W_H W_O Delta_A, and for one head
    ||Delta_A|| is the CAOTE score c_j of the last query's weights (Thm 3.2 inside a model)."""
    n_heads, n_kv = heads
    model = attention_only_model(n_heads, n_kv, seed)
    tokens = np.random.default_rng(seed).integers(0, 64, length)
    j = j % length
    dense = attention_only_logits(model, tokens)
    evicted = attention_only_logits(model, tokens, evict=j)
    delta_a = evicted.head_outputs - dense.head_outputs  # (H, d)
    w_o = model.weights.layers[0].wo
    w_h = model.weights.embed.T
    predicted = (delta_a.reshape(-1) @ w_o) @ w_h  # row-vector form of W_H W_O Delta_A
    scale = float(np.abs(dense.logits).max())
    np.testing.assert_allclose(evicted.logits - dense.logits, predicted, rtol=0, atol=1e-12 * max(scale, 1.0))
    # ||Delta_l|| <= ||W_H W_O||_2 ||Delta_A|| (the paper's "eviction error leads to logit error").
    op_norm = np.linalg.norm(w_o @ w_h, 2)
    assert np.linalg.norm(evicted.logits - dense.logits) <= op_norm * np.linalg.norm(delta_a) * (1 + 1e-12) + 1e-12
    for h in range(n_heads):
        kv = h // (n_heads // n_kv)
        c = caote_scores(dense.weights[h], dense.values[kv])[j]
        if np.isfinite(c):
            assert np.linalg.norm(delta_a[h]) == pytest.approx(c, rel=1e-9, abs=1e-12)


def test_appB2_rejects_deeper_models(tiny64):
    with pytest.raises(ValueError, match="one layer"):
        attention_only_logits(tiny64, [1, 2, 3])


# -- FastCAOTE (Eq. 22) --------------------------------------------------------------------------

@given(data=logits_and_values(), level=st.one_of(st.just(0.0), bounded(1e-6, 1e6)))
def test_fastcaote_equals_caote_when_weights_are_uniform(data, level):
    """With a_i = 1/n (constant base scores, or all zero: normalised to uniform), V a is the
    mean of V, so Eq. 22 and Eq. 8 coincide."""
    _, values = data
    n = values.shape[0]
    base = np.full(n, level)
    np.testing.assert_allclose(normalise(base), 1.0 / n, rtol=4 * EPS64)
    fast = fast_caote_scores(base, values)
    full = caote_scores(base, values)
    vmax = _norm_bound(values)
    np.testing.assert_allclose(fast, full, rtol=0, atol=8 * n * EPS64 * max(vmax, 1e-300))


@given(data=logits_and_values())
def test_fastcaote_differs_from_caote_by_at_most_the_output_shift(data):
    """Triangle inequality: |fast_j - c_j| <= a_j / (1 - a_j) ||mean(V) - V a||."""
    logits, values = data
    a = softmax(logits)
    assume(a.max() < 1.0)
    gain = a / (1.0 - a)
    difference = values.mean(axis=0) - a @ values
    top = float(np.abs(difference).max())
    shift = top * float(np.linalg.norm(difference / top)) if top > 0 else 0.0  # scaled: no underflow
    fast, full = fast_caote_scores(a, values), caote_scores(a, values)
    bound = gain * shift
    # The bound is attained when the vectors are collinear (d = 1), so allow the rounding of
    # all three quantities: relative eps / (1 - a_j) each, plus eps max||v|| / (1 - a_j).
    n = values.shape[0]
    vmax = _norm_bound(values)
    slack = 8.0 * n * EPS64 / (1.0 - a) * (bound + fast + full + vmax) + 1e-300
    assert np.all(np.abs(fast - full) <= bound + slack)


def test_fastcaote_can_choose_a_different_token_than_caote():
    """With non-uniform weights the two rules may evict different tokens, so Eq. 22 is an
    approximation, not an identity. Worked by hand: a = (0.6, 0.3, 0.1), v = (0, 1, 4);
    V a = 0.7 and mean(V) = 5/3.

    CAOTE:     c = (1.5 * 0.7, 3/7 * 0.3, 1/9 * 3.3) = (1.05, 0.1286, 0.3667): evict token 1.
    FastCAOTE: f = (1.5 * 5/3, 3/7 * 2/3, 1/9 * 7/3) = (2.5, 0.2857, 0.2593): evict token 2.
    """
    a = np.array([0.6, 0.3, 0.1])
    values = np.array([[0.0], [1.0], [4.0]])
    full = caote_scores(a, values)
    fast = fast_caote_scores(a, values)
    np.testing.assert_allclose(full, [1.5 * 0.7, 3 / 7 * 0.3, 1 / 9 * 3.3], rtol=1e-12)
    np.testing.assert_allclose(fast, [1.5 * 5 / 3, 3 / 7 * 2 / 3, 1 / 9 * 7 / 3], rtol=1e-12)
    np.testing.assert_allclose(full, eviction_errors(np.log(a), values), rtol=1e-12)
    assert np.argmin(full) == 1 and np.argmin(fast) == 2


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda: attention_after_eviction([1.0], 0), "logits must be a 1-D array with at least 2"),
    (lambda: attention_after_eviction([1.0, 2.0], 2), r"j must be an integer in \[0, 1\]"),
    (lambda: eviction_errors([1.0, np.nan], np.ones((2, 1))), "logits must be finite"),
    (lambda: eviction_errors([1.0, 2.0], np.ones((3, 1))), "values must have 2 rows"),
])
def test_caote_theory_functions_reject_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
