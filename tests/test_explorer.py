"""refkv show, the eviction explorer (refkv/explorer.py): page content, counts, offline, CLI errors."""

import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest

from refkv.cli import main
from refkv.engine import Engine
from refkv.explorer import KEPT, explore, highlight_tokens, render_ansi, render_html, token_pieces
from refkv.model import load_with_tokenizer
from refkv.policies.spec import make_policy, parse_spec_list

#: Characters HTML must escape, a non-ASCII letter, a newline and text that looks like a placeholder.
PROMPT = ("The pass key is 48151. <b>Remember</b> it & \"quote\" 'it'. {{DATA}} caf\u00e9\n"
          + "The grass is green. The sky is blue. " * 5)
SPECS = ["h2o", "keydiff", "snapkv:window=8", "tova", "hashevict"]


@pytest.fixture(scope="module")
def tiny():
    return load_with_tokenizer("tiny")


@pytest.fixture(scope="module")
def result(tiny):
    model, tokenizer = tiny
    tokens = tokenizer.encode(PROMPT)
    return explore(model, tokenizer, tokens, SPECS, budget=48, block=16, max_new_tokens=3,
                   highlights=["48151", "sky"], command="refkv show <test> & more", notes=["a <note>"])


class _Page(HTMLParser):
    """Collects every token span's text per text block, checks that tags nest, and lists
    every attribute value that could load something."""

    VOID = frozenset({"meta", "br", "img", "input", "link", "hr", "col", "wbr", "source"})

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.errors, self.texts, self.loads = [], [], {}, []
        self.block = None
        self.token = None
        self.scripts = []
        self.in_script = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("src", "href", "action", "data", "poster"):
            if name in attrs:
                self.loads.append(attrs[name])
        if tag == "link" or (tag == "script" and "src" in attrs):
            self.loads.append(f"<{tag}>")
        if tag == "script":
            self.in_script = True
            self.scripts.append("")
        if tag not in self.VOID:
            self.stack.append(tag)
        if tag == "div" and attrs.get("class") == "text":
            self.block = attrs["id"]
            self.texts[self.block] = []
        if tag == "span" and self.block and "t" in attrs.get("class", "").split():
            self.token = int(attrs["data-i"])
            self.texts[self.block].append([self.token, ""])

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()
        if tag == "script":
            self.in_script = False
        if tag == "span":
            self.token = None
        if tag == "div" and self.block and "div" not in self.stack[-3:]:
            self.block = None

    def handle_data(self, data):
        if self.in_script:
            self.scripts[-1] += data
        elif self.token is not None:
            self.texts[self.block][-1][1] += data


def _parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page)
    parser.close()
    return parser


def test_page_is_valid_html_with_every_token_escaped(result):
    page = render_html(result)
    assert page.startswith("<!DOCTYPE html>")
    parsed = _parse(page)
    assert parsed.errors == [] and parsed.stack == []
    assert len(parsed.texts) == len(SPECS)  # one text per policy, side by side
    for spans in parsed.texts.values():
        assert [i for i, _ in spans] == list(range(len(result.pieces)))  # every token, in order
        # the text as parsed (entities decoded) is each token's text exactly
        assert [text for _, text in spans] == [p if p else "\u200b" for p in result.pieces]
    assert "".join(result.pieces) == PROMPT  # and the pieces are the prompt
    assert "<b>" not in page and "</b>" not in page and "&lt;" in page and "&amp;" in page  # escaped
    assert "refkv show &lt;test&gt; &amp; more" in page and "a &lt;note&gt;" in page
    assert page.count("{{") == 0 or "{{DATA}}" in "".join(result.pieces)
    # the data block is JSON that the page's script reads, and it closes no tag early
    data = json.loads(parsed.scripts[0])
    assert "</" not in parsed.scripts[0]
    assert len(data["runs"]) == len(SPECS) and data["n_blocks"] == result.n_blocks


def test_no_remote_resource(result):
    page = render_html(result)
    parsed = _parse(page)
    assert all(not re.match(r"\s*(https?:)?//", value) for value in parsed.loads), parsed.loads
    assert "<link" not in page and "<script src" not in page
    assert not re.search(r"url\(\s*['\"]?\s*(https?:)?//", page)
    assert not re.search(r"""(src|href)\s*=\s*['"]?\s*(https?:)?//""", page)
    assert "http://" not in page and "https://" not in page
    assert "@import" not in page


def test_kept_counts_match_the_engines_trace(tiny, result):
    model, tokenizer = tiny
    tokens = tokenizer.encode(PROMPT)
    page_data = json.loads(_parse(render_html(result)).scripts[0])
    for spec, run, shown in zip(SPECS, result.runs, page_data["runs"]):
        engine = Engine(model, make_policy(spec), 48, record=True)
        engine.prefill(tokens, 16)
        final = engine.trace.kept[result.n_blocks - 1]
        decisions = np.array(shown["decisions"])
        for layer, positions in enumerate(final):
            for head, row in enumerate(positions):
                assert np.array_equal(np.flatnonzero(run.kept[layer, head]), row)
                assert np.array_equal(np.flatnonzero(decisions[layer, head] == KEPT), row)
        # every token evicted at block b was offered at an eviction of block b and not kept
        for event in engine.trace.evictions:
            for head in range(event.positions.shape[0]):
                dropped = np.setdiff1d(event.positions[head], event.kept_positions[head])
                assert (run.decisions[event.layer, head, dropped] == event.block).all()
        assert np.allclose(run.kept_fraction, run.kept.mean(axis=(0, 1)))
        assert (run.kept.sum(axis=2) == 48).all()  # N per layer and KV head


def test_scores_rank_the_last_eviction(result):
    """At each layer's last eviction, every unprotected kept token scores at least as high as
    every unprotected token that eviction dropped (ties go to the later token)."""
    for run in result.runs:
        for layer in range(result.n_layers):
            last = run.last_block[layer]
            assert last >= 0
            for head in range(result.n_kv_heads):
                free = ~run.protected[layer, head]
                kept = run.scores[layer, head][run.kept[layer, head] & free]
                dropped = run.scores[layer, head][(run.decisions[layer, head] == last) & free]
                assert len(dropped) > 0 and np.isfinite(dropped).all()
                unscored = np.flatnonzero(run.kept[layer, head] & np.isnan(run.scores[layer, head]))
                if make_policy(run.spec).evict_before_attention:  # the block arrives after its eviction
                    assert (unscored >= last * result.block).all()
                    kept = kept[np.isfinite(kept)]
                else:
                    assert len(unscored) == 0
                assert kept.min(initial=np.inf) >= dropped.max(), (run.spec, layer, head)


def test_highlights_cover_exactly_the_matching_tokens(tiny, result):
    _, tokenizer = tiny
    pieces = result.pieces
    for text, tokens in result.highlights:
        joined = "".join(pieces[i] for i in tokens)
        assert text in joined
        for i in tokens:  # each token overlaps an occurrence
            start = sum(len(p) for p in pieces[:i])
            assert any(m.start() < start + len(pieces[i]) and start < m.end()
                       for m in re.finditer(re.escape(text), "".join(pieces)))
    assert len(result.highlights[1][1]) == 5 * len("sky")  # byte tokens: 5 occurrences
    with pytest.raises(ValueError, match="does not occur"):
        highlight_tokens(pieces, "no such text")
    # a character split over byte tokens goes with the token that completes it
    split = token_pieces(tokenizer, tokenizer.encode("caf\u00e9"))
    assert split == ["c", "a", "f", "", "\u00e9"]
    assert highlight_tokens(split, "\u00e9") == [4]


def test_ansi_has_one_line_per_policy(result):
    text = render_ansi(result)
    lines = text.splitlines()
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in lines]
    for run in result.runs:
        row = next(line for line in plain if line.startswith(run.label + ": "))
        assert row[len(run.label) + 2:] == "".join(result.pieces).replace("\n", "\u23ce")
    assert sum(line.startswith("answer, ") for line in plain) == len(SPECS) + 1
    # kept tokens, and only they, get a background
    first = next(line for line in lines if line.startswith("\x1b[1m" + result.runs[0].label))
    assert first.count("48;5;") >= 1


def test_parse_spec_list():
    assert parse_spec_list("h2o,caote:base=snapkv,fast=True,tova") == ["h2o", "caote:base=snapkv,fast=True", "tova"]
    assert parse_spec_list(" h2o , snapkv:window=8,kernel=3") == ["h2o", "snapkv:window=8,kernel=3"]
    for bad, message in (("h2o,,tova", "empty item"), ("window=8,h2o", "follows no"), ("nope", "unknown policy"),
                         ("", "non-empty")):
        with pytest.raises(ValueError, match=message):
            parse_spec_list(bad)


def test_show_writes_a_page_and_ansi(tmp_path, capsys):
    out = tmp_path / "page" / "show.html"
    argv = ["show", PROMPT, "--model", "tiny", "--policy", "h2o,snapkv:window=8", "--budget", "48", "--block",
            "16", "--highlight", "48151", "--max-new-tokens", "2", "--threads", "1", "--out", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out and out.as_uri() in captured.out
    page = out.read_text(encoding="utf-8")
    assert "snapkv(window=8" in page and "--highlight 48151" in page
    assert [p.name for p in out.parent.iterdir()] == ["show.html"]  # no temporary file left
    assert captured.err.splitlines()[1:4] == [f"run {i} of 3: {label}, 258 prompt tokens ..." for i, label in
                                              ((1, "h2o(recent=None, form='paper')"),
                                               (2, "snapkv(window=8, kernel=7, pooling='avg', form='paper')"),
                                               (3, "no eviction"))]
    assert main([*argv[:-2], "--format", "ansi"]) == 0
    text = capsys.readouterr().out
    assert "\x1b[" in text and "answer, no eviction" in text


def test_show_passkey_highlights_the_needle(tmp_path, capsys):
    out = tmp_path / "passkey.html"
    assert main(["show", "--passkey", "300", "--key", "12345", "--model", "tiny", "--policy", "keydiff",
                 "--budget", "64", "--block", "32", "--max-new-tokens", "0", "--threads", "1",
                 "--out", str(out)]) == 0
    assert "[1 run in " in capsys.readouterr().err  # no answers asked for: no no-eviction run
    page = out.read_text(encoding="utf-8")
    assert "The pass key is 12345. Remember it." in page
    assert 'class="t hl"' in page


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0"], "--budget must be"),
    (["--block", "-1"], "--block must be"),
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--policy", "h2o,,tova"], "empty item"),
    (["--policy", "full"], "never evicts"),
    (["--policy", "hashevict", "--budget", "16", "--block", "32"], "--block must be <="),
    (["--highlight", "not in the prompt"], "does not occur in the prompt"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be"),
    (["--example"], "exactly one of"),
    (["--passkey", "300"], "exactly one of"),
])
def test_show_bad_input_is_one_line_exit_2(argv, message, capsys, tmp_path):
    out = tmp_path / "never.html"
    code = main(["show", "some words here to look at", "--model", "tiny", "--out", str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("refkv: error: ") and message in err[-1]
    assert "Traceback" not in "\n".join(err)
    assert not out.exists()


def test_show_notes_a_prompt_that_fits(tmp_path, capsys):
    assert main(["show", "short prompt", "--model", "tiny", "--policy", "h2o", "--budget", "64", "--out",
                 str(tmp_path / "fits.html"), "--max-new-tokens", "0", "--threads", "1"]) == 0
    assert "note: the prompt's 12 tokens fit in --budget 64: nothing is evicted" in capsys.readouterr().err


def test_show_reads_the_prompt_before_loading_the_model(capsys, monkeypatch, tmp_path):
    import refkv.model.loading as loading

    monkeypatch.setattr(loading, "load_with_tokenizer", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["show", "--prompt-file", str(tmp_path / "missing.txt"), "--model", "tiny"]) == 2
    assert "--prompt-file" in capsys.readouterr().err
    assert main(["show", "   ", "--model", "tiny"]) == 2
    assert "must not be empty" in capsys.readouterr().err
    assert main(["show", "bad \udc80 byte", "--model", "tiny"]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--passkey", "10"], "--passkey must be"),
    (["--passkey", "300", "--key", "7"], "--key must be"),
    (["--passkey", "300", "--depth", "2"], "--depth must be in [0, 1]"),
    ([], "exactly one of"),
])
def test_show_bad_prompt_sources(argv, message, capsys):
    assert main(["show", "--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_docstring_examples_run():
    import doctest

    import refkv.explorer

    result = doctest.testmod(refkv.explorer, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_the_quick_start_show_commands_parse():
    """Every ``refkv show`` command of the quick start names options that exist, with valid values."""
    import pathlib
    import shlex

    from refkv.cli import build_parser

    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "guide" / "quickstart.rst").read_text(
        encoding="utf-8")
    commands = re.findall(r"^    (refkv show .*)$", page, re.M)
    assert len(commands) >= 2
    for command in commands:
        args = build_parser().parse_args(shlex.split(command)[1:])  # SystemExit on an unknown option
        assert parse_spec_list(args.policy)


@pytest.mark.skipif(not __import__("shutil").which("chromium"), reason="needs a headless chromium")
def test_the_script_selects_the_head_in_the_address(result, tmp_path):
    """In a real browser (headless chromium, offline), ``#layer=1&head=0&mode=score`` selects that
    head: each policy's line names it and its kept count, and the cell is marked."""
    import subprocess

    page = tmp_path / "page.html"
    page.write_text(render_html(result), encoding="utf-8")
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--virtual-time-budget=3000", "--dump-dom",
                          page.as_uri() + "#layer=1&head=0&mode=score"],
                         capture_output=True, text=True, timeout=120).stdout
    for index, run in enumerate(result.runs):
        kept = int(run.kept[1, 0].sum())
        assert re.search(rf'id="sel-{index}">layer 1, KV head 0: {kept} kept; last eviction at block '
                         rf'{run.last_block[1]}<', dom)
    assert dom.count('class="cell on"') == len(result.runs)
    assert "scores at the layer's last eviction" in dom


#: Measures the page in the browser: words of policy labels split across lines, and the size of
#: the grid's cells. Written into the DOM, which ``--dump-dom`` returns.
_MEASURE = """<script>
window.addEventListener("load", function () {
  var split = [];
  document.querySelectorAll("h3, .answers th").forEach(function (el) {
    var walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT), node;
    while ((node = walker.nextNode())) {
      var re = /[^\\s,]+/g, m;
      while ((m = re.exec(node.data))) {
        var range = document.createRange();
        range.setStart(node, m.index); range.setEnd(node, m.index + m[0].length);
        var tops = {};
        Array.prototype.forEach.call(range.getClientRects(), function (r) { tops[Math.round(r.top)] = 1; });
        if (Object.keys(tops).length > 1) { split.push(m[0]); }
      }
    }
  });
  var cells = Array.prototype.map.call(document.querySelectorAll("td.cell"), function (c) {
    var r = c.getBoundingClientRect(); return [r.width, r.height];
  });
  var lines = Array.prototype.map.call(document.querySelectorAll("h3"), function (h) {
    return Math.round(h.getBoundingClientRect().height);
  });
  var out = document.createElement("pre"); out.id = "measured";
  out.textContent = JSON.stringify({split: split, cells: cells, h3: lines});
  document.body.appendChild(out);
});
</script>"""


@pytest.mark.skipif(not __import__("shutil").which("chromium"), reason="needs a headless chromium")
def test_labels_never_break_inside_a_word_and_cells_are_large_targets(result, tmp_path):
    """In a narrow window (labels must wrap), no word of a policy label is split across lines
    ("metric='cos" / "ine'" was), and every grid cell is at least 16 x 22 px, gaps included."""
    import html
    import json
    import subprocess

    page = tmp_path / "narrow.html"
    page.write_text(render_html(result).replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--window-size=360,900", "--virtual-time-budget=3000",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    measured = json.loads(html.unescape(re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S).group(1)))
    assert max(measured["h3"]) > 1.5 * min(measured["h3"])  # some label did wrap: the check means something
    assert measured["split"] == []
    n_cells = len(result.runs) * result.n_layers * result.n_kv_heads
    assert len(measured["cells"]) == n_cells
    assert min(w for w, _ in measured["cells"]) >= 16 and min(h for _, h in measured["cells"]) >= 22
