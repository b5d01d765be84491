"""Issue 33 C: the candidate reader refuses what it cannot judge, in one line naming the file and array.

Each test starts from a candidate that passes and changes one thing the checker used to pass
silently (NaN or complex rows, a fractional or huge count) or refuse with a raw error
(a matmul shape error, "could not convert string to float"). Through the CLI the file FAILs
(exit 1) with one line ``refused: <file>: <array>: ...``; through the Python API the
validation raises a ``ValueError`` with the same line.
"""

from __future__ import annotations

import io
import json
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refkv import Engine, policies
from refkv.cli import main
from refkv.model import builtin_model
from refkv.oracle.candidates import (
    CandidateError,
    validate_candidate,
    validate_schedule_candidate,
)
from refkv.oracle.cases import compare_case
from refkv.oracle.endtoend import read_end_to_end, write_end_to_end
from refkv.oracle.models import decode_tokens, prompt_tokens
from refkv.oracle.recorder import run_schedule_golden
from refkv.oracle.rounds import compare_schedule
from refkv.oracle.walk import compare_end_to_end
from refkv.schedule import Schedule, run_schedule
from refkv.testing import load_cases

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SCHED = Schedule(None, None, 4, 16, new_tokens=12)
HEADER = {"schema": "refkv-e2e", "schema_version": 2, "refkv_version": "x", "numpy_version": "y"}


def _rows(sched=SCHED, policy="keydiff"):
    """A correct candidate's arrays from refkv itself: kept rows, their keys and values, logits."""
    model = builtin_model(seed=0, dtype=np.float64)
    engine = Engine(model, policies.get(policy))
    prompt = prompt_tokens(1, 24, model.config.vocab_size)
    new = decode_tokens(2, sched.new_tokens, model.config.vocab_size)
    rows, keys, values = [], [], []

    def on_step(step, rnd):
        if rnd is not None:
            rows.append([c.positions.copy() for c in engine.caches])
            keys.append([c.keys.copy() for c in engine.caches])
            values.append([c.values.copy() for c in engine.caches])

    logits, _ = run_schedule(engine, prompt, new, sched, on_step=on_step)
    kept = np.array(rows)
    return {"kept": kept, "kept_count": np.full(kept.shape[:2], kept.shape[3], dtype=np.int64),
            "row_keys": np.array(keys), "row_values": np.array(values), "logits": logits}


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """A keydiff schedule golden (tiny model) in a reference folder, and a correct candidate's arrays."""
    m, a = run_schedule_golden(policies.get("keydiff"), SCHED)
    root = tmp_path_factory.mktemp("ref")
    (root / "e2e" / "keydiff").mkdir(parents=True)
    write_end_to_end(root / "e2e" / "keydiff" / "sched.json", m, a)
    cand = _rows()
    cand["scores"], cand["score_positions"] = a["scores"].copy(), a["candidates"].copy()
    assert compare_schedule(cand, a, m).ok
    return root, m, a, cand


def write_candidate(folder: Path, arrays: dict) -> Path:
    """A candidate schedule file with ANY arrays (complex, strings: what ``write_npz`` refuses to write)."""
    target = folder / "e2e" / "keydiff"
    target.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, a in arrays.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, np.asarray(a), allow_pickle=False)
            zf.writestr(f"{name}.npy", member.getvalue())
    (target / "sched.npz").write_bytes(buf.getvalue())
    contents = {n: {"dtype": np.asarray(a).dtype.name, "shape": list(np.shape(a))} for n, a in arrays.items()}
    (target / "sched.json").write_text(json.dumps({**HEADER, "arrays": {"file": "sched.npz", "contents": contents}}))
    return target / "sched.npz"


def check_cli(capsys, candidate_dir, reference_dir) -> tuple[int, str]:
    code = main(["golden", "check", str(candidate_dir), "--against", str(reference_dir)])
    out = capsys.readouterr()
    return code, out.out + out.err


def refusal_line(out: str) -> str:
    """The report's one failure line for the file (``refused: ...``)."""
    lines = [ln.strip() for ln in out.splitlines() if "refused:" in ln]
    assert len(lines) == 1, out
    return lines[0]


def _changed(cand: dict, name: str, value) -> dict:
    out = {k: np.array(v, copy=True) for k, v in cand.items()}
    out[name] = value
    return out


def _with(cand, name, index, value, dtype=None):
    a = np.array(cand[name], dtype=dtype or np.asarray(cand[name]).dtype, copy=True)
    a[index] = value
    return _changed(cand, name, a)


# -- the known silent passes and unclear messages, through the CLI and the API ----------------------------------
def _nan_one(c):
    return _with(c, "row_keys", (0, 1, 0, 3, 5), np.nan)


def _nan_head(c):
    return _with(c, "row_values", (0, 1, 1), np.nan)


def _nan_all(c):
    return _changed(c, "row_keys", np.full_like(c["row_keys"], np.nan))


def _complex(c):
    return _changed(c, "row_keys", c["row_keys"] + 1e-3j)


def _eight_and_a_half(c):
    return _with(c, "kept_count", (0, 1), 8.5, np.float64)


def _nan_count(c):
    return _with(c, "kept_count", (0, 1), np.nan, np.float64)


def _wide(c):
    return _changed(c, "row_keys", np.concatenate([c["row_keys"], c["row_keys"][..., :1]], axis=-1))


def _strings(c):
    return _changed(c, "row_keys", c["row_keys"].astype(str))


CASES = [
    ("nan one element", _nan_one, "row_keys: 1 NaN value (round 0, layer 1, head 0, row 3); a candidate's floats "
                                  "must be finite"),
    ("nan one head", _nan_head, "row_values: {head} NaN values (first at round 0, layer 1, head 1, row 0); a "
                                "candidate's floats must be finite"),
    ("nan everywhere", _nan_all, "row_keys: {all} NaN values (first at round 0, layer 0, head 0, row 0); a "
                                 "candidate's floats must be finite"),
    ("complex", _complex, "row_keys: complex values (dtype complex128); a candidate's arrays must be real"),
    ("kept_count 8.5", _eight_and_a_half, "kept_count: fractional value 8.5 (round 0, layer 1); counts must be "
                                          "integers"),
    ("kept_count NaN", _nan_count, "kept_count: nan (round 0, layer 1); counts must be integers"),
    ("row_keys one column too wide", _wide, "row_keys: shape (3, 4, 2, 16, {d1}), expected (round 3, layer 4, "
                                            "head 2, row 16, d_head {d})"),
    ("string row_keys", _strings, "row_keys: dtype <U"),
]


@pytest.mark.parametrize("label, mutate, message", CASES, ids=[c[0] for c in CASES])
def test_a_candidate_the_checker_cannot_judge_fails_in_one_line_naming_file_and_array(
        label, mutate, message, golden, capsys, tmp_path):
    root, m, a, cand = golden
    r, l, hkv, k, d = cand["row_keys"].shape
    assert (r, l, hkv, k) == (3, 4, 2, 16)  # three rounds of the tiny model's 4 layers, 2 KV heads, N = 16
    message = message.format(head=k * d, all=r * l * hkv * k * d, d=d, d1=d + 1)
    bad = mutate(cand)
    # the API: one ValueError line, before any comparison
    with pytest.raises(ValueError) as err:
        validate_schedule_candidate(bad, a, m, source="cand.npz")
    text = str(err.value)
    assert "\n" not in text and text.startswith("cand.npz: " + message), text
    # the CLI: the file FAILs, exit 1, one line naming the candidate's file and the array
    npz = write_candidate(tmp_path / "cand", bad)
    code, out = check_cli(capsys, tmp_path / "cand", root)
    assert code == 1, out
    line = refusal_line(out)
    assert line.startswith(f"refused: {npz}: {message}"), line
    assert "Traceback" not in out and "PASS" not in out


def test_the_correct_candidate_passes_from_its_file(golden, capsys, tmp_path):
    """The fixture's candidate, through the same file writer, passes: the refusals above are the mutations'."""
    root, _, _, cand = golden
    write_candidate(tmp_path / "cand", cand)
    code, out = check_cli(capsys, tmp_path / "cand", root)
    assert code == 0, out


def test_adakv_kept_count_of_2_to_the_62_fails(capsys, tmp_path):
    """AdaKV's pooled heads read each row up to the candidate's count: 2**62 used to slice whole rows and pass."""
    adakv = policies.get("adakv", base="snapkv", base_params={"window": 4})
    m, a = run_schedule_golden(adakv, Schedule(None, 12, 1, 12, new_tokens=0))
    (tmp_path / "ref" / "e2e" / "keydiff").mkdir(parents=True)
    write_end_to_end(tmp_path / "ref" / "e2e" / "keydiff" / "sched.json", m, a)
    cand = {"kept": a["kept"], "kept_count": a["kept_count"].copy(), "logits": a["logits"]}
    assert compare_schedule(cand, a, m).ok
    cand["kept_count"][0, 0] = 2 ** 62
    width = a["kept"].shape[3]
    message = (f"kept_count: value {2 ** 62} (round 0, layer 0) out of range; counts must be integers in "
               f"[0, {width}]")
    with pytest.raises(ValueError, match=r"^" + __import__("re").escape(message) + "$"):
        validate_schedule_candidate(cand, a, m)
    npz = write_candidate(tmp_path / "cand", cand)
    code, out = check_cli(capsys, tmp_path / "cand", tmp_path / "ref")
    assert code == 1 and refusal_line(out) == f"refused: {npz}: {message}", out


@pytest.mark.parametrize("position, expected", [(-2, "value -2"), (36, "value 36")])
def test_positions_must_lie_in_minus_one_to_the_tokens_seen(golden, position, expected):
    """Round 0 had seen 28 tokens (positions 0..27); round 2 36 (0..35); -1 pads."""
    _, m, a, cand = golden
    r = 2 if position == 36 else 0
    bad = _with(cand, "kept", (r, 0, 0, 0), position)
    top = int(a["round_position"][r]) - 1
    with pytest.raises(CandidateError, match=rf"^kept: {expected} \(round {r}, layer 0, head 0, row 0\) out of "
                                             rf"range; positions must be integers in \[-1, {top}\]$"):
        validate_schedule_candidate(bad, a, m)
    assert a["round_position"].tolist() == [28, 32, 36]  # 24 prompt tokens, rounds every 4 decoded


def test_integral_floats_are_accepted_and_converted(golden):
    _, m, a, cand = golden
    as_floats = _changed(cand, "kept_count", cand["kept_count"].astype(np.float64))
    as_floats["kept"] = cand["kept"].astype(np.float32)
    out = validate_schedule_candidate(as_floats, a, m)
    assert out["kept"].dtype == np.int64 and out["kept_count"].dtype == np.int64
    assert compare_schedule(out, a, m).ok


def test_scores_need_their_positions_and_must_be_finite_where_scored(golden):
    _, m, a, cand = golden
    lone = {k: v for k, v in cand.items() if k != "score_positions"}
    with pytest.raises(CandidateError, match="scores and score_positions go together"):
        validate_schedule_candidate(lone, a, m)
    bad = _with(cand, "scores", (1, 2, 0, 4), np.inf)
    with pytest.raises(CandidateError, match=r"^scores: 1 infinite value \(round 1, layer 2, head 0, candidate 4\)"):
        validate_schedule_candidate(bad, a, m)
    # declared kept_only: scores are not compared, so not judged either
    assert validate_schedule_candidate(bad, a, m, declare={"kept_only": True})["scores"] is not None
    # NaN in the padding (score_positions -1) is not judged
    pad = np.argwhere(a["candidates"] < 0)
    if pad.size:
        validate_schedule_candidate(_with(cand, "scores", tuple(pad[0]), np.nan), a, m)


def test_nan_in_a_padding_row_is_not_judged(golden):
    """A row past kept_count (or holding -1) is never compared, so what it holds is not refused."""
    _, m, a, cand = golden
    wide = {k: np.array(v, copy=True) for k, v in cand.items()}
    pad = np.full((*cand["kept"].shape[:3], 1), -1)
    wide["kept"] = np.concatenate([cand["kept"], pad], axis=3)
    for name in ("row_keys", "row_values"):
        wide[name] = np.concatenate([cand[name], np.full((*pad.shape, cand[name].shape[-1]), np.nan)], axis=3)
    validate_schedule_candidate(wide, a, m)


def test_the_candidates_own_state_is_validated_when_given(golden):
    _, m, a, cand = golden
    r, l, hkv, c = a["candidates"].shape
    d, h = m["model"]["config"]["d_head"], m["model"]["config"]["n_heads"]
    state = {"state_positions": a["candidates"], "state_keys": np.zeros((r, l, hkv, c, d)),
             "state_values": np.zeros((r, l, hkv, c, d)), "state_queries": np.zeros((r, l, h, 4, d))}
    ok = validate_schedule_candidate({**cand, **state}, a, m)
    assert ok["state_positions"].dtype == np.int64
    col = int(np.flatnonzero(a["candidates"][0, 0, 0] >= 0)[0])
    with pytest.raises(CandidateError, match=rf"^state_keys: 1 NaN value \(round 0, layer 0, head 0, row {col}\)"):
        validate_schedule_candidate({**cand, **_with(state, "state_keys", (0, 0, 0, col, 0), np.nan)}, a, m)
    with pytest.raises(CandidateError, match=rf"^state_queries: shape \(3, 4, 2, 4, {d}\), expected \(round 3, "
                                             rf"layer 4, query head {h}, query \*, d_head {d}\)"):
        validate_schedule_candidate({**cand, **state, "state_queries": np.zeros((r, l, hkv, 4, d))}, a, m)
    with pytest.raises(CandidateError, match="state_values: given without state_positions"):
        validate_schedule_candidate({**cand, "state_values": state["state_values"]}, a, m)
    with pytest.raises(CandidateError, match=r"^state_values: 1 infinite value"):
        validate_schedule_candidate({**cand, **_with(state, "state_values", (0, 0, 0, col, 0), -np.inf)}, a, m)


def test_compare_schedule_itself_refuses_nan_rows(golden):
    _, m, a, cand = golden
    with pytest.raises(ValueError, match="row_keys: 1 NaN value"):
        compare_schedule(_nan_one(cand), a, m)


# -- the other kinds: end-to-end per block and final only, vectors cases -----------------------------------
@pytest.fixture(scope="module")
def e2e_golden():
    g = read_end_to_end(GOLDEN / "e2e" / "h2o" / "N8-B4-float64.json")
    return g.manifest, g.arrays


def test_end_to_end_candidates_are_refused_in_one_line(e2e_golden, capsys, tmp_path):
    m, a = e2e_golden
    good = {"kept": a["kept"], "kept_count": a["kept_count"], "logits": a["logits"]}
    assert compare_end_to_end(good, a, m).ok
    with pytest.raises(ValueError, match=r"^logits: 1 NaN value \(token id 7\); a candidate's floats must be "
                                         r"finite$"):
        compare_end_to_end(_with(good, "logits", 7, np.nan), a, m)
    with pytest.raises(ValueError, match=r"^kept_count: fractional value 2.5 \(block 1, layer 0\)"):
        compare_end_to_end(_with(good, "kept_count", (1, 0), 2.5, np.float64), a, m)
    width = a["kept"].shape[3]
    with pytest.raises(ValueError, match=rf"^kept_count: value 9 \(block 0, layer 1\) out of range; counts must be "
                                         rf"integers in \[0, {width}\]$"):
        compare_end_to_end(_with(good, "kept_count", (0, 1), 9), a, m)
    with pytest.raises(ValueError, match=r"^kept: complex values"):
        compare_end_to_end(_changed(good, "kept", a["kept"] + 0j), a, m)
    # the final-only form reads the last block's cache: same rules
    final = {"kept": a["kept"][-1], "kept_count": a["kept_count"][-1], "logits": a["logits"]}
    assert compare_end_to_end(final, a, m, final_only=True).ok
    with pytest.raises(ValueError, match=r"^kept: fractional value 0.5 \(layer 0, head 0, row 0\)"):
        validate_candidate("final", _with(final, "kept", (0, 0, 0), 0.5, np.float64), a, m)
    # from a file: the suite check names the candidate's npz
    rel = Path("e2e") / "h2o" / "N8-B4-float64"
    (tmp_path / "ref" / rel.parent).mkdir(parents=True)
    (tmp_path / "cand" / rel.parent).mkdir(parents=True)
    write_end_to_end(tmp_path / "ref" / rel.with_suffix(".json"), m, a)
    write_end_to_end(tmp_path / "cand" / rel.with_suffix(".json"), HEADER | {"schema_version": 1},
                     _with(good, "logits", 3, np.inf))
    code, out = check_cli(capsys, tmp_path / "cand", tmp_path / "ref")
    npz = tmp_path / "cand" / rel.with_suffix(".npz")
    assert code == 1 and refusal_line(out) == (f"refused: {npz}: logits: 1 infinite value (token id 3); a "
                                               f"candidate's floats must be finite"), out


def test_vectors_candidates_are_refused_in_one_line(capsys, tmp_path):
    case = load_cases(GOLDEN, policy="keydiff", dtype="float64")[0]
    out = case.outputs
    assert compare_case({"scores": out["scores"], "kept": out["kept"]}, case).ok
    scores = out["scores"].copy()
    scores[0, 2] = np.nan
    with pytest.raises(ValueError, match=r"^scores: 1 NaN value \(head 0, column 2\); a candidate's floats must be "
                                         r"finite$"):
        compare_case({"scores": scores}, case)
    # a declared kept_only candidate's scores are not compared: not judged
    assert compare_case({"scores": scores, "kept": out["kept"]}, case, declare={"kept_only": True}).ok
    with pytest.raises(ValueError, match=r"^scores: complex values"):
        compare_case({"scores": out["scores"] + 0j}, case)
    with pytest.raises(ValueError, match=r"^kept: fractional value 1.5 \(head 0, row 0\)"):
        compare_case({"kept": np.full(out["kept"].shape, 1.5)}, case)
    with pytest.raises(ValueError, match=r"^protected: dtype float64 with values other than 0 and 1"):
        compare_case({"protected": np.full(out["protected"].shape, 0.5)}, case)
    # from a file (JSON encodes NaN as the string "nan"): the case fails, naming the file and the case
    from refkv.oracle.encode import candidate_document
    from refkv.oracle.io import write_json
    doc = candidate_document("keydiff", {case.id: {"scores": scores, "kept": out["kept"]}})
    (tmp_path / "cand" / "vectors").mkdir(parents=True)
    write_json(tmp_path / "cand" / "vectors" / "keydiff.json", doc)
    code = main(["golden", "check", str(tmp_path / "cand"), "--against", str(GOLDEN), "--policies", "keydiff",
                 "--kind", "vectors", "--case-dtype", "float64"])
    text = capsys.readouterr().out
    assert code == 1, text
    line = refusal_line(text)
    assert line.startswith(f"{case.label}: refused: {tmp_path / 'cand' / 'vectors' / 'keydiff.json'}: case "
                           f"{case.id}: scores: 1 NaN value (head 0, column 2)"), line


# -- fuzz: any mutation of a valid candidate file is refused cleanly, never a traceback, never a pass -----------
MUTATIONS = ("nan", "inf", "complex", "string", "bool", "drop_axis", "extra_column", "fractional", "huge",
             "below_minus_one")
ARRAYS = ("kept", "kept_count", "logits", "row_keys", "row_values", "scores", "score_positions")
COUNTS = ("kept", "kept_count", "score_positions")


def _judged_index(name, cand, draw_index):
    """An element the comparison reads (a held row, a real score position), so a bad value there must be refused."""
    if name in ("row_keys", "row_values"):
        held = np.argwhere(cand["kept"] >= 0)
    elif name == "scores":
        held = np.argwhere(cand["score_positions"] >= 0)
    else:
        held = np.argwhere(np.ones(np.shape(cand[name]), dtype=bool))
    return tuple(held[draw_index % len(held)])


def _mutate(cand, name, mutation, pick):
    a = np.asarray(cand[name])
    index = _judged_index(name, cand, pick)
    if mutation in ("nan", "inf", "fractional", "huge", "below_minus_one"):
        value = {"nan": np.nan, "inf": -np.inf, "fractional": 0.5, "huge": 2.0 ** 62, "below_minus_one": -7}[mutation]
        if name not in COUNTS and mutation in ("fractional", "below_minus_one"):
            value = np.nan  # a float array: any real value is judgeable, so break it
        if name not in COUNTS and mutation == "huge":
            value = np.inf
        return _with(cand, name, index, value, np.float64)
    if mutation == "complex":
        return _changed(cand, name, a + 1j)
    if mutation == "string":
        return _changed(cand, name, a.astype(str))
    if mutation == "bool":
        return _changed(cand, name, a != 0)
    if mutation == "drop_axis":
        return _changed(cand, name, a[..., 0] if a.ndim > 1 else a[:, None])
    return _changed(cand, name, np.concatenate([a, a[..., :1]], axis=-1) if name != "kept" else a[:-1])


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=st.sampled_from(ARRAYS), mutation=st.sampled_from(MUTATIONS), pick=st.integers(0, 10 ** 6))
def test_fuzz_any_broken_array_is_refused_cleanly(golden, capsys, name, mutation, pick):
    root, _, _, cand = golden
    bad = _mutate(cand, name, mutation, pick)
    with tempfile.TemporaryDirectory() as tmp:
        npz = write_candidate(Path(tmp), bad)
        code, out = check_cli(capsys, tmp, root)
    assert code == 1, (name, mutation, out)
    assert "Traceback" not in out
    line = refusal_line(out)
    assert line.startswith(f"refused: {npz}: "), line
    # the array named is the one broken (a count's problem may be caught on the array it bounds)
    named = line.split(": ")[2]
    assert named == name or (name, named) == ("score_positions", "scores"), (mutation, line)
