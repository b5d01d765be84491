"""NVIDIA kvpress's presses run on refkv's golden cases: the adapter and the pairing table.

A press scores the ``(batch, Hkv, n)`` candidates of one layer from its keys and (for the
attention presses) the ``(batch, H, q_len, n)`` attention weights, then keeps the top
``int(n * (1 - compression_ratio))`` with :meth:`torch.Tensor.topk` and gathers them
(``ScorerPress.compress``). :func:`press_outputs` feeds a refkv
:class:`~refkv.oracle.VectorCase` to exactly that code and returns the press's scores
and kept columns in refkv's layout, ``(Hkv, n)`` and ``(Hkv, N)``, ready for
:func:`refkv.testing.assert_case`.

:data:`PAIRINGS` says, for every press, which refkv policy and options it is compared
with, what differs by design (declared to the comparison, never hidden), and on which
cases it can run. ``python tests/kvpress_adapter.py`` prints the table of
``docs/oracle/kvpress.rst`` from the tests' outcomes (:func:`tally`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import numpy as np
import torch

from refkv.oracle.io import write_json
from refkv.oracle.synthetic import (
    duplicate_key,
    huge_logits,
    near_duplicate_key,
    plant_huge_logit,
    random_tokens,
    replay,
    zero_key,
)
from refkv.oracle.vectors import encode_case, vectors_document
from refkv.policies import get as get_policy
from refkv.policies import select
from refkv.testing import assert_case, load_cases

#: The torch dtypes a press is run in; bf16 and fp16 run on the float32 cases.
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
#: Which case dtype each press dtype is checked on.
CASE_DTYPE = {"float64": "float64", "float32": "float32", "bfloat16": "float32", "float16": "float32"}


# -- the adapter -----------------------------------------------------------------------------
def compression_ratio(n: int, keep: int) -> float:
    """The ratio for which kvpress keeps exactly ``keep`` of ``n`` tokens.

    ``compute_n_kept`` truncates ``n * (1 - ratio)``; aiming half a token above ``keep``
    makes the truncation land on ``keep`` whatever the rounding of the ratio. Keeping
    everything takes ratio 0 (kvpress then skips the press), except for a one-token prompt,
    where any ratio keeps the token and the press runs, as it would in a pipeline.
    """
    if keep >= n:
        return 0.5 if n == 1 else 0.0
    return (n - keep - 0.5) / n


def press_outputs(press, case, dtype: str = "float32") -> dict:
    """Run ``press`` on one golden case, in torch ``dtype``; scores and kept columns, refkv's layout.

    Parameters
    ----------
    press : kvpress.ScorerPress
        Its ``compression_ratio`` is replaced by the one that keeps ``case.budget`` tokens.
    case : refkv.oracle.VectorCase
    dtype : {"float64", "float32", "bfloat16", "float16"}
        The inputs (keys, attention weights) are cast to it; the press computes in it.

    Returns
    -------
    dict
        ``scores``: (Hkv, n) float64 (exactly the press's values, whatever their dtype);
        ``kept``: (Hkv, min(N, n)) int64 column indices, increasing.
    """
    s = case.sizes
    h, hkv, n, d, b = s["n_heads"], s["n_kv_heads"], s["n"], s["d_head"], s["block"]
    tdtype = DTYPES[dtype]
    view = case.view()
    keys = torch.from_numpy(np.ascontiguousarray(view.keys))[None].to(tdtype)        # (1, Hkv, n, d)
    attention = case.inputs.get("attention")                                         # (Hkv, g, B, n)
    if attention is not None:  # query head i*g + j is KV head i's j-th query (transformers' repeat_kv)
        attention = torch.from_numpy(attention.reshape(h, b, n))[None].to(tdtype)    # (1, H, B, n)
    module = SimpleNamespace(config=SimpleNamespace(num_attention_heads=h, num_key_value_heads=hkv),
                             head_dim=d, layer_idx=case.layer)
    hidden_states = torch.zeros(1, b, 1, dtype=tdtype)  # only its length (q_len) is read by these presses
    press = copy.copy(press)
    press.compression_ratio = compression_ratio(n, min(case.budget, n))
    scores = press.score(module, hidden_states, keys, keys, attention, {})           # (1, Hkv, n)
    # kvpress's own selection (compute_n_kept, topk, gather): gather the column numbers.
    columns = torch.arange(n, dtype=torch.float64).expand(1, hkv, d, n).transpose(2, 3).contiguous()
    press.score = lambda *args, **kwargs: scores
    _, gathered = press.compress(module, hidden_states, keys, columns, attention, {})  # (1, Hkv, N, d)
    kept = np.sort(gathered[0, :, :, 0].numpy().astype(np.int64), axis=1)
    return {"scores": scores[0].to(torch.float64).numpy(), "kept": kept}


# -- the pairings ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Pairing:
    """A kvpress press and the refkv policy (with options) it is checked against.

    Attributes
    ----------
    press : str
        The kvpress class name.
    policy : str
        The refkv policy.
    verdict : str
        "matches", "matches option", "differs by design" or "bug found".
    how : str
        One sentence for the docs table: the option, the difference, or the defect.
    params : dict
        The refkv options that match the press (also the filter on committed cases).
    declare : dict
        What the comparison is told (``refkv.testing.assert_case(declare=...)``).
    modes : tuple of str
        Case modes the press can run on: "oneshot" (``B = n``), "block".
    compare_kept : bool
        Whether kept sets are comparable (False when the press's ranking differs by design).
    """

    press: str
    policy: str
    verdict: str
    how: str
    params: dict = field(default_factory=dict)
    declare: dict = field(default_factory=dict)
    modes: tuple = ("oneshot", "block")
    compare_kept: bool = True

    def make(self, case):
        """The press with the parameters of ``case`` (kvpress's names for refkv's)."""
        import kvpress

        cls = getattr(kvpress, self.press)
        p = case.params
        if self.press == "StreamingLLMPress":
            return cls(n_sink=p["sink"])
        if self.press == "SnapKVPress":
            return cls(window_size=p["window"], kernel_size=p["kernel"])
        return cls()

    def runs_on(self, case) -> bool:
        """Whether the press can run on ``case`` and means the same as its policy options there."""
        if case_mode(case) not in self.modes or case.stage != "after-attention":
            return False
        defaults = {k: _json(v) for k, v in get_policy(case.policy_name).params().items()}
        wanted = {**defaults, **{k: _json(v) for k, v in self.params.items()}}
        if self.press == "SnapKVPress":  # any window and kernel: the press takes them as parameters
            wanted = {**wanted, "window": case.params.get("window"), "kernel": case.params.get("kernel")}
            return case.params == wanted and case.sizes["block"] > case.params["window"]
        if self.press == "StreamingLLMPress":  # any sink count (n_sink)
            return case.params == {**wanted, "sink": case.params.get("sink")}
        return case.params == wanted

    def declaration(self, case) -> dict:
        """The declaration for ``case``: TOVA's pinned column is the case's last position."""
        if self.press == "TOVAPress":
            return {"pinned": [int(case.inputs["positions"][0, -1])]}
        return dict(self.declare)

    def scale(self, case) -> np.ndarray:
        """(n,) factors from the press's score units to refkv's (a positive multiple by design)."""
        n = case.sizes["n"]
        if self.press == "ObservedAttentionPress":  # divided by n - j, the queries that saw token j
            return np.arange(n, 0, -1, dtype=np.float64)
        if self.press == "SnapKVPress":  # a mean over the w window queries where refkv sums
            return np.full(n, float(case.params["window"]))
        return np.ones(n)

    def candidate(self, case, out: dict) -> dict:
        """What is compared: the press's outputs, transformed where the pairing says how."""
        if self.press == "ObservedAttentionPress":  # undo the normalisation by the queries that saw j
            return {"scores": out["scores"] * self.scale(case)}
        if not self.compare_kept:
            return {"scores": out["scores"]}
        if self.declare.get("kept_only"):
            return {"kept": out["kept"]}
        return {"scores": out["scores"], "kept": out["kept"]}


def _json(value):
    return list(value) if isinstance(value, tuple) else value


PAIRINGS = {p.press: p for p in (
    Pairing("KeyDiffPress", "keydiff", "matches",
            "anchor = mean unit key, score = -cos (KeyDiff Eq. 8); every committed case with default options, "
            "block and one-shot (the score reads only the candidates' keys)"),
    Pairing("KnormPress", "knorm", "matches",
            "score = -||k||, computed in float32 for bf16/fp16 keys; every committed case with default options"),
    Pairing("StreamingLLMPress", "sink", "differs by design",
            "scores are 1 (kept) / 0 (pruned) instead of refkv's positions with both groups protected: "
            "kept sets compared (declare kept_only); n_sink = sink", declare={"kept_only": True}),
    Pairing("SnapKVPress", "snapkv", "differs by design",
            "mean over the window's queries where refkv sums (a factor 1/w: declare scores=positive_multiple) and "
            "the window padded with max+1 where refkv protects it (declare pinned=protected); window_size = window, "
            "kernel_size = kernel (defaults differ: 64/5 vs 32/7); one-shot cases with more than w queries",
            params={"pooling": "avg"}, declare={"scores": "positive_multiple", "pinned": "protected"},
            modes=("oneshot",)),
    Pairing("TOVAPress", "tova", "differs by design",
            "matches option all_heads=True (the last query's weights averaged over all query heads, as the TOVA "
            "code does) except that the last token's score is padded with max+1, so it is always kept: scores "
            "compared with declare pinned=[last position], kept sets with refkv's decision when the last token "
            "is protected", params={"all_heads": True}),
    Pairing("ObservedAttentionPress", "h2o", "differs by design",
            "matches option recent=0 up to a per-token factor: the accumulated attention of token j is divided by "
            "n - j, the number of queries that saw it, so rankings differ; scores compared after multiplying by "
            "n - j, kept sets not comparable; one-shot only", params={"recent": 0}, modes=("oneshot",),
            compare_kept=False),
)}


def reference_for(pairing: Pairing, case):
    """The reference the press is compared with: ``case``, or for TOVA its decision with the last token kept.

    kvpress's TOVA pads the last token's score with max+1, so it always keeps it; refkv's
    TOVA keeps it only when its weight is in the top N. A declaration cannot change a
    decision, so the difference is applied to the reference, in the open: the last token
    joins the protected set and refkv's one selection routine picks the rest.
    """
    if pairing.press != "TOVAPress":
        return case
    ref, positions = case.outputs, case.inputs["positions"]
    protected = ref["protected"] | (positions == positions[:, -1:])                   # (Hkv, n)
    return replace(case, outputs={**ref, "protected": protected,
                                  "kept": select(ref["scores"], positions, case.budget, protected)})


class ToleranceGap(Exception):
    """The press fails only where refkv's float16 tolerance has no floor for subnormal results.

    refkv's tolerance is relative to each score's own scale; float16 results below
    ``2**-14`` are subnormal, with an absolute spacing of ``2**-24``, so a correct float16
    press that rounds a tiny attention sum can miss a relative tolerance by one step. The
    check is repeated with exactly those scores (reference below ``2**-14`` in the press's
    units, off by at most two subnormal steps) set to the reference: if that passes, the
    failure is this gap of refkv's and nothing else.
    """


#: Subnormal spacing of float16 and its smallest normal number.
FLOAT16_SUBNORMAL_STEP, FLOAT16_TINY = 2.0 ** -24, 2.0 ** -14


def check(pairing: Pairing, case, dtype: str) -> list:
    """Run the press on ``case`` in ``dtype`` and check it with :func:`refkv.testing.assert_case`.

    Raises AssertionError where the press and refkv disagree beyond what is declared,
    :class:`ToleranceGap` where they disagree only by float16 subnormal steps; returns
    the accepted ties.
    """
    __tracebackhide__ = True
    out = press_outputs(pairing.make(case), case, dtype)
    options = {"dtype": dtype, "declare": pairing.declaration(case) or None}
    reference = reference_for(pairing, case)
    try:
        return assert_case(reference, **pairing.candidate(case, out), **options)
    except AssertionError as failure:
        if dtype != "float16" or "scores" not in pairing.candidate(case, out):
            raise
        scale = pairing.scale(case)                                                       # (n,)
        ref = case.outputs["scores"] / scale                                              # press units
        off = np.abs(out["scores"] - ref)
        subnormal = (np.abs(ref) < FLOAT16_TINY) & (off <= 2 * FLOAT16_SUBNORMAL_STEP) & (off > 0)
        if not subnormal.any():
            raise
        patched = {**out, "scores": np.where(subnormal, ref, out["scores"])}
        try:
            assert_case(reference, **pairing.candidate(case, patched), **options)
        except AssertionError:
            raise failure from None
        raise ToleranceGap(f"{case.label}: {int(subnormal.sum())} float16 subnormal scores differ from the "
                           f"reference by at most {off[subnormal].max():.3g} (2**-24 = 6.0e-8 is one step); "
                           f"refkv's float16 tolerance has no absolute floor there") from failure


def pairing_candidate(pairing: Pairing, case, dtype: str) -> dict:
    """The outputs of the press on ``case`` that a candidate file holds (what is compared)."""
    return pairing.candidate(case, press_outputs(pairing.make(case), case, dtype))


def file_declarations(pairing: Pairing, cases: list, dtype: str) -> dict:
    """Top-level entries of a candidate file: the precision it computed in and its declarations.

    """
    if not cases:
        return {}
    declarations = {repr(pairing.declaration(case)) for case in cases}
    if len(declarations) != 1:
        raise ValueError(f"{pairing.press}: the cases need different declarations; write one file per kind")
    return {"computed_dtype": dtype, "declare": pairing.declaration(cases[0])}


# -- one-shot cases built with the public API --------------------------------------------------
#: Policy options of the in-test one-shot cases: the pairings' options, SnapKV with a
#: window that fits the small cases.
ONESHOT_POLICIES = {
    "keydiff": {}, "knorm": {}, "sink": {"sink": 4},
    "snapkv": {"window": 4, "kernel": 5, "pooling": "avg"},
    "tova": {"all_heads": True}, "h2o": {"recent": 0},
}
ONESHOT_TOKENS, ONESHOT_BUDGET = 24, 12


def _variants(tokens, rng):
    """The adversarial edits of the golden suite, on one-shot inputs (name, Tokens)."""
    t = tokens.n_tokens
    yield "plain", tokens
    yield "zero-norm key", zero_key(tokens, 0, 5)
    yield "duplicate keys", duplicate_key(tokens, 0, 3, 9)
    yield "near-duplicate keys", near_duplicate_key(tokens, tokens.keys.shape[0] - 1, 2, 11, 1e-6)
    yield "huge logits", plant_huge_logit(huge_logits(tokens, 3.0), 0, t - 1, 7)


def oneshot_documents(seed: int = 20251122) -> dict:
    """Vectors documents of one-shot cases (the whole prompt is one block), per policy.

    Built only with public functions: :func:`refkv.oracle.synthetic.random_tokens` and
    its adversarial edits, :func:`~refkv.oracle.synthetic.replay` with
    ``block_size = T``, :func:`refkv.oracle.vectors.encode_case` and
    :func:`~refkv.oracle.vectors.vectors_document`.
    """
    docs = {}
    for name, params in ONESHOT_POLICIES.items():
        policy = get_policy(name, **params)
        cases = []
        rng = np.random.default_rng(seed)
        for dtype in (np.float64, np.float32):
            for h, hkv in ((4, 2), (2, 2)):
                base = random_tokens(rng, h, hkv, 16, ONESHOT_TOKENS, dtype)
                for label, tokens in _variants(base, rng):
                    view = replay(policy, tokens, block_size=ONESHOT_TOKENS, budget=ONESHOT_BUDGET)
                    comment = (f"one-shot: {ONESHOT_TOKENS} tokens in one block of {ONESHOT_TOKENS}, "
                               f"N = {ONESHOT_BUDGET}, H = {h}, Hkv = {hkv}, {label}")
                    cases.append(encode_case(policy, view, case_id=len(cases), comment=comment))
        docs[name] = vectors_document(name, [({k: _json(v) for k, v in policy.params().items()}, cases)])
    return docs


def write_oneshot_suite(folder) -> None:
    """Write :func:`oneshot_documents` as ``folder/vectors/<policy>.json`` (no suite.json)."""
    from pathlib import Path

    vectors = Path(folder) / "vectors"
    vectors.mkdir(parents=True, exist_ok=True)
    for name, doc in oneshot_documents().items():
        write_json(vectors / f"{name}.json", doc)


# -- defects of kvpress that refkv's cases expose ------------------------------------------------
@dataclass(frozen=True)
class Defect:
    """A defect of a press, the case flag that exposes it, and its minimal reproduction.

    ``repro`` is Python that raises AssertionError while the defect stands (the tests run
    it as a strict expected failure, so a fixed kvpress turns it into a failure to notice).
    """

    press: str
    dtypes: tuple
    exposed_by: str
    applies_to: Callable
    what: str
    repro: str

    def applies(self, press: str, dtype: str, case) -> bool:
        return press == self.press and dtype in self.dtypes and self.applies_to(case)


DEFECTS = (
    Defect("KeyDiffPress", ("float16",), "cases flagged zero-norm-key", lambda case: "zero-norm-key" in case.flags,
           "in float16 a KV head holding one zero key gets NaN for every score: F.normalize's eps = 1e-12 "
           "underflows to 0 in float16, so the zero key normalises to 0/0 and the NaN anchor spreads to every "
           "cosine; topk then keeps an arbitrary set (float32 and bfloat16 give the zero key a score of 0)",
           "import torch\n"
           "from kvpress import KeyDiffPress\n"
           "keys = torch.tensor([[[[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float16)  # (1, 1, 3, 2)\n"
           "scores = KeyDiffPress().score(None, None, keys, keys, None, {})\n"
           "assert not scores.isnan().any(), scores  # float32: [0, -0.7071, -0.7071]\n"),
    Defect("StreamingLLMPress", tuple(DTYPES), "cases of at most `sink` tokens (a one-token prompt)",
           lambda case: case.sizes["n"] <= case.params["sink"],
             "a prompt of at most n_sink tokens stops the press with AssertionError ('Input should contain more "
             "tokens than n_sink') even when compression keeps every token (a one-token prompt keeps max(1, "
             "int(1 - ratio)) = 1 token for any ratio); refkv keeps the prompt",
             "from types import SimpleNamespace\n"
             "import torch\n"
             "from kvpress import StreamingLLMPress\n"
             "keys = torch.zeros(1, 1, 1, 2)  # a one-token prompt: (batch, Hkv, n, d)\n"
             "press = StreamingLLMPress(compression_ratio=0.5, n_sink=4)  # keeps max(1, int(0.5)) = 1 token\n"
             "kept, _ = press.compress(SimpleNamespace(head_dim=2), None, keys, keys, None, {})  # AssertionError\n"
             "assert kept.shape[2] == 1\n"),
)


def item_id(press: str, dtype: str, source: str, case) -> str:
    """The pytest id of one (press, dtype, case) check."""
    return f"{press}-{dtype}-{source}-{case}"


def defect_for(press: str, dtype: str, case) -> Defect | None:
    """The known defect that makes ``press`` fail on ``case`` in ``dtype``, if any."""
    return next((d for d in DEFECTS if d.applies(press, dtype, case)), None)


# -- the cases each press runs on, and the table of outcomes ------------------------------------
def case_mode(case) -> str:
    """"oneshot" (the whole prompt was one block) or "block"."""
    mode = getattr(case, "mode", None)
    if mode is not None:
        return mode
    return "oneshot" if case.sizes["block"] == case.sizes["n"] else "block"


@functools.cache
def _cases(folder: str, policy: str) -> tuple:
    """The cases of ``policy`` in ``folder``, read once (the files do not change during a run)."""
    return tuple(load_cases(folder, policy=policy))


def cases_for(pairing: Pairing, dtype: str, folders: dict) -> list:
    """``(source, case)`` pairs the pairing runs on in ``dtype``, from each source folder."""
    out = []
    for source, folder in folders.items():
        for case in _cases(str(folder), pairing.policy):
            if case.dtype == CASE_DTYPE[dtype] and pairing.runs_on(case):
                out.append((source, case))
    return out


def outcome(pairing: Pairing, case, dtype: str) -> str:
    """"pass", "defect" (kvpress, :data:`DEFECTS`), "gap" (refkv, :class:`ToleranceGap`) or "fail"."""
    try:
        check(pairing, case, dtype)
    except ToleranceGap:
        return "gap"
    except AssertionError:
        return "defect" if defect_for(pairing.press, dtype, case) else "fail"
    return "pass"


def tally(folders: dict) -> dict:
    """``{press: {dtype: (passed, total, defects, gaps)}}`` over every case the press runs on."""
    table = {}
    for press, pairing in PAIRINGS.items():
        row = {}
        for dtype in DTYPES:
            results = [outcome(pairing, case, dtype) for _, case in cases_for(pairing, dtype, folders)]
            row[dtype] = (results.count("pass"), len(results), results.count("defect"), results.count("gap"))
        table[press] = row
    return table


def table_rst(counts: dict) -> str:
    """The table of ``docs/oracle/kvpress.rst`` (between its ``begin-table`` and ``end-table``)."""
    lines = [".. list-table::", "   :header-rows: 1", "", "   * - press", "     - refkv policy",
             "     - verdict", *(f"     - {d}" for d in DTYPES)]
    for press, pairing in PAIRINGS.items():
        options = ", ".join(f"{k}={v!r}" for k, v in pairing.params.items())
        bugs = [d for d in DEFECTS if d.press == press and any(counts[press][t][2] for t in d.dtypes)]
        verdict = pairing.verdict + "".join(
            f"; bug found ({'all dtypes' if len(d.dtypes) == len(DTYPES) else ', '.join(d.dtypes)})" for d in bugs)
        lines += [f"   * - ``{press}``", f"     - ``{pairing.policy}``" + (f" ({options})" if options else ""),
                  f"     - {verdict}"]
        for dtype in DTYPES:
            passed, total, defects, gaps = counts[press][dtype]
            notes = [f"{defects} kvpress bug"] * bool(defects) + [f"{gaps} refkv tolerance gap"] * bool(gaps)
            lines.append(f"     - {passed}/{total}" + (f" ({', '.join(notes)})" if notes else ""))
    return "\n".join(lines) + "\n"


def how_rst() -> str:
    """The list of ``docs/oracle/kvpress.rst`` (between ``begin-how`` and ``end-how``)."""
    return "".join(f"* ``{press}`` -- ``{p.policy}``, {p.verdict}: {p.how}.\n" for press, p in PAIRINGS.items())


if __name__ == "__main__":  # print the docs blocks from the outcomes (paste them into kvpress.rst)
    import tempfile
    from pathlib import Path

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        write_oneshot_suite(tmp)
        print(".. begin-table\n\n" + table_rst(tally({"built": tmp, "golden": Path(__file__).parent / "golden"}))
              + "\n.. end-table\n\n.. begin-how\n\n" + how_rst() + "\n.. end-how")
