"""Streaming detokenizers: turn one token id at a time into stable text.

They reproduce mlx-lm's `tokenizer_utils` detokenizers segment for segment, so streamed output
is the same bytes the reference server sends. Text is only emitted once it can no longer change:
incomplete UTF-8 sequences and a trailing lone space are held back until the next token.

One detokenizer serves one request; `Tokenizer.detokenizer()` makes a fresh one each time while
the per-vocab token map is built once and shared.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

_SPM_SPACE = "\u2581".encode("utf-8")
# mlx-lm's stand-in for ids past the tokenizer's vocab (models often pad their embedding).
_OUT_OF_VOCAB_PIECE = "!"


class TextStream(Protocol):
    """What the text pipeline asks of a detokenizer (api/pipeline/sink.py): a token in, the
    stable text since the last read out, and a flush at the end."""

    def add_token(self, token: int) -> None: ...

    @property
    def last_segment(self) -> str: ...

    def finalize(self) -> None: ...


class StreamingDetokenizer(abc.ABC):
    """Interface: add_token() per id, read last_segment for new text, finalize() at the end.

    After finalize(), `text` equals the tokenizer's full decode of `tokens`.
    """

    text: str
    tokens: list[int]
    offset: int

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop all streaming state."""

    @abc.abstractmethod
    def add_token(self, token: int) -> None:
        """Consume one token id."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Flush any text held back waiting for more tokens."""

    @property
    def last_segment(self) -> str:
        """The stable text produced since the previous read."""
        text = self.text
        segment = text[self.offset :]
        self.offset = len(text)
        return segment


class NaiveStreamingDetokenizer(StreamingDetokenizer):
    """Works with any tokenizer by re-decoding the tokens of the current line (O(line²))."""

    def __init__(self, decode: Callable[[list[int]], str], encode: Callable[[str], list[int]]) -> None:
        self._decode = decode
        # Some decoders delete the space before punctuation; then a trailing space may vanish
        # once the next token arrives, so it must be held back.
        self._clean_spaces = " ," not in decode(encode("a ,b"))
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self.tokens = []
        self._text = ""
        self._current_tokens: list[int] = []
        self._current_text = ""

    def add_token(self, token: int) -> None:
        self._current_tokens.append(token)
        self.tokens.append(token)

    def finalize(self) -> None:
        self._text += self._decode(self._current_tokens)
        self._current_tokens = []
        self._current_text = ""

    @property
    def text(self) -> str:  # type: ignore[override]
        if self._current_tokens:
            self._current_text = self._decode(self._current_tokens)
            if self._current_text.endswith("\ufffd"):
                # An incomplete character can decode to several replacement characters.
                self._current_text = self._current_text.rstrip("\ufffd")
            elif self._clean_spaces and self._current_text and self._current_text[-1] == " ":
                self._current_text = self._current_text[:-1]
        if self._current_text and self._current_text[-1] == "\n":
            self._text += self._current_text
            self._current_tokens.clear()
            self._current_text = ""
        return self._text + self._current_text


class SPMStreamingDetokenizer(StreamingDetokenizer):
    """SentencePiece style: ▁ is a space and <0xNN> pieces are raw bytes."""

    def __init__(self, pieces: Sequence[str], *, trim_space: bool = True) -> None:
        self.trim_space = trim_space
        self._byte_pieces = spm_piece_bytes(pieces)
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self._unflushed = b""
        self.text = ""
        self.tokens = []

    def _try_flush(self, force: bool = False) -> None:
        text = self._unflushed.replace(_SPM_SPACE, b" ").decode("utf-8", "replace")
        if not force and text.endswith("\ufffd"):
            return
        if not self.text and self.trim_space and text and text[0] == " ":
            text = text[1:]
        self.text += text
        self._unflushed = b""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        # mlx-lm would fail on an id past the vocab; a padded embedding row decodes to nothing.
        self._unflushed += self._byte_pieces[token] if 0 <= token < len(self._byte_pieces) else b""
        self._try_flush()

    def finalize(self) -> None:
        self._try_flush(force=True)
        self._unflushed = b""


def spm_piece_bytes(pieces: Sequence[str]) -> list[bytes]:
    return [bytes([int(p[3:5], 16)]) if p.startswith("<0x") else p.encode("utf-8") for p in pieces]


@functools.lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable-character → byte table (the inverse of its bytes_to_unicode)."""
    char_to_byte: dict[str, int] = {}
    limits = [0, ord("!"), ord("~") + 1, ord("¡"), ord("¬") + 1, ord("®"), ord("ÿ") + 1]
    n = 0
    for i, (start, stop) in enumerate(zip(limits, limits[1:])):
        if i % 2 == 0:
            for b in range(start, stop):
                char_to_byte[chr(2**8 + n)] = b
                n += 1
        else:
            for b in range(start, stop):
                char_to_byte[chr(b)] = b
    return char_to_byte


class BPEStreamingDetokenizer(StreamingDetokenizer):
    """GPT-2/Qwen byte-level BPE: each piece character stands for one byte."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self._pieces = pieces
        self.reset()

    def reset(self) -> None:
        self.offset = 0
        self._unflushed = ""
        self.text = ""
        self.tokens = []

    @staticmethod
    def _decode_bytes(seq: str) -> str:
        byte_decoder = byte_level_decoder()
        buffer = bytearray()
        for ch in seq:
            # Characters outside the table come from added tokens (<|im_end|>), which are
            # their own literal text. mlx-lm tests the byte for truthiness, turning NUL into
            # "Ā"; we compare with None so NUL decodes as the full decode does.
            value = byte_decoder.get(ch)
            if value is not None:
                buffer.append(value)
            else:
                buffer.extend(ch.encode("utf-8"))
        return buffer.decode("utf-8", "replace")

    def _maybe_trim_space(self, current_text: str) -> str:
        # The very first leading space is dropped, as mlx-lm does.
        if current_text and current_text[0] == " " and not self.text:
            return current_text[1:]
        return current_text

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        piece = self._pieces[token] if 0 <= token < len(self._pieces) else _OUT_OF_VOCAB_PIECE
        self._unflushed += piece
        text = self._decode_bytes(self._unflushed)
        # Wait for multi-byte characters to complete, and hold a lone space until the next
        # token (mlx-lm's rule, kept so segment boundaries match).
        is_lone_space = len(piece) == 1 and byte_level_decoder().get(piece) == 32
        if not text.endswith("\ufffd") and not is_lone_space:
            self.text += self._maybe_trim_space(text)
            self._unflushed = ""

    def finalize(self) -> None:
        self.text += self._maybe_trim_space(self._decode_bytes(self._unflushed))
        self._unflushed = ""


# -- choosing a detokenizer from tokenizer.json's `decoder` ------------------------------------

_SPM_DECODER_STEPS = [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
]
_SPM_STRIP_STEP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}


def _same(a: Any, b: Any) -> bool:
    # Strict structural equality (1 == True must not match), as mlx-lm's _match.
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return len(a) == len(b) and all(k in b and _same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def detokenizer_kind(decoder: Mapping[str, Any] | None) -> str:
    """ "spm", "spm_no_trim", "bpe" or "naive", by mlx-lm's rule."""
    spm = {"type": "Sequence", "decoders": _SPM_DECODER_STEPS + [_SPM_STRIP_STEP]}
    spm_no_trim = {"type": "Sequence", "decoders": list(_SPM_DECODER_STEPS)}
    if decoder is None:
        return "naive"
    if _same(spm, decoder):
        return "spm"
    if _same(spm_no_trim, decoder):
        return "spm_no_trim"
    if isinstance(decoder, dict) and decoder.get("type") == "ByteLevel":
        return "bpe"
    return "naive"


def make_detokenizer(
    kind: str,
    pieces: Sequence[str],
    decode: Callable[[list[int]], str],
    encode: Callable[[str], list[int]],
) -> StreamingDetokenizer:
    if kind == "bpe":
        return BPEStreamingDetokenizer(pieces)
    if kind == "spm":
        return SPMStreamingDetokenizer(pieces, trim_space=True)
    if kind == "spm_no_trim":
        return SPMStreamingDetokenizer(pieces, trim_space=False)
    return NaiveStreamingDetokenizer(decode, encode)
