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
row's key and value are matched bit for bit against the rows the layer held just before
the press compressed it (a forward hook registered before the press's own), since presses
gather rows unchanged; a row whose key changed (``KeyRerotationPress`` re-rotates keys) is
matched by its value alone. A row that matches nothing is written as position -1, which
the check reports.

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
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import kvpress
import torch
import transformers

from ..oracle.encode import encode_case, vectors_document
from ..oracle.endtoend import EndToEnd, is_schedule, read_end_to_end, write_end_to_end
from ..oracle.hfexport import hf_config_dict, hf_tensors
from ..oracle.io import write_json
from ..oracle.models import build_model
from ..oracle.schema import E2E_SCHEMA, SCHEDULE_VERSION, header
from ..oracle.synthetic import (
    duplicate_key,
    huge_logits,
    near_duplicate_key,
    plant_huge_logit,
    random_tokens,
    replay,
    zero_key,
)
from ..policies import get as get_policy
from ..policies import select
from ..schedule import Schedule
from ..testing import assert_case, load_cases

__all__ = ["CASE_DTYPE", "DEFECTS", "DTYPES", "PAIRINGS", "Defect", "Pairing", "Skip", "ToleranceGap", "check",
           "compression_ratio", "docs_blocks", "fit_press", "hf_model", "model_of", "oneshot_documents", "outcome",
           "press_outputs", "run_press", "schedule_goldens", "tally", "write_candidates", "write_oneshot_suite"]

#: The torch dtypes a press can run in (bf16 and fp16 are checked on the float32 cases).
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


class Skip(ValueError):
    """The press cannot run this golden's schedule (the message says why)."""


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


def hf_model(model, dtype: str = "float32", attention: str = "eager"):
    """A transformers model (Llama, Qwen2 or Qwen3 by its features) holding refkv ``model``'s weights.

    ``attention="eager"`` materialises the attention weights (presses that read them need
    it); ``"sdpa"`` does not (``BlockPress`` and ``ChunkPress`` refuse attention weights).
    """
    cfg_dict = hf_config_dict(model.config, "float32")
    cfg_dict = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "torch_dtype")}
    config = transformers.AutoConfig.for_model(**cfg_dict)
    config._attn_implementation = attention
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
    ratio = compression_ratio(prompt_length, schedule.prefill_budget)
    if isinstance(press, kvpress.PerLayerCompressionPress):
        press.compression_ratios = [ratio] * len(press.compression_ratios)
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
        hf = hf_model(model_of(g.manifest), dtype, "eager" if needs_attention(press) else "sdpa")
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
        keys = cache.layers[layer].keys[0].detach().clone()                         # (Hkv, n, d)
        values = cache.layers[layer].values[0].detach().clone()
        new_pos = torch.arange(step_positions["first"], step_positions["first"] + step_positions["count"])
        old = positions[layer] if positions[layer] is not None else torch.zeros(values.shape[0], 0, dtype=torch.long)
        pos = torch.cat([old, new_pos.expand(values.shape[0], -1)], dim=1)
        before[layer] = (keys, values, pos)
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
            feeds = [prompt, *([int(t)] for t in new)]
            first = 0
            for step, tokens in enumerate(feeds):
                step_positions.update(first=first, count=len(tokens))
                scores_now.clear()
                ids = torch.tensor(np.asarray(tokens, dtype=np.int64)[None, :])
                pos_ids = torch.arange(first, first + len(tokens))[None, :]
                out = hf(input_ids=ids, past_key_values=cache, position_ids=pos_ids, use_cache=True)
                first += len(tokens)
                for layer in range(n_layers):
                    keys_now, values_now = cache.layers[layer].keys[0], cache.layers[layer].values[0]
                    b_keys, b_values, b_pos = before[layer]
                    if torch.equal(keys_now, b_keys) and torch.equal(values_now, b_values):
                        positions[layer] = b_pos  # the press left the rows as they were
                    else:
                        positions[layer] = _match_rows(keys_now, values_now, b_keys, b_values, b_pos)
                if step in round_steps:
                    records.append(_snapshot(cache, positions, before, scores_now, n_layers))
            logits = out.logits[0, -1].to(torch.float64).numpy()
    finally:
        for h in handles:
            h.remove()
        for s in scorers:
            s.score = originals[id(s)]
    return _stack(records, logits, dtype)


def _match_rows(keys, values, before_keys, before_values, before_positions) -> torch.Tensor:
    """(Hkv, m) positions of the rows of ``keys``, ``values`` (Hkv, m, d), matched bit for bit to the rows before.

    A row is matched by its key and value together (equal tokens give equal layer-0 values at
    different positions; RoPE tells their keys apart); a row whose key changed (a press that
    re-rotates keys) by its value alone; a row that matches nothing is -1.
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
        pending = []
        for j in range(m):
            hits = [i for i in both.get(k[j].tobytes() + v[j].tobytes(), ()) if i not in used]
            if hits:
                used.add(hits[0])
                out[h, j] = before_positions[h, hits[0]]
            else:
                pending.append(j)
        for j in pending:
            hits = [i for i in alone.get(v[j].tobytes(), ()) if i not in used]
            if hits:
                used.add(hits[0])
                out[h, j] = before_positions[h, hits[0]]
    return out


def _snapshot(cache, positions, before, scores_now, n_layers) -> list:
    per = []
    for layer in range(n_layers):
        keys = cache.layers[layer].keys[0].detach().to(torch.float64).numpy().copy()      # (Hkv, m, d)
        values = cache.layers[layer].values[0].detach().to(torch.float64).numpy().copy()
        scored = scores_now.get(layer)
        score_pos = before[layer][2].numpy() if scored is not None else None
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
                     golden_dtype: str | None = None, row_keys: bool = True, declare: dict | None = None,
                     progress=print) -> dict:
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
        attention = "eager" if needs_attention(fitted) else "sdpa"
        key = repr(g.manifest["model"].get("builder")), g.manifest["model"].get("seed"), attention
        if key not in models:
            models[key] = hf_model(model_of(g.manifest), dtype, attention)
        arrays = run_press(fitted, g, dtype=dtype, hf=models[key])
        if not row_keys:
            del arrays["row_keys"]
        manifest = {**header(E2E_SCHEMA, SCHEDULE_VERSION), "computed_dtype": dtype, **(
                    {"declare": dict(declare)} if declare else {}),
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


def docs_blocks(golden) -> str:
    """The table and list blocks of ``docs/oracle/kvpress.rst`` from the outcomes (one-shot cases built here
    and the cases of folder ``golden``)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_oneshot_suite(tmp)
        return (".. begin-table\n\n" + table_rst(tally({"built": tmp, "golden": Path(golden)}))
                + "\n.. end-table\n\n.. begin-how\n\n" + how_rst() + "\n.. end-how")


if __name__ == "__main__":  # python -m refkv.interop.kvpress GOLDEN_DIR: the docs blocks (paste them into kvpress.rst)
    import sys

    torch.set_num_threads(1)
    print(docs_blocks(sys.argv[1] if len(sys.argv) > 1 else "tests/golden"))
