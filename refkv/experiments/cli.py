"""``refkv experiment NAME [--quick | --full] [--jobs N] [--scheduler ADDRESS] [--out DIR] [--policies ...]``."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from ..files import OutputFolder, read_regular
from ..policies.spec import parse_spec_list
from ..threads import ThreadChoice, blas_threads, check_threads, choose_threads
from ..validation import check_int
from .cluster import check_scheduler, dask_executor
from .models import load_model
from .registry import EXPERIMENTS, experiment_options, get_experiment, suite
from .runner import plan, run
from .settings import Settings, check_policy_specs
from .tables import format_table

#: Largest table or plot ``--publish`` copies (a summary file is kilobytes to a few MB).
MAX_PUBLISHED_BYTES = 256 << 20

__all__ = ["add_experiment_command", "policy_list", "summary_table"]


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
    p.add_argument("name", choices=[*(e.name for e in EXPERIMENTS), "all"], help="experiment to run, or 'all'")
    p.add_argument("--quick", action="store_true", help="the tiny grid (a minute or two)")
    p.add_argument("--full", action="store_true",
                   help="the powered grid (>= 8 texts of 1,024 tokens, 50 passkey prompts at 1K/2K/4K, 10 "
                        "output-error prompts): many core-hours, see --dry-run; use --jobs or --scheduler")
    for option in experiment_options():  # each experiment's own settings, as it declares them
        p.add_argument(option.flag, type=int, nargs="+" if option.many else None, default=None,
                       metavar=option.metavar, help=option.help)
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="run the cells on a Dask cluster: a scheduler address (tcp://HOST:8786) or 'local' "
                        "for a LocalCluster of --jobs workers; needs the sweeps extra (default: no Dask)")
    p.add_argument("--out", default="results", help="results folder (default ./results)")
    p.add_argument("--model", default=None,
                   help="'tiny', 'smollm2' or a path (default: smollm2 when installed, else tiny)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="compute precision")
    p.add_argument("--policies", nargs="+", metavar="SPEC",
                   help="policy specs replacing the defaults, separated by spaces or commas; each a name from "
                        "`refkv policies` with parameters as name:param=value,... or name(param=value,...), "
                        "e.g. sink keydiff:reserve=0.25 'caote(base=h2o)'")
    p.add_argument("--budgets", nargs="+", metavar="N", help="budgets N (integers, or 'none')")
    p.add_argument("--blocks", nargs="+", metavar="B", help="block sizes B (integers, or 'none' = one shot)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the grid (default 0)")
    p.add_argument("--dry-run", action="store_true", help="list the cells still to run and exit")
    p.add_argument("--registered", action="store_true",
                   help="the registered design (docs: registration); passkey: the calibration, or with "
                        "--passkey-lengths L the test grid at the calibrated length L; perplexity: the 16 verdict "
                        "texts and MAT's selection texts (--policies SPEC: MAT's chosen spec); attention_loss (A1) and "
                        "geometry (G1, G2, S1): the first 512 tokens of the 16 verdict texts")
    p.add_argument("--no-summary", action="store_true", help="skip the tables and plots")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="BLAS threads (default: measured with --jobs 1, one per worker otherwise)")
    p.add_argument("--publish", metavar="DIR", default=None,
                   help="also copy each experiment's tables and plots to DIR/NAME/ (how the docs get theirs)")
    p.set_defaults(func=_cmd_experiment)


def policy_list(items) -> list[str]:
    """``--policies``' words as one spec per policy: each word may list several, comma-separated,
    as ``refkv show --policy`` does (``h2o,tova keydiff:reserve=0.25`` is three policies)."""
    specs = []
    for item in items:
        try:
            specs += parse_spec_list(item)
        except ValueError as err:
            raise ValueError(f"--policies: {item!r}: {err}") from None
    return specs


def _cmd_experiment(args) -> int:
    check_int("--jobs", args.jobs, 1)
    check_int("--seed", args.seed, 0)
    if args.threads is not None:
        check_threads("--threads", args.threads)
    if args.scheduler is not None:
        check_scheduler(args.scheduler)
    if args.policies:
        args.policies = policy_list(args.policies)
        check_policy_specs(args.policies, "--policies")  # every spec, before any cell runs
    settings = Settings(
        quick=args.quick, model=args.model, dtype=args.dtype,
        policies=tuple(args.policies) if args.policies else None,
        budgets=tuple(_optional_int(b, "--budgets") for b in args.budgets) if args.budgets else None,
        blocks=tuple(_optional_int(b, "--blocks") for b in args.blocks) if args.blocks else None,
        seed=args.seed, full=args.full, registered=args.registered,
        options={o.name: getattr(args, o.name) for o in experiment_options() if getattr(args, o.name) is not None})
    experiments = suite() if args.name == "all" else [get_experiment(args.name)]
    publish = None
    if args.publish:  # its folders are checked before any cell runs (no symlink below it, not --out itself)
        publish = OutputFolder(args.publish, what="--publish folder",
                               inputs=[Path(args.out) / e.name for e in experiments])
        for experiment in experiments:
            publish.path(experiment.name)
    if args.dry_run:
        tasks, done = plan(experiments, settings, args.out)
        for task in tasks:
            print(f"{task.experiment}\t{task.cost:8.1f}\t{task.key}")
        print(f"{len(tasks)} cells to run, {done} finished; estimated {sum(t.cost for t in tasks) / 60:.1f} "
              f"core-minutes", file=sys.stderr)
        return 0
    tasks, done = plan(experiments, settings, args.out)
    cost = sum(t.cost for t in tasks) / 60
    print(f"refkv experiment {args.name}: 0/{len(tasks)} cells ({done} already finished), estimated "
          f"{cost:.1f} core-minutes; results go to {args.out}/", file=sys.stderr, flush=True)
    choice = _threads(args, settings, tasks)
    print(f"threads: {choice.n} ({choice.reason})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        executor = None
        if args.scheduler is not None:
            executor = stack.enter_context(dask_executor(args.scheduler, n_workers=args.jobs))
        stack.enter_context(blas_threads(choice.n if args.jobs == 1 and executor is None else 1))
        try:
            records = run(experiments, settings, out=args.out, jobs=args.jobs, summarise=not args.no_summary,
                          executor=executor, threads_per_job=choice.n)
        except KeyboardInterrupt:
            print(f"\nrefkv experiment: interrupted; every finished cell is kept in {args.out}/: run the "
                  f"same command to resume", file=sys.stderr, flush=True)
            return 130  # 128 + SIGINT, as shells report it
    elapsed = time.perf_counter() - start
    if publish is not None:
        _publish(args.out, publish, list(records))
    for name, recs in records.items():
        cell_time = sum(r["wall_time_s"] for r in recs)
        print(f"{name}: {len(recs)} cells, {cell_time:.0f} s of cell time -> {args.out}/{name}.jsonl, "
              f"{args.out}/{name}/")
        table = summary_table(name, args.out)
        if table:
            print(table)
    where = f"Dask scheduler {args.scheduler}" if args.scheduler else f"--jobs {args.jobs}"
    print(f"wall time {elapsed:.0f} s with {where}, {choice.n} BLAS thread(s) per process")
    return 0


def _threads(args, settings, tasks):
    """The BLAS threads: ``--threads``, one per worker with ``--jobs > 1``, else measured on the grid's model."""
    if args.threads is not None or args.jobs > 1 or args.scheduler is not None or not tasks:
        if args.threads is not None:
            return choose_threads(None, requested=args.threads)
        if not tasks:
            return ThreadChoice(1, "nothing to run")
        return ThreadChoice(1, "one per worker, " + (f"Dask scheduler {args.scheduler}" if args.scheduler
                                                      else f"--jobs {args.jobs}"))
    name = settings.resolved_model()
    print(f"loading {name} ...", file=sys.stderr, flush=True)
    model, _ = load_model(name, args.dtype)  # cached: the cells reuse it
    return choose_threads(model.config)


def summary_table(name: str, out) -> str | None:
    """The experiment's main results as an aligned text table (3 significant digits), or None.

    Reads the CSV its summary wrote (the :attr:`~refkv.experiments.design.Experiment.table`
    it declares, under ``OUT/NAME/``); None when there is none (``--no-summary``).
    """
    table = get_experiment(name).table
    return None if table is None else format_table(Path(out) / name / table[0], table[1])


def _publish(out, target: OutputFolder, names) -> None:
    """Copy the CSV tables and PNG/SVG plots of ``names`` from ``out`` to ``target/NAME/`` (atomically per file).

    Written through the guarded ``--publish`` folder: a symlinked ``PUB/NAME`` is refused,
    never written through.
    """
    for name in names:
        source = Path(out) / name
        for path in sorted(source.glob("*")):
            if path.suffix not in (".csv", ".png", ".svg"):
                continue
            target.write_bytes(f"{name}/{path.name}", read_regular(path, MAX_PUBLISHED_BYTES, what="summary file"))
