"""``refkv experiment NAME [--quick | --full] [--jobs N] [--scheduler ADDRESS] [--out DIR] [--policies ...]``."""

from __future__ import annotations

import contextlib
import sys
import time

__all__ = ["add_experiment_command"]

#: Experiment names the command accepts (``all`` runs every one).
NAMES = ("passkey", "perplexity", "attention_loss", "geometry", "all")


def _optional_int(text: str, option: str):
    """An integer >= 1, or None for 'none' (also 'full', 'inf'); errors name ``option``."""
    if text.lower() in ("none", "full", "inf"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{option} must each be an integer >= 1 or 'none', got {text!r}")
    return value


def add_experiment_command(sub) -> None:
    """Add ``refkv experiment`` to the subcommands."""
    p = sub.add_parser("experiment", help="run the small CPU experiments that re-test the papers' claims",
                       description="Run (or resume) an experiment grid; results are appended to "
                                   "OUT/NAME.jsonl, tables and plots go to OUT/NAME/.")
    p.add_argument("name", choices=NAMES, help="experiment to run, or 'all'")
    p.add_argument("--quick", action="store_true", help="the tiny grid (a minute or two)")
    p.add_argument("--full", action="store_true",
                   help="the powered grid (>= 8 texts of 1,024 tokens, 50 passkey prompts at 1K/2K/4K, 10 "
                        "output-error prompts): many core-hours, see --dry-run; use --jobs or --scheduler")
    p.add_argument("--texts", type=int, default=None, metavar="N", help="perplexity texts per cell")
    p.add_argument("--text-length", type=int, default=None, metavar="T", help="tokens per perplexity text")
    p.add_argument("--passkey-prompts", type=int, default=None, metavar="N",
                   help="passkey prompts per cell (spread over the needle depths)")
    p.add_argument("--passkey-lengths", type=int, nargs="+", default=None, metavar="T",
                   help="passkey prompt lengths in tokens")
    p.add_argument("--output-prompts", type=int, default=None, metavar="N",
                   help="prompts of the output-error and attention-loss cells")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="run the cells on a Dask cluster: a scheduler address (tcp://HOST:8786) or 'local' "
                        "for a LocalCluster of --jobs workers; needs the sweeps extra (default: no Dask)")
    p.add_argument("--out", default="results", help="results folder (default ./results)")
    p.add_argument("--model", default=None,
                   help="'tiny', 'smollm2' or a path (default: smollm2 when installed, else tiny)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--policies", nargs="+", metavar="SPEC",
                   help="policy specs replacing the defaults, e.g. sink keydiff caote:base=h2o")
    p.add_argument("--budgets", nargs="+", metavar="N", help="budgets N (integers, or 'none')")
    p.add_argument("--blocks", nargs="+", metavar="B", help="block sizes B (integers, or 'none' = one shot)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the grid (default 0)")
    p.add_argument("--dry-run", action="store_true", help="list the cells still to run and exit")
    p.add_argument("--no-summary", action="store_true", help="skip the tables and plots")
    p.add_argument("--publish", metavar="DIR", default=None,
                   help="also copy each experiment's tables and plots to DIR/NAME/ (how the docs get theirs)")
    p.set_defaults(func=_cmd_experiment)


def _cmd_experiment(args) -> int:
    from ..validation import check_int
    from .runner import Settings, check_policy_specs, experiment_names, get_experiment, plan, run

    check_int("--jobs", args.jobs, 1)
    check_int("--seed", args.seed, 0)
    if args.scheduler is not None:
        from .cluster import check_scheduler

        check_scheduler(args.scheduler)
    if args.policies:
        check_policy_specs(args.policies, "--policies")  # every spec, before any cell runs
    settings = Settings(
        quick=args.quick, model=args.model, dtype=args.dtype,
        policies=tuple(args.policies) if args.policies else None,
        budgets=tuple(_optional_int(b, "--budgets") for b in args.budgets) if args.budgets else None,
        blocks=tuple(_optional_int(b, "--blocks") for b in args.blocks) if args.blocks else None,
        seed=args.seed, full=args.full, texts=args.texts, text_length=args.text_length,
        passkey_prompts=args.passkey_prompts,
        passkey_lengths=tuple(args.passkey_lengths) if args.passkey_lengths else None,
        output_prompts=args.output_prompts)
    names = experiment_names() if args.name == "all" else [args.name]
    experiments = [get_experiment(n) for n in names]
    if args.dry_run:
        tasks, done = plan(experiments, settings, args.out)
        for task in tasks:
            print(f"{task.experiment}\t{task.cost:8.1f}\t{task.key}")
        print(f"{len(tasks)} cells to run, {done} finished; estimated {sum(t.cost for t in tasks) / 60:.1f} "
              f"core-minutes", file=sys.stderr)
        return 0
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        executor = None
        if args.scheduler is not None:
            from .cluster import dask_executor

            executor = stack.enter_context(dask_executor(args.scheduler, n_workers=args.jobs))
        records = run(experiments, settings, out=args.out, jobs=args.jobs, summarise=not args.no_summary,
                      executor=executor)
    elapsed = time.perf_counter() - start
    if args.publish:
        _publish(args.out, args.publish, list(records))
    for name, recs in records.items():
        cell_time = sum(r["wall_time_s"] for r in recs)
        print(f"{name}: {len(recs)} cells, {cell_time:.0f} s of cell time -> {args.out}/{name}.jsonl, "
              f"{args.out}/{name}/")
    where = f"Dask scheduler {args.scheduler}" if args.scheduler else f"--jobs {args.jobs}"
    print(f"wall time {elapsed:.0f} s with {where}")
    return 0


def _publish(out, target, names) -> None:
    """Copy the CSV tables and PNG/SVG plots of ``names`` from ``out`` to ``target`` (atomically per file)."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from .common import file_mode

    for name in names:
        source, dest = Path(out) / name, Path(target) / name
        dest.mkdir(parents=True, exist_ok=True)
        for path in sorted(source.glob("*")):
            if path.suffix not in (".csv", ".png", ".svg"):
                continue
            fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            shutil.copyfile(path, tmp)
            os.chmod(tmp, file_mode())
            os.replace(tmp, dest / path.name)
