"""Per-decision: a press's score and selection on refkv's vector cases (one eviction, one layer)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import kvpress
import numpy as np
import torch

from ...policies import get as get_policy
from ...policies import select
from ...testing import assert_case
from .models import DTYPES, compression_ratio

__all__ = [
    "CASE_DTYPE",
    "PAIRINGS",
    "Pairing",
    "ToleranceGap",
    "check",
    "file_declarations",
    "pairing_candidate",
    "prefill_mode",
    "press_outputs",
    "reference_for",
]


# =====================================================================================================
# Per-decision: a press's score and selection on refkv's vector cases (one eviction, one layer)
# =====================================================================================================
# A press scores the ``(batch, Hkv, n)`` candidates of one layer from its keys and (for the
# attention presses) the ``(batch, H, q_len, n)`` attention weights, then keeps the top
# ``int(n * (1 - compression_ratio))`` with ``torch.Tensor.topk`` and gathers them
# (``ScorerPress.compress``). :func:`press_outputs` feeds a refkv ``VectorCase`` to exactly
# that code and returns the press's scores and kept columns in refkv's layout, ``(Hkv, n)``
# and ``(Hkv, N)``, ready for :func:`refkv.testing.assert_case`. :data:`PAIRINGS` says, for
# every press, which refkv policy and options it is compared with, what differs by design
# (declared to the comparison, never hidden), and on which cases it can run.
#: Which case dtype each press dtype is checked on.
CASE_DTYPE = {"float64": "float64", "float32": "float32", "bfloat16": "float32", "float16": "float32"}


# -- the adapter -----------------------------------------------------------------------------
def press_outputs(press, case, dtype: str = "float32", device: str = "cpu") -> dict:
    """Run ``press`` on one golden case, in torch ``dtype``; scores and kept columns, refkv's layout.

    Parameters
    ----------
    press : kvpress.ScorerPress
        Its ``compression_ratio`` is replaced by the one that keeps ``case.budget`` tokens.
    case : refkv.oracle.VectorCase
    dtype : {"float64", "float32", "bfloat16", "float16"}
        The inputs (keys, attention weights) are cast to it; the press computes in it.
    device : str
        The torch device the press computes on (``"cpu"``, ``"cuda"``).

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
    keys = torch.from_numpy(np.ascontiguousarray(view.keys))[None].to(device, tdtype)  # (1, Hkv, n, d)
    attention = case.inputs.get("attention")                                         # (Hkv, g, B, n)
    if attention is not None:  # query head i*g + j is KV head i's j-th query (transformers' repeat_kv)
        attention = torch.from_numpy(attention.reshape(h, b, n))[None].to(device, tdtype)  # (1, H, B, n)
    module = SimpleNamespace(config=SimpleNamespace(num_attention_heads=h, num_key_value_heads=hkv),
                             head_dim=d, layer_idx=case.layer)
    # only its length (q_len) is read by these presses
    hidden_states = torch.zeros(1, b, 1, dtype=tdtype, device=device)
    press = copy.copy(press)
    press.compression_ratio = compression_ratio(n, min(case.budget, n))
    scores = press.score(module, hidden_states, keys, keys, attention, {})           # (1, Hkv, n)
    # kvpress's own selection (compute_n_kept, topk, gather): gather the column numbers.
    columns = torch.arange(n, dtype=torch.float64, device=device).expand(1, hkv, d, n).transpose(2, 3).contiguous()
    press.score = lambda *args, **kwargs: scores
    _, gathered = press.compress(module, hidden_states, keys, columns, attention, {})  # (1, Hkv, N, d)
    kept = np.sort(gathered[0, :, :, 0].cpu().numpy().astype(np.int64), axis=1)
    return {"scores": scores[0].cpu().to(torch.float64).numpy(), "kept": kept}


def prefill_mode(case) -> str:
    """"oneshot" (the whole prompt was one block) or "block".

    Unlike ``refkv.testing.loading.case_mode`` (which reads a case without a stated ``mode`` as
    block mode), a case without one counts as one-shot when its block spans all ``n``
    candidates: what a press, which has no block prefill, can run on."""
    mode = getattr(case, "mode", None)
    if mode is not None:
        return mode
    return "oneshot" if case.sizes["block"] == case.sizes["n"] else "block"


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
        cls = getattr(kvpress, self.press)
        p = case.params
        if self.press == "StreamingLLMPress":
            return cls(n_sink=p["sink"])
        if self.press == "SnapKVPress":
            return cls(window_size=p["window"], kernel_size=p["kernel"])
        return cls()

    def runs_on(self, case) -> bool:
        """Whether the press can run on ``case`` and means the same as its policy options there."""
        if prefill_mode(case) not in self.modes or case.stage != "after-attention":
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


def check(pairing: Pairing, case, dtype: str, device: str = "cpu") -> list:
    """Run the press on ``case`` in ``dtype`` and check it with :func:`refkv.testing.assert_case`.

    Raises AssertionError where the press and refkv disagree beyond what is declared,
    :class:`ToleranceGap` where they disagree only by float16 subnormal steps; returns
    the accepted ties.
    """
    __tracebackhide__ = True
    out = press_outputs(pairing.make(case), case, dtype, device)
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


def pairing_candidate(pairing: Pairing, case, dtype: str, device: str = "cpu") -> dict:
    """The outputs of the press on ``case`` that a candidate file holds (what is compared)."""
    return pairing.candidate(case, press_outputs(pairing.make(case), case, dtype, device))


def file_declarations(pairing: Pairing, cases: list, dtype: str) -> dict:
    """Top-level entries of a candidate file: the precision it computed in and its declarations.

    """
    if not cases:
        return {}
    declarations = {repr(pairing.declaration(case)) for case in cases}
    if len(declarations) != 1:
        raise ValueError(f"{pairing.press}: the cases need different declarations; write one file per kind")
    return {"computed_dtype": dtype, "declare": pairing.declaration(cases[0])}

