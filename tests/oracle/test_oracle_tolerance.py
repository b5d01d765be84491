"""Dtype-derived tolerances (issue 12 B): correct low-precision kernels pass, wrong ones fail.

Low-precision kernels are emulated in NumPy: the case's inputs rounded to bfloat16 or
float16 with :func:`refkv.testing.round_to`, refkv's own policy code run on the rounded
inputs in float32, the scores rounded to the dtype. The wrong kernels are small NumPy
candidates written here, each with one bug a GPU port can plausibly have.

Cases: every float32 case :func:`refkv.testing.load_cases` finds in ``tests/golden`` for
the policy (so one-shot cases added to the suite are picked up), plus one-shot cases built
here with the public :func:`refkv.oracle.synthetic.replay` and
:func:`refkv.oracle.encode.encode_case` (the whole prompt one block, then one eviction).
"""

import inspect
import pathlib
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refkv import policies
from refkv.oracle.cases import compare_case
from refkv.oracle.encode import encode_case, vectors_document
from refkv.oracle.io import write_json
from refkv.oracle.retention import compare_retention
from refkv.oracle.synthetic import random_tokens, replay
from refkv.oracle.tolerance import UNIT_ROUNDOFF, backward_error, reductions, score_tolerance
from refkv.oracle.vectors import json_params, read_vectors
from refkv.policies.base import select
from refkv.testing import load_cases, round_to

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"
LOW = ("bfloat16", "float16")
#: Policies that run one-shot (evicting after attention); HashEvict and MAT evict before it.
ONESHOT = {"tova": {}, "h2o": {}, "snapkv": {}, "keydiff": {}, "knorm": {}, "sink": {}, "caote": {},
           "scissorhands": {}, "full": None}


# -- one-shot cases built with the public API ---------------------------------------------------
def _oneshot_document(name: str, params: dict, seeds=(0, 1), n_heads=4, n_kv_heads=2, d=8):
    policy = policies.get(name, **params)
    budget = {"snapkv": 40, "scissorhands": 16}.get(name, 12)
    cases = []
    for i, seed in enumerate(seeds):
        n_tokens = budget + 10 + 6 * i
        tokens = random_tokens(np.random.default_rng([7, seed]), n_heads, n_kv_heads, d, n_tokens, np.float32)
        view = replay(policy, tokens, block_size=n_tokens, budget=budget)  # one block: one-shot prefill
        cases.append(encode_case(policy, view, case_id=i + 1, comment=f"one-shot prefill of {n_tokens} tokens"))
    return vectors_document(name, [(json_params(policy.params()), cases)])


@pytest.fixture(scope="module")
def oneshot_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("oneshot")
    for name, params in ONESHOT.items():
        if params is not None:
            write_json(folder / f"{name}.json", _oneshot_document(name, params))
    return folder


def _cases(policy: str, oneshot_dir, *, defaults=False) -> list:
    params = policies.get(policy).params() if defaults else None
    cases = load_cases(GOLDEN, policy=policy, dtype="float32", params=params)
    if ONESHOT.get(policy) is not None:
        cases += load_cases(oneshot_dir / f"{policy}.json", params=params)
    return cases


# -- emulated kernels --------------------------------------------------------------------------
def rounded(case, dtype):
    """The case with every float input and per-token field rounded to ``dtype`` (held in float32)."""
    def r(a):
        return round_to(a, dtype) if a.dtype.kind == "f" else a
    return replace(case, dtype="float32", inputs={k: r(v) for k, v in case.inputs.items()},
                   fields={k: r(v) for k, v in case.fields.items()})


def _keep(policy, view, budget):
    one_argument = len(inspect.signature(policy.keep_indices).parameters) == 1
    return policy.keep_indices(view) if one_argument else policy.keep_indices(view, budget)


def correct_kernel(case, dtype):
    """refkv's policy on inputs rounded to ``dtype``, in float32; scores rounded to ``dtype``."""
    policy, view = case.policy(), rounded(case, dtype).view()
    return {"scores": round_to(policy.score(view), dtype), "protected": policy.protected(view),
            "kept": _keep(policy, view, case.budget)}


def correct_kernel_topk_in_dtype(case, dtype):
    """Same scores, but the top-k runs on the rounded scores (ties broken by refkv's rule)."""
    out = correct_kernel(case, dtype)
    m = case.outputs["kept"].shape[1]
    out["kept"] = select(out["scores"].astype(np.float64), case.inputs["positions"], m, out["protected"])
    return out


def _bf16_view(case):
    return rounded(case, "bfloat16").view()


def _finish(case, view, scores, protected=None):
    protected = np.zeros(scores.shape, bool) if protected is None else protected
    kept = select(scores, view.positions, case.outputs["kept"].shape[1], protected)
    return {"scores": round_to(scores, "bfloat16"), "kept": kept}


def tova_max_over_group(case):
    view = _bf16_view(case)
    return _finish(case, view, view.attention[..., -1, :].max(axis=1))  # (Hkv, g, B, n) -> (Hkv, n)


def keydiff_raw_mean_anchor(case):
    view = _bf16_view(case)
    keys = view.keys.astype(np.float32)
    anchor = keys.mean(axis=1, keepdims=True)  # the mean of raw keys, not of unit keys
    norms = np.linalg.norm(keys, axis=-1) * np.linalg.norm(anchor, axis=-1)
    cos = (keys * anchor).sum(axis=-1) / np.maximum(norms, 1e-8)
    return _finish(case, view, -cos, case.policy().protected(view))


def snapkv_window_plus_one(case):
    view = _bf16_view(case)
    w = case.params["window"] + 1  # one query too many in the window, one token too many protected
    mean = view.attention.mean(axis=1)  # (Hkv, B, n)
    summed = mean[:, -w:].sum(axis=1)
    k, n = case.params["kernel"], summed.shape[-1]
    prefix = max(n - w, 0)
    padded = np.pad(summed[:, :prefix], ((0, 0), (k // 2, k // 2)))
    pooled = np.stack([padded[:, i:i + k] for i in range(prefix)], axis=1)
    counts = np.stack([np.pad(np.ones(prefix), (k // 2, k // 2))[i:i + k].sum() for i in range(prefix)]) \
        if prefix else np.zeros(0)
    scores = summed.copy()
    if prefix:
        scores[:, :prefix] = pooled.sum(axis=-1) / counts if case.params["pooling"] == "avg" else pooled.max(-1)
    protected = np.zeros(scores.shape, bool)
    protected[:, n - w:] = True
    return _finish(case, view, scores, protected)


def sink_one_extra(case):
    view = _bf16_view(case)
    sink, m = case.params["sink"] + 1, case.outputs["kept"].shape[1]
    protected = view.positions < sink
    protected[:, view.positions.shape[1] - (m - sink):] = True
    return _finish(case, view, view.positions.astype(np.float64), protected)


def h2o_without_group_average(case):
    view = _bf16_view(case)
    group = view.attention.shape[1]
    this_block = view.attention.mean(axis=1).sum(axis=-2)  # what refkv added to the accumulator
    # Summing the group instead of averaging adds (g - 1) more of this block's weights.
    scores = view.fields["h2o_accumulated"].astype(np.float64) + (group - 1) * this_block
    return _finish(case, view, scores, case.policy().protected(view))


WRONG = {"tova": tova_max_over_group, "keydiff": keydiff_raw_mean_anchor, "snapkv": snapkv_window_plus_one,
         "sink": sink_one_extra, "h2o": h2o_without_group_average}


def _verdicts(cases, kernel, dtype, **options):
    return [compare_case(kernel(case), case, dtype=dtype, **options) for case in cases]


# -- required outcomes -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("policy", sorted(set(policies.available()) & {*ONESHOT, "hashevict", "mat"}))
def test_a_correct_low_precision_kernel_passes_every_float32_case_without_a_factor(policy, dtype, oneshot_dir):
    cases = _cases(policy, oneshot_dir)
    if not cases:
        pytest.skip(f"no float32 {policy} cases")
    for kernel in (correct_kernel, correct_kernel_topk_in_dtype):
        failed = [r.format() for r in _verdicts(cases, lambda c, k=kernel: k(c, dtype), dtype) if not r.ok]
        assert not failed, f"{kernel.__name__} in {dtype}: {len(failed)} of {len(cases)} cases fail:\n" + \
            "\n".join(failed[:3])


@pytest.mark.parametrize("policy", sorted(WRONG))
def test_wrong_kernels_are_rejected_in_bfloat16(policy, oneshot_dir):
    cases = _cases(policy, oneshot_dir, defaults=True)
    kernel = WRONG[policy]
    with_scores = _verdicts(cases, kernel, "bfloat16")
    assert any(not r.ok for r in with_scores), f"the wrong {policy} kernel passed every case with its scores"
    kept_only = [compare_case({"kept": kernel(c)["kept"]}, c, dtype="bfloat16") for c in cases]
    if policy == "h2o":
        # Summing a group instead of averaging it multiplies this block's weights by g: in a
        # one-shot case (no earlier blocks) that is a positive multiple, the same ranking,
        # so the kept sets agree there; only the scores reveal it.
        oneshot = [r for r, c in zip(kept_only, cases) if "one-shot" in c.comment]
        assert oneshot and all(r.ok for r in oneshot)
    else:
        # The strict tie rule: kept sets alone reject the bug too (issue 12: a wrong TOVA
        # used to pass on kept sets once tolerances were loosened for bfloat16).
        assert any(not r.ok for r in kept_only), f"the wrong {policy} kernel passed on kept sets"


@pytest.mark.parametrize("relation", ["monotone", "positive_multiple"])
def test_a_declaration_cannot_hide_a_ranking_that_differs(relation, oneshot_dir):
    cases = _cases("tova", oneshot_dir, defaults=True)
    results = _verdicts(cases, tova_max_over_group, "bfloat16", declare={"scores": relation})
    failed = [r for r in results if not r.ok]
    assert failed
    assert all(f"declared scores={relation} (argument)" in r.notes for r in results)
    assert any(f"scores (declared {relation}" in m for r in failed for m in r.messages)
    # The correct kernel passes under the same declarations.
    assert all(r.ok for r in _verdicts(cases, lambda c: correct_kernel(c, "bfloat16"), "bfloat16",
                                       declare={"scores": relation}))


def test_a_tie_is_accepted_only_within_the_dtype_tolerance_at_the_scores_own_scale(oneshot_dir):
    case = load_cases(oneshot_dir / "tova.json")[0]
    ref, kept = case.outputs["scores"].astype(np.float64), case.outputs["kept"]
    tol = score_tolerance(case, "bfloat16")
    # Own scale: an attention weight's tolerance is a fixed fraction of the weight itself
    # (TOVA's scores are non-negative combinations of the stored weights), never
    # max(1, max|s|) times anything.
    eta = backward_error("bfloat16", reductions(case))
    assert np.all(tol <= (3 * eta + 1e-6) * ref + 1e-38)  # 2 eta perturbations + eta output; 1e-6: float32 reference
    assert np.all(tol >= eta * ref)
    accepted = rejected = 0
    for h in range(ref.shape[0]):
        inside = [c for c in kept[h]]
        outside = [c for c in range(ref.shape[1]) if c not in inside]
        for d in inside:
            for e in outside:
                swapped = kept.copy()
                swapped[h] = np.sort([e if c == d else c for c in kept[h]])
                r = compare_retention(swapped, kept, ref, positions=case.inputs["positions"], tolerance=tol,
                                      rule="bfloat16 rule")
                expected = abs(ref[h, d] - ref[h, e]) <= tol[h, d] + tol[h, e]
                assert r.ok == expected
                if r.ok:
                    accepted += 1
                    assert r.ties[0].rule == ("exact tie: equal reference scores" if ref[h, d] == ref[h, e]
                                              else "bfloat16 rule")
                else:
                    rejected += 1
    assert rejected > 0


def _bf16_near_ties(case):
    ref = case.outputs["scores"].astype(np.float64)
    tol = score_tolerance(case, "bfloat16")
    kept = case.outputs["kept"]
    return [(h, d, e) for h in range(ref.shape[0]) for d in kept[h] for e in range(ref.shape[1])
            if e not in kept[h] and not case.outputs["protected"][h, d]
            and 0 < abs(ref[h, d] - ref[h, e]) <= tol[h, d] + tol[h, e]]


def test_the_report_names_the_rule_of_each_accepted_tie(oneshot_dir):
    found = [(c, t) for c in _cases("tova", oneshot_dir) + _cases("keydiff", oneshot_dir)
             for t in _bf16_near_ties(c)[:1]]
    assert found, "no bfloat16 near tie in any float32 TOVA or KeyDiff case"
    case, (h, d, e) = found[0]
    kept = case.outputs["kept"]
    swapped = kept.copy()
    swapped[h] = np.sort([e if c == d else c for c in kept[h]])
    r = compare_case({"kept": swapped}, case, dtype="bfloat16")
    assert r.ok and r.ties and "[bfloat16 tolerance at the two scores' own scale]" in r.ties[0].describe()
    r = compare_case({"kept": swapped}, case)  # the case's own float32: the same swap is a failure
    assert not r.ok and "float32 tolerance" in r.messages[0]


def test_the_tolerance_factor_is_an_override_shown_in_the_report():
    case = load_cases(GOLDEN, policy="keydiff", dtype="float32")[0]
    base = score_tolerance(case, "float32")
    out = case.outputs
    r = compare_case({"scores": out["scores"] + 3 * base}, case)
    assert not r.ok
    r = compare_case({"scores": out["scores"] + 3 * base}, case, tolerance_factor=4.0)
    assert r.ok and any("tolerance factor 4" in n for n in r.notes)
    with pytest.raises(ValueError, match="tolerance_factor must be a finite number"):
        compare_case({"kept": out["kept"]}, case, tolerance_factor=float("inf"))


@pytest.mark.slow  # importing torch takes several seconds
def test_round_to_agrees_with_torch_and_numpy_half():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(2000) * 10.0 ** rng.integers(-45, 39, 2000),
                        [0.0, -0.0, 1 + 2**-8, 1 + 3 * 2**-8, 3.3895e38, 3.4e38, 1e-45, 65504, 65520, 6e-8]])
    x = x.astype(np.float32)
    with np.errstate(over="ignore"):
        expected = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(round_to(x, "bfloat16"), expected)
        np.testing.assert_array_equal(round_to(x, "float16"), x.astype(np.float16).astype(np.float32))
    assert round_to(x, "float32").dtype == np.float32 and round_to(x, "float64").dtype == np.float64
    with pytest.raises(ValueError, match="dtype must be one of"):
        round_to(x, "float8")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(LOW),
       name=st.sampled_from(["tova", "keydiff", "snapkv", "h2o", "knorm"]), tokens=st.integers(14, 48))
def test_property_emulated_low_precision_kernels_pass_random_one_shot_cases(tmp_path_factory, seed, dtype, name,
                                                                             tokens):
    policy = policies.get(name, **({"window": 4, "kernel": 3} if name == "snapkv" else {}))
    data = random_tokens(np.random.default_rng(seed), 4, 2, 8, tokens, np.float32)
    view = replay(policy, data, block_size=tokens, budget=10)
    doc = vectors_document(name, [(json_params(policy.params()), [encode_case(policy, view, case_id=1,
                                                                             comment="drawn")])])
    path = tmp_path_factory.mktemp("drawn") / f"{name}.json"
    write_json(path, doc)
    case = read_vectors(path).cases[0]
    for kernel in (correct_kernel, correct_kernel_topk_in_dtype):
        r = compare_case(kernel(case, dtype), case, dtype=dtype)
        assert r.ok, r.format()


# -- kernels computed in torch's bfloat16 and float16 (not emulated) -------------------------------------
def _torch_kernels(torch):
    def finish(case, scores, protected):
        m = case.outputs["kept"].shape[1]
        ranked = scores.float().numpy().astype(np.float64)
        return {"scores": scores, "kept": select(ranked, case.inputs["positions"], m, protected)}

    def keydiff(case, dt):
        k = torch.from_numpy(case.inputs["keys"]).to(dt)  # (Hkv, n, d), every step below in dt
        # eps = 1e-8 underflows to 0 in float16 (smallest subnormal 6e-8), and a zero key
        # then scores 0/0 = NaN: a correct half-precision kernel floors at its dtype's
        # smallest normal number instead.
        eps = max(1e-8, torch.finfo(dt).tiny)
        unit = k / torch.clamp(torch.linalg.vector_norm(k, dim=-1, keepdim=True), min=eps)
        anchor = unit.mean(dim=1, keepdim=True)
        cos = (unit * anchor).sum(-1) / torch.clamp(torch.linalg.vector_norm(anchor, dim=-1), min=eps)
        return finish(case, -cos, case.policy().protected(case.view()))

    def tova(case, dt):
        a = torch.from_numpy(case.inputs["attention"]).to(dt)
        scores = a[:, :, -1, :].mean(dim=1)
        return finish(case, scores, np.zeros(tuple(scores.shape), bool))

    def knorm(case, dt):
        scores = -torch.linalg.vector_norm(torch.from_numpy(case.inputs["keys"]).to(dt), dim=-1)
        return finish(case, scores, np.zeros(tuple(scores.shape), bool))

    return {"keydiff": keydiff, "tova": tova, "knorm": knorm}


@pytest.mark.slow  # importing torch takes several seconds
@pytest.mark.parametrize("policy", ["keydiff", "tova", "knorm"])
def test_kernels_computed_in_torch_half_precision_pass(policy, oneshot_dir):
    torch = pytest.importorskip("torch")
    kernel = _torch_kernels(torch)[policy]
    cases = [c for c in _cases(policy, oneshot_dir, defaults=True) if c.layer not in c.params.get("skip_layers", [])]
    for dt, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        failed = [r.format() for r in (compare_case(kernel(c, dt), c, dtype=name) for c in cases) if not r.ok]
        assert not failed, "\n".join(failed[:2])


def test_a_policy_this_process_does_not_know_gets_the_magnitude_model():
    case = load_cases(GOLDEN, policy="tova", dtype="float32")[0]
    foreign = replace(case, policy_name="not-registered-here")
    tol = score_tolerance(foreign, "bfloat16")
    s = np.abs(case.outputs["scores"].astype(np.float64))
    eta = backward_error("bfloat16", reductions(case))
    typical = np.median(s, axis=1, keepdims=True)
    np.testing.assert_allclose(tol, 2 * eta * np.maximum(s, typical) + UNIT_ROUNDOFF["bfloat16"] * s)
