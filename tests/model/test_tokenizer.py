"""Tokenizers: the byte table, SmolLM2's BPE against an independent pure-Python BPE, the
chat template against its Jinja source, streaming of split characters, byte tokens."""

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refkv.model import english_prose
from refkv.model.tokenizer import ByteTokenizer, StreamDecoder, byte_alphabet

# -- the byte table -------------------------------------------------------------------------


def test_byte_alphabet_is_gpt2s_table():
    table = byte_alphabet()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    # Printable ASCII and Latin-1 stand for themselves.
    assert table[ord("A")] == "A" and table[ord("~")] == "~" and table[0xE9] == "é"
    # The 68 others count up from chr(256) in byte order: 0x00 is the first, then 0x01...
    # the space (0x20) is the 33rd (after 0x00-0x1F), so chr(256 + 32) = "Ġ"; newline 0x0A -> "Ċ".
    assert table[0] == chr(256) and table[0x20] == "Ġ" and table[0x0A] == "Ċ"
    assert table[0x7F] == chr(256 + 33) and table[0xAD] == chr(256 + 67)


# -- an independent BPE ---------------------------------------------------------------------
# SmolLM2's vocabulary has no token for these bytes (see the tokenizer module's Notes).
NO_TOKEN = {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xF1, 0xF2}
encodable_text = st.text(st.characters(codec="utf-8").filter(lambda c: not set(c.encode()) & NO_TOKEN))

SMOLLM_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")


def reference_encode(text: str, vocab) -> list[int]:
    """Byte-level BPE written from its definition: split, map bytes, merge lowest rank first."""
    regex = pytest.importorskip("regex")
    ranks = {pair: r for r, pair in enumerate(vocab.merges)}
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    table = byte_alphabet()
    out = []
    for chunk in regex.split(r"(\p{N})", text):  # every digit alone (pre-tokenizer "smollm")
        for piece in regex.findall(SMOLLM_SPLIT, chunk):
            symbols = [table[b] for b in piece.encode("utf-8")]
            while len(symbols) > 1:
                pairs = [(ranks.get((a, b), np.inf), i) for i, (a, b) in enumerate(itertools.pairwise(symbols))]
                rank, i = min(pairs)
                if rank == np.inf:
                    break
                symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
            out += [ids[s] for s in symbols]
    return out


def test_encoding_matches_the_reference_bpe_on_english_prose(smollm2_tokenizer):
    text = english_prose(6000)
    assert smollm2_tokenizer.encode(text) == reference_encode(text, smollm2_tokenizer.vocab)


SAMPLES = [
    "Hello world!", "  leading spaces and trailing   ", "tabs\tand\nnewlines\n\n\n", "x = f(12345) + 0.5e-3",
    "it's, we're, they'll, I'd", "naïve café über", "日本語のテキスト", "emoji 😀🚀 ok", "Ünïcödé\u00a0nbsp",
    "<|im_start|> is plain text here", "mixed123abc456", "a\r\nb", "", " ", "\x00\x01 control",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_encoding_matches_the_reference_bpe_on_edge_cases(smollm2_tokenizer, text):
    assert smollm2_tokenizer.encode(text) == reference_encode(text, smollm2_tokenizer.vocab)


@given(encodable_text.map(lambda t: t[:60]))
def test_encoding_matches_the_reference_bpe_on_any_text(smollm2_tokenizer, text):
    assert smollm2_tokenizer.encode(text) == reference_encode(text, smollm2_tokenizer.vocab)


def test_missing_bytes_are_exactly_those_without_a_token(smollm2_tokenizer):
    tok = smollm2_tokenizer
    present = set(tok.vocab.tokens)
    without = {b for b, c in byte_alphabet().items() if c not in present}
    assert without == set(tok.missing_bytes)
    # Beyond NO_TOKEN only bytes that valid UTF-8 never contains.
    assert without - NO_TOKEN == {0xC0, 0xC1, *range(0xF5, 0x100)}


@pytest.mark.parametrize("text", ["a\x04b", "x\U00040000", "\x1d\x1d\x13"])
def test_text_with_a_byte_without_token_is_refused(smollm2_tokenizer, text):
    with pytest.raises(ValueError, match="cannot encode"):
        smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.unencodable(text) == sorted(set(text) - {"a", "b", "x"})


def test_lone_surrogates_are_refused(smollm2_tokenizer):
    with pytest.raises(ValueError, match="lone surrogate at index 1"):
        smollm2_tokenizer.encode("a\ud800")
    with pytest.raises(ValueError, match="lone surrogate"):
        ByteTokenizer(256).encode("\udfff")


def test_known_pieces(smollm2_tokenizer):
    tok = smollm2_tokenizer
    pieces = [tok.vocab.tokens[i] for i in tok.encode("Hello world!")]
    assert pieces == ["Hello", "Ġworld", "!"]
    assert [tok.vocab.tokens[i] for i in tok.encode("In 2024")] == ["In", "Ġ", "2", "0", "2", "4"]


# -- round trips ----------------------------------------------------------------------------
@given(encodable_text.map(lambda t: t[:200]))
def test_decode_inverts_encode(smollm2_tokenizer, text):
    assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text


@given(encodable_text.map(lambda t: t[:100]))
def test_decode_agrees_with_the_tokenizers_library(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == tok.backend.decode(ids, skip_special_tokens=False)


def test_round_trip_of_prose(smollm2_tokenizer):
    text = english_prose(20000)
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text
    assert len(text) / len(ids) > 3.5  # English BPE: about 4 characters per token


# -- special tokens -------------------------------------------------------------------------
def test_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.vocab.tokens[:3] == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert tok.eos_id == 2 and tok.stop_ids == {0, 2}
    assert tok.encode("<|im_end|>", special=True) == [2]
    plain = tok.encode("<|im_end|>")
    assert 2 not in plain and tok.decode(plain) == "<|im_end|>"
    assert tok.decode([1, 2]) == "<|im_start|><|im_end|>"
    assert tok.token_bytes(2) == b"<|im_end|>"


def test_bad_ids_and_inputs(smollm2_tokenizer):
    tok = smollm2_tokenizer
    for bad in (-1, tok.vocab_size, 1.0, True):
        with pytest.raises(ValueError, match="token id must be an integer in"):
            tok.token_bytes(bad)
    with pytest.raises(ValueError, match="text must be a str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="no BOS"):
        type(tok)(dataclasses.replace(tok.vocab, bos_id=None)).encode("x", add_bos=True)
    assert tok.encode("x", add_bos=True)[0] == tok.bos_id


# -- the chat template ----------------------------------------------------------------------
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Two\nlines"}],
    [],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_the_gguf_jinja_template(smollm2_tokenizer, messages, add_generation_prompt):
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(smollm2_tokenizer.vocab.chat_template)
    expected = template.render(messages=messages, add_generation_prompt=add_generation_prompt)
    got = smollm2_tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert got == expected


def test_chat_encoding(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode_chat("What is the capital of France?")
    text = tok.render_chat("What is the capital of France?")
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert ids == tok.encode(text, special=True)
    # Four control tokens per turn pair: system and user turns, then the open assistant turn.
    assert [i for i in ids if i in (1, 2)] == [1, 2, 1, 2, 1]
    assert tok.decode(ids) == text
    last_start = len(ids) - 1 - ids[::-1].index(1)
    assert tok.decode(ids[last_start:]) == "<|im_start|>assistant\n"


@pytest.mark.parametrize("bad", [[{"role": "user"}], [("user", "hi")], [{"role": "a b", "content": "x"}],
                                 [{"role": "user", "content": 3}]])
def test_bad_messages(smollm2_tokenizer, bad):
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        smollm2_tokenizer.render_chat(bad)


# -- streaming ------------------------------------------------------------------------------
def test_stream_holds_back_split_characters():
    tok = ByteTokenizer(512)
    stream = StreamDecoder(tok)
    pieces = [stream.feed(b) for b in "é😀".encode()]
    assert pieces == ["", "é", "", "", "", "😀"]
    assert stream.flush() == ""
    stream = tok.stream()
    assert stream.feed(0xF0) == "" and stream.flush() == "\ufffd"


@given(encodable_text.map(lambda t: t[:80]))
def test_streamed_text_equals_decoded_text(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    stream = tok.stream()
    pieces = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_real_tokens_can_split_a_character(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("😀")
    assert len(ids) > 1  # a rare emoji is not one token: its 4 bytes span tokens
    stream = tok.stream()
    assert [stream.feed(i) for i in ids][-1] == "😀"


# -- byte tokens for the random model -------------------------------------------------------
@given(st.text(max_size=50))
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer(512)
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text


def test_byte_tokenizer_details():
    tok = ByteTokenizer(512)
    assert tok.decode([300]) == "<300>" and not tok.has_chat_template and tok.stop_ids == frozenset()
    with pytest.raises(ValueError, match=">= 256"):
        ByteTokenizer(100)
    with pytest.raises(ValueError, match=r"\[0, 511\]"):
        tok.decode([512])


def test_tokenizer_refuses_other_models(smollm2_tokenizer):
    from refkv.model.tokenizer import Tokenizer

    vocab = smollm2_tokenizer.vocab
    with pytest.raises(ValueError, match="'llama' is not supported"):
        Tokenizer(dataclasses.replace(vocab, model="llama"))


def test_tokenizer_from_a_small_gguf(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from test_gguf import write_gguf

    from refkv.model import Tokenizer, load_with_tokenizer

    path = tmp_path / "small.gguf"
    write_gguf(path)
    tok = Tokenizer.from_gguf(path)
    # The three merges of the small vocabulary: "Ġ t" -> "Ġt", "h e" -> "he", "Ġt he" -> "Ġthe".
    assert [tok.vocab.tokens[i] for i in tok.encode("the the")] == ["t", "he", "Ġthe"]
    model, tok2 = load_with_tokenizer(path)
    assert tok2.encode("hi there") == tok.encode("hi there") and model.config.vocab_size == 262
    assert tok.default_system is None  # no chat template in this file
    assert tok.render_chat("x") == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(("template", "expected"), [
    # SmolLM2's GGUF template: a real newline inside the Jinja string literal
    ("{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}", "You are SmolLM"),
    # Qwen2.5's tokenizer_config.json: Jinja's backslash-n escape
    ("{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>"
     "\\n' }}", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    # Qwen3: the system turn is built from the messages, there is no default text
    ("{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}", None),
])
def test_default_system_turn_is_read_from_the_template(smollm2_tokenizer, template, expected):
    from refkv.model import Tokenizer

    tok = Tokenizer(dataclasses.replace(smollm2_tokenizer.vocab, chat_template=template))
    assert tok.default_system == expected
