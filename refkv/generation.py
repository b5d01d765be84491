"""Text generation with a KV-cache policy: :func:`generate_text` and ``refkv generate``.

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
* The progress line goes to stderr only for prompts of at least
  :data:`PROGRESS_MIN_TOKENS` tokens, so short runs and pipes stay clean.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from .engine import Engine

__all__ = ["PROGRESS_MIN_TOKENS", "Generation", "add_generate_command", "generate_text"]

#: Prompts at least this long get a progress line on stderr during prefill.
PROGRESS_MIN_TOKENS = 256


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
    """
    _check_prompt(prompt)
    if chat and not tokenizer.has_chat_template:
        raise ValueError(f"{tokenizer!r} has no chat template; use chat=False (--raw)")
    ids = tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt)
    if not ids:
        raise ValueError("prompt must not be empty (it encodes to no tokens)")
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


def _check_prompt(prompt) -> None:
    """Refuse a prompt that is not text, or holds bytes that were not UTF-8.

    Python hands over undecodable bytes of ``argv`` (and of stdin read with
    ``surrogateescape``) as lone surrogates ``U+DC80..U+DCFF``; the message shows the byte
    and its offset in the prompt as the user gave it (before any chat template wraps it).
    """
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
    match = _SURROGATE.search(prompt)
    if match is None:
        return
    code = ord(match.group())
    offset = len(prompt[:match.start()].encode("utf-8"))  # the first bad character: the prefix is clean
    if 0xDC80 <= code <= 0xDCFF:
        raise ValueError(f"prompt is not valid UTF-8: byte 0x{code - 0xDC00:02x} at byte {offset} of the prompt")
    raise ValueError(f"prompt is not valid Unicode: lone surrogate U+{code:04X} at byte {offset} of the prompt")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _read_stdin() -> str:
    """Standard input as text; bytes that are not UTF-8 become lone surrogates (then refused)."""
    raw = getattr(sys.stdin, "buffer", None)
    return sys.stdin.read() if raw is None else raw.read().decode("utf-8", "surrogateescape")


# -- the command ---------------------------------------------------------------------------
def add_generate_command(sub) -> None:
    """Register ``refkv generate`` on an argparse subparsers object."""
    from .cli import _policy_arguments

    p = sub.add_parser("generate", help="generate text with the real model under a KV-cache policy",
                       description="Greedy generation, streamed to stdout; statistics go to stderr.")
    p.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (default), 'tiny' (random, byte tokens), a .gguf file or a checkpoint directory")
    _policy_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="generation limit (default 128)")
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help="default: float32 for trained models, float64 for tiny")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args) -> int:
    from .cli import make_policy
    from .model.loading import load_with_tokenizer

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    prompt = _read_stdin() if args.prompt == "-" else args.prompt
    _check_prompt(prompt)  # before loading the model: a bad byte fails at once
    policy = make_policy(args)
    start = time.perf_counter()
    model, tokenizer = load_with_tokenizer(args.model, dtype=args.dtype)
    load_seconds = time.perf_counter() - start
    chat = not args.raw and tokenizer.has_chat_template
    n_prompt = len(tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt))

    def progress(done: int, total: int) -> None:
        rate = done / max(time.perf_counter() - prefill_start, 1e-9)
        print(f"\rprefill: {done}/{total} tokens ({rate:.0f} tokens/s)", end="", file=sys.stderr, flush=True)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    long_prompt = n_prompt >= PROGRESS_MIN_TOKENS
    prefill_start = time.perf_counter()
    result = generate_text(model, tokenizer, prompt, policy=policy, budget=args.budget, block_size=args.block,
                           max_new_tokens=args.max_new_tokens, chat=chat, on_text=show,
                           progress=progress if long_prompt else None)
    if long_prompt:
        print(file=sys.stderr)
    print(flush=True)
    n_new = len(result.tokens)
    s = result.engine.stats
    print(f"[{model.config.name} {model.dtype}, loaded in {load_seconds:.1f} s; policy {policy.describe()}, "
          f"budget {args.budget}, block {args.block}; prompt {n_prompt} tokens in {result.prefill_seconds:.2f} s; "
          f"{n_new} generated in {result.decode_seconds:.2f} s"
          f"{' (stop token)' if result.stopped else ' (limit)'}; peak cache {s.peak_cache_tokens} tokens per head]",
          file=sys.stderr)
    return 0
