"""The model's tokenizer: `tokenizers` for text ↔ ids, plus BOS/EOS policy and the chat template.

Loaded from a model directory's tokenizer.json + tokenizer_config.json (+ chat_template.jinja),
the files every Hugging Face / mlx-community checkpoint ships. Runtime code must not depend on
transformers, so the parts of its behaviour that matter (added tokens from the config, template
selection, special-token variables for the template) are reproduced here.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import tokenizers

from model.text.chat_template import ChatTemplate, TemplateError
from model.text.detokenizer import StreamingDetokenizer, TextStream, detokenizer_kind, make_detokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# The named special tokens transformers hands to chat templates as variables.
_TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_THINK_START, _THINK_END = "<think>", "</think>"
# Above this many characters `encode` goes through the GIL-releasing batch call.
GIL_FREE_ENCODE_CHARS = 4096


def _token_text(value: Any) -> str | None:
    # tokenizer_config writes special tokens either as a string or as an AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    file = path / TOKENIZER_FILE
    if not file.is_file():
        raise ValueError(f"{file}: tokenizer file not found (only tokenizer.json is supported)")
    try:
        return tokenizers.Tokenizer.from_str(file.read_text(encoding="utf-8"))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{file}: not a valid tokenizer.json ({' '.join(str(exc).split())})") from None


def _load_config(path: Path) -> dict[str, Any]:
    file = path / TOKENIZER_CONFIG_FILE
    if not file.is_file():
        # Some checkpoints ship tokenizer.json alone; everything below then has defaults.
        return {}
    config = _read_json(file)
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return config


def _add_configured_tokens(backend: tokenizers.Tokenizer, config: Mapping[str, Any]) -> None:
    # transformers registers added_tokens_decoder entries missing from tokenizer.json; so must we,
    # or such a token would be split into pieces instead of matching as one id.
    missing = []
    for entry in (config.get("added_tokens_decoder") or {}).values():
        content = _token_text(entry)
        if content is None or backend.token_to_id(content) is not None:
            continue
        missing.append(
            tokenizers.AddedToken(
                content,
                single_word=bool(entry.get("single_word", False)),
                lstrip=bool(entry.get("lstrip", False)),
                rstrip=bool(entry.get("rstrip", False)),
                normalized=bool(entry.get("normalized", not entry.get("special", False))),
                special=bool(entry.get("special", False)),
            )
        )
    if missing:
        backend.add_tokens(missing)


def _load_chat_template(path: Path, config: Mapping[str, Any]) -> ChatTemplate | dict[str, ChatTemplate] | None:
    # As in transformers, a chat_template.jinja file takes priority over the config's entry:
    # newer checkpoints keep the template there and may leave a stale copy in the config.
    file = path / CHAT_TEMPLATE_FILE
    if file.is_file():
        return ChatTemplate(file.read_text(encoding="utf-8"))
    source = config.get("chat_template")
    if isinstance(source, str):
        return ChatTemplate(source)
    if isinstance(source, list):
        named = {
            item["name"]: ChatTemplate(item["template"])
            for item in source
            if isinstance(item, Mapping) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)
        }
        return named or None
    return None


def read_template_file(path: Path | str) -> ChatTemplate:
    """The Jinja chat template in `path` (`--chat-template`). Raises ValueError (one line) for a
    file that cannot be read or does not compile."""
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {path}: cannot be read ({exc})") from None
    try:
        return ChatTemplate(source)
    except TemplateError as exc:
        raise ValueError(f"--chat-template {path}: {exc}") from None


def with_template_file(tokenizer: ChatTokenizer, path: Path | str) -> ChatTokenizer:
    """`tokenizer` rendering the template in `path` instead of the model's own. Raises ValueError
    as `read_template_file`, or for a tokenizer that cannot take another template."""
    template = read_template_file(path)
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError("--chat-template: this tokenizer cannot take another chat template")
    return tokenizer.with_chat_template(template)


class ChatTokenizer(Protocol):
    """What the API layer asks of a tokenizer: `Tokenizer` below, and the tests' doubles
    (tests/fakes.py), which mypy checks against it. `vocab_size` None: no known bound on ids."""

    eos_token_ids: frozenset[int]

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def has_thinking(self) -> bool: ...

    @property
    def has_chat_template(self) -> bool: ...

    def id_to_token(self, token_id: int) -> str: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def detokenizer(self) -> TextStream: ...

    def chat_template(self, *, tools: Sequence[Any] | None = None) -> ChatTemplate: ...

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str: ...

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]: ...


class Tokenizer:
    """Text ↔ token ids for one model, with its BOS/EOS policy and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        config: Mapping[str, Any] | None = None,
        chat_template: ChatTemplate | Mapping[str, ChatTemplate] | None = None,
        decoder: Mapping[str, Any] | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        config = dict(config or {})
        self._backend = backend
        self._templates: dict[str, ChatTemplate] = (
            dict(chat_template)
            if isinstance(chat_template, Mapping)
            else ({"default": chat_template} if chat_template else {})
        )
        self._template_tokens = {
            name: text for name in _TEMPLATE_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None
        }
        self.bos_token: str | None = self._template_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(self.bos_token) if self.bos_token else None
        eos_token = self._template_tokens.get("eos_token")
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        # mlx-lm adds the tokenizer's eos only when config.json/generation_config.json name
        # none; we always take the union, since a chat model must also stop on its template's
        # end-of-turn token even when config lists only <|endoftext|> (and vice versa).
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids) | ({eos_id} if eos_id is not None else set())
        self._detokenizer_kind = detokenizer_kind(decoder)
        self._detokenizer_prototype: StreamingDetokenizer | None = None

    @classmethod
    def from_dir(cls, path: Path, *, eos_token_ids_from_config: Iterable[int] = ()) -> Tokenizer:
        """Load a model directory's tokenizer; `eos_token_ids_from_config` are the ids the model
        loader found in config.json and generation_config.json."""
        path = Path(path)
        backend = _load_backend(path)
        config = _load_config(path)
        _add_configured_tokens(backend, config)
        decoder = json.loads(backend.to_str()).get("decoder")
        return cls(
            backend,
            config=config,
            chat_template=_load_chat_template(path, config),
            decoder=decoder,
            eos_token_ids=eos_token_ids_from_config,
        )

    # -- vocabulary ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary piece (e.g. "Ġworld", "▁world", "<0xE4>")."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        return piece

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def vocab(self) -> dict[str, int]:
        """Every piece and its id, added tokens included (a copy: two models share a tokenizer
        when these are equal)."""
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def has_thinking(self) -> bool:
        return self.token_to_id(_THINK_START) is not None and self.token_to_id(_THINK_END) is not None

    # -- text ↔ ids ----------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. A text that already starts with the BOS string (templates often
        write it) does not get a second BOS from the post-processor."""
        if len(text) > GIL_FREE_ENCODE_CHARS:
            # `encode` holds the GIL for the whole text; `encode_batch` releases it, so a large
            # prompt tokenized on a worker thread does not stall the event loop (same ids).
            ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if (
            add_special_tokens
            and bos is not None
            and text.startswith(self.bos_token or "")
            and len(ids) >= 2
            and ids[0] == bos
            and ids[1] == bos
        ):
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self) -> StreamingDetokenizer:
        """A fresh streaming detokenizer for one request."""
        if self._detokenizer_prototype is None:
            # The piece table is the expensive part (one entry per id); copies share it.
            pieces = [self._backend.id_to_token(i) or "" for i in range(self.vocab_size)]
            self._detokenizer_prototype = make_detokenizer(
                self._detokenizer_kind,
                pieces,
                decode=lambda ids: self.decode(ids),
                encode=lambda text: self.encode(text, add_special_tokens=False),
            )
        detokenizer = copy.copy(self._detokenizer_prototype)
        detokenizer.reset()
        return detokenizer

    # -- chat ----------------------------------------------------------------------------------

    @property
    def template_tokens(self) -> dict[str, str]:
        """The special-token variables (bos_token, eos_token, ...) templates are rendered with."""
        return dict(self._template_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def with_chat_template(self, template: ChatTemplate) -> Tokenizer:
        """This tokenizer rendering `template` instead of its own (`--chat-template`), for every
        conversation, with or without tools."""
        replaced = copy.copy(self)
        replaced._templates = {"default": template}
        return replaced

    def chat_template(self, *, tools: Sequence[Any] | None = None) -> ChatTemplate:
        """The template transformers would pick: "tool_use" when tools are given and one exists,
        else "default", else the first named one."""
        if not self._templates:
            raise ValueError("this model has no chat template (tokenizer_config.json or chat_template.jinja)")
        if tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        return self._templates.get("default") or next(iter(self._templates.values()))

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text; `template_kwargs` (enable_thinking, ...) reach the template as
        variables and override the special-token variables."""
        variables = {**self._template_tokens, **template_kwargs}
        return self.chat_template(tools=tools).render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=True)
