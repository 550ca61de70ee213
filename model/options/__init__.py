"""Every option of the server in one place (groups.py), the flags generated from them
(flags.py), their value parsers (values.py) and the engine's device defaults (engine.py)."""

from model.options.engine import GPU_GROUP_BUCKET, ResolvedEngine, padding, resolve_engine
from model.options.groups import (
    AccessOptions,
    AdapterOptions,
    AdmissionOptions,
    CacheOptions,
    EngineOptions,
    HttpOptions,
    KVOptions,
    ModelOptions,
    ObservabilityOptions,
    ResponsesOptions,
    SamplingOptions,
    SchedulingOptions,
    ServerOptions,
    SpeculationOptions,
    TemplateOptions,
)

__all__ = [
    "GPU_GROUP_BUCKET",
    "AccessOptions",
    "AdapterOptions",
    "AdmissionOptions",
    "CacheOptions",
    "EngineOptions",
    "HttpOptions",
    "KVOptions",
    "ModelOptions",
    "ObservabilityOptions",
    "ResolvedEngine",
    "ResponsesOptions",
    "SamplingOptions",
    "SchedulingOptions",
    "ServerOptions",
    "SpeculationOptions",
    "TemplateOptions",
    "padding",
    "resolve_engine",
]
