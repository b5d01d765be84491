"""Tokenizers: the byte-level BPE of a GGUF file (SmolLM2), its chat template, streaming.

:class:`Tokenizer` rebuilds the model's tokenizer from the GGUF fields
(``tokenizer.ggml.tokens``, ``merges``, ``token_type``, special ids, pre-tokenizer) with
the ``tokenizers`` library for encoding, and decodes with its own byte table, so a
token always maps to exact bytes (what streaming output needs).
:class:`ByteTokenizer` is the stand-in for the built-in random ``tiny`` model.

Notes
-----
**Byte-level BPE.** Every byte of the UTF-8 text is first written as one printable
character (GPT-2's table, :func:`byte_alphabet`: printable Latin-1 bytes stand for
themselves, the other 68 bytes for ``chr(256 + n)`` in byte order, so a space is
``"Ġ"``), then merges join adjacent symbols in priority order. Any UTF-8 text
can be written in this alphabet, and decoding the tokens' bytes gives it back exactly.

**Bytes without a token.** Byte-level BPE covers any text only if every byte is a
token. SmolLM2's vocabulary lacks 21 bytes: six ASCII controls (U+0004, U+0006,
U+0013, U+0014, U+0016, U+001D), the lead bytes 0xF1 and 0xF2 (code points
U+40000..U+BFFFF, the unassigned planes 4 to 11), and bytes that never occur in UTF-8
(0xC0, 0xC1, 0xF5..0xFF). The ``tokenizers`` library would silently drop such
characters; :meth:`Tokenizer.encode` raises ``ValueError`` naming them instead
(:meth:`Tokenizer.unencodable` lists them). All other text round-trips.

**Pre-tokenizer ``smollm``.** As llama.cpp defines it: every digit is its own piece
(``\\p{N}``), then GPT-2's split (contractions, ``" ?"`` + letters, ``" ?"`` +
numbers, ``" ?"`` + other symbols, whitespace runs). In ``tokenizers`` terms:
``Sequence([Digits(individual_digits=True), ByteLevel(add_prefix_space=False)])``.
``gpt2`` and ``default`` get plain GPT-2 splitting; other names (Llama 3's ``llama-bpe``,
``qwen2``, ...) are refused rather than split wrongly. A Hugging Face
checkpoint's ``tokenizer.json`` is used as it is (its own pre-tokenizer and normalizer:
Llama 3 and Qwen2 split numbers and text by their own rules).

**Special tokens.** Control tokens (GGUF token type 3, e.g. ``<|im_start|>``) are
registered as special: :meth:`Tokenizer.encode` with ``special=True`` turns their
text into the single id (what a chat template needs), with ``special=False`` (the
default) their text is ordinary text, so a user string can never inject a control
token. No BOS is prepended (``tokenizer.ggml.add_bos_token`` is false for SmolLM2;
when true, :meth:`Tokenizer.encode_chat` and ``encode(..., add_bos=True)`` add it).

**Stopping.** Generation stops at the EOS id (``<|im_end|>`` = 2 for the instruct
model) and also at ``<|endoftext|>`` (0), which ends a document in pre-training data.

**Chat template.** The GGUF holds a Jinja ChatML template; refkv renders ChatML itself
(no Jinja dependency): an optional default system turn (taken from the template text),
then ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
``<|im_start|>assistant\\n``. Tests compare it with the Jinja rendering.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Sequence
from functools import cache

import numpy as np

__all__ = [
    "ByteTokenizer",
    "StreamDecoder",
    "Tokenizer",
    "byte_alphabet",
]

CONTROL, USER_DEFINED = 3, 4
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# A default system turn written out as a literal in the template: "<|im_start|>system", a
# newline (a real one, or Jinja's backslash-n escape as Qwen2.5's tokenizer_config.json
# has it), then plain text up to "<|im_end|>". Text with quotes or braces is template code
# (Qwen3 builds its system turn from the messages) and is not taken for a default.
_DEFAULT_SYSTEM = re.compile(re.escape(IM_START) + r"system(?:\n|\\n)([^'\"{}\\]*?)" + re.escape(IM_END))


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character table of byte-level BPE (a bijection on 0..255).

    Bytes that are printable Latin-1 characters (``!``..``~``, ``¡``..``¬``,
    ``®``..``ÿ``) stand for themselves; the remaining 68 bytes (controls, space, DEL,
    NBSP, soft hyphen...) get ``chr(256 + n)`` in increasing byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table


class StreamDecoder:
    """Turn token ids into text as they arrive, holding back incomplete UTF-8.

    A character split across tokens (an emoji is 4 bytes; BPE may cut it) is printed
    once its last byte arrives; bytes that can never form valid UTF-8 become U+FFFD.

    Parameters
    ----------
    tokenizer : Tokenizer or ByteTokenizer
    """

    def __init__(self, tokenizer):
        self._bytes = tokenizer.token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        """Text completed by ``token`` (possibly empty)."""
        return self._utf8.decode(self._bytes(token))

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


class _Base:
    """What :class:`Tokenizer` and :class:`ByteTokenizer` share: decoding from token bytes."""

    vocab_size: int
    stop_ids: frozenset[int]

    def token_bytes(self, token: int) -> bytes:  # pragma: no cover - overridden
        raise NotImplementedError

    def _check_id(self, token) -> int:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < self.vocab_size:
            raise ValueError(f"token id must be an integer in [0, {self.vocab_size - 1}], got {token!r}")
        return int(token)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens appear as their text (``<|im_end|>``)."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def stream(self) -> StreamDecoder:
        """A :class:`StreamDecoder` for printing tokens as they are generated."""
        return StreamDecoder(self)


#: ``tokenizer.ggml.pre`` names whose splitting :class:`Tokenizer` rebuilds from GGUF fields.
GGUF_PRE_TOKENIZERS = ("smollm", "gpt2", "default")


class Tokenizer(_Base):
    """The byte-level BPE tokenizer described by a GGUF file.

    Parameters
    ----------
    vocab : refkv.model.gguf.GGUFVocab
        The ``tokenizer.ggml.*`` fields.
    backend : tokenizers.Tokenizer, optional
        The model's own ``tokenizers`` object (read from a checkpoint's ``tokenizer.json``):
        its normalizer, pre-tokenizer and BPE settings are then used as they are, which is
        what Llama 3's and Qwen2's own splitting rules need. Without it the backend is
        rebuilt from ``vocab`` (pre-tokenizer ``smollm`` or GPT-2).

    Raises
    ------
    ValueError
        If the vocabulary is not byte-level BPE (``tokenizer.ggml.model != "gpt2"``) or a
        normal token holds a character outside the byte alphabet.
    """

    def __init__(self, vocab, *, backend=None):
        if vocab.model != "gpt2":
            raise ValueError(f"tokenizer model {vocab.model!r} is not supported; refkv reads byte-level BPE "
                             f"('gpt2') vocabularies only")
        try:
            from tokenizers import AddedToken, decoders, models, pre_tokenizers
            from tokenizers import Tokenizer as Backend
        except ImportError as err:
            raise ModuleNotFoundError("the tokenizer needs the 'tokenizers' package: pip install tokenizers  "
                                      "(the 'models' extra: pip install -e '.[models]' in a checkout)") from err
        self.vocab = vocab
        self.vocab_size = len(vocab.tokens)
        types = np.asarray(vocab.token_types)
        self.special_ids = frozenset(int(i) for i in np.flatnonzero((types == CONTROL) | (types == USER_DEFINED)))
        self._bytes = self._token_bytes_table(vocab.tokens, self.special_ids)

        if backend is None and vocab.pre not in GGUF_PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre {vocab.pre!r} is not implemented: refkv rebuilds "
                             f"{', '.join(repr(p) for p in GGUF_PRE_TOKENIZERS)} splitting from GGUF fields, and "
                             f"others (Llama 3's 'llama-bpe', 'qwen2') split text differently; load the model's "
                             f"Hugging Face checkpoint directory instead (its tokenizer.json is used as it is)")
        if backend is None:  # rebuilt from the GGUF fields
            backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)},
                                         merges=list(vocab.merges), fuse_unk=False, byte_fallback=False))
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            if vocab.pre == "smollm":
                backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                                 byte_level])
            else:
                backend.pre_tokenizer = byte_level
            backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False)
                                    for i in sorted(self.special_ids)])
        self.backend = backend
        # Bytes the vocabulary has no token for: BPE would silently drop them.
        alphabet = byte_alphabet()
        present = set(vocab.tokens)
        self.missing_bytes = bytes(b for b in range(256) if alphabet[b] not in present)

        self.eos_id = vocab.eos_id
        self.bos_id = vocab.bos_id
        ids = {t: i for i, t in enumerate(vocab.tokens) if i in self.special_ids}
        self.stop_ids = frozenset(i for i in (vocab.eos_id, ids.get("<|endoftext|>")) if i is not None)
        self._im_start, self._im_end = ids.get(IM_START), ids.get(IM_END)
        template = vocab.chat_template or ""
        match = _DEFAULT_SYSTEM.search(template)
        self.default_system = match.group(1) if match else None

    @classmethod
    def from_gguf(cls, path) -> Tokenizer:
        """Read only the tokenizer fields of a GGUF file (no weights)."""
        from .gguf import GGUFError, read_gguf

        vocab = read_gguf(path, weights=False).vocab
        if vocab is None:
            raise GGUFError(f"{path} has no tokenizer fields (tokenizer.ggml.tokens)")
        return cls(vocab)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, pre={self.vocab.pre!r}, eos={self.eos_id})"

    @staticmethod
    def _token_bytes_table(tokens: Sequence[str], special: frozenset[int]) -> tuple[bytes, ...]:
        inverse = {c: b for b, c in byte_alphabet().items()}
        table = []
        for i, token in enumerate(tokens):
            if i in special:
                table.append(token.encode("utf-8"))
                continue
            try:
                table.append(bytes(inverse[c] for c in token))
            except KeyError as err:
                raise ValueError(f"token {i} ({token!r}) has a character outside the byte-level alphabet; "
                                 f"not a byte-level BPE vocabulary") from err
        return tuple(table)

    # -- encoding --------------------------------------------------------------------------
    def encode(self, text: str, *, special: bool = False, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``.

        Parameters
        ----------
        text : str
        special : bool
            If true, the text of a control token (``<|im_start|>``) becomes its id; if
            false it is encoded as ordinary characters.
        add_bos : bool
            Prepend the BOS id.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        bad = self.unencodable(text)
        if bad:
            raise ValueError(f"text contains characters this vocabulary cannot encode (it lacks a token for "
                             f"one of their UTF-8 bytes): {', '.join(f'U+{ord(c):04X}' for c in bad)}")
        # A setting of the backend, not an argument of its encode(): set it on every call.
        self.backend.encode_special_tokens = not special
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos=True but this vocabulary has no BOS token")
            ids = [self.bos_id, *ids]
        return ids

    def unencodable(self, text: str) -> list[str]:
        """The distinct characters of ``text`` whose UTF-8 bytes include a byte with no token."""
        data = _utf8(text)
        if len(data.translate(None, self.missing_bytes)) == len(data):
            return []
        missing = set(self.missing_bytes)
        return sorted({c for c in text if missing & set(c.encode("utf-8"))})

    def token_bytes(self, token: int) -> bytes:
        """The exact bytes token ``token`` stands for."""
        return self._bytes[self._check_id(token)]

    # -- chat ------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        """True when the vocabulary has ChatML's ``<|im_start|>`` / ``<|im_end|>`` tokens."""
        return self._im_start is not None and self._im_end is not None

    def render_chat(self, messages, *, add_generation_prompt: bool = True) -> str:
        """The ChatML text of a conversation.

        Parameters
        ----------
        messages : sequence of dict or str
            ``{"role": ..., "content": ...}`` dicts; a plain string is one user message.
        add_generation_prompt : bool
            End with ``<|im_start|>assistant\\n`` so the model writes the reply.
        """
        if not self.has_chat_template:
            raise ValueError("this vocabulary has no ChatML tokens (<|im_start|>, <|im_end|>); encode raw text")
        messages = _check_messages(messages)
        parts = []
        if messages and messages[0]["role"] != "system" and self.default_system is not None:
            parts.append(f"{IM_START}system\n{self.default_system}{IM_END}\n")
        parts += [f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages]
        if add_generation_prompt:
            parts.append(f"{IM_START}assistant\n")
        return "".join(parts)

    def encode_chat(self, messages, *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of :meth:`render_chat` (control tokens as single ids)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, special=True, add_bos=self.vocab.add_bos)


class ByteTokenizer(_Base):
    """UTF-8 bytes as token ids, for the built-in random model (``vocab_size >= 256``).

    Ids ``0..255`` are bytes; larger ids (never produced by :meth:`encode`) decode to
    ``<id>``. There is no EOS and no chat template.
    """

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"vocab_size must be >= 256 for byte tokens, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.stop_ids = frozenset()
        self.has_chat_template = False

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"

    def encode(self, text: str, *, special: bool = False, add_bos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` (``special`` and ``add_bos`` have no effect)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return list(_utf8(text))

    def token_bytes(self, token: int) -> bytes:
        token = self._check_id(token)
        return bytes([token]) if token < 256 else f"<{token}>".encode()


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"text must be valid Unicode; it has a lone surrogate at index {err.start}") from err


def _check_messages(messages) -> list[dict]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"} \
                or not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}] must be a dict with str 'role' and 'content', got {m!r}")
        if not m["role"] or any(c.isspace() for c in m["role"]):
            raise ValueError(f"messages[{i}]['role'] must be a non-empty word, got {m['role']!r}")
        out.append(m)
    return out
