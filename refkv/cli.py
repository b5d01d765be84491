"""The ``refkv`` command (also ``python -m refkv``).

Subcommands are added by small ``add_*`` functions so each feature keeps its own
command next to its code; :func:`build_parser` lists them.
"""

from __future__ import annotations

import argparse
import ast
import sys

import numpy as np

from . import __version__, policies
from .engine import Engine
from .experiments.cli import add_experiment_command
from .formatting import format_ranges
from .generation import add_generate_command
from .oracle.cli import add_golden_command

__all__ = ["build_parser", "format_ranges", "main", "parse_params"]


def parse_params(items: list[str] | None) -> dict:
    """Parse ``["key=value", ...]`` into a dict; values are Python literals or strings.

    ``ast.literal_eval`` only reads literals (numbers, strings, tuples, booleans, None),
    so nothing is executed.
    """
    params = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--param must look like name=value, got {item!r}")
        try:
            params[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            params[key] = raw
    return params


def _policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="full", help="policy name (see `refkv policies`)")
    parser.add_argument("--param", action="append", metavar="NAME=VALUE",
                        help="policy parameter, repeatable (e.g. --param sink=4)")
    parser.add_argument("--budget", type=int, default=None, help="N, tokens per layer and KV head")
    parser.add_argument("--block", type=int, default=None, help="B, prompt block size (default: whole prompt)")


def make_policy(args) -> policies.Policy:
    """Build the policy named by ``--policy`` with its ``--param`` values."""
    return policies.get(args.policy, **parse_params(args.param))


def add_policies_command(sub) -> None:
    p = sub.add_parser("policies", help="list the eviction policies")
    p.set_defaults(func=_cmd_policies)


def _cmd_policies(args) -> int:
    for name in policies.available():
        cls = policies.policy_class(name)
        print(f"{name:14s} {cls.summary}")
        print(f"{'':14s}   paper: {cls.paper}; defaults: {cls().describe()}")
    return 0


def add_run_command(sub) -> None:
    p = sub.add_parser("run", help="block prompt processing + generation on the built-in model")
    _policy_arguments(p)
    p.add_argument("--prompt-len", type=int, default=300, help="random prompt length (tokens)")
    p.add_argument("--new-tokens", type=int, default=20, help="tokens to generate greedily")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompt")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args) -> int:
    from .model import load

    if args.prompt_len < 1:
        raise ValueError(f"--prompt-len must be >= 1, got {args.prompt_len}")
    if args.seed < 0:
        raise ValueError(f"--seed must be an integer >= 0, got {args.seed}")
    model = load("tiny", dtype=args.dtype, seed=args.seed)
    prompt = np.random.default_rng(args.seed).integers(0, model.config.vocab_size, args.prompt_len)
    engine = Engine(model, make_policy(args), args.budget)
    logits = engine.prefill(prompt, args.block)
    new = engine.generate(logits, args.new_tokens)
    print(f"model: {model.config.name} ({model.dtype}), policy: {engine.policy.describe()}, "
          f"budget: {args.budget}, block: {args.block}, prompt: {args.prompt_len} tokens")
    for layer, cache in enumerate(engine.caches):
        for head in range(cache.n_kv_heads):
            kept = cache.positions[head]
            print(f"layer {layer} head {head}: {len(kept)} kept: {format_ranges(kept)}")
    s = engine.stats
    print(f"peak cache size: {s.peak_cache_tokens} tokens per head; evictions: {s.evictions}; "
          f"attention weights materialised: {s.attention_materialised} of {s.attention_calls} calls")
    print("generated:", " ".join(map(str, new)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refkv", description="Reference KV-cache eviction in NumPy.")
    parser.add_argument("--version", action="version", version=f"refkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_policies_command, add_run_command, add_generate_command, add_golden_command,
                add_experiment_command):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"refkv: error: {_one_line(str(err))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `refkv run | head` is fine
        return 0
    except OSError as err:  # unwritable or full output folder, a file given as a folder, ...
        print(f"refkv: error: {_os_error(err)}", file=sys.stderr)
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
