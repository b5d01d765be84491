"""Recording end-to-end goldens: run a model under a policy and keep every eviction decision.

:func:`run_end_to_end` records block prompt processing (or one-shot prefill) of a seeded
prompt; :func:`run_schedule_golden` a run under a compression schedule
(:mod:`refkv.schedule`), round by round. Both return a manifest and the arrays
:func:`refkv.oracle.endtoend.write_end_to_end` writes (the format is in
:mod:`refkv.oracle.endtoend`).
"""

from __future__ import annotations

import numpy as np

from ..engine import Engine, blocks
from ..model import Model
from ..policies import Policy
from ..schedule import run_schedule
from ..validation import check_lengths
from .encode import boundary_gap
from .endtoend import PRINT_RULE, PRINT_SEED, fingerprints
from .models import DECODE_RULE, PROMPT_RULE, WEIGHTS_RULE, build_model, decode_tokens, prompt_tokens
from .schema import E2E_SCHEMA, FLOAT_FORMAT, SCHEDULE_VERSION, header
from .tolerance import e2e_tolerance
from .vectors import json_params

__all__ = ["run_end_to_end", "run_schedule_golden"]


def run_end_to_end(policy: Policy, *, budget: int | None, block_size: int | None, dtype="float64",
                   prompt_length: int = 40, model_seed: int = 0, prompt_seed: int = 1,
                   model: str = "tiny") -> tuple[dict, dict]:
    """Run a model of :data:`~refkv.oracle.models.MODELS` (default ``tiny``) under ``policy``; record a golden.

    ``block_size=None`` is one-shot prefill: the whole prompt attends (full square causal
    attention), then each layer evicts once to ``budget``.

    Returns
    -------
    manifest : dict
        Without the ``arrays`` entry (added by :func:`write_end_to_end`).
    arrays : dict of str to ndarray

    Raises
    ------
    ValueError
        If the policy refuses the budget or the block size (the engine's errors).
    """
    builder = model
    model = build_model(builder, model_seed, dtype)
    cfg = model.config
    prompt = prompt_tokens(prompt_seed, prompt_length, cfg.vocab_size)
    engine = Engine(model, policy, budget, record="views")
    logits = engine.prefill(prompt, block_size)
    n_blocks = len(engine.trace.kept)
    if n_blocks != len(blocks(prompt, block_size)):
        raise RuntimeError("the trace does not hold one entry per block")
    log: dict = {}
    for event in engine.trace.evictions:  # at most one per (block, layer): the engine evicts once per step
        key = (event.block, event.layer)
        if key in log:
            raise RuntimeError(f"two evictions in block {event.block}, layer {event.layer}")
        view = event.view
        log[key] = (event.positions, np.asarray(policy.score(view), dtype=np.float64),
                    np.asarray(policy.protected(view), dtype=bool), event.kept)

    hkv, n_layers = cfg.n_kv_heads, cfg.n_layers
    kept_width = max(k.shape[1] for per_block in engine.trace.kept for k in per_block)
    cand_width = max((entry[0].shape[1] for entry in log.values()), default=0)
    kept = np.full((n_blocks, n_layers, hkv, kept_width), -1, dtype=np.int64)
    kept_count = np.zeros((n_blocks, n_layers), dtype=np.int64)
    candidates = np.full((n_blocks, n_layers, hkv, cand_width), -1, dtype=np.int64)
    candidate_count = np.zeros((n_blocks, n_layers), dtype=np.int64)
    scores = np.full((n_blocks, n_layers, hkv, cand_width), np.nan)
    protected = np.zeros((n_blocks, n_layers, hkv, cand_width), dtype=bool)
    closest = None
    for b, per_block in enumerate(engine.trace.kept):
        for layer, positions in enumerate(per_block):
            kept[b, layer, :, :positions.shape[1]] = positions
            kept_count[b, layer] = positions.shape[1]
            if (b, layer) in log:
                closest = _store_eviction(log[(b, layer)], (b, layer), candidates, candidate_count, scores,
                                          protected, closest, "block")

    tol_scores = e2e_tolerance(dtype, scores)
    manifest = {
        **header(E2E_SCHEMA),
        "float_format": FLOAT_FORMAT,
        "dtype": np.dtype(dtype).name,
        "model": {"name": cfg.name, "builder": builder, "config": cfg.to_dict(), "seed": model_seed,
                  "weights": WEIGHTS_RULE},
        "prompt": {"length": prompt_length, "seed": prompt_seed, "rule": PROMPT_RULE},
        "policy": {"name": policy.name, "params": json_params(policy.params()), "needs": sorted(policy.needs),
                   "evict_before_attention": bool(policy.evict_before_attention)},
        "budget": budget,
        "block_size": block_size,
        "mode": "oneshot" if n_blocks == 1 else "block",
        "n_blocks": n_blocks,
        "evictions": int((candidate_count > 0).sum()),
        "tolerance": {"logits": e2e_tolerance(dtype, logits), "scores": tol_scores},
        "closest_call": closest,
    }
    arrays = {"prompt": prompt, "kept": kept, "kept_count": kept_count, "candidates": candidates,
              "candidate_count": candidate_count, "scores": scores, "protected": protected,
              "logits": np.asarray(logits)}
    return manifest, arrays

def _store_eviction(entry, at, candidates, candidate_count, scores, protected, closest, step_name):
    """Write one recorded eviction (candidates, scores, protected flags; ``entry`` as logged
    from the trace) into the golden's arrays at ``at`` = (step, layer), and return the
    closest call so far (the smallest gap at a kept/evicted boundary), updated."""
    cand, s, prot, cols = entry
    c = cand.shape[1]
    candidates[at][:, :c] = cand
    candidate_count[at] = c
    scores[at][:, :c] = s
    protected[at][:, :c] = prot
    for h, gap in enumerate(boundary_gap(s, cols, prot)):
        if gap is not None and (closest is None or gap < closest["gap"]):
            closest = {step_name: at[0], "layer": at[1], "head": h, "gap": gap}
    return closest


def run_schedule_golden(policy: Policy, schedule, *, dtype="float64", prompt_length: int = 24,
                        model_seed: int = 0, prompt_seed: int = 1, decode_seed: int = 2,
                        model: str = "tiny", built: Model | None = None) -> tuple[dict, dict]:
    """Run a model under ``policy`` and :class:`refkv.schedule.Schedule` ``schedule``; record a golden.

    Arrays (``R`` rounds, see :mod:`refkv.schedule`; per round, layer and KV head):

    ====================  ==============================  ======================================
    array                 shape                           meaning
    ====================  ==============================  ======================================
    ``prompt``            (T,) int64                      the prompt
    ``decode``            (D,) int64                      the tokens fed one at a time after it
    ``round_step``        (R,) int64                      forward call of each round (prefill
                                                          blocks first, from 0)
    ``round_position``    (R,) int64                      tokens processed after the round
    ``kept``              (R, L, Hkv, K) int64            positions held after the round,
                                                          increasing, padded with -1
    ``kept_count``        (R, L) int64
    ``candidates``        (R, L, Hkv, C) int64            positions offered to the round's
                                                          eviction (candidate_count 0: none)
    ``candidate_count``   (R, L) int64
    ``scores``            (R, L, Hkv, C) float64          reference scores of the candidates
    ``protected``         (R, L, Hkv, C) bool
    ``key_print``         (R, L, Hkv, K) float64          fingerprint of the key each kept
                                                          position holds (:data:`~refkv.oracle.endtoend.PRINT_RULE`)
    ``value_print``       (R, L, Hkv, K) float64          the same for its value
    ``logits``            (vocab,) model dtype            logits of the last token fed
    ====================  ==============================  ======================================

    ``built`` is a model already built (a real checkpoint); ``model`` then only names it.
    """
    builder = model
    model = built if built is not None else build_model(builder, model_seed, dtype)
    cfg = model.config
    # Before the prompt, the tokens or any round is sized by them (a golden past the context
    # would record positions the model was never trained for).
    check_lengths({"prompt_length": (prompt_length, 1), "new_tokens": (schedule.new_tokens, 0),
                   "interval": (schedule.interval, 1), "block_size": (schedule.block_size, 1)},
                  cfg.max_positions, model=builder, within=("prompt_length", "new_tokens"))
    prompt = prompt_tokens(prompt_seed, prompt_length, cfg.vocab_size)
    new = decode_tokens(decode_seed, schedule.new_tokens, cfg.vocab_size)
    engine = Engine(model, policy, None, record="views")
    snapshots: list[tuple] = []

    def on_step(step, rnd):
        if rnd is not None:
            # Empty slots of an uneven cache (AdaKV, PyramidKV) are recorded as -1, like the padding.
            snapshots.append((rnd, [(c.positions_or(-1), c.keys.copy(), c.values.copy()) for c in engine.caches]))

    logits, rounds = run_schedule(engine, prompt, new, schedule, on_step=on_step)
    by_step = {r.step: i for i, r in enumerate(rounds)}
    log: dict = {}
    for event in engine.trace.evictions:
        key = (by_step[event.block], event.layer)
        if key in log:
            raise RuntimeError(f"two evictions in round {key[0]}, layer {key[1]}")
        view = event.view
        log[key] = (event.positions, np.asarray(policy.score(view), dtype=np.float64),
                    np.asarray(policy.protected(view), dtype=bool), event.kept)

    n_rounds, n_layers, hkv = len(rounds), cfg.n_layers, cfg.n_kv_heads
    kept_width = max((s[0].shape[1] for _, per in snapshots for s in per), default=0)
    cand_width = max((entry[0].shape[1] for entry in log.values()), default=0)
    kept = np.full((n_rounds, n_layers, hkv, kept_width), -1, dtype=np.int64)
    kept_count = np.zeros((n_rounds, n_layers), dtype=np.int64)
    key_print = np.full((n_rounds, n_layers, hkv, kept_width), np.nan)
    value_print = np.full((n_rounds, n_layers, hkv, kept_width), np.nan)
    candidates = np.full((n_rounds, n_layers, hkv, cand_width), -1, dtype=np.int64)
    candidate_count = np.zeros((n_rounds, n_layers), dtype=np.int64)
    scores = np.full((n_rounds, n_layers, hkv, cand_width), np.nan)
    protected = np.zeros((n_rounds, n_layers, hkv, cand_width), dtype=bool)
    closest = None
    for r, (_, per_layer) in enumerate(snapshots):
        for layer, (positions, keys, values) in enumerate(per_layer):
            n = positions.shape[1]
            kept[r, layer, :, :n] = positions
            kept_count[r, layer] = n
            real = positions >= 0  # (Hkv, n): False at an empty slot, whose print stays NaN
            key_print[r, layer, :, :n] = np.where(real, fingerprints(keys, cfg.d_head), np.nan)
            value_print[r, layer, :, :n] = np.where(real, fingerprints(values, cfg.d_head), np.nan)
            if (r, layer) in log:
                closest = _store_eviction(log[(r, layer)], (r, layer), candidates, candidate_count, scores,
                                          protected, closest, "round")

    prints = np.concatenate([key_print.ravel(), value_print.ravel()])
    manifest = {
        **header(E2E_SCHEMA, SCHEDULE_VERSION),
        "float_format": FLOAT_FORMAT,
        "dtype": np.dtype(model.dtype).name,
        "model": {"name": cfg.name, "builder": builder, "config": cfg.to_dict(), "seed": model_seed,
                  "weights": WEIGHTS_RULE if built is None else f"the checkpoint {builder}"},
        "prompt": {"length": len(prompt), "seed": prompt_seed, "rule": PROMPT_RULE},
        "decode": {"length": schedule.new_tokens, "seed": decode_seed, "rule": DECODE_RULE,
                   "note": "teacher-forced: the candidate feeds these tokens one at a time after the prompt"},
        "policy": {"name": policy.name, "params": json_params(policy.params()), "needs": sorted(policy.needs),
                   "evict_before_attention": bool(policy.evict_before_attention)},
        "schedule": schedule.to_dict(),
        "schedule_text": schedule.describe(),
        "budget": schedule.budget,
        "block_size": schedule.block_size,
        "mode": "schedule",
        "rounds": [{"step": r.step, "phase": r.phase, "budget": r.budget, "position": r.position} for r in rounds],
        "n_rounds": n_rounds,
        "evictions": int((candidate_count > 0).sum()),
        "prints": {"rule": PRINT_RULE, "seed": PRINT_SEED},
        "tolerance": {"logits": e2e_tolerance(model.dtype, logits), "scores": e2e_tolerance(model.dtype, scores),
                      "prints": e2e_tolerance(model.dtype, prints)},
        "closest_call": closest,
    }
    arrays = {"prompt": prompt, "decode": new, "round_step": np.array([r.step for r in rounds], dtype=np.int64),
              "round_position": np.array([r.position for r in rounds], dtype=np.int64), "kept": kept,
              "kept_count": kept_count, "candidates": candidates, "candidate_count": candidate_count,
              "scores": scores, "protected": protected, "key_print": key_print, "value_print": value_print,
              "logits": np.asarray(logits)}
    return manifest, arrays

