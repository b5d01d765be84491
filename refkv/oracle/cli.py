"""``refkv golden``: generate a golden suite, check a candidate against one, export weights."""

from __future__ import annotations

import time

from ..formatting import terminal_text

__all__ = ["add_golden_command"]


def _names(values: list[str] | None, selecting: bool = False) -> list[str] | None:
    """``--policies a b`` or ``--policies a,b``, options included: ``--policies "adakv(base=keydiff,form=kvpress)"``
    (read by the one spec parser, :func:`refkv.policies.spec.parse_spec_list`); canonical specs."""
    if values is None:
        return None
    from .specs import golden_specs

    return golden_specs(values, selecting=selecting)


def add_golden_command(sub) -> None:
    """Add ``golden generate``, ``golden check`` and ``golden weights`` to the ``refkv`` parser."""
    p = sub.add_parser("golden", help="golden files: generate a suite, check a candidate against one",
                       description="Golden files for checking other implementations against refkv "
                                   "(see docs/oracle).")
    gsub = p.add_subparsers(dest="golden_command", required=True)

    g = gsub.add_parser("generate", help="write a golden suite (every policy refkv defines, by default)")
    g.add_argument("--out", required=True, help="directory to write (created if needed)")
    g.add_argument("--policies", nargs="+", metavar="SPEC",
                   help="only these policies (names or a,b,c), options included: 'adakv(base=keydiff,form=kvpress)' "
                        "or adakv:base=keydiff,form=kvpress (goldens of one policy with other options get other "
                        "file names)")
    g.add_argument("--authors-forms", action="store_true",
                   help="the authors' forms (form='authors') of every policy that has one, each in its authors' "
                        "regime, instead of the defaults: the suite tests/golden-authors")
    g.add_argument("--quiet", action="store_true", help="no progress lines")
    s = g.add_argument_group("schedule goldens for one model and schedule (any of these options: only those "
                             "goldens are written, into a folder without suite.json)")
    s.add_argument("--model", metavar="NAME|PATH",
                   help="tiny, llama3, qwen2, qwen3 (seeded random weights), smollm2, or a checkpoint directory / "
                        ".gguf file")
    s.add_argument("--budget", type=int, metavar="N", help="decoding rounds keep N tokens per layer and KV head")
    s.add_argument("--ratio", type=float, metavar="R",
                   help="decoding rounds keep max(1, int(seen * (1 - R))) instead of N (CompressionRatioDecodingPress)")
    s.add_argument("--interval", type=int, metavar="K", help="compress every K decoding steps (default 16)")
    s.add_argument("--new-tokens", type=int, metavar="D", help="decoding steps (default 3 K: three rounds)")
    s.add_argument("--prefill", metavar="oneshot|B", help="one-shot prefill (default) or blocks of B tokens")
    s.add_argument("--prefill-budget", type=int, metavar="N0",
                   help="compress the prompt to N0 per block (default: not compressed, DecodingPress alone)")
    s.add_argument("--prompt-length", type=int, metavar="T", help="prompt tokens (default 128)")
    s.add_argument("--dtype", choices=("float32", "float64"),
                   help="default float64 for the tiny models, float32 for a checkpoint")
    g.set_defaults(func=_cmd_generate)

    c = gsub.add_parser("check", help="compare a candidate directory with a golden suite; exit 1 on failure")
    c.add_argument("candidate", help="directory with the candidate's files, laid out like the suite")
    c.add_argument("--against", required=True, help="the golden suite directory")
    c.add_argument("--policies", nargs="+", metavar="SPEC",
                   help="only these policies: a name selects its goldens whatever their options, a spec with "
                        "options ('adakv(base=keydiff,form=kvpress)') only those")
    c.add_argument("--kind", choices=("all", "vectors", "e2e"), default="all", help="which files to check")
    c.add_argument("--allow-missing", action="store_true", help="skip suite files the candidate lacks")
    c.add_argument("--dtype", metavar="D",
                   help="the precision the candidate computed in: float64, float32, bfloat16 or float16 "
                        "(tolerances derive from it; overrides the candidate files' computed_dtype). Also selects "
                        "the reference cases: float64 cases for float64, float32 cases otherwise")
    c.add_argument("--case-dtype", choices=("float32", "float64", "all"),
                   help="which reference cases and end-to-end goldens to compare (default: from --dtype; all "
                        "without it)")
    c.add_argument("--declare", action="append", metavar="KEY=VALUE", default=[],
                   help="a declared difference, printed in the report: scores=exact|positive_multiple|monotone, "
                        "pinned=protected or pinned=POS,POS,..., kept_only=true (overrides the candidate files')")
    c.add_argument("--kept-only", action="store_true", help="same as --declare kept_only=true")
    c.add_argument("--final-only", action="store_true",
                   help="end-to-end goldens: the candidate gives only its final cache (kept, kept_count after the "
                        "last block) and logits; weaker than the per-block check")
    c.add_argument("--default-params", action="store_true",
                   help="only vector cases with the policies' default parameters (no variants)")
    c.add_argument("--strict-ties", action="store_true",
                   help="fail on accepted ties too (the candidate must follow refkv's tie rule exactly)")
    c.add_argument("--tolerance-factor", type=float, default=1.0,
                   help="explicit override: multiply every derived tolerance by this finite factor > 0 "
                        "(shown in the report)")
    c.add_argument("--exact-dtype", action="store_true",
                   help="require identical dtypes (default: same kind, float/integer/bool)")
    c.add_argument("--verbose", action="store_true", help="list passing files and every tie")
    c.set_defaults(func=_cmd_check)

    from .models import MODELS

    w = gsub.add_parser("weights", help="export the weights of a golden's model: a transformers checkpoint "
                                        "directory (config.json + model.safetensors), or npz + JSON manifest")
    w.add_argument("--out", required=True,
                   help="a directory (transformers loads it: AutoModelForCausalLM.from_pretrained(OUT)), or a "
                        ".npz file (refkv's names and layout, tiny models only)")
    w.add_argument("--model", default="tiny", metavar="NAME|PATH",
                   help=f"{', '.join(sorted(MODELS))} (seeded random weights), smollm2, or a checkpoint directory / "
                        f".gguf file (default tiny)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--dtype", choices=("float32", "float64"),
                   help="default float64 for the tiny models, float32 for a checkpoint")
    w.set_defaults(func=_cmd_weights)


_SCHEDULE_OPTIONS = ("model", "budget", "ratio", "interval", "new_tokens", "prefill", "prefill_budget",
                     "prompt_length", "dtype")


#: Schedule fields -> the options of ``golden generate`` that set them (messages name the option).
_SCHEDULE_FLAGS = {"block_size": "--prefill", "prefill_budget": "--prefill-budget", "interval": "--interval",
                   "budget": "--budget", "ratio": "--ratio", "new_tokens": "--new-tokens"}


def _schedule_of(args):
    """The Schedule the generate options describe (one-line ValueErrors name the option)."""
    from ..schedule import Schedule
    from ..validation import check_lengths

    block = None
    if args.prefill not in (None, "oneshot"):
        try:
            block = int(args.prefill)
        except ValueError:
            raise ValueError(f"--prefill must be 'oneshot' or a block size >= 1, got {args.prefill!r}") from None
        if block < 1:
            raise ValueError(f"--prefill must be 'oneshot' or a block size >= 1, got {args.prefill!r}")
    interval = 16 if args.interval is None else args.interval
    new_tokens = 3 * interval if args.new_tokens is None else args.new_tokens
    # Every length is bounded before a Schedule (or anything it sizes) exists; the model's
    # context is checked by generate_schedules once the model is known.
    check_lengths({"--prefill": (block, 1), "--interval": (interval, 1), "--new-tokens": (new_tokens, 0),
                   "--prompt-length": (args.prompt_length, 1), "--prefill-budget": (args.prefill_budget, 1),
                   "--budget": (args.budget, 1)})
    if args.ratio is not None and args.budget is not None:
        raise ValueError("--budget and --ratio exclude each other (a round keeps N, or a fraction of the tokens seen)")
    budget = args.budget if args.ratio is None else None
    if args.ratio is None and budget is None:
        budget = 64
    try:
        return Schedule(block_size=block, prefill_budget=args.prefill_budget, interval=interval, budget=budget,
                        rule="ratio" if args.ratio is not None else "interval", ratio=args.ratio,
                        new_tokens=new_tokens)
    except ValueError as err:
        text = str(err)
        field = next((f for f in _SCHEDULE_FLAGS if text.startswith(f + " ")), None)
        raise ValueError(_SCHEDULE_FLAGS[field] + text[len(field):] if field else text) from None


def _cmd_generate(args) -> int:
    from .generate import generate_schedules, generate_suite

    start = time.perf_counter()
    say = None if args.quiet else print
    if args.authors_forms and args.policies is not None:
        raise ValueError("--authors-forms and --policies exclude each other (--authors-forms names the policies)")
    if args.authors_forms and any(getattr(args, name) is not None for name in _SCHEDULE_OPTIONS):
        raise ValueError("--authors-forms writes a suite, each form in its own regime: no schedule options")
    if any(getattr(args, name) is not None for name in _SCHEDULE_OPTIONS):
        sched = _schedule_of(args)  # every length bounded here, the model's context in generate_schedules
        done = generate_schedules(args.out, _names(args.policies), sched, model=args.model or "tiny",
                                  prompt_length=args.prompt_length or 128, dtype=args.dtype, progress=say)
        print(f"wrote {len(done['written'])} schedule goldens ({sched.describe()}) for model "
              f"{terminal_text(args.model or 'tiny')} to {terminal_text(args.out)} ({len(done['skipped'])} policies "
              f"skipped) in {time.perf_counter() - start:.1f} s")
        return 0 if done["written"] else 1
    if args.authors_forms:
        from .specs import authors_specs

        index = generate_suite(args.out, authors_specs(), progress=say)
    else:
        index = generate_suite(args.out, _names(args.policies), progress=say)
    n_vec = sum(1 for f in index["files"] if f["kind"] == "vectors")
    n_e2e = len(index["files"]) - n_vec
    print(f"wrote {n_vec} vectors files and {n_e2e} end-to-end goldens for {len(index['policies'])} policies "
          f"to {args.out} ({len(index['skipped'])} cases skipped, see suite.json) in "
          f"{time.perf_counter() - start:.1f} s")
    return 0


def _cmd_check(args) -> int:
    from ..validation import check_float
    from .checker import check_suite
    from .declare import parse_cli_declaration
    from .tolerance import check_dtype_name

    factor = check_float("--tolerance-factor", args.tolerance_factor, 0.0, low_open=True)
    if args.dtype is not None:
        try:
            check_dtype_name(args.dtype)
        except ValueError as err:
            raise ValueError(f"--{err}") from None
    declare = dict(parse_cli_declaration(text) for text in args.declare)
    if args.kept_only:
        declare["kept_only"] = True
    kinds = ("vectors", "e2e") if args.kind == "all" else (args.kind,)
    report = check_suite(args.candidate, args.against, policies=_names(args.policies, selecting=True), kinds=kinds,
                         allow_missing=args.allow_missing, tolerance_factor=factor,
                         strict_ties=args.strict_ties, check_dtype=True if args.exact_dtype else "kind",
                         dtype=args.dtype, declare=declare or None, case_dtype=args.case_dtype,
                         default_params_only=args.default_params, final_only=args.final_only,
                         source="command line")
    print(report.format(verbose=args.verbose))
    return 0 if report.ok else 1


def _cmd_weights(args) -> int:
    from pathlib import Path

    from ..validation import check_int
    from .models import MODELS, export_weights

    check_int("--seed", args.seed, 0)
    if args.out.endswith(".npz"):
        if args.model not in MODELS:
            raise ValueError(f"--model {args.model!r}: the .npz export is for {', '.join(sorted(MODELS))}; write a "
                             f"checkpoint directory instead (--out DIR)")
        dtype = args.dtype or "float64"
        m = export_weights(args.out, seed=args.seed, dtype=dtype, model=args.model)
        print(f"wrote {len(m['arrays']['contents'])} arrays of model {args.model} (seed {args.seed}, {dtype}) to "
              f"{args.out} and its manifest to {m['arrays']['file'].rsplit('.', 1)[0]}.json")
        return 0
    from .generate import load_golden_model
    from .hfexport import checkpoint_folder, write_checkpoint

    dtype = args.dtype or ("float64" if args.model in MODELS else "float32")
    settings = {"model": args.model, "seed": args.seed, "dtype": dtype}
    folder = checkpoint_folder(args.out, settings,  # refused before any model is built
                               inputs=[] if args.model in MODELS or not Path(args.model).exists() else [args.model])
    if args.model in MODELS:
        from .models import build_model

        model = build_model(args.model, args.seed, dtype)
    else:
        model = load_golden_model(args.model, dtype)
    config = write_checkpoint(folder, model, extra={"refkv": settings})
    print(f"wrote {config['architectures'][0]} checkpoint of model {args.model} ({dtype}) to {Path(args.out)}: "
          f"config.json + model.safetensors (transformers: AutoModelForCausalLM.from_pretrained)")
    return 0
