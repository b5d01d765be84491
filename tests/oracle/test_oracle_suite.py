"""The committed golden suite: complete, intact, deterministic; and the ``refkv golden`` command."""

import json
import pathlib
import shutil
import time

import numpy as np
import pytest

from refkv.cli import main
from refkv.oracle import check_suite, generate_suite, read_suite
from refkv.oracle.io import read_npz, write_json, write_npz
from refkv.oracle.recipes import E2E_MODELS, library_policies
from refkv.oracle.regenerate import REGENERATION_BOUND, regeneration_differences

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"
REGENERATE = "regenerate with: refkv golden generate --out tests/golden"


def test_the_suite_is_intact_and_small():
    index = read_suite(GOLDEN)  # verifies every file's sha256
    size = sum(f.stat().st_size for f in GOLDEN.rglob("*") if f.is_file())
    # 3.7 MB of vectors, block and one-shot goldens, 0.55 MB of schedule goldens (issue 22 A),
    # 0.75 MB for AdaKV and PyramidKV (SnapKV's 32-token window makes their cases large): 5.0 MB
    assert size < 5_500_000, f"the committed suite is {size} bytes"
    listed = {e["path"] for e in index["files"]}
    on_disk = {str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*.json")} - {"suite.json"}
    assert listed == on_disk


def test_every_registered_policy_has_goldens():
    index = read_suite(GOLDEN)
    missing = sorted(set(library_policies()) - set(index["policies"]))
    assert not missing, f"no goldens for {missing}; {REGENERATE}"
    for name in index["policies"]:
        kinds = {e["kind"] for e in index["files"] if e["policy"] == name}
        assert "e2e" in kinds, name
        assert "vectors" in kinds, name


@pytest.mark.slow
def test_regenerating_the_suite_gives_the_same_decisions_and_floats_within_the_stated_bound(tmp_path):
    # Portable: on another CPU or BLAS the last bits of floats may move, so the condition is
    # identical decisions (kept positions, protected masks, flags, counts, strings) and
    # floats within the bound suite.json states (far below the check tolerances); both
    # sides are printed when it fails. Regenerate only if a change is intended.
    start = time.perf_counter()
    generate_suite(tmp_path)
    seconds = time.perf_counter() - start
    bound = read_suite(GOLDEN, verify=False)["regeneration"]["float_bound"]
    assert bound == REGENERATION_BOUND
    diff = regeneration_differences(GOLDEN, tmp_path)
    assert not diff.decisions, (f"{len(diff.decisions)} decisions changed:\n" + "\n".join(diff.decisions[:20])
                                + f"\n{REGENERATE}")
    beyond = diff.beyond(bound)
    assert not beyond, "\n".join(f"{where}: scaled difference {d:.2e} > {bound[diff.kind(where)][dtype]} ({dtype})\n"
                                 f"  committed:   {_short(a)}\n  regenerated: {_short(b)}"
                                 for where, d, dtype, a, b in beyond[:10]) + f"\n{REGENERATE}"
    print(f"regenerated in {seconds:.1f} s; largest scaled float differences: " + ", ".join(
        f"{kind} {dtype} {diff.largest(dtype, kind):.1e}" for kind in bound for dtype in bound[kind]))


def _short(x) -> str:
    return np.array2string(np.asarray(x, dtype=np.float64).ravel()[:8], precision=17) + " ..."


def test_regeneration_compares_decisions_exactly_and_floats_by_the_bound(tmp_path):
    # The comparison itself can fail: a flipped kept position is a decision, a float moved
    # by 1e-8 is beyond the float64 end-to-end bound (1e-10), one moved by 1e-13 is within it.
    for sub in ("a", "b"):
        shutil.copytree(GOLDEN / "e2e" / "sink", tmp_path / sub / "e2e" / "sink")
    rel = "e2e/sink/N8-B4-float64.npz"  # float64 end to end: bound 1e-10
    arrays = read_npz(tmp_path / "b" / rel)
    arrays["logits"] = arrays["logits"] * (1 + 1e-13)
    write_npz(tmp_path / "b" / rel, arrays)
    diff = regeneration_differences(tmp_path / "a", tmp_path / "b")
    assert not diff.decisions and not diff.beyond(REGENERATION_BOUND) and diff.largest("float64") > 0
    arrays["logits"] = arrays["logits"] * (1 + 1e-8)
    k = arrays["kept"]
    k[-1, 0, 0, 0] += 1
    write_npz(tmp_path / "b" / rel, arrays)
    diff = regeneration_differences(tmp_path / "a", tmp_path / "b")
    assert [d for d in diff.decisions if d.startswith(f"{rel}:kept: values differ")]
    assert [f for f in diff.beyond(REGENERATION_BOUND) if f[0] == f"{rel}:logits"]


def test_generating_twice_on_one_machine_gives_identical_bytes(tmp_path):
    # Bit-identity is a property of one machine (not the condition across CPUs).
    generate_suite(tmp_path / "a", ["sink"])
    generate_suite(tmp_path / "b", ["sink"])
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files and all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)


def test_the_suite_passes_against_itself_with_no_ties():
    report = check_suite(GOLDEN, GOLDEN)
    assert report.ok and len(report.files) == len(read_suite(GOLDEN)["files"])
    assert all(f.status == "ok" for f in report.files)


def test_a_tampered_reference_is_refused(tmp_path):
    shutil.copytree(GOLDEN, tmp_path / "g")
    path = tmp_path / "g" / "vectors" / "sink.json"
    path.write_text(path.read_text().replace('"budget": 6', '"budget": 7', 1))
    with pytest.raises(ValueError, match=r"sink.json: checksum mismatch with suite.json"):
        read_suite(tmp_path / "g")


# -- candidates through the command line -----------------------------------------------------------
@pytest.fixture
def candidate(tmp_path):
    """A copy of the committed suite's h2o and keydiff files, to be spoiled by each test."""
    root = tmp_path / "cand"
    for sub in ("vectors", "e2e"):
        (root / sub).mkdir(parents=True)
    for name in ("h2o", "keydiff"):
        shutil.copy(GOLDEN / "vectors" / f"{name}.json", root / "vectors")
        shutil.copytree(GOLDEN / "e2e" / name, root / "e2e" / name)
    return root


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_check_passes_an_exact_copy(capsys, candidate):
    code, out = _run(capsys, "golden", "check", str(candidate), "--against", str(GOLDEN), "--policies", "h2o,keydiff")
    assert code == 0 and out.rstrip().endswith("PASS")


def test_check_reports_missing_files_unless_allowed(capsys, candidate):
    code, out = _run(capsys, "golden", "check", str(candidate), "--against", str(GOLDEN), "--policies", "sink")
    assert code == 1 and "MISS vectors/sink.json" in out
    code, out = _run(capsys, "golden", "check", str(candidate), "--against", str(GOLDEN), "--allow-missing")
    assert code == 0


def test_check_names_the_first_end_to_end_divergence(capsys, candidate):
    rel = "e2e/h2o/N8-B4-float64"
    ref = read_npz(GOLDEN / f"{rel}.npz")
    arrays = {k: ref[k].copy() for k in ("kept", "kept_count", "logits")}
    # In the first eviction of layer 0, head 0: keep the worst-scored evicted token instead
    # of the worst-scored kept one.
    b = int(np.argmax(ref["candidate_count"][:, 0] > 0))
    c = ref["candidate_count"][b, 0]
    cand, scores, prot = ref["candidates"][b, 0, 0, :c], ref["scores"][b, 0, 0, :c], ref["protected"][b, 0, 0, :c]
    kept = arrays["kept"][b, 0, 0, :ref["kept_count"][b, 0]]
    evicted = [i for i in range(c) if cand[i] not in kept]
    inside = [i for i in range(c) if cand[i] in kept and not prot[i]]
    out_i = min(evicted, key=lambda i: scores[i])
    in_i = min(inside, key=lambda i: scores[i])
    arrays["kept"][b, 0, 0, :len(kept)] = np.sort(np.where(kept == cand[in_i], cand[out_i], kept))
    write_npz(candidate / f"{rel}.npz", arrays)
    code, out = _run(capsys, "golden", "check", str(candidate), "--against", str(GOLDEN), "--policies", "h2o",
                     "--kind", "e2e")
    assert code == 1
    assert f"FAIL {rel}.json" in out
    assert (f"block {b}, layer 0, head 0: candidate keeps position {cand[out_i]} (reference score" in out
            and f"instead of position {cand[in_i]} (reference score" in out)


def test_check_accepts_a_swap_at_the_closest_call_as_a_tie(capsys, candidate):
    # With tolerances scaled up past the golden's closest call, swapping those two tokens is
    # a tie: accepted, reported, and what follows it is not compared.
    rel = "e2e/keydiff/N8-B4-float64"
    man = json.loads((GOLDEN / f"{rel}.json").read_text())
    ref = read_npz(GOLDEN / f"{rel}.npz")
    call = man["closest_call"]
    b, l, h = call["block"], call["layer"], call["head"]
    c = ref["candidate_count"][b, l]
    cand, scores, prot = ref["candidates"][b, l, h, :c], ref["scores"][b, l, h, :c], ref["protected"][b, l, h, :c]
    k = ref["kept_count"][b, l]
    kept = ref["kept"][b, l, h, :k].copy()
    inside = [i for i in range(c) if cand[i] in kept and not prot[i]]
    evicted = [i for i in range(c) if cand[i] not in kept]
    low = min(inside, key=lambda i: scores[i])
    high = max(evicted, key=lambda i: scores[i])
    assert scores[low] - scores[high] == pytest.approx(call["gap"])
    arrays = {n: ref[n].copy() for n in ("kept", "kept_count", "logits")}
    arrays["kept"][b, l, h, :k] = np.sort(np.where(kept == cand[low], cand[high], kept))
    write_npz(candidate / f"{rel}.npz", arrays)
    argv = ["golden", "check", str(candidate), "--against", str(GOLDEN), "--policies", "keydiff", "--kind", "e2e"]
    code, out = _run(capsys, *argv)
    assert code == 1 and "> tolerance" in out  # the gap is far above the suite's own tolerance
    factor = 2 * call["gap"] / man["tolerance"]["scores"]["atol"]
    code, out = _run(capsys, *argv, "--tolerance-factor", str(factor))
    assert code == 0, out
    assert f"TIE  {rel}.json" in out and f"tie accepted: block {b}, layer {l}, head {h}" in out
    code, out = _run(capsys, *argv, "--tolerance-factor", str(factor), "--strict-ties")
    assert code == 1 and "strict ties" in out


def test_check_reports_vector_failures_per_case(capsys, candidate):
    path = candidate / "vectors" / "keydiff.json"
    doc = json.loads(path.read_text())
    case = doc["groups"][0]["cases"][0]
    case["outputs"]["scores"]["data"][0] += 0.5
    write_json(path, doc)
    code, out = _run(capsys, "golden", "check", str(candidate), "--against", str(GOLDEN), "--policies", "keydiff",
                     "--kind", "vectors")
    assert code == 1
    assert "FAIL vectors/keydiff.json" in out and "keydiff case 1 [" in out
    assert "scores: values differ: 1 of" in out and "first at head 0, position" in out


def test_generate_merges_chosen_policies_into_an_existing_suite(capsys, tmp_path):
    code, out = _run(capsys, "golden", "generate", "--out", str(tmp_path), "--policies", "sink", "knorm", "--quiet")
    assert code == 0 and "for 2 policies" in out
    assert read_suite(tmp_path)["policies"] == ["knorm", "sink"]
    knorm = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "knorm" in p.name + str(p.parent)}
    assert any(p.suffix == ".npz" for p in knorm)
    (tmp_path / "vectors" / "sink.json").unlink()  # sink's files are rewritten
    code, out = _run(capsys, "golden", "generate", "--out", str(tmp_path), "--policies", "sink", "--quiet")
    assert code == 0
    index = read_suite(tmp_path)  # every checksum holds
    assert index["policies"] == ["knorm", "sink"] and (tmp_path / "vectors" / "sink.json").exists()
    assert all(p.read_bytes() == data for p, data in knorm.items())  # knorm untouched
    assert not (tmp_path / ".refkv-generate").exists()
    code, out = _run(capsys, "golden", "check", str(tmp_path), "--against", str(GOLDEN), "--policies", "sink")
    assert code == 0


def test_usage_errors_exit_2_with_a_message(capsys, tmp_path):
    code, out = _run(capsys, "golden", "generate", "--out", str(tmp_path), "--policies", "nosuch")
    assert code == 2 and "unknown policy 'nosuch'" in out
    code, out = _run(capsys, "golden", "check", str(tmp_path / "absent"), "--against", str(GOLDEN))
    assert code == 2 and "does not exist" in out
    code, out = _run(capsys, "golden", "check", str(GOLDEN), "--against", str(tmp_path))
    assert code == 2 and "has no suite.json" in out


# -- one-shot coverage (issue 12 A) -----------------------------------------------------------------------
def _cases():
    from refkv.oracle import read_vectors

    return [c for path in sorted((GOLDEN / "vectors").glob("*.json")) for c in read_vectors(path).cases]


def test_every_policy_that_runs_one_shot_has_one_shot_goldens_in_both_dtypes():
    from refkv import policies
    from refkv.oracle.recipes import NO_ONESHOT
    from refkv.oracle.synthetic import config_for

    index = read_suite(GOLDEN)
    cases = _cases()
    largest = set()
    for name in index["policies"]:
        e2e = {(e["mode"], e["dtype"]) for e in index["files"] if e["policy"] == name and e["kind"] == "e2e"}
        vec = {(c.mode, c.dtype) for c in cases if c.policy_name == name}
        if policies.policy_class(name).evict_before_attention:
            # No one-shot form: the reason is stated in the suite, once per parameter set and model.
            assert not any(m == "oneshot" for m, _ in e2e | vec), name
            reasons = [s for s in index["skipped"] if s["policy"] == name and "one-shot" in s["what"] + s["reason"]]
            assert reasons and all(s["reason"] == NO_ONESHOT for s in reasons), name
            # ... and their nearest regime, the largest block they accept, is covered instead.
            for c in (c for c in cases if c.policy_name == name and "largest block" in c.comment):
                cfg = config_for(c.sizes["n_heads"], c.sizes["n_kv_heads"], c.sizes["d_head"], c.n_layers)
                n = c.budget + c.sizes["block"]  # before attention the case keeps N - B
                assert c.sizes["block"] == c.policy().max_block(n, cfg), c.label
                largest.add(name)
            continue
        assert {("oneshot", "float32"), ("oneshot", "float64"), ("block", "float64")} <= e2e, name
        assert ("oneshot", "float32") in vec, name
        if name != "full":  # full never evicts: its vectors are a no-eviction and a single-token case
            assert {("oneshot", "float64"), ("block", "float32"), ("block", "float64")} <= vec, name
    assert largest == {n for n in index["policies"] if policies.policy_class(n).evict_before_attention}


def test_float32_cases_carry_every_adversarial_flag():
    flags = {f for c in _cases() if c.dtype == "float32" for f in c.flags}
    assert {"zero-norm-key", "duplicate-keys", "exact-tie", "near-tie", "huge-logits", "gqa", "mha",
            "single-token"} <= flags
    oneshot = {f for c in _cases() if c.dtype == "float32" and c.mode == "oneshot" for f in c.flags}
    assert {"zero-norm-key", "duplicate-keys", "near-tie", "huge-logits", "gqa", "mha"} <= oneshot


def test_one_shot_cases_are_the_whole_prompt_and_snapkv_sees_its_whole_window():
    snapkv = 0
    for c in _cases():
        if c.mode != "oneshot":
            continue
        assert c.stage == "after-attention" and c.sizes["block"] == c.sizes["n"], c.label
        assert list(c.inputs["query_positions"]) == list(range(c.sizes["n"])), c.label
        if c.policy_name == "snapkv" and c.sizes["n"] > c.budget:
            assert c.sizes["block"] >= c.params["window"], c.label
            snapkv += c.params["window"] == 32  # the default window, not only the small variants
    assert snapkv >= 2
    index = read_suite(GOLDEN)
    oneshot_snapkv = [e for e in index["files"] if e["policy"] == "snapkv" and e.get("mode") == "oneshot"]
    for entry in oneshot_snapkv:
        man = json.loads((GOLDEN / entry["path"]).read_text())
        assert man["block_size"] is None and man["budget"] > man["policy"]["params"]["window"]
        assert man["prompt"]["length"] >= man["policy"]["params"]["window"] + man["budget"] // 2
        assert man["evictions"] == man["model"]["config"]["n_layers"]  # every layer evicted once
    # float64 and float32 on the built-in model, float32 on each other architecture's model
    assert len(oneshot_snapkv) == 2 + len(E2E_MODELS) - 1


def test_every_case_states_the_block_size_it_ran():
    import re

    for c in _cases():
        t = int(c.inputs["query_positions"][-1]) + 1  # the prompt ran up to the last block's end
        stated = re.search(r"\((one-shot: T=(\d+) in one block|T=(\d+) in (\d+) blocks of (\d+)), N=(\d+)\)$",
                           c.comment)
        if "engine" in c.flags:
            b = re.search(r"N=\d+, B=(\d+|the whole prompt \(one-shot\))", c.comment).group(1)
            assert (c.mode == "oneshot") == b.startswith("the whole"), c.label
            assert c.mode == "oneshot" or int(b) == c.sizes["block"], c.label
            continue
        assert stated, c.label
        if stated.group(2):
            assert c.mode == "oneshot" and int(stated.group(2)) == t == c.sizes["block"], c.label
        else:
            total, count, block = (int(stated.group(i)) for i in (3, 4, 5))
            assert c.mode == "block" and block == c.sizes["block"] and total == t == count * block, c.label


def test_a_float64_array_of_a_float32_case_is_bounded_as_float32(tmp_path):
    # H2O's accumulator is stored in float64 but computed by a float32 run: another CPU
    # moves it by float32 rounding, which the float64 bound (1e-12) would call a failure.
    for sub in ("a", "b"):
        shutil.copytree(GOLDEN / "vectors", tmp_path / sub / "vectors")
    rel = tmp_path / "b" / "vectors" / "h2o.json"
    doc = json.loads(rel.read_text())
    case = next(c for g in doc["groups"] for c in g["cases"]
                if c["dtype"] == "float32" and "h2o_accumulated" in c["inputs"].get("fields", {}))
    field = case["inputs"]["fields"]["h2o_accumulated"]
    assert field["dtype"] == "float64"
    field["data"] = [x * (1 + 3e-8) if isinstance(x, float) else x for x in field["data"]]
    rel.write_text(json.dumps(doc))
    diff = regeneration_differences(tmp_path / "a", tmp_path / "b")
    moved = [f for f in diff.floats if f[0].endswith("h2o_accumulated")]
    assert moved and all(f[2] == "float32" for f in moved)
    assert not [f for f in diff.beyond(REGENERATION_BOUND) if f[0].endswith("h2o_accumulated")]
