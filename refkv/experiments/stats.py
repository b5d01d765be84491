"""The statistics every experimental verdict carries: intervals, paired tests, effect sizes.

Each verdict of the experiments compares two policies on the *same* prompts or tokens, so
every comparison here is **paired**:

* **Perplexity** (:func:`perplexity_gap`): the gap ``ppl_A - ppl_B`` over several texts,
  with a paired *block* bootstrap over tokens. Token losses are autocorrelated (a hard
  passage is hard for both policies and for several tokens in a row), so tokens are
  resampled in contiguous blocks of 64, each text's blocks within that text, and the same
  blocks for A and B (Kunsch 1989; Lahiri 2003, ch. 2).
* **Passkey accuracy** (:func:`wilson_interval`, :func:`mcnemar_exact`,
  :func:`paired_proportion_difference`): per-policy accuracy with the Wilson score
  interval, and A vs B on the same prompts with McNemar's exact test, which uses only the
  discordant prompts (A right and B wrong, or the reverse).
* **Output error over prompts** (:func:`paired_mean_difference`): Student's t interval of
  the mean paired difference.
* **Summary rows** (:func:`mean_std`): mean, sample standard deviation and count of the
  cells of a table row, NaN left out.

The registered design (``docs/guide/registration.rst``) takes prompts and texts as its
units and adds what its rule needs: Newcombe's paired interval for passkey accuracy
(:func:`newcombe_paired_difference`), the paired t-test's p-value (:func:`paired_t_test`),
per-text perplexities (:func:`text_perplexities`) and Holm's step-down correction within a
claim (:func:`holm`).

The second registered phase (``docs/experiment_registration_phase2.json``) adds what its
analysis needs: power and sample size (:func:`mcnemar_power`, :func:`mcnemar_power_normal`,
:func:`paired_t_power`, :func:`sample_size`), the source as a stratum with per-source
estimates and the source x policy interaction (:func:`stratified_binary`,
:func:`stratified_mean`, :func:`discordance_homogeneity`, :func:`one_way_anova`), the
two-stage bootstrap (:func:`two_stage_bootstrap`) and a rank AUC (:func:`rank_auc`).

:func:`excluded_effects` turns an interval into the sentence a verdict needs: which effect
sizes (the paper's, scaled to this model) the data rule out.

All functions are deterministic given their ``seed``; nothing here touches the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..validation import check_float, check_int

__all__ = [
    "Interval",
    "discordance_homogeneity",
    "excluded_effects",
    "holm",
    "mcnemar_exact",
    "mcnemar_power",
    "mcnemar_power_normal",
    "mean_std",
    "newcombe_paired_difference",
    "one_way_anova",
    "paired_mean_difference",
    "paired_proportion_difference",
    "paired_t_power",
    "paired_t_test",
    "perplexity_gap",
    "rank_auc",
    "sample_size",
    "stratified_binary",
    "stratified_mean",
    "text_perplexities",
    "two_stage_bootstrap",
    "wilson_interval",
]



def scipy_stats():
    """:mod:`scipy.stats`, imported on first use.

    It takes about as long to import as the rest of refkv, and every ``refkv`` command
    imports this module: the command line lists the experiments' own options, so it
    imports the experiment modules, which import this one. Only a summary needs it.
    """
    import scipy.stats

    return scipy.stats


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided confidence interval.

    Attributes
    ----------
    estimate : float
        The statistic on the data as observed.
    low, high : float
        The interval's ends, ``low <= high``.
    confidence : float
        Its nominal coverage, e.g. 0.95.
    n : int
        The sample size it rests on (prompts, texts or tokens; ``unit`` says which).
    unit : str
        What ``n`` counts.
    method : str
        How the interval was computed, for the tables.
    """

    estimate: float
    low: float
    high: float
    confidence: float
    n: int
    unit: str
    method: str

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies in the closed interval."""
        return self.low <= value <= self.high

    def format(self, digits: int = 2) -> str:
        """``"+1.23 [+0.40, +2.10]"`` with signs, for tables."""
        return f"{self.estimate:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


def _check_confidence(confidence) -> float:
    return check_float("confidence", confidence, 0.0, 1.0, low_open=True, high_open=True)


def wilson_interval(successes: int, n: int, *, confidence: float = 0.95) -> Interval:
    """Wilson score interval for a binomial proportion (Wilson 1927).

    .. math::
        \\frac{\\hat p + \\frac{z^2}{2n} \\pm z \\sqrt{\\frac{\\hat p (1-\\hat p)}{n}
        + \\frac{z^2}{4n^2}}}{1 + \\frac{z^2}{n}}, \\qquad z = \\Phi^{-1}(1 - \\alpha/2).

    Unlike the Wald interval it stays inside [0, 1] and keeps its coverage at 0/n and n/n,
    which passkey cells often hit.
    """
    n = check_int("n", n, 1)
    successes = check_int("successes", successes, 0, n)
    confidence = _check_confidence(confidence)
    z = scipy_stats().norm.ppf(0.5 + confidence / 2)
    p = successes / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    scale = 1 + z * z / n
    # Clip rounding at the ends: at 0/n the lower end is exactly 0 in exact arithmetic.
    low, high = max(0.0, (centre - half) / scale), min(1.0, (centre + half) / scale)
    return Interval(p, low, high, confidence, n, "prompts", "Wilson score")


def mcnemar_exact(a_correct, b_correct) -> tuple[int, int, float]:
    """McNemar's exact test of two policies answered on the same prompts.

    Only discordant prompts carry information: ``b`` prompts A got right and B wrong,
    ``c`` the reverse. Under the null of equal accuracy each discordant prompt is a fair
    coin, so the two-sided p-value is ``min(1, 2 P[Bin(b + c, 1/2) <= min(b, c)])``.

    Parameters
    ----------
    a_correct, b_correct : array_like of bool, shape (n_prompts,)
        Whether each policy answered each prompt correctly, in the same prompt order.

    Returns
    -------
    b, c : int
        Discordant counts (A only, B only).
    p : float
        Two-sided exact p-value (1.0 when there is no discordant prompt).
    """
    a = np.asarray(a_correct, dtype=bool)
    b_arr = np.asarray(b_correct, dtype=bool)
    if a.ndim != 1 or a.shape != b_arr.shape or a.size == 0:
        raise ValueError(f"a_correct and b_correct must be non-empty 1-D arrays of the same length, "
                         f"got shapes {a.shape} and {b_arr.shape}")
    b = int(np.sum(a & ~b_arr))
    c = int(np.sum(~a & b_arr))
    if b + c == 0:
        return b, c, 1.0
    p = min(1.0, 2.0 * scipy_stats().binom.cdf(min(b, c), b + c, 0.5))
    return b, c, float(p)


def _percentile_interval(estimate: float, draws: np.ndarray, confidence: float, n: int, unit: str,
                         method: str) -> Interval:
    alpha = 1 - confidence
    low, high = np.quantile(draws, [alpha / 2, 1 - alpha / 2])
    return Interval(float(estimate), float(low), float(high), confidence, n, unit, method)


def paired_proportion_difference(a_correct, b_correct, *, confidence: float = 0.95, n_boot: int = 10_000,
                                 seed: int = 0) -> Interval:
    """Accuracy of A minus accuracy of B on the same prompts, paired bootstrap over prompts.

    Prompts are resampled with replacement and both policies' answers move together, so
    the interval reflects the pairing (the same quantity McNemar's test asks about).
    """
    a = np.asarray(a_correct, dtype=float)
    b = np.asarray(b_correct, dtype=float)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
        raise ValueError(f"a_correct and b_correct must be non-empty 1-D arrays of the same length, "
                         f"got shapes {a.shape} and {b.shape}")
    confidence = _check_confidence(confidence)
    n_boot = check_int("n_boot", n_boot, 100)
    diff = a - b                                                   # (n,)
    rng = np.random.default_rng(check_int("seed", seed, 0))
    idx = rng.integers(0, diff.size, size=(n_boot, diff.size))    # (n_boot, n)
    draws = diff[idx].mean(axis=1)
    return _percentile_interval(diff.mean(), draws, confidence, diff.size, "prompts",
                                "paired bootstrap over prompts")


def paired_mean_difference(a, b, *, confidence: float = 0.95) -> Interval:
    """Mean of ``a - b`` over paired samples (prompts) with Student's t interval.

    Parameters
    ----------
    a, b : array_like, shape (n,)
        One value per prompt for each policy, in the same prompt order; n >= 2.
    """
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.ndim != 1 or a.shape != b.shape or a.size < 2:
        raise ValueError(f"a and b must be 1-D arrays of the same length >= 2, got shapes {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("a and b must be finite")
    confidence = _check_confidence(confidence)
    d = a - b
    n = d.size
    mean = d.mean()
    se = d.std(ddof=1) / math.sqrt(n)
    t = scipy_stats().t.ppf(0.5 + confidence / 2, df=n - 1)
    return Interval(float(mean), float(mean - t * se), float(mean + t * se), confidence, n, "prompts",
                    "paired t")


def paired_t_test(a, b, *, confidence: float = 0.95) -> tuple[Interval, float]:
    """Student's paired t interval of ``mean(a - b)`` and its two-sided p-value.

    The unit is whatever ``a`` and ``b`` are indexed by (texts, prompts); the registered
    design uses it for per-text perplexities and per-prompt measures. With every
    difference equal (zero spread) the p-value is 1 when they are 0 and 0 otherwise.
    """
    interval = paired_mean_difference(a, b, confidence=confidence)
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    se = d.std(ddof=1) / math.sqrt(d.size)
    if se == 0:
        return interval, 1.0 if d.mean() == 0 else 0.0
    p = 2 * scipy_stats().t.sf(abs(d.mean()) / se, df=d.size - 1)
    return interval, float(p)


def newcombe_paired_difference(a_correct, b_correct, *, confidence: float = 0.95) -> Interval:
    """Accuracy of A minus accuracy of B on the same prompts, Newcombe's method 10 interval.

    Newcombe (1998), "Improved confidence intervals for the difference between binomial
    proportions based on paired data", Statist. Med. 17:2635-2650, method 10 ("square and
    add" of the two marginal Wilson score intervals, corrected for the pairing). With ``A``
    prompts both right, ``B`` only A right, ``C`` only B right, ``D`` both wrong, ``N`` in
    all, A's accuracy ``p1 = (A + B) / N`` has Wilson limits ``(l1, u1)`` and B's
    ``p2 = (A + C) / N`` has ``(l2, u2)``; then

    .. math::
        L = p_1 - p_2 - \\sqrt{(p_1 - l_1)^2 + (u_2 - p_2)^2 - 2\\psi (p_1 - l_1)(u_2 - p_2)},

        U = p_1 - p_2 + \\sqrt{(p_2 - l_2)^2 + (u_1 - p_1)^2 - 2\\psi (p_2 - l_2)(u_1 - p_1)},

    where ``psi`` is the phi coefficient of the paired table with Newcombe's continuity
    correction: with ``E = AD - BC`` and ``M`` the product of the four margins,
    ``psi = (E - N/2) / sqrt(M)`` when ``E > N/2``, ``0`` when ``0 <= E <= N/2``,
    ``E / sqrt(M)`` when ``E < 0``, and ``0`` when a margin is empty. The ends are clipped
    to [-1, 1]. Checked against the published example of Fagerland, Lydersen and Laake
    (2017), ch. 8 (Cavo et al. 2012: -0.0621, 95% CI -0.1186 to -0.0046).
    """
    a = np.asarray(a_correct, dtype=bool)
    b = np.asarray(b_correct, dtype=bool)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
        raise ValueError(f"a_correct and b_correct must be non-empty 1-D arrays of the same length, "
                         f"got shapes {a.shape} and {b.shape}")
    confidence = _check_confidence(confidence)
    n = a.size
    both, only_a, only_b, neither = (int(np.sum(a & b)), int(np.sum(a & ~b)), int(np.sum(~a & b)),
                                     int(np.sum(~a & ~b)))
    p1, p2 = (both + only_a) / n, (both + only_b) / n
    w1 = wilson_interval(both + only_a, n, confidence=confidence)
    w2 = wilson_interval(both + only_b, n, confidence=confidence)
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    e = both * neither - only_a * only_b
    if margins == 0 or 0 <= e <= n / 2:
        psi = 0.0
    else:
        psi = (e - n / 2 if e > 0 else e) / math.sqrt(margins)
    below1, above1, below2, above2 = p1 - w1.low, w1.high - p1, p2 - w2.low, w2.high - p2
    d = p1 - p2
    low = d - math.sqrt(max(0.0, below1 ** 2 + above2 ** 2 - 2 * psi * below1 * above2))
    high = d + math.sqrt(max(0.0, below2 ** 2 + above1 ** 2 - 2 * psi * below2 * above1))
    return Interval(d, max(-1.0, low), min(1.0, high), confidence, n, "prompts",
                    "Newcombe paired square-and-add (method 10)")


def holm(p_values) -> np.ndarray:
    """Holm's step-down adjusted p-values (Holm 1979), in the order given.

    Sorted ascending, the ``i``-th smallest of ``m`` p-values becomes
    ``max_{j <= i} min(1, (m - j + 1) p_(j))``; rejecting where the adjusted value is below
    alpha controls the family-wise error rate at alpha.
    """
    p = np.asarray(p_values, dtype=float)
    if p.ndim != 1 or p.size == 0 or not np.all((p >= 0) & (p <= 1)):
        raise ValueError(f"p_values must be a non-empty 1-D array of probabilities in [0, 1], got {p_values!r}")
    m = p.size
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])      # (m,) in ascending order
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(scaled)
    return adjusted


def text_perplexities(nll_per_text) -> np.ndarray:
    """Each text's perplexity, ``exp`` of its mean token negative log-likelihood (n_texts,)."""
    out = []
    for i, nll in enumerate(nll_per_text):
        nll = np.asarray(nll, dtype=float)
        if nll.ndim != 1 or nll.size == 0 or not np.isfinite(nll).all():
            raise ValueError(f"text {i}: token losses must be a non-empty 1-D array of finite values")
        out.append(math.exp(nll.mean()))
    return np.asarray(out)


def _block_starts(n_tokens: int, block: int) -> np.ndarray:
    """Start offsets of the non-overlapping blocks tiling one text (the last may be shorter)."""
    return np.arange(0, n_tokens, block)


def perplexity_gap(nll_a, nll_b, *, block: int = 64, confidence: float = 0.95, n_boot: int = 2000,
                   seed: int = 0) -> Interval:
    """Perplexity of A minus perplexity of B, with a paired block bootstrap over tokens.

    ``ppl = exp(mean NLL)`` over all tokens of all texts. Each bootstrap replicate draws,
    for every text independently, as many blocks as that text has, with replacement, from
    that text's own non-overlapping blocks of ``block`` tokens; A and B get the same blocks,
    so the replicate's gap ``exp(mean nll_A*) - exp(mean nll_B*)`` is paired.

    Parameters
    ----------
    nll_a, nll_b : sequence of array_like
        Per-token negative log-likelihoods, one array per text, the same texts and lengths
        for A and B.
    block : int
        Block length in tokens (64 by default: longer than the loss autocorrelation seen on
        the real model, short enough to give each 1,024-token text 16 blocks).

    Returns
    -------
    Interval
        ``estimate`` is the observed gap; ``n`` counts tokens (``unit`` says so; the method
        string gives the number of texts and blocks).
    """
    if len(nll_a) != len(nll_b) or len(nll_a) == 0:
        raise ValueError(f"nll_a and nll_b must hold the same number (>= 1) of texts, "
                         f"got {len(nll_a)} and {len(nll_b)}")
    block = check_int("block", block, 1)
    confidence = _check_confidence(confidence)
    n_boot = check_int("n_boot", n_boot, 100)
    rng = np.random.default_rng(check_int("seed", seed, 0))
    sum_a = np.zeros(n_boot)
    sum_b = np.zeros(n_boot)
    count = np.zeros(n_boot)
    total_a = total_b = 0.0
    n_tokens = n_blocks = 0
    for i, (a, b) in enumerate(zip(nll_a, nll_b)):
        a = np.asarray(a, dtype=float)
        b = np.asarray(b, dtype=float)
        if a.ndim != 1 or a.shape != b.shape or a.size == 0:
            raise ValueError(f"text {i}: nll_a and nll_b must be non-empty 1-D arrays of the same length, "
                             f"got shapes {a.shape} and {b.shape}")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(f"text {i}: token losses must be finite")
        starts = _block_starts(a.size, block)
        # Per-block sums and lengths: a replicate's totals are sums of drawn blocks.
        block_a = np.add.reduceat(a, starts)                       # (n_blocks_i,)
        block_b = np.add.reduceat(b, starts)
        lengths = np.diff(np.append(starts, a.size))               # (n_blocks_i,)
        draw = rng.integers(0, starts.size, size=(n_boot, starts.size))  # (n_boot, n_blocks_i)
        sum_a += block_a[draw].sum(axis=1)
        sum_b += block_b[draw].sum(axis=1)
        count += lengths[draw].sum(axis=1)
        total_a += a.sum()
        total_b += b.sum()
        n_tokens += a.size
        n_blocks += starts.size
    estimate = math.exp(total_a / n_tokens) - math.exp(total_b / n_tokens)
    draws = np.exp(sum_a / count) - np.exp(sum_b / count)
    method = f"paired block bootstrap ({len(nll_a)} texts, {n_blocks} blocks of {block} tokens)"
    return _percentile_interval(estimate, draws, confidence, n_tokens, "tokens", method)


def excluded_effects(interval: Interval, effects: dict[str, float]) -> str:
    """Say which reference effect sizes an interval excludes and which it cannot.

    Parameters
    ----------
    interval : Interval
        The measured paired difference.
    effects : dict
        Named effect sizes on the interval's scale, e.g. ``{"paper (scaled)": 2.5, "none": 0}``.

    Returns
    -------
    str
        For example ``"excludes paper (scaled) (+2.50); consistent with none (+0.00)"``.
    """
    out, inside = [], []
    for name, value in effects.items():
        value = check_float(f"effects[{name!r}]", value)
        (inside if interval.contains(value) else out).append(f"{name} ({value:+.2f})")
    parts = []
    if out:
        parts.append("excludes " + ", ".join(out))
    if inside:
        parts.append("consistent with " + ", ".join(inside))
    return "; ".join(parts) if parts else "no reference effect given"


def mean_std(values) -> tuple[float, float, int]:
    """Mean, sample standard deviation (0 for one value) and count, ignoring NaN."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    arr = arr[~np.isnan(arr)]
    if arr.size == 0:
        return float("nan"), float("nan"), 0
    std = float(arr.std(ddof=1)) if arr.size > 1 else 0.0
    return float(arr.mean()), std, int(arr.size)


# -- power and sample size (the second registered phase) ----------------------------------------
def _check_alpha(alpha) -> float:
    return check_float("alpha", alpha, 0.0, 1.0, low_open=True, high_open=True)


def _discordant_cells(p_discordant, delta) -> tuple[float, float]:
    """``(p10, p01)``: the chances that only A, or only B, is right on a prompt, from the
    discordance rate ``p10 + p01`` and the effect ``delta = p10 - p01``."""
    p_discordant = check_float("p_discordant", p_discordant, 0.0, 1.0, low_open=True)
    delta = check_float("delta", delta, -1.0, 1.0)
    if abs(delta) > p_discordant:
        raise ValueError(f"|delta| must be <= p_discordant ({p_discordant}), got {delta}: an accuracy "
                         f"difference needs at least as many discordant prompts")
    return (p_discordant + delta) / 2, (p_discordant - delta) / 2


def mcnemar_power(n: int, p_discordant: float, delta: float, alpha: float) -> float:
    """Exact power of the two-sided exact McNemar test (:func:`mcnemar_exact`) at level ``alpha``.

    Each of ``n`` prompts is, independently, discordant with chance ``p_discordant``
    (``p10 + p01``), and a discordant prompt favours A with chance ``q = p10 / p_discordant``,
    where ``delta = p10 - p01`` is the difference of accuracies. The test rejects when its
    p-value is below ``alpha`` (the registered rule: ``p < alpha``), so

    .. math::
        \\text{power} = \\sum_{m=0}^{n} \\binom{n}{m} p_d^m (1 - p_d)^{n-m}
        \\sum_{b=0}^{m} \\binom{m}{b} q^b (1-q)^{m-b}\\,
        [\\min(1, 2 F_{m,1/2}(\\min(b, m - b))) < \\alpha],

    summed exactly (no simulation, no normal approximation).
    """
    n = check_int("n", n, 1)
    alpha = _check_alpha(alpha)
    p10, _ = _discordant_cells(p_discordant, delta)
    q = p10 / p_discordant
    binom = scipy_stats().binom
    power = 0.0
    for m in range(1, n + 1):
        b = np.arange(m + 1)
        p_value = np.minimum(1.0, 2.0 * binom.cdf(np.minimum(b, m - b), m, 0.5))   # (m + 1,)
        reject = b[p_value < alpha]
        if reject.size:
            power += binom.pmf(m, n, p_discordant) * binom.pmf(reject, m, q).sum()
    return float(power)


def mcnemar_power_normal(n: int, p_discordant: float, delta: float, alpha: float) -> float:
    """Connor's (1987) normal approximation to the power of McNemar's test, for comparison:

    .. math::
        \\Phi\\left(\\frac{|\\delta| \\sqrt{n} - z_{1-\\alpha/2} \\sqrt{p_d}}{\\sqrt{p_d - \\delta^2}}\\right).

    Connor, R. J. (1987), "Sample size for testing differences in proportions for the
    paired-sample design", Biometrics 43:207-211.
    """
    n = check_int("n", n, 1)
    alpha = _check_alpha(alpha)
    _discordant_cells(p_discordant, delta)
    norm = scipy_stats().norm
    spread = p_discordant - delta * delta
    if spread <= 0:                      # every discordant prompt favours one side
        return 1.0
    z = norm.ppf(1 - alpha / 2)
    return float(norm.cdf((abs(delta) * math.sqrt(n) - z * math.sqrt(p_discordant)) / math.sqrt(spread)))


def paired_t_power(n: int, effect: float, sd: float, alpha: float) -> float:
    """Exact power of the two-sided paired (one-sample) t-test with ``n`` units, for a true
    mean difference ``effect`` and a standard deviation ``sd`` of the per-unit differences:
    ``P(|T| > t_{1-alpha/2, n-1})`` with ``T`` noncentral t, ``n - 1`` degrees of freedom,
    noncentrality ``effect / sd * sqrt(n)``."""
    n = check_int("n", n, 2)
    effect = check_float("effect", effect)
    sd = check_float("sd", sd, 0.0, low_open=True)
    alpha = _check_alpha(alpha)
    st = scipy_stats()
    critical = st.t.ppf(1 - alpha / 2, n - 1)
    shift = effect / sd * math.sqrt(n)
    return float(st.nct.sf(critical, n - 1, shift) + st.nct.cdf(-critical, n - 1, shift))


def sample_size(power, target: float = 0.8, n_min: int = 2, n_max: int = 10_000) -> int | None:
    """The smallest ``n`` in ``[n_min, n_max]`` with ``power(n) >= target``; ``None`` if none.

    ``power`` is a function of ``n`` (e.g. ``lambda n: mcnemar_power(n, 0.4, 0.28, 0.05 / 3)``).
    The search is upward, one ``n`` at a time: the exact McNemar power is not monotone in
    ``n`` (the discrete test's size jumps), so the first ``n`` that reaches the target is
    reported, not one found by bisection.
    """
    target = check_float("target", target, 0.0, 1.0, low_open=True, high_open=True)
    n_min = check_int("n_min", n_min, 1)
    n_max = check_int("n_max", n_max, n_min)
    for n in range(n_min, n_max + 1):
        if power(n) >= target:
            return n
    return None


# -- the source as a stratum ------------------------------------------------------------------
def _strata(values: np.ndarray, strata) -> tuple[list, np.ndarray]:
    labels = np.asarray(strata)
    if labels.shape != values.shape[:1]:
        raise ValueError(f"strata must give one label per unit ({values.shape[0]}), got shape {labels.shape}")
    return list(dict.fromkeys(labels.tolist())), labels


def discordance_homogeneity(only_a, only_b) -> tuple[float, float]:
    """Whether the discordant prompts split between A and B alike in every stratum: the source
    x policy interaction of a paired binary comparison.

    Stratum ``s`` has ``only_a[s]`` prompts only A answered and ``only_b[s]`` only B. Under the
    null (the same chance ``q`` in every stratum that a discordant prompt favours A), given
    each stratum's discordant count ``m_s`` and the total ``sum only_a``, the ``only_a[s]`` are
    multivariate hypergeometric: a table ``x`` has probability
    ``prod_s C(m_s, x_s) / C(sum m, sum only_a)``. The statistic is Pearson's chi-square of the
    ``S x 2`` table, ``sum_s (x_s - m_s q)^2 / (m_s q (1 - q))`` with ``q`` the pooled share;
    the p-value is exact: the chance, under that conditional law, of a table with a chi-square
    at least as large. Strata with no discordant prompt carry no information and are left
    out. Returns ``(chi_square, p)``; ``p = 1`` with fewer than two informative strata.

    Notes
    -----
    Given the totals, the chi-square is an increasing affine function of ``sum_s x_s^2 / m_s``
    (expand the square: ``sum_s (x_s - m_s q)^2 / m_s = sum_s x_s^2 / m_s - q sum_s x_s``, and
    ``sum_s x_s`` is fixed), so a table is at least as extreme as the observed one exactly when
    ``sum_s x_s^2 l / m_s`` (``l`` the least common multiple of the ``m_s``: an integer) is at
    least the observed value. The tail is computed stratum by stratum, a dynamic program over
    (prompts given to A so far, that integer so far) with the exact integer weights
    ``prod C(m_s, x_s)``, not an enumeration of the tables; a state that already reached the
    observed value counts wholly. Ties are exact: no floating-point tolerance. 21 documents
    of 7 prompts take well under a second.
    """
    a = np.asarray(only_a, dtype=int)
    b = np.asarray(only_b, dtype=int)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0 or (a < 0).any() or (b < 0).any():
        raise ValueError("only_a and only_b must be 1-D arrays of the same length of counts >= 0")
    m = a + b
    keep = m > 0
    a, m = a[keep], m[keep]
    if a.size < 2 or a.sum() in (0, m.sum()):
        return 0.0, 1.0
    total, favour = int(m.sum()), int(a.sum())
    q = favour / total
    observed = float(np.sum((a - m * q) ** 2 / (m * q * (1 - q))))
    sizes = [int(x) for x in m]
    lcm = math.lcm(*sizes)
    scale = [lcm // size for size in sizes]  # x^2 / m_s in units of 1 / lcm
    target = sum(int(x) ** 2 * w for x, w in zip(a, scale))
    # states: (prompts given to A so far, sum of x^2 lcm / m so far, or None once it reached target) -> weight
    states: dict[tuple[int, int | None], int] = {(0, 0): 1}
    after = [total - sum(sizes[:i + 1]) for i in range(len(sizes))]  # discordant prompts in the later strata
    for size, w, rest in zip(sizes, scale, after):
        following: dict[tuple[int, int | None], int] = {}
        for (given, partial), weight in states.items():
            for x in range(size + 1):
                k = given + x
                if k > favour or favour - k > rest:  # the remaining strata cannot make up the total
                    continue
                value = None if partial is None or partial + x * x * w >= target else partial + x * x * w
                following[(k, value)] = following.get((k, value), 0) + weight * math.comb(size, x)
        states = following
    tail = sum(weight for (k, value), weight in states.items() if k == favour and value is None)
    return observed, float(min(1.0, tail / math.comb(total, favour)))


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def stratified_binary(a_correct, b_correct, strata, *, confidence: float = 0.95) -> dict:
    """A paired binary comparison with the source as a stratum.

    Returns ``{"strata": {label: {"n", "only_a", "only_b", "estimate", "low", "high", "p"}},
    "chi_square", "p_interaction"}``: per stratum, the difference of accuracies with
    Newcombe's paired interval and the exact McNemar p (:func:`newcombe_paired_difference`,
    :func:`mcnemar_exact`); and the source x policy interaction
    (:func:`discordance_homogeneity`). The pooled exact McNemar test over all prompts is the
    Mantel-Haenszel test for matched pairs stratified by source (it pools the discordant
    pairs), so the registered pooled test is already the stratified one.
    """
    a = np.asarray(a_correct, dtype=bool)
    b = np.asarray(b_correct, dtype=bool)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
        raise ValueError("a_correct and b_correct must be non-empty 1-D arrays of the same length")
    order, labels = _strata(a, strata)
    out, only_a, only_b = {}, [], []
    for label in order:
        mine = labels == label
        interval = newcombe_paired_difference(a[mine], b[mine], confidence=confidence)
        x, y, p = mcnemar_exact(a[mine], b[mine])
        only_a.append(x)
        only_b.append(y)
        out[label] = {"n": int(mine.sum()), "only_a": x, "only_b": y, "estimate": interval.estimate,
                      "low": interval.low, "high": interval.high, "p": p}
    chi, p_interaction = discordance_homogeneity(only_a, only_b)
    return {"strata": out, "chi_square": chi, "p_interaction": p_interaction}


def one_way_anova(groups) -> tuple[float, int, int, float]:
    """One-way analysis of variance: ``(F, df_between, df_within, p)``.

    ``F = [sum_s n_s (mean_s - mean)^2 / (S - 1)] / [sum_s sum_i (x_si - mean_s)^2 / (N - S)]``.
    Applied to per-unit paired differences grouped by source, it tests the source x policy
    interaction: whether the policy difference is the same in every source. Groups with one
    unit add to the between-groups sum only. ``p`` is NaN when the within-group sum is 0.
    """
    groups = [np.asarray(g, dtype=float) for g in groups]
    if len(groups) < 2 or any(g.ndim != 1 or g.size == 0 for g in groups):
        raise ValueError("groups must be at least two non-empty 1-D arrays")
    every = np.concatenate(groups)
    if not np.isfinite(every).all():
        raise ValueError("groups must hold finite values")
    n, s = every.size, len(groups)
    if n <= s:
        raise ValueError(f"one_way_anova needs more units ({n}) than groups ({s})")
    between = sum(g.size * (g.mean() - every.mean()) ** 2 for g in groups)
    within = sum(((g - g.mean()) ** 2).sum() for g in groups)
    if within == 0:
        return float("inf") if between > 0 else float("nan"), s - 1, n - s, float("nan")
    f = (between / (s - 1)) / (within / (n - s))
    return float(f), s - 1, n - s, float(scipy_stats().f.sf(f, s - 1, n - s))


def stratified_mean(a, b, strata, *, confidence: float = 0.95) -> dict:
    """A paired mean comparison (per-text perplexity, per-prompt measure) with the source as
    a stratum: per stratum the mean difference ``a - b`` with its paired t interval and p
    (:func:`paired_t_test`; a stratum with one unit gets its difference and NaN interval),
    and the interaction by :func:`one_way_anova` of the differences across strata.
    ``b`` may be None for a one-sample statistic.

    Returns ``{"strata": {label: {"n", "estimate", "low", "high", "p"}}, "f", "df",
    "p_interaction"}``.
    """
    a = np.asarray(a, dtype=float)
    b = np.zeros(a.shape) if b is None else np.asarray(b, dtype=float)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
        raise ValueError("a and b must be non-empty 1-D arrays of the same length")
    order, labels = _strata(a, strata)
    d = a - b
    out = {}
    for label in order:
        mine = labels == label
        if mine.sum() >= 2:
            interval, p = paired_t_test(a[mine], b[mine], confidence=confidence)
            out[label] = {"n": int(mine.sum()), "estimate": interval.estimate, "low": interval.low,
                          "high": interval.high, "p": p}
        else:
            out[label] = {"n": 1, "estimate": float(d[mine][0]), "low": float("nan"), "high": float("nan"),
                          "p": float("nan")}
    if len(order) < 2:
        return {"strata": out, "f": float("nan"), "df": (0, 0), "p_interaction": float("nan")}
    f, df1, df2, p = one_way_anova([d[labels == label] for label in order])
    return {"strata": out, "f": f, "df": (df1, df2), "p_interaction": p}


# -- the two-stage bootstrap and a rank AUC ---------------------------------------------------
def two_stage_bootstrap(nll_a, nll_b, *, block: int = 64, confidence: float = 0.95, n_boot: int = 10_000,
                        seed: int = 0) -> Interval:
    """The mean over texts of the per-text perplexity difference, two-stage bootstrap.

    Each replicate draws texts with replacement (stage one), then, within each drawn text,
    its non-overlapping blocks of ``block`` tokens with replacement (stage two), the same
    blocks for A and B; a text's replicate value is ``exp(mean nll_A*) - exp(mean nll_B*)``
    over its drawn blocks, and the replicate is the mean over the drawn texts. The registered
    design reports it beside the paired t interval, with its spread over bootstrap seeds; no
    verdict uses it. ``estimate`` is the observed mean per-text difference.
    """
    if len(nll_a) != len(nll_b) or len(nll_a) < 2:
        raise ValueError(f"nll_a and nll_b must hold the same number (>= 2) of texts, "
                         f"got {len(nll_a)} and {len(nll_b)}")
    block = check_int("block", block, 1)
    confidence = _check_confidence(confidence)
    n_boot = check_int("n_boot", n_boot, 100)
    rng = np.random.default_rng(check_int("seed", seed, 0))
    per_text, observed = [], []
    for i, (a, b) in enumerate(zip(nll_a, nll_b)):
        a = np.asarray(a, dtype=float)
        b = np.asarray(b, dtype=float)
        if a.ndim != 1 or a.shape != b.shape or a.size == 0 or not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(f"text {i}: nll_a and nll_b must be finite non-empty 1-D arrays of the same length")
        starts = _block_starts(a.size, block)
        per_text.append((np.add.reduceat(a, starts), np.add.reduceat(b, starts),
                         np.diff(np.append(starts, a.size))))
        observed.append(math.exp(a.mean()) - math.exp(b.mean()))
    n_texts = len(per_text)
    texts = rng.integers(0, n_texts, size=(n_boot, n_texts))               # (n_boot, n_texts)
    draws = np.zeros(n_boot)
    for t, (block_a, block_b, lengths) in enumerate(per_text):
        # every replicate redraws the blocks of text t each time t is drawn; draw for all
        # replicates and copies at once: (n_boot, copies, n_blocks)
        copies = (texts == t).sum(axis=1)                                   # (n_boot,)
        most = int(copies.max())
        if most == 0:
            continue
        pick = rng.integers(0, block_a.size, size=(n_boot, most, block_a.size))
        count = lengths[pick].sum(axis=2)
        value = np.exp(block_a[pick].sum(axis=2) / count) - np.exp(block_b[pick].sum(axis=2) / count)
        used = np.arange(most)[None, :] < copies[:, None]                   # (n_boot, most)
        draws += np.where(used, value, 0.0).sum(axis=1)
    draws /= n_texts
    return _percentile_interval(float(np.mean(observed)), draws, confidence, n_texts, "texts",
                                f"two-stage bootstrap (texts, then blocks of {block} tokens)")


def rank_auc(scores, positive) -> tuple[float, float]:
    """The area under the ROC curve of ``scores`` for telling ``positive`` units from the
    others, with the two-sided p of the Mann-Whitney U test (``AUC = U / (n_pos n_neg)``,
    ties counted one half). Used to ask whether ``needle_retention`` separates right answers
    from wrong ones."""
    x = np.asarray(scores, dtype=float)
    y = np.asarray(positive, dtype=bool)
    if x.ndim != 1 or x.shape != y.shape or y.all() or not y.any():
        raise ValueError("scores and positive must be 1-D of the same length, with both classes present")
    pos, neg = x[y], x[~y]
    u = float((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum())
    p = float(scipy_stats().mannwhitneyu(pos, neg, alternative="two-sided").pvalue)
    return u / (pos.size * neg.size), p
