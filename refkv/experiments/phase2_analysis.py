"""Phase two's analysis: from the committed records to its per-unit table and verdicts, as registered.

``docs/experiment_registration_phase2.json`` fixes the rule; ``docs/phase2_verdicts.py``
reads the records and writes the tables; every rule lives here:

* **Passkey** (P1, P2; experiment ``passkey2``): the budget ``N`` is the registered one
  (:func:`refkv.experiments.phase2_passkey.chosen_budget` on the calibration records, after
  the ceiling check); a comparison the floor check excludes
  (:func:`~refkv.experiments.phase2_passkey.testable`) is reported "not testable (floor)" or
  "(ceiling)" and never tested; the others are tested on the 147 test prompts, paired by
  prompt: the exact McNemar test and Newcombe's interval, per document and per kind the same
  with the exact interaction test (:func:`refkv.experiments.stats.stratified_binary`).
* **Per-document means** (L1, C1, M1, H1, A1, G1, G2, S1 and the secondary A1-unmatched,
  G1-all): a document's value is the mean over its windows; the paired t-test across the 21
  documents, per kind with the ANOVA interaction across kinds, and the ANOVA of the
  per-window differences across documents (:func:`~refkv.experiments.stats.stratified_mean`).
  HashEvict's value is the mean over its 3 seeds (each seed published,
  :func:`hashevict_seed_rows`).
* Holm within each claim over its tested primary comparisons and the verdict rule
  (:func:`refkv.experiments.registered.verdict_rows`); a secondary comparison keeps its
  unadjusted p and has no verdict; paper effects where the paper's metric is the same
  (:func:`~refkv.experiments.registered.paper_effect`), "not comparable" where the
  registration says the metric differs; the registered power beside "not resolved".
* The perplexity claims' two-stage bootstrap (documents, then 64-token blocks within each
  window) beside the t interval, with its spread over 20 seeds (:func:`document_bootstrap`).

A claim without records is listed "not run", comparison by comparison, never left out.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from ..files import parse_json, read_regular
from .documents import document_kind
from .records import MAX_RECORD_BYTES, MAX_RECORDS_BYTES
from .registered import Comparison, paper_effect, unit_rows, verdict_rows, versus_paper
from .stats import Interval, mcnemar_power, stratified_binary, stratified_mean

__all__ = ["STRATA_COLUMNS", "UNIT_COLUMNS", "VERDICT_COLUMNS", "analyse", "document_bootstrap",
           "read_gzip_records"]

#: The experiments of phase two and the claims each one's records decide.
CLAIMS = {"passkey2": ("P1", "P2"), "perplexity2": ("L1", "C1", "M1", "H1"),
          "attention_loss2": ("A1", "A1-unmatched"), "geometry2": ("G1", "G1-all", "G2", "S1")}
VERDICT_COLUMNS = ["claim", "secondary", "a", "b", "n", "unit", "estimate", "low", "high", "p", "p_holm",
                   "verdict", "power", "paper_effect", "versus_paper", "p_interaction_kind",
                   "p_interaction_document", "setting"]
UNIT_COLUMNS = ["claim", "a", "b", "unit", "kind", "value_a", "value_b", "value_full"]
STRATA_COLUMNS = ["claim", "a", "b", "stratum_type", "stratum", "n", "only_a", "only_b", "estimate", "low", "high",
                  "p"]
BOOTSTRAP_COLUMNS = ["claim", "a", "b", "documents", "estimate", "t_low", "t_high", "low", "high", "low_min",
                     "low_max", "high_min", "high_max", "seeds", "resamples"]
#: How many resamples and seeds the registered bootstrap display uses.
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEEDS, BOOTSTRAP_BLOCK = 10_000, 20, 64


# -- reading the records ---------------------------------------------------------------------------
def read_gzip_records(path, max_bytes: int = MAX_RECORDS_BYTES) -> list[dict]:
    """The records of a gzip-compressed JSON-lines results file, read within caps.

    The compressed file and its decompressed text are each capped at ``max_bytes``, a line at
    :data:`~refkv.experiments.records.MAX_RECORD_BYTES`, JSON depth and size as every refkv JSON
    (:func:`refkv.files.parse_json`). Unlike a run's own results file, a committed file must be
    whole: a line that is not a record (an object with a string ``key`` and ``params`` and
    ``result`` objects) is an error naming the file and line. Records with the same key: the
    last wins, as the runner reads them.
    """
    path = Path(path)
    data = read_regular(path, max_bytes, what="compressed records file")
    inflate = zlib.decompressobj(wbits=31)                      # gzip framing
    try:
        text = inflate.decompress(data, max_bytes + 1)
    except zlib.error as err:
        raise ValueError(f"{path}: not a gzip file: {err}") from None
    if len(text) > max_bytes or inflate.unconsumed_tail:
        raise ValueError(f"{path}: decompresses to more than the {max_bytes} bytes allowed")
    if not inflate.eof:
        raise ValueError(f"{path}: the gzip stream is truncated")
    by_key: dict[str, dict] = {}
    for number, line in enumerate(text.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        if len(line) > MAX_RECORD_BYTES:
            raise ValueError(f"{where}: a record of {len(line)} bytes, more than {MAX_RECORD_BYTES}")
        record = parse_json(line, where)
        if not (isinstance(record, dict) and isinstance(record.get("key"), str)
                and isinstance(record.get("params"), dict) and isinstance(record.get("result"), dict)):
            raise ValueError(f"{where}: a record must be an object with a string key and params and result objects")
        by_key[record["key"]] = record
    return list(by_key.values())


def _ran(records: list[dict]) -> list[dict]:
    return [r for r in records if r["params"].get("design") == "phase2" and "skipped" not in r["result"]]


# -- passkey ----------------------------------------------------------------------------------------
def _passkey_side(name: str) -> tuple[str, bool]:
    """A registration name (``keydiff``, ``snapkv@oneshot``, ``snapkv@blocks``) -> (policy, one-shot)."""
    policy, _, how = name.partition("@")
    return policy, how == "oneshot"


def passkey_units(records: list[dict], claim: dict, n_budget: int) -> list[tuple]:
    """Per registered comparison of ``claim``: (a, b, {prompt: (a_correct, b_correct)}) at budget ``n_budget``."""
    answers: dict[tuple, dict[tuple, bool]] = {}
    for r in _ran(records):
        p = r["params"]
        if p.get("purpose") == "test" and p["budget"] == n_budget:
            key = (p["policy"], p["block"] is None)
            answers.setdefault(key, {})[(p["document"], p["window"])] = bool(r["result"]["correct"])
    out = []
    for a, b in claim["comparisons"]:
        sa, sb = answers.get(_passkey_side(a), {}), answers.get(_passkey_side(b), {})
        prompts = sorted(set(sa) & set(sb))
        out.append((a, b, {q: (sa[q], sb[q]) for q in prompts}))
    return out


def passkey_calibration(records: list[dict], design: dict) -> dict:
    """The calibration's outcome: ``ceiling`` (full-cache accuracy), ``met``, ``budget`` (the
    registered N, or None), ``testable`` ({(claim, a, b): verdict} at that N) and ``rows`` (the
    per-budget table), from the calibration records alone."""
    from .phase2_passkey import CANDIDATE_BUDGETS, COMPARISONS, chosen_budget, testable

    calibration = [r for r in _ran(records) if r["params"].get("purpose") == "calibration"]
    full = [bool(r["result"]["correct"]) for r in calibration if r["params"]["policy"] == "full"]
    out = {"ceiling": float(np.mean(full)) if full else None, "met": False, "budget": None, "testable": {},
           "rows": [], "prompts": len(full)}
    if not full:
        return out
    out["met"] = out["ceiling"] >= design["samples"]["passkey_ceiling_required"]
    try:
        verdicts = {b: testable(calibration, b) for b in CANDIDATE_BUDGETS}
    except KeyError:                                  # a setting has no calibration record yet
        return out
    claims = {c["id"]: c for c in design["claims"]}
    for budget in CANDIDATE_BUDGETS:
        for claim_id, pairs in COMPARISONS.items():
            for ((a, a_one), (b, b_one)), registered in zip(pairs, claims[claim_id]["comparisons"]):
                name = f"{claim_id} {a}{'@oneshot' if a_one else ''} vs {b}{'@oneshot' if b_one else ''}"
                mean = _calibration_mean(calibration, budget, (a, a_one), (b, b_one))
                out["rows"].append({"budget": budget, "claim": claim_id, "a": registered[0], "b": registered[1],
                                    "mean_accuracy": mean, "verdict": verdicts[budget][name],
                                    "discordance": _discordance(calibration, budget, (a, a_one), (b, b_one))})
    if out["met"]:
        out["budget"] = chosen_budget(calibration)
        out["testable"] = {(r["claim"], r["a"], r["b"]): r["verdict"] for r in out["rows"]
                           if r["budget"] == out["budget"]}
    return out


def _calibration_answers(records, budget, side) -> dict[tuple, bool]:
    policy, one_shot = side
    return {(r["params"]["document"], r["params"]["window"]): bool(r["result"]["correct"]) for r in records
            if r["params"]["policy"] == policy and r["params"]["budget"] == budget
            and (r["params"]["block"] is None) == one_shot}


def _calibration_mean(records, budget, a, b) -> float:
    sa, sb = _calibration_answers(records, budget, a), _calibration_answers(records, budget, b)
    return (float(np.mean(list(sa.values()))) + float(np.mean(list(sb.values())))) / 2


def _discordance(records, budget, a, b) -> float:
    sa, sb = _calibration_answers(records, budget, a), _calibration_answers(records, budget, b)
    shared = sorted(set(sa) & set(sb))
    return float(np.mean([sa[q] != sb[q] for q in shared])) if shared else float("nan")


# -- per-document means -----------------------------------------------------------------------------
def _window_values(records: list[dict], match, value) -> dict[str, dict[tuple, float]]:
    """``{policy: {(document, window): value(result)}}`` of the records ``match(params)`` accepts."""
    out: dict[str, dict[tuple, float]] = {}
    for r in _ran(records):
        p = r["params"]
        if match(p):
            out.setdefault(p.get("policy", ""), {})[(p["document"], p["window"])] = float(value(r["result"]))
    return out


def _seed_mean(values: dict[str, dict], seeds: tuple[str, ...]) -> dict[tuple, float]:
    """Per window, the mean over HashEvict's seeds (windows all seeds ran)."""
    present = [values.get(s, {}) for s in seeds]
    return {w: float(np.mean([v[w] for v in present])) for w in present[0] if all(w in v for v in present)}


def mean_sides(claim_id: str, records: list[dict]) -> dict[str, dict[tuple, float]]:
    """Per registration name of ``claim_id``'s sides (and ``full`` for perplexity): per-window values."""
    from .phase2_texts import BLOCK, HASHEVICT_SEEDS, MAT_SPEC

    if claim_id in ("L1", "C1", "M1", "H1"):
        blocked = _window_values(records, lambda p: p["block"] == BLOCK, lambda r: r["ppl"])
        single = _window_values(records, lambda p: p["block"] == 1, lambda r: r["ppl"])
        sides = {"full": blocked.get("full", {})}
        if claim_id in ("L1", "C1"):
            sides.update({k: v for k, v in blocked.items() if k != "full"})
        else:
            sides.update({"sink": single.get("sink", {}), "mat@selected": single.get(MAT_SPEC, {}),
                          "knorm:recent=10,sink=4": single.get("knorm:recent=10,sink=4", {}),
                          "hashevict": _seed_mean(single, HASHEVICT_SEEDS)})
        return sides
    if claim_id in ("A1", "A1-unmatched"):
        loss = _window_values(records, lambda p: p.get("kind") == "step_loss", lambda r: r["mean_loss"])
        return {**loss, "hashevict": _seed_mean(loss, HASHEVICT_SEEDS)}
    if claim_id == "G1":
        return {"spearman": _window_values(records, lambda p: p.get("kind") == "cosine", lambda r: -np.nanmean(
            np.asarray(r["common_queries"]["spearman"], dtype=float))).get("", {})}
    if claim_id == "G1-all":
        return {"spearman_all": _window_values(records, lambda p: p.get("kind") == "cosine", lambda r: -np.nanmean(
            np.asarray(r["spearman_anchor"], dtype=float))).get("", {})}
    if claim_id == "G2":
        return _window_values(records, lambda p: p.get("kind") == "retention",
                              lambda r: np.mean(np.asarray(r["log_volume"], dtype=float)))
    if claim_id == "S1":
        out = {}
        for bits in (32, 8):
            out[f"bits={bits}"] = _window_values(records, lambda p: p.get("kind") == "hamming", lambda r, b=bits: (
                np.nanmean(np.asarray(r["pearson"][str(b)], dtype=float)))).get("", {})
        return out
    raise ValueError(f"claim must be a per-document claim of phase two, got {claim_id!r}")


def _by_document(values: dict[tuple, float], windows: list[tuple]) -> dict[str, float]:
    docs: dict[str, list[float]] = {}
    for w in windows:
        docs.setdefault(w[0], []).append(values[w])
    return {d: float(np.mean(v)) for d, v in docs.items()}


def mean_comparison(claim: dict, a: str, b: str | None, sides: dict) -> tuple[Comparison, list[tuple]] | None:
    """The per-document comparison (None with fewer than 2 documents) and the windows it rests on.

    A document's value is the mean over the windows both sides (and, for perplexity, the full
    cache) ran; ``reference`` is B's mean per-document gap to the full cache (perplexity) or B's
    mean (attention loss), what a paper's fraction or ratio scales.
    """
    need = [sides.get(a, {})] + ([sides.get(b, {})] if b else [])
    perplexity = claim["measure"] == "perplexity"
    if perplexity:
        need.append(sides.get("full", {}))
    windows = sorted(set.intersection(*[set(v) for v in need]))
    if not windows:
        return None
    va = _by_document(sides[a], windows)
    documents = list(va)
    if len(documents) < 2:
        return None
    a_values = np.array([va[d] for d in documents])
    b_values = full = reference = None
    if b:
        vb = _by_document(sides[b], windows)
        b_values = np.array([vb[d] for d in documents])
    if perplexity:
        vf = _by_document(sides["full"], windows)
        full = np.array([vf[d] for d in documents])
        reference = float(np.mean(b_values - full))
    elif claim["measure"] == "attention loss":
        reference = float(np.mean(b_values))
    return Comparison(claim["id"], a, b, a_values, b_values, "documents", reference, tuple(documents), full), windows


# -- the two-stage bootstrap over documents -----------------------------------------------------------
def document_bootstrap(nll_a, nll_b, *, block: int = BOOTSTRAP_BLOCK, confidence: float = 0.95,
                       n_boot: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> Interval:
    """The mean over documents of the per-document perplexity difference, two-stage bootstrap.

    Parameters
    ----------
    nll_a, nll_b : array_like, (S, D, W, T)
        Token losses of each side: ``S`` runs averaged as one side (HashEvict's seeds; 1
        otherwise), ``D`` documents, ``W`` windows per document, ``T`` tokens per window.

    Each replicate draws ``D`` documents with replacement (stage one); for every drawn document,
    each of its windows draws its non-overlapping blocks of ``block`` tokens with replacement
    (stage two), the same blocks for every run of both sides. A window's value is
    ``mean_s exp(mean nll_A,s*) - mean_s exp(mean nll_B,s*)`` over its drawn blocks, a
    document's the mean over its windows, the replicate's the mean over the drawn documents
    (the registered estimate's arithmetic, :mod:`refkv.experiments.stats`'s
    :func:`~refkv.experiments.stats.two_stage_bootstrap` with a document level above the
    window). ``estimate`` is the observed mean per-document difference.
    """
    a = np.asarray(nll_a, dtype=float)
    b = np.asarray(nll_b, dtype=float)
    if a.ndim != 4 or b.ndim != 4 or a.shape[1:] != b.shape[1:] or a.shape[1] < 2 or a.shape[3] == 0:
        raise ValueError(f"nll_a and nll_b must be (runs, documents >= 2, windows, tokens) arrays of the same "
                         f"documents, windows and tokens, got shapes {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("nll_a and nll_b must be finite")
    from ..validation import check_int

    block, n_boot = check_int("block", block, 1), check_int("n_boot", n_boot, 100)
    _, docs, windows, tokens = a.shape
    starts = np.arange(0, tokens, block)
    sums_a = np.add.reduceat(a, starts, axis=3)                        # (Sa, D, W, K)
    sums_b = np.add.reduceat(b, starts, axis=3)                        # (Sb, D, W, K)
    lengths = np.diff(np.append(starts, tokens))                       # (K,)
    observed = (np.exp(a.mean(axis=3)).mean(axis=0) - np.exp(b.mean(axis=3)).mean(axis=0)).mean(axis=1).mean()
    rng = np.random.default_rng(check_int("seed", seed, 0))
    drawn = rng.integers(0, docs, size=(n_boot, docs))                 # (n_boot, D) stage one
    draws = np.zeros(n_boot)
    for w in range(windows):
        pick = rng.integers(0, len(starts), size=(n_boot, docs, len(starts)))   # (n_boot, D, K) stage two
        count = lengths[pick].sum(axis=2)                                       # (n_boot, D)
        value = [np.exp(sums[:, drawn[:, :, None], w, pick].sum(axis=3) / count).mean(axis=0)  # (n_boot, D)
                 for sums in (sums_a, sums_b)]
        draws += (value[0] - value[1]).mean(axis=1) / windows
    alpha = 1 - confidence
    low, high = np.quantile(draws, [alpha / 2, 1 - alpha / 2])
    return Interval(float(observed), float(low), float(high), confidence, docs, "documents",
                    f"two-stage bootstrap (documents, then blocks of {block} tokens within each window)")


def _nll_array(records: list[dict], policies: tuple[str, ...], block: int, documents, windows) -> np.ndarray:
    """(runs, D, W, T) token losses of ``policies`` (one run each) at ``block`` on the given windows."""
    nll = {(r["params"]["policy"], r["params"]["document"], r["params"]["window"]): r["result"]["nll"]
           for r in _ran(records) if r["params"]["block"] == block and r["params"]["policy"] in policies}
    return np.array([[[nll[(p, d, w)] for w in windows] for d in documents] for p in policies], dtype=float)


def bootstrap_rows(records: list[dict], comparisons: list[tuple], *, n_boot: int = BOOTSTRAP_RESAMPLES,
                   seeds: int = BOOTSTRAP_SEEDS) -> list[dict]:
    """The two-stage bootstrap display of every perplexity comparison: seed 0's interval and the
    range of each end over ``seeds`` seeds, beside the t interval."""
    from .phase2_texts import BLOCK, HASHEVICT_SEEDS, MAT_SPEC

    spec = {"hashevict": HASHEVICT_SEEDS, "mat@selected": (MAT_SPEC,)}
    rows = []
    for comparison, windows, interval in comparisons:
        block = BLOCK if comparison.claim in ("L1", "C1") else 1
        documents = list(comparison.labels)
        per_doc = sorted({w[1] for w in windows})
        if any((d, w) not in windows for d in documents for w in per_doc):
            continue                                                      # a document lacks a window: no display
        arrays = [_nll_array(records, spec.get(side, (side,)), block, documents, per_doc)
                  for side in (comparison.a, comparison.b)]
        draws = [document_bootstrap(*arrays, n_boot=n_boot, seed=s) for s in range(seeds)]
        rows.append({"claim": comparison.claim, "a": comparison.a, "b": comparison.b, "documents": len(documents),
                     "estimate": draws[0].estimate, "t_low": interval.low, "t_high": interval.high,
                     "low": draws[0].low, "high": draws[0].high, "low_min": min(d.low for d in draws),
                     "low_max": max(d.low for d in draws), "high_min": min(d.high for d in draws),
                     "high_max": max(d.high for d in draws), "seeds": seeds, "resamples": n_boot})
    return rows


# -- HashEvict's seeds, the needle's distinctiveness -------------------------------------------------
def hashevict_seed_rows(records: dict[str, list[dict]]) -> list[dict]:
    """Per document, each HashEvict seed's value and their mean: H1's perplexity and A1's loss."""
    from .phase2_texts import HASHEVICT_SEEDS

    rows = []
    for claim, experiment, match, value in (
            ("H1", "perplexity2", lambda p: p["block"] == 1, lambda r: r["ppl"]),
            ("A1", "attention_loss2", lambda p: p.get("kind") == "step_loss", lambda r: r["mean_loss"])):
        values = _window_values(records.get(experiment, []), match, value)
        present = [values.get(s, {}) for s in HASHEVICT_SEEDS]
        windows = sorted(set.intersection(*[set(v) for v in present]))
        documents = {s: _by_document(v, windows) for s, v in zip(HASHEVICT_SEEDS, present)}
        for d in dict.fromkeys(w[0] for w in windows):
            row = {"claim": claim, "document": d, "kind": document_kind(d)}
            row.update({s: documents[s][d] for s in HASHEVICT_SEEDS})
            row["mean"] = float(np.mean([documents[s][d] for s in HASHEVICT_SEEDS]))
            rows.append(row)
    return rows


def distinctiveness_rows(records: list[dict], n_budget: int | None) -> list[dict]:
    """Per test prompt: the needle's distinctiveness by KeyDiff's score (the full cache's record)
    and whether each policy answered, at the registered budget."""
    prompts: dict[tuple, dict] = {}
    for r in _ran(records):
        p = r["params"]
        if p.get("purpose") != "test":
            continue
        row = prompts.setdefault((p["document"], p["window"]), {"document": p["document"], "window": p["window"],
                                                                "kind": document_kind(p["document"])})
        if p["policy"] == "full":
            row["distinctiveness"] = r["result"].get("needle_distinctiveness")
            row["full"] = bool(r["result"]["correct"])
        elif p["budget"] == n_budget:
            row[f"{p['policy']}@{'oneshot' if p['block'] is None else 'blocks'}"] = bool(r["result"]["correct"])
    return [prompts[k] for k in sorted(prompts)]


# -- the verdicts ------------------------------------------------------------------------------------
def _power(power: dict, claim_id: str, a: str, b: str | None) -> float | None:
    """The registered power at the registered n for the comparison's sizing effect (``power.csv``)."""
    name = "A1 (secondary)" if claim_id == "A1-unmatched" else claim_id
    row = power.get((name, a, b or ""))
    return None if row is None else float(row["power_registered"])


def _label(claim: dict) -> str:
    """The paper label of a claim without a registered paper effect: "not comparable" where the
    registration says the paper's metric differs, else none."""
    return "not comparable" if str(claim.get("paper_note", "")).startswith("not comparable") else ""


def _stratified_mean(a, b, labels) -> dict:
    """:func:`~refkv.experiments.stats.stratified_mean`, or, when every stratum holds one unit (no
    spread within a stratum, so no ANOVA), each unit's difference and a NaN interaction."""
    if len(set(labels)) < len(labels):
        return stratified_mean(a, b, labels)
    d = np.asarray(a, dtype=float) - (0.0 if b is None else np.asarray(b, dtype=float))
    nan = float("nan")
    return {"strata": {label: {"n": 1, "estimate": float(x), "low": nan, "high": nan, "p": nan}
                       for label, x in zip(labels, d)}, "p_interaction": nan}


def _strata_rows(claim_id, a, b, kind, stats_) -> list[dict]:
    return [{"claim": claim_id, "a": a, "b": b or "", "stratum_type": kind, "stratum": label, **values}
            for label, values in stats_["strata"].items()]


def analyse(design: dict, records: dict[str, list[dict]], power: dict[tuple, float], *,
            n_boot: int = BOOTSTRAP_RESAMPLES, seeds: int = BOOTSTRAP_SEEDS, bootstrap: bool = True) -> dict:
    """Every table of phase two from its records (``{experiment: records}``).

    Returns ``{"verdicts", "units", "strata", "calibration", "bootstrap", "seeds", "distinctiveness"}``,
    each a list of row dicts (:data:`VERDICT_COLUMNS`, :data:`UNIT_COLUMNS`, :data:`STRATA_COLUMNS`, ...).
    """
    claims = {c["id"]: c for c in design["claims"]}
    experiment_of = {cid: name for name, ids in CLAIMS.items() for cid in ids}
    calibration = passkey_calibration(records.get("passkey2", []), design)
    comparisons, strata, interactions, excluded, settings = [], [], {}, {}, {}
    boot_inputs = []
    for cid, claim in claims.items():
        mine = records.get(experiment_of.get(cid, ""), [])
        if cid in ("P1", "P2"):
            if not calibration["met"] or calibration["budget"] is None:
                continue
            settings[cid] = f"N = {calibration['budget']}, B = {calibration['budget'] // 16}"
            for a, b, pairs in passkey_units(mine, claim, calibration["budget"]):
                if not pairs:
                    continue
                verdict = calibration["testable"].get((cid, a, b), "testable")
                prompts = list(pairs)
                c = Comparison(cid, a, b, np.array([pairs[q][0] for q in prompts]),
                               np.array([pairs[q][1] for q in prompts]), "prompts",
                               labels=tuple(f"{d}/{w}" for d, w in prompts))
                if verdict != "testable":
                    excluded[(cid, a, b)] = (c, verdict)
                    continue
                comparisons.append(c)
                docs = [d for d, _ in prompts]
                by_doc = stratified_binary(c.a_values, c.b_values, docs)
                by_kind = stratified_binary(c.a_values, c.b_values, [document_kind(d) for d in docs])
                strata += _strata_rows(cid, a, b, "kind", by_kind) + _strata_rows(cid, a, b, "document", by_doc)
                interactions[(cid, a, b)] = (by_kind["p_interaction"], by_doc["p_interaction"])
            continue
        if not mine:
            continue
        sides = mean_sides(cid, mine)
        for a, b in claim["comparisons"]:
            made = mean_comparison(claim, a, b, sides)
            if made is None:
                continue
            c, windows = made
            comparisons.append(c)
            kinds = [document_kind(d) for d in c.labels]
            by_kind = _stratified_mean(c.a_values, c.b_values, kinds)
            wa = np.array([sides[a][w] for w in windows])
            wb = None if b is None else np.array([sides[b][w] for w in windows])
            by_doc = _stratified_mean(wa, wb, [w[0] for w in windows])
            strata += _strata_rows(cid, a, b, "kind", by_kind)
            interactions[(cid, a, b or None)] = (by_kind["p_interaction"], by_doc["p_interaction"])
            if claim["measure"] == "perplexity":
                boot_inputs.append((c, windows))
    rows = verdict_rows(design, [c for c in comparisons if not claims[c.claim].get("secondary")])
    rows += _secondary_rows(design, [c for c in comparisons if claims[c.claim].get("secondary")])
    by_key = {(r["claim"], r["a"], r["b"] or None): r for r in rows}
    out_rows = []
    for cid, claim in claims.items():
        for a, b in claim["comparisons"]:
            key = (cid, a, b)
            if key in by_key:
                row = dict(by_key[key])
                row["secondary"] = bool(claim.get("secondary"))
                if row["paper_effect"] is None and not row["versus_paper"]:
                    row["versus_paper"] = _label(claim)
                row["power"] = _power(power, cid, a, b) if row["verdict"] == "not resolved" else None
                row["p_interaction_kind"], row["p_interaction_document"] = interactions.get(key, (None, None))
            elif key in excluded:
                c, verdict = excluded[key]
                row = {"claim": cid, "secondary": False, "a": a, "b": b, "n": len(c.a_values), "unit": "prompts",
                       "verdict": verdict, "versus_paper": _label(claim)}
            else:
                row = {"claim": cid, "secondary": bool(claim.get("secondary")), "a": a, "b": b or "",
                       "verdict": _not_run(cid, calibration)}
            row["setting"] = settings.get(cid, claim.get("setting", ""))
            out_rows.append(row)
    units = unit_rows(comparisons + [c for c, _ in excluded.values()])
    for u in units:
        u["kind"] = document_kind(u["unit"].split("/")[0])
    t_intervals = {(r["claim"], r["a"], r["b"]): Interval(r["estimate"], r["low"], r["high"], 0.95, r["n"],
                                                          "documents", "paired t")
                   for r in out_rows if r.get("estimate") is not None}
    boot = [{"claim": "not run", "a": "", "b": ""}]   # the page's table needs a row
    if bootstrap and boot_inputs:
        boot = bootstrap_rows(records.get("perplexity2", []),
                              [(c, w, t_intervals[(c.claim, c.a, c.b)]) for c, w in boot_inputs],
                              n_boot=n_boot, seeds=seeds)
    return {"verdicts": out_rows, "units": units, "strata": strata,
            "calibration": _calibration_rows(calibration, power, design), "bootstrap": boot,
            "seeds": hashevict_seed_rows(records),
            "distinctiveness": distinctiveness_rows(records.get("passkey2", []), calibration["budget"])}


def _not_run(claim_id: str, calibration: dict) -> str:
    if claim_id in ("P1", "P2") and calibration["ceiling"] is not None and not calibration["met"]:
        return "not run (ceiling not met)"
    return "not run"


def _secondary_rows(design: dict, comparisons: list[Comparison]) -> list[dict]:
    """A secondary comparison: estimate, interval and unadjusted p; never a verdict."""
    claims = {c["id"]: c for c in design["claims"]}
    rows = []
    for c in comparisons:
        for r in verdict_rows({**design, "claims": [claims[c.claim]]}, [c]):
            direction = 1 if ">" in claims[c.claim]["direction"] else -1
            effect = paper_effect(claims[c.claim], c.a, c.b, c.reference)
            interval = Interval(r["estimate"], r["low"], r["high"], 0.95, r["n"], r["unit"], "")
            rows.append({**r, "p_holm": None, "verdict": "secondary (no verdict)", "paper_effect": effect,
                         "versus_paper": versus_paper(interval, effect, direction)})
    return rows


def _calibration_rows(calibration: dict, power: dict, design: dict) -> list[dict]:
    """The calibration table: per candidate budget and comparison, the mean accuracy, the floor
    verdict and the discordance rate, with (at the chosen budget) the exact McNemar power at the
    registered n recomputed from the calibration's own discordance (the registered power update);
    then the ceiling and the chosen budget."""
    n = design["samples"]["passkey_prompts"]
    rows = []
    for r in calibration["rows"]:
        row = dict(r)
        sizing = power.get((r["claim"], r["a"], r["b"]), {})
        if r["budget"] == calibration["budget"] and sizing and 0 < r["discordance"] <= 1:
            effect, alpha = float(sizing["effect"]), float(sizing["alpha"])
            if abs(effect) < r["discordance"]:
                row["power_at_n"] = mcnemar_power(n, r["discordance"], effect, alpha)
        rows.append(row)
    if calibration["ceiling"] is None:
        rows.append({"budget": "not run", "claim": "", "a": "", "b": ""})  # the page's table needs a row
    else:
        rows.append({"budget": "ceiling", "claim": "", "a": "full", "b": "",
                     "mean_accuracy": calibration["ceiling"],
                     "verdict": "met" if calibration["met"] else "not met"})
        rows.append({"budget": "chosen", "claim": "", "a": calibration["budget"] or "none", "b": ""})
    return rows



def _signed(x) -> str:
    """A number to 3 significant digits with its sign (``+0.25``, ``-0.0123``; zero is ``0``)."""
    x = float(x)
    return "0" if x == 0 else f"{x:+.3g}"


def _comparison_words(row: dict) -> str:
    """``keydiff`` - ``snapkv`` +0.12 [+0.05, +0.19], n = 147 prompts, Holm p 0.003 (no estimate: the
    comparison's name and n only)."""
    # literals: a name such as snapkv@oneshot would otherwise become a mailto link
    name = f"``{row['a']}``" if not row.get("b") else f"``{row['a']}`` - ``{row['b']}``"
    if row.get("estimate") in (None, ""):
        n = f", n = {row['n']} {row.get('unit', '')}".rstrip() if row.get("n") not in (None, "") else ""
        return f"{name}{n}"
    p = row.get("p_holm") if row.get("p_holm") not in (None, "") else row.get("p")
    text = (f"{name} {_signed(row['estimate'])} [{_signed(row['low'])}, {_signed(row['high'])}], "
            f"n = {row['n']} {row['unit']}")
    if p not in (None, ""):
        text += f", {'Holm ' if row.get('p_holm') not in (None, '') else ''}p {float(p):.2g}"
    if row.get("versus_paper"):
        text += f", {row['versus_paper']}"
    if row.get("verdict") == "not resolved" and row.get("power") not in (None, ""):
        text += f", registered power {float(row['power']):.2f}"
    if row.get("p_interaction_kind") not in (None, ""):
        text += f", kind x policy p {float(row['p_interaction_kind']):.2g}"
    return text


def verdict_words(design: dict, rows: list[dict]) -> str:
    """Phase two's verdicts in words, one reStructuredText bullet per claim, from the rows of
    :func:`analyse` (``verdicts``) or of ``verdicts.csv`` (strings); the results page includes it.

    Within a claim, comparisons are grouped by verdict in the order they first appear, each
    with its estimate, 95% interval, n, (Holm) p, paper label, registered power beside "not
    resolved" and the kind x policy interaction p. Only what ``rows`` says is written.
    """
    lines = []
    for claim in design["claims"]:
        mine = [r for r in rows if r["claim"] == claim["id"]]
        if not mine:
            continue
        groups: dict[str, list[str]] = {}
        for r in mine:
            groups.setdefault(r["verdict"], []).append(_comparison_words(r))
        said = "; ".join(f"**{verdict}** ({'; '.join(parts)})" for verdict, parts in groups.items())
        setting = mine[0].get("setting") or claim.get("setting", "")
        lines.append(f"* **{claim['claim']}** ({claim['id']}; {setting}): {said}.")
    return "\n".join(lines) + "\n"


COST_COLUMNS = ["experiment", "part", "cells", "cell_core_minutes", "cpu_minutes", "first_finished_utc",
                "last_finished_utc"]


def _cost_part(record: dict) -> str:
    """The part of a grid a record's cell belongs to, for the cost table: the passkey purpose
    (calibration or test), token-by-token prefill (``B = 1``), the geometry kind, or blocks."""
    params = record["params"]
    if "purpose" in params:
        return str(params["purpose"])
    if "kind" in params:
        return str(params["kind"])
    return "token by token" if params.get("block") == 1 else "blocks"


def cost_rows(records: dict[str, list[dict]]) -> list[dict]:
    """What each part of each grid cost, from its records' own times: cells, the sum of the cells'
    wall seconds in core-minutes (each cell runs on one core), their CPU minutes (the process's
    own: below the wall time where a cell waited for a shared core), and the first and last cell's finish time (UTC)."""
    rows = []
    for experiment in sorted(records):
        parts: dict[str, list[dict]] = {}
        for r in records[experiment]:
            parts.setdefault(_cost_part(r), []).append(r)
        for part in sorted(parts):
            mine = parts[part]
            finished = sorted(r["finished_utc"] for r in mine)
            rows.append({"experiment": experiment, "part": part, "cells": len(mine),
                         "cell_core_minutes": round(sum(r["wall_time_s"] for r in mine) / 60, 1),
                         "cpu_minutes": round(sum(r["cpu_time_s"] for r in mine) / 60, 1),
                         "first_finished_utc": finished[0], "last_finished_utc": finished[-1]})
    return rows or [{"experiment": "not run"}]
