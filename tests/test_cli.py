"""The ``refkv`` command: run and policies."""

import re
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
    # 300 prompt tokens + 19 generated ones were cached; sink keeps 64 of them everywhere.
    assert "evicted: 255 of 319 tokens in every layer and KV head (64 kept)" in out
    assert "peak cache: 80 tokens per head" in out
    # 19 prompt blocks of 16 (the first 4 fit, blocks 5-19 evict) and 19 decoding steps that all
    # evict: (15 + 19) x 4 layers = 136 evicting calls of (19 + 19) x 4 = 152.
    assert "eviction steps: 136 of 152 layer calls" in out
    assert "\ngenerated:" not in out  # the random model's tokens tell nothing about the policy
    assert "attention weights formed" not in out  # sink never forms them: the line would say nothing


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


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0"], "--budget must be an integer >= 1, got 0"),
    (["--policy", "sink", "--budget", "16", "--block", "0"], "--block must be an integer >= 1, got 0"),
    (["--policy", "sink", "--budget", "16", "--threads", "0"], "--threads must be an integer >= 1, got 0"),
    (["--policy", "full", "--budget", "64"], "--budget cannot be used with --policy full"),
    (["--policy", "keydiff", "--param", "sink=4", "--budget", "64"],
     "policy 'keydiff' has no parameter 'sink'; allowed: "),
    (["--policy", "knorm", "--param", "skip_layers=(7,)", "--budget", "64"], "skip_layers must be in [0, 3]"),
    (["--policy", "mat", "--budget", "64", "--block", "64"],
     "--block must be <= 60 for --policy mat with --budget 64"),  # N - sink in its shallow layers
    (["--policy", "hashevict", "--budget", "64"],
     "--policy hashevict with --budget 64 cannot process the prompt (300 tokens) as one block"),
    (["--prompt-len", "0"], "--prompt-len must be an integer in [1, 131072], got 0"),
])
def test_run_rejects_bad_combinations_in_one_line(argv, message, capsys):
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_policy_without_a_budget_warns(capsys):
    assert main(["run", "--policy", "keydiff", "--prompt-len", "20", "--new-tokens", "1"]) == 0
    out, err = capsys.readouterr()
    assert "warning: --policy keydiff without --budget never evicts" in err
    assert "evicted: nothing (no budget)" in out
    assert main(["run", "--prompt-len", "20", "--new-tokens", "1"]) == 0
    assert "warning" not in capsys.readouterr().err  # full without a budget is the plain baseline


def test_run_shows_attention_use_only_when_there_is_some(capsys):
    assert main(["run", "--policy", "h2o", "--budget", "32", "--block", "8", "--prompt-len", "60",
                 "--new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "attention weights formed: " in out and "h2o reads them" in out


def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for inner, subsub in _subparsers(sub):
                    yield f"{name} {inner}", subsub


def test_every_help_shows_the_defaults():
    """Every option with a default value says it in --help (``refkv`` and every subcommand)."""
    import argparse

    from refkv.cli import build_parser

    parser = build_parser()
    checked = 0
    for name, sub in [("refkv", parser), *_subparsers(parser)]:
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            if action.default is None or action.default is False:
                continue
            assert action.help, f"{name} {action.option_strings[0]} has no help"
            helptext = " ".join((action.help % {"default": action.default}).split())
            assert "default" in helptext or f"(default: {action.default})" in text, (name, action.option_strings)
            checked += 1
    assert checked >= 10


def test_generate_on_the_tiny_model_reports_eviction(capsys, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a fairly long prompt " * 10, encoding="utf-8")
    assert main(["generate", "--prompt-file", str(prompt), "--model", "tiny", "--policy", "tova",
                 "--budget", "64", "--block", "16", "--max-new-tokens", "3", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == "loading tiny ..."
    # 210 prompt bytes + 2 of the 3 generated tokens were cached; tova keeps 64.
    assert "[evicted: 148 of 212 tokens in every layer and KV head (64 kept)]" in err
    assert "BLAS threads: 1 (as asked by --threads)]" in err


def test_generate_prompt_sources_are_exclusive_and_checked(capsys, tmp_path):
    assert main(["generate", "x", "--example", "--model", "tiny"]) == 2
    assert "give exactly one of PROMPT, --prompt-file PATH or --example (got PROMPT and --example)" in \
        capsys.readouterr().err
    assert main(["generate", "--model", "tiny"]) == 2
    assert "give exactly one of" in capsys.readouterr().err
    assert main(["generate", "--prompt-file", str(tmp_path / "missing.txt"), "--model", "tiny"]) == 2
    assert "--prompt-file" in capsys.readouterr().err


def test_example_passage_is_long_enough_to_evict():
    from refkv.generation import example_passage

    text = example_passage()
    assert text.rstrip().endswith("?") and "Question:" in text
    assert 250 < len(text.split()) < 400  # a few hundred tokens: a budget of 64-128 must evict


def test_generate_errors_come_before_the_model_loads(capsys, monkeypatch):
    import refkv.model.loading as loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_with_tokenizer", no_loading)
    for argv in (["--policy", "full", "--budget", "8"], ["--policy", "sink", "--budget", "4"],
                 ["--policy", "keydiff", "--param", "bogus=1", "--budget", "8"], ["--budget", "-3"],
                 ["--policy", "mat", "--budget", "64", "--block", "80"]):
        assert main(["generate", "hello", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("refkv: error: ") and "loading" not in err, err


def test_progress_line_only_for_a_slow_prefill(capsys, monkeypatch):
    """The progress line appears once the prefill is on course to take more than ~2 s."""
    import refkv.cli as cli

    monkeypatch.setattr(cli, "PROGRESS_AFTER_SECONDS", 0.0)  # every prefill is "slow"
    assert main(["generate", "x" * 200, "--model", "tiny", "--block", "50", "--max-new-tokens", "2"]) == 0
    assert "prefill: 200/200 tokens" in capsys.readouterr().err
    monkeypatch.setattr(cli, "PROGRESS_AFTER_SECONDS", 1e9)
    assert main(["generate", "x" * 200, "--model", "tiny", "--block", "50", "--max-new-tokens", "2"]) == 0
    assert "prefill:" not in capsys.readouterr().err


# -- threads ------------------------------------------------------------------------------------
def test_threads_requested_is_used_unmeasured():
    from refkv.model import TINY
    from refkv.threads import ThreadChoice, choose_threads

    assert choose_threads(TINY, requested=3) == ThreadChoice(3, "--threads")
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        choose_threads(TINY, requested=0)


@pytest.mark.parametrize("speedup, expected", [(0.95, 1), (0.85, 4), (1.5, 1)])
def test_threads_choice_needs_a_clear_win_over_one_thread(speedup, expected, monkeypatch):
    """More threads are chosen only when they were at least MARGIN (10%) faster than one."""
    import refkv.threads as threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "_blas_controllable", lambda: True)
    monkeypatch.setattr(threads, "idle_cores", lambda: 4.0)
    # candidates 1, 2, 4: two threads no better than one, four `speedup` times one's time
    fake = {1: 10.0, 2: 10.0, 4: 10.0 * speedup}
    monkeypatch.setattr(threads, "_time_workload", lambda n, *a: fake[n])
    from refkv.model import TINY

    choice = threads.choose_threads(TINY)
    assert choice.n == expected
    assert "measured" in choice.reason and "4: " in choice.reason


def test_threads_choice_counts_the_stalls_of_a_busy_core(monkeypatch):
    """Two threads fast in most runs but stalled for a time slice in some (another process
    on a core) are slower over a long prompt: the mean sees it, the fastest run would not."""
    import itertools

    import refkv.threads as threads
    from refkv.model import TINY

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "_blas_controllable", lambda: True)
    monkeypatch.setattr(threads, "idle_cores", lambda: None)  # timing alone must see it
    stalls = itertools.cycle([3.0, 3.0, 3.0, 60.0])  # ms: one run in four waits a time slice
    monkeypatch.setattr(threads, "_time_workload", lambda n, *a: 5.0 if n == 1 else next(stalls))
    choice = threads.choose_threads(TINY)
    assert choice.n == 1 and f"mean of {threads.REPEATS}" in choice.reason


@pytest.mark.parametrize("idle, cores_timed",
                         [(1.1, None), (1.7, None), (1.8, [1, 2]), (2.6, [1, 2]), (3.9, [1, 2, 4])])
def test_threads_never_exceed_the_idle_cores(idle, cores_timed, monkeypatch):
    """With other work on the cores, only the cores it leaves idle are candidates: 1.1 idle
    cores of 4 means one thread, unmeasured; a core counts when at least 75% of it is idle."""
    import refkv.threads as threads
    from refkv.model import TINY

    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "_blas_controllable", lambda: True)
    monkeypatch.setattr(threads, "idle_cores", lambda: idle)
    timed = set()
    monkeypatch.setattr(threads, "_time_workload", lambda n, *a: timed.add(n) or 10.0 / n)
    choice = threads.choose_threads(TINY)
    if cores_timed is None:
        assert choice == threads.ThreadChoice(1, f"{idle:.1f} idle cores of 4") and not timed
    else:
        assert sorted(timed) == cores_timed and choice.n == max(cores_timed)


def test_idle_cores_reads_the_machine():
    import refkv.threads as threads

    idle = threads.idle_cores(0.05)
    if idle is None:
        pytest.skip("no /proc/stat here")
    assert 0.0 <= idle <= threads.usable_cores() + 1e-9


def test_threads_one_core_or_no_blas_pool_means_one(monkeypatch):
    import refkv.threads as threads
    from refkv.model import TINY

    monkeypatch.setattr(threads, "usable_cores", lambda: 1)
    assert threads.choose_threads(TINY).n == 1
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.setattr(threads, "_blas_controllable", lambda: False)
    assert threads.choose_threads(TINY) == threads.ThreadChoice(1, "no BLAS thread pool found")


def test_blas_threads_sets_and_restores_the_pool():
    from threadpoolctl import threadpool_info

    from refkv.threads import blas_threads

    def counts():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    before = counts()
    if not before:
        pytest.skip("no BLAS thread pool visible to threadpoolctl")
    with blas_threads(1):
        assert counts() == [1] * len(before)
    assert counts() == before


def test_experiment_summary_table_is_rounded(tmp_path):
    from refkv.experiments.cli import summary_table

    folder = tmp_path / "perplexity"
    folder.mkdir()
    (folder / "ppl.csv").write_text("policy,label,budget,block,ppl,delta_ppl,segments\n"
                                    "h2o,H2O,128,32,19.24812345,0.8634571,1\n"
                                    "full,no eviction,,32,18.3846,0,1\n", encoding="utf-8")
    table = summary_table("perplexity", tmp_path)
    assert "19.2" in table and "0.863" in table and "19.248" not in table
    assert "segments" not in table  # only the columns that answer "how good"
    assert summary_table("perplexity", tmp_path / "nowhere") is None


def test_experiment_summary_table_shows_a_gap_without_its_baseline_as_nan(tmp_path):
    # `--policies SPEC` alone (MAT's chosen spec in the registered run) has no full-cache row
    # in its table: the gap is NaN, and the console table printed it as a traceback-free error
    # "cannot convert float NaN to integer" after the cells had finished.
    from refkv.experiments.cli import summary_table

    folder = tmp_path / "perplexity"
    folder.mkdir()
    (folder / "ppl.csv").write_text("policy,label,budget,block,ppl,delta_ppl,segments\n"
                                    "mat,MAT,128,1,18.996,nan,0\n", encoding="utf-8")
    table = summary_table("perplexity", tmp_path)
    assert "19" in table and "nan" in table


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "refkv", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("refkv ")


def test_parse_params_and_ranges():
    assert parse_params(["sink=4", "name=h2o", "frac=0.5", "flag=True", "t=(1, 2)"]) == {
        "sink": 4, "name": "h2o", "frac": 0.5, "flag": True, "t": (1, 2)}
    with pytest.raises(ValueError, match=re.escape("--param takes NAME=VALUE as one word, e.g. --param "
                                                   "reserve=0.25; got 'novalue'")):
        parse_params(["novalue"])
    assert parse_params(["code=__import__('os')"]) == {"code": "__import__('os')"}  # never evaluated
    assert format_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert format_ranges([]) == "-"


def test_the_readme_quick_start_command_evicts(capsys):
    """The README's generate command, on the built-in model (byte tokens: a longer prompt), shows eviction."""
    import pathlib
    import shlex

    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.rst").read_text(encoding="utf-8")
    line = next(x.strip() for x in readme.splitlines() if x.startswith("    refkv generate"))
    words = shlex.split(line)[1:]
    words[words.index("--max-new-tokens") + 1] = "2"
    assert main([*words, "--model", "tiny", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "[evicted: " in err and "evicted: nothing" not in err


def test_generate_refuses_a_too_long_single_block_before_loading(capsys, monkeypatch):
    """No --block with a policy that evicts before attention: a prompt with more words than the
    block limit cannot fit (every word is at least one token), so the error comes before loading."""
    import refkv.model.loading as loading

    monkeypatch.setattr(loading, "load_with_tokenizer", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["generate", "word " * 100, "--policy", "mat", "--budget", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refkv: error: --policy mat with --budget 64 cannot process the prompt "
                          "(at least 100 tokens) as one block")
    assert "pass --block 60 or smaller" in err


# -- the first hour (issue 24 B) ----------------------------------------------------------------
def test_a_wrong_flag_shows_the_subcommands_usage_and_the_closest_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--example", "--max-tokens", "48"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: refkv generate ")  # the subcommand's usage, not the top level's
    assert "error: unrecognized arguments: --max-tokens (did you mean --max-new-tokens?)" in err
    with pytest.raises(SystemExit):
        main(["run", "--polcy", "sink", "--budgett=4"])
    err = capsys.readouterr().err
    assert err.startswith("usage: refkv run ") and "did you mean --policy or --budget?" in err
    with pytest.raises(SystemExit):
        main(["run", "--zzzzzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzz;" in err and "did you mean" not in err


def test_policies_columns_line_up_for_every_name(capsys):
    from refkv import policies

    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * len(policies.available())
    width = max(map(len, policies.available())) + 2
    for name, summary, paper in zip(policies.available(), lines[::2], lines[1::2]):
        assert summary.startswith(name) and summary[len(name):width].strip() == "" and summary[width] != " "
        assert paper[:width].strip() == "" and paper[width:].startswith("paper: ")


def test_generate_example_says_what_to_compare(capsys):
    from refkv.generation import example_answer, example_passage, example_question

    assert example_question() in example_passage() and "1879" in example_passage()
    assert "Agnes Ruddock" in example_answer() and "1879" in example_answer()
    assert main(["generate", "--example", "--model", "tiny", "--policy", "sink", "--budget", "64", "--block",
                 "32", "--max-new-tokens", "1", "--threads", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[-3:] == [f"[question: {example_question()}]",
                        f"[reference answer, from the passage: {example_answer()}]",
                        "[compare: are the name and the year in the answer above? Run it again without --budget "
                        "for the model's answer with nothing evicted]"]
    assert main(["generate", "--example", "--model", "tiny", "--max-new-tokens", "1", "--threads", "1"]) == 0
    assert "add --budget 128 --block 32" in capsys.readouterr().err


def test_threads_line_is_plain_words():
    from refkv.cli import _threads_line
    from refkv.threads import ThreadChoice

    assert _threads_line(ThreadChoice(1, "0.3 idle cores of 2")) == \
        "BLAS threads: 1 (other programs are busy: 0.3 of 2 cores idle, so one thread)"
    assert _threads_line(ThreadChoice(2, "measured, mean of 5 (1: 46.4 ms, 2: 30.2 ms)")) == \
        "BLAS threads: 2 (the fastest when timed: 1 thread 46.4 ms, 2 threads 30.2 ms)"
    assert _threads_line(ThreadChoice(3, "--threads")) == "BLAS threads: 3 (as asked by --threads)"


def _sample_lines(text: str) -> list[str]:
    """Output lines without what changes from run to run: progress lines, times, the thread choice."""
    lines = []
    for line in text.splitlines():
        if line.startswith("prefill: ") or not line.strip():
            continue
        line = re.sub(r"\d+\.\d+ s\b", "T s", line)
        line = re.sub(r"BLAS threads: .*\]$", "BLAS threads: ...]", line)
        lines.append(line)
    return lines


def test_quick_start_sample_output_is_a_real_run(smollm2, smollm2_tokenizer, capsys, monkeypatch):
    """The quick start's sample output is what its command prints (timings and threads aside)."""
    import pathlib
    import shlex

    import refkv.model.loading as loading

    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "guide" / "quickstart.rst").read_text(
        encoding="utf-8")
    command = re.search(r"^    (refkv generate --example .*)$", page, re.M).group(1)
    sample = re.search(r"\.\. code-block:: text\n   :class: sample-output\n\n((?:   .*\n)+)", page).group(1)
    monkeypatch.setattr(loading, "load_with_tokenizer", lambda name, dtype=None: (smollm2, smollm2_tokenizer))
    assert main([*shlex.split(command)[1:], "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    err_lines = err.splitlines()
    ran = _sample_lines("\n".join([err_lines[0], *out.splitlines(), *err_lines[1:]]))
    shown = _sample_lines("\n".join(line[3:] for line in sample.splitlines()))
    assert shown == ran
