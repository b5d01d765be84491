"""The experiment numbers quoted in README.rst, docs/guide/concepts.rst and docs/guide/choosing.rst.

Every sentence of those pages that quotes a measured number is written here, as a template
filled from the published tables (``docs/_static/choosing/quality_vs_budget.csv``, which
``docs/choosing_figure.py`` computes from the experiments, and
``docs/_static/experiments/perplexity/ppl.csv``), so the three pages cannot disagree (as
"under 2%" and "within 4%" once did). In each page the generated text sits between two
comments, each followed or preceded by a blank line::

    .. experiment-numbers: NAME

    ... generated text ...

    .. experiment-numbers: end

``python docs/experiment_numbers.py`` rewrites those blocks from the tables;
``python docs/experiment_numbers.py --check`` exits 1 naming each block that differs
(``tests/experiments/test_experiment_numbers.py`` runs the same check).
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
import textwrap
from pathlib import Path

from refkv.experiments.phase2_analysis import read_gzip_records
from refkv.experiments.records import read_records
from refkv.experiments.stats import paired_t_test
from refkv.files import OutputFolder

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
POINTS = HERE / "_static" / "choosing" / "quality_vs_budget.csv"
PPL = HERE / "_static" / "experiments" / "perplexity" / "ppl.csv"
#: The registered run's published tables (``docs/registered_verdicts.py`` writes them).
REGISTERED = HERE / "_static" / "experiments" / "registered"
#: Phase two's published tables (``docs/phase2_verdicts.py`` writes them from its records).
PHASE2 = HERE / "_static" / "experiments" / "phase2"
#: The attention-based policies the budget advice speaks of.
ATTENTION = ("h2o", "snapkv", "tova")
#: A generated block: the opening comment, the text, the closing comment.
BLOCK = re.compile(r"(?P<open>^(?P<indent>[ \t]*)\.\. experiment-numbers: (?P<name>[\w-]+)\n\n)(?P<body>.*?)"
                   r"(?P<close>\n^(?P=indent)\.\. experiment-numbers: end\n)", re.M | re.S)


def _read(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def registered_values(folder: Path = REGISTERED) -> dict[str, str]:
    """The registered run's numbers the pages quote, from its per-unit table and calibration:
    passkey answers out of the prompts per policy and prefill, and KeyDiff's mean per-text
    perplexity gap to SnapKV, TOVA and H2O."""
    units = _read(folder / "units.csv")
    chosen = int(_read(folder / "choices.csv")[0]["calibrated_length"])
    full = next(r for r in _read(folder / "calibration.csv") if int(r["length"]) == chosen)

    def answered(claim, a, b, side):
        rows = [r for r in units if (r["claim"], r["a"], r["b"]) == (claim, a, b)]
        return f"{sum(r[side] == 'True' for r in rows)}/{len(rows)}"

    def l1_gap(b):
        rows = [r for r in units if (r["claim"], r["a"], r["b"]) == ("L1", "keydiff", b)]
        return sum(float(r["value_a"]) - float(r["value_b"]) for r in rows) / len(rows)

    gaps = [l1_gap(b) for b in ATTENTION]
    # H2O - SnapKV per text: both are L1's B side on the same texts
    ppl = {b: {r["unit"]: float(r["value_b"]) for r in units if (r["claim"], r["a"], r["b"]) == ("L1", "keydiff", b)}
           for b in ("h2o", "snapkv")}
    texts_h2o = sorted(ppl["h2o"])
    h2o_snapkv, _ = paired_t_test([ppl["h2o"][t] for t in texts_h2o], [ppl["snapkv"][t] for t in texts_h2o])
    oneshot = [r for r in read_records(folder / "records" / "passkey-test.jsonl")
               if r["params"]["policy"] == "keydiff" and r["params"]["block"] is None]
    caote = next(r for r in _read(folder / "verdicts.csv") if (r["claim"], r["b"]) == ("C1", "h2o"))
    texts = {len([r for r in units if (r["claim"], r["a"], r["b"]) == ("L1", "keydiff", b)]) for b in ATTENTION}
    return {
        "reg_length": f"{chosen:,}", "reg_budget": str(chosen // 8),
        "reg_full": f"{int(full['correct'])}/{int(full['prompts'])}",
        "reg_keydiff_blocks": answered("P1", "keydiff", "snapkv", "value_a"),
        "reg_snapkv_blocks": answered("P1", "keydiff", "snapkv", "value_b"),
        "reg_tova_blocks": answered("P1", "keydiff", "tova", "value_b"),
        "reg_h2o_blocks": answered("P1", "keydiff", "h2o", "value_b"),
        "reg_snapkv_oneshot": answered("P2", "snapkv@oneshot", "snapkv@blocks", "value_a"),
        "reg_tova_oneshot": answered("P2", "tova@oneshot", "tova@blocks", "value_a"),
        "reg_h2o_oneshot": answered("P2", "h2o@oneshot", "h2o@blocks", "value_a"),
        "reg_l1_range": f"{min(gaps):.1f}-{max(gaps):.1f}", "reg_texts": str(texts.pop()),
        "reg_caote_h2o": f"{-float(caote['estimate']):.2f} [{-float(caote['high']):.2f}, {-float(caote['low']):.2f}]",
        "reg_h2o_snapkv": f"{h2o_snapkv.estimate:+.2f} [{h2o_snapkv.low:+.2f}, {h2o_snapkv.high:+.2f}]",
        "reg_keydiff_oneshot": f"{sum(bool(r['result']['correct']) for r in oneshot)}/{len(oneshot)}",
    }


def phase2_values(folder: Path = PHASE2) -> dict[str, str]:
    """Phase two's passkey test as the README quotes it (``p2_passkey``), from its published
    units and verdicts and the full cache's test records: answers out of the test prompts per
    policy and prefill, and each registered comparison's verdict; before the test phase's
    records are committed, a sentence saying so."""
    verdicts = {(r["claim"], r["a"], r["b"]): r for r in _read(folder / "verdicts.csv")}
    return {**_phase2_passkey(folder, verdicts), **_phase2_text(verdicts), **_phase2_token_by_token(verdicts)}


def _phase2_text(verdicts: dict) -> dict[str, str]:
    """``p2_text``: phase two's L1 and C1 in one sentence, from its verdicts (or that they have not
    run), without a full stop: the page's list goes on after it."""
    l1 = [verdicts[("L1", "keydiff", b)] for b in ("snapkv", "tova", "h2o")]
    c1 = [verdicts[("C1", f"caote:base={b}", b)] for b in ("h2o", "tova", "snapkv")]
    if any(r["estimate"] == "" for r in l1 + c1):
        return {"p2_text": "Phase two, on 21 documents of 6 kinds, has not run its perplexity grid yet"}
    gaps = [float(r["estimate"]) for r in l1]

    def lowered(r):
        return f"{-float(r['estimate']):.2f} [{-float(r['high']):.2f}, {-float(r['low']):.2f}] ({r['verdict']})"
    return {"p2_text": textwrap.fill(
        f"In phase two ({l1[0]['n']} documents of 6 kinds, two windows each, ``N = 128``) KeyDiff raised "
        f"perplexity {min(gaps):.1f}-{max(gaps):.1f} more than SnapKV, TOVA and H2O (L1 {l1[0]['verdict']} on "
        f"perplexity, a metric the paper does not report), and CAOTE lowered H2O's by {lowered(c1[0])}, TOVA's by "
        f"{lowered(c1[1])} and SnapKV's by {lowered(c1[2])}, each {c1[0]['versus_paper']}"
        f"{'' if len({r['versus_paper'] for r in c1}) == 1 else ' (see the table)'}",
        width=98, subsequent_indent="  ")}


def _phase2_token_by_token(verdicts: dict) -> dict[str, str]:
    """``p2_kernel``: phase two's claims on the policies that read no attention weights (M1: MAT
    against sink; H1: HashEvict against L2 with the same protection, perplexity; A1: attention
    lost per step), each comparison as ``A - B`` with its interval and verdict, or that its
    grid has not run."""
    def said(claim, a, b, what):
        r = verdicts[(claim, a, b)]
        if r["estimate"] == "":
            return f"{what} has not run ({claim})"
        versus = "" if r["versus_paper"] in ("", "not comparable") else f", {r['versus_paper']}"
        return (f"{what} {float(r['estimate']):+.2g} [{float(r['low']):+.2g}, {float(r['high']):+.2g}] "
                f"({claim} {r['verdict']}{versus})")
    parts = [said("M1", "mat@selected", "sink", "MAT - sink in perplexity"),
             said("H1", "hashevict", "knorm:recent=10,sink=4",
                  "HashEvict (mean of 3 hash seeds) - L2 with HashEvict's protection in perplexity"),
             said("A1", "hashevict", "knorm:recent=10,sink=4", "in attention lost per step HashEvict - that L2"),
             said("A1", "h2o", "hashevict", "H2O - HashEvict")]
    return {"p2_kernel": textwrap.fill(
        "In phase two (21 documents of 6 kinds, token by token, ``N = 128``; ``N = 256`` for attention loss): "
        + "; ".join(parts) + ".", width=98, subsequent_indent="  ")}


def _phase2_passkey(folder: Path, verdicts: dict) -> dict[str, str]:
    """``p2_passkey`` and ``p2_blocks``: phase two's passkey test (or that it has not run)."""
    units = [r for r in _read(folder / "units.csv") if r["claim"] in ("P1", "P2")]
    if not units:
        return {"p2_passkey": "Phase two, registered to decide this on 21 documents of 6 kinds, has not run its "
                              "passkey test yet.", "p2_blocks": "Phase two's passkey test has not run yet."}

    def answered(claim, a, b, side):
        rows = [r for r in units if (r["claim"], r["a"], r["b"]) == (claim, a, b)]
        return f"{sum(r[side] == 'True' for r in rows)}/{len(rows)}"

    def verdict(claim, a, b):
        return verdicts[(claim, a, b)]["verdict"]

    test = [r for path in sorted((folder / "records").glob("*.jsonl.gz")) for r in read_gzip_records(path)
            if r["experiment"] == "passkey2" and r["params"].get("purpose") == "test"
            and r["params"]["policy"] == "full"]
    budget = int(next(r for r in _read(folder / "calibration.csv") if r["budget"] == "chosen")["a"])
    prompts = {r["unit"] for r in units}
    documents = {u.split("/")[0] for u in prompts}
    kinds = {r["kind"] for r in units}
    policies = [("KeyDiff", "keydiff", None), ("SnapKV", "snapkv", "snapkv"), ("TOVA", "tova", "tova"),
                ("H2O", "h2o", "h2o")]
    said = []
    for name, p1_side, p2 in policies:
        blocks = (answered("P1", "keydiff", "snapkv", "value_a") if p1_side == "keydiff"
                  else answered("P1", "keydiff", p1_side, "value_b"))
        oneshot = f" ({answered('P2', f'{p2}@oneshot', f'{p2}@blocks', 'value_a')} in one shot)" if p2 else ""
        said.append(f"{name} {blocks}{oneshot}")
    display = {"snapkv": "SnapKV", "tova": "TOVA", "h2o": "H2O"}
    p1 = ", ".join(f"{display[b]} {verdict('P1', 'keydiff', b)}" for b in display)
    p2 = ", ".join(f"{display[b]} {verdict('P2', f'{b}@oneshot', f'{b}@blocks')}" for b in display)
    one_shot = ", ".join(
        f"{display[b]} {answered('P2', f'{b}@oneshot', f'{b}@blocks', 'value_a')} against "
        f"{answered('P2', f'{b}@oneshot', f'{b}@blocks', 'value_b')} ({verdict('P2', f'{b}@oneshot', f'{b}@blocks')})"
        for b in display)
    kinds_p = ", ".join(f"{float(verdicts[('P1', 'keydiff', b)]['p_interaction_kind']):.2g}" for b in display)
    return {"p2_passkey": textwrap.fill(
        f"In phase two, registered to decide this ({len(prompts)} prompts from {len(documents)} documents of "
        f"{len(kinds)} kinds, ``N = {budget}`` of 1,024 tokens, blocks of {budget // 16}; without eviction "
        f"{sum(bool(r['result']['correct']) for r in test)}/{len(test)}), KeyDiff in blocks answered "
        f"{said[0].split(' ', 1)[1]}, {', '.join(said[1:-1])} and {said[-1]}. KeyDiff better than each in "
        f"blocks (P1): {p1} (the kind x policy interaction p: {kinds_p}); one-shot better than blocks (P2): "
        f"{p2}.", width=98, subsequent_indent="  "),
            "p2_blocks": textwrap.fill(
                f"In phase two (``N = {budget}`` of 1,024 tokens, blocks of {budget // 16}, {len(prompts)} "
                f"prompts), one shot against blocks: {one_shot}.", width=98)}


def values(points_csv: Path = POINTS, ppl_csv: Path = PPL) -> dict[str, str]:
    """Every quoted number, formatted as the pages print it, from the published tables."""
    points = _read(points_csv)
    ppl = _read(ppl_csv)

    def gap(policy, budget):
        return next(float(r["value"]) for r in points
                    if r["panel"] == "delta_ppl" and r["policy"] == policy and r["budget"] == str(budget))

    def accuracy(policy, block):
        return next(float(r["value"]) for r in points
                    if r["panel"] == "passkey" and r["policy"] == policy and r["block"] == block)

    full = next(r for r in ppl if r["policy"] == "full" and r["block"] == "32")
    reference = float(full["ppl"])
    reserve = next(float(r["gap"]) for r in ppl if r["policy"] == "keydiff:reserve=0.5" and r["budget"] == "128"
                   and r["block"] == "32")
    budgets = sorted({int(r["budget"]) for r in points if r["panel"] == "delta_ppl"})
    passkey_n = {r["n"] for r in points if r["panel"] == "passkey"}
    tokens = {r["n"] for r in points if r["panel"] == "delta_ppl"}
    if len(passkey_n) != 1 or len(tokens) != 1:
        raise ValueError(f"the sample sizes differ between rows: {sorted(passkey_n)} prompts, {sorted(tokens)} tokens")
    texts = int(full["segments"])
    percent = {n: [100 * gap(p, n) / reference for p in ATTENTION] for n in (128, 256)}
    others = [float(r["value"]) for r in points if r["panel"] == "passkey" and r["policy"] not in ("keydiff", "full")]
    blocks_attention = [accuracy(p, "128") for p in ATTENTION]

    def f2(x):
        return f"{x:.2f}"

    def f1(x):
        return f"{x:.1f}"

    def acc(x):
        return f"{x:.1f}".rstrip("0").rstrip(".") if x else "0"

    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
    return {
        "reference": f2(reference),
        "texts": words.get(texts, str(texts)),
        "h2o_128": f2(gap("h2o", 128)), "h2o_256": f2(gap("h2o", 256)),
        "h2o_128_percent": f"{100 * gap('h2o', 128) / reference:.0f}%",
        "h2o_256_percent": f"{100 * gap('h2o', 256) / reference:.1f}%",
        "snapkv_tova_128": f"{f1(min(gap('snapkv', 128), gap('tova', 128)))}-"
                           f"{f1(max(gap('snapkv', 128), gap('tova', 128)))}",
        "snapkv_tova_256": f"{f1(min(gap('snapkv', 256), gap('tova', 256)))}-"
                           f"{f1(max(gap('snapkv', 256), gap('tova', 256)))}",
        "caote_128": f2(gap("caote:base=h2o", 128)), "caote_256": f2(gap("caote:base=h2o", 256)),
        "quarter_within": f"{math.ceil(max(percent[256]))}%",
        "quarter_range": f"{min(percent[256]):.1f}-{max(percent[256]):.1f}%",
        "eighth_range": f"{min(percent[128]):.0f}-{max(percent[128]):.0f}%",
        "keydiff_blocks": acc(accuracy("keydiff", "128")), "keydiff_oneshot": acc(accuracy("keydiff", "none")),
        "keydiff_range": f"{acc(min(accuracy('keydiff', '128'), accuracy('keydiff', 'none')))}-"
                         f"{acc(max(accuracy('keydiff', '128'), accuracy('keydiff', 'none')))}",
        "full_passkey": acc(accuracy("full", "128")),
        "others_range": f"{acc(min(others))}-{acc(max(others))}",
        "attention_blocks_range": f"{acc(min(blocks_attention))}-{acc(max(blocks_attention))}",
        "tova_oneshot": acc(accuracy("tova", "none")), "tova_blocks": acc(accuracy("tova", "128")),
        "prompts": passkey_n.pop(),
        "keydiff_128": f1(gap("keydiff", 128)), "keydiff_reserve_128": f1(reserve),
        "sink_256": f2(gap("sink", 256)), "mat_256": f2(gap("mat", 256)), "knorm_256": f1(gap("knorm", 256)),
        "budget_low": str(budgets[0]), "budget_high": str(budgets[-1]),
        **registered_values(), **phase2_values(),
    }


#: The generated text of each block, by name (``{name}`` fields from :func:`values`).
TEMPLATES = {
    "readme-which-policy": """\
* **continuing or summarising text**: an attention-based policy. In the registered run ({reg_texts}
  texts of 1,024 tokens, ``N = 128``) KeyDiff raised perplexity {reg_l1_range} more than SnapKV, TOVA
  and H2O, and H2O and SnapKV could not be told apart (H2O - SnapKV {reg_h2o_snapkv}); CAOTE
  lowered H2O's by {reg_caote_h2o}. (In an exploratory run on {texts} texts H2O raised it least,
  by {h2o_128} at ``N = 128``.)
  {p2_text};
* **finding one fact far back in a long prompt**: measure first; on this 135M model every
  policy answered fewer than the full cache. In the registered run (60 prompts of
  {reg_length} tokens, a needle at a random depth in varied text, ``N = {reg_budget}``; without
  eviction {reg_full}) KeyDiff answered
  {reg_keydiff_blocks} with blocks of 128, SnapKV {reg_snapkv_blocks} ({reg_snapkv_oneshot} in one shot),
  TOVA {reg_tova_blocks} and H2O {reg_h2o_blocks}. (An exploratory test whose repeated filler makes the needle the most
  distinctive key had KeyDiff answer {keydiff_range}.)
  {p2_passkey}
* **a kernel that never forms the attention weights** (FlashAttention-style): KeyDiff,
  HashEvict, MAT, L2 norm, ExpectedAttention or sink need none; TOVA and SnapKV read only
  the last 1 or ``w`` rows, which a backend recomputes beside the fused kernel; only H2O and
  Scissorhands (and CAOTE over them), which accumulate every query's attention, conflict;
* **budget**: in an exploratory run on {texts} texts, about a quarter of the prompt kept H2O, SnapKV
  and TOVA within {quarter_within} of the perplexity without eviction, an eighth cost {eighth_range}; for
  retrieval, measure before you evict (``refkv experiment passkey``).
""",
    "concepts-budget": """\
The cache grows by one entry per token, per layer and per KV head. An *eviction policy*
keeps it to a budget of :math:`N` tokens: whenever the cache holds more than :math:`N`, the
policy scores the tokens and the cache keeps the :math:`N` highest (KeyDiff Eqs. 4, 5). In
refkv the budget is per layer and per KV head; each head may keep *different* tokens, but
every head keeps the same number. Retained tokens stay in position order. How large
:math:`N` should be for a prompt of :math:`T` tokens, and which policy to use for what, is
the subject of :doc:`choosing` (in short: on SmolLM2, in an exploratory run on {texts} texts,
:math:`N \\approx T/4` kept H2O, SnapKV and TOVA within {quarter_within} of the perplexity without
eviction ({quarter_range}); retrieving one fact needed more).
""",
    "choosing-figure": """\
.. figure:: ../_static/choosing/quality_vs_budget.svg
   :alt: Left: perplexity increase over no eviction against the budget N, one line per
         policy with its 95% interval as a bar (shifted sideways a little per policy), log
         scale. Right: passkey accuracy at N = 256 per policy with Wilson 95% intervals.
   :width: 100%

   Exploratory, not a registered result (the registered run's verdicts are on
   :doc:`experiments`; there no policy answered more than 2 of 60 passkeys in blocks). Left: how
   much perplexity rises over no eviction ({reference}) on {texts} 1,024-token texts, at
   budgets :math:`N` from {budget_low} to {budget_high} with blocks of :math:`B = 32`; bars are 95%
   intervals. Right: passkey accuracy ({prompts} prompts of 1-2K tokens, :math:`N = 256`),
   filled with block processing (:math:`B = 128`), open in one shot, with Wilson 95%
   intervals; the dashed line is the model without eviction. The numbers are in
   :download:`quality_vs_budget.csv <../_static/choosing/quality_vs_budget.csv>`;
   ``python docs/choosing_figure.py`` redraws the figure from the published experiment
   tables, and a test fails when the figure's numbers no longer match them.
""",
    "choosing-task": """\
* *Continue or summarise text* (every token matters a little): an **attention-based**
  policy. On the registered run's {reg_texts} texts at :math:`N = 128`, H2O and SnapKV could not be
  told apart (H2O - SnapKV {reg_h2o_snapkv} in perplexity), and CAOTE on top of H2O lowered its
  perplexity by {reg_caote_h2o}. In the exploratory run (two texts, so the intervals describe
  those texts only) H2O raised perplexity least: by {h2o_128} at :math:`N = 128` ({h2o_128_percent} of
  {reference}) and {h2o_256} at :math:`N = 256` ({h2o_256_percent}), with SnapKV and TOVA close
  behind ({snapkv_tova_128} and {snapkv_tova_256}), and CAOTE made no difference those texts
  could resolve ({caote_128} and {caote_256}).
  {p2_text}.
* *Find one fact far back in a long prompt* (retrieval, the passkey test): **measure
  first**; no policy was safe at an eighth of the prompt. In the registered run (60 prompts
  of {reg_length} tokens, the needle at a random depth in varied text, :math:`N = {reg_budget}`; without
  eviction {reg_full}) KeyDiff answered {reg_keydiff_blocks} with blocks of 128, SnapKV {reg_snapkv_blocks}
  and {reg_snapkv_oneshot} in one shot, TOVA {reg_tova_blocks} and H2O {reg_h2o_blocks}
  (:doc:`experiments`): at an eighth of the prompt every policy sat at the floor, so the
  advantage KeyDiff's paper reports could not be tested there. In an earlier exploratory
  test ({prompts} prompts, a repeated filler, so that the
  needle was the most distinctive key by construction) KeyDiff answered {keydiff_blocks}
  with blocks of 128 and {keydiff_oneshot} in one shot, against {full_passkey} without eviction.
  {p2_passkey}
  KeyDiff raised perplexity far more than the attention-based policies ({reg_l1_range} more than
  SnapKV, TOVA and H2O on {reg_texts} texts in the registered run; {keydiff_128} at :math:`N = 128` in the
  exploratory one, {keydiff_reserve_128} with a recent reserve of half the budget): it keeps *diverse*
  keys, not the recent context that next-token prediction leans on.
""",
    "choosing-kernel": """\
**Can your kernel give the attention weights?** A fused (FlashAttention-style) kernel
never forms them. How much that matters depends on how much of the matrix a policy reads
(the :doc:`policy table <../policies/index>` has a column for what each needs):

* KeyDiff, HashEvict, MAT, L2 norm, ExpectedAttention and sink read no attention weights
  at all. Among those, sink ({sink_256} at :math:`N = 256`) and MAT ({mat_256}) kept perplexity
  lowest and L2 norm was last ({knorm_256}, and no passkey answered) in the exploratory run;
  KeyDiff retrieved best there (the registered runs' passkey results are above).
  {p2_kernel}
* TOVA reads one row of the matrix (the last query's) and SnapKV :math:`w` rows (its
  window's queries). A backend keeps the fused kernel for the attention output and
  recomputes those rows beside it, at :math:`O(w\\,n)` extra work; kvpress's
  ``SnapKVPress`` recomputes its window's queries this way. Tutorial 3 checks that the
  recomputed rows give the same scores.
* H2O and Scissorhands (and CAOTE over them) accumulate the attention *every* query gives
  every token, so they need the whole matrix at every step: these are the policies that
  really conflict with fused kernels.

:ref:`Tutorial 9 <sphx_glr_tutorials_09_families.py>` maps every family on these
questions -- needs attention weights or not, evicts before or after attention, works with
a fused kernel (with the row-recompute option), uses the question or not -- and runs five
of them on a real passage.
""",
    "choosing-blocks": """\
**How is the prompt processed?** With block processing (a long prompt read in blocks of
:math:`B` under the budget, KeyDiff Eq. 6) every policy sees only part of the prompt when
it evicts. In the registered passkey run (:math:`N = {reg_budget}` of {reg_length} tokens, :math:`B = 128`) every
policy was near the floor in blocks (KeyDiff {reg_keydiff_blocks}, SnapKV {reg_snapkv_blocks}, TOVA
{reg_tova_blocks}, H2O {reg_h2o_blocks}); one shot lifted SnapKV to {reg_snapkv_oneshot} and KeyDiff to
{reg_keydiff_oneshot}, TOVA and H2O not at all ({reg_tova_oneshot}, {reg_h2o_oneshot}). (In the exploratory run,
whose repeated filler makes the needle the most distinctive key: TOVA {tova_oneshot} one-shot and
{tova_blocks} in blocks, KeyDiff {keydiff_oneshot} and {keydiff_blocks}.) {p2_blocks} HashEvict and MAT evict
before attention and need :math:`B` below :math:`N` (refkv tells you the limit).
""",
    "choosing-budget": """\
**Which budget?** In the exploratory run (two texts, 10 passkey prompts), :math:`N` of about a quarter of the prompt
(:math:`N = 256` for 1,024 tokens) kept H2O, SnapKV and TOVA within {quarter_within} of the perplexity
without eviction ({quarter_range}), and an eighth (:math:`N = 128`) cost {eighth_range}. For retrieval a
quarter was not enough for any policy to match no eviction (KeyDiff {keydiff_range} against {full_passkey} on
1-2K-token prompts, so :math:`N` was an eighth to a quarter of the prompt). If an answer
must come from one sentence of a long document, do not evict -- or measure first:
""",
}
#: Where each block lives.
PAGES = {"readme-which-policy": ROOT / "README.rst", "concepts-budget": HERE / "guide" / "concepts.rst",
         "choosing-figure": HERE / "guide" / "choosing.rst", "choosing-task": HERE / "guide" / "choosing.rst",
         "choosing-kernel": HERE / "guide" / "choosing.rst", "choosing-blocks": HERE / "guide" / "choosing.rst",
         "choosing-budget": HERE / "guide" / "choosing.rst"}


def render(numbers: dict[str, str] | None = None) -> dict[str, str]:
    """Every block's text from the published tables."""
    numbers = values() if numbers is None else numbers
    return {name: template.format(**numbers) for name, template in TEMPLATES.items()}


def update(text: str, blocks: dict[str, str]) -> tuple[str, list[str]]:
    """``text`` with each generated block replaced; also the names of the blocks that changed.
    A block name the text holds but :data:`TEMPLATES` does not know is an error."""
    changed = []

    def replace(match):
        name = match["name"]
        if name not in blocks:
            raise ValueError(f"block {name!r} is not generated here (known: {sorted(blocks)})")
        body = "".join(match["indent"] + line if line.strip() else line
                       for line in blocks[name].splitlines(keepends=True))
        if body != match["body"]:
            changed.append(name)
        return match["open"] + body + match["close"]

    return BLOCK.sub(replace, text), changed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python docs/experiment_numbers.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each block that differs from the tables")
    check = parser.parse_args(argv).check  # unknown arguments: exit 2; --help: exit 0, nothing written
    blocks = render()
    stale, missing = [], []
    for page in sorted(set(PAGES.values())):
        text = page.read_text(encoding="utf-8")
        new, changed = update(text, blocks)
        found = {m["name"] for m in BLOCK.finditer(text)}
        missing += [name for name, where in PAGES.items() if where == page and name not in found]
        stale += [f"{page.relative_to(ROOT)}: {name}" for name in changed]
        if changed and not check:
            OutputFolder(ROOT).write_text(page.relative_to(ROOT).as_posix(), new)
    if missing:
        print(f"blocks missing from their pages: {', '.join(missing)}")
        return 1
    if check and stale:
        print("the quoted experiment numbers differ from the tables (run `python docs/experiment_numbers.py`): "
              + "; ".join(stale))
        return 1
    print(("checked" if check else "updated") + f" {len(blocks)} blocks" + (f"; rewrote {len(stale)}" if stale and
                                                                            not check else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
