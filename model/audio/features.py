"""Gemma 4's audio features: a clip's 16 kHz samples to log-mel frames, as Hugging Face's
Gemma4AudioFeatureExtractor (and mlx-vlm's numpy port of it) makes them, and the clip's tokens.

Semicausal framing (half a frame of zeros before the clip), 20 ms Hann-windowed frames every
10 ms, the magnitude of a 512-point FFT, an HTK mel filter bank of 128 bins up to 8 kHz, the log
of it above a floor. The clip is zero-padded to a multiple of 128 samples; frames that reach past
its end are zeroed. Its tokens are the frames the audio tower keeps after its two stride-2
convolutions (Hugging Face's `_compute_audio_num_tokens`), at most 750 (30 s).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np

MAX_TOKENS = 750  # the processor's audio_seq_length: 30 s at 40 ms a token


@attrs.frozen
class AudioFeatureConfig:
    feature_size: int = 128
    sampling_rate: int = 16_000
    frame_length_ms: float = 20.0
    hop_length_ms: float = 10.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    mel_floor: float = 1e-3
    pad_to_multiple_of: int = 128
    max_tokens: int = MAX_TOKENS

    @classmethod
    def read(cls, model_dir: Path) -> AudioFeatureConfig:
        """processor_config.json's `feature_extractor` (Gemma 4's checkpoints ship none: the USM
        defaults, as Hugging Face's and mlx-vlm's processors take them)."""
        raw: dict[str, Any] = {}
        for name in ("processor_config.json", "preprocessor_config.json"):
            path = model_dir / name
            if path.exists():
                raw = json.loads(path.read_text(encoding="utf-8"))
                break
        fe, d = raw.get("feature_extractor") or {}, cls()
        return cls(
            feature_size=int(fe.get("feature_size", d.feature_size)),
            sampling_rate=int(fe.get("sampling_rate", d.sampling_rate)),
            frame_length_ms=float(fe.get("frame_length_ms", d.frame_length_ms)),
            hop_length_ms=float(fe.get("hop_length_ms", d.hop_length_ms)),
            min_frequency=float(fe.get("min_frequency", d.min_frequency)),
            max_frequency=float(fe.get("max_frequency", d.max_frequency)),
            mel_floor=float(fe.get("mel_floor", d.mel_floor)),
            max_tokens=int(raw.get("audio_seq_length", d.max_tokens)),
        )

    @property
    def frame_length(self) -> int:
        return int(round(self.sampling_rate * self.frame_length_ms / 1000.0))

    @property
    def hop_length(self) -> int:
        return int(round(self.sampling_rate * self.hop_length_ms / 1000.0))

    def valid_frames(self, samples: int) -> int:
        """The mel frames of a clip of `samples` samples that end within it (the rest are padding)."""
        return max((samples + self.frame_length // 2 - (self.frame_length + 1)) // self.hop_length + 1, 0)

    def tokens(self, samples: int) -> int:
        """The tokens of a clip of `samples` samples: its mel frames through two stride-2 convolutions."""
        frames = self.valid_frames(samples)
        if frames <= 0:
            return 0
        for _ in range(2):
            frames = (frames + 2 - 3) // 2 + 1
        return min(frames, self.max_tokens)


def mel_filter_bank(bins: int, mels: int, low: float, high: float, rate: int) -> np.ndarray:
    """[bins, mels] HTK triangles (float64), as transformers' `mel_filter_bank(norm=None, mel_scale="htk")`."""
    mel_low, mel_high = 2595.0 * np.log10(1.0 + (low / 700.0)), 2595.0 * np.log10(1.0 + (high / 700.0))
    filter_freqs = 700.0 * (np.power(10, np.linspace(mel_low, mel_high, mels + 2) / 2595.0) - 1.0)
    fft_freqs = np.linspace(0, rate // 2, bins)
    diff = np.diff(filter_freqs)
    slopes = np.expand_dims(filter_freqs, 0) - np.expand_dims(fft_freqs, 1)
    down, up = -slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]
    return np.maximum(np.zeros(1), np.minimum(down, up))


def log_mel(samples: np.ndarray, config: AudioFeatureConfig) -> np.ndarray:
    """[frames, feature_size] float32 log-mel features of one clip (frames past its end zeroed)."""
    c = config
    frame_length, hop = c.frame_length, c.hop_length
    fft_length = 2 ** math.ceil(math.log2(frame_length))
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(frame_length, dtype=np.float32) / frame_length)
    filters = mel_filter_bank(fft_length // 2 + 1, c.feature_size, c.min_frequency, c.max_frequency, c.sampling_rate)
    length = -(-len(samples) // c.pad_to_multiple_of) * c.pad_to_multiple_of
    wave = np.zeros((1, length + frame_length // 2), dtype=np.float32)
    wave[0, frame_length // 2 : frame_length // 2 + len(samples)] = samples
    valid = np.zeros(length + frame_length // 2, dtype=np.int32)
    valid[frame_length // 2 : frame_length // 2 + len(samples)] = 1
    count = (wave.shape[1] - (frame_length + 1)) // hop + 1
    if count <= 0:
        return np.zeros((0, c.feature_size), dtype=np.float32)
    frames = np.lib.stride_tricks.as_strided(
        wave, shape=(1, count, frame_length + 1), strides=(wave.strides[0], wave.strides[1] * hop, wave.strides[1])
    )[..., :-1]
    magnitude = np.abs(np.fft.rfft(frames * window, n=fft_length, axis=-1))
    spectrogram = np.log(np.matmul(magnitude, filters) + np.array(c.mel_floor, dtype=np.float64))[0]
    keep = valid[np.arange(count) * hop + frame_length].astype(bool)
    return spectrogram.astype(np.float32) * keep[:, None]
