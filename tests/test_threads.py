"""``refkv.threads.idle_cores``: its /proc/stat arithmetic on fake snapshots, hand-computed.

Only the reading of the file is replaced (by two fixed ``cpu`` lines); the parsing, the
differences, the idle share and the scaling to the usable cores run as they are.
"""

from __future__ import annotations

import pytest

from refkv import threads

#        user nice system idle iowait irq softirq steal guest guest_nice
BEFORE = "cpu  1000 20 300 5000 100 7 13 60 90 11\n"
# Deltas: user +40, system +10, idle +250, iowait +50, softirq +10, steal +40 (= 400 in all,
# 300 of them idle or waiting); guest +30 and guest_nice +5 are already inside user and nice.
AFTER = "cpu  1040 20 310 5250 150 7 23 100 120 16\n"


def _fake_stat(monkeypatch, lines, usable=4, cpu_count=8):
    snapshots = iter(lines)
    monkeypatch.setattr(threads, "_read_proc_stat", lambda: next(snapshots))
    monkeypatch.setattr(threads, "usable_cores", lambda: usable)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: cpu_count)


def test_cpu_times_reads_idle_plus_iowait_over_the_first_eight_fields(monkeypatch):
    _fake_stat(monkeypatch, [BEFORE])
    # idle 5000 + iowait 100; total 1000+20+300+5000+100+7+13+60 (guest fields excluded).
    assert threads._cpu_times() == (5100.0, 6500.0)


def test_idle_cores_is_the_idle_share_of_the_usable_cores(monkeypatch):
    _fake_stat(monkeypatch, [BEFORE, AFTER], usable=4, cpu_count=8)
    # (250 + 50) / 400 = 0.75 of the 4 usable cores.
    assert threads.idle_cores(0.0) == pytest.approx(3.0, rel=1e-12)


def test_idle_cores_scales_by_the_smaller_of_affinity_and_cpu_count(monkeypatch):
    _fake_stat(monkeypatch, [BEFORE, AFTER], usable=16, cpu_count=2)
    assert threads.idle_cores(0.0) == pytest.approx(1.5, rel=1e-12)


@pytest.mark.parametrize("after", [BEFORE, "cpu  1 2 3\n", None, "cpu  a b c d e f g h\n"])
def test_idle_cores_is_none_without_progress_or_a_readable_line(after, monkeypatch):
    _fake_stat(monkeypatch, [BEFORE, after])
    assert threads.idle_cores(0.0) is None
