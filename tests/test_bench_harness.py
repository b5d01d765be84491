"""Correctness of the helpers the benchmark scripts rely on (bench/harness.py); no timing is asserted."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("bench_harness", BENCH / "harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("power", [0.5, 1.0, 2.0, 3.0])
def test_growth_exponent_recovers_a_power_law(harness, power):
    sizes = [256, 1024, 4096, 32768]
    values = [7.0 * n**power for n in sizes]
    assert math.isclose(harness.growth_exponent(sizes, values), power, rel_tol=1e-12)


def test_growth_exponent_of_two_points_is_the_log_ratio(harness):
    # Time doubles when n quadruples: p = log 2 / log 4 = 0.5.
    assert math.isclose(harness.growth_exponent([1000, 4000], [3.0, 6.0]), 0.5, rel_tol=1e-12)


@pytest.mark.parametrize("sizes, values", [([1024], [1.0]), ([8, 8], [1.0, 2.0]), ([8, 16], [1.0, 0.0]),
                                           ([8, 16], [1.0])])
def test_growth_exponent_rejects_unfittable_input(harness, sizes, values):
    with pytest.raises(ValueError):
        harness.growth_exponent(sizes, values)


def test_rst_table_parses_as_a_table(harness):
    docutils_core = pytest.importorskip("docutils.core")
    # "-" and "* x" alone in a cell would be read as bullet lists: they must come out as text.
    text = harness.rst_table(["policy", "1K"], [["keydiff", 2.5], ["pairwise (Eq. 7)", "-"], ["-1.5", "* x"],
                                                      ["", "+"]])
    doctree = docutils_core.publish_doctree(text, settings_overrides={"report_level": 5})
    entries = [e.astext() for e in doctree.findall(lambda node: node.tagname == "entry")]
    assert entries == ["policy", "1K", "keydiff", "2.5", "pairwise (Eq. 7)", "-", "-1.5", "* x", "", "+"]


def test_rst_table_rejects_ragged_rows(harness):
    with pytest.raises(ValueError):
        harness.rst_table(["a", "b"], [["only one"]])


def test_write_json_round_trips_and_leaves_no_temporary(harness, tmp_path):
    target = tmp_path / "out.json"
    harness.write_json(target, {"n": [1, 2], "x": 0.5})
    harness.write_json(target, {"n": [3]})  # replaces the old file
    assert json.loads(target.read_text()) == {"n": [3]}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_write_json_keeps_the_old_file_when_encoding_fails(harness, tmp_path):
    target = tmp_path / "out.json"
    harness.write_json(target, {"ok": 1})
    with pytest.raises(TypeError):
        harness.write_json(target, {"bad": object()})
    assert json.loads(target.read_text()) == {"ok": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_peak_extra_bytes_sees_numpy_buffers(harness):
    size = 4_000_000

    def allocate():
        return np.ones(size // 8)  # float64: `size` bytes

    peak = harness.peak_extra_bytes(allocate)
    assert size <= peak < size + 1_000_000


def test_peak_extra_bytes_counts_temporaries_freed_before_return(harness):
    def temporary():
        big = np.zeros(1_000_000, dtype=np.uint8)
        return int(big.sum())

    assert harness.peak_extra_bytes(temporary) >= 1_000_000


def test_median_time_calls_the_function_and_is_positive(harness):
    calls = []
    seconds = harness.median_time(lambda: calls.append(1), repeats=3, min_sample=0.0)
    assert seconds >= 0.0 and len(calls) >= 4  # a warm-up call, then at least one per sample
    with pytest.raises(ValueError):
        harness.median_time(lambda: None, repeats=0)


def _load_script(name):
    import sys

    sys.path.insert(0, str(BENCH))  # the scripts import harness as a sibling module
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_one_shot_estimate_is_exact_on_a_quadratic():
    memory = _load_script("memory")
    points = {2048: 5.0 + 3.0 * 2048**2, 4096: 5.0 + 3.0 * 4096**2}
    assert math.isclose(memory.one_shot_estimate(points, 8192), 5.0 + 3.0 * 8192**2, rel_tol=1e-12)
    assert memory.one_shot_estimate({2048: 1.0}, 8192) is None


def test_policy_benchmark_runs_every_policy_on_a_small_cache(tmp_path, capsys):
    # A smoke run (n = 256, one sample): the script must keep working as policies evolve.
    policies = _load_script("policies")
    out = tmp_path / "run.json"
    results = policies.main(["--sizes", "256", "--repeats", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    for label, _, _ in policies.POLICIES:
        assert label in printed
        row = next(p for p in results["policies"] if p["label"] == label)["sizes"][256]
        assert row["peak_extra_bytes"] > 0 and row["seconds"]["total"] > 0
    again = policies.load_results(out)
    assert policies.report(again) == policies.report(results)


# -- bench/decoder.py and bench/compare.py: smoke runs on the tiny model, and their arithmetic ----

def test_decoder_byte_and_flop_counts_follow_the_shapes(tiny32):
    decoder = _load_script("decoder")
    cfg = tiny32.config
    n_params = cfg.vocab_size * cfg.d_model + cfg.d_model + cfg.n_layers * (
        2 * cfg.d_model + cfg.d_model * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.d_head
        + cfg.n_heads * cfg.d_head * cfg.d_model + 3 * cfg.d_model * cfg.d_ff)
    # (untied: the LM head, also vocab x d_model, is read instead of the embedding table)
    assert decoder.model_bytes(tiny32) == 4 * n_params
    one_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.d_head * 4  # keys and values, float32
    assert decoder.decode_bytes(tiny32, 11) - decoder.decode_bytes(tiny32, 10) == one_token
    # One block of 3 tokens: 6 causal (query, key) pairs per head, plus one LM-head row.
    dense = 2 * 3 * (n_params - cfg.vocab_size * cfg.d_model - cfg.d_model - cfg.n_layers * 2 * cfg.d_model)
    head = 2 * cfg.d_model * cfg.vocab_size
    attention = cfg.n_layers * 4 * cfg.d_head * cfg.n_heads * 6
    assert math.isclose(decoder.prefill_flops(cfg, 3, 3), dense + attention + head, rel_tol=1e-12)
    # The same block's unavoidable exponentials: 6 pairs per query head, one per MLP activation.
    assert decoder.prefill_exps(cfg, 3, 3) == cfg.n_layers * (cfg.n_heads * 6 + cfg.d_ff * 3)
    assert decoder.prefill_exps(cfg, 6, 3) == cfg.n_layers * (cfg.n_heads * (6 + 3 * 3 + 6) + cfg.d_ff * 6)
    assert decoder.decode_exps(cfg, 10) == cfg.n_layers * (cfg.n_heads * 10 + cfg.d_ff)


def test_decoder_measures_limits_and_runs_on_the_tiny_model(tiny32):
    decoder = _load_script("decoder")
    result = decoder.measure(tiny32, {24: list(range(3, 27))}, block=8, decode_tokens=2, threads=1, phases=True)
    for clock in ("wall", "cpu"):
        assert result["gemm_flops"][clock] > 0 and result["bandwidth"][clock] > 0
    run = result["lengths"]["24"]
    assert min(run["prefill_seconds"].values()) > 0 and min(run["decode_seconds"].values()) > 0
    assert run["decode_steps"] == 2
    assert {"qkv", "mlp", "attention"} <= set(run["phases"])
    assert min(result["exp_rate"].values()) > 0 and min(run["cache_read_rate"].values()) > 0
    summary = decoder.summarise([result, result])
    figures = summary["lengths"]["24"]
    assert 0 < figures["prefill_fraction"] and 0 < figures["decode_fraction"]
    # A ceiling is the fraction left once the exponentials are paid: below 1, and by the formula.
    r, clock = result, summary["clock"]
    gemm_time = run["prefill_flops"] / r["gemm_flops"][clock]
    want = gemm_time / (gemm_time + run["prefill_exps"] / r["exp_rate"][clock])
    assert math.isclose(figures["prefill_ceiling"], want, rel_tol=1e-12) and 0 < want < 1
    assert 0 < figures["decode_ceiling"] < 1 and figures["cache_read_gb_per_s"] > 0
    table = decoder.report({"a": summary, "b": summary}, 8)
    assert "fraction of GEMM rate" in table and "ceiling (GEMM rate + exp rate)" in table


@pytest.mark.slow  # importing torch and transformers: ~10-20 s on a loaded 2-core machine
def test_compare_runs_refkv_and_transformers_on_the_tiny_model(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    compare = _load_script("compare")
    result = compare.main(["--model", "tiny", "--lengths", "20", "--block", "8", "--decode-tokens", "2",
                           "--repeats", "1", "--out", str(tmp_path / "c.json")])
    printed = capsys.readouterr().out
    for impl in compare.IMPLEMENTATIONS:
        assert impl in printed
    # The same weights and greedy decoding: transformers must pick the same tokens as refkv,
    # one-shot and in blocks, with 1 and 2 threads (the defaults).
    cases = result["summary"]["cpu"]
    assert sorted(cases) == ["blocks/1/20", "blocks/2/20", "one-shot/1/20", "one-shot/2/20"]
    assert all(all(case["same_tokens"].values()) for case in cases.values())
    assert printed.index("one-shot") < printed.index("blocks")  # one-shot first
    assert json.loads((tmp_path / "c.json").read_text())["args"]["lengths"] == [20]


def test_oneshot_report_pairs_each_block_run_with_one_shot():
    oneshot = _load_script("oneshot")
    runs = []
    for repeat, slow in ((0, 1.0), (1, 3.0)):  # a burst of load slows all of repetition 1
        runs.append({"tree": "t", "length": 100, "policy": "full", "block": None, "repeat": repeat,
                     "cpu_seconds": 2.0 * slow, "wall_seconds": 2.0 * slow, "peak_bytes": 300 * 2**20,
                     "extra_bytes": 100 * 2**20})
        runs.append({"tree": "t", "length": 100, "policy": "full", "block": 128, "repeat": repeat,
                     "cpu_seconds": 4.0 * slow, "wall_seconds": 4.0 * slow, "peak_bytes": 200 * 2**20,
                     "extra_bytes": 0})
    table = oneshot.report({"trees": ["t"], "lengths": [100], "policies": ["full"], "blocks": [None, 128],
                            "budget": 8, "repeats": 2, "runs": runs, "machine": {"cpus": 2},
                            "load_average": [1.0, 2.0]})
    block_row = next(line for line in table.splitlines() if "B = 128" in line)
    # one-shot took half the time of blocks in each repetition, with 1.5x the peak
    assert "0.50" in block_row and "1.50" in block_row
    assert "load average 1.00-2.00" in table


def test_compare_says_how_to_install_torch_when_missing(monkeypatch):
    import builtins

    compare = _load_script("compare")
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch":
            raise ImportError("no torch", name="torch")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(SystemExit, match=r'pip install -e "\.\[interop\]".*torch==2\.13\.0'):
        compare.import_torch()


def test_contention_measures_both_counts_and_reports_the_thread_choice(tiny32, monkeypatch):
    import sys
    import types

    contention = _load_script("contention")
    prompt = list(range(3, 19))
    fake = types.ModuleType("refkv.threads")
    fake.choose_threads = lambda config: types.SimpleNamespace(n=2, reason="fake")
    monkeypatch.setitem(sys.modules, "refkv.threads", fake)
    result = contention.measure(tiny32, prompt, 8, 1)
    assert set(result["conditions"]) == set(contention.CONDITIONS)
    for c in result["conditions"].values():
        assert c["choice"] == {"n": 2, "reason": "fake"} and all(s > 0 for s in c["median_seconds"].values())
    assert "2 thread(s)" in contention.report(result, len(prompt))

    monkeypatch.setitem(sys.modules, "refkv.threads", None)  # the module missing: the column says so
    result = contention.measure(tiny32, prompt, 8, 1, conditions=("as is",))
    assert "refkv.threads" in result["note"] and "n/a" in contention.report(result, len(prompt))


@pytest.mark.slow  # two `refkv experiment` subprocesses: ~10 s on a loaded 2-core machine
def test_throughput_counts_cells_and_their_cpu_time(tmp_path):
    throughput = _load_script("throughput")
    result = throughput.main(["--model", "tiny", "--experiments", "perplexity", "--options",
                              "--quick --policies keydiff", "--out", str(tmp_path / "t.json")])
    (run,) = result["runs"]["this checkout"]
    assert run["cells"] >= 1 and run["cpu_seconds"] > 0
    assert math.isclose(result["rate"]["this checkout"], 3600 * run["cells"] / run["cpu_seconds"])
