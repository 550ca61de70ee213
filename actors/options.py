"""Every serving choice, as one options object built from the command line (actors/serve.py).

Nothing in the server reads the environment for its behaviour: the only environment variables
are secrets and deployment paths (docs/operations.md).
"""

from __future__ import annotations

import attrs

from actors.media_flags import DEFAULT_MEDIA_MEMORY_GIB, DEFAULT_MEDIA_REQUEST_MEMORY_GIB
from actors.proxy_flags import DEFAULT_FORWARDED_ALLOW_IPS
from model.kv_scheme import DEFAULT_GROUP_SIZE, DEFAULT_QUANTIZED_KV_START
from model.options import EngineOptions
from model.speculation import DEFAULT_DRAFT_TOKENS, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN


@attrs.frozen
class ServeConfig:
    model: str | None = None
    # The names the model is served under (the first is the one replies and logs use); empty =
    # the model's own name. Requests naming another model get 404 (api/model_names.py).
    served_model_name: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    host: str = "127.0.0.1"
    port: int = 8080
    batch: int | None = None  # rows decoding at once; None = auto, sized at start-up (policy.resolve_batch)
    max_tokens: int | None = None  # server default for requests that name none
    memory_budget_gb: float | None = None
    max_queue: int = 256
    shutdown_timeout: float = 30.0
    prompt_cache_gb: float = 8.0  # RAM prompt cache cap in GiB; 0 disables it
    cache_retention_share: float = 0.5  # of the RAM cache, what cache-breakpoint entries may hold protected
    # The prompt cache's SSD tier: --ssd-cache DIR (requires the RAM tier) and its knobs.
    ssd_cache_dir: str | None = None
    ssd_cache_max_gb: float = 32.0  # GiB
    ssd_spill_queue_gb: float = 2.0  # GiB of write-behind clones; 0 = newest + in-flight only
    ssd_demote_idle_s: float = 300.0  # 0 = off
    ssd_verify: bool = True  # tensor hashes checked on restore (--no-ssd-verify skips)
    ssd_optional: bool = False  # an unusable --ssd-cache: warn and serve without it (else exit 2)
    # Access, limits and logs (api/security.py, api/request_log.py).
    api_key: str | None = None  # required on /v1/* (Bearer or x-api-key) when set
    admin_token: str | None = None  # required on every /admin/* and /v1/adapters* request when set
    cors_origins: tuple[str, ...] = ()  # empty: CORS off; "*" allows any origin
    # Behind a proxy (actors/proxy_flags.py): the Host names served besides IP literals,
    # localhost and --host ("*" = any), and the peers whose X-Forwarded-For / Forwarded name the
    # client in logs (IPs, CIDRs or "*").
    allowed_hosts: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    forwarded_allow_ips: tuple[str, ...] = attrs.field(default=DEFAULT_FORWARDED_ALLOW_IPS, converter=tuple)
    max_body_mb: float = 16.0  # request body cap in MiB (413 above); 0 = no cap
    log_prompts: bool = False  # put the prompt text in the per-request log line
    idle_timeout: float = 5.0  # seconds an idle keep-alive connection stays open (hypercorn)
    ui: bool = True  # the chat page at GET / (api/ui_routes.py); --no-ui turns it off
    # Server-wide sampling defaults (--temp, --top-p, --top-k, --min-p); None = not set, so the
    # checkpoint's generation_config.json value (or the fallback) applies.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # Decode batch sizes 1..batch are met once before serving: "auto" on a GPU, "on", "off".
    warm_up: str = "auto"
    # Simultaneous short arrivals prefilled in one forward: "auto" (= on), "on", "off".
    group_prefill: str = "auto"
    # A joiner's prefill chunk while other rows decode: None = DECODING_PREFILL_CHUNK on CPU and
    # the full chunk on a GPU (unmeasured there); 0 = always the full chunk.
    decoding_prefill_chunk: int | None = None
    # With group prefill, how long a queue head may wait for requests still on their way in.
    arrival_window_ms: float = 10.0
    # The engine's device and shape choices (model/options.py says what each does); None = the
    # device's default.
    prefill_chunk: int = 2048  # prompt tokens per prefill forward
    prefill_bucket: int = 0  # a row's prefill right-padded to a multiple of this (0 = exact widths)
    group_bucket: int | None = None  # the same for a group prefill's shared width
    unfused_hit_prefill: bool | None = None  # attention as matmuls after a prompt-cache hit
    warm_decode_capacity: int | None = None  # warm-up meets KV buffers up to this capacity
    clear_cache: bool | None = None  # release MLX's freed buffers as mlx-lm does
    compile_decode: bool = True  # decode steps as compiled stages
    # The KV cache's storage (model/kv_scheme.py; resolved by the worker once the model loads).
    kv_quant: str = "off"  # "off" | "config" | "4" | "8"
    kv_group_size: int = DEFAULT_GROUP_SIZE
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START  # a row turns quantized once it holds this many
    # Speculative decoding (actors/spec_flags.py; built by the worker once the target loads).
    draft_model: str | None = None  # a draft model's directory or HF cache name, as --model
    draft_kind: str | None = None  # "draft" | "ngram"; None = draft when draft_model is set, else off
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    ngram_max: int = DEFAULT_NGRAM_MAX
    ngram_min: int = DEFAULT_NGRAM_MIN
    # LoRA adapters (actors/adapter_flags.py): (id, path) mounted at start-up; the directory
    # GET /v1/adapters/available lists.
    adapters: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=tuple)
    adapters_dir: str | None = None
    # OpenTelemetry traces (actors/trace_flags.py, api/tracing.py): the OTLP/HTTP collector's URL.
    otlp_endpoint: str | None = None
    # Tensor parallelism (actors/tp_flags.py, actors/tp_leader.py): ranks the model is split across; 1 = off.
    tensor_parallel: int = 1
    # Decoding images (actors/media_flags.py, api/media.py): GiB all requests' decodes may take at
    # once (more wait), and one request's (more is a 400).
    media_memory_gb: float = DEFAULT_MEDIA_MEMORY_GIB
    media_request_memory_gb: float = DEFAULT_MEDIA_REQUEST_MEMORY_GIB

    def engine_options(self) -> EngineOptions:
        """The engine's fields, which this object names alike."""
        return EngineOptions(**{name: getattr(self, name) for name in attrs.fields_dict(EngineOptions)})
