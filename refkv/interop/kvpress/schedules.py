"""Fit a press to a schedule golden, run it round by round, and write the candidate files."""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import os
from pathlib import Path

import kvpress
import numpy as np
import torch
import transformers

from ...files import OutputFolder
from ...model.config import ModelConfig
from ...oracle.checker import check_suite
from ...oracle.endtoend import EndToEnd, is_schedule, policy_from_manifest, read_end_to_end, write_end_to_end
from ...oracle.io import read_json
from ...oracle.ownstate import query_rows, unjudgeable
from ...oracle.report import SuiteReport
from ...oracle.schema import E2E_SCHEMA, SCHEDULE_VERSION, header
from ...oracle.specs import golden_spec, golden_specs, manifest_spec, spec_label, spec_matches
from ...oracle.vectors import json_params
from ...policies import get as get_policy
from ...schedule import Schedule
from .catalog import OPTIONS
from .models import DTYPES, compression_ratio, hf_model, model_of
from .rows import masked_rows, match_rows, snapshot, stack, stack_states, stack_tokens, state_of, step_queries

__all__ = ["Skip", "check", "fit_press", "kvpress_version", "needs_attention", "run_press", "schedule_goldens",
           "write_candidates"]


class Skip(ValueError):
    """The press cannot run this golden's schedule (the message says why)."""




def _inner(press, name):
    return getattr(press, name, None)


def kvpress_version() -> str:
    """The installed kvpress distribution's version (``importlib.metadata``), or ``"unknown"``."""
    try:
        return importlib.metadata.version("kvpress")
    except importlib.metadata.PackageNotFoundError:
        return getattr(kvpress, "__version__", "unknown")


def fit_press(press, schedule: Schedule, prompt_length: int, layer_budgets: list[int] | None = None,
              policy: dict | None = None, *, notes: list | None = None, other_options: bool = False):
    """A copy of ``press`` configured to run ``schedule`` and the golden's policy options; :class:`Skip` if it cannot.

    ``layer_budgets`` are the golden policy's prefill budgets per layer where they differ
    (refkv's ``pyramidkv``): ``PerLayerCompressionPress`` gets one ratio per layer that keeps
    exactly each. ``PyramidKVPress`` computes its own layer budgets from the total: it gets
    the ratio ``1 - N / n`` itself, since its schedule reads ``n * (1 - ratio)`` unrounded.

    ``policy`` is the golden's ``{"name", "params"}`` (its manifest's ``policy``): every option
    a press exposes that the golden states is set to the golden's value -- ``window_size``,
    ``kernel_size`` (SnapKV), ``n_sink`` (StreamingLLM), ``beta`` (PyramidKV),
    ``alpha_safeguard`` (AdaKV), ExpectedAttention's five (:data:`~refkv.interop.kvpress.catalog.OPTIONS`),
    through every wrapper -- and each change is appended to ``notes``. An option the press
    computes with but cannot set (KeyDiff's anchor, TOVA's ``all_heads=True``, H2O's recent
    window, a form: ``AdaKVPress`` and ``PyramidKVPress`` are refkv's ``form="kvpress"``)
    that differs from the golden's is a :class:`Skip` naming both values, or with
    ``other_options`` a note (the press then runs against a golden of another form, on
    purpose). A scorer press of another refkv policy than the golden's (a press checked
    against a policy it does not implement, on purpose) is run as it is, with a note.
    """
    press = copy.deepcopy(press)
    if policy is not None:
        _fit_options(press, policy, notes if notes is not None else [], other_options)
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


def _label(policy: dict) -> str:
    return spec_label(manifest_spec(policy))


def _base_policy(params: dict) -> dict:
    """The ``{"name", "params"}`` of an AdaKV or PyramidKV golden's base (its full parameters)."""
    base = params.get("base", "snapkv")
    base_params = params.get("base_params") or {}
    if not isinstance(base, str) or not isinstance(base_params, dict):
        raise Skip(f"the golden's base {base!r} with {base_params!r} is not a policy name and parameters")
    return {"name": base, "params": json_params(get_policy(base, **base_params).params())}


def _set(press, field: str, value, notes: list) -> None:
    old = getattr(press, field)
    if old != value:
        setattr(press, field, value)
        notes.append(f"{type(press).__name__}.{field} {old!r} -> {value!r} (the golden's)")


def _fit_options(press, policy: dict, notes: list, other_options: bool) -> None:
    """Set ``press``'s options (and its inner presses') to the golden ``policy``'s; :class:`Skip` (or, with
    ``other_options``, a note) for one it cannot set that differs. See :func:`fit_press`."""
    name, params = policy.get("name"), policy.get("params") or {}
    kind = type(press).__name__

    def differs(what: str) -> None:
        if not other_options:
            raise Skip(what)
        notes.append(f"runs against a golden of another form: {what}")

    if isinstance(press, kvpress.PrefillDecodingPress):
        for inner in (press.prefilling_press, press.decoding_press):
            if inner is not None:
                _fit_options(inner, policy, notes, other_options)
        return
    if isinstance(press, kvpress.DecodingPress):
        _fit_options(press.base_press, policy, notes, other_options)
        return
    if isinstance(press, kvpress.AdaKVPress):
        if name != "adakv":
            differs(f"{kind} allocates the budget across heads (refkv's adakv, form='kvpress'); the golden's policy "
                    f"is {_label(policy)}")
            _fit_options(press.press, policy, notes, other_options)
            return
        if params.get("form") != "kvpress":
            differs(f"{kind} compares the base's raw scores across heads (refkv's adakv form='kvpress'); the golden's "
                    f"form is {params.get('form')!r}: make it with --policies 'adakv(form=kvpress,base=...)'")
        _set(press, "alpha_safeguard", params.get("alpha", press.alpha_safeguard), notes)
        _fit_options(press.press, _base_policy(params), notes, other_options)
        return
    if isinstance(press, kvpress.PyramidKVPress):
        if name != "pyramidkv":
            differs(f"{kind} is refkv's pyramidkv (form='kvpress', over snapkv); the golden's policy is "
                    f"{_label(policy)}")
            return
        if params.get("form") != "kvpress":
            differs(f"{kind} computes kvpress's layer schedule (refkv's pyramidkv form='kvpress'); the golden's form "
                    f"is {params.get('form')!r}: make it with --policies 'pyramidkv(form=kvpress)'")
        base = _base_policy(params)
        if base["name"] != "snapkv":
            differs(f"{kind} scores with SnapKV; the golden's pyramidkv is over {base['name']!r}")
            return
        if base["params"].get("pooling") != "avg":
            differs(f"{kind} pools with avg_pool1d; the golden's snapkv has pooling={base['params'].get('pooling')!r}")
        _set(press, "beta", params.get("beta", press.beta), notes)
        _set(press, "window_size", base["params"]["window"], notes)
        _set(press, "kernel_size", base["params"]["kernel"], notes)
        return
    if isinstance(press, kvpress.PerLayerCompressionPress):
        _fit_options(press.press, _base_policy(params) if name == "pyramidkv" else policy, notes, other_options)
        return
    inner = getattr(press, "press", None)
    if inner is not None and dataclasses.is_dataclass(inner):  # KeyRerotationPress, ChunkPress, BlockPress, ...
        _fit_options(inner, policy, notes, other_options)
        return
    for scorer, (refkv_name, settable, fixed) in OPTIONS.items():
        if not isinstance(press, getattr(kvpress, scorer)):
            continue
        if refkv_name != name:
            notes.append(f"{kind} is refkv's {refkv_name}; compared with {_label(policy)} as asked")
            return
        for option, field in settable.items():
            if option in params:
                _set(press, field, params[option], notes)
        for option, value in fixed.items():
            if option in params and params[option] != value:
                differs(f"{kind} computes {refkv_name} with {option}={value!r} and has no option to change it; the "
                        f"golden's {option}={params[option]!r}")
        return


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
    """``(relative path, golden)`` of every schedule golden under folder ``reference`` (of ``policy``).

    ``policy`` is a policy spec: a name selects the policy's goldens whatever their options,
    a spec with options (``"adakv(base=keydiff,form=kvpress)"``) only those
    (:func:`refkv.oracle.specs.spec_matches`).
    """
    reference = Path(reference)
    selector = None if policy is None else golden_specs([policy], selecting=True)[0]
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
        if selector is None or spec_matches(selector, manifest_spec(g.manifest["policy"])):
            out.append((path.relative_to(reference).as_posix(), g))
    return out


def _layer_budgets(manifest: dict, schedule: Schedule, prompt_length: int) -> list[int] | None:
    """The golden policy's prefill budget per layer, where it has its own (``pyramidkv``), for its prompt."""
    policy = get_policy(manifest["policy"]["name"], **manifest["policy"]["params"])
    if schedule.prefill_budget is None or not hasattr(policy, "layer_budgets"):
        return None
    return policy.layer_budgets(schedule.prefill_budget, int(manifest["model"]["config"]["n_layers"]), prompt_length)


def write_candidates(press, reference, out, *, policy: str, dtype: str = "float32",
                     golden_dtype: str | None = None, row_keys: bool = True, declare: dict | None = None,
                     progress=print, device: str = "cpu", other_options: bool = False) -> dict:
    """Run ``press`` on every schedule golden of ``policy`` under ``reference`` it can run; write candidates.

    Parameters
    ----------
    press : kvpress press
        Fitted to each golden's schedule and policy options (:func:`fit_press`); the argument
        is not changed.
    reference, out : path-like
        The golden folder (``refkv golden generate``) and the candidate folder to write
        (same relative paths).
    policy : str
        The refkv policy the press is compared with: a name (its goldens whatever their
        options) or a spec with options, ``"adakv(base=keydiff,form=kvpress)"``.
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
    other_options : bool
        Run against goldens whose options the press computes otherwise and cannot set
        (default: skip them, saying why); the difference is listed under ``fitted``.

    Returns
    -------
    dict
        ``{"written": [paths], "skipped": {path: reason}, "fitted": {path: [what was set]}}``;
        each skip and each fitted option is also a ``progress`` line.
    """
    written, skipped, fitted_notes = [], {}, {}
    found = schedule_goldens(reference, policy)
    if not found:
        raise ValueError(f"{reference} holds no schedule golden of policy {policy!r} (refkv golden generate "
                         f"--out {reference} --policies {policy!r})")
    folder = OutputFolder(out, inputs=[reference], what="candidate folder")
    for rel, _ in found:  # no symlinked component below out, not into the goldens: refused before any run
        folder.check_replaceable(rel), folder.check_replaceable(rel[:-len(".json")] + ".npz")
    models: dict = {}
    for rel, g in found:
        if golden_dtype is not None and g.manifest["dtype"] != golden_dtype:
            continue
        sched = Schedule.from_dict(g.manifest["schedule"])
        prompt_length = len(g.arrays["prompt"])
        notes: list = []
        try:
            fitted = fit_press(press, sched, prompt_length, _layer_budgets(g.manifest, sched, prompt_length),
                               g.manifest["policy"], notes=notes, other_options=other_options)
        except Skip as why:
            skipped[rel] = str(why)
            continue
        if notes:
            fitted_notes[rel] = notes
        attention = "eager" if needs_attention(fitted) else "sdpa"
        key = repr(g.manifest["model"].get("builder")), g.manifest["model"].get("seed"), attention
        if key not in models:
            models[key] = hf_model(model_of(g.manifest), dtype, attention).to(device)
        arrays = run_press(fitted, g, dtype=dtype, hf=models[key], device=device)
        if not row_keys:
            del arrays["row_keys"]
        manifest = {**header(E2E_SCHEMA, SCHEDULE_VERSION), "computed_dtype": dtype, **(
                    {"declare": dict(declare)} if declare else {}),
                    "candidate": {"press": repr(fitted), "kvpress_version": kvpress_version(),
                                  "transformers_version": transformers.__version__,
                                  **({"fitted": notes} if notes else {})}}
        write_end_to_end(folder / rel, manifest, arrays, compresslevel=1)
        written.append(str(folder.path(rel)))
        if progress is not None:
            progress(f"{rel}: {type(fitted).__name__} ran {len(arrays['kept'])} rounds"
                     + (f" ({'; '.join(notes)})" if notes else ""))
    if progress is not None:
        for rel, why in skipped.items():
            progress(f"{rel}: skipped: {why}")
    return {"written": written, "skipped": skipped, "fitted": fitted_notes}


def check(candidate, reference, *, policy: str | None = None, dtype: str | None = None, declare: dict | None = None,
          strict_ties: bool = False, tolerance_factor: float = 1.0, allow_missing: bool = True) -> SuiteReport:
    """Check the candidates :func:`write_candidates` wrote against the goldens: ``refkv golden check``
    without the command line.

    Every schedule (and end-to-end) golden under ``reference`` of ``policy`` (a name or a
    spec, as in :func:`write_candidates`; default: all) that the candidate folder holds is
    compared, whatever its dtype; goldens the adapter skipped (``write_candidates`` returns
    why) are not counted as missing unless ``allow_missing=False``. A check that compares
    nothing fails.

    Parameters
    ----------
    candidate, reference : path-like
        The candidate folder and the golden folder.
    dtype : str, optional
        The precision the press computed in (default: the candidate files' ``computed_dtype``).
    declare, strict_ties, tolerance_factor
        As :func:`refkv.oracle.checker.check_suite`.

    Returns
    -------
    SuiteReport
        ``report.ok`` is the verdict, ``report.format()`` the text the command line prints.

    Examples
    --------
    >>> report = check("candidate", "goldens", policy="keydiff")  # doctest: +SKIP
    >>> print(report.format()); assert report.ok                   # doctest: +SKIP
    """
    return check_suite(candidate, reference, policies=None if policy is None else [golden_spec(policy)],
                       kinds=("e2e",), allow_missing=allow_missing, tolerance_factor=tolerance_factor,
                       strict_ties=strict_ties, dtype=dtype, declare=declare, case_dtype="all",
                       source="argument")
