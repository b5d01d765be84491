"""kvpress's deployments (issue 22 F): scorers under their wrappers, round by round, on refkv's schedule goldens.

Only the public adapter (:func:`refkv.interop.kvpress.write_candidates`) and the CLI
(``refkv golden check``) are used: each press runs through transformers on the tiny
model's exported weights, and the check compares every round's kept positions (as sets),
the key and value each cache row holds, the press's scores and the final logits.

Decoding wrappers run on the committed schedule goldens (``tests/golden``); the prefill
wrappers on prefill-only schedule goldens made here. Every outcome is asserted: a press
that matches must pass, a difference by design must fail the way it is described, and a
kvpress defect is a strict expected failure with its minimal reproduction.
"""

import os
import pathlib

import pytest

torch = pytest.importorskip("torch", reason="the kvpress interop tests need torch: pip install 'refkv[interop]'")
kvpress = pytest.importorskip("kvpress", reason="the kvpress interop tests need kvpress: pip install 'refkv[interop]'")
pytest.importorskip("transformers", reason="needs transformers: pip install 'refkv[interop]'")

from refkv import policies  # noqa: E402
from refkv.cli import main  # noqa: E402
from refkv.interop.kvpress import write_candidates  # noqa: E402
from refkv.oracle.endtoend import write_end_to_end  # noqa: E402
from refkv.oracle.recorder import run_schedule_golden  # noqa: E402
from refkv.schedule import Schedule  # noqa: E402

torch.set_num_threads(1)
#: Where the presses run: ``REFKV_TEST_DEVICE=cuda`` runs them on a GPU (the outcomes asserted are
#: the CPU's; a GPU run shows where its kernels' arithmetic decides differently).
DEVICE = os.environ.get("REFKV_TEST_DEVICE", "cpu")
GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"

SCORERS = {"keydiff": lambda: kvpress.KeyDiffPress(), "knorm": lambda: kvpress.KnormPress()}  # prefill wrappers
DECODING = {
    "DecodingPress": lambda s: kvpress.DecodingPress(s()),
    "PrefillDecodingPress": lambda s: kvpress.PrefillDecodingPress(s(), kvpress.DecodingPress(s())),
    "CompressionRatioDecodingPress": lambda s: kvpress.CompressionRatioDecodingPress(s()),
}
#: The seven scorer presses run under every decoding wrapper: press -> (refkv policy, make, write options).
DECODING_SCORERS = {
    "KeyDiffPress": ("keydiff", lambda: kvpress.KeyDiffPress(), {}),
    "KnormPress": ("knorm", lambda: kvpress.KnormPress(), {}),
    # refkv's sink scores nothing: only the kept sets are compared
    "StreamingLLMPress": ("sink", lambda: kvpress.StreamingLLMPress(n_sink=4), {"declare": {"kept_only": True}}),
    # fitted to the golden's snapkv: window_size 32, kernel_size 7 (refkv's defaults)
    "SnapKVPress": ("snapkv", lambda: kvpress.SnapKVPress(), {}),
    # TOVA is refkv's tova all_heads=True and ObservedAttention h2o recent=0: the committed goldens' tova and h2o
    # are the defaults (all_heads=False, recent=None), which the adapter skips unless asked (other_options)
    "TOVAPress": ("tova", lambda: kvpress.TOVAPress(), {"other_options": True}),
    "ObservedAttentionPress": ("h2o", lambda: kvpress.ObservedAttentionPress(), {"other_options": True}),
    "ExpectedAttentionPress": ("expected_attention", lambda: kvpress.ExpectedAttentionPress(), {}),
}


def _check(candidate, reference, policy, *extra) -> int:
    return main(["golden", "check", str(candidate), "--against", str(reference), "--kind", "e2e",
                 "--policies", policy, "--allow-missing", "--case-dtype", "all", "--verbose", *extra])


def _run(press, reference, tmp_path, policy, capsys, dtype="float32", **kwargs):
    out = write_candidates(press, reference, tmp_path / "candidate", policy=policy, dtype=dtype, progress=None,
                           device=DEVICE, **kwargs)
    assert out["written"], out["skipped"]
    capsys.readouterr()
    code = _check(tmp_path / "candidate", reference, policy, "--dtype", dtype)
    return code, capsys.readouterr().out, out


def test_decoding_press_in_bfloat16(tmp_path, capsys):
    code, report, _ = _run(kvpress.DecodingPress(kvpress.KeyDiffPress()), GOLDEN, tmp_path, "keydiff", capsys,
                           dtype="bfloat16", golden_dtype="float32")
    assert code == 0, report


def test_a_wrong_press_is_located_at_its_first_round(tmp_path, capsys):
    """Knorm's decisions offered as KeyDiff's: the report names the round, layer, head and kind."""
    out = write_candidates(kvpress.DecodingPress(kvpress.KnormPress()), GOLDEN, tmp_path / "c", policy="keydiff",
                           progress=None, device=DEVICE)
    assert out["written"]
    capsys.readouterr()
    assert _check(tmp_path / "c", GOLDEN, "keydiff") == 1
    report = capsys.readouterr().out
    assert "first diverged at round 0 (decode step 4, 28 tokens seen, budget 16): kept-set difference beyond ties" \
        in report
    assert "more divergence(s):" in report


# -- the StreamingLLM defect under decoding ---------------------------------------------------------------
STREAMING_REPRO = """\
import torch
from types import SimpleNamespace
from kvpress import StreamingLLMPress

press = StreamingLLMPress(compression_ratio=0.5, n_sink=2)
pos = torch.arange(8.0).reshape(1, 1, 8, 1)  # each row holds its position
keys, values = press.compress(SimpleNamespace(head_dim=1), None, pos, pos, None, {})  # rows 1, 7, 6, 0
new = torch.arange(8.0, 12.0).reshape(1, 1, 4, 1)  # four more tokens, then compress again
keys, values = press.compress(SimpleNamespace(head_dim=1), None, torch.cat([keys, new], 2),
                              torch.cat([values, new], 2), None, {})
assert sorted(values.flatten().tolist()) == [0.0, 1.0, 10.0, 11.0], values.flatten()  # got 1, 7, 10, 11
"""
STREAMING_DEFECT = ("StreamingLLMPress keeps the first n_sink and last rows of the cache, but ScorerPress.compress "
                    "leaves rows in topk order, so from the second compression on (DecodingPress, "
                    "PrefillDecodingPress) it keeps whichever tokens topk left in those rows: recent-window tokens "
                    "are evicted and older ones kept instead, and the sink tokens where topk moved them out of the "
                    "first rows")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=f"kvpress 0.5.5 defect: {STREAMING_DEFECT}")
def test_streaming_llm_defect_minimal_reproduction():
    exec(compile(STREAMING_REPRO, "<StreamingLLMPress repro>", "exec"), {})


# -- prefill wrappers on prefill-only schedule goldens ------------------------------------------------------
@pytest.fixture(scope="module")
def prefill_goldens(tmp_path_factory):
    """One-shot prefill of 48 tokens to N = 16 and no decoding, float32, per scorer's policy."""
    root = tmp_path_factory.mktemp("prefill-goldens")
    for policy in SCORERS:
        folder = root / "e2e" / policy
        folder.mkdir(parents=True)
        m, a = run_schedule_golden(policies.get(policy), Schedule(None, 16, 1, 16, new_tokens=0), dtype="float32",
                                   prompt_length=48)
        write_end_to_end(folder / "prefill-N16.json", m, a)
    return root


PREFILL = {  # wrapper -> (make, write_candidates options, expected: "pass" or the failure's words)
    "bare": (lambda s: s, {}, "pass"),
    "PerLayerCompressionPress": (lambda s: kvpress.PerLayerCompressionPress(s, [0.5] * 4), {}, "pass"),
    # re-rotated keys by design: kept sets compared, not the keys or the logits
    "KeyRerotationPress": (lambda s: kvpress.KeyRerotationPress(s), {"row_keys": False,
                                                                     "declare": {"kept_only": True}}, "pass"),
    # chunks compressed one by one, each rounding its own share down: 3 x int(16 * 0.34) = 15 tokens, not 16
    "ChunkPress": (lambda s: kvpress.ChunkPress(s, chunk_length=16), {}, "kept count differs"),
}


@pytest.mark.parametrize("wrapper", list(PREFILL))
@pytest.mark.parametrize("scorer", list(SCORERS))
def test_prefill_wrappers(scorer, wrapper, prefill_goldens, tmp_path, capsys):
    make, options, expected = PREFILL[wrapper]
    code, report, _ = _run(make(SCORERS[scorer]()), prefill_goldens, tmp_path, scorer, capsys, **options)
    if expected == "pass":
        assert code == 0, report
    else:
        assert code == 1 and expected in report, report


def test_block_press_is_one_shot_for_independent_scores_only(prefill_goldens, tmp_path, capsys):
    """BlockPress selects block by block: Knorm's per-token score gives the one-shot set, KeyDiff's
    set-dependent anchor does not (it is block prompt processing's selection over one-shot attention)."""
    code, report, _ = _run(kvpress.BlockPress(kvpress.KnormPress(), block_size=8), prefill_goldens, tmp_path / "k",
                           "knorm", capsys)
    assert code == 0, report
    code, report, _ = _run(kvpress.BlockPress(kvpress.KeyDiffPress(), block_size=8), prefill_goldens,
                           tmp_path / "d", "keydiff", capsys)
    assert code == 1 and "kept-set difference beyond ties" in report


# -- the seven scorers under the three decoding wrappers ------------------------------------------------------
_ROUND0 = "first diverged at round 0 (decode step 4, 28 tokens seen, budget {}): {}".format
_STREAMING = ("kvpress defect (rows in score order from the second round: recent-window tokens evicted, sink "
              "tokens too where topk moved them)",
              "first diverged at round 1 (decode step {}, {} tokens seen, budget 16): protected position evicted")
_TOVA = "differs by design (the current query over all heads: tova all_heads=True; the current token always kept)"
_OBSERVED = "kvpress defect (one query's weights divided by n - j; H2O accumulates)"
_NAN = "kvpress defect (NaN scores: an interval <= n_sink leaves no query)"
_WINDOW = "should be greater than the window size 32"
#: ``(press, wrapper) -> (the table's status, expected)``: expected is "pass", a words of the check's
#: report, or ``error: `` and the words of the error the press raises.
DECODING_OUTCOMES = {
    **{(p, w): ("matches", "pass") for p in ("KeyDiffPress", "KnormPress") for w in DECODING},
    # the defect of test_streaming_llm_defect_minimal_reproduction: right at the first compression (the
    # prefill's, under PrefillDecodingPress), wrong from the second
    ("StreamingLLMPress", "DecodingPress"): (_STREAMING[0], _STREAMING[1].format(8, 32)),
    ("StreamingLLMPress", "PrefillDecodingPress"): (_STREAMING[0], _STREAMING[1].format(16, 40)),
    ("StreamingLLMPress", "CompressionRatioDecodingPress"): (_STREAMING[0], _STREAMING[1].format(8, 32)),
    ("SnapKVPress", "DecodingPress"): ("cannot run (rounds of 4 queries are shorter than its window of 32)",
                                       f"error: Query length 4 {_WINDOW}"),
    ("SnapKVPress", "PrefillDecodingPress"): ("cannot run (rounds of 16 queries are shorter than its window of 32)",
                                              f"error: Query length 16 {_WINDOW}"),
    ("SnapKVPress", "CompressionRatioDecodingPress"): ("cannot run (rounds of 4 queries are shorter than its "
                                                       "window of 32)", f"error: Query length 4 {_WINDOW}"),
    # scores the current token's query (the last buffered state) averaged over ALL query heads (refkv's
    # all_heads=True, not its default group mean) and pads the current token with max+1: always kept; at
    # PrefillDecodingPress's prefill the last prompt token's query and padding
    ("TOVAPress", "DecodingPress"): (_TOVA, _ROUND0(16, "kept-set difference beyond ties")),
    ("TOVAPress", "PrefillDecodingPress"): (
        "differs by design (at the prefill already: the last token's query over all heads, the last token "
        "always kept)", "first diverged at round 0 (prefill step 0, 24 tokens seen, budget 16): kept-set "
        "difference beyond ties"),
    ("TOVAPress", "CompressionRatioDecodingPress"): (_TOVA, _ROUND0(14, "kept-set difference beyond ties")),
    # eager: the current step's weights only (one query), not H2O's accumulated sums, divided by n - j; at
    # PrefillDecodingPress's prefill the sums over the prompt divided by n - j and no recent window (the
    # committed goldens' h2o has recent=None: half the budget)
    ("ObservedAttentionPress", "DecodingPress"): (_OBSERVED, _ROUND0(16, "kept-set difference beyond ties")),
    ("ObservedAttentionPress", "PrefillDecodingPress"): (
        "differs by design at the prefill (no recent window: the golden's h2o protects the last N // 2 = 8 "
        "tokens; sums divided by n - j); the decoding rounds then have DecodingPress's defect",
        "first diverged at round 0 (prefill step 0, 24 tokens seen, budget 16): protected position evicted"),
    ("ObservedAttentionPress", "CompressionRatioDecodingPress"): (_OBSERVED,
                                                                 _ROUND0(14, "kept-set difference beyond ties")),
    # the query statistics drop the first n_sink = 4 buffered states (refkv: the queries at positions >=
    # n_sink): at an interval of 4 none is left (NaN); at 16 twelve, so the prefill matches and round 1 differs
    # (the NaN scores are refused before any comparison, whatever topk then kept among them on the device)
    ("ExpectedAttentionPress", "DecodingPress"): (_NAN, "a candidate's floats must be finite"),
    ("ExpectedAttentionPress", "PrefillDecodingPress"): (
        "kvpress defect (the query statistics drop a round's first n_sink = 4 queries: the prefill matches, "
        "the first decoding round differs)", "first diverged at round 1 (decode step 16, 40 tokens seen, budget "
        "16): kept-set difference beyond ties"),
    ("ExpectedAttentionPress", "CompressionRatioDecodingPress"): (_NAN, "a candidate's floats must be finite"),
}


@pytest.fixture(scope="module")
def snapkv_ratio_golden(tmp_path_factory):
    """The committed goldens hold no ratio schedule of snapkv: the keydiff one's (every 4 tokens to half the
    tokens seen), made for snapkv on a 64-token prompt (refkv's snapkv window of 32 needs budgets above 32)."""
    root = tmp_path_factory.mktemp("snapkv-ratio")
    (root / "e2e" / "snapkv").mkdir(parents=True)
    m, a = run_schedule_golden(policies.get("snapkv"), Schedule(None, None, 4, None, new_tokens=12, rule="ratio",
                                                                 ratio=0.5), dtype="float32", prompt_length=64)
    write_end_to_end(root / "e2e" / "snapkv" / "sched-oneshot-K4-ratio0.5-float32.json", m, a)
    return root


@pytest.mark.parametrize(("press", "wrapper"), [pytest.param(*k, id="-".join(k)) for k in DECODING_OUTCOMES])
def test_decoding_wrappers(press, wrapper, request, tmp_path, capsys):
    """Each scorer under each decoding wrapper, every round: matches, or fails the way its status says."""
    policy, make, options = DECODING_SCORERS[press]
    _, expected = DECODING_OUTCOMES[press, wrapper]
    snapkv_ratio = (press, wrapper) == ("SnapKVPress", "CompressionRatioDecodingPress")
    reference = request.getfixturevalue("snapkv_ratio_golden") if snapkv_ratio else GOLDEN
    if expected.startswith("error: "):
        with pytest.raises(AssertionError, match=expected.removeprefix("error: ")):
            write_candidates(DECODING[wrapper](make), reference, tmp_path, policy=policy, progress=None, device=DEVICE,
                             **options)
        return
    code, report, out = _run(DECODING[wrapper](make), reference, tmp_path, policy, capsys, **options)
    # each wrapper runs the goldens of its own schedule and says why it skips the others
    assert all("kvpress treats a second prompt block as decoding" in why or "golden" in why
               for why in out["skipped"].values())
    if expected == "pass":
        assert code == 0, report
        assert "rows' keys checked" in report and " 0 rows' keys checked" not in report
    else:
        assert code == 1 and expected in report, report


def test_why_tova_and_expected_attention_differ_at_round_0(tmp_path):
    """The reasons of :data:`DECODING_OUTCOMES`, read from the candidates: TOVA keeps the token just fed in every layer
    and head at every round; ExpectedAttention's scores are all NaN at every round."""
    from refkv.oracle.endtoend import read_end_to_end

    out = write_candidates(kvpress.DecodingPress(kvpress.TOVAPress()), GOLDEN, tmp_path / "t", policy="tova",
                           golden_dtype="float32", progress=None, device=DEVICE, other_options=True)
    (path,) = out["written"]
    tova = read_end_to_end(path, candidate=True).arrays
    golden = read_end_to_end(GOLDEN / pathlib.Path(path).relative_to(tmp_path / "t")).arrays
    current = golden["round_position"] - 1                                                  # (R,) token just fed
    assert (tova["kept"] == current[:, None, None, None]).any(axis=-1).all()
    out = write_candidates(kvpress.DecodingPress(kvpress.ExpectedAttentionPress()), GOLDEN, tmp_path / "e",
                           policy="expected_attention", golden_dtype="float32", progress=None, device=DEVICE)
    (path,) = out["written"]
    scores = read_end_to_end(path, candidate=True).arrays["scores"]  # (R, L, Hkv, C)
    assert scores.size and torch.isnan(torch.from_numpy(scores)).all()


def test_snapkv_cannot_run_decoding_rounds_shorter_than_its_window(tmp_path):
    """kvpress's SnapKVPress needs more buffered queries than its window (fitted to the golden's 32): every 4
    tokens is refused."""
    with pytest.raises(AssertionError, match="should be greater than the window size 32"):
        write_candidates(kvpress.DecodingPress(kvpress.SnapKVPress()), GOLDEN, tmp_path, policy="snapkv",
                         progress=None, device=DEVICE)


# -- the table of docs/oracle/decoding.rst, from the outcomes asserted above ---------------------------------
PRESSES = ("KeyDiffPress", "KnormPress", "StreamingLLMPress", "TOVAPress", "ObservedAttentionPress",
           "ExpectedAttentionPress", "SnapKVPress")
WRAPPERS = (*DECODING, "PerLayerCompressionPress", "KeyRerotationPress", "ChunkPress", "BlockPress")
CLASS = {"keydiff": "KeyDiffPress", "knorm": "KnormPress"}


def outcome_table() -> dict:
    """``{(press, wrapper): status}`` of every combination the tests above run, with their asserted result."""
    table = {key: status for key, (status, _) in DECODING_OUTCOMES.items()}
    for scorer in SCORERS:
        for wrapper, (_, options, expected) in PREFILL.items():
            if wrapper != "bare":
                declared = " (re-rotated keys declared)" if options else ""
                table[CLASS[scorer], wrapper] = ("matches" + declared if expected == "pass"
                                                 else f"differs by design ({expected})")
    table["KnormPress", "BlockPress"] = "matches"
    table["KeyDiffPress", "BlockPress"] = "differs by design (block-wise selection over one-shot attention)"
    return table


def table_rst() -> str:
    lines = [".. list-table::", "   :header-rows: 1", "", "   * - press", *(f"     - {w}" for w in WRAPPERS)]
    table = outcome_table()
    for press in PRESSES:
        lines.append(f"   * - ``{press}``")
        lines += [f"     - {table.get((press, w), 'not run')}" for w in WRAPPERS]
    return "\n".join(lines) + "\n"


def test_docs_table_is_the_outcomes():
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "oracle" / "decoding.rst").read_text()
    begin, end = ".. begin-decoding-table\n", ".. end-decoding-table\n"
    shown = page[page.index(begin) + len(begin):page.index(end)].strip("\n")
    assert shown == table_rst().strip("\n"), "docs/oracle/decoding.rst's table is stale; paste:\n" + table_rst()


def _rope(x, turn, inv_freq):
    """RoPE's rotation (rotate-half) of ``x`` (d,) by ``turn`` positions, in float64."""
    half = x.shape[0] // 2
    angle = turn * inv_freq
    return torch.cat([x[:half] * torch.cos(angle) - x[half:] * torch.sin(angle),
                      x[half:] * torch.cos(angle) + x[:half] * torch.sin(angle)])


def test_a_re_rotated_row_of_a_repeated_token_is_matched_by_its_whole_rotation():
    """Layer 0 gives a repeated token equal values at both positions, so a re-rotated row is told apart
    by its key alone: RoPE's rotation of the candidate's key by (row - position) must land on the row's
    key. In float16 the first rotary pair alone is noise when it is small (a KeyRerotationPress(SnapKV)
    float16 cell was once wrong by a swap of positions 28 and 30, both token 63)."""
    from refkv.interop.kvpress.rows import match_rows

    d, base = 8, 10000.0
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)               # (d/2,)
    # the first rotary pair (dimensions 0 and 4) below float16's resolution: its angle says nothing
    raw = torch.tensor([1e-9, 0.9, -1.3, 0.7, -2e-9, 1.1, 0.4, -0.8], dtype=torch.float64)
    before_pos = torch.tensor([[28, 30]])
    before_keys = torch.stack([_rope(raw, 28, inv_freq), _rope(raw, 30, inv_freq)])[None].half()   # (1, 2, d)
    values = torch.ones(1, 2, d, dtype=torch.float16)                                 # the same token's values
    for keep in (0, 1):  # the press keeps one of them in row 0, re-rotated to position 0
        row_key = _rope(before_keys[0, keep].double(), -int(before_pos[0, keep]), inv_freq).half()
        got = match_rows(row_key[None, None], values[:, :1], before_keys, values, before_pos, inv_freq)
        assert got.tolist() == [[int(before_pos[0, keep])]]
    # the first pair alone (no frequencies given) cannot tell them apart: one of the two goes wrong
    firsts = [match_rows(_rope(before_keys[0, keep].double(), -int(before_pos[0, keep]), inv_freq).half()[None, None],
                         values[:, :1], before_keys, values, before_pos).tolist() for keep in (0, 1)]
    assert firsts[0] == firsts[1]
