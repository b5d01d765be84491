"""Fit a press to a schedule golden, run it round by round, and write the candidate files."""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import kvpress
import numpy as np
import torch
import transformers

from ...files import OutputFolder
from ...model.config import ModelConfig
from ...oracle.endtoend import EndToEnd, is_schedule, policy_from_manifest, read_end_to_end, write_end_to_end
from ...oracle.io import read_json
from ...oracle.ownstate import query_rows, unjudgeable
from ...oracle.schema import E2E_SCHEMA, SCHEDULE_VERSION, header
from ...policies import get as get_policy
from ...schedule import Schedule
from .models import DTYPES, compression_ratio, hf_model, model_of
from .rows import masked_rows, match_rows, snapshot, stack, stack_states, stack_tokens, state_of, step_queries

__all__ = ["Skip", "fit_press", "needs_attention", "run_press", "schedule_goldens", "write_candidates"]


class Skip(ValueError):
    """The press cannot run this golden's schedule (the message says why)."""




def _inner(press, name):
    return getattr(press, name, None)


def fit_press(press, schedule: Schedule, prompt_length: int, layer_budgets: list[int] | None = None):
    """A copy of ``press`` configured to run ``schedule``; :class:`Skip` if it cannot.

    ``layer_budgets`` are the golden policy's prefill budgets per layer where they differ
    (refkv's ``pyramidkv``): ``PerLayerCompressionPress`` gets one ratio per layer that keeps
    exactly each. ``PyramidKVPress`` computes its own layer budgets from the total: it gets
    the ratio ``1 - N / n`` itself, since its schedule reads ``n * (1 - ratio)`` unrounded.
    """
    press = copy.deepcopy(press)
    one_shot = schedule.block_size is None
    if not one_shot:
        raise Skip(f"prefill in blocks of {schedule.block_size}: kvpress treats a second prompt block as "
                   f"decoding, so only one-shot prefill schedules are run")
    decodes = schedule.new_tokens > 0

    def fit_decoding(p):
        if isinstance(p, kvpress.CompressionRatioDecodingPress):
            if schedule.rule != "ratio":
                raise Skip(f"{type(p).__name__} compresses to a ratio; the golden's rule is {schedule.rule!r}")
            p.target_compression_ratio = schedule.ratio
        else:
            if schedule.rule != "interval":
                raise Skip(f"{type(p).__name__} compresses to a target size; the golden's rule is {schedule.rule!r}")
            p.target_size = schedule.budget
        p.compression_interval = schedule.interval
        return p

    if isinstance(press, kvpress.PrefillDecodingPress):
        if schedule.prefill_budget is None:
            raise Skip("PrefillDecodingPress compresses the prompt; the golden's prefill is not compressed")
        if press.prefilling_press is None or press.decoding_press is None:
            raise Skip("PrefillDecodingPress needs both a prefilling and a decoding press here")
        press.prefilling_press.compression_ratio = compression_ratio(prompt_length, schedule.prefill_budget)
        fit_decoding(press.decoding_press)
        return press
    if isinstance(press, kvpress.DecodingPress):
        if schedule.prefill_budget is not None:
            raise Skip(f"{type(press).__name__} does not compress the prompt; the golden's prefill keeps "
                       f"{schedule.prefill_budget}")
        return fit_decoding(press)
    if decodes:
        raise Skip(f"{type(press).__name__} does not compress while decoding; the golden has decoding rounds")
    if schedule.prefill_budget is None:
        raise Skip("the golden compresses nothing at prefill")
    ratio = compression_ratio(prompt_length, schedule.prefill_budget)
    if isinstance(press, kvpress.PerLayerCompressionPress):
        budgets = layer_budgets or [schedule.prefill_budget] * len(press.compression_ratios)
        if len(budgets) != len(press.compression_ratios):
            raise Skip(f"PerLayerCompressionPress has {len(press.compression_ratios)} ratios; the model "
                       f"{len(budgets)} layers")
        press.compression_ratios = [compression_ratio(prompt_length, b) for b in budgets]
        return press
    if isinstance(press, kvpress.PyramidKVPress):
        press.compression_ratio = 1 - schedule.prefill_budget / prompt_length
        return press
    if not hasattr(press, "compression_ratio"):
        raise Skip(f"{type(press).__name__} has no compression_ratio to set")
    press.compression_ratio = ratio
    return press


def needs_attention(press) -> bool:
    """Whether a press reads the attention weights (then the model runs eager attention)."""
    return any(isinstance(p, kvpress.ObservedAttentionPress) for p in _all_presses(press))


def _all_presses(press) -> list:
    out, todo = [], [press]
    while todo:
        p = todo.pop()
        out.append(p)
        for name in ("base_press", "press", "prefilling_press", "decoding_press"):
            inner = _inner(p, name)
            if inner is not None and dataclasses.is_dataclass(inner):
                todo.append(inner)
        todo.extend(getattr(p, "presses", None) or ())
    return out


def _scorers(press) -> list:
    """The ScorerPress objects inside ``press`` whose ``score`` calls are recorded."""
    return [p for p in _all_presses(press) if isinstance(p, kvpress.ScorerPress)]


def run_press(press, golden: EndToEnd | str | os.PathLike, *, dtype: str = "float32", hf=None,
              device: str = "cpu") -> dict:
    """Run ``press`` (already fitted, :func:`fit_press`) on a schedule golden; the candidate's arrays.

    The model runs on torch ``device`` (``"cuda"`` for a GPU kernel's own arithmetic); what
    is recorded is copied to the CPU after each step.

    Returns ``kept`` (R, L, Hkv, K) positions per cache row (in the rows' order),
    ``kept_count``, ``row_keys``, ``row_values`` (R, L, Hkv, K, d), ``logits`` and, when a
    scorer was called at a round, ``scores`` with ``score_positions`` (R, L, Hkv, C).
    """
    g = golden if isinstance(golden, EndToEnd) else read_end_to_end(golden)
    if not is_schedule(g.manifest):
        raise ValueError(f"{g.path} is not a schedule golden (it has no 'schedule')")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if hf is None:
        hf = hf_model(model_of(g.manifest), dtype, "eager" if needs_attention(press) else "sdpa")
    hf = hf.to(device)
    prompt, new = g.arrays["prompt"], g.arrays["decode"]
    round_steps = [int(s) for s in g.arrays["round_step"]]
    n_layers = hf.config.num_hidden_layers
    inv_freq = hf.model.rotary_emb.inv_freq.detach().cpu().double()  # (d/2,): to match re-rotated rows
    cache = transformers.DynamicCache(config=hf.config)
    positions = [None] * n_layers                      # (Hkv, n) int64 per layer, rows' positions
    before: dict[int, tuple] = {}                      # layer -> (values, positions) before the press acted
    step_positions = {"first": 0, "count": 0, "round": False}
    scores_now: dict[int, tuple] = {}
    # What each round's eviction saw, for the check on the candidate's own state
    # (refkv.oracle.ownstate): the rows before the press acted, and the step's last queries
    # where the golden's policy reads attention rows.
    # A policy one round's state cannot judge (per-token state, the step's own queries) is
    # replayed from every token's query, key and value at every layer.
    policy = policy_from_manifest(g.manifest)
    n_queries = query_rows(policy)
    queries_now: dict[int, torch.Tensor] = {}
    replay = unjudgeable(policy, ModelConfig(**g.manifest["model"]["config"])) is not None
    per_token: dict[int, list] = {layer: [] for layer in range(n_layers)}

    def pre_press(module, args, kwargs, output):       # runs before the press's hook (registered first)
        layer = module.layer_idx
        keys = cache.layers[layer].keys[0].detach().cpu().clone()                   # (Hkv, n, d)
        values = cache.layers[layer].values[0].detach().cpu().clone()
        new_pos = torch.arange(step_positions["first"], step_positions["first"] + step_positions["count"])
        old = positions[layer] if positions[layer] is not None else torch.zeros(values.shape[0], 0, dtype=torch.long)
        pos = torch.cat([old, new_pos.expand(values.shape[0], -1)], dim=1)
        before[layer] = (keys, values, pos)
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if step_positions["round"] and n_queries:
            queries_now[layer] = step_queries(module, hidden, kwargs["position_embeddings"], n_queries)
        if replay:
            count = step_positions["count"]
            per_token[layer].append((step_queries(module, hidden, kwargs["position_embeddings"], count),
                                  keys[:, -count:], values[:, -count:]))
        return output

    handles = [layer.self_attn.register_forward_hook(pre_press, with_kwargs=True) for layer in hf.model.layers]
    scorers = _scorers(press)
    originals = {id(s): s.score for s in scorers}

    def recording(scorer):
        original = originals[id(scorer)]

        def score(module, hidden_states, keys, values, attentions, kwargs):
            s = original(module, hidden_states, keys, values, attentions, kwargs)
            scores_now[module.layer_idx] = s[0].detach().cpu().to(torch.float64).clone()
            return s
        return score

    for s in scorers:
        s.score = recording(s)
    records, states = [], []
    try:
        with torch.no_grad(), press(hf):
            feeds = [prompt, *([int(t)] for t in new)]
            first = 0
            for step, tokens in enumerate(feeds):
                step_positions.update(first=first, count=len(tokens), round=step in round_steps)
                scores_now.clear()
                queries_now.clear()
                ids = torch.tensor(np.asarray(tokens, dtype=np.int64)[None, :], device=device)
                pos_ids = torch.arange(first, first + len(tokens), device=device)[None, :]
                out = hf(input_ids=ids, past_key_values=cache, position_ids=pos_ids, use_cache=True)
                first += len(tokens)
                for layer in range(n_layers):
                    keys_now, values_now = cache.layers[layer].keys[0].cpu(), cache.layers[layer].values[0].cpu()
                    b_keys, b_values, b_pos = before[layer]
                    if torch.equal(keys_now, b_keys) and torch.equal(values_now, b_values):
                        positions[layer] = b_pos  # the press left the rows as they were
                    else:
                        positions[layer] = match_rows(keys_now, values_now, b_keys, b_values, b_pos, inv_freq)
                if step in round_steps:
                    masks = {layer: masked_rows(hf.model.layers[layer].self_attn, *positions[layer].shape)
                             for layer in range(n_layers)}
                    records.append(snapshot(cache, positions, before, scores_now, n_layers, masks))
                    states.append(state_of(before, queries_now, n_layers))
            logits = out.logits[0, -1].cpu().to(torch.float64).numpy()
    finally:
        for h in handles:
            h.remove()
        for s in scorers:
            s.score = originals[id(s)]
    return {**stack(records, logits, dtype), **stack_states(states), **(stack_tokens(per_token) if replay else {})}



def schedule_goldens(reference, policy: str | None = None) -> list[tuple[str, EndToEnd]]:
    """``(relative path, golden)`` of every schedule golden under folder ``reference`` (of ``policy``)."""
    reference = Path(reference)
    out = []
    for path in sorted(reference.rglob("*.json")):
        if path.name == "suite.json":
            continue
        # Only a file that is not a schedule golden at all is passed over (vectors, a weights
        # manifest); a schedule golden that fails its reading -- a checksum, a corrupted .npz,
        # a bad manifest -- is an error naming the file, never "no schedule golden here".
        head = read_json(path)  # a .json file there that is not JSON at all is an error too
        if head.get("schema") != E2E_SCHEMA or not is_schedule(head):
            continue
        g = read_end_to_end(path)
        name = g.manifest["policy"].get("name") if isinstance(g.manifest.get("policy"), dict) else None
        if policy is None or name == policy:
            out.append((path.relative_to(reference).as_posix(), g))
    return out


def _layer_budgets(manifest: dict, schedule: Schedule) -> list[int] | None:
    """The golden policy's prefill budget per layer, where it has its own (``pyramidkv``)."""
    policy = get_policy(manifest["policy"]["name"], **manifest["policy"]["params"])
    if schedule.prefill_budget is None or not hasattr(policy, "layer_budgets"):
        return None
    return policy.layer_budgets(schedule.prefill_budget, int(manifest["model"]["config"]["n_layers"]))


def write_candidates(press, reference, out, *, policy: str, dtype: str = "float32",
                     golden_dtype: str | None = None, row_keys: bool = True, declare: dict | None = None,
                     progress=print, device: str = "cpu") -> dict:
    """Run ``press`` on every schedule golden of ``policy`` under ``reference`` it can run; write candidates.

    Parameters
    ----------
    press : kvpress press
        Fitted to each golden's schedule (:func:`fit_press`); the argument is not changed.
    reference, out : path-like
        The golden folder (``refkv golden generate``) and the candidate folder to write
        (same relative paths).
    policy : str
        The refkv policy the press is compared with.
    dtype : str
        The torch dtype the press runs in (``computed_dtype`` of the files).
    golden_dtype : str, optional
        Only goldens of this dtype (default: all; a float32 press is checked against a
        float64 golden with tolerances scaled to float32).
    row_keys : bool
        Write the rows' keys (checked against the position each row claims). ``False`` for a
        press that changes kept keys by design (``KeyRerotationPress`` re-rotates them).
    declare : dict, optional
        Declared differences written into the files (``{"kept_only": True}``: logits and
        scores not compared).
    device : str
        The torch device the model and the press run on (``"cpu"``, ``"cuda"``).

    Returns
    -------
    dict
        ``{"written": [paths], "skipped": {path: reason}}``.
    """
    written, skipped = [], {}
    found = schedule_goldens(reference, policy)
    if not found:
        raise ValueError(f"{reference} holds no schedule golden of policy {policy!r} (refkv golden generate "
                         f"--out {reference} --policies {policy})")
    folder = OutputFolder(out, inputs=[reference], what="candidate folder")
    for rel, _ in found:  # no symlinked component below out, not into the goldens: refused before any run
        folder.check_replaceable(rel), folder.check_replaceable(rel[:-len(".json")] + ".npz")
    models: dict = {}
    for rel, g in found:
        if golden_dtype is not None and g.manifest["dtype"] != golden_dtype:
            continue
        sched = Schedule.from_dict(g.manifest["schedule"])
        try:
            fitted = fit_press(press, sched, len(g.arrays["prompt"]), _layer_budgets(g.manifest, sched))
        except Skip as why:
            skipped[rel] = str(why)
            continue
        attention = "eager" if needs_attention(fitted) else "sdpa"
        key = repr(g.manifest["model"].get("builder")), g.manifest["model"].get("seed"), attention
        if key not in models:
            models[key] = hf_model(model_of(g.manifest), dtype, attention).to(device)
        arrays = run_press(fitted, g, dtype=dtype, hf=models[key], device=device)
        if not row_keys:
            del arrays["row_keys"]
        manifest = {**header(E2E_SCHEMA, SCHEDULE_VERSION), "computed_dtype": dtype, **(
                    {"declare": dict(declare)} if declare else {}),
                    "candidate": {"press": repr(fitted), "kvpress_version": getattr(kvpress, "__version__", "?"),
                                  "transformers_version": transformers.__version__}}
        write_end_to_end(folder / rel, manifest, arrays, compresslevel=1)
        written.append(str(folder.path(rel)))
        if progress is not None:
            progress(f"{rel}: {type(fitted).__name__} ran {len(arrays['kept'])} rounds")
    if progress is not None:
        for rel, why in skipped.items():
            progress(f"{rel}: skipped: {why}")
    return {"written": written, "skipped": skipped}

