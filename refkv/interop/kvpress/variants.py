"""Wrong and right presses, to prove that a check can fail and can pass.

A check that passes everything is worth nothing, and in bfloat16 on a real checkpoint the
old end-to-end tolerance was such a check. Each variant here is a kvpress press with one
deliberate mistake (or none), named after it; :data:`VARIANTS` says which refkv policy it
is checked against, how its goldens are made, and whether a sound check must reject it.
``bench/oracle_variants.py`` runs the whole table (variant x dtype) and the interop tests
run the part CI can afford.

The mistakes are the ones a kvpress developer made in a trial of the oracle: random
scores, KeyDiff's anchor over the wrong window, scores computed in a coarser dtype than the
run's, a decoding counter that is never reset, a token moved from one KV head to another
under AdaKV, SnapKV's window one token too wide. The right ones: the plain press, the same
score written another way, and a press that returns its rows in another order.
"""

from __future__ import annotations

from dataclasses import dataclass

import kvpress
import torch
from torch.nn import functional as F

__all__ = ["VARIANTS", "Variant"]


@dataclass(frozen=True)
class Variant:
    """One press to check: ``make()`` builds it, ``policy`` is refkv's policy it is checked against,
    ``regime`` the golden it runs on (``"decoding"``: DecodingPress rounds; ``"prefill"``: the
    prompt compressed once), and ``wrong`` whether a sound check must reject it."""

    name: str
    policy: str
    regime: str
    wrong: bool
    make: object
    what: str


@dataclass
class RandomScoresPress(kvpress.ScorerPress):
    """Scores drawn at random (seeded): any check must reject it."""

    compression_ratio: float = 0.0
    seed: int = 0

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        g = torch.Generator().manual_seed(self.seed + 7919 * module.layer_idx + keys.shape[2])
        return torch.rand(keys.shape[:-1], generator=g).to(device=keys.device, dtype=keys.dtype)


@dataclass
class WrongWindowKeyDiffPress(kvpress.ScorerPress):
    """KeyDiff with its anchor (the mean unit key) taken over the first half of the cache only."""

    compression_ratio: float = 0.0

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        unit = F.normalize(keys, p=2, dim=-1)
        anchor = unit[:, :, : max(1, keys.shape[2] // 2)].mean(dim=2, keepdim=True)
        return -F.cosine_similarity(keys, anchor, dim=-1)


@dataclass
class CoarseKeyDiffPress(kvpress.ScorerPress):
    """KeyDiff computed on keys rounded to a coarser dtype than the run's (a float8 under a 16-bit
    run: e4m3, 4 significant bits, or e5m2, 3; bfloat16 under a float32 one): the scores carry
    that dtype's rounding, not the run's."""

    compression_ratio: float = 0.0
    float8: str = "e4m3"

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        eight = torch.float8_e4m3fn if self.float8 == "e4m3" else torch.float8_e5m2
        coarse = torch.bfloat16 if keys.dtype == torch.float32 else eight
        rounded = keys.to(coarse).to(keys.dtype)
        anchor = F.normalize(rounded, p=2, dim=-1).mean(dim=2, keepdim=True)
        return -F.cosine_similarity(rounded, anchor, dim=-1)


@dataclass
class RefactoredKeyDiffPress(kvpress.ScorerPress):
    """KeyDiff written another way (the cosine as an explicit dot product over norms): right."""

    compression_ratio: float = 0.0

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        k = keys.float()
        norms = k.pow(2).sum(dim=-1, keepdim=True).sqrt().clamp_min(1e-12)
        anchor = (k / norms).mean(dim=2, keepdim=True)                                # (b, Hkv, 1, d)
        cos = (k * anchor).sum(dim=-1) / (norms[..., 0] * anchor.norm(dim=-1).clamp_min(1e-12))
        return (-cos).to(keys.dtype)


@dataclass
class PermutedRowsKeyDiffPress(kvpress.KeyDiffPress):
    """KeyDiffPress whose kept rows come back in reversed order: right (rows are compared as sets)."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        keys, values = super().compress(module, hidden_states, keys, values, attentions, kwargs)
        flip = torch.arange(keys.shape[2] - 1, -1, -1, device=keys.device)
        return keys[:, :, flip], values[:, :, flip]


@dataclass
class WideWindowSnapKVPress(kvpress.SnapKVPress):
    """SnapKV whose observation window is one token wider than its setting."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        w = self.window_size
        self.window_size = w + 1
        try:
            return super().score(module, hidden_states, keys, values, attentions, kwargs)
        finally:
            self.window_size = w


@dataclass
class CounterNotResetPress(kvpress.DecodingPress):
    """DecodingPress whose per-layer step counter is never reset: after the first round it
    compresses at every step."""

    def forward_hook(self, module, input, kwargs, output):
        count = self.layer_step_counts[module.layer_idx]
        output = super().forward_hook(module, input, kwargs, output)
        if self.layer_step_counts[module.layer_idx] == 0 and count > 0:
            self.layer_step_counts[module.layer_idx] = count + 1
        return output


@dataclass
class MovedTokenAdaKVPress(kvpress.AdaKVPress):
    """AdaKV that, after its joint selection, gives KV head 0 back its most recently evicted row and
    takes from KV head 1 its earliest kept row outside the window: one token moved between heads."""

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        keys, values = super().compress(module, hidden_states, keys, values, attentions, kwargs)
        indices = getattr(module, "masked_key_indices", None)
        if indices is None or keys.shape[1] < 2:
            return keys, values
        batch, heads, rows = (t.clone() for t in indices)
        in_head0 = torch.nonzero(heads == 0).flatten()
        if in_head0.numel() == 0:
            return keys, values
        give_back = in_head0[torch.argmax(rows[in_head0])]
        masked_1 = set(rows[heads == 1].tolist())
        take = next((r for r in range(keys.shape[2]) if r not in masked_1), None)
        if take is None:
            return keys, values
        keep = torch.ones(len(rows), dtype=torch.bool)
        keep[give_back] = False
        batch, heads, rows = batch[keep], heads[keep], rows[keep]
        module.masked_key_indices = (torch.cat([batch, batch.new_zeros(1)]), torch.cat([heads, heads.new_ones(1)]),
                                     torch.cat([rows, rows.new_tensor([take])]))
        return keys, values


def _decoding(scorer):
    return lambda: kvpress.DecodingPress(scorer())


#: The variants, wrong ones first.
VARIANTS = {v.name: v for v in (
    Variant("random scores", "keydiff", "decoding", True, _decoding(RandomScoresPress),
            "DecodingPress over seeded random scores"),
    Variant("KeyDiff anchor over the wrong window", "keydiff", "decoding", True,
            _decoding(WrongWindowKeyDiffPress), "the anchor is the mean unit key of the first half of the cache"),
    Variant("scores in a coarser dtype", "keydiff", "decoding", True, _decoding(CoarseKeyDiffPress),
            "KeyDiff on keys rounded to float8 e4m3 (bfloat16 in a float32 run)"),
    Variant("scores in a coarser dtype (e5m2)", "keydiff", "decoding", True,
            lambda: kvpress.DecodingPress(CoarseKeyDiffPress(float8="e5m2")),
            "KeyDiff on keys rounded to float8 e5m2 (bfloat16 in a float32 run)"),
    Variant("decoding counter not reset", "keydiff", "decoding", True,
            lambda: CounterNotResetPress(kvpress.KeyDiffPress()), "compresses at every step after the first round"),
    Variant("AdaKV moves a token between heads", "adakv", "prefill", True,
            lambda: MovedTokenAdaKVPress(kvpress.SnapKVPress()), "head 0 keeps one token more, head 1 one fewer"),
    Variant("SnapKV window off by one", "snapkv", "prefill", True, WideWindowSnapKVPress,
            "the observation window is w + 1 queries and protects w + 1 tokens"),
    Variant("correct KeyDiff", "keydiff", "decoding", False, _decoding(kvpress.KeyDiffPress), "kvpress's own"),
    Variant("refactored KeyDiff", "keydiff", "decoding", False, _decoding(RefactoredKeyDiffPress),
            "the cosine as a dot product over norms, in float32"),
    Variant("rows permuted", "keydiff", "decoding", False, _decoding(PermutedRowsKeyDiffPress),
            "KeyDiffPress with its kept rows reversed"),
    Variant("correct SnapKV", "snapkv", "prefill", False, kvpress.SnapKVPress, "kvpress's own"),
    Variant("correct AdaKV(SnapKV)", "adakv", "prefill", False, lambda: kvpress.AdaKVPress(kvpress.SnapKVPress()),
            "kvpress's own"),
)}
