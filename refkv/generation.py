"""Text generation with a KV-cache policy: :func:`generate_text` (``refkv generate`` is in :mod:`refkv.cli`).

The prompt is tokenized (inside the model's chat template unless ``raw``), processed
in blocks of ``B`` under the policy and budget (:meth:`refkv.engine.Engine.prefill`),
then decoded greedily one token at a time (``B = 1``) until an end token or the limit.
Each token's text is handed out as soon as it is chosen; a character split across
tokens (multi-byte UTF-8) is handed out once complete (:class:`~refkv.model.tokenizer.StreamDecoder`).

Notes
-----
* Greedy decoding only: ``argmax`` of the logits, ties to the lowest id (NumPy's rule).
* Stop tokens (EOS, ``<|endoftext|>``) end generation; they are kept in
  :attr:`Generation.tokens` but not in :attr:`Generation.text`.
* :func:`example_passage` is the ~300-token passage ``refkv generate --example`` asks
  about (long enough that a budget of 64-128 tokens evicts most of it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .engine import Engine
from .validation import check_context, check_prompt

__all__ = ["Generation", "example_answer", "example_passage", "example_question", "generate_text"]


@dataclass(frozen=True)
class Generation:
    """What :func:`generate_text` returns.

    Attributes
    ----------
    prompt_tokens : list of int
    tokens : list of int
        Generated ids, including a final stop id if one ended generation.
    text : str
        Text of the generated ids without the stop id.
    stopped : bool
        True if a stop id ended generation (False: the token limit did).
    prefill_seconds, decode_seconds : float
    engine : Engine
        The engine after generation (its caches, stats and trace).
    """

    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    stopped: bool
    prefill_seconds: float
    decode_seconds: float
    engine: Engine


def generate_text(model, tokenizer, prompt: str, *, policy="full", budget: int | None = None,
                  block_size: int | None = None, max_new_tokens: int = 64, chat: bool = True,
                  on_text: Callable[[str], None] | None = None,
                  progress: Callable[[int, int], None] | None = None, **engine_options) -> Generation:
    """Generate a continuation (or a chat reply) of ``prompt`` greedily.

    Parameters
    ----------
    model : Model
    tokenizer : Tokenizer or ByteTokenizer
    prompt : str
    policy : Policy or str
    budget : int or None
        ``N`` per layer and KV head; ``None`` keeps everything.
    block_size : int or None
        ``B`` for the prompt; ``None`` processes it as one block.
    max_new_tokens : int
    chat : bool
        Wrap the prompt as one user message in the chat template. Requires a
        tokenizer with one (``ValueError`` otherwise).
    on_text : callable, optional
        Called with each new piece of text as it is produced (streaming).
    progress : callable, optional
        ``progress(done, total)`` after each prompt block.
    **engine_options
        Passed to :class:`~refkv.engine.Engine` (``record``, ``key_chunk``).

    Examples
    --------
    On the built-in random model (byte tokens, no chat template, so ``chat=False``); with
    the real model, ``load_with_tokenizer("smollm2")`` and a question instead:

    >>> from refkv.generation import generate_text
    >>> from refkv.model import load_with_tokenizer
    >>> model, tokenizer = load_with_tokenizer("tiny")
    >>> result = generate_text(model, tokenizer, "x" * 100, policy="tova",
    ...                        budget=32, block_size=16, max_new_tokens=4,
    ...                        chat=False)
    >>> len(result.prompt_tokens), len(result.tokens)
    (100, 4)
    >>> result.engine.caches[0].positions.shape  # KV heads x N
    (2, 32)
    """
    check_prompt(prompt)
    if chat and not tokenizer.has_chat_template:
        raise ValueError(f"{tokenizer!r} has no chat template; use chat=False (--raw)")
    ids = tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt)
    if not ids:
        raise ValueError("prompt must not be empty (it encodes to no tokens)")
    check_context(len(ids), model.config.max_positions)
    engine = Engine(model, policy, budget, **engine_options)
    stream, pieces = tokenizer.stream(), []
    stop_ids = tokenizer.stop_ids

    def emit(token: int) -> None:
        if token in stop_ids:
            return
        piece = stream.feed(token)
        if piece:
            pieces.append(piece)
            if on_text is not None:
                on_text(piece)

    start = time.perf_counter()
    logits = engine.prefill(ids, block_size, progress=progress)
    middle = time.perf_counter()
    new = engine.generate(logits, max_new_tokens, eos=stop_ids, on_token=emit)
    tail = stream.flush()
    if tail:
        pieces.append(tail)
        if on_text is not None:
            on_text(tail)
    return Generation(prompt_tokens=list(ids), tokens=new, text="".join(pieces),
                      stopped=bool(new) and new[-1] in stop_ids, prefill_seconds=middle - start,
                      decode_seconds=time.perf_counter() - middle, engine=engine)


def example_passage() -> str:
    """The passage with a question that ``refkv generate --example`` uses (about 300 tokens).

    Long enough that a budget of 64 or 128 tokens evicts most of it, so the statistics
    show eviction at work; the answer is in the passage's first half.
    """
    from importlib.resources import files

    return files("refkv").joinpath("data", "example_passage.txt").read_text(encoding="utf-8")


def example_question() -> str:
    """The question at the end of :func:`example_passage` (its last line, without ``Question:``)."""
    last = example_passage().strip().splitlines()[-1]
    return last.removeprefix("Question:").strip()


def example_answer() -> str:
    """The reference answer to :func:`example_question`, from the passage (its designer and year)."""
    from importlib.resources import files

    return files("refkv").joinpath("data", "example_answer.txt").read_text(encoding="utf-8").strip()
