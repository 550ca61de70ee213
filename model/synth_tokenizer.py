"""Write small, real, deterministic tokenizer directories (tokenizer.json + tokenizer_config.json).

Test fixtures, the synthetic model writer and the embedded demo model all need a tokenizer that
behaves like the ones users bring: a GPT-2/Qwen byte-level BPE or a llama/mistral
SentencePiece-style BPE with byte fallback, plus a chat template. Training on an embedded corpus
(instead of downloading one) keeps the result identical on every machine and every run.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

KINDS = ("bpe", "spm")
TEMPLATES = ("chatml", "llama3")
MIN_VOCAB_SIZE = 300
MAX_VOCAB_SIZE = 8000

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.",
    "Every morning he walked down to the harbour, checked his nets, and talked with the other sailors.",
    "Hello! How are you today? I'm fine, thank you. What would you like to talk about?",
    "The weather is lovely this afternoon; let's go for a walk in the park and have some tea.",
    "Language models predict the next token given the previous tokens in the sequence.",
    "Please summarise the following paragraph in two sentences, keeping the key facts.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    'for i in range(10):\n    print(f"value {i} = {i * i}")\n',
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n        return f'Point({self.x}, {self.y})'\n",
    "import json\nwith open('data.json') as fh:\n    data = json.load(fh)\n",
    "function add(a, b) {\n  return a + b;\n}\nconsole.log(add(2, 3));\n",
    "SELECT name, age FROM users WHERE age > 21 ORDER BY name;",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"type": "function", "function": {"name": "search", "description": "Search the web", '
    '"parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}',
    '[{"id": 1, "ok": true, "score": 0.75}, {"id": 2, "ok": false, "score": null}]',
    "Café, naïve, façade, résumé, jalapeño, Straße, smörgåsbord, crème brûlée, déjà vu.",
    "El niño comió una manzana. ¿Dónde está la biblioteca? Ça va très bien, merci.",
    "Привет, как дела? Москва — столица России.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "日本語のテキストも少し含めます。東京は日本の首都です。",
    "한국어 문장도 있습니다. 안녕하세요!",
    "Emoji: 😀 🎉 🚀 👍🏽 ❤️ 🇫🇷 — and symbols: € £ ¥ © ® ™ ° ± × ÷ → ∞.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 2025-01-31 12:30:45",
    "<think>\nLet me reason about this step by step.\n</think>\n\nThe answer is 42.",
    "User: What is the capital of France?\nAssistant: The capital of France is Paris.",
]

_SYLLABLES = (
    "ba be bi bo bu ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu ra re ri ro ru "
    "sa se si so su ta te ti to tu va ve vi vo vu za ze zi zo zu an en in on un ar er ir or ur "
    "st tr pl gr th sh ch qu"
).split()


def _synthetic_words(count: int) -> list[str]:
    # The embedded prose alone runs out of merges long before an 8000-token vocab; a seeded
    # generator supplies enough distinct words without making the result machine-dependent.
    rng = random.Random(1234)
    lines = []
    for _ in range(count // 12 + 1):
        words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 5))) for _ in range(12)]
        lines.append(" ".join(words))
    return lines


def _training_corpus(vocab_size: int) -> list[str]:
    extra = _synthetic_words(max(0, vocab_size - 200) * 2)
    return _CORPUS * 4 + extra


# -- special tokens per template ------------------------------------------------------------

_CHATML_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]
_LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
_SPM_CORE_SPECIALS = ["<unk>", "<s>", "</s>"]

# `<think>` style markers are ordinary text to Qwen's tokenizer (special=False), which is why
# they survive skip_special_tokens; the chat control tokens are special.
_NON_SPECIAL_MARKERS = {"<think>", "</think>", "<tool_call>", "</tool_call>"}


def _template_specials(template: str) -> list[str]:
    return list(_CHATML_SPECIALS if template == "chatml" else _LLAMA3_SPECIALS)


# -- chat templates ---------------------------------------------------------------------------

CHATML_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role != "system" %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if tools is not none and tools %}
    {%- set system_message = (system_message + "\\n\\n" if system_message else "") + "You have access to the following functions:\\n\\n" %}
    {%- for t in tools %}
        {%- set system_message = system_message + (t | tojson(indent=4)) + "\\n\\n" %}
    {%- endfor %}
{%- endif %}
{%- if system_message %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role in ['user', 'system'] %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- if message.content %}
            {{- message.content | trim }}
        {%- endif %}
        {%- for tool_call in message.tool_calls | default([]) %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {{- '{"name": "' + call.name + '", "parameters": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role in ['tool', 'ipython'] %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
        {%- if message.content is mapping or message.content is iterable and message.content is not string %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


# -- builders ---------------------------------------------------------------------------------


def _build_byte_level_bpe(vocab_size: int, template: str) -> Tokenizer:
    specials = _template_specials(template)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=specials,
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(vocab_size), trainer)
    tok = _mark_markers_non_special(tok)
    if template == "llama3":
        # Real Llama-3 tokenizers add BOS in the post-processor while their template also writes
        # it: the reason encode() must de-duplicate.
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
                ),
            ]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _build_sentencepiece_bpe(vocab_size: int, template: str) -> Tokenizer:
    specials = _SPM_CORE_SPECIALS + [t for t in _template_specials(template) if t not in _SPM_CORE_SPECIALS]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    # Train with word splitting so no piece spans a word boundary (as sentencepiece pieces don't),
    # then ship the unsplit Metaspace real llama/mistral tokenizer.json files use.
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    n_pieces = max(vocab_size - len(specials) - len(byte_tokens), 8)
    corpus = _training_corpus(n_pieces + 256)
    alphabet = _frequent_characters(corpus, min(120, n_pieces))
    trainer = trainers.BpeTrainer(
        vocab_size=n_pieces,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        min_frequency=1,
        show_progress=False,
    )
    trainer_tok.train_from_iterator(corpus, trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    pieces = sorted(trained["vocab"].items(), key=lambda kv: kv[1])

    vocab: dict[str, int] = {}
    for token in specials[:3] + byte_tokens:
        vocab[token] = len(vocab)
    for piece, _ in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(specials)
    tok = _mark_markers_non_special(tok)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def _frequent_characters(corpus: Sequence[str], limit: int) -> list[str]:
    # A small alphabet leaves rare characters (emoji, most CJK) to the <0xNN> byte fallback. The
    # trainer's own limit_alphabet breaks frequency ties in hash order, so pick them here, sorted.
    counts: dict[str, int] = {}
    for line in corpus:
        for ch in line.replace(" ", "▁"):
            counts[ch] = counts.get(ch, 0) + 1
    counts["▁"] = max(counts.values()) + 1
    return sorted(counts, key=lambda ch: (-counts[ch], ch))[:limit]


def _mark_markers_non_special(tok: Tokenizer) -> Tokenizer:
    # tokenizers' API cannot flip `special` on an added token; a JSON round trip keeps the ids
    # while matching Qwen's flags.
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        if entry["content"] in _NON_SPECIAL_MARKERS:
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(data))


def _token_config(template: str, kind: str) -> dict[str, str | None]:
    # The BOS named here must be the one the post-processor adds, or de-duplication can't work.
    if template == "llama3":
        bos = "<s>" if kind == "spm" else "<|begin_of_text|>"
        return {"bos_token": bos, "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>"}
    bos = "<s>" if kind == "spm" else None
    return {"bos_token": bos, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def _added_tokens_decoder(tok: Tokenizer) -> dict[str, dict]:
    data = json.loads(tok.to_str())
    return {
        str(entry["id"]): {
            "content": entry["content"],
            "lstrip": entry["lstrip"],
            "normalized": entry["normalized"],
            "rstrip": entry["rstrip"],
            "single_word": entry["single_word"],
            "special": entry["special"],
        }
        for entry in data["added_tokens"]
    }


def write_tokenizer_files(
    path: Path,
    *,
    kind: str = "bpe",
    vocab_size: int = 512,
    template: str = "chatml",
    extra_added_tokens: Sequence[str] = (),
) -> None:
    """Write tokenizer.json and tokenizer_config.json into `path` (created if missing).

    `vocab_size` is the size of the trained vocabulary including special tokens; each of
    `extra_added_tokens` is appended as one added, non-special token on top of it.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {KINDS}")
    if template not in TEMPLATES:
        raise ValueError(f"unknown chat template {template!r}; expected one of {TEMPLATES}")
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}], got {vocab_size}")

    tok = (
        _build_byte_level_bpe(vocab_size, template) if kind == "bpe" else _build_sentencepiece_bpe(vocab_size, template)
    )
    new_extras = [t for t in dict.fromkeys(extra_added_tokens) if tok.token_to_id(t) is None]
    if new_extras:
        tok.add_tokens(new_extras)

    config = {
        **_token_config(template, kind),
        "add_bos_token": kind == "spm" or template == "llama3",
        "add_eos_token": False,
        "added_tokens_decoder": _added_tokens_decoder(tok),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHATML_TEMPLATE if template == "chatml" else LLAMA3_TEMPLATE,
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
