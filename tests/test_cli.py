"""The ``refkv`` command: run and policies."""

import subprocess
import sys

import pytest

from refkv.cli import main
from refkv.formatting import format_ranges
from refkv.policies.spec import parse_params


def test_run_prints_kept_positions_peak_and_tokens(capsys):
    assert main(["run", "--policy", "sink", "--budget", "64", "--block", "16", "--prompt-len", "300",
                 "--new-tokens", "20"]) == 0
    out = capsys.readouterr().out
    assert "layer 0 head 0: 64 kept: 0-3,259-318" in out  # 300 prompt + 19 generated tokens attended
    assert "layer 3 head 1: 64 kept:" in out
    assert "peak cache size: 80 tokens per head" in out
    generated = out.strip().splitlines()[-1].split()
    assert generated[0] == "generated:" and len(generated) == 21


def test_run_with_policy_params(capsys):
    assert main(["run", "--policy", "sink", "--param", "sink=2", "--budget", "10", "--prompt-len", "30",
                 "--new-tokens", "1"]) == 0
    assert "0-1,22-29" in capsys.readouterr().out


def test_policies_lists_every_policy(capsys):
    from refkv import policies

    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    for name in policies.available():
        if not name.startswith("_"):
            assert f"\n{name} " in "\n" + out
    assert "StreamingLLM" in out


def test_errors_exit_2_with_a_message(capsys):
    assert main(["run", "--policy", "sink", "--budget", "4"]) == 2
    assert "budget must be > sink=4" in capsys.readouterr().err
    assert main(["run", "--policy", "nope"]) == 2
    with pytest.raises(SystemExit):
        main(["run", "--budget", "x"])


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "refkv", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("refkv ")


def test_parse_params_and_ranges():
    assert parse_params(["sink=4", "name=h2o", "frac=0.5", "flag=True", "t=(1, 2)"]) == {
        "sink": 4, "name": "h2o", "frac": 0.5, "flag": True, "t": (1, 2)}
    with pytest.raises(ValueError, match="name=value"):
        parse_params(["novalue"])
    assert parse_params(["code=__import__('os')"]) == {"code": "__import__('os')"}  # never evaluated
    assert format_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert format_ranges([]) == "-"
