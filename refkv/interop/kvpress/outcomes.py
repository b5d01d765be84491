"""The one-shot cases built with the public API, kvpress's defects they expose, and the docs table."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...oracle.encode import encode_case, vectors_document
from ...oracle.io import write_json
from ...oracle.synthetic import (
    duplicate_key,
    huge_logits,
    near_duplicate_key,
    plant_huge_logit,
    random_tokens,
    replay,
    zero_key,
)
from ...policies import get as get_policy
from ...testing import load_cases
from .cases import CASE_DTYPE, PAIRINGS, Pairing, ToleranceGap, _json, check
from .models import DTYPES

__all__ = ["DEFECTS", "Defect", "cases_for", "defect_for", "docs_blocks", "how_rst", "item_id", "oneshot_documents",
           "outcome", "table_rst", "tally", "write_oneshot_suite"]


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
    ``block_size = T``, :func:`refkv.oracle.encode.encode_case` and
    :func:`~refkv.oracle.encode.vectors_document`.
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


def outcome(pairing: Pairing, case, dtype: str, device: str = "cpu") -> str:
    """"pass", "defect" (kvpress, :data:`DEFECTS`), "gap" (refkv, :class:`ToleranceGap`) or "fail"."""
    try:
        check(pairing, case, dtype, device)
    except ToleranceGap:
        return "gap"
    except AssertionError:
        return "defect" if defect_for(pairing.press, dtype, case) else "fail"
    return "pass"


def tally(folders: dict, device: str = "cpu") -> dict:
    """``{press: {dtype: (passed, total, defects, gaps)}}`` over every case the press runs on."""
    table = {}
    for press, pairing in PAIRINGS.items():
        row = {}
        for dtype in DTYPES:
            results = [outcome(pairing, case, dtype, device) for _, case in cases_for(pairing, dtype, folders)]
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


def docs_blocks(golden) -> str:
    """The table and list blocks of ``docs/oracle/kvpress.rst`` from the outcomes (one-shot cases built here
    and the cases of folder ``golden``)."""
    with tempfile.TemporaryDirectory() as tmp:
        write_oneshot_suite(tmp)
        return (".. begin-table\n\n" + table_rst(tally({"built": tmp, "golden": Path(golden)}))
                + "\n.. end-table\n\n.. begin-how\n\n" + how_rst() + "\n.. end-how")

