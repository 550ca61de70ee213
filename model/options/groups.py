"""Every option of the server, grouped by what it configures: each field states its default, its
flag, its help and its value parser once (model/options/flags.py turns them into the command
line). `ServerOptions` nests the groups; each consumer receives its own group. `None` in a field
documented as auto is resolved at start-up from the device and the model (`actors/options.py`
`resolve`; the engine's device defaults in model/options/engine.py).

The module sits at the bottom layer and imports nothing that runs, so the model layer can take
its groups (engine, kv, speculation) and the API layer its own (http, access) alike.
"""

from __future__ import annotations

import attrs

from model.options import values as v
from model.options.flags import Flag, group, option

# -- the model --------------------------------------------------------------------------------


@attrs.frozen
class ModelOptions:
    """Model: what is served and under which names."""

    model: str | None = option(
        None,
        Flag(
            "--model",
            "model directory or an org/name in the local Hugging Face cache",
            parse=v.path_arg,
            shown="the embedded demo model",
        ),
    )
    # The names the model is served under (the first is the one replies and logs use); empty =
    # the model's own name. Requests naming another model get 404 (api/model_names.py).
    served_model_name: tuple[str, ...] = option(
        (),
        Flag(
            "--served-model-name",
            "names the model answers to; the first is used in replies and logs (default: org/name or directory name)",
            parse=v.non_empty,
            nargs="+",
            metavar="NAME",
            shown="org/name or directory name",
        ),
        converter=tuple,
    )
    # Several models in one server (actors/pool.py): on with --model-pool above 1 or --models-dir;
    # --model-pool 1 without --models-dir serves the --model alone, as before the pool existed.
    model_pool: int = option(
        1,
        Flag(
            "--model-pool",
            "models resident at once: a request's `model` picks one, loaded on demand, the least "
            "recently used idle one unloaded to make room (default 1: the --model alone)",
            parse=v.at_least_one,
            metavar="N",
        ),
    )
    models_dir: str | None = option(
        None,
        Flag(
            "--models-dir",
            "a directory of model directories, each servable by its directory name (turns the pool on)",
            parse=v.path_arg,
            metavar="DIR",
        ),
    )
    model_ttl: float = option(
        0.0,
        Flag(
            "--model-ttl",
            "unload a pooled model once it has been idle this many seconds (default 0: never)",
            parse=v.non_negative_float,
            metavar="S",
        ),
    )
    model_load_timeout: float = option(
        300.0,
        Flag(
            "--model-load-timeout",
            "seconds a request waits for its model to load, room in the pool included, before a 503 (default 300)",
            parse=v.positive_float,
            metavar="S",
        ),
    )


# -- HTTP and access --------------------------------------------------------------------------


@attrs.frozen
class HttpOptions:
    """HTTP: where the server listens and how connections and shutdown behave."""

    host: str = option("127.0.0.1", Flag("--host", "address to listen on"))
    port: int = option(8080, Flag("--port", "TCP port; 0 = a free port the system picks", parse=v.port_number))
    idle_timeout: float = option(
        5.0,
        Flag(
            "--idle-timeout",
            "seconds an idle keep-alive connection stays open (default 5)",
            parse=v.positive_float,
            metavar="S",
        ),
    )
    max_body_mb: float = option(
        16.0,
        Flag(
            "--max-body-mb",
            "request body cap in MiB, 413 above it (default 16; 0 = no cap)",
            parse=v.non_negative_float,
            metavar="MiB",
        ),
    )
    shutdown_timeout: float = option(
        30.0,
        Flag(
            "--shutdown-timeout",
            "seconds in-flight requests get to finish after SIGINT/SIGTERM",
            parse=v.positive_float,
            metavar="S",
        ),
    )
    # Serve HTTP on this unix socket instead of TCP (actors/preflight.py checks it; actors/serve.py
    # binds it and removes it at exit).
    unix: str | None = option(
        None,
        Flag(
            "--unix",
            "serve HTTP on a unix socket at PATH instead of TCP (--host and --port are then unused); "
            "the file is created with --unix-mode, a stale one from a dead server replaced, and removed "
            "at exit; its clients count as local for the admin routes (default: TCP)",
            parse=v.path_arg,
            metavar="PATH",
        ),
    )
    unix_mode: int = option(
        0o600,
        Flag(
            "--unix-mode",
            "permissions of the --unix socket file, in octal (default 600: only this user; 660 lets "
            "the file's group, a proxy's, connect)",
            parse=v.file_mode,
            metavar="MODE",
            shown="600",
        ),
    )
    ui: bool = option(
        True,
        Flag(
            "--no-ui",
            "do not serve the chat page at GET / (the API is unchanged; default: the page is served, "
            "and asks for --api-key in the browser when one is set)",
            action="store_false",
        ),
    )


# Read by api/http/security.py, cross_site.py and forwarded.py.
@attrs.frozen
class AccessOptions:
    """Access: keys, the admin gate, browsers and proxies."""

    # Secrets may come from the environment so they stay out of `ps`.
    api_key: str | None = option(
        None,
        Flag(
            "--api-key",
            "require this key on /v1/* (Authorization: Bearer or x-api-key); env MLX_TRIO_API_KEY",
            env="MLX_TRIO_API_KEY",
        ),
    )
    admin_token: str | None = option(
        None,
        Flag(
            "--admin-token",
            "require this token on every /admin/* and /v1/adapters* request, loopback included "
            "(without one: directly connected loopback clients only); env MLX_TRIO_ADMIN_TOKEN",
            env="MLX_TRIO_ADMIN_TOKEN",
        ),
    )
    cors_origins: tuple[str, ...] = option(
        (),
        Flag(
            "--cors-origin",
            "allow browser calls from ORIGIN (repeatable or comma-separated; * = any); default: CORS off",
            action="append",
            metavar="ORIGIN",
        ),
        converter=v.parse_origins,
    )
    allowed_hosts: tuple[str, ...] = option(
        (),
        Flag(
            "--allowed-hosts",
            "Host names the server answers to, besides IP addresses, localhost and the --host name "
            "(repeatable or comma-separated; * = any): any other Host gets 403, a guard against DNS "
            "rebinding (default: none)",
            parse=v.listed(v.parse_hosts),
            action=v.CommaList,
            metavar="NAME",
        ),
        converter=tuple,
    )
    forwarded_allow_ips: tuple[str, ...] = option(
        ("127.0.0.1", "::1"),  # a proxy on the same host
        Flag(
            "--forwarded-allow-ips",
            "proxies whose X-Forwarded-For / Forwarded headers name the client in logs: IPs or CIDRs "
            "(repeatable or comma-separated; * = any peer; '' = none) (default: 127.0.0.1,::1)",
            parse=v.listed(v.parse_allow_ips),
            action=v.CommaList,
            metavar="IPS",
        ),
        converter=tuple,
    )


# -- admission, sampling, scheduling ----------------------------------------------------------


@attrs.frozen
class AdmissionOptions:
    """Admission: the memory budget and the queue (actors/admission.py, actors/policy.py)."""

    memory_budget_gb: float | None = option(
        None,
        Flag(
            "--memory-budget",
            "memory budget in decimal GB (default: 0.75 x device/system memory)",
            parse=v.positive_float,
            metavar="GB",
        ),
    )
    # Live KV: every active row's together (actors/kv_memory.py); None = what the memory budget
    # leaves after weights, adapters and the prefill transient (the prompt cache yields to rows).
    kv_budget_gb: float | None = option(
        None,
        Flag(
            "--kv-budget",
            "KV that all running rows may hold together, in decimal GB: a row that would pass it "
            "waits, and before a decode step that would pass it the latest arrival is preempted "
            "(default: what --memory-budget leaves after weights, adapters and the prefill transient)",
            parse=v.positive_float,
            metavar="GB",
            shown="auto",
        ),
    )
    max_queue: int = option(256, Flag("--max-queue", "requests allowed to wait; more get 503", parse=v.at_least_one))
    # Decoding images (api/media.py): GiB all requests' decodes may take at once (more wait), and
    # one request's (more is a 400).
    media_memory_gb: float = option(
        4.0,
        Flag(
            "--media-memory",
            "memory that decoding requests' images may take at once; an image request that "
            "does not fit waits for earlier ones (default 4)",
            parse=v.positive_float,
            metavar="GiB",
        ),
    )
    media_request_memory_gb: float = option(
        3.0,
        Flag(
            "--media-request-memory",
            "memory that decoding one request's images may take (at most --media-memory); a "
            "request over it gets 400 images_too_large (default 3)",
            parse=v.positive_float,
            metavar="GiB",
        ),
    )


@attrs.frozen
class SamplingOptions:
    """Request defaults: sampling and length for requests that set none (request > flag >
    generation_config.json > fallback)."""

    max_tokens: int | None = option(
        None, Flag("--max-tokens", "default max_tokens for requests", parse=v.at_least_one, shown="per route")
    )
    temperature: float | None = option(
        None,
        Flag(
            "--temp",
            "default sampling temperature (default: generation_config.json, else 0 = greedy)",
            parse=v.non_negative_float,
        ),
    )
    top_p: float | None = option(
        None, Flag("--top-p", "default top_p", parse=v.non_negative_float, shown="generation_config.json")
    )
    top_k: int | None = option(
        None, Flag("--top-k", "default top_k (0 = off)", parse=int, shown="generation_config.json")
    )
    min_p: float | None = option(
        None, Flag("--min-p", "default min_p", parse=v.non_negative_float, shown="generation_config.json")
    )


# Read by api/chat.py (template defaults, the reasoning budget) and actors/root.py (the template).
@attrs.frozen
class TemplateOptions:
    """Chat template and reasoning: the template, and the defaults of requests that set none.

    A request's own values win over these flags, and they over the template's own defaults."""

    chat_template: str | None = option(
        None,
        Flag(
            "--chat-template",
            "render chat prompts with this Jinja template FILE instead of the model's own",
            parse=v.path_arg,
            metavar="FILE",
            shown="the model's",
        ),
    )
    # (name, value) pairs, sorted: variables every render gets unless a request's chat_template_kwargs set them.
    chat_template_args: tuple[tuple[str, object], ...] = option(
        (),
        Flag(
            "--chat-template-args",
            "a JSON object of variables the chat template gets unless a request's chat_template_kwargs "
            "set them, e.g. '{\"preserve_thinking\": true}' (default: none)",
            parse=v.json_object,
            metavar="JSON",
        ),
        converter=v.sorted_items,
    )
    thinking: str = option(
        "auto",
        Flag(
            "--thinking",
            "enable_thinking for requests that do not set it: on, off, or auto = the template's own default",
            choices=("on", "off", "auto"),
        ),
    )
    thinking_budget: int | None = option(
        None,
        Flag(
            "--thinking-budget",
            "reasoning tokens a row may generate before the server ends its reasoning (the model's "
            "end-of-reasoning marker) and it goes on to the answer, for requests that set no budget "
            "(default: none)",
            parse=v.non_negative_int,
            metavar="N",
        ),
    )


@attrs.frozen
class SchedulingOptions:
    """Scheduling: rows decoding at once and how prefills share the engine (actors/scheduler.py)."""

    batch: int | None = option(
        None,
        Flag(
            "--batch",
            "max concurrent rows; 1 = strict serial executor (default auto: 32, fewer if their KV does not fit)",
            parse=v.batch_rows,
            metavar="N|auto",
        ),
    )
    group_prefill: str = option(
        "auto",
        Flag(
            "--group-prefill",
            "prefill simultaneous short arrivals in one forward (auto: on)",
            choices=("auto", "on", "off"),
        ),
    )
    arrival_window_ms: float = option(
        10.0,
        Flag(
            "--arrival-window-ms",
            "with group prefill, a queue head waits up to MS for requests still being read "
            "and templated, so a burst shares one group prefill (default 10; 0 = off)",
            parse=v.non_negative_float,
            metavar="MS",
        ),
    )
    # A joiner's prefill chunk while other rows decode: None = DECODING_PREFILL_CHUNK on CPU and
    # the full chunk on a GPU; 0 = always the full chunk.
    decoding_prefill_chunk: int | None = option(
        None,
        Flag(
            "--decoding-prefill-chunk",
            "prefill a joining prompt N tokens at a time while other rows decode, so their "
            "streams wait for at most one such chunk between tokens (default: 512 on CPU, "
            "the full --prefill-chunk on a GPU; 0 = always the full chunk)",
            parse=v.non_negative_int,
            metavar="N",
        ),
    )


# -- caches and KV ----------------------------------------------------------------------------


@attrs.frozen
class CacheOptions:
    """Prompt cache: the RAM tier, its retention of client breakpoints, and the SSD tier."""

    # None = a quarter of the KV room the memory budget leaves, at most 8 GiB (actors/options.py).
    prompt_cache_gb: float | None = option(
        None,
        Flag(
            "--prompt-cache",
            "RAM prompt cache size in GiB, inside the memory budget: running rows take room from "
            "it before they wait (default: a quarter of what the budget leaves after weights, at "
            "most 8; 0 disables it)",
            shown="auto",
            parse=v.non_negative_float,
            metavar="GiB",
        ),
    )
    cache_retention_share: float = option(
        0.5,
        Flag(
            "--cache-retention-share",
            "share of --prompt-cache that entries at clients' cache breakpoints (cache_control) may "
            "hold protected from eviction until their ttl ends (default 0.5; 0 = no protection)",
            parse=v.share,
            metavar="F",
        ),
    )
    prompt_cache_key_isolation: bool = option(
        False,
        Flag(
            "--prompt-cache-key-isolation",
            "make a request's OpenAI prompt_cache_key part of its prompt-cache namespace: requests with "
            "different keys never share a cache entry (default: the key only names a group, every request "
            "shares the cache)",
            action="store_true",
        ),
    )
    ssd_cache_dir: str | None = option(
        None,
        Flag(
            "--ssd-cache",
            "keep prompt-cache entries on disk in DIR too, so they survive restarts (needs --prompt-cache > 0)",
            parse=v.path_arg,
            metavar="DIR",
            shown="off",
        ),
    )
    ssd_cache_max_gb: float = option(
        32.0,
        Flag("--ssd-cache-max", "SSD cache size cap in GiB (default 32)", parse=v.positive_float, metavar="GiB"),
    )
    ssd_spill_queue_gb: float = option(
        2.0,
        Flag(
            "--ssd-spill-queue",
            "write-behind queue cap in GiB; over it the oldest queued spill is dropped (default 2)",
            parse=v.non_negative_float,
            metavar="GiB",
        ),
    )
    ssd_demote_idle_s: float = option(
        300.0,
        Flag(
            "--ssd-demote-idle",
            "move RAM entries unused this long to the SSD tier (default 300; 0 = off)",
            parse=v.non_negative_float,
            metavar="S",
        ),
    )
    ssd_verify: bool = option(
        True,
        Flag(
            "--no-ssd-verify",
            "skip the per-tensor hash check when restoring from the SSD tier (default: checked)",
            action="store_false",
        ),
    )
    ssd_optional: bool = option(
        False,
        Flag(
            "--ssd-optional",
            "an --ssd-cache directory that cannot be written or that another server holds is a warning "
            "and the server runs without the SSD tier (default: start-up fails, exit 2)",
            action="store_true",
        ),
    )


@attrs.frozen
class ResponsesOptions:
    """Responses store: what previous_response_id continues from, and where it is kept."""

    # A directory, "memory", or None: DIR/responses under --ssd-cache, else memory
    # (actors/ssd/response_log.py).
    response_store: str | None = option(
        None,
        Flag(
            "--response-store",
            "keep stored Responses (store: true) in DIR, each on disk before its answer is sent, so "
            "previous_response_id, GET and DELETE survive restarts and crashes; 'memory' keeps them in "
            "RAM only (default: DIR/responses under --ssd-cache, else memory)",
            parse=v.path_arg,
            metavar="DIR|memory",
            shown="DIR/responses under --ssd-cache, else memory",
        ),
    )
    response_store_ttl_s: float | None = option(
        None,
        Flag(
            "--response-store-ttl",
            "seconds a stored response is kept (default: 30 days on disk, 1 hour in memory)",
            parse=v.positive_float,
            metavar="S",
            shown="30 days on disk, 1 hour in memory",
        ),
    )
    response_store_max_gb: float = option(
        4.0,
        Flag(
            "--response-store-max",
            "size cap of the store on disk in GiB; over it the least recently used responses go first (default 4)",
            parse=v.positive_float,
            metavar="GiB",
        ),
    )


@attrs.frozen
class KVOptions:
    """KV cache storage: quantized or the activation dtype, contiguous or paged (model/kv/scheme.py)."""

    kv_quant: str = option(
        "off",
        Flag(
            "--kv-quant",
            "store the KV cache quantized: 8 or 4 bits in every layer, config = the model's "
            "kv_config.json (full precision if it ships none), off = the activation dtype (default off)",
            choices=("off", "config", "4", "8"),
        ),
    )
    kv_group_size: int = option(
        64,
        Flag(
            "--kv-group-size",
            "elements per quantization group along the head dimension",
            parse=int,
            choices=(32, 64, 128),
            metavar="{32,64,128}",
        ),
    )
    quantized_kv_start: int = option(
        5000,
        Flag(
            "--quantized-kv-start",
            "a row's KV turns quantized after the first forward that leaves it holding at least N "
            "positions (as mlx-lm)",
            parse=v.non_negative_int,
            metavar="N",
        ),
    )
    # A batch's full-attention KV in a pool of fixed blocks with a block table per row
    # (model/kv/paged.py): rows are billed by the blocks they hold, not padded to the longest.
    paged_kv: bool = option(
        False,
        Flag(
            "--paged-kv",
            "keep a batch's full-attention KV in a pool of 256-position blocks, each row holding "
            "its own: a row is billed by its own length, not padded to the batch's longest, and "
            "rows join and leave without copying the others' KV; on CUDA decode attention reads "
            "the blocks in place (default off: one contiguous, left-padded buffer per layer)",
            action="store_true",
        ),
    )


@attrs.frozen
class SpeculationOptions:
    """Speculative decoding: who drafts and how much (model/engine/speculation.py)."""

    draft_model: str | None = option(
        None,
        Flag(
            "--draft-model",
            "speculative decoding with this small draft model (a directory or an org/name in the local "
            "Hugging Face cache, as --model); it must share the target's tokenizer vocabulary",
            parse=v.path_arg,
            metavar="DIR",
        ),
    )
    draft_kind: str | None = option(
        None,
        Flag(
            "--draft-kind",
            "who proposes the draft tokens the model verifies: draft = --draft-model, ngram = prompt lookup "
            "(the tokens that followed the row's latest n-gram earlier in its prompt and output). Default: draft "
            "when --draft-model is given, else no speculative decoding",
            choices=("draft", "ngram"),
        ),
    )
    num_draft_tokens: int = option(
        3,
        Flag(
            "--num-draft-tokens",
            "draft tokens proposed per verification step",
            parse=v.at_least_one,
            metavar="K",
        ),
    )
    ngram_max: int = option(
        4,
        Flag(
            "--ngram-max",
            "--draft-kind ngram: the longest trailing n-gram looked up",
            parse=v.at_least_one,
            metavar="N",
        ),
    )
    ngram_min: int = option(
        2,
        Flag(
            "--ngram-min",
            "--draft-kind ngram: the shortest trailing n-gram looked up",
            parse=v.at_least_one,
            metavar="N",
        ),
    )

    @property
    def kind(self) -> str | None:
        """The effective drafter: an explicit --draft-kind, else draft when a draft model is
        given; None = no speculative decoding."""
        if self.draft_kind is not None:
            return self.draft_kind
        return "draft" if self.draft_model else None


@attrs.frozen
class AdapterOptions:
    """LoRA adapters: mounted at start-up, and the directory offered for mounting later."""

    # (id, path) pairs, mounted in order once the model is loaded (actors/root.py); one that
    # cannot mount fails start-up in one line, exit 2.
    adapters: tuple[tuple[str, str], ...] = option(
        (),
        Flag(
            "--adapter",
            "mount the LoRA / DoRA adapter directory PATH (mlx-lm's adapter_config.json + "
            "adapters.safetensors) under ID once the model is loaded; repeatable. Requests pick it with "
            '"adapter": "ID" or "model": "<served-name>:ID"; one given alone is the default of requests '
            "that pick none (--default-adapter) (default: none)",
            parse=v.adapter_spec,
            action=v.AppendAdapter,
            metavar="ID=PATH",
        ),
        converter=tuple,
    )
    # The adapter requests that name none run on (api/adapters/select.py): `default`.
    default_adapter: str | None = option(
        None,
        Flag(
            "--default-adapter",
            "the --adapter that requests without an adapter field run on (default: the one --adapter when "
            'exactly one is given, else the base model); none = the base model ("adapter": "none" always is)',
            parse=v.default_adapter,
            metavar="ID|none",
        ),
    )
    adapters_dir: str | None = option(
        None,
        Flag(
            "--adapters-dir",
            "a directory of adapter directories that GET /v1/adapters/available lists, for POST "
            "/v1/adapters to mount at runtime (default: none)",
            parse=v.path_arg,
            metavar="DIR",
        ),
    )

    @property
    def default(self) -> str | None:
        """The adapter a request that names none runs on: `--default-adapter` (None for `none`),
        else the one `--adapter` when exactly one is given; None: the base model."""
        if self.default_adapter is not None:
            return None if self.default_adapter == v.NO_ADAPTER else self.default_adapter
        return self.adapters[0][0] if len(self.adapters) == 1 else None


@attrs.frozen
class ObservabilityOptions:
    """Logs and traces."""

    log_level: str = option(
        "info",
        Flag(
            "--log-level",
            "log threshold; debug also prints the traceback of a start-up failure (default info)",
            choices=("debug", "info", "warning", "error"),
        ),
    )
    log_prompts: bool = option(
        False, Flag("--log-prompts", "include prompt text in the per-request log lines", action="store_true")
    )
    request_id_header: str = option(
        "X-Request-Id",
        Flag(
            "--request-id-header",
            "the header a request's id comes in and goes out on (a client's well-formed one is kept, "
            "else the server makes one): set it to what your proxy or tracing uses",
            parse=v.non_empty,
            metavar="NAME",
        ),
    )
    otlp_endpoint: str | None = option(
        None,
        Flag(
            "--otlp-endpoint",
            "trace every request with OpenTelemetry and export the spans over OTLP/HTTP to the "
            "collector at URL (its base URL, e.g. http://localhost:4318: /v1/traces is appended); "
            "the standard OTEL_EXPORTER_OTLP_ENDPOINT does the same when this is not given. Needs "
            f"{v.TRACING_INSTALL_HINT} (default: off)",
            parse=v.otlp_url,
            action=v.NeedsOtel,
            metavar="URL",
        ),
    )


# -- the engine -------------------------------------------------------------------------------


@attrs.frozen
class EngineOptions:
    """Engine: device and shape choices; auto = the device's default (model/options/engine.py)."""

    # Prompt tokens per prefill forward (a longer prompt takes several chunks).
    prefill_chunk: int = option(
        2048,
        Flag(
            "--prefill-chunk",
            "prompt tokens per prefill forward; a longer prompt takes several (default 2048)",
            parse=v.at_least_one,
            metavar="N",
        ),
    )
    # Right-pad a row's own prefill forwards to a multiple of this (0 = exact widths: a cold
    # prompt keeps mlx-lm's shapes, and so its greedy tokens, on CUDA too). The padding sits
    # after the real tokens, so causal attention keeps it out of their keys and values, and it
    # is trimmed off the caches: the same math, but on CUDA cuBLAS picks GEMM kernels by shape,
    # and on the 8B shape a padded prefill's greedy tokens left mlx-lm's at token 0.
    prefill_bucket: int = option(
        0,
        Flag(
            "--prefill-bucket",
            "right-pad a request's prefill to a multiple of N tokens so CUDA attention graphs "
            "are reused (first prompt of a new length ~60 ms faster on an H200); greedy "
            "tokens may then differ from mlx-lm's in the last bits (default 0 = exact widths)",
            parse=v.non_negative_int,
            metavar="N",
        ),
    )
    # The same for a group prefill's shared width. None: GPU_GROUP_BUCKET on a GPU, else 0.
    group_bucket: int | None = option(
        None,
        Flag(
            "--group-bucket",
            "round a group prefill's shared width up to a multiple of N tokens, so its shapes "
            "recur (default: 64 on a GPU, where each new shape builds a cuDNN graph; 0 elsewhere)",
            parse=v.non_negative_int,
            metavar="N",
        ),
    )
    # A prefill after a prompt-cache hit runs its attention as matmuls: MLX's own fallback formula,
    # which builds no per-shape cuDNN graph (a suffix after a hit has a new k length almost every
    # time). A cold prompt never takes it, so its tokens stay mlx-lm's. None: on under CUDA only.
    unfused_hit_prefill: bool | None = option(
        None,
        Flag(
            "--unfused-hit-prefill",
            "after a prompt-cache hit, run the prefill's attention as plain matmuls, which build "
            "no per-shape cuDNN graph; cold prompts never take it (default auto: on under CUDA)",
            parse=v.auto_on_off,
            metavar="auto|on|off",
        ),
    )
    # Warm-up meets KV buffers of every capacity up to this. None: CUDA_WARM_DECODE_CAPACITY on
    # CUDA, else 0.
    warm_decode_capacity: int | None = option(
        None,
        Flag(
            "--warm-decode-capacity",
            "warm-up also meets KV buffers of every capacity up to N tokens, each a first-use "
            "stall of ~0.4 s on CUDA (default: 8192 on CUDA, else 0)",
            parse=v.non_negative_int,
            metavar="N",
        ),
    )
    # Release MLX's freed buffers after each prefill and every 256 steps, as mlx-lm does. None:
    # off on CUDA (fresh buffers there are first-touched managed memory), on elsewhere.
    clear_cache: bool | None = option(
        None,
        Flag(
            "--clear-cache",
            "release MLX's freed buffers after each prefill and every 256 steps, as mlx-lm does "
            "(default auto: off on CUDA, where reused buffers are faster; on elsewhere)",
            parse=v.auto_on_off,
            metavar="auto|on|off",
        ),
    )
    # Decode steps run as compiled stages (same numerics, far fewer host ops); False runs the
    # eager graph (tests compare the two).
    compile_decode: bool = option(True)
    # Decode batch sizes 1..batch are met once before serving: "auto" on a GPU, "on", "off".
    warm_up: str = option(
        "auto",
        Flag(
            "--warm-up",
            "meet decode batch sizes 1..--batch once before serving (auto: on a GPU only)",
            choices=("auto", "on", "off"),
        ),
    )
    # Ranks the model is split across (actors/tp/leader.py); 1 = off.
    tensor_parallel: int = option(
        1,
        Flag(
            "--tensor-parallel",
            "split attention heads and MLP across N ranks: this process and N-1 follower processes it starts, "
            "joined by MLX's ring backend on localhost; the heads must divide by N. Turns the prompt cache off; "
            "not with --ssd-cache, speculative decoding, adapters or embedding models (default 1 = off)",
            parse=v.at_least_one,
            metavar="N",
        ),
    )
    # Each model's engine (worker, caches, MLX thread) in a process of its own (actors/isolate/).
    isolate: bool = option(
        False,
        Flag(
            "--isolate",
            "run each model's engine (its weights, caches and MLX thread) in a child process of its own: "
            "a crash there (a fault, the OOM killer) fails only that model's requests in flight, and "
            "the engine is restarted; HTTP, admission and scheduling stay in this process "
            "(default: off, one process)",
            action="store_true",
        ),
    )
    blas: str = option(
        "auto",
        Flag(
            "--blas",
            "Linux CPU only: the BLAS MLX's CPU backend binds when it loads; auto = the first optimized "
            "one found (MKL, OpenBLAS, BLIS), off = MLX's bundled reference BLAS, or a library's path "
            "(default auto)",
            parse=v.path_arg,
            metavar="auto|off|PATH",
        ),
    )


# -- all of them ------------------------------------------------------------------------------


@attrs.frozen
class ServerOptions:
    """Every serving choice (`python -m actors.serve --help` lists them by group)."""

    model: ModelOptions = group(ModelOptions)
    http: HttpOptions = group(HttpOptions)
    access: AccessOptions = group(AccessOptions)
    admission: AdmissionOptions = group(AdmissionOptions)
    sampling: SamplingOptions = group(SamplingOptions)
    templates: TemplateOptions = group(TemplateOptions)
    scheduling: SchedulingOptions = group(SchedulingOptions)
    caches: CacheOptions = group(CacheOptions)
    responses: ResponsesOptions = group(ResponsesOptions)
    kv: KVOptions = group(KVOptions)
    speculation: SpeculationOptions = group(SpeculationOptions)
    adapters: AdapterOptions = group(AdapterOptions)
    observability: ObservabilityOptions = group(ObservabilityOptions)
    engine: EngineOptions = group(EngineOptions)
