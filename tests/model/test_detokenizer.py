"""Streaming detokenizers: exact full-decode text, and mlx-lm's segments token by token."""

from __future__ import annotations

import json
import random

import pytest
from _tok_helpers import SAMPLE_TEXTS, make_tokenizer_dir
from mlx_lm.tokenizer_utils import load as mlx_lm_load

from model.text.detokenizer import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
    detokenizer_kind,
)
from model.text.tokenizer import Tokenizer

MULTIBYTE_TEXTS = [
    "Café naïve façade — crème brûlée, déjà vu, Ærøskøbing.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "日本語のテキスト、東京は日本の首都です。한국어 문장도 있습니다!",
    "Emoji 😀🎉🚀 👍🏽 ❤️ 🇫🇷 👨‍👩‍👧‍👦 🦄🧪 done",
    "Mixed: Привет 東京 Straße ∞ → ± ½ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "code:\n```python\nprint('héllo 🌍')\n```\n",
    "trailing spaces   \n  and  double  spaces ",
    "<|im_start|>assistant\n<think>\n思考中…\n</think>\n\n答案 ✅<|im_end|>",
]


@pytest.fixture(scope="module", params=["bpe", "spm"])
def tok_dir(request, tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp(request.param), kind=request.param, vocab_size=700)


def _stream(detokenizer, ids):
    segments = []
    for token in ids:
        detokenizer.add_token(token)
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    segments.append(detokenizer.last_segment)
    return segments


def _expected_stream_text(full_decode: str) -> str:
    # mlx-lm drops one leading space of a generation; our detokenizers keep that rule.
    return full_decode[1:] if full_decode.startswith(" ") else full_decode


def test_streaming_reproduces_full_decode_of_multibyte_text(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    split_characters = 0
    for text in MULTIBYTE_TEXTS + SAMPLE_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        segments = _stream(tok.detokenizer(), ids)
        assert "".join(segments) == _expected_stream_text(tok.decode(ids)), text
        # Only whole characters are ever emitted.
        assert not any("\ufffd" in s for s in segments), text
        split_characters += sum(1 for i in ids if "\ufffd" in tok.decode([i]))
    # The texts really do split characters across byte tokens, so holding back was exercised.
    assert split_characters > 20


def test_every_intermediate_text_is_a_stable_prefix(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    text = "".join(MULTIBYTE_TEXTS)
    ids = tok.encode(text, add_special_tokens=False)
    final = _expected_stream_text(tok.decode(ids))
    detokenizer = tok.detokenizer()
    for token in ids:
        detokenizer.add_token(token)
        assert final.startswith(detokenizer.text)
    detokenizer.finalize()
    assert detokenizer.text == final
    assert detokenizer.tokens == ids


def _mlx_lm_segments(path, ids):
    wrapper = mlx_lm_load(path)
    return _stream(wrapper.detokenizer, ids), type(wrapper._detokenizer).__name__


def test_segments_equal_mlx_lm_token_by_token(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    for text in MULTIBYTE_TEXTS + SAMPLE_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        ours = _stream(tok.detokenizer(), ids)
        reference, reference_class = _mlx_lm_segments(tok_dir, ids)
        assert ours == reference, text
        assert type(tok.detokenizer()).__name__ == reference_class


def test_segments_equal_mlx_lm_for_random_token_sequences(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    # Byte 0 ("Ā" in byte-level BPE) is the one place we deliberately differ: mlx-lm turns it
    # into "Ā", we decode it as NUL like the full decode (tested separately).
    usable = [i for i in range(tok.vocab_size) if "Ā" not in tok.id_to_token(i) and tok.id_to_token(i) != "<0x00>"]
    rng = random.Random(7)
    sequences = [[rng.choice(usable) for _ in range(rng.randint(1, 40))] for _ in range(60)]
    wrapper = mlx_lm_load(tok_dir)
    for ids in sequences:
        assert _stream(tok.detokenizer(), ids) == _stream(wrapper.detokenizer, ids), ids


def test_chat_output_with_special_tokens_matches_mlx_lm(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    text = tok.render_chat(
        [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "wörld 🌍", "reasoning_content": "ok"}],
        add_generation_prompt=False,
    )
    ids = tok.encode(text, add_special_tokens=False)
    ours = _stream(tok.detokenizer(), ids)
    assert ours == _mlx_lm_segments(tok_dir, ids)[0]
    assert "<|im_start|>" in "".join(ours) and "<think>" in "".join(ours)


def test_nul_byte_decodes_like_full_decode(tmp_path):
    tok = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, kind="bpe"))
    ids = tok.encode("a\x00b", add_special_tokens=False)
    assert "".join(_stream(tok.detokenizer(), ids)) == tok.decode(ids) == "a\x00b"


def test_bpe_lone_space_waits_for_next_token(tmp_path):
    tok = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, kind="bpe"))
    space = tok.token_to_id("Ġ")
    word = tok.encode("hello", add_special_tokens=False)
    detokenizer = tok.detokenizer()
    for token in word:
        detokenizer.add_token(token)
    assert detokenizer.last_segment == "hello"
    detokenizer.add_token(space)
    assert detokenizer.last_segment == ""
    detokenizer.add_token(word[0])
    assert detokenizer.last_segment == " " + tok.decode(word[:1])


def test_bpe_out_of_vocab_id_streams_like_mlx_lm(tmp_path):
    path = make_tokenizer_dir(tmp_path, kind="bpe")
    tok = Tokenizer.from_dir(path)
    ids = tok.encode("hi", add_special_tokens=False) + [tok.vocab_size + 5]
    assert _stream(tok.detokenizer(), ids) == _mlx_lm_segments(path, ids)[0]


def test_detokenizers_are_independent_per_request(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    first, second = tok.detokenizer(), tok.detokenizer()
    a = tok.encode("première réponse", add_special_tokens=False)
    b = tok.encode("第二个回答 🎉", add_special_tokens=False)
    # Interleave the two requests' tokens, as a batch of rows would.
    for i in range(max(len(a), len(b))):
        if i < len(a):
            first.add_token(a[i])
        if i < len(b):
            second.add_token(b[i])
    first.finalize()
    second.finalize()
    assert first.text == "première réponse" and first.tokens == a
    assert second.text == "第二个回答 🎉" and second.tokens == b


def test_reset_clears_state(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    detokenizer = tok.detokenizer()
    for token in tok.encode("你好", add_special_tokens=False):
        detokenizer.add_token(token)
    detokenizer.reset()
    assert detokenizer.text == "" and detokenizer.tokens == [] and detokenizer.last_segment == ""


def _rewrite_decoder(path, decoder):
    file = path / "tokenizer.json"
    data = json.loads(file.read_text())
    data["decoder"] = decoder
    file.write_text(json.dumps(data, ensure_ascii=False))


def test_spm_decoder_without_strip_keeps_leading_space(tmp_path):
    path = make_tokenizer_dir(tmp_path, kind="spm")
    decoder = json.loads((path / "tokenizer.json").read_text())["decoder"]
    decoder["decoders"] = decoder["decoders"][:3]
    _rewrite_decoder(path, decoder)
    tok = Tokenizer.from_dir(path)
    detokenizer = tok.detokenizer()
    assert isinstance(detokenizer, SPMStreamingDetokenizer) and not detokenizer.trim_space
    ids = tok.encode("héllo 你好 😀", add_special_tokens=False)
    ours = _stream(detokenizer, ids)
    assert ours == _mlx_lm_segments(path, ids)[0]
    assert "".join(ours) == tok.decode(ids) == " héllo 你好 😀"


def test_unrecognised_decoder_falls_back_to_naive_like_mlx_lm(tmp_path):
    path = make_tokenizer_dir(tmp_path, kind="bpe")
    _rewrite_decoder(
        path,
        {
            "type": "Sequence",
            "decoders": [{"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}],
        },
    )
    tok = Tokenizer.from_dir(path)
    assert isinstance(tok.detokenizer(), NaiveStreamingDetokenizer)
    wrapper = mlx_lm_load(path)
    for text in MULTIBYTE_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        ours = _stream(tok.detokenizer(), ids)
        assert ours == _stream(wrapper.detokenizer, ids), text
        assert "".join(ours) == tok.decode(ids)


def test_detokenizer_kind_follows_mlx_lm_rule(tmp_path):
    bpe = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, "bpe", kind="bpe"))
    spm = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, "spm", kind="spm"))
    assert isinstance(bpe.detokenizer(), BPEStreamingDetokenizer)
    assert isinstance(spm.detokenizer(), SPMStreamingDetokenizer) and spm.detokenizer().trim_space
    assert detokenizer_kind(None) == "naive"
    assert detokenizer_kind({"type": "WordPiece", "prefix": "##", "cleanup": True}) == "naive"
    spm_decoder = json.loads((tmp_path / "spm" / "tokenizer.json").read_text())["decoder"]
    altered = json.loads(json.dumps(spm_decoder))
    altered["decoders"][3]["start"] = 2
    assert detokenizer_kind(spm_decoder) == "spm"
    assert detokenizer_kind(altered) == "naive"
