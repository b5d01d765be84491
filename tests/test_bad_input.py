"""Issue 13, attacked again: one test per defect (``test_attack_13_<NN>_<slug>``).

Each test here failed on the code the issue was filed against and passes after its fix.
The other areas' attacks live in ``tests/test_bad_input_*.py`` (oracle, suite, model);
:func:`test_reliability_table_matches_attack_tests` keeps the table of
``docs/guide/reliability.rst`` and all those tests in step.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refkv import files, policies
from refkv.attention import attend
from refkv.cli import main
from refkv.engine import Engine
from refkv.experiments import runner
from refkv.experiments.records import append_record, cut_partial_tail, read_records
from refkv.experiments.settings import Settings
from refkv.model import builtin_model
from refkv.policies.keydiff import KeyDiff, anchor_scores, pairwise_scores

ROOT = Path(__file__).resolve().parents[1]


def _one_line_error(capsys, *needles: str) -> str:
    """The command's stderr: one ``error:`` line holding every needle, no traceback
    (progress lines before it are fine)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, err
    assert "error:" in lines[0] and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    return lines[0]


# -- 3: published summary files are written atomically --------------------------------------
def test_attack_13_03_plots_written_atomically(tmp_path, monkeypatch):
    """A run killed while a plot is being written leaves the previous file whole.

    ``savefig`` is replaced by a writer that puts half a file wherever it is told to
    write and then dies (as ``kill -9`` would, mid-write): the published PNG and SVG
    must still hold their previous content and no temporary file may stay behind.
    """
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from refkv.experiments import plots

    folder = tmp_path / "passkey"
    folder.mkdir()
    old = {name: f"complete old {name}".encode() for name in ("p.png", "p.svg")}
    for name, data in old.items():
        (folder / name).write_bytes(data)

    class Killed(BaseException):
        pass

    def torn_savefig(self, fname, **kwargs):
        if hasattr(fname, "write"):
            fname.write(b"\x89PNG torn")
        else:
            Path(fname).write_bytes(b"\x89PNG torn")
        raise Killed

    monkeypatch.setattr(Figure, "savefig", torn_savefig)
    plt = plots._pyplot()
    with pytest.raises(Killed):
        plots._save(plt.figure(), folder, "p")
    for name, data in old.items():
        assert (folder / name).read_bytes() == data
    assert sorted(p.name for p in folder.iterdir()) == ["p.png", "p.svg"]

    # The CSV tables: killed just before the new file replaces the old one.
    from refkv.experiments import tables

    table = tables.write_csv(folder / "t.csv", [{"a": 1}])
    monkeypatch.setattr(files.os, "replace", lambda *args, **kwargs: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        tables.write_csv(table, [{"a": 2}] * 1000)
    assert table.read_text() == "a\n1\n"
    assert sorted(p.name for p in folder.iterdir()) == ["p.png", "p.svg", "t.csv"]


def test_atomic_plots_are_complete_and_readable(tmp_path):
    """The atomic route still writes real PNG/SVG files, with the umask's permissions."""
    pytest.importorskip("matplotlib")
    from refkv.experiments import plots
    from refkv.files import file_mode

    plt = plots._pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    png, svg = plots._save(fig, tmp_path, "line")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert svg.read_text().rstrip().endswith("</svg>")
    assert {p.stat().st_mode & 0o777 for p in (png, svg)} == {file_mode()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["line.png", "line.svg"]


# -- 5: workers exit when the parent dies ----------------------------------------------------
_SLOW_EXPERIMENT = '''
import os, time
from pathlib import Path
from refkv.experiments import design, registry

MARKERS = Path(__file__).with_name("started")

def cells(settings):
    return [{"i": i} for i in range(4)]

def run(params):
    (MARKERS / str(os.getpid())).touch()  # this worker is inside a cell now
    time.sleep(120)
    return {}

SLOW = registry.register_experiment(design.Experiment(
    name="slowpoke", title="sleeps", cells=cells, run=run, summarise=lambda r, f, s: []))
'''


def _children(pid: int) -> set[int]:
    """Processes whose parent is ``pid`` (read from /proc)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.add(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped has finished)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize(("sent", "exit_code"), [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGINT, 130)])
def test_attack_13_05_workers_end_with_their_parent(tmp_path, sent, exit_code):
    """A ``--jobs 2`` run while both workers are inside a 120 s cell: ``kill -9`` of the
    parent, or SIGINT to the parent alone (``kill -INT PID``, a supervisor; a terminal's
    Ctrl-C would reach the workers too). The run ends within seconds, not when the cells
    finish, and every child process (workers, resource tracker) is gone 5 s later."""
    (tmp_path / "slowpoke_module.py").write_text(_SLOW_EXPERIMENT)
    markers = tmp_path / "started"
    markers.mkdir()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import io, signal, slowpoke_module
        from refkv.experiments import runner
        # As in an interactive shell: a background job (CI, this test's own runner) may
        # start with SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            runner.run(slowpoke_module.SLOW, out={str(tmp_path / 'out')!r}, jobs=2, summarise=False,
                       stream=io.StringIO())
        except KeyboardInterrupt:
            sys.exit(130)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(list(markers.iterdir())) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
        assert len(list(markers.iterdir())) == 2, "the two workers never started their cells"
        workers = _children(parent.pid)
        assert {int(p.name) for p in markers.iterdir()} <= workers
        os.kill(parent.pid, sent)
        assert parent.wait(timeout=15) == exit_code
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.1)
        orphans = [w for w in workers if _alive(w)]
        assert not orphans, f"processes {orphans} outlived their parent"
    finally:
        for pid in [parent.pid, *workers]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# -- 7: Scissorhands' history is bounded -----------------------------------------------------
def test_attack_13_07_scissorhands_history_is_bounded(tiny64):
    from refkv.policies.scissorhands import FIELD, MAX_HISTORY, Scissorhands

    for bad in (10**6, 10**7, MAX_HISTORY + 1):
        with pytest.raises(ValueError, match=r"history must be an integer in \[1, "):
            Scissorhands(history=bad)
    # The largest allowed history runs, and its per-token state is what the docs say.
    policy = Scissorhands(history=MAX_HISTORY)
    assert policy.fields(tiny64.config)[FIELD].shape == (MAX_HISTORY,)
    engine = Engine(tiny64, policy, 24)
    engine.prefill(np.arange(40) % tiny64.config.vocab_size, 8)
    per_token = engine.caches[0].fields[FIELD].nbytes / engine.caches[0].fields[FIELD].shape[1]
    assert per_token <= tiny64.config.n_kv_heads * MAX_HISTORY


# -- 8: non-finite numbers are caught, naming the layer --------------------------------------
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's overflow warning comes first
def test_attack_13_08_engine_overflowing_weights_name_the_layer():
    """A norm weight of 3e38 in float32 overflows layer 1: an error naming layer 1, not garbage."""
    model = builtin_model(seed=0, dtype=np.float32)
    model.weights.layers[1].mlp_norm[:] = np.float32(3e38)
    engine = Engine(model, "sink", 16)
    with pytest.raises(ValueError, match=r"layer 1\b.*(non-finite|inf|NaN)"):
        engine.prefill(np.arange(30), 8)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_attack_13_08_engine_nan_logits_are_an_error():
    """NaN in the LM head gives NaN logits: greedy decoding must not return token 0 for them."""
    model = builtin_model(seed=0, dtype=np.float64)
    head = model.weights.lm_head if model.weights.lm_head is not None else model.weights.embed
    head[-1, 0] = np.nan  # a token the prompt never uses (the embedding may be tied)
    engine = Engine(model)
    with pytest.raises(ValueError, match="logits"):
        engine.generate(engine.prefill(np.arange(10)), 3)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("weights", [False, True])
def test_attack_13_08_attend_refuses_nan_inputs(which, weights):
    rng = np.random.default_rng(0)
    arrays = {"q": rng.standard_normal((4, 3, 8)), "k": rng.standard_normal((2, 5, 8)),
              "v": rng.standard_normal((2, 5, 8))}
    arrays[which][0, 1, 2] = np.nan
    with pytest.raises(ValueError, match=rf"\b{which}\b.*non-finite"):
        attend(arrays["q"], arrays["k"], arrays["v"], np.arange(2, 5), np.tile(np.arange(5), (2, 1)),
               return_weights=weights, key_chunk=2)


def test_attend_nan_in_a_future_key_is_harmless():
    """A NaN key a query can never see does not change its output (nothing to report)."""
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 1, 4)), rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    clean, _ = attend(q, k[:, :2], v[:, :2], np.array([1]), np.tile(np.arange(2), (2, 1)))
    k[:, 2] = np.nan
    out, _ = attend(q, k, v, np.array([1]), np.tile(np.arange(3), (2, 1)))
    np.testing.assert_allclose(out, clean, rtol=1e-12)


# -- 9: KeyDiff on half precision and extreme magnitudes -------------------------------------
@pytest.mark.parametrize("anchor", ["unit_mean", "mean", "median", "pairwise"])
def test_attack_13_09_keydiff_half_precision_zero_and_tiny_keys(anchor):
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((2, 6, 8))
    for scale in (1.0, 1e-5):
        k16 = (keys * scale).astype(np.float16)
        k16[0, 3] = 0.0  # a zero key
        scores = KeyDiff(anchor=anchor).score(_view(k16))
        assert np.isfinite(scores).all(), (anchor, scale, scores)
        assert scores[0, 3] == 0.0  # a zero key's cosine is 0 / eps = 0
        reference = KeyDiff(anchor=anchor).score(_view(k16.astype(np.float64)))
        np.testing.assert_allclose(scores, reference, atol=8 * 8 * 2.0**-11)


@pytest.mark.parametrize("dtype,magnitude", [(np.float32, 1e30), (np.float64, 1e200), (np.float32, 3e37)])
def test_attack_13_09_keydiff_extreme_magnitudes(dtype, magnitude):
    """Cosine scores are scale-free: huge or tiny keys score as the same keys at norm ~1."""
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((2, 7, 16))
    reference = anchor_scores(keys)
    scaled = (keys * magnitude).astype(dtype)
    for kind in ("unit_mean", "pairwise"):
        scores = pairwise_scores(scaled) if kind == "pairwise" else anchor_scores(scaled)
        assert np.isfinite(scores).all(), (kind, scores)
        expected = pairwise_scores(keys) if kind == "pairwise" else reference
        np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,magnitude", [(np.float32, 1e-30), (np.float64, 1e-200)])
def test_keydiff_tiny_keys_stay_finite(dtype, magnitude):
    """Keys far below eps: the floor decides (cosines ~ 0), and nothing is NaN."""
    keys = (np.random.default_rng(3).standard_normal((2, 7, 16)) * magnitude).astype(dtype)
    assert np.isfinite(anchor_scores(keys)).all() and np.isfinite(pairwise_scores(keys)).all()


def test_attack_13_09_keydiff_overflowing_metrics_are_an_error():
    """``dot`` of keys at 1e200 overflows float64: an error naming the metric, not inf/NaN scores."""
    keys = np.full((1, 3, 4), 1e200)
    keys[0, 1] *= -1
    with pytest.raises(ValueError, match="metric='dot'"):
        anchor_scores(keys, "mean", "dot")


@pytest.mark.parametrize("eps", [1e308, 1.0, 0.5, 0.0, -1e-8, float("nan"), float("inf")])
def test_attack_13_09_keydiff_eps_out_of_range(eps):
    with pytest.raises(ValueError, match=r"eps must be a finite number in \(0, "):
        KeyDiff(eps=eps)
    with pytest.raises(ValueError, match=r"eps must be a finite number in \(0, "):
        anchor_scores(np.ones((1, 2, 3)), eps=eps)


def _view(keys):
    from refkv.policies.base import View

    h, n, _ = keys.shape
    positions = np.tile(np.arange(n), (h, 1))
    return View(layer=0, n_layers=1, keys=keys, values=keys, positions=positions, fields={},
                queries=keys[:, -1:], query_positions=np.array([n - 1]), block_keys=keys[:, -1:],
                block_values=keys[:, -1:], budget=n - 1)


_HALF = st.floats(min_value=-2.0, max_value=2.0, width=16, allow_subnormal=False)


@given(keys=st.lists(st.lists(_HALF, min_size=4, max_size=4), min_size=2, max_size=6),
       exponent=st.integers(-12, 12), kind=st.sampled_from(["unit_mean", "pairwise"]))
def test_attack_13_09_keydiff_half_precision_is_scale_free(keys, exponent, kind):
    """float16 keys (zeros included) give finite scores, unchanged by power-of-two scaling
    (exact in floating point while nothing under- or overflows), and within float16's
    rounding of the float64 scores of the same keys."""
    k16 = np.array(keys, dtype=np.float16)[None]
    nonzero = np.abs(k16[k16 != 0])
    if nonzero.size and (nonzero.min() * 2.0**exponent < 2.0**-14 or nonzero.max() * 2.0**exponent > 2.0**14):
        exponent = 0  # stay in float16's normal range, where scaling by 2**e is exact
    score = pairwise_scores if kind == "pairwise" else anchor_scores
    base = score(k16)
    assert np.isfinite(base).all()
    np.testing.assert_array_equal(score((k16 * np.float16(2.0**exponent)).astype(np.float16)), base)
    n = k16.shape[1]
    bound = (n if kind == "pairwise" else 1) * 16 * 2.0**-11  # a few ulps of float16 per term
    np.testing.assert_allclose(base, score(k16.astype(np.float64)), atol=bound)


# -- 12: experiment records and policy lists -------------------------------------------------
def test_attack_13_12_complete_last_record_without_newline_is_kept(tmp_path):
    path = tmp_path / "toy.jsonl"
    append_record(path, {"key": "a", "result": {"v": 1}})
    append_record(path, {"key": "b", "result": {"v": 2}})
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # a complete record, newline lost
    assert [r["key"] for r in read_records(path)] == ["a", "b"]
    cut_partial_tail(path)
    assert [r["key"] for r in read_records(path)] == ["a", "b"]
    append_record(path, {"key": "c", "result": {"v": 3}})
    assert [r["key"] for r in read_records(path)] == ["a", "b", "c"]
    # A torn record (no closing brace) is still cut.
    with open(path, "ab") as f:
        f.write(b'{"key": "d", "res')
    assert [r["key"] for r in read_records(path)] == ["a", "b", "c"]
    cut_partial_tail(path)
    assert path.read_bytes().endswith(b"}\n")


def test_attack_13_12_duplicate_policies_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"policies.*sink.*twice"):
        Settings(policies=("sink", "sink"))
    with pytest.raises(ValueError, match=r"policies.*sink:sink=2.*twice"):
        Settings(policies=("sink:sink=2", "sink: sink = 2"))
    assert main(["experiment", "passkey", "--quick", "--model", "tiny", "--dry-run", "--out", str(tmp_path),
                 "--policies", "sink", "sink"]) == 2
    _one_line_error(capsys, "--policies", "twice")


# -- 13: unknown policy parameters -----------------------------------------------------------
def test_attack_13_13_unknown_policy_parameter_api():
    with pytest.raises(ValueError, match=r"^policy .sink. has no parameter .bogus.; allowed: sink$") as info:
        policies.get("sink", bogus=1)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"keydiff.*'epsilon'.*allowed: anchor, metric, reserve, eps"):
        policies.get("keydiff", epsilon=1e-6)


def test_attack_13_13_unknown_policy_parameter_cli(capsys):
    assert main(["run", "--policy", "sink", "--param", "bogus=3", "--prompt-len", "5"]) == 2
    _one_line_error(capsys, "bogus", "allowed")


def test_attack_13_13_unknown_caote_base_params():
    with pytest.raises(ValueError, match=r"h2o.*'bogus'.*allowed"):
        policies.get("caote", base="h2o", base_params={"bogus": 1})


def test_attack_13_13_experiment_dry_run_validates_every_policy(tmp_path, capsys):
    args = ["experiment", "passkey", "--quick", "--model", "tiny", "--out", str(tmp_path), "--policies", "sink",
            "sink:bogus=1"]
    assert main([*args, "--dry-run"]) == 2
    _one_line_error(capsys, "bogus")
    assert main(args) == 2  # the real run refuses it before any cell
    _one_line_error(capsys, "bogus")
    assert not (tmp_path / "passkey.jsonl").exists() or read_records(tmp_path / "passkey.jsonl") == []


# -- 16: CAOTE over ``full`` ------------------------------------------------------------------
def test_attack_13_16_caote_over_full_fails_at_construction():
    with pytest.raises(ValueError, match=r"caote.*full"):
        policies.get("caote", base="full")
    with pytest.raises(ValueError, match=r"caote.*full"):
        policies.get("caote", base="full", fast=True)


# -- 17: the command's errors ----------------------------------------------------------------
def _experiment(out, *extra):
    return ["experiment", "perplexity", "--quick", "--model", "tiny", "--policies", "sink", "--budgets", "40",
            "--out", str(out), *extra]


def test_attack_13_17_out_is_an_existing_file(tmp_path, capsys):
    target = tmp_path / "file.txt"
    target.write_text("keep me")
    assert main(_experiment(target)) == 2
    _one_line_error(capsys, str(target), "folder")
    assert target.read_text() == "keep me"


def test_attack_13_17_out_is_dev_null(capsys):
    assert main(_experiment("/dev/null")) == 2
    _one_line_error(capsys, "/dev/null")


def test_attack_13_17_read_only_out(tmp_path, capsys, monkeypatch):
    """A folder the user may not write: one line naming it (simulated: tests may run as root)."""
    def refuse(path, record):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(runner, "append_record", refuse)
    assert main(_experiment(tmp_path / "ro")) == 2
    _one_line_error(capsys, "Permission denied", "perplexity.jsonl")


def test_attack_13_17_full_disk(tmp_path, capsys, monkeypatch):
    def full(path, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(runner, "append_record", full)
    assert main(_experiment(tmp_path / "full")) == 2
    _one_line_error(capsys, "No space left on device")


def test_attack_13_17_file_too_large(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from refkv.experiments import plots

    def too_big(*args, **kwargs):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(plots, "_save", too_big)
    assert main(_experiment(tmp_path / "big")) == 2
    _one_line_error(capsys, "File too large")


@pytest.mark.parametrize("option,value", [("--budgets", "0"), ("--blocks", "0"), ("--budgets", "x"),
                                          ("--seed", "-1")])
def test_attack_13_17_experiment_options_name_themselves(tmp_path, capsys, option, value):
    args = ["experiment", "passkey", "--quick", "--model", "tiny", "--dry-run", "--out", str(tmp_path),
            option, value]
    assert main(args) == 2
    _one_line_error(capsys, option)


def test_attack_13_17_run_seed_names_the_option(capsys):
    assert main(["run", "--seed", "-1", "--prompt-len", "5"]) == 2
    _one_line_error(capsys, "--seed")


def test_attack_13_17_non_utf8_byte_is_shown(capsys):
    prompt = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # how Python hands over a latin-1 argv
    assert main(["generate", "--model", "tiny", "--raw", "--max-new-tokens", "1", prompt]) == 2
    line = _one_line_error(capsys, "0xe9", "byte 3")
    assert "UTF-8" in line


def test_attack_13_17_non_utf8_stdin(capsys, monkeypatch):
    import io

    class Stdin:
        buffer = io.BytesIO(b"ok\nthen \xff\xfe")

        def read(self):
            return self.buffer.getvalue().decode("utf-8", "surrogateescape")

    monkeypatch.setattr(sys, "stdin", Stdin())
    assert main(["generate", "--model", "tiny", "--max-new-tokens", "1", "-"]) == 2
    _one_line_error(capsys, "0xff", "byte 8")


def test_attack_13_17_library_prompt_with_lone_surrogate(tiny64):
    from refkv.generation import generate_text
    from refkv.model.tokenizer import ByteTokenizer

    with pytest.raises(ValueError, match=r"prompt.*0xff.*byte 2"):
        generate_text(tiny64, ByteTokenizer(tiny64.config.vocab_size), "ab\udcffcd", chat=False, max_new_tokens=1)


@pytest.mark.parametrize("model", [None, "tiny", 3])
def test_attack_13_17_engine_model_must_be_a_model(model):
    with pytest.raises(ValueError, match="model must be"):
        Engine(model, "sink", 16)


@pytest.mark.parametrize("chunk", [1.5, 0, -3, True, "8"])
def test_attack_13_17_key_chunk_must_be_an_integer(tiny64, chunk):
    with pytest.raises(ValueError, match="key_chunk must be an integer"):
        Engine(tiny64, "sink", 16, key_chunk=chunk)
    q = np.zeros((2, 1, 4))
    with pytest.raises(ValueError, match="key_chunk must be an integer"):
        attend(q, q, q, np.array([0]), np.zeros((2, 1), dtype=np.int64), key_chunk=chunk)


# -- the reliability page's table -------------------------------------------------------------
ATTACK_TEST = re.compile(r"^def (test_attack_13_(\d\d)_\w+)\(", re.MULTILINE)


def _table_rows() -> dict[int, list[str]]:
    """Rows of the attack table: item number -> the cells after the attack's description."""
    text = (ROOT / "docs" / "guide" / "reliability.rst").read_text()
    text = text[text.index(".. table:: Issue 13"):]
    text = text[:text.index("inputs tried")]  # this table only (issue 26 has its own, checked with its tests)
    rows = {}
    for line in text.splitlines():
        match = re.match(r"^\s*(\d+)\s{2,}(.+?)\s{2,}(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$", line)
        if match:
            item = int(match.group(1))
            assert item not in rows, f"item {item} appears twice in the table"
            rows[item] = [match.group(2), *map(int, match.groups()[2:])]
    return rows


def test_reliability_table_matches_attack_tests():
    """Every row of the table has a test ``test_attack_13_<NN>_*`` and every such test a row;
    every row was tried and came out clear (no unclear, silent, data loss or hang)."""
    rows = _table_rows()
    assert sorted(rows) == list(range(1, 19)), sorted(rows)
    for item, (attack, tried, clear, unclear, silent, lost, hang) in rows.items():
        assert tried >= 1 and clear == tried, (item, attack)
        assert (unclear, silent, lost, hang) == (0, 0, 0, 0), (item, attack)
    tested: dict[int, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_bad_input*.py")):
        for name, number in ATTACK_TEST.findall(path.read_text()):
            tested.setdefault(int(number), []).append(name)
    missing = sorted(set(rows) - set(tested))
    assert not missing, f"table rows without a test_attack_13_NN_* test: {missing}"
    extra = sorted(set(tested) - set(rows))
    assert not extra, f"tests for items not in the table: {extra}"


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path):
    from refkv.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("refkv.experiments.cli.run", interrupted)
    out = tmp_path / "res"
    assert main(["experiment", "passkey", "--quick", "--model", "tiny", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"interrupted; every finished cell is kept in {out}/" in err
    monkeypatch.setattr("refkv.cli._cmd_generate", interrupted)
    import refkv.cli as cli

    parser_func = cli.build_parser().parse_args(["generate", "x"]).func
    assert parser_func is interrupted
    assert main(["generate", "hello", "--model", "tiny"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "refkv: interrupted"
