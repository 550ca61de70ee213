"""The plain values of a row's life: what the scheduler asks of the engine and what comes back.

The scheduler (trio side) and the engine (MLX side) speak only in these: token ids, counts and
sampling values, never MLX arrays, so they cross the GPU-worker's thread boundary as they are.
"""

from __future__ import annotations

import attrs
import numpy as np

from model.engine.params import SamplingParams


@attrs.frozen
class ImageInput:
    """One preprocessed media item of a row's prompt (model/vision/, model/audio/): an image, a
    video or an audio clip. Its values, its grid, the sha256 of its encoded bytes (the prompt-cache
    key's part) and the pad-token runs it fills in the prompt, in order."""

    pixels: np.ndarray = attrs.field(eq=False)  # patches (image, video) or log-mel frames (audio), float32
    grid_thw: tuple[int, int, int]  # image, video: the patch grid (t, h, w); audio: (1, mel frames, valid ones)
    digest: str
    kind: str = "image"  # "image" | "video" | "audio"
    runs: tuple[int, ...] = ()  # tokens of each of its pad runs (() = one run of t * h * w / merge^2)


@attrs.frozen
class RowSpec:
    row_id: int
    prompt: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    namespace: str = ""  # prompt-cache namespace (adapter ids; "" = base model)
    # Template-stable prefix length (cache/boundary.py): the engine snapshots the KV there so the
    # next turn of the conversation hits. None = no snapshot.
    snapshot_at: int | None = None
    # A client's retention hints (api/chat.py): (prompt position, seconds). The engine snapshots
    # the KV at each position and puts it protected from eviction for that long.
    retain: tuple[tuple[int, float], ...] = ()
    # A cached prefix shorter than this is not restored: the scheduler asks for it when it opens
    # rows to prefill together, where a short hit would only keep the row out of the group.
    min_cached_tokens: int = 1
    # LoRA adapters (ids, mounted on the engine) whose deltas this row's forwards add, in order.
    adapters: tuple[str, ...] = ()
    # Images whose features replace the prompt's image-pad runs, in order (a vision model only).
    images: tuple[ImageInput, ...] = ()
    # A preempted row resumed: the last `resumed` prompt tokens are ones it generated before
    # (its sampler goes on from them, keyed by the same steps), `max_tokens` what is left.
    resumed: int = 0


@attrs.frozen
class RowOpened:
    row_id: int
    cached_tokens: int  # prompt tokens restored from the prompt cache
    to_prefill: int  # prompt tokens still to forward before token 0 (excludes the last token)
    cache_created: int = 0  # the longest retention-hinted prefix this row's prefill will put


@attrs.frozen
class PrefillProgress:
    row_id: int
    done: int  # prompt tokens whose KV is now in the row's cache
    remaining: int  # 0 => the row is ready to join


@attrs.frozen
class TopLogprob:
    token: int
    logprob: float


@attrs.frozen
class TokenOut:
    row_id: int
    token: int
    # None while the row continues; "stop" on an EOS token; "length" when max_tokens is reached;
    # "error" when the row cannot go on (its grammar failed): `error` says why.
    finish: str | None = None
    logprob: float | None = None  # only when the row asked for logprobs
    top_logprobs: tuple[TopLogprob, ...] = ()
    error: str | None = None
    # Speculative decoding: on the first token a verification produced, the draft tokens it
    # checked and how many the target accepted (0, 0 on every other token).
    drafted: int = 0
    accepted: int = 0
