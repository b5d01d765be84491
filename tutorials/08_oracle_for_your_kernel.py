"""
8. refkv as the oracle for your own kernel
==========================================

Suppose you have written a fast KeyDiff for your inference engine -- a CUDA kernel, a
Triton kernel, a vectorised CPU path. How do you know it evicts what KeyDiff evicts?
refkv is meant to be the reference you test it against, in your own CI:

* **golden files** (``refkv golden generate``): test vectors of each policy's scores,
  protected masks and kept tokens, on small inputs chosen to be hard (grouped-query
  attention, near ties, zero-norm and duplicate keys, huge logits, float32), plus
  end-to-end runs of the built-in model. JSON and ``.npz``, readable without refkv;
* **assertions** (:mod:`refkv.testing`) that compare your outputs with a golden case and
  say *where* they differ, accepting a different token only when it ties with the one it
  replaces;
* **hypothesis strategies** (:mod:`refkv.testing.strategies`) to test against refkv's
  policies directly on many random caches.

Here the "kernel" is a vectorised NumPy KeyDiff standing in for yours, first with a
plausible bug.
"""

import json
import pathlib
import tempfile

import numpy as np
from hypothesis import given, settings
from hypothesis.configuration import set_hypothesis_home_dir

from refkv import policies
from refkv.figures import pyplot
from refkv.oracle import generate_suite
from refkv.testing import (
    assert_case,
    assert_same_retention,
    assert_scores_close,
    load_cases,
)
from refkv.testing import strategies as kvst

plt = pyplot("Tutorial 8")  # matplotlib.pyplot, or one line saying how to install it

# %%
# A kernel to test
# ----------------
#
# KeyDiff Eq. 8: score each key by minus its cosine with the anchor, the mean of the
# unit keys, and keep the ``budget`` best per KV head. A fast implementation selects
# with a partial sort (``argpartition``), not a full sort, and so makes no promise about
# which of two *equal* scores it keeps. This first version has a bug that is easy to
# write: it averages the raw keys instead of the unit keys.


def my_keydiff(keys, budget, *, unit_anchor=True):
    """keys (Hkv, n, d) -> scores (Hkv, n), kept column indices (Hkv, min(budget, n)),
    increasing."""
    norms = np.sqrt(np.sum(keys * keys, axis=-1))
    unit = keys / np.maximum(norms, 1e-8)[..., None]
    anchor = (unit if unit_anchor else keys).mean(axis=1)
    cos = (np.einsum("hnd,hd->hn", keys, anchor)
           / np.maximum(norms * np.linalg.norm(anchor, axis=-1)[:, None], 1e-8))
    scores = -cos
    m = min(budget, keys.shape[1])
    best = np.argpartition(-scores, m - 1, axis=-1)[:, :m]
    return scores, np.sort(best, axis=-1)


# %%
# Golden test vectors
# -------------------
#
# ``refkv golden generate --out DIR`` writes a suite; from Python it is
# :func:`refkv.oracle.generate_suite`. Your CI would generate it once, commit it (or pin
# the refkv version that writes it), and test against the files -- refkv itself need not
# be installed where the test runs. We write it into a temporary directory.

workdir = tempfile.TemporaryDirectory()
suite_dir = pathlib.Path(workdir.name) / "golden"
# hypothesis's cache, not in your cwd
set_hypothesis_home_dir(pathlib.Path(workdir.name) / ".hypothesis")
index = generate_suite(suite_dir, ["keydiff"])
for entry in index["files"]:
    print(f"{entry['kind']:<8} {entry['path']}")

# %%
# The files are plain JSON (arrays as a flat ``data`` list with their dtype and shape)
# and ``.npz`` without pickled objects; the format is specified on the Oracle pages. A
# look at the vectors file without refkv's reader:

document = json.loads((suite_dir / "vectors" / "keydiff.json").read_text())
print({key: document[key] for key in ("schema", "schema_version", "policy")
       if key in document})
print("top-level keys:", sorted(document))

# %%
# :func:`refkv.testing.load_cases` reads them back as :class:`refkv.oracle.VectorCase`
# objects. We keep KeyDiff's default parameters (the file also holds the paper's
# ablation variants) and look at each case's ``mode`` -- ``oneshot`` (the whole prompt
# is one block, as kvpress and GPU backends prefill) or ``block`` (block prompt
# processing) -- and the flags that say what it is built to catch:

defaults = policies.get("keydiff").params()
cases = load_cases(suite_dir, policy="keydiff", params=defaults)
print(len(cases), "cases with the default parameters")
for case in cases[:4]:
    print(f"  {case}: {case.mode}, {case.dtype}, {case.sizes['n']} candidates "
          f"-> budget {case.budget}, flags {list(case.flags)}")
print("modes:", sorted({case.mode for case in cases}))

# %%
# Checking the kernel
# -------------------
#
# **Predict, then run:** how many of the cases will the raw-key anchor fail -- all, or
# only some? :func:`refkv.testing.assert_case` compares scores (shape, dtype kind,
# values within the case's tolerance, scaled for its dtype) and kept tokens. In a test
# suite each case would be one ``pytest`` parameter; here we loop and print what fails.


def check(kernel_options, cases, kernel=my_keydiff):
    failures, ties = 0, 0
    for case in cases:
        scores, kept = kernel(case.inputs["keys"], case.budget, **kernel_options)
        try:
            ties += len(assert_case(case, scores=scores, kept=kept))
        except AssertionError as error:
            failures += 1
            if failures == 1:
                print(str(error).splitlines()[0])
                print("\n".join(str(error).splitlines()[1:4]))
    print(f"-> {failures} of {len(cases)} cases fail, {ties} ties accepted")
    return failures


_ = check({"unit_anchor": False}, cases)

# %%
# The first failing case names the case, the head and the position where the scores part
# company, with both values. The fix is the one-word change to Eq. 8's anchor:

_ = check({"unit_anchor": True}, cases)

# %%
# The same verdict as a picture: on one case, each key's score from the kernel against
# refkv's reference score, for both versions. The fixed kernel lies on the diagonal; the
# buggy one scatters, and the kept set changes with it.

case = next(c for c in cases if c.dtype == "float64")
reference = case.outputs["scores"]
fig, ax = plt.subplots(figsize=(5, 4.2))
for options, label, marker in (({"unit_anchor": False}, "raw-key anchor (bug)", "x"),
                               ({"unit_anchor": True}, "unit-key anchor (Eq. 8)", "o")):
    ax.scatter(reference.ravel(),
               my_keydiff(case.inputs["keys"], case.budget, **options)[0].ravel(),
               marker=marker, s=18, label=label, alpha=0.8)
lims = (reference.min() - 0.1, reference.max() + 0.1)
ax.plot(lims, lims, color="grey", lw=1, ls="--")
ax.set(xlabel="refkv's score (golden file)", ylabel="kernel's score",
       title=f"KeyDiff scores, case {case}")
ax.legend(fontsize=8)
fig.tight_layout()

# %%
# All pass. The ties line matters: where your kernel keeps another token than refkv,
# ``assert_case`` accepts it only when the two tokens' reference scores are equal within
# the tolerance (a *tie*), and returns these swaps so you can see them. refkv's own rule
# is "equal scores keep the more recent token"; ``strict_ties=True`` demands it. A swap
# that is not a tie fails, with the positions kept by each side.
#
# The golden cases above produced no tie with this kernel, so here is one made on
# purpose. Eight keys of one head, the sixth a copy of the third: their scores are
# equal to the last bit. A kernel that sorts stably keeps the *older* of two equal
# scores; when the budget cuts between the two copies it keeps the third token where
# refkv keeps the sixth. **Predict, then run:** accepted, or a failure?

tie_keys = np.random.default_rng(8).standard_normal((1, 8, 4))
tie_keys[0, 5] = tie_keys[0, 2]                  # position 5 duplicates position 2
tie_scores, _ = my_keydiff(tie_keys, 8)
tie_positions = np.arange(8)[None, :]
m = int((tie_scores[0] > tie_scores[0, 2]).sum()) + 1   # room for one of the copies
older_first = np.sort(np.argsort(-tie_scores, kind="stable")[:, :m], axis=-1)
reference_kept = policies.select(tie_scores, tie_positions, m)
print(f"budget {m}: refkv keeps {reference_kept[0].tolist()}, "
      f"the stable kernel {older_first[0].tolist()}")
swaps = assert_same_retention(older_first, reference_kept, tie_scores,
                              positions=tie_positions, rtol=1e-12)
for swap in swaps:
    print(f"{len(swaps)} tie accepted: {swap.describe()}")
try:
    assert_same_retention(older_first, reference_kept, tie_scores,
                          positions=tie_positions, rtol=1e-12, strict_ties=True)
except AssertionError as error:
    print("with strict_ties=True:", str(error).splitlines()[0])
assert [(s.kept_position, s.dropped_position) for s in swaps] == [(2, 5)]

# %%
# A kernel that disagrees with refkv only on ties passes; one that must reproduce
# refkv's exact kept set (to compare caches bit for bit, say) sets ``strict_ties``.
#
# Property-based: against the policy itself
# -----------------------------------------
#
# Golden files pin a fixed set of cases. With hypothesis you can also draw fresh caches:
# :func:`refkv.testing.strategies.views` runs a drawn cache through block prompt
# processing, exactly as the engine would, and hands you the
# :class:`refkv.policies.View` of the last eviction -- GQA layouts, both dtypes, and the
# adversarial features included. The property: same scores and same kept tokens (up to
# ties) as refkv.

keydiff = policies.get("keydiff")


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(kvst.views(keydiff))
def test_my_keydiff_matches_refkv(view):
    scores, kept = my_keydiff(view.keys, view.keep)
    tol = ({"rtol": 1e-4, "atol": 1e-5} if view.keys.dtype == np.float32
           else {"rtol": 1e-9, "atol": 1e-12})
    assert_scores_close(scores, keydiff.score(view), positions=view.positions, **tol)
    assert_same_retention(kept, keydiff.keep_indices(view), keydiff.score(view),
                          positions=view.positions, **tol)


test_my_keydiff_matches_refkv()
print("60 drawn caches: scores and kept tokens agree with refkv")

# %%
# In your repository
# ------------------
#
# The whole check, as a test file another project would keep next to its kernel
# (``my_kernels.keydiff`` standing for your binding)::
#
#     # tests/test_keydiff_kernel.py
#     import pytest
#     from refkv.testing import assert_case, load_cases
#     from my_kernels import keydiff
#
#     CASES = load_cases("tests/golden/vectors/keydiff.json")
#
#     @pytest.mark.parametrize("case", CASES, ids=str)
#     def test_keydiff_kernel(case):
#         scores, kept = keydiff(case.inputs["keys"], case.budget, **case.params)
#         assert_case(case, scores=scores, kept=kept)
#
# and the end-to-end runs are checked from the command line after your engine has
# written its own kept positions in the same format::
#
#     refkv golden generate --out tests/golden --policies keydiff
#     refkv golden check my_outputs/ --against tests/golden
#
# (``--policies keydiff`` into an existing suite adds or replaces KeyDiff's files and
# leaves the other policies' files untouched.)
#
# The oracle pages of this documentation give the schema of both file kinds, the
# tolerance rules and the end-to-end format.

workdir.cleanup()

# %%
# Exercises
# ---------
#
# 1. A sign slip: a kernel that keeps the *lowest* scores. Which cases catch it?
# 2. A kernel that scores in float32 whatever the input. Does it pass the float64 cases?
#
# Solutions
# ---------
# (The test suite runs these lines; a wrong solution fails it.)


# 1. Every case that evicts anything (n > budget) fails; cases keeping all tokens cannot
#    tell.
def lowest_first(keys, budget):
    scores, _ = my_keydiff(keys, budget)
    m = min(budget, keys.shape[1])
    return scores, np.sort(np.argsort(scores, axis=-1, kind="stable")[:, :m], axis=-1)


evicting = sum(case.sizes["n"] > case.budget for case in cases)
failed = check({}, cases, kernel=lowest_first)
print(f"exercise 1: {failed} failures; {evicting} cases evict")
assert failed == evicting


# 2. float32 rounding (about 1e-7) is far above a float64 case's tolerance: it fails
#    there, and passes the float32 cases.
def single_precision(keys, budget):
    return my_keydiff(keys.astype(np.float32), budget)


failed = check({}, [c for c in cases if c.dtype == "float64"], kernel=single_precision)
print("exercise 2:", failed, "float64 cases fail")
assert failed > 0 and check({}, [c for c in cases if c.dtype == "float32"],
                            kernel=single_precision) == 0

# %%
# Saving the figures
# ------------------
# In the documentation the figures above are part of the page. Run by hand, as
# ``python tutorials/08_oracle_for_your_kernel.py``, the script saves them as PNG files
# in ``~/.cache/refkv/figures`` (or in the folder named by the ``REFKV_FIGURES``
# environment variable), never in the source tree, and prints each path;
# :func:`refkv.figures.save_figures` does it.

from refkv.figures import save_figures

save_figures()
