"""The docs' sample CLI output is a real run, so it cannot go stale.

A page shows a command in a ``console`` block (``$ refkv ...``) and what it printed in the
``text`` block right after it, marked ``:class: sample-output``. Here every such pair is
run again on the real model and the printed lines compared, with what changes from run
to run (times, the thread choice, progress lines) masked as in the quick start's test
(``tests/test_cli.py``).
"""

import pathlib
import re
import shlex

import pytest
from test_cli import _sample_lines

from refkv.cli import main

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
#: Pages whose sample outputs are checked here (the quick start has its own test).
PAGES = [DOCS / "guide" / "real-model.rst"]

_BLOCK = re.compile(r"^\.\. code-block:: (\w+)\n((?:   :.*\n)*)\n((?:(?:   .*)?\n)+)", re.M)


def samples(page: pathlib.Path) -> list[tuple[str, list[str]]]:
    """``(command, printed lines)`` for each sample-output block of ``page``: the command is
    the last ``$ `` line of the console block just before it."""
    blocks = [(m.group(1), m.group(2), [line[3:] for line in m.group(3).rstrip("\n").split("\n")])
              for m in _BLOCK.finditer(page.read_text(encoding="utf-8"))]
    found = []
    for previous, (language, options, lines) in zip([None, *blocks], blocks):
        if ":class: sample-output" not in options:
            continue
        assert language == "text" and previous is not None and previous[0] == "console", \
            f"{page.name}: a sample output must follow the console block of its command"
        commands = [line[2:] for line in previous[2] if line.startswith("$ ")]
        assert commands and commands[-1].startswith("refkv "), previous[2]
        found.append((commands[-1], lines))
    return found


def test_samples_are_found():
    """The parser finds the pages' samples (so the test below cannot pass by finding none)."""
    found = samples(PAGES[0])
    assert [command.split('"')[1] for command, _ in found] == ["What is the capital of France?",
                                                              "Name three rivers in Europe."]
    assert all(lines[0] == "loading smollm2 ..." for _, lines in found)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_sample_output_is_a_real_run(page, smollm2, smollm2_tokenizer, capsys, monkeypatch):
    import refkv.model.loading as loading

    monkeypatch.setattr(loading, "load_with_tokenizer", lambda name, dtype=None: (smollm2, smollm2_tokenizer))
    for command, shown in samples(page):
        assert main([*shlex.split(command)[1:], "--threads", "1"]) == 0
        out, err = capsys.readouterr()
        err_lines = err.splitlines()
        # As a terminal shows it: "loading ..." first, then the streamed answer, then the statistics.
        ran = _sample_lines("\n".join([err_lines[0], *out.splitlines(), *err_lines[1:]]))
        assert _sample_lines("\n".join(shown)) == ran, command
