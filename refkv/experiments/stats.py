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
    "excluded_effects",
    "holm",
    "mcnemar_exact",
    "mean_std",
    "newcombe_paired_difference",
    "paired_mean_difference",
    "paired_proportion_difference",
    "paired_t_test",
    "perplexity_gap",
    "text_perplexities",
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
