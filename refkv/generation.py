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
* ``refkv generate`` shows a progress line on stderr only when the prompt's processing
  is on course to take more than :data:`PROGRESS_AFTER_SECONDS`, so short runs and pipes
  stay clean.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from .engine import Engine

__all__ = ["PROGRESS_AFTER_SECONDS", "Generation", "add_generate_command", "example_passage", "generate_text"]


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
#: A prefill expected to take longer than this many seconds gets a progress line.
PROGRESS_AFTER_SECONDS = 2.0


def example_passage() -> str:
    """The passage with a question that ``refkv generate --example`` uses (about 300 tokens).

    Long enough that a budget of 64 or 128 tokens evicts most of it, so the statistics
    show eviction at work; the answer is in the passage's first half.
    """
    from importlib.resources import files

    return files("refkv").joinpath("data", "example_passage.txt").read_text(encoding="utf-8")


def add_generate_command(sub) -> None:
    """Register ``refkv generate`` on an argparse subparsers object."""
    from .cli import _policy_arguments

    p = sub.add_parser("generate", help="generate text with the real model under a KV-cache policy",
                       description="Greedy generation, streamed to stdout; progress and statistics go to "
                                   "stderr. The prompt is the PROMPT argument, a file (--prompt-file), "
                                   "stdin (PROMPT is -) or the shipped example passage (--example).")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text, or - to read it from stdin")
    p.add_argument("--prompt-file", metavar="PATH", default=None, help="read the prompt from this file")
    p.add_argument("--example", action="store_true",
                   help="use the shipped example: a ~300-token passage and a question about it")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2', 'tiny' (random, byte tokens), a .gguf file or a checkpoint directory")
    _policy_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="generation limit")
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help="default: float32 for trained models, float64 for tiny")
    p.set_defaults(func=_cmd_generate)


def _read_prompt(args) -> str:
    given = [name for name, on in (("PROMPT", args.prompt is not None), ("--prompt-file", args.prompt_file),
                                   ("--example", args.example)) if on]
    if len(given) != 1:
        raise ValueError("give exactly one of PROMPT, --prompt-file PATH or --example"
                         + (f" (got {' and '.join(given)})" if given else ""))
    if args.example:
        return example_passage()
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--prompt-file {args.prompt_file!r} cannot be read: {err}") from None
    return _read_stdin() if args.prompt == "-" else args.prompt


def _cmd_generate(args) -> int:
    from .cli import _ANY_DEPTH, check_policy_arguments, check_policy_for_model, evicted_summary
    from .model.config import TINY
    from .threads import blas_threads, choose_threads
    from .validation import check_int

    check_int("--max-new-tokens", args.max_new_tokens, 0)
    prompt = _read_prompt(args)
    _check_prompt(prompt)  # before loading the model: a bad byte fails at once
    if not prompt.strip():
        raise ValueError("the prompt must not be empty")
    tiny = None
    if args.model == "tiny":
        from .model.config import TINY as tiny
    policy = check_policy_arguments(args, tiny)  # before the model is read: errors come at once
    if args.block is None and args.budget is not None:
        # Every word is at least one token, so a prompt of more words than a policy's block
        # limit is refused now; the exact count is checked once the tokenizer is read.
        check_policy_for_model(policy, args, tiny or TINY.replace(n_layers=_ANY_DEPTH), len(prompt.split()),
                               at_least=True)
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    from .model.loading import load_with_tokenizer

    start = time.perf_counter()
    model, tokenizer = load_with_tokenizer(args.model, dtype=args.dtype)
    load_seconds = time.perf_counter() - start
    chat = not args.raw and tokenizer.has_chat_template
    ids = tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt)
    n_prompt = len(ids)
    check_policy_for_model(policy, args, model.config, n_prompt)
    choice = choose_threads(model.config, requested=args.threads)

    # "open": a progress line without its newline is on screen; it is ended before anything
    # else prints, so neither the reply nor an error is glued to it.
    line = {"started": False, "open": False, "printed": 0.0}
    tty = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        elapsed = time.perf_counter() - prefill_start
        on_course_for = elapsed * total / max(done, 1)  # extrapolated prefill time
        if not line["started"] and (done >= total or on_course_for <= PROGRESS_AFTER_SECONDS):
            return  # a fast prefill stays quiet
        rate = done / max(elapsed, 1e-9)
        text = f"prefill: {done}/{total} tokens ({rate:.0f} tokens/s)"
        if tty:  # redrawn in place
            print(f"\r{text}", end="", file=sys.stderr, flush=True)
            line["open"] = True
        elif done >= total or elapsed - line["printed"] >= PROGRESS_AFTER_SECONDS:  # a log: one line per ~2 s
            print(text, file=sys.stderr, flush=True)
            line["printed"] = elapsed
        line["started"] = True

    def end_line() -> None:
        if line["open"]:
            print(file=sys.stderr, flush=True)
            line["open"] = False

    def show(piece: str) -> None:
        end_line()
        sys.stdout.write(piece)
        sys.stdout.flush()

    if args.block is None and n_prompt >= 256:
        print(f"prefill: {n_prompt} tokens as one block (--block B shows progress) ...", file=sys.stderr,
              flush=True)
    prefill_start = time.perf_counter()
    try:
        with blas_threads(choice.n):
            result = generate_text(model, tokenizer, prompt, policy=policy, budget=args.budget,
                                   block_size=args.block, max_new_tokens=args.max_new_tokens, chat=chat,
                                   on_text=show, progress=progress)
    finally:
        end_line()
    print(flush=True)
    n_new = len(result.tokens)
    s = result.engine.stats
    block = "whole prompt" if args.block is None else args.block
    print(f"[{model.config.name} {model.dtype}, loaded in {load_seconds:.1f} s; policy {policy.describe()}, "
          f"budget {args.budget}, block {block}; prompt {n_prompt} tokens in {result.prefill_seconds:.2f} s; "
          f"{n_new} generated in {result.decode_seconds:.2f} s"
          f"{' (stop token)' if result.stopped else ' (limit)'}; peak cache {s.peak_cache_tokens} tokens per head; "
          f"threads {choice.n}, {choice.reason}]", file=sys.stderr)
    print(f"[{evicted_summary(result.engine)}]", file=sys.stderr)
    return 0
