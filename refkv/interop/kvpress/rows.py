"""Which position each cache row holds, found without trusting the press, and the candidate's arrays.

After each step every row's key and value are matched bit for bit against the rows the
layer held just before the press compressed it (presses gather rows unchanged); a row
whose key changed (``KeyRerotationPress``) is matched by its value alone. A press that
masks rows instead of removing them (``AdaKVPress``, ``CriticalAdaKVPress``: the rows
stay, ``module.masked_key_indices`` names the evicted ones) keeps the unmasked rows.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from ...model.layers import apply_rope

__all__ = ["masked_rows", "match_rows", "snapshot", "stack", "stack_states", "stack_tokens", "state_of", "step_queries"]


def match_rows(keys, values, before_keys, before_values, before_positions, inv_freq=None) -> torch.Tensor:
    """(Hkv, m) positions of the rows of ``keys``, ``values`` (Hkv, m, d), matched bit for bit to the rows before.

    A row is matched by its key and value together (equal tokens give equal layer-0 values at
    different positions; RoPE tells their keys apart); a row whose key changed (a press that
    re-rotates keys) by its value alone; a row that matches nothing is -1. Equal values (an
    equal token, layer 0) leave a value-only match ambiguous; ``KeyRerotationPress`` moves
    the key of position ``p`` to row ``j`` by RoPE's rotation of ``j - p``: the candidate
    whose key, rotated so in float64 with the model's RoPE frequencies ``inv_freq`` (d/2,),
    is nearest the row's key is taken. (The first rotary pair alone, frequency 1, is not
    enough: in float16 a pair of small magnitude turns by rounding noise, and two equal
    tokens two positions apart were once swapped.)
    """
    hkv, m, _ = values.shape

    def raw(t, h):
        return t[h].contiguous().view(torch.uint8).reshape(t.shape[1], -1).numpy()

    out = torch.full((hkv, m), -1, dtype=torch.long)
    for h in range(hkv):
        both: dict[bytes, list[int]] = {}
        alone: dict[bytes, list[int]] = {}
        bk, bv = raw(before_keys, h), raw(before_values, h)
        for i in range(bk.shape[0]):
            both.setdefault(bk[i].tobytes() + bv[i].tobytes(), []).append(i)
            alone.setdefault(bv[i].tobytes(), []).append(i)
        used: set[int] = set()
        k, v = raw(keys, h), raw(values, h)
        pending, source = [], [-1] * m  # source[j]: the row before that row j holds
        for j in range(m):
            hits = [i for i in both.get(k[j].tobytes() + v[j].tobytes(), ()) if i not in used]
            if hits:
                used.add(hits[0])
                source[j] = hits[0]
            else:
                pending.append(j)
        for j in pending:
            hits = [i for i in alone.get(v[j].tobytes(), ()) if i not in used]
            if len(hits) > 1:
                hits = [min(hits, key=lambda i: _rotation_gap(keys[h, j], before_keys[h, i],
                                                                 j - int(before_positions[h, i]), inv_freq))]
            if hits:
                used.add(hits[0])
                source[j] = hits[0]
        for j, i in enumerate(source):
            if i >= 0:
                out[h, j] = before_positions[h, i]
    return out


def masked_rows(attention_module, n_kv_heads: int, n_rows: int) -> np.ndarray | None:
    """(Hkv, n) bool: the rows a masking press evicted (``module.masked_key_indices``), or None.

    ``AdaKVPress`` and ``CriticalAdaKVPress`` leave every row in the cache and name the
    evicted ones (batch, head, row indices); kvpress's attention patch then hides them from
    every later query. The mask is reset at each prefill and replaced at each compression.
    """
    indices = getattr(attention_module, "masked_key_indices", None)
    if indices is None:
        return None
    _, heads, rows = indices
    mask = np.zeros((n_kv_heads, n_rows), dtype=bool)
    mask[heads.cpu().numpy(), rows.cpu().numpy()] = True
    return mask


def _rotation_gap(key_now, key_before, turn: int, inv_freq=None) -> float:
    """``||R(turn) key_before - key_now||^2`` in float64: RoPE's rotation by ``turn`` positions
    (pair ``(i, i + d/2)`` by ``turn * inv_freq[i]`` radians, rotate-half as transformers and
    kvpress apply it); without ``inv_freq``, the first pair alone (frequency 1)."""
    half = key_now.shape[-1] // 2
    now, was = key_now.double().cpu().numpy(), key_before.double().cpu().numpy()
    if inv_freq is None:
        now, was, freq = now[[0, half]], was[[0, half]], np.ones(1)
    else:
        freq = torch.as_tensor(inv_freq, dtype=torch.float64).cpu().numpy()
    angle = np.concatenate([turn * freq, turn * freq])                      # (d,): pair i's angle twice
    rotated = apply_rope(was, np.cos(angle), np.sin(angle))
    return float(((rotated - now) ** 2).sum())


def snapshot(cache, positions, before, scores_now, n_layers, masks=None) -> list:
    """Per layer: the positions, keys and values of the rows the layer holds, and the round's scores.

    A layer with a mask (:func:`masked_rows`) holds, per head, its unmasked rows in their
    order: heads may then hold different counts, the shorter padded with position -1.
    """
    per = []
    for layer in range(n_layers):
        pos = positions[layer].numpy().copy()                                             # (Hkv, m)
        keys = cache.layers[layer].keys[0].detach().cpu().to(torch.float64).numpy().copy()  # (Hkv, m, d)
        values = cache.layers[layer].values[0].detach().cpu().to(torch.float64).numpy().copy()
        mask = None if masks is None else masks.get(layer)
        if mask is not None:
            pos, keys, values = _unmasked(pos, keys, values, mask)
        scored = scores_now.get(layer)
        score_pos = before[layer][2].numpy() if scored is not None else None
        per.append((pos, keys, values, None if scored is None else scored.cpu().numpy(), score_pos))
    return per


def _unmasked(pos, keys, values, mask):
    """Each head's unmasked rows, in order, padded to the widest head: (Hkv, m'), (Hkv, m', d) twice."""
    hkv, _, d = keys.shape
    width = int((~mask).sum(axis=1).max())
    out_pos = np.full((hkv, width), -1, dtype=pos.dtype)
    out_keys, out_values = np.zeros((hkv, width, d)), np.zeros((hkv, width, d))
    for h in range(hkv):
        rows = np.flatnonzero(~mask[h])
        out_pos[h, :len(rows)], out_keys[h, :len(rows)], out_values[h, :len(rows)] = pos[h, rows], keys[h, rows], \
            values[h, rows]
    return out_pos, out_keys, out_values


def stack(records, logits, dtype) -> dict:
    n_rounds, n_layers = len(records), len(records[0]) if records else 0
    hkv = records[0][0][0].shape[0] if records else 0
    d = records[0][0][1].shape[2] if records else 0
    width = max((r[0].shape[1] for rec in records for r in rec), default=0)
    c_width = max((r[3].shape[1] for rec in records for r in rec if r[3] is not None), default=0)
    kept = np.full((n_rounds, n_layers, hkv, width), -1, dtype=np.int64)
    counts = np.zeros((n_rounds, n_layers), dtype=np.int64)
    # float32 holds a bfloat16, float16 or float32 model's numbers exactly (half the bytes of float64)
    exact = np.float64 if dtype == "float64" else np.float32
    row_keys = np.zeros((n_rounds, n_layers, hkv, width, d), dtype=exact)
    row_values = np.zeros((n_rounds, n_layers, hkv, width, d), dtype=exact)
    scores = np.full((n_rounds, n_layers, hkv, c_width), np.nan)
    score_pos = np.full((n_rounds, n_layers, hkv, c_width), -1, dtype=np.int64)
    for r, rec in enumerate(records):
        for layer, (pos, keys, values, s, sp) in enumerate(rec):
            m = pos.shape[1]
            kept[r, layer, :, :m] = pos
            counts[r, layer] = m
            row_keys[r, layer, :, :m] = keys
            row_values[r, layer, :, :m] = values
            if s is not None and s.shape == sp.shape:
                scores[r, layer, :, :s.shape[1]] = s
                score_pos[r, layer, :, :sp.shape[1]] = sp
    out = {"kept": kept, "kept_count": counts, "row_keys": row_keys, "row_values": row_values,
           "logits": logits.astype(np.float64 if dtype == "float64" else np.float32)}
    if c_width:
        out.update(scores=scores, score_positions=score_pos)
    return out



def step_queries(attention_module, hidden_states, position_embeddings, count: int) -> torch.Tensor:
    """(H, W, d) on the CPU: the queries of the step's last ``W = min(count, T)`` tokens, after RoPE,
    as the attention layer computes them (its ``q_proj``, its ``q_norm`` where it has one, and
    its own model family's ``apply_rotary_pos_emb``), in the model's dtype."""
    family = sys.modules[type(attention_module).__module__]
    w = min(count, hidden_states.shape[1])
    d = attention_module.head_dim
    q = attention_module.q_proj(hidden_states[:, -w:]).view(1, w, -1, d)            # (1, W, H, d)
    if getattr(attention_module, "q_norm", None) is not None:
        q = attention_module.q_norm(q)
    q = q.transpose(1, 2)                                                            # (1, H, W, d)
    cos, sin = (t[:, -w:] for t in position_embeddings)
    q, _ = family.apply_rotary_pos_emb(q, q, cos, sin)
    return q[0].detach().cpu().clone()


def state_of(before: dict, queries: dict, n_layers: int) -> list:
    """Per layer: what the round's eviction saw -- the rows' positions, keys and values before
    the press acted, and the step's last queries (None where none were recorded)."""
    return [(before[layer][2].numpy().copy(), before[layer][0], before[layer][1], queries.get(layer))
            for layer in range(n_layers)]


def stack_states(states: list) -> dict:
    """The state arrays of :mod:`refkv.oracle.ownstate` from :func:`state_of` per round.

    Keys, values and queries are stored in float32: the model's bfloat16, float16 or float32
    numbers exactly (a float64 model's in float64).
    """
    if not states:
        return {}
    n_rounds, n_layers = len(states), len(states[0])
    hkv, _, d = states[0][0][1].shape
    width = max(s[0].shape[1] for rec in states for s in rec)
    exact = np.float64 if states[0][0][1].dtype == torch.float64 else np.float32
    positions = np.full((n_rounds, n_layers, hkv, width), -1, dtype=np.int64)
    keys = np.zeros((n_rounds, n_layers, hkv, width, d), dtype=exact)
    values = np.zeros((n_rounds, n_layers, hkv, width, d), dtype=exact)
    out = {"state_positions": positions, "state_keys": keys, "state_values": values}
    q_first = next((s[3] for rec in states for s in rec if s[3] is not None), None)
    if q_first is not None:
        h = q_first.shape[0]
        out["state_queries"] = np.zeros((n_rounds, n_layers, h, max(s[3].shape[1] for rec in states for s in rec
                                                                      if s[3] is not None), d), dtype=exact)
    for r, rec in enumerate(states):
        for layer, (pos, k, v, q) in enumerate(rec):
            m = pos.shape[1]
            positions[r, layer, :, :m] = pos
            keys[r, layer, :, :m] = k.to(torch.float64).numpy()
            values[r, layer, :, :m] = v.to(torch.float64).numpy()
            if q is not None:
                # A shorter step (a decoded token) keeps its queries last, like the step's own order.
                out["state_queries"][r, layer, :, -q.shape[1]:] = q.to(torch.float64).numpy()
    return out


def stack_tokens(tokens: dict) -> dict:
    """``token_queries`` (L, H, P, d), ``token_keys``, ``token_values`` (L, Hkv, P, d): every token's
    query, key and value at every layer, from the per-step ``(q, k, v)`` of each layer, in float32
    (a 16-bit or float32 model's numbers exactly; float64 for a float64 model)."""
    layers = sorted(tokens)
    exact = np.float64 if tokens[layers[0]][0][1].dtype == torch.float64 else np.float32

    def joined(i):
        return np.stack([torch.cat([step[i] for step in tokens[layer]], dim=1).to(torch.float64).numpy()
                         for layer in layers]).astype(exact)
    return {"token_queries": joined(0), "token_keys": joined(1), "token_values": joined(2)}
