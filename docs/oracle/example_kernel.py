"""Checking your kernel against refkv: the worked example of ``docs/oracle/example.rst``.

A second implementation of three policies, written the way a kernel author would: every
KV head at once, float32 throughout, one shared top-k with no Python loop over heads.
It is checked against refkv's committed golden vectors with :mod:`refkv.testing`. One
variant is deliberately wrong, and the kit says where.

Run it from the repository root: ``python docs/oracle/example_kernel.py``.
(``tests/oracle/test_oracle_example.py`` runs it too, so it cannot go stale.)
"""

from pathlib import Path

import numpy as np

from refkv import policies
from refkv.testing import assert_case, load_cases

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "golden"
F32 = np.float32


# -- the selection every policy shares -----------------------------------------------------------
def keep_top(scores, protected, budget):
    """Kept column indices (Hkv, m), increasing: protected first, then the highest scores,
    equal scores going to the more recent token (refkv's tie rule).

    Two stable sorts instead of refkv's lexsort: columns are reversed so that, among equal
    keys, a stable sort puts the more recent token first; sorting by score and then by
    "not protected" leaves the score order intact inside each group.
    """
    n = scores.shape[1]
    m = min(budget, n)
    by_score = np.argsort(-scores[:, ::-1], axis=1, kind="stable")
    unprotected = ~protected[:, ::-1]
    by_group = np.argsort(np.take_along_axis(unprotected, by_score, axis=1), axis=1, kind="stable")
    reversed_cols = np.take_along_axis(by_score, by_group, axis=1)[:, :m]
    return np.sort(n - 1 - reversed_cols, axis=1)


# -- three policies, float32, all heads at once ------------------------------------------------
def sink_kernel(case):
    """StreamingLLM: the first ``sink`` tokens and the most recent ``budget - sink``."""
    positions, budget, sink = case.inputs["positions"], case.budget, case.params["sink"]
    n = positions.shape[1]
    scores = positions.astype(F32)
    protected = (positions < sink) | (np.arange(n) >= n - (budget - sink))[None, :]
    return {"scores": scores, "protected": protected, "kept": keep_top(scores, protected, budget)}


def keydiff_kernel(case):
    """KeyDiff Eq. 8: minus the cosine of each key with the mean of the unit keys."""
    keys = case.inputs["keys"].astype(F32)
    eps = F32(case.params["eps"])
    norms = np.sqrt(np.einsum("hnd,hnd->hn", keys, keys))
    anchor = (keys / np.maximum(norms, eps)[..., None]).mean(axis=1)
    dots = np.einsum("hnd,hd->hn", keys, anchor)
    cosine = dots / np.maximum(norms * np.sqrt(np.einsum("hd,hd->h", anchor, anchor))[:, None], eps)
    scores = -cosine
    protected = np.zeros(scores.shape, dtype=bool)
    return {"scores": scores, "protected": protected, "kept": keep_top(scores, protected, case.budget)}


def tova_kernel(case):
    """TOVA: the attention the block's last query gives each token, averaged over the
    query heads that share the KV head (GQA)."""
    attention = case.inputs["attention"].astype(F32)  # (Hkv, g, B, n)
    scores = attention[:, :, -1, :].sum(axis=1) / F32(attention.shape[1])
    protected = np.zeros(scores.shape, dtype=bool)
    return {"scores": scores, "protected": protected, "kept": keep_top(scores, protected, case.budget)}


def tova_kernel_wrong(case):
    """A plausible GQA bug: the *maximum* over the query group instead of the mean."""
    attention = case.inputs["attention"].astype(F32)
    scores = attention[:, :, -1, :].max(axis=1)
    protected = np.zeros(scores.shape, dtype=bool)
    return {"scores": scores, "protected": protected, "kept": keep_top(scores, protected, case.budget)}


KERNELS = {"sink": sink_kernel, "keydiff": keydiff_kernel, "tova": tova_kernel}


# -- checking them with the kit ---------------------------------------------------------------------
def float32_cases(policy, golden=GOLDEN):
    """The golden float32 cases of ``policy`` with its default parameters."""
    return load_cases(golden, policy=policy, dtype="float32", params=policies.get(policy).params())


def check(policy, kernel, golden=GOLDEN):
    """Assert every case; return (cases, accepted ties). Raises the first AssertionError."""
    cases = float32_cases(policy, golden)
    ties = 0
    for case in cases:
        ties += len(assert_case(case, **kernel(case)))
    return len(cases), ties


def first_failure(policy, kernel, golden=GOLDEN, outputs=("scores", "protected", "kept")):
    """The message of the first case ``kernel`` fails, giving the kit only ``outputs``."""
    for case in float32_cases(policy, golden):
        result = kernel(case)
        try:
            assert_case(case, **{k: result[k] for k in outputs})
        except AssertionError as failure:
            return str(failure)
    return None


# -- the same from the command line: write a candidate directory, run `refkv golden check` ------------
def write_candidate(directory, kernels, golden=GOLDEN):
    """Write the kernels' outputs on the golden float32 cases as a candidate directory."""
    from refkv.oracle.encode import candidate_document
    from refkv.oracle.io import write_json

    for policy, kernel in kernels.items():
        outputs = {case.id: kernel(case) for case in float32_cases(policy, golden)}
        write_json(Path(directory) / "vectors" / f"{policy}.json", candidate_document(policy, outputs))


def golden_check(directory, policies_, golden=GOLDEN):
    """``refkv golden check`` on the vectors of ``policies_``, float32 and default parameters."""
    from refkv.cli import main as refkv_main

    return refkv_main(["golden", "check", str(directory), "--against", str(golden), "--kind", "vectors",
                       "--dtype", "float32", "--default-params", "--policies", *policies_])


def main(golden=GOLDEN):
    import tempfile

    for policy, kernel in KERNELS.items():
        n, ties = check(policy, kernel, golden)
        print(f"{policy:8s} {n} float32 cases pass ({ties} accepted ties)")
    message = first_failure("tova", tova_kernel_wrong, golden)
    if message is None:
        raise SystemExit("the wrong variant passed: the golden cases do not cover GQA")
    print("\n# tova_kernel_wrong, checked with assert_case:")
    print(message)
    print("\n# the same kernel, when it only reports the kept tokens:")
    print(first_failure("tova", tova_kernel_wrong, golden, outputs=("kept",)))
    with tempfile.TemporaryDirectory() as tmp:
        write_candidate(tmp, KERNELS, golden)
        print("\n# the correct kernels, from the command line:")
        assert golden_check(tmp, list(KERNELS), golden) == 0
        write_candidate(tmp, {"tova": tova_kernel_wrong}, golden)
        print("\n# with tova_kernel_wrong:")
        assert golden_check(tmp, ["tova"], golden) == 1


if __name__ == "__main__":
    main()
