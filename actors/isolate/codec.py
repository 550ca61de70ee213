"""Plain data to and from an isolated engine: the worker calls' values as JSON and raw bytes.

What crosses the process boundary (actors/isolate/protocol.py) is built only from JSON's own
values, tuples, frozensets, dicts, numpy arrays and instances of the few attrs classes in
`CLASSES` (the rows' specs and events, sampling values, the model's facts, the options): never a
pickle, so decoding a message can only ever build those. A class outside the list is refused on
both sides.

Encoding: JSON values stay themselves; a tuple is `{"(": [...]}`, a frozenset `{"{": [...]}`, a
dict `{"#": [[key, value], ...]}`, an attrs instance `{"@": "Name", field: value, ...}` (its
init fields), and an array's bytes travel beside the JSON, `{"nd": index, "dtype", "shape"}`
naming them. `TokenOut`, one per row per decode step, has a short form of its own: a list of its
fields in order under `"T"`, so a step's tokens cost a list of numbers each.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import attrs
import numpy as np

from model.engine.rows import TokenOut, TopLogprob

# Name -> "module:class". Imported on first use: the child reads its options before the BLAS is
# bound, and must not import MLX (which some of these modules do) until then.
CLASSES = {
    "RowSpec": "model.engine.rows:RowSpec",
    "ImageInput": "model.engine.rows:ImageInput",
    "RowOpened": "model.engine.rows:RowOpened",
    "PrefillProgress": "model.engine.rows:PrefillProgress",
    "TopLogprob": "model.engine.rows:TopLogprob",
    "TokenOut": "model.engine.rows:TokenOut",
    "SamplingParams": "model.engine.params:SamplingParams",
    "Constraint": "model.engine.params:Constraint",
    "ThinkControl": "model.engine.params:ThinkControl",
    "ModelInfo": "actors.worker_api:ModelInfo",
    "AdapterReport": "actors.worker_api:AdapterReport",
    "ImageProcessorConfig": "model.vision.preprocess:ImageProcessorConfig",
    "Gemma4ImageConfig": "model.vision.gemma4:Gemma4ImageConfig",
    "VideoProcessorConfig": "model.vision.video:VideoProcessorConfig",
    "AudioFeatureConfig": "model.audio.features:AudioFeatureConfig",
    "MediaLayout": "model.media:MediaLayout",
    "KindLayout": "model.media:KindLayout",
    "Pooling": "model.load.embedding_config:Pooling",
    "MachineFacts": "model.engine.machine:MachineFacts",
    "FlushResult": "actors.messages:FlushResult",
    "DrainReport": "actors.ssd.drain:DrainReport",
    **{
        name: f"model.options.groups:{name}"
        for name in (
            "ServerOptions",
            "ModelOptions",
            "HttpOptions",
            "AccessOptions",
            "AdmissionOptions",
            "SamplingOptions",
            "TemplateOptions",
            "SchedulingOptions",
            "CacheOptions",
            "ResponsesOptions",
            "KVOptions",
            "SpeculationOptions",
            "AdapterOptions",
            "ObservabilityOptions",
            "EngineOptions",
        )
    },
}
_resolved: dict[str, type] = {}


class CodecError(ValueError):
    """A value that is not plain data, or a message that does not decode to plain data."""


def _class(name: str) -> type:
    cls = _resolved.get(name)
    if cls is None:
        where = CLASSES.get(name)
        if where is None:
            raise CodecError(f"{name!r} is not a class that crosses to the engine process")
        module, _, attr = where.partition(":")
        cls = _resolved[name] = getattr(importlib.import_module(module), attr)
    return cls


def _fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(cls) if f.init)


def encode(message: dict[str, Any]) -> tuple[bytes, list[bytes]]:
    """A message (a JSON object: str keys, each value encoded) as JSON text and the raw buffers its
    arrays travel in."""
    blobs: list[bytes] = []
    body = {key: _encode(value, blobs) for key, value in message.items()}
    return json.dumps(body, separators=(",", ":")).encode(), blobs


def decode(text: bytes, blobs: list[bytes]) -> dict[str, Any]:
    try:
        body = json.loads(text)
        if type(body) is not dict:
            raise CodecError("a message is a JSON object")
        return {key: _decode(value, blobs) for key, value in body.items()}
    except (KeyError, TypeError, IndexError, ValueError) as exc:  # (json.JSONDecodeError: a ValueError)
        raise CodecError(f"a malformed message: {exc}") from exc


def _encode(value: Any, blobs: list[bytes]) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is TokenOut:
        t: TokenOut = value
        top = [[p.token, p.logprob] for p in t.top_logprobs]
        return {"T": [t.row_id, t.token, t.finish, t.logprob, top, t.error, t.drafted, t.accepted]}
    if kind is list:
        return [_encode(v, blobs) for v in value]
    if kind is tuple:
        return {"(": [_encode(v, blobs) for v in value]}
    if kind is frozenset:
        return {"{": [_encode(v, blobs) for v in value]}
    if kind is dict:
        return {"#": [[_encode(k, blobs), _encode(v, blobs)] for k, v in value.items()]}
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        blobs.append(array.tobytes())
        return {"nd": len(blobs) - 1, "dtype": array.dtype.str, "shape": list(array.shape)}
    if attrs.has(kind) and _class(kind.__name__) is kind:
        return {"@": kind.__name__, **{name: _encode(getattr(value, name), blobs) for name in _fields(kind)}}
    if isinstance(value, (bool, int, float, str)):  # a subclass (an IntEnum, a str enum): its plain value
        return _encode(kind.__mro__[1](value) if kind is not bool else bool(value), blobs)
    raise CodecError(f"{kind.__module__}.{kind.__qualname__} does not cross to the engine process")


def _decode(value: Any, blobs: list[bytes]) -> Any:
    if type(value) is list:
        return [_decode(v, blobs) for v in value]
    if type(value) is not dict:
        return value
    if "T" in value:
        row_id, token, finish, logprob, top, error, drafted, accepted = value["T"]
        tops = tuple(TopLogprob(int(i), float(p)) for i, p in top)
        return TokenOut(row_id, token, finish, logprob, tops, error, drafted, accepted)
    if "(" in value:
        return tuple(_decode(v, blobs) for v in value["("])
    if "{" in value:
        return frozenset(_decode(v, blobs) for v in value["{"])
    if "#" in value:
        return {_decode(k, blobs): _decode(v, blobs) for k, v in value["#"]}
    if "nd" in value:
        data = blobs[value["nd"]]
        return np.frombuffer(data, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
    if "@" in value:
        cls = _class(value["@"])
        names = _fields(cls)
        return cls(**{name: _decode(value[name], blobs) for name in names if name in value})
    raise CodecError(f"a malformed value: {sorted(value)}")
