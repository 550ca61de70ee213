"""Structured-output grammars, enforced per row by llguidance (docs/structured-outputs.md).

A `Constraint` (model/engine/params.py, plain data) becomes an llguidance grammar string
(`grammar_text`, cached, no tokenizer needed: the API side validates requests with it), then a
matcher bound to the model's tokenizer (`GrammarCompiler.matcher`, on the GPU-worker thread; the
compiled matcher is cached per constraint and each row gets a deep copy). The API keeps a
compiler of its own (`compiler_for_tokenizer`) to reject, when the request arrives, a constraint
that does not compile or can match nothing (`GrammarCompiler.check`). Per row, a
`RowGrammar` consumes the row's tokens in order and fills the allowed-token mask the sampler
applies after the logits processors. Once the grammar can accept nothing more, the mask allows
only EOS, so the row ends with finish "stop". A matcher that fails mid-generation (a rejected
token, an engine limit hit deep in the grammar) ends its row with finish "error" instead
(model/engine/decoding.py `record`): its text so far is no valid output.

Nothing here imports MLX; the sampler (model/engine/sampling.py) turns masks into arrays.
llguidance is optional: without it `available()` is False, no compiler is built and constrained
requests are served unconstrained with a Warning header (api/structured.py). Tests simulate its
absence by setting the module's `_ll` to None.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from model.engine.params import Constraint
from model.text import tool_grammar
from model.text.tool_grammar import TOOL_FORMATS

__all__ = ["TOOL_FORMATS", "GrammarCompiler", "GrammarError", "RowGrammar", "grammar_text", "validate"]

if TYPE_CHECKING:
    from model.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

COMPILED_CACHE_SIZE = 128
PROBE_STEPS = 4  # tokens `GrammarCompiler.check` walks into a grammar

# JSON is generated compact, with OpenAI's separators: no free whitespace means a model cannot
# pad forever between tokens, and output matches json.dumps. A schema's own "x-guidance" options
# override these (llguidance applies defaults → x-guidance → overrides).
JSON_DEFAULTS = tool_grammar.JSON_DEFAULTS


def _import_engine() -> ModuleType | None:
    try:
        import llguidance
    except ImportError:  # an optional dependency
        return None
    return llguidance


_ll = _import_engine()  # llguidance, or None when it is not installed


class GrammarError(ValueError):
    """The constraint does not compile; the message is the engine's."""


def available() -> bool:
    return _ll is not None


def _engine() -> ModuleType:
    if _ll is None:
        raise GrammarError("no grammar engine installed (pip install llguidance)")
    return _ll


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar for a constraint (no tokenizer involved). Raises GrammarError."""
    return _grammar_text(constraint, frozenset())


@functools.lru_cache(maxsize=512)
def _grammar_text(constraint: Constraint, specials: frozenset[tuple[str, int]]) -> str:
    # `specials`: (marker, id) for markers that are one special token in the model's vocabulary;
    # grammars must name those by id (<[id]>), since a special token does not match its text.
    ll = _engine()
    M = ll.LLMatcher
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if kind == "json_schema":
            schema = json.loads(spec) if spec else {"type": "object"}
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be an object")
            options = {**JSON_DEFAULTS, "lenient": not constraint.strict}
            return M.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return M.grammar_from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choices must be a non-empty array of strings")
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if kind == "grammar":
            return ll.grammar_from("grammar", spec)  # EBNF / GBNF, or Lark as is
        if kind == "lark":
            return M.grammar_from_lark(spec)
        if kind == "tool_call":
            lark = tool_grammar.tool_call_lark(json.loads(spec), specials, strict=constraint.strict)
            return M.grammar_from_lark(lark)
    except GrammarError:
        raise
    except tool_grammar.ToolGrammarError as exc:
        raise GrammarError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise GrammarError(f"invalid JSON: {exc}") from None
    except Exception as exc:  # llguidance raises ValueError / bare Exception with its message
        raise GrammarError(str(exc)) from None
    raise GrammarError(f"unknown constraint kind {kind!r}")


def tool_markers(spec: str) -> tuple[str, ...]:
    """A tool_call constraint's markers (model/text/tool_grammar.py `tool_markers`)."""
    return tool_grammar.tool_markers(json.loads(spec))


@functools.lru_cache(maxsize=512)
def _validation(constraint: Constraint) -> str:
    try:
        grammar = grammar_text(constraint)
    except GrammarError as exc:
        return str(exc) or "invalid grammar"
    return _engine().LLMatcher.validate_grammar(grammar)


def validate(constraint: Constraint) -> None:
    """Raise GrammarError (the engine's message) if the constraint cannot compile."""
    message = _validation(constraint)
    if message:
        raise GrammarError(message.strip())


class GrammarCompiler:
    """Binds grammars to one model's tokenizer. Lives on the GPU-worker thread."""

    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        ll = _engine()
        self.eos_token_ids = sorted(set(eos_token_ids))
        if not self.eos_token_ids:
            raise GrammarError("the model has no EOS token: a finished grammar could not end the row")
        self.tokenizer = ll.LLTokenizer(tokenizer_json, n_vocab=vocab_size or None, eos_token=self.eos_token_ids)
        self.vocab_size = self.tokenizer.vocab_size
        self.mask_words = (self.vocab_size + 31) // 32
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._checked: OrderedDict[Constraint, str | None] = OrderedDict()  # `check`'s verdicts
        self._lengths: np.ndarray | None = None
        self._lock = threading.Lock()
        self.compiles = 0  # cache misses, for tests and /stats

    @classmethod
    def from_model_dir(cls, path: Path | str, *, vocab_size: int, eos_token_ids: Iterable[int]) -> GrammarCompiler:
        # The same tokenizer the API encodes with: tokenizer.json plus tokenizer_config's added tokens.
        from model.text.tokenizer import _add_configured_tokens, _load_backend, _load_config

        path = Path(path)
        backend = _load_backend(path)
        _add_configured_tokens(backend, _load_config(path))
        backend.no_padding()
        backend.no_truncation()
        vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
        return cls(backend.to_str(), vocab_size=vocab, eos_token_ids=eos_token_ids)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> GrammarCompiler:
        """A compiler over the API's own tokenizer (the backend it encodes with)."""
        spec = json.loads(tokenizer._backend.to_str())
        spec["padding"] = spec["truncation"] = None  # as from_model_dir: whole texts, never padded
        return cls(json.dumps(spec), vocab_size=tokenizer.vocab_size, eos_token_ids=tokenizer.eos_token_ids)

    def check(self, constraint: Constraint) -> None:
        """Compile the constraint and run it a few tokens deep, as a row would: raises
        GrammarError if it does not compile, can match no text, or exceeds the engine's limits
        on the way. The matcher builds its lexer lazily, so a counted repetition like
        `b{99999}` only blows past the limits once a token enters it: the walk takes the longest
        allowed token at each step (the deepest way in) for `PROBE_STEPS` steps. A grammar
        that fails deeper still fails its row (finish "error")."""
        with self._lock:
            if constraint in self._checked:
                message = self._checked[constraint]
                if message is None:
                    return
                raise GrammarError(message)
        try:
            self._probe(constraint)
            message = None
        except GrammarError as exc:
            message = str(exc)
        with self._lock:  # failures too: a client retrying a bad grammar does not rebuild it
            self._checked[constraint] = message
            while len(self._checked) > COMPILED_CACHE_SIZE:
                self._checked.popitem(last=False)
        if message is not None:
            raise GrammarError(message)

    def _probe(self, constraint: Constraint) -> None:
        row = RowGrammar(self.compile(constraint).deep_copy(), self, warn=False)
        lengths = self._token_lengths()
        for _ in range(PROBE_STEPS):
            allowed = row.mask(lengths.shape[0])
            if row.failed:
                raise GrammarError(f"the grammar cannot match any text ({row.failure})")
            candidates = np.flatnonzero(allowed & (lengths > 0))
            if candidates.size == 0:
                return  # only EOS (or nothing) can follow: the grammar is complete
            row.observe(row.consumed, int(candidates[np.argmax(lengths[candidates])]))
            if row.failed:
                raise GrammarError(f"the grammar exceeds the grammar engine's limits ({row.failure})")

    def _token_lengths(self) -> np.ndarray:
        """Bytes per token id (0 for special tokens), computed once."""
        if self._lengths is None:
            tok = self.tokenizer
            self._lengths = np.array(
                [0 if tok.is_special_token(i) else len(tok.decode_bytes([i])) for i in range(self.vocab_size)],
                dtype=np.int64,
            )
        return self._lengths

    def compile(self, constraint: Constraint) -> Any:
        """A fresh matcher for the constraint (cached; callers deep-copy it)."""
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
                return compiled
        matcher = _engine().LLMatcher(self.tokenizer, self._grammar(constraint), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error().strip())
        with self._lock:
            self.compiles += 1
            self._compiled[constraint] = matcher
            while len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def _grammar(self, constraint: Constraint) -> str:
        specials: set[tuple[str, int]] = set()
        if constraint.kind == "tool_call":
            for marker in tool_markers(constraint.spec):
                ids = self.tokenizer.tokenize_str(marker, parse_special=True)
                if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
                    specials.add((marker, ids[0]))
        return _grammar_text(constraint, frozenset(specials))

    def matcher(self, constraint: Constraint) -> RowGrammar:
        return RowGrammar(self.compile(constraint).deep_copy(), self)


def compiler_for_tokenizer(tokenizer: Any) -> GrammarCompiler | None:
    """`GrammarCompiler.from_tokenizer`, or None (no engine, or a tokenizer it cannot read)."""
    from model.text.tokenizer import Tokenizer

    if not available() or not isinstance(tokenizer, Tokenizer):
        return None
    try:
        return GrammarCompiler.from_tokenizer(tokenizer)
    except Exception as exc:  # the worker's compiler fails the same way and logs it
        log.debug("no request-time grammar compiler (%s)", exc, exc_info=True)
        return None


def make_compiler(model_dir: Path | str, *, vocab_size: int, eos_token_ids: Iterable[int]) -> GrammarCompiler | None:
    """The worker's compiler, or None (engine missing/disabled, or a tokenizer it cannot read):
    never fails model start-up."""
    if not available():
        return None
    try:
        return GrammarCompiler.from_model_dir(model_dir, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
    except Exception as exc:  # a degraded feature, not a crash: one warning line, no traceback
        log.warning("grammar engine unavailable for %s (%s): constraints will not be enforced", model_dir, exc)
        log.debug("grammar engine start-up failure", exc_info=True)
        return None


class RowGrammar:
    """One row's matcher: consumes the row's tokens in order and produces its next-token mask.

    The engine reads tokens one step late (pipelined decode), so tokens arrive through
    `observe(index, token)`, keyed by position: the same token may be reported more than once,
    and a position already consumed is ignored.
    """

    def __init__(self, matcher: Any, compiler: GrammarCompiler, *, warn: bool = True) -> None:
        self._m = matcher
        self._warn = warn  # log a rejected token (a request-time probe expects them)
        self._compiler = compiler
        self._words = np.zeros(compiler.mask_words, dtype=np.int32)
        self._prefilled: np.ndarray | None = None  # set by fill_masks, used once by mask_words
        self.consumed = 0  # tokens consumed so far (positions 0 .. consumed-1)
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        """No token but EOS can follow (grammar complete, or the matcher failed)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def failed(self) -> bool:
        """The matcher hit an error (a rejected token, a limit) and allows only EOS from here."""
        return bool(self._m.is_error())

    @property
    def failure(self) -> str:
        """The first line of the matcher's error ("" when it has none)."""
        error = self._m.get_error() or ""
        return error.strip().splitlines()[0] if error.strip() else ""

    def observe(self, index: int, token: int) -> None:
        if index < self.consumed:
            return
        if index > self.consumed:
            raise RuntimeError(f"grammar row skipped tokens: expected position {self.consumed}, got {index}")
        self.consumed += 1
        self._prefilled = None
        if self._m.is_stopped():
            return  # EOS (or a token computed ahead after the end): nothing left to match
        if not self._m.consume_token(int(token)) and self.error is None:
            # Only reachable if a disallowed token was sampled; the matcher then allows only EOS.
            self.error = self._m.get_error().strip().splitlines()[0] if self._m.get_error() else "token rejected"
            if self._warn:
                log.warning("grammar matcher rejected token %d: %s", token, self.error)

    def mask_words(self) -> np.ndarray:
        """The allowed-token bitmask for the next position: int32 words, bit i of word w = id 32w+i."""
        if self._prefilled is not None:
            words, self._prefilled = self._prefilled, None
            return words
        self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        return self._words

    def mask(self, width: int) -> np.ndarray:
        """The allowed-token mask as bools, exactly `width` long (ids past the tokenizer: False)."""
        bits = np.unpackbits(self.mask_words().view(np.uint8), bitorder="little").view(np.bool_)
        if bits.shape[0] >= width:
            return bits[:width]
        return np.concatenate([bits, np.zeros(width - bits.shape[0], np.bool_)])


_executor: Any = None


def fill_masks(grammars: list[RowGrammar]) -> None:
    """Compute the next masks of several rows at once, in parallel on llguidance's thread pool
    (the GIL is released); each row's next `mask` then uses its result."""
    global _executor
    if len(grammars) < 2:
        return  # one row: its own mask() call is just as fast
    if _executor is None:
        _executor = _engine().LLExecutor()
    words = grammars[0]._words.shape[0]
    buffer = np.zeros((len(grammars), words), dtype=np.int32)
    _executor.unsafe_compute_mask_ptr(
        [(g._m, i) for i, g in enumerate(grammars)], buffer.ctypes.data, words * 4, len(grammars)
    )
    for g, row in zip(grammars, buffer):
        g._prefilled = row
