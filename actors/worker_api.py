"""The contract between the scheduler and a GPU worker.

The scheduler never touches MLX. It asks a worker, one awaited call at a time, to open a row,
prefill it chunk by chunk, join it to the running batch, step the batch, and close rows. The real
worker (`actors/gpu_worker.py`) runs each call as one job on its dedicated MLX thread; the fake
worker (`tests/fakes.py`) runs inline and spends virtual time, so MockClock tests are exact.

A call is never interrupted once started: cancellation takes effect at call boundaries, which are
exactly the "step boundaries" rows leave at. The one exception is `abort`, which is not a call
but a signal: a prefill forward of that row, running or still to come, stops early and the row
can then only be closed.

LoRA adapters mount and unmount as calls too (`mount_adapter`, `unmount_adapter`), between other
calls; what crosses back is an `AdapterReport` of plain values. A row naming an adapter that is
no longer mounted fails its `open_row` / `fork_rows` with `AdapterNotMounted`: that request's
mistake (a 400), never the worker's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from model.audio.features import AudioFeatureConfig
from model.engine.rows import PrefillProgress, RowOpened, RowSpec, TokenOut
from model.kv.scheme import KVScheme
from model.load.embedding_config import Pooling
from model.media import MediaLayout
from model.vision.preprocess import ImageProcessor, ImageProcessorConfig
from model.vision.video import VideoProcessorConfig

if TYPE_CHECKING:
    from model.load.loader import LoadedModel


@attrs.frozen
class ModelInfo:
    """What the trio side needs to know about the loaded model (plain values only)."""

    name: str
    context_length: int  # max_position_embeddings
    weights_bytes: int
    kv_bytes_per_token: int
    eos_token_ids: frozenset[int]
    batchable: bool = True
    device: str = "cpu"
    backend: str = "cpu"  # "cpu" | "metal" | "cuda": a GPU's kind
    # Memory the device can give this process (unified/GPU memory); 0 = unknown, in which case
    # admission's default budget falls back to system RAM.
    memory_bytes: int = 0
    # generation_config.json sampling defaults the checkpoint ships (only the keys it gives).
    generation_defaults: tuple[tuple[str, float], ...] = ()
    model_type: str = ""  # config.json's model_type (tool-call format detection falls back on it)
    # The KV cache's storage (model/kv/scheme.py). `kv_bytes_per_token` stays the full-precision
    # rate; a quantized row costs `kv_quant_ratio` of it per token once it is past
    # `kv_quantized_from` positions (0 = never quantized): actors/policy.py `kv_bill`.
    kv_scheme: str = "bf16"  # its label
    kv_quant_ratio: float = 1.0
    kv_quantized_from: int = 0
    kv_group_size: int | None = None  # None when nothing is quantized
    kv_bits: int | tuple[int | None, ...] | None = None  # KVScheme.bits
    kv_start: int = 0  # --quantized-kv-start
    kv_paged: bool = False  # --paged-kv: a batch's rows hold blocks of their own (actors/kv_memory.py)
    # Bytes every row holds whatever its length (a hybrid model's recurrent states).
    state_bytes_per_row: int = 0
    # One prefill forward's peak beyond weights and KV, for the chunk in use and the model's
    # shape (model/engine/prefill_memory.py): admission keeps it out of the KV budget.
    prefill_transient_bytes: int = 0
    # A row's KV comes back exactly from the prompt cache (plain KV caches, not quantized, one
    # rank): the scheduler may preempt its rows (actors/kv_memory.py).
    preemptible: bool = False
    # Speculative decoding: "" = off, else "draft:<name> k=K" or "ngram k=K n=MIN..MAX".
    speculation: str = ""
    # An embedding model's pooling (sentence-transformers files): it serves /v1/embeddings only.
    embedding: Pooling | None = None
    # A vision-language model: it takes images (api/images.py), preprocessed with this config,
    # each one's features at a run of `image_token_id` tokens in the prompt.
    vision: bool = False
    image_token_id: int = -1
    image_processor: ImageProcessor | None = None
    # Videos and audio clips beside images (api/images.py): how its prompts hold each kind it
    # takes (None: images at runs of `image_token_id`), and their processors.
    media_layout: MediaLayout | None = None
    video_processor: VideoProcessorConfig | None = None
    audio_processor: AudioFeatureConfig | None = None


def loaded_fields(loaded: LoadedModel) -> dict[str, Any]:
    """ModelInfo's fields read off the loaded model: an embedding model's pooling, and the vision
    fields of one with a vision tower (it encodes images)."""
    model = loaded.model
    state = getattr(model, "state_bytes_per_row", None)
    common = {"embedding": loaded.pooling, "state_bytes_per_row": state(loaded.kv_dtype.size) if state else 0}
    kinds = getattr(model, "media_kinds", ())
    if "image" not in kinds:
        return common
    processor = getattr(model, "image_processor_class", ImageProcessorConfig).read(loaded.path)
    vision = {"vision": True, "image_token_id": int(model.image_token_id), "image_processor": processor}
    vision["media_layout"] = model.media_layout()
    if "video" in kinds:
        vision["video_processor"] = VideoProcessorConfig.read(loaded.path)
    if "audio" in kinds:
        vision["audio_processor"] = AudioFeatureConfig.read(loaded.path)
    return {**common, **vision}


def kv_fields(
    scheme: KVScheme, *, num_layers: int, dtype_name: str, dtype_bytes: int, prefill_chunk: int
) -> dict[str, Any]:
    """ModelInfo's kv_* fields for a loaded model stored under `scheme`, whose full-precision KV
    has dtype `dtype_name` (e.g. "bfloat16"). A long prompt's rows turn quantized at the first
    prefill-chunk end at or past the scheme's start."""
    quantized = scheme.quantized
    return {
        "kv_scheme": scheme.labelled(dtype_name),
        "kv_quant_ratio": scheme.ratio(num_layers, dtype_bytes),
        "kv_quantized_from": scheme.conversion_point(10**9, prefill_chunk) if quantized else 0,
        "kv_group_size": scheme.group_size,
        "kv_bits": scheme.bits,
        "kv_start": scheme.start,
        "kv_paged": scheme.paged,
    }


@attrs.frozen
class AdapterReport:
    """A mounted LoRA adapter, as the trio side sees it (model/lora/adapters.py `AdapterInfo`'s values)."""

    id: str
    path: str
    fine_tune_type: str
    rank: int
    nbytes: int
    fingerprint: str


class AdapterNotMounted(ValueError):
    """A row named an adapter the worker does not have mounted (it was unmounted meanwhile)."""


class NotAnEmbeddingModel(ValueError):
    """`embed` on a model without a Pooling module: it has no embeddings to give."""


class Worker(Protocol):
    async def open_row(self, spec: RowSpec) -> RowOpened: ...

    async def prefill(self, row_id: int, max_tokens: int | None = None) -> PrefillProgress: ...

    async def prefill_group(self, row_ids: list[int]) -> list[PrefillProgress]: ...

    async def fork_rows(self, source_id: int, specs: list[RowSpec]) -> list[RowOpened]: ...

    async def join(self, row_id: int) -> TokenOut: ...

    async def join_group(self, row_ids: list[int]) -> list[TokenOut | None]: ...

    async def step(self) -> list[TokenOut]: ...

    async def close_row(self, row_id: int, *, reusable: bool, retain_s: float | None = None) -> None:
        """The row leaves; `reusable`: its KV goes to the prompt cache (protected for `retain_s`:
        a preempted row's, until it resumes)."""
        ...

    async def mount_adapter(self, adapter_id: str, path: str) -> AdapterReport:
        """Load and mount a LoRA adapter (ValueError: the engine's reason it cannot)."""
        ...

    async def unmount_adapter(self, adapter_id: str) -> bool:
        """True: gone now; False: it leaves once the rows using it close (ValueError: not mounted)."""
        ...

    async def embed(self, inputs: list[list[int]], *, dimensions: int | None = None) -> list[list[float]]:
        """One pooled vector per input (`ModelInfo.embedding`), run as jobs of their own between
        the scheduler's calls (NotAnEmbeddingModel: the model has no pooling)."""
        ...

    def abort(self, row_id: int) -> None:
        """An opened row is leaving (it will be closed, not reused): a prefill forward of it
        stops at its next check between layers. Never blocks; safe while a call runs."""
        ...


@runtime_checkable
class LosesRows(Protocol):
    """A worker whose engine can die and come back (actors/isolate/worker.py): `on_lost(error)` is
    told, on the trio thread, the moment every row it had opened is gone (the root hands it to the
    scheduler as `WorkerLost`)."""

    on_lost: Callable[[Exception], None] | None
