"""Audio clips (WAV or MP3 bytes) to mono float32 samples at the tower's rate.

`read_audio_header` reads a clip's header (WAV: the stdlib's `wave`; MP3: the container's stated
duration), so its length, and so its tokens, are known before it is decoded. `decode_audio`
decodes it with PyAV (FFmpeg's decoders and its resampler, libswresample, bundled in PyAV's
wheels: no MP3 decoder or resampler of our own) at `rate` (16 kHz for Gemma 4's feature
extractor) and mixes it down to one channel, the channels' mean (as librosa's `to_mono`). It runs
on api/media.py's threads.
"""

from __future__ import annotations

import io
import wave
from typing import Any

import attrs
import numpy as np

SAMPLE_RATE = 16_000
FORMATS = ("wav", "mp3")


class AudioError(ValueError):
    """A clip that cannot be decoded or accepted (the API answers 400)."""


@attrs.frozen
class AudioHeader:
    seconds: float
    rate: int  # the clip's own sample rate
    channels: int


def read_audio_header(data: bytes, fmt: str) -> AudioHeader:
    """The clip's length and rate from its header (nothing decoded). Raises AudioError."""
    if fmt == "wav":
        try:
            with wave.open(io.BytesIO(data)) as clip:
                rate, channels, frames = clip.getframerate(), clip.getnchannels(), clip.getnframes()
        except (wave.Error, EOFError, ValueError) as e:
            raise AudioError(f"cannot decode audio: not a PCM WAV file ({e})") from None
        if rate <= 0 or channels <= 0:
            raise AudioError("cannot decode audio: the WAV header states no rate or channels")
        return AudioHeader(frames / rate, rate, channels)
    if fmt != "mp3":
        raise AudioError(f"unsupported audio format {fmt!r} (wav or mp3)")
    container = _open(data)
    try:
        stream = container.streams.audio[0]
        rate, channels = int(stream.codec_context.sample_rate or 0), int(stream.codec_context.channels or 0)
        if stream.duration and stream.time_base:
            seconds = float(stream.duration * stream.time_base)
        else:
            seconds = (container.duration or 0) / 1e6
        if rate <= 0 or seconds <= 0:
            raise AudioError("cannot decode audio: the MP3 states no rate or duration")
        return AudioHeader(seconds, rate, max(channels, 1))
    finally:
        container.close()


def _open(data: bytes) -> Any:
    import av  # (FFmpeg: imported on first use, on a media thread)

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception as e:  # PyAV raises many types for what is not audio
        raise AudioError(f"cannot decode audio: {e}") from None
    if not container.streams.audio:
        container.close()
        raise AudioError("cannot decode audio: it has no audio stream")
    return container


def decode_audio(data: bytes, rate: int = SAMPLE_RATE) -> np.ndarray:
    """The clip's samples, one channel (the channels' mean) at `rate`, float32 in [-1, 1].
    Raises AudioError."""
    import av

    container = _open(data)
    stream = container.streams.audio[0]
    channels = max(int(stream.codec_context.channels or 1), 1)
    # Each channel resampled as it is (interleaved float32), then their mean: librosa's mono.
    resampler = av.AudioResampler(format="flt", layout=stream.codec_context.layout, rate=rate)
    parts: list[np.ndarray] = []
    try:
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                parts.append(out.to_ndarray().reshape(-1, channels).mean(axis=1, dtype=np.float32))
        for out in resampler.resample(None):  # the resampler's tail
            parts.append(out.to_ndarray().reshape(-1, channels).mean(axis=1, dtype=np.float32))
    except Exception as e:  # corrupt data past the header
        raise AudioError(f"cannot decode audio: {e}") from None
    finally:
        container.close()
    if not parts:
        raise AudioError("cannot decode audio: no samples decode")
    return np.concatenate(parts).astype(np.float32, copy=False)
