"""Issue 36, the writing half: one guarded output folder for every writer (``test_attack_36_<what>``).

Each test reproduces an item of issue 36 that lost data on the code the issue was filed
against, plus the properties of :class:`refkv.files.OutputFolder` every writer inherits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from refkv.cli import main
from refkv.files import OutputFolder, atomic_write

ROOT = Path(__file__).resolve().parents[1]


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- workers die with their parent -------------------------------------------------------------
_SLOW = '''
import os, time
from pathlib import Path
from refkv.experiments import design, registry

MARKERS = Path(__file__).with_name("started")

def cells(settings):
    return [{"i": i} for i in range(4)]

def run(params):
    (MARKERS / str(os.getpid())).touch()
    while True:  # busy in Python, as a real cell is (not asleep in one C call)
        sum(range(10000))

SLOW = registry.register_experiment(design.Experiment(
    name="slowpoke36", title="spins", cells=cells, run=run, summarise=lambda r, f, s: []))
'''


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (read from /proc), found while ``pid`` still runs."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGKILL])
def test_attack_36_workers_die_with_the_command(tmp_path, sent):
    """``refkv experiment ... --jobs 2`` killed with SIGTERM or SIGKILL while both workers
    spin inside a cell: every process it started is gone within 5 s (was: 3 left running)."""
    (tmp_path / "slowpoke36.py").write_text(_SLOW)
    markers = tmp_path / "started"
    markers.mkdir()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import slowpoke36
        from refkv.experiments import cli
        cli.EXPERIMENTS = (*cli.EXPERIMENTS, slowpoke36.SLOW)  # the command's choices
        from refkv.cli import main
        sys.exit(main(["experiment", "slowpoke36", "--jobs", "2", "--model", "tiny", "--no-summary",
                       "--out", {str(tmp_path / 'out')!r}]))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 12
        while len(list(markers.iterdir())) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.1)
        assert len(list(markers.iterdir())) == 2, "the two workers never started their cells"
        children = _descendants(parent.pid)
        assert {int(p.name) for p in markers.iterdir()} <= children
        os.kill(parent.pid, sent)
        parent.wait(timeout=5)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.05)
        orphans = [c for c in children if _alive(c)]
        assert not orphans, f"processes {orphans} outlived their parent (killed with {sent.name})"
    finally:
        for pid in [parent.pid, *children]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


# -- the guarded folder itself ---------------------------------------------------------------------------
def test_output_folder_refuses_links_escapes_and_inputs(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    (out / "e2e").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "x.json").write_text("precious")
    (out / "e2e" / "keydiff").symlink_to(elsewhere, target_is_directory=True)
    prompt = tmp_path / "p.txt"
    prompt.write_text("prompt")
    folder = OutputFolder(out, inputs=[prompt])
    for bad, words in [("e2e/keydiff/x.json", "is a symlink"), ("../x.json", "'..'"),
                       (str(tmp_path / "abs.json"), "must be relative"), ("e2e/keydiff/new/y.json", "is a symlink")]:
        with pytest.raises(ValueError, match=words) as err:
            folder.write_text(bad, "new")
        assert "\n" not in str(err.value)
    assert (elsewhere / "x.json").read_text() == "precious" and sorted(os.listdir(elsewhere)) == ["x.json"]
    with pytest.raises(ValueError, match="is a file named as input"):
        OutputFolder(tmp_path, inputs=[prompt]).write_text("p.txt", "page")
    assert prompt.read_text() == "prompt"
    with pytest.raises(ValueError, match="a folder named as input"):
        OutputFolder(tmp_path, inputs=[elsewhere]).write_text("elsewhere/y.txt", "x")
    # a file written: complete, ordinary permissions, no temporary left
    path = folder.write_json("a/b/c.json", {"k": 1})
    assert path == out / "a" / "b" / "c.json" and path.read_text() == '{\n "k": 1\n}\n'
    assert os.listdir(out / "a" / "b") == ["c.json"]
    # a Target (folder / "x") is written through the same guards by atomic_write
    assert Path(atomic_write(folder / "t.csv", "a\n")).read_text() == "a\n"
    with pytest.raises(ValueError, match="is a symlink"):
        atomic_write(folder / "e2e" / "keydiff" / "z.csv", "a\n")
    with pytest.raises(ValueError, match=r"other settings \(n: 2 there, 1 now\)"):
        folder.refuse_other_settings("a/b/c.json", {"n": 1}, {"n": 2}, what="golden")


def test_output_folder_check_mode_writes_nothing(tmp_path):
    folder = OutputFolder(tmp_path / "never")
    assert folder.publish({"a.csv": "x\n"}, check=True) == ["a.csv"]
    assert not (tmp_path / "never").exists()
    assert folder.publish({"a.csv": "x\n"}) == ["a.csv"] and folder.publish({"a.csv": "x\n"}, check=True) == []


# -- data loss 1: schedule goldens through a symlinked OUT/e2e/<policy> --------------------------------------
def test_attack_36_schedule_goldens_never_write_through_a_symlinked_policy_folder(capsys, tmp_path):
    out, victim = tmp_path / "OUT", tmp_path / "V"
    (out / "e2e").mkdir(parents=True)
    victim.mkdir()
    (victim / "tiny-sched-oneshot-K16-N8-float64.json").write_text("x\n")
    (out / "e2e" / "keydiff").symlink_to(victim, target_is_directory=True)
    code, text = _run(capsys, "golden", "generate", "--out", out, "--model", "tiny", "--budget", 8,
                      "--prompt-length", 24, "--policies", "keydiff")
    assert code == 2 and "is a symlink" in text and "Traceback" not in text, text
    assert sorted(os.listdir(victim)) == ["tiny-sched-oneshot-K16-N8-float64.json"]
    assert (victim / "tiny-sched-oneshot-K16-N8-float64.json").read_text() == "x\n"


def test_attack_36_a_second_schedule_generation_never_silently_replaces_the_first(capsys, tmp_path):
    """Another ``--prompt-length`` into the same ``--out``: refused, or written beside the first."""
    out = tmp_path / "OUT"
    argv = ("golden", "generate", "--out", out, "--model", "tiny", "--budget", 8, "--policies", "sink", "--quiet")
    assert _run(capsys, *argv, "--prompt-length", 24)[0] == 0
    first = _snapshot(out)
    code, text = _run(capsys, *argv, "--prompt-length", 32)
    after = _snapshot(out)
    assert all(after.get(name) == data for name, data in first.items()), "the first golden was replaced"
    if code == 2:
        assert "other settings (prompt_length: 24 there, 32 now)" in text and after == first, text
    else:
        assert code == 0 and len(after) == 2 * len(first), text


# -- data loss 2: the kvpress adapter's write_candidates through out/e2e/<policy> -----------------------------
def test_attack_36_write_candidates_never_writes_through_a_symlinked_policy_folder(capsys, tmp_path):
    pytest.importorskip("kvpress")
    from refkv.interop.kvpress import write_candidates

    reference, out, victim = tmp_path / "goldens", tmp_path / "candidate", tmp_path / "V"
    assert _run(capsys, "golden", "generate", "--out", reference, "--model", "tiny", "--budget", 8,
                "--prompt-length", 24, "--policies", "keydiff", "--quiet")[0] == 0
    (out / "e2e").mkdir(parents=True)
    victim.mkdir()
    (out / "e2e" / "keydiff").symlink_to(victim, target_is_directory=True)

    class NeverRun:  # refused before any press is fitted or run
        def __getattr__(self, name):
            raise AssertionError(f"the press was used ({name}) before the output folder was checked")

    with pytest.raises(ValueError, match="is a symlink") as err:
        write_candidates(NeverRun(), reference, out, policy="keydiff", progress=None)
    assert "\n" not in str(err.value) and os.listdir(victim) == []
    before = _snapshot(reference)
    with pytest.raises(ValueError, match="a folder named as input"):  # the goldens are never overwritten
        write_candidates(NeverRun(), reference, reference, policy="keydiff", progress=None)
    assert _snapshot(reference) == before


# -- data loss 3: experiment --publish through a symlinked PUB/overlap ----------------------------------------
def test_attack_36_publish_never_writes_through_a_symlinked_experiment_folder(capsys, tmp_path):
    publish, victim = tmp_path / "PUB", tmp_path / "V"
    publish.mkdir()
    victim.mkdir()
    (victim / "overlap.csv").write_text("precious\n")
    (publish / "overlap").symlink_to(victim, target_is_directory=True)
    code, text = _run(capsys, "experiment", "overlap", "--quick", "--model", "tiny", "--out", tmp_path / "OUT",
                      "--publish", publish)
    assert code == 2 and "is a symlink" in text and "Traceback" not in text, text
    assert (victim / "overlap.csv").read_text() == "precious\n" and os.listdir(victim) == ["overlap.csv"]
    assert not (tmp_path / "OUT").exists()  # refused before any cell ran


# -- data loss 4: docs/registered_verdicts.py with a bad folder or --help ---------------------------------------
@pytest.mark.parametrize("argv, code, words", [
    (["/nonexistent"], 2, "no such folder"),
    (["--help"], 0, "usage:"),
    (["--bogus"], 2, "unrecognized arguments"),
    (["."], 2, "holds none of"),
])
def test_attack_36_registered_verdicts_script_writes_nothing_on_bad_arguments(tmp_path, argv, code, words):
    published = ROOT / "docs" / "_static" / "experiments" / "registered"
    out = tmp_path / "registered"
    shutil.copytree(published, out)
    before = _snapshot(out), _snapshot(published)
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "registered_verdicts.py"), *argv, "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == code and words in proc.stdout + proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (_snapshot(out), _snapshot(published)) == before


def test_attack_36_registered_verdicts_check_writes_nothing(tmp_path):
    published = ROOT / "docs" / "_static" / "experiments" / "registered"
    out = tmp_path / "registered"
    shutil.copytree(published, out)
    (out / "run.inc").write_text("edited by hand\n")
    before = _snapshot(out)
    run = [sys.executable, str(ROOT / "docs" / "registered_verdicts.py"), "--page", "--check", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(run, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1 and "run.inc" in proc.stdout, proc.stdout + proc.stderr
    assert _snapshot(out) == before
    shutil.copy(published / "run.inc", out / "run.inc")
    assert subprocess.run(run, capture_output=True, text=True, timeout=120, env=env).returncode == 0


# -- data loss 6: refkv show --prompt-file p.txt --out p.txt -----------------------------------------------------
def test_attack_36_show_never_writes_over_its_prompt_file(capsys, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("The capital of France is Paris. The capital of France is")
    code, text = _run(capsys, "show", "--model", "tiny", "--prompt-file", prompt, "--out", prompt, "--budget", 4)
    assert code == 2 and "a file named as input" in text and "Traceback" not in text, text
    assert prompt.read_text() == "The capital of France is Paris. The capital of France is"
    (tmp_path / "link.html").symlink_to(prompt)
    code, text = _run(capsys, "show", "--model", "tiny", "--prompt-file", prompt, "--out", tmp_path / "link.html",
                      "--budget", 4)
    assert code == 2 and ("a file named as input" in text or "is a symlink" in text), text
    assert prompt.read_text().startswith("The capital")


# -- silent wrong 2: golden weights over another checkpoint --------------------------------------------------------
@pytest.mark.parametrize("layout", [
    {"config.json": '{"model_type": "llama"}', "model.safetensors": "x", "generation_config.json": "{}"},
    {"config.json": "{}", "model-00001-of-00002.safetensors": "x", "model-00002-of-00002.safetensors": "y",
     "model.safetensors.index.json": "{}"},
    {"config.json": '{"model_type": "llama"}', "model.safetensors": "x"},  # not written by refkv
])
def test_attack_36_golden_weights_never_replaces_another_checkpoint(capsys, tmp_path, layout):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name, text in layout.items():
        (folder / name).write_text(text)
    before = _snapshot(folder)
    code, text = _run(capsys, "golden", "weights", "--model", "qwen2", "--out", folder)
    assert code == 2 and "Traceback" not in text and ("holds files" in text or "did not write" in text), text
    assert _snapshot(folder) == before


def test_attack_36_golden_weights_replaces_only_its_own_checkpoint_of_the_same_settings(capsys, tmp_path):
    folder = tmp_path / "ckpt"
    assert _run(capsys, "golden", "weights", "--model", "tiny", "--out", folder)[0] == 0
    first = _snapshot(folder)
    assert sorted(first) == ["config.json", "model.safetensors"]
    assert _run(capsys, "golden", "weights", "--model", "tiny", "--out", folder)[0] == 0  # same settings: same bytes
    assert _snapshot(folder) == first
    code, text = _run(capsys, "golden", "weights", "--model", "tiny", "--seed", 3, "--out", folder)
    assert code == 2 and "other settings (seed: 0 there, 3 now)" in text, text
    assert _snapshot(folder) == first


# -- a check never writes: golden check on a read-only copy ----------------------------------------------------------
def test_golden_check_runs_on_a_read_only_suite(capsys, tmp_path, monkeypatch):
    """Read-only modes (which root ignores), and every call that would write, move or delete
    made to fail: the check still passes and the suite is byte for byte as before."""
    suite = tmp_path / "suite"
    assert _run(capsys, "golden", "generate", "--out", suite, "--policies", "sink", "--quiet")[0] == 0
    before = _snapshot(suite)
    stamps = {p: p.stat().st_mtime_ns for p in suite.rglob("*")}
    folders = [suite, *(p for p in suite.rglob("*") if p.is_dir())]
    for path in [*suite.rglob("*"), suite]:
        path.chmod(0o555 if path.is_dir() else 0o444)

    def refused(*args, **kwargs):
        raise AssertionError(f"a check wrote: {args}")

    for name in ("replace", "rename", "unlink", "mkdir", "rmdir", "makedirs"):
        monkeypatch.setattr(os, name, refused)
    monkeypatch.setattr(OutputFolder, "write_bytes", refused)
    try:
        code, text = _run(capsys, "golden", "check", suite, "--against", suite)
        assert code == 0 and "Traceback" not in text, text
    finally:
        monkeypatch.undo()
        for path in folders:
            path.chmod(0o755)
    assert _snapshot(suite) == before
    assert {p: p.stat().st_mtime_ns for p in suite.rglob("*")} == stamps
