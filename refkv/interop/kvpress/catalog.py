"""Every kvpress 0.5.5 press and what refkv says of it; the scorer x wrapper x dtype grid the tests assert."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFECTS", "GRID", "KEPT_ONLY", "OPTIONS", "PAIRS", "PRESSES", "WRAPPERS", "Cell", "Defect", "grid_rst",
           "presses_rst"]

#: Scorer press -> (its refkv policy, {policy option: the press's field} the adapter sets to the
#: golden's, {policy option: the value the press computes with} it cannot set). Read from the
#: dataclass fields and ``score`` methods of kvpress 0.5.5's presses; a golden stating another value
#: of a fixed option is skipped (:func:`refkv.interop.kvpress.fit_press`). ``PyramidKVPress``
#: (pyramidkv over snapkv) and ``AdaKVPress`` (adakv) are wrappers with options of their own.
OPTIONS = {
    "KeyDiffPress": ("keydiff", {}, {"anchor": "unit_mean", "metric": "cosine", "reserve": 0.0}),
    "KnormPress": ("knorm", {}, {"skip_layers": []}),
    "StreamingLLMPress": ("sink", {"sink": "n_sink"}, {}),
    "SnapKVPress": ("snapkv", {"window": "window_size", "kernel": "kernel_size"}, {"pooling": "avg"}),
    "TOVAPress": ("tova", {}, {"all_heads": True}),
    "ObservedAttentionPress": ("h2o", {}, {"recent": 0}),
    "ExpectedAttentionPress": ("expected_attention", {name: name for name in (
        "n_future_positions", "n_sink", "use_covariance", "use_vnorm", "epsilon")}, {}),
}

#: Scorer press -> (refkv policy, its options that match the press, the press's parameters).
PAIRS = {
    "KeyDiffPress": ("keydiff", {}, {}),
    "KnormPress": ("knorm", {}, {}),
    "StreamingLLMPress": ("sink", {"sink": 4}, {"n_sink": 4}),
    "SnapKVPress": ("snapkv", {"window": 4, "kernel": 5, "pooling": "avg"}, {"window_size": 4, "kernel_size": 5}),
    "TOVAPress": ("tova", {"all_heads": True}, {}),
    "ObservedAttentionPress": ("h2o", {"recent": 0}, {}),
    "ExpectedAttentionPress": ("expected_attention", {}, {}),
}
#: Scorers whose scores differ from refkv's by design in a way a schedule check cannot
#: declare (1/0 marks, a mean for a sum, max+1 padding): kept sets compared, not scores.
KEPT_ONLY = ("StreamingLLMPress", "SnapKVPress", "TOVAPress")
WRAPPERS = ("DecodingPress", "AdaKVPress", "DecodingPress(AdaKVPress)", "PerLayerCompressionPress", "PyramidKVPress",
            "KeyRerotationPress", "ChunkPress", "BlockPress")


@dataclass(frozen=True)
class Cell:
    """One cell's status (the table's words) and what the test expects: "pass", or words of the
    check's report or of the press's error."""

    status: str
    expect: str = "pass"


@dataclass(frozen=True)
class Defect:
    """A kvpress defect the grid found: its one-line description and a minimal reproduction that
    raises AssertionError while the defect stands (a strict expected failure)."""

    name: str
    what: str
    repro: str


#: The kvpress defects the grid found (each also a strict expected failure of the tests).
DEFECTS = (
    Defect("AdaKVPress under DecodingPress",
           "each compression re-selects over every row of the cache, the rows masked at earlier rounds included: "
           "evicted tokens come back, and enter the scores of the others (KeyDiff's anchor)",
           "import torch\n"
           "from types import SimpleNamespace\n"
           "from kvpress import AdaKVPress, KeyDiffPress\n"
           "module = SimpleNamespace(config=SimpleNamespace(_attn_implementation=\"sdpa\"))\n"
           "keys = torch.tensor([[1.5, -0.3], [-2.2, 0.6], [-1.1, -1.4], [0.4, 0.8], [-0.7, -0.4]]).view(1, 1, 5, 2)\n"
           "press = AdaKVPress(KeyDiffPress(compression_ratio=0.5))\n"
           "press.compress(module, None, keys[:, :, :4], keys[:, :, :4], None, {})  # keeps 2 of 4: masks rows 1, 3\n"
           "evicted = set(module.masked_key_indices[2].tolist())\n"
           "press.compression_ratio = 0.6  # as DecodingPress sets it: a fifth token came, keep int(5 * 0.4) = 2\n"
           "press.compress(module, None, keys, keys, None, {})\n"
           "assert evicted <= set(module.masked_key_indices[2].tolist()), module.masked_key_indices  # 3 is back\n"),
    Defect("ObservedAttentionPress under DecodingPress",
           "the one decoding query's attention weights are divided by n - j (the number of prompt queries that "
           "see token j at prefill), though each token was seen by that one query: recent tokens are favoured",
           "import torch\n"
           "from kvpress import ObservedAttentionPress\n"
           "keys = torch.zeros(1, 1, 4, 2)\n"
           "attentions = torch.full((1, 1, 1, 4), 0.25)  # one decoding query, uniform over 4 keys\n"
           "scores = ObservedAttentionPress().score(None, None, keys, keys, attentions, {})\n"
           "assert torch.allclose(scores, attentions[:, :, 0]), scores  # got 0.25 / [4, 3, 2, 1]\n"),
    Defect("ExpectedAttentionPress under DecodingPress",
           "with compression_interval <= n_sink the query statistics are taken over the buffered decoding "
           "states minus the first n_sink, none: every score is NaN and topk evicts arbitrarily (sink tokens "
           "included); for longer intervals the future positions are counted from the buffer's length, not "
           "the cache's",
           "import torch\n"
           "from transformers import LlamaConfig\n"
           "from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding\n"
           "from kvpress import ExpectedAttentionPress\n"
           "config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4)\n"
           "module = LlamaAttention(config, layer_idx=0)\n"
           "module.rotary_emb = LlamaRotaryEmbedding(config)\n"
           "keys = torch.randn(1, 1, 10, 4)\n"
           "hidden = torch.randn(1, 4, 8)  # DecodingPress's buffer at compression_interval=4: four states\n"
           "scores = ExpectedAttentionPress().score(module, hidden, keys, keys, None, {})\n"
           "assert not scores.isnan().any(), scores  # n_sink=4 drops all four: NaN\n"),
    Defect("SnapKVPress under DecodingPress: window queries rotated at one position",
           "the observation window's queries are the buffered decoding states, but all are rotated with the "
           "current token's cos and sin (a decoding step's position_embeddings hold one position, which "
           "cos[:, -window_size:] broadcasts): every window query is placed at the current position",
           "import torch\n"
           "from transformers import LlamaConfig\n"
           "from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding\n"
           "from kvpress import SnapKVPress\n"
           "torch.manual_seed(0)\n"
           "config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4)\n"
           "module = LlamaAttention(config, layer_idx=0)\n"
           "rotary = LlamaRotaryEmbedding(config)\n"
           "hidden = torch.randn(1, 3, 8)  # DecodingPress's buffer: the states of positions 7, 8 and 9\n"
           "keys = torch.randn(1, 1, 10, 4)\n"
           "press = SnapKVPress(window_size=2, kernel_size=1)\n"
           "now = rotary(hidden, torch.tensor([[9]]))  # what a decoding step passes: the current token's cos, sin\n"
           "own = rotary(hidden, torch.tensor([[7, 8, 9]]))  # each buffered state's own position\n"
           "scores = press.score(module, hidden, keys, keys, None, {\"position_embeddings\": now})\n"
           "assert torch.allclose(scores, press.score(module, hidden, keys, keys, None, "
           "{\"position_embeddings\": own})), scores\n"),
    Defect("Pooled scores under DecodingPress: rows in score order",
           "ScorerPress.compress gathers the kept rows in topk (score) order, so at the next compression "
           "SnapKV's avg_pool1d (and PyramidKV's) smooths each token with rows that are not its neighbours in "
           "the sequence",
           "import torch\n"
           "from types import SimpleNamespace\n"
           "from kvpress import KnormPress\n"
           "keys = torch.tensor([[3.0, 0.0], [2.0, 0.0], [4.0, 0.0], [1.0, 0.0]]).view(1, 1, 4, 2)  # positions 0-3\n"
           "kept, _ = KnormPress(compression_ratio=0.5).compress(SimpleNamespace(head_dim=2), None, keys, keys, None, "
           "{})\n"
           "# the two smallest norms, positions 1 and 3, in the sequence's order (a pooled score reads rows as "
           "neighbours)\n"
           "assert torch.equal(kept, keys[:, :, [1, 3]]), kept[0, 0, :, 0]  # got the rows of positions 3, then 1\n"),
)

_BOTH = ("float32", "bfloat16", "float16")
_CHUNK = Cell("differs by design (each chunk keeps int(16 x (1 - ratio)): 3 x 5 = 15 of 16)", "kept count differs")
_BLOCK = Cell("differs by design (selection block by block, each block scored on its own)", "round 0")
_TOVA = Cell("differs by design (the last token's score is padded max+1: always kept)", "candidate keeps position 47")
_OBSERVED = Cell("differs by design (h2o sums divided by n - j, the queries that saw token j)",
                 "kept-set difference beyond ties")
_TOVA_OWN = Cell("differs by design (the current token always kept), found on the candidate's own state at round "
                 "2; the reference comparison at the measured tolerance (rtol 0.25) accepted it as ties",
                 "kept-set difference beyond ties")
_MASKED_STATE = Cell("kvpress defect (masked rows re-selected: each round's state offers the rows evicted before; "
                     "the kept sets coincide, a per-token score re-selecting the same rows, and the state shows it)",
                     "state does not continue the previous round")
_NO_EAGER = Cell("cannot run (AdaKVPress refuses eager attention, which ObservedAttentionPress needs)",
                 "eager mode not supported")
_NO_ATTENTION = Cell("cannot run (the wrapper refuses attention weights)", "does not support attentions")
_SNAP_WINDOW = Cell("cannot run (a round of 4 queries is shorter than its window); with rounds longer than its "
                    "window (512-token prompt, N=256, K=64, w=32): differs by design (refkv scores a decoding round "
                    "with its one query, kvpress with the last w buffered) and two kvpress defects (window queries "
                    "rotated at the current position; rows in score order, so the next round pools non-neighbours)",
                    "should be greater than the window size")
_KVPRESS = 'matches option form="kvpress"'


def _cells(press: str) -> dict:
    """The asserted outcome of every (wrapper, dtype) of one scorer."""
    ada = Cell(f"{_KVPRESS}") if press not in ("TOVAPress",) else _TOVA
    out = {("AdaKVPress", d): ada for d in _BOTH}
    out[("DecodingPress", "float32")] = Cell("matches")
    out[("PerLayerCompressionPress", "float32")] = Cell("matches option pyramidkv (its layer budgets)")
    out[("KeyRerotationPress", "float32")] = Cell("matches (re-rotated keys declared)")
    out[("ChunkPress", "float32")] = _CHUNK
    out[("BlockPress", "float32")] = _BLOCK
    out[("DecodingPress(AdaKVPress)", "float32")] = Cell(f"{_KVPRESS}")
    for d in _BOTH[1:]:
        out[("DecodingPress", d)] = Cell("matches")
    return out


def _grid() -> dict:
    defect = "kvpress defect ({})".format
    grid = {}
    for press in PAIRS:
        cells = _cells(press)
        if press == "KeyDiffPress":
            cells["DecodingPress(AdaKVPress)", "float32"] = Cell(defect("masked rows re-selected: evicted tokens "
                                                                        "come back"), "first diverged at round 1")
        if press == "KnormPress":
            cells["BlockPress", "float32"] = Cell("matches (a per-token score: block by block selects the same)")
        if press in ("KnormPress", "StreamingLLMPress"):
            for d in _BOTH:
                cells["DecodingPress(AdaKVPress)", d] = _MASKED_STATE
        if press == "StreamingLLMPress":
            for d in _BOTH:
                cells["DecodingPress", d] = Cell(defect("rows in score order from the second round: recent-window "
                                                        "tokens evicted, then sink tokens"),
                                                 "first diverged at round 1")
            cells["BlockPress", "float32"] = Cell("differs by design (each block's own sink and window)",
                                                  "protected position evicted")
        if press == "SnapKVPress":
            for d in _BOTH:
                cells["DecodingPress", d] = _SNAP_WINDOW
            cells["DecodingPress(AdaKVPress)", "float32"] = _SNAP_WINDOW
            cells["PyramidKVPress", "float32"] = Cell(f"{_KVPRESS} (pyramidkv over snapkv)")
            # the numbers are pinned by tests/interop/test_interop_grid.py's
            # test_adakv_snapkv_bfloat16_moves_one_token_between_heads_by_a_near_tie
            cells["AdaKVPress", "bfloat16"] = Cell(
                f"{_KVPRESS} on its own state, with no tie; against the reference's scores at the measured "
                "tolerance it needed one cross-head tie at layer 0: refkv keeps (head 1, position 33), score "
                "0.0950118, over (head 0, position 31), 0.0948460 (gap 1.66e-4, relative 1.7e-3 < bfloat16's 2^-8, "
                "within the bfloat16 tie tolerance 0.05 of the pair); the bfloat16 press scores both 0.0236816 (a "
                "mean for refkv's sum over the window of 4) and topk takes head 0's. AdaKV allocates across heads, "
                "so the heads are compared pooled")
        if press == "TOVAPress":
            for w in ("PerLayerCompressionPress", "KeyRerotationPress"):
                cells[w, "float32"] = _TOVA
            cells["DecodingPress", "float32"] = Cell("differs by design (the current token always kept)",
                                                     "candidate keeps position 51")
            cells["DecodingPress(AdaKVPress)", "float32"] = cells["DecodingPress", "float32"]
            cells["DecodingPress(AdaKVPress)", "bfloat16"] = _MASKED_STATE
            cells["DecodingPress", "float16"] = cells["DecodingPress", "float32"]
            cells["DecodingPress", "bfloat16"] = _TOVA_OWN
        if press == "ObservedAttentionPress":
            for d in _BOTH:
                cells["AdaKVPress", d] = _NO_EAGER
            cells["DecodingPress(AdaKVPress)", "float32"] = _NO_EAGER
            cells["ChunkPress", "float32"] = cells["BlockPress", "float32"] = _NO_ATTENTION
            cells["PerLayerCompressionPress", "float32"] = cells["KeyRerotationPress", "float32"] = _OBSERVED
            for d in _BOTH:
                cells["DecodingPress", d] = Cell(defect("one query's weights divided by n - j"),
                                                 "first diverged at round 0")
        if press == "ExpectedAttentionPress":
            cells["BlockPress", "bfloat16"] = Cell(
                "passes: as ties: this prompt's expected-attention scores all lie within 0.08-0.11, inside "
                "bfloat16's tie tolerance (about 0.05 each), so block-by-block selection cannot be told apart; "
                "float32 and float16 show the difference")
            # the candidate's NaN scores are refused before any comparison (refkv.oracle.candidates),
            # whatever topk then kept among them on the device
            for d in _BOTH:
                cells["DecodingPress", d] = Cell(defect("NaN scores when the interval <= n_sink"),
                                                 "a candidate's floats must be finite")
            cells["DecodingPress(AdaKVPress)", "float32"] = Cell(defect("NaN scores when the interval <= n_sink"),
                                                                 "a candidate's floats must be finite")
        # every wrapper in the coarse dtypes too: the float32 outcome unless stated above
        for (w, d), cell in list(cells.items()):
            if d == "float32":
                for coarse in _BOTH[1:]:
                    cells.setdefault((w, coarse), cell)
        grid.update({(press, w, d): c for (w, d), c in cells.items()})
    return grid


#: ``(scorer press, wrapper, dtype) -> Cell``: what tests/interop/test_interop_grid.py asserts.
GRID = _grid()


def grid_rst() -> str:
    """The grid as the list-table of docs/oracle/kvpress.rst (between ``begin-grid`` and ``end-grid``)."""
    lines = [".. list-table::", "   :header-rows: 1", "", "   * - scorer", "     - wrapper", "     - float32",
             "     - bfloat16", "     - float16"]
    for press in PAIRS:
        for wrapper in WRAPPERS:
            if (press, wrapper, "float32") not in GRID:
                continue
            lines += [f"   * - ``{press}``", f"     - ``{wrapper}``"]
            for dtype in ("float32", "bfloat16", "float16"):
                cell = GRID.get((press, wrapper, dtype))
                lines.append(f"     - {cell.status if cell else 'not run'}")
    return "\n".join(lines) + "\n"


_NOT_POLICY = "not an eviction policy"
_NOT_IMPL = "not implemented"
_HUB = "needs a hub download"

#: Every name of ``kvpress.__all__`` (0.5.5) -> its one status (a test compares the names with
#: the installed kvpress, so a new press fails until it is classified here).
PRESSES = {
    "AdaKVPress": f'{_KVPRESS} of adakv over keydiff, knorm, sink, snapkv and expected_attention (the grid); '
                  "kvpress defect under DecodingPress (masked rows re-selected)",
    "BasePress": f"{_NOT_POLICY} (the base class of every press)",
    "BlockPress": "matches for per-token scores (knorm); differs by design for the others (block-wise selection)",
    "CAMPress": f"{_NOT_POLICY} (merging: evicted values are merged into the kept ones)",
    "CapPress": f"{_NOT_IMPL} (CAPKV's score has no refkv policy)",
    "ChunkKVPress": f"{_NOT_IMPL} (chunk-wise selection of whole chunks: no refkv policy)",
    "ChunkPress": "differs by design (each chunk rounds its own share down: 15 of 16 kept)",
    "ComposedPress": f"{_NOT_POLICY} (runs presses one after another; each is checked alone)",
    "CompactorPress": f"{_NOT_IMPL} (leverage scores blended with attention: no refkv policy)",
    "CompressionRatioDecodingPress": "matches (refkv golden generate --ratio; tests/interop/test_interop_schedules.py)",
    "CriticalAdaKVPress": f"{_NOT_IMPL} (CriticalKV weights scores by ``|W_o v|_1``; refkv's views hold no W_o)",
    "CriticalKVPress": f"{_NOT_IMPL} (needs W_o in the view, as CriticalAdaKVPress)",
    "CURPress": f"{_NOT_IMPL} (CUR leverage scores of keys and values: no refkv policy)",
    "DMSPress": f"{_NOT_POLICY} (learned: evicts by a trained threshold model)",
    "DecodingPress": "matches for keydiff and knorm; kvpress defects with StreamingLLM, ObservedAttention and "
                     "ExpectedAttention (the grid)",
    "DuoAttentionPress": f"{_HUB} (its retrieval/streaming head patterns)",
    "EntropyGatedChunkKVPress": f"{_NOT_IMPL} (ChunkKV with an entropy gate: no refkv policy)",
    "ExpectedAttentionPress": "matches (expected_attention, one-shot); kvpress defect under DecodingPress "
                              "(NaN scores when the interval <= n_sink)",
    "ExpectedAttentionStatsPress": f"{_HUB} (pre-computed query statistics)",
    "FastKVzipPress": f"{_NOT_POLICY} (learned: gates trained on KVzip scores, downloaded)",
    "FinchPress": f"{_NOT_IMPL} (SnapKV windows set by delimiter tokens of the prompt)",
    "KVComposePress": f"{_NOT_IMPL} (composite tokens across heads: no refkv policy)",
    "KVgradPress": f"{_NOT_IMPL} (gradients of the final hidden states: needs a backward pass)",
    "KVPressTextGenerationPipeline": f"{_NOT_POLICY} (the generation pipeline)",
    "KVzapPress": f"{_NOT_POLICY} (learned: a surrogate model, downloaded)",
    "KVzipPress": f"{_NOT_IMPL} (scores by a second forward pass reconstructing the context)",
    "KeyDiffPress": "matches (keydiff) under every wrapper but ChunkPress and BlockPress (by design)",
    "KeyRerotationPress": "matches (re-rotated keys declared; rows matched by their RoPE turn)",
    "KnormPress": "matches (knorm) under every wrapper but ChunkPress (by design)",
    "LUKVPress": f"{_HUB} (its pre-computed budget curve)",
    "LagKVPress": f"{_NOT_IMPL} (lag-relative statistics of key chunks: no refkv policy)",
    "LeverageScorePress": f"{_NOT_IMPL} (leverage scores of pre-RoPE keys: no refkv policy)",
    "MergingPress": f"{_NOT_POLICY} (merging: evicted values blended into kept ones)",
    "NonCausalAttnPress": f"{_NOT_IMPL} (non-causal chunked attention: no refkv policy)",
    "ObservedAttentionPress": "differs by design (h2o recent=0, sums divided by n - j); kvpress defect under "
                              "DecodingPress (one query's weights divided by n - j)",
    "PerLayerCompressionPress": "matches option pyramidkv (its layer budgets as ratios), every scorer but TOVA "
                                "and ObservedAttention (their own differences)",
    "PrefillDecodingPress": "matches (keydiff, knorm; tests/interop/test_interop_schedules.py)",
    "PyramidKVPress": f"{_KVPRESS} of pyramidkv (over snapkv, window inside the budget)",
    "QFilterPress": f"{_HUB} (learned Q-filters)",
    "RandomPress": f"{_NOT_IMPL} (random scores: nothing to compare)",
    "RestoreKVPress": f"{_HUB} (learned restore tokens on top of KVzip)",
    "ScorerPress": f"{_NOT_POLICY} (the base class of scorers)",
    "SimLayerKVPress": f"{_NOT_IMPL} (per-layer laziness test switching to a window: no refkv policy)",
    "SnapKVPress": "differs by design (snapkv pooling=avg: a mean where refkv sums, window padded max+1); "
                   "cannot run decoding rounds shorter than its window; under DecodingPress with longer rounds, "
                   "differs by design (the last w buffered queries, where refkv's decoding round has one) and two "
                   "kvpress defects (window queries rotated at the current position; rows in score order, so the "
                   "next round pools non-neighbours)",
    "StreamingLLMPress": "differs by design (sink: 1/0 scores, kept sets compared); kvpress defects: a prompt of "
                         "at most n_sink tokens, and from the second DecodingPress round a cache in score order "
                         "(recent-window tokens evicted, sink tokens too where topk moved them)",
    "TOVAPress": "differs by design (tova all_heads=True, the last token padded max+1: always kept)",
    "ThinKPress": f"{_NOT_POLICY} (prunes key channels, not tokens)",
}


def presses_rst() -> str:
    """Every kvpress press and its status, for docs/oracle/kvpress.rst (between ``begin-presses`` and
    ``end-presses``)."""
    lines = [".. list-table::", "   :header-rows: 1", "", "   * - press", "     - status"]
    for name in sorted(PRESSES, key=str.lower):
        lines += [f"   * - ``{name}``", f"     - {PRESSES[name]}"]
    return "\n".join(lines) + "\n"
