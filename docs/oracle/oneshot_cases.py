"""One-shot golden cases from your own tensors, with refkv's public API.

The whole prompt is one block (full square causal attention over all T tokens), then one
eviction to N: kvpress's regime. Run: python docs/oracle/oneshot_cases.py OUT_DIR
"""

import sys
from pathlib import Path

import numpy as np

from refkv import policies
from refkv.oracle.encode import encode_case, vectors_document
from refkv.oracle.io import write_json
from refkv.oracle.synthetic import Tokens, random_tokens, replay
from refkv.oracle.vectors import json_params, read_vectors
from refkv.testing import assert_case


def layer_tensors(seed: int, length: int) -> Tokens:
    """Stand-in for one layer of your model: queries (H, T, d), keys and values (Hkv, T, d),
    after RoPE. Here random (exact in float32); use your own model's tensors instead."""
    return random_tokens(np.random.default_rng(seed), 4, 2, 8, length, dtype=np.float32)


def write_cases(out: Path, name: str = "snapkv", budget: int = 40, length: int = 48) -> Path:
    policy = policies.get(name)  # default parameters: SnapKV's window is 32 <= T
    cases = []
    for case_id, seed in enumerate((1, 2), start=1):
        view = replay(policy, layer_tensors(seed, length), budget=budget)  # block_size=None: one-shot
        cases.append(encode_case(policy, view, case_id=case_id,
                                 comment=f"one-shot {name}, T={length}, N={budget}, seed {seed}"))
    path = out / "vectors" / f"{name}.json"
    write_json(path, vectors_document(name, [(json_params(policy.params()), cases)]))
    return path


def check_kernel(path: Path, kernel) -> int:
    """Check ``kernel(case) -> {"scores", "kept"}`` on every case of the file."""
    cases = read_vectors(path).cases
    for case in cases:
        assert case.mode == "oneshot"
        out = kernel(case)
        assert_case(case, scores=out["scores"], kept=out["kept"])
    return len(cases)


def refkv_as_kernel(case):
    """A kernel that is refkv itself (replace with yours): rebuild the view, score, select."""
    policy, view = case.policy(), case.view()
    return {"scores": policy.score(view), "kept": policy.keep_indices(view)}  # view.keep == case.budget


if __name__ == "__main__":
    written = write_cases(Path(sys.argv[1]))
    print(f"{check_kernel(written, refkv_as_kernel)} one-shot cases written to {written} and passed")
