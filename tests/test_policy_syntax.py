"""One policy syntax on every command (issue 37, item 2), and the show/generate stumbles (item 6).

Every command that takes a policy reads the same spec, ``name:param=value,...`` or
``name(param=value,...)`` (:mod:`refkv.policies.spec`); ``--param NAME=VALUE`` still adds
parameters where it was documented (generate, run) and now on ``show`` too. Mix-ups get an
answer that names the right form. All on the built-in ``tiny`` model.
"""

import re
import sys

import pytest

from refkv.cli import main, missing_package_message
from refkv.experiments.cli import policy_list
from refkv.explorer import visible_answer
from refkv.policies.spec import with_params

#: Long enough (bytes are tokens on tiny) that a budget of 64 evicts.
PROMPT = "The pass key is 48151. Remember it. " + "The grass is green and the sky is blue. " * 6

#: The same KeyDiff with a recent reserve, written the three accepted ways.
KEYDIFF_FORMS = (["--policy", "keydiff:reserve=0.25"], ["--policy", "keydiff(reserve=0.25)"],
                 ["--policy", "keydiff", "--param", "reserve=0.25"])


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# -- the same spec everywhere ----------------------------------------------------------------
def test_run_reads_every_form_of_the_spec_alike(capsys):
    outputs = []
    for form in KEYDIFF_FORMS:
        assert main(["run", *form, "--budget", "64", "--block", "16", "--prompt-len", "120",
                     "--new-tokens", "2", "--threads", "1"]) == 0, form
        outputs.append(capsys.readouterr().out)
    assert "reserve=0.25" in outputs[0]
    assert outputs[0] == outputs[1] == outputs[2]
    # ... and the reserve is used: without it KeyDiff keeps other positions
    assert main(["run", "--policy", "keydiff", "--budget", "64", "--block", "16", "--prompt-len", "120",
                 "--new-tokens", "2", "--threads", "1"]) == 0
    assert capsys.readouterr().out != outputs[0]


def test_generate_reads_every_form_of_the_spec_alike(capsys):
    lines = []
    for form in KEYDIFF_FORMS:
        assert main(["generate", PROMPT, "--model", "tiny", *form, "--budget", "64", "--block", "16",
                     "--max-new-tokens", "2", "--threads", "1"]) == 0, form
        err = capsys.readouterr().err
        assert "unknown policy" not in err
        lines.append([line for line in err.splitlines() if line.startswith("[evicted") or "policy keydiff(" in line])
    assert "reserve=0.25" in lines[0][0]
    strip_times = [[re.sub(r"\d+\.\d+ s", "T s", line) for line in group] for group in lines]
    assert strip_times[0] == strip_times[1] == strip_times[2]


def test_show_reads_every_form_of_the_spec_and_param(capsys, tmp_path):
    pages = []
    for index, form in enumerate(KEYDIFF_FORMS):
        out = tmp_path / f"page{index}.html"
        assert main(["show", PROMPT, "--model", "tiny", *form, "--budget", "64", "--block", "16",
                     "--max-new-tokens", "0", "--threads", "1", "--out", str(out)]) == 0, form
        capsys.readouterr()
        page = out.read_text(encoding="utf-8")
        assert "reserve=0.25" in page
        # the page's data (decisions and scores) is the same whichever way the spec was written
        pages.append(re.search(r'<script type="application/json" id="refkv-data">(.*?)</script>', page).group(1))
    assert pages[0] == pages[1] == pages[2]


def test_show_param_needs_one_policy(capsys):
    assert main(["show", PROMPT, "--model", "tiny", "--param", "reserve=0.25"]) == 2
    err = _error(capsys)
    assert "unrecognized arguments" not in err
    assert err.strip() == ("refkv: error: --param adds a parameter to one policy, but the default lists 4 "
                           "(h2o,keydiff,snapkv,tova); write it in that policy's spec instead, e.g. "
                           "--policy keydiff:reserve=0.25,h2o")
    assert main(["show", PROMPT, "--model", "tiny", "--policy", "h2o,keydiff", "--param", "reserve=0.25"]) == 2
    assert "but --policy lists 2 (h2o,keydiff)" in _error(capsys)


def test_experiment_policies_take_specs_and_comma_lists(capsys, tmp_path):
    assert policy_list(["keydiff(reserve=0.25)", "h2o,tova", "caote:base=snapkv,fast=True"]) == \
        ["keydiff(reserve=0.25)", "h2o", "tova", "caote:base=snapkv,fast=True"]
    out = tmp_path / "results"
    assert main(["experiment", "overlap", "--quick", "--model", "tiny", "--policies", "keydiff(reserve=0.25)",
                 "h2o,tova", "--dry-run", "--out", str(out)]) == 0
    cells = capsys.readouterr().out.splitlines()
    assert sorted(re.search(r'"policy":"([^"]*)"', line).group(1) for line in cells) == \
        ["h2o", "keydiff:reserve=0.25", "tova"]  # the records' canonical spec
    assert not out.exists()  # a dry run writes nothing
    # the same policy twice, once per form, is refused as such
    assert main(["experiment", "overlap", "--quick", "--model", "tiny", "--policies", "keydiff(reserve=0.25)",
                 "keydiff:reserve=0.25", "--dry-run", "--out", str(out)]) == 2
    assert "lists 'keydiff:reserve=0.25' twice" in _error(capsys)


def test_with_params_merges_and_refuses_two_values():
    assert with_params("keydiff", ["reserve=0.25"]) == "keydiff:reserve=0.25"
    assert with_params("keydiff(reserve=0.25)", None) == "keydiff(reserve=0.25)"
    assert with_params("keydiff:reserve=0.25", ["reserve=0.25"]) == "keydiff:reserve=0.25"  # the same value twice
    assert with_params("caote(base=snapkv)", ["base_params={'window': 8}"]) == \
        "caote:base=snapkv,base_params={'window': 8}"
    with pytest.raises(ValueError, match=r"parameter 'reserve' is given twice, reserve=0\.2 in the spec"):
        with_params("keydiff:reserve=0.2", ["reserve=0.25"])


# -- the three misleading messages, and other mix-ups ------------------------------------------
def test_a_spec_on_generate_is_no_longer_an_unknown_policy(capsys, monkeypatch):
    import refkv.model.loading as loading

    monkeypatch.setattr(loading, "load_with_tokenizer", lambda *a, **k: pytest.fail("model loaded"))
    # a bad value in the spec is refused before the model loads, naming the parameter
    assert main(["generate", "hello", "--policy", "keydiff:reserve=1.5", "--budget", "64"]) == 2
    err = _error(capsys)
    assert "unknown policy" not in err and "reserve" in err


@pytest.mark.parametrize("tail", [["x"], ["--example"], []])
def test_param_in_two_words_says_name_equals_value(tail, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "tiny", "--policy", "keydiff", "--param", "reserve", "0.25", *tail])
    assert exit_info.value.code == 2
    err = _error(capsys)
    assert "give exactly one of" not in err and "unrecognized" not in err
    assert err.splitlines()[-1] == ("refkv generate: error: --param takes NAME=VALUE as one word, e.g. "
                                    "--param reserve=0.25; got --param reserve 0.25 (write --param reserve=0.25)")


def test_param_without_value_on_run_and_show(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--policy", "sink", "--param", "sink", "--budget", "16"])
    assert "--param takes NAME=VALUE as one word" in _error(capsys)
    with pytest.raises(SystemExit):
        main(["show", "text", "--model", "tiny", "--policy", "keydiff", "--param", "reserve", "0.25"])
    assert "(write --param reserve=0.25)" in _error(capsys)
    # after "--" every word is positional: a prompt may say "--param x"
    assert main(["generate", "--model", "tiny", "--max-new-tokens", "1", "--threads", "1", "--",
                 "--param x"]) == 0
    capsys.readouterr()


def test_a_parameter_given_as_an_option_names_both_forms(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--policy", "keydiff", "--reserve=0.25", "--budget", "64"])
    err = _error(capsys)
    assert "unrecognized arguments: --reserve=0.25 (did you mean --param reserve=0.25, or the spec " \
           "--policy NAME:reserve=0.25?)" in err


@pytest.mark.parametrize("argv", [
    ["run", "--policy", "H2O", "--budget", "64"],
    ["generate", "hello", "--model", "tiny", "--policy", "H2O", "--budget", "64"],
    ["show", "hello", "--model", "tiny", "--policy", "H2O,keydiff"],
    ["experiment", "overlap", "--quick", "--model", "tiny", "--policies", "H2O", "--dry-run"],
])
def test_a_policy_name_in_the_wrong_case_gets_its_spelling(argv, capsys, tmp_path):
    assert main([*argv, *(["--out", str(tmp_path / "x")] if argv[0] in ("show", "experiment") else [])]) == 2
    err = _error(capsys)
    assert "unknown policy 'H2O' (did you mean 'h2o'? policy names are lower case)" in err
    assert err.count("\n") == 1


def test_did_you_mean_on_misspelt_names():
    from refkv import policies

    with pytest.raises(ValueError, match=r"unknown policy 'kediff' \(did you mean 'keydiff'\?\)"):
        policies.get("kediff")
    with pytest.raises(ValueError, match=r"unknown policy 'zzzz'; available: adakv"):
        policies.get("zzzz")
    with pytest.raises(ValueError, match=r"has no parameter 'reserv' \(did you mean 'reserve'\?\)"):
        policies.get("keydiff", reserv=0.25)
    with pytest.raises(ValueError, match=r"has no parameter 'Reserve' \(did you mean 'reserve'\? parameter names"):
        policies.get("keydiff", Reserve=0.25)
    with pytest.raises(ValueError, match="that is a policy spec"):
        policies.get("keydiff:reserve=0.25")


def test_several_policies_where_one_runs(capsys):
    assert main(["run", "--policy", "h2o,keydiff", "--budget", "64"]) == 2
    assert "--policy names one policy here, got 2: h2o, keydiff (`refkv show --policy h2o,keydiff` compares " \
           "several)" in _error(capsys)


# -- a missing extra is one line -------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "show"])
def test_a_missing_models_extra_is_one_line(command, capsys, monkeypatch, tmp_path):
    """Without the ``gguf`` package (the ``models`` extra), reading a model file is one line naming
    the install command, exit status 1, no traceback."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ModuleNotFoundError
    assert main([command, "hello", "--model", str(model), "--out" if command == "show" else "--raw",
                 *([str(tmp_path / "page.html")] if command == "show" else [])]) == 1
    err = _error(capsys).splitlines()
    assert err == [f"loading {model} ...",
                   "refkv: error: reading GGUF files needs the 'gguf' package: pip install gguf tokenizers  "
                   "(the 'models' extra: pip install -e '.[models]' in a checkout)"]


def test_missing_package_message_names_the_extra():
    err = ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    assert missing_package_message(err) == ("No module named 'matplotlib': install the 'plot' extra: "
                                            "pip install -e '.[plot]' in the checkout")
    own = ModuleNotFoundError("the tokenizer needs the 'tokenizers' package: pip install tokenizers")
    assert missing_package_message(own) == str(own)  # it already says how


# -- show's small stumbles ---------------------------------------------------------------------
def test_show_counts_in_the_right_number_and_says_nothing_evicted(capsys, tmp_path):
    out = tmp_path / "fits.html"
    assert main(["show", "x", "--model", "tiny", "--policy", "h2o", "--budget", "500", "--max-new-tokens", "0",
                 "--threads", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out} (1 token, 1 policy; nothing evicted: they fit in --budget 500)" in captured.out
    assert "note: the prompt's 1 token fit in --budget 500" in captured.err
    assert "[1 run in " in captured.err and "1 prompt token ..." in captured.err
    page = out.read_text(encoding="utf-8")
    assert "nothing evicted</b>: the prompt's 1 token fit in N = 500" in page
    assert "1 tokens kept per layer and KV head (nothing evicted)" in page
    assert main(["show", "x", "--model", "tiny", "--policy", "h2o", "--budget", "500", "--max-new-tokens", "0",
                 "--threads", "1", "--format", "ansi"]) == 0
    assert "nothing evicted: the prompt fits in N = 500" in capsys.readouterr().out
    # when the budget evicts, none of it is said
    assert main(["show", PROMPT, "--model", "tiny", "--policy", "h2o,tova", "--budget", "64", "--max-new-tokens",
                 "0", "--threads", "1", "--out", str(out)]) == 0
    assert "2 policies)" in capsys.readouterr().out
    assert "nothing evicted" not in out.read_text(encoding="utf-8")


def test_show_says_the_random_models_answers_are_noise_and_shows_them(capsys, tmp_path):
    out = tmp_path / "tiny.html"
    assert main(["show", PROMPT, "--model", "tiny", "--policy", "h2o", "--budget", "64", "--max-new-tokens", "4",
                 "--threads", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    page = out.read_text(encoding="utf-8")
    assert "These answers are from <strong>tiny</strong>, refkv's built-in random model" in page
    answers = page[page.index('<section class="answers">'):]
    answers = answers[:answers.index("</table>")]
    cells = re.findall(r"<tr><th>.*?</th>(<td[^>]*>.*?</td>)</tr>", answers)
    assert len(cells) == 2
    for cell in cells:  # every answer cell shows something: a mark, a letter, or "(empty ...)"
        text = re.sub(r"<[^>]+>", "", cell)
        assert text.strip(), cell


def test_visible_answer_marks_what_would_look_blank():
    assert visible_answer("\n" * 32) == '<span class="esc">\u23ce</span>' * 32
    assert visible_answer("a\tb\x00<") == 'a<span class="esc">\u21e5</span>b<span class="esc">\\x00</span>&lt;'
    assert visible_answer("   ") == '<span class="esc">\u2423</span>' * 3  # nothing but spaces
    assert visible_answer("two words") == "two words"  # spaces between words stay spaces


# -- the docs show the one spec, and what they show runs ---------------------------------------
def _doc_commands(pattern: str) -> list[tuple[str, str]]:
    """``(file, command)`` for every command matching ``pattern`` in the README and the docs."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    found = []
    for path in [root / "README.rst", *sorted((root / "docs").rglob("*.rst"))]:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(pattern, text, re.M):
            found.append((path.name, match.group(1)))
    return found


def test_the_docs_name_policies_by_spec_and_their_run_commands_work(capsys):
    """Every ``refkv run --policy ...`` the README and docs show runs (on tiny, one new token), and
    none uses the older ``--param`` where a spec says it in one word."""
    import shlex

    commands = _doc_commands(r"(?:``|\$ |^   )(refkv run --policy [^`\n]*?)(?:``|\s*#|$)")
    assert len(commands) >= 8, commands
    for name, command in commands:
        words = shlex.split(command)
        assert "--param" not in words, (name, command)
        assert main([*words[1:], "--new-tokens", "1", "--threads", "1"]) == 0, (name, command)
        capsys.readouterr()
