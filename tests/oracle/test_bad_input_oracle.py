"""Issue 13, the oracle's items: each defect's test fails on the code before the fix."""

import io
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from refkv.cli import main
from refkv.oracle.io import read_json, read_npz

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
E2E = "e2e/h2o/N8-B4-float64"


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def _candidate_with_e2e(root: Path) -> Path:
    (root / "e2e").mkdir(parents=True)
    shutil.copytree(GOLDEN / "e2e" / "h2o", root / "e2e" / "h2o")
    return root


def _forged_npz(path: Path, shape=(10**11,)) -> None:
    """An .npz whose 'logits' member declares ``shape`` in its header but holds 8 bytes."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as zf:
        for name in ("kept", "kept_count"):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.zeros((1,), dtype=np.int64))
            zf.writestr(f"{name}.npy", member.getvalue())
        zf.writestr("logits.npy", header.getvalue() + b"\0" * 8)


def test_attack_13_06_npz_member_shapes_are_validated_from_headers(tmp_path, capsys):
    path = tmp_path / "forged.npz"
    _forged_npz(path)
    with pytest.raises(ValueError, match=r"member logits.npy declares shape \(100000000000,\) of float64 "
                                         r"\(800000000000 bytes\) but holds 8 bytes"):
        read_npz(path)
    cand = _candidate_with_e2e(tmp_path / "cand")
    _forged_npz(cand / f"{E2E}.npz")
    code, out = _run(capsys, "golden", "check", str(cand), "--against", str(GOLDEN), "--policies", "h2o",
                     "--kind", "e2e")
    assert code == 1 and f"FAIL {E2E}.json" in out and "declares shape (100000000000,)" in out
    # The other files of the policy were still compared, each on its own line.
    assert out.count("FAIL ") == 1 and "1 failed" in out


def test_attack_13_06_symlink_to_dev_zero_is_refused(tmp_path, capsys):
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    link = tmp_path / "zero.npz"
    link.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=r"not a regular file \(a device\)"):
        read_npz(link)
    json_link = tmp_path / "zero.json"
    json_link.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=r"not a regular file \(a device\)"):
        read_json(json_link)
    cand = _candidate_with_e2e(tmp_path / "cand")
    (cand / f"{E2E}.npz").unlink()
    (cand / f"{E2E}.npz").symlink_to("/dev/zero")
    code, out = _run(capsys, "golden", "check", str(cand), "--against", str(GOLDEN), "--policies", "h2o",
                     "--kind", "e2e")
    assert code == 1 and f"FAIL {E2E}.json" in out and "not a regular file (a device)" in out


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_attack_13_06_fifo_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"not a regular file \(a FIFO\)"):
        read_json(fifo)
    cand = tmp_path / "cand"
    (cand / "vectors").mkdir(parents=True)
    os.mkfifo(cand / "vectors" / "sink.json")
    code, out = _run(capsys, "golden", "check", str(cand), "--against", str(GOLDEN), "--policies", "sink",
                     "--kind", "vectors")
    assert code == 1 and "FAIL vectors/sink.json" in out and "not a regular file (a FIFO)" in out


@pytest.mark.parametrize("factor", ["inf", "nan", "-1", "0", "-inf"])
def test_attack_13_11_non_finite_tolerance_factor_is_refused(capsys, factor):
    code, out = _run(capsys, "golden", "check", str(GOLDEN), "--against", str(GOLDEN), "--policies", "sink",
                     f"--tolerance-factor={factor}")
    assert code == 2 and "--tolerance-factor must be a finite number in (0, inf)" in out
    assert "Traceback" not in out


def test_attack_13_11_a_factor_that_makes_the_tie_rule_meaningless_is_reported(capsys, tmp_path):
    cand = tmp_path / "cand"
    (cand / "vectors").mkdir(parents=True)
    shutil.copy(GOLDEN / "vectors" / "keydiff.json", cand / "vectors")
    code, out = _run(capsys, "golden", "check", str(cand), "--against", str(GOLDEN), "--policies", "keydiff",
                     "--kind", "vectors", "--tolerance-factor", "1e300", "--verbose")
    assert code == 0
    assert "tolerance factor 1e+300: every tolerance multiplied (explicit override)" in out
    assert "the tie rule accepts any swap" in out


def test_attack_13_18_allow_missing_on_an_empty_folder_is_one_verdict(capsys, tmp_path):
    code, out = _run(capsys, "golden", "check", str(tmp_path), "--against", str(GOLDEN), "--allow-missing")
    assert code == 1
    assert out.rstrip().endswith("FAIL (nothing was compared)") and "PASS" not in out
