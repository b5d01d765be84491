"""Check an NVIDIA kvpress press against refkv's schedule goldens, end to end.

A kvpress developer checks a press in a few lines::

    from kvpress import DecodingPress, KeyDiffPress
    from refkv.interop.kvpress import write_candidates

    # goldens made once with: refkv golden generate --out goldens --policies keydiff
    write_candidates(DecodingPress(KeyDiffPress()), "goldens", "candidate", policy="keydiff")
    # then: refkv golden check candidate --against goldens --dtype float32

:func:`write_candidates` finds the policy's schedule goldens (:mod:`refkv.schedule`) that
the press can run, fits the press to each golden's schedule (:func:`fit_press`: the
compression interval, target size or ratio, and the prefill ratio that keeps the golden's
prefill budget), builds the golden's model in ``transformers`` from refkv's weights
(:func:`hf_model`), feeds the golden's prompt and then its decoding tokens one at a time
inside the press's context, and records after every round, per layer and KV head, which
**position each cache row holds**, the rows' keys and values, and the press's scores where
its scorer exposes them. The candidate files mirror the goldens' paths, so ``refkv golden
check`` reads them.

Which position a row holds is found without trusting the press: after each step every
row's **value** is matched bit for bit against the rows the layer held just before the
press compressed it (a forward hook registered before the press's own), since presses
gather values unchanged (``KeyRerotationPress`` changes keys, not values). A row that
matches nothing is written as position -1, which the check reports.

Schedules a press can run (others are skipped, with the reason):

* ``DecodingPress``: prefill one-shot and not compressed, ``rule="interval"``;
* ``CompressionRatioDecodingPress``: the same with ``rule="ratio"``;
* ``PrefillDecodingPress``: one-shot prefill compressed to the golden's prefill budget
  (its prefilling press's ``compression_ratio`` is set to keep exactly that many), then
  its decoding press as above;
* a press without decoding (any ``ScorerPress`` and prefill wrappers): one-shot prefill
  with a budget and no decoding rounds.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import kvpress  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from ..oracle.endtoend import EndToEnd, build_model, is_schedule, read_end_to_end, write_end_to_end  # noqa: E402
from ..oracle.hfexport import hf_config_dict, hf_tensors  # noqa: E402
from ..oracle.schema import E2E_SCHEMA, SCHEDULE_VERSION, header  # noqa: E402
from ..schedule import Schedule  # noqa: E402

__all__ = ["DTYPES", "Skip", "compression_ratio", "fit_press", "hf_model", "model_of", "run_press",
           "schedule_goldens", "write_candidates"]

#: The torch dtypes a press can run in.
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


class Skip(ValueError):
    """The press cannot run this golden's schedule (the message says why)."""


def compression_ratio(n: int, keep: int) -> float:
    """The ratio for which kvpress keeps exactly ``keep`` of ``n`` tokens (``compute_n_kept`` truncates)."""
    if keep >= n:
        return 0.0
    return (n - keep - 0.5) / n


def hf_model(model, dtype: str = "float32"):
    """A transformers model (Llama, Qwen2 or Qwen3 by its features) holding refkv ``model``'s weights.

    Eager attention, so that presses reading attention weights get them.
    """
    cfg_dict = hf_config_dict(model.config, "float32")
    cfg_dict = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "torch_dtype")}
    config = transformers.AutoConfig.for_model(**cfg_dict)
    config._attn_implementation = "eager"
    cls = getattr(transformers, hf_config_dict(model.config)["architectures"][0])
    hf = cls(config).eval()
    state = {name: torch.from_numpy(np.array(a, dtype=np.float64, order="C")) for name, a in hf_tensors(model).items()}
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not fit {cls.__name__}: missing {missing}, unexpected {unexpected}")
    return hf.to(DTYPES[dtype])


def model_of(manifest: dict):
    """The refkv model a golden was generated with (a built-in tiny model, or its checkpoint)."""
    m = manifest["model"]
    builder = m.get("builder", "tiny")
    try:
        return build_model(builder, m.get("seed", 0), "float64")
    except ValueError:
        from ..model import load

        return load(builder, dtype=np.float64)


def _inner(press, name):
    return getattr(press, name, None)


def fit_press(press, schedule: Schedule, prompt_length: int):
    """A copy of ``press`` configured to run ``schedule``; :class:`Skip` if it cannot."""
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
    if not hasattr(press, "compression_ratio"):
        raise Skip(f"{type(press).__name__} has no compression_ratio to set")
    press.compression_ratio = compression_ratio(prompt_length, schedule.prefill_budget)
    return press


def _scorers(press) -> list:
    """The ScorerPress objects inside ``press`` whose ``score`` calls are recorded."""
    out, todo = [], [press]
    while todo:
        p = todo.pop()
        if isinstance(p, kvpress.ScorerPress):
            out.append(p)
        for name in ("base_press", "press", "prefilling_press", "decoding_press"):
            inner = _inner(p, name)
            if inner is not None and dataclasses.is_dataclass(inner):
                todo.append(inner)
        for inner in getattr(p, "presses", None) or ():
            todo.append(inner)
    return out


def run_press(press, golden: EndToEnd | str | os.PathLike, *, dtype: str = "float32", hf=None) -> dict:
    """Run ``press`` (already fitted, :func:`fit_press`) on a schedule golden; the candidate's arrays.

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
        hf = hf_model(model_of(g.manifest), dtype)
    prompt, new = g.arrays["prompt"], g.arrays["decode"]
    round_steps = [int(s) for s in g.arrays["round_step"]]
    n_layers = hf.config.num_hidden_layers
    cache = transformers.DynamicCache(config=hf.config)
    positions = [None] * n_layers                      # (Hkv, n) int64 per layer, rows' positions
    before: dict[int, tuple] = {}                      # layer -> (values, positions) before the press acted
    step_positions = {"first": 0, "count": 0}
    scores_now: dict[int, tuple] = {}

    def pre_press(module, args, kwargs, output):       # runs before the press's hook (registered first)
        layer = module.layer_idx
        values = cache.layers[layer].values[0].detach().clone()                     # (Hkv, n, d)
        new_pos = torch.arange(step_positions["first"], step_positions["first"] + step_positions["count"])
        old = positions[layer] if positions[layer] is not None else torch.zeros(values.shape[0], 0, dtype=torch.long)
        pos = torch.cat([old, new_pos.expand(values.shape[0], -1)], dim=1)
        before[layer] = (values, pos)
        return output

    handles = [layer.self_attn.register_forward_hook(pre_press, with_kwargs=True) for layer in hf.model.layers]
    scorers = _scorers(press)
    originals = {id(s): s.score for s in scorers}

    def recording(scorer):
        original = originals[id(scorer)]

        def score(module, hidden_states, keys, values, attentions, kwargs):
            s = original(module, hidden_states, keys, values, attentions, kwargs)
            scores_now[module.layer_idx] = s[0].detach().to(torch.float64).clone()
            return s
        return score

    for s in scorers:
        s.score = recording(s)
    records = []
    try:
        with torch.no_grad(), press(hf):
            feeds = [prompt] + [[int(t)] for t in new]
            first = 0
            for step, tokens in enumerate(feeds):
                step_positions.update(first=first, count=len(tokens))
                scores_now.clear()
                ids = torch.tensor(np.asarray(tokens, dtype=np.int64)[None, :])
                pos_ids = torch.arange(first, first + len(tokens))[None, :]
                out = hf(input_ids=ids, past_key_values=cache, position_ids=pos_ids, use_cache=True)
                first += len(tokens)
                for layer in range(n_layers):
                    positions[layer] = _match_rows(cache.layers[layer].values[0], *before[layer])
                if step in round_steps:
                    records.append(_snapshot(cache, positions, before, scores_now, n_layers))
            logits = out.logits[0, -1].to(torch.float64).numpy()
    finally:
        for h in handles:
            h.remove()
        for s in scorers:
            s.score = originals[id(s)]
    return _stack(records, logits, dtype)


def _match_rows(values, before_values, before_positions) -> torch.Tensor:
    """(Hkv, m) positions of the rows of ``values`` (Hkv, m, d): each matched bit for bit to a row before."""
    hkv, m, _ = values.shape
    out = torch.full((hkv, m), -1, dtype=torch.long)
    for h in range(hkv):
        index: dict[bytes, list[int]] = {}
        raw_before = before_values[h].contiguous().view(torch.uint8).reshape(before_values.shape[1], -1).numpy()
        for i, row in enumerate(raw_before):
            index.setdefault(row.tobytes(), []).append(i)
        raw = values[h].contiguous().view(torch.uint8).reshape(m, -1).numpy()
        for j, row in enumerate(raw):
            hits = index.get(row.tobytes())
            if hits:
                out[h, j] = before_positions[h, hits.pop(0)]
    return out


def _snapshot(cache, positions, before, scores_now, n_layers) -> list:
    per = []
    for layer in range(n_layers):
        keys = cache.layers[layer].keys[0].detach().to(torch.float64).numpy().copy()      # (Hkv, m, d)
        values = cache.layers[layer].values[0].detach().to(torch.float64).numpy().copy()
        scored = scores_now.get(layer)
        score_pos = before[layer][1].numpy() if scored is not None else None
        per.append((positions[layer].numpy().copy(), keys, values,
                    None if scored is None else scored.numpy(), score_pos))
    return per


def _stack(records, logits, dtype) -> dict:
    n_rounds, n_layers = len(records), len(records[0]) if records else 0
    hkv = records[0][0][0].shape[0] if records else 0
    d = records[0][0][1].shape[2] if records else 0
    width = max((r[0].shape[1] for rec in records for r in rec), default=0)
    c_width = max((r[3].shape[1] for rec in records for r in rec if r[3] is not None), default=0)
    kept = np.full((n_rounds, n_layers, hkv, width), -1, dtype=np.int64)
    counts = np.zeros((n_rounds, n_layers), dtype=np.int64)
    row_keys = np.zeros((n_rounds, n_layers, hkv, width, d))
    row_values = np.zeros((n_rounds, n_layers, hkv, width, d))
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


def schedule_goldens(reference, policy: str | None = None) -> list[tuple[str, EndToEnd]]:
    """``(relative path, golden)`` of every schedule golden under folder ``reference`` (of ``policy``)."""
    reference = Path(reference)
    out = []
    for path in sorted(reference.rglob("*.json")):
        if path.name == "suite.json":
            continue
        try:
            g = read_end_to_end(path)
        except ValueError:
            continue
        if is_schedule(g.manifest) and (policy is None or g.manifest["policy"]["name"] == policy):
            out.append((path.relative_to(reference).as_posix(), g))
    return out


def write_candidates(press, reference, out, *, policy: str, dtype: str = "float32",
                     golden_dtype: str | None = None, progress=print) -> dict:
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
    models: dict = {}
    for rel, g in found:
        if golden_dtype is not None and g.manifest["dtype"] != golden_dtype:
            continue
        sched = Schedule.from_dict(g.manifest["schedule"])
        try:
            fitted = fit_press(press, sched, len(g.arrays["prompt"]))
        except Skip as why:
            skipped[rel] = str(why)
            continue
        key = repr(g.manifest["model"].get("builder")), g.manifest["model"].get("seed")
        if key not in models:
            models[key] = hf_model(model_of(g.manifest), dtype)
        arrays = run_press(fitted, g, dtype=dtype, hf=models[key])
        manifest = {**header(E2E_SCHEMA, SCHEDULE_VERSION), "computed_dtype": dtype,
                    "candidate": {"press": repr(fitted), "kvpress_version": getattr(kvpress, "__version__", "?"),
                                  "transformers_version": transformers.__version__}}
        target = Path(out) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        write_end_to_end(target, manifest, arrays)
        written.append(str(target))
        if progress is not None:
            progress(f"{rel}: {type(fitted).__name__} ran {len(arrays['kept'])} rounds")
    if progress is not None:
        for rel, why in skipped.items():
            progress(f"{rel}: skipped: {why}")
    return {"written": written, "skipped": skipped}
