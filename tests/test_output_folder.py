"""Issue 36, the writing half: one guarded output folder for every writer (``test_attack_36_<what>``).

Each test reproduces an item of issue 36 that lost data on the code the issue was filed
against, plus the properties of :class:`refkv.files.OutputFolder` every writer inherits.
"""

from __future__ import annotations

import contextlib
import os
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
