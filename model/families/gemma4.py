"""Gemma 4 (model_type gemma4) as its checkpoints ship it: the text model (model/families/
gemma4_text.py) with its vision tower (model/vision/gemma4.py) and, on E2B and E4B, its audio
tower (model/audio/gemma4.py); a checkpoint without the towers' weights is the text model.

Each image becomes `<|image>`, its soft tokens' pads, `<image|>`; each audio clip `<|audio>`, its
pads, `<audio|>` (model/media.py). Their features replace the pads' embeddings (the text's are
scaled by √hidden, the features are not), and the per-layer inputs of a pad are token 0's. With
`use_bidirectional_attention: "vision"` an image's tokens see each other in the sliding layers
(Hugging Face's mask: within the window, full layers stay causal; mlx-vlm 0.7.10 also opens the
full layers), so a prefill chunk never cuts an image (`atomic_media`). Positions are plain RoPE.
Op for op as mlx-vlm's gemma4 (greedy tokens equal its generate on the same weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from model.audio.gemma4 import AudioArgs, AudioTower
from model.engine.rows import ImageInput
from model.families import gemma4_text
from model.families.gemma4_text import SLIDING, Gemma4TextModel
from model.kv.cache import LayerCache, causal_mask
from model.media import KindLayout, MediaLayout
from model.nn.language_model import AfterLayer, LanguageModel
from model.vision.gemma4 import Embedder, Gemma4ImageConfig, VisionArgs, VisionTower

MODEL_TYPES: tuple[str, ...] = ("gemma4",)  # (a text-only checkpoint: gemma4_text.build's model)
_TOWERS = ("vision_tower", "embed_vision", "audio_tower", "embed_audio")


class Gemma4Model(Gemma4TextModel):
    image_processor_class = Gemma4ImageConfig

    def __init__(self, args: Any, vision: VisionArgs, audio: AudioArgs | None, ids: dict[str, int], bidi: bool):
        super().__init__(args)
        self.vision_tower = VisionTower(vision)
        self.embed_vision = Embedder(vision.hidden_size, args.hidden_size, vision.rms_norm_eps)
        kinds = {"image"}
        if audio is not None:
            self.audio_tower = AudioTower(audio)
            self.embed_audio = Embedder(audio.output_dims, args.hidden_size, audio.rms_norm_eps)
            kinds.add("audio")
        self.media_kinds = frozenset(kinds)
        self.atomic_media = frozenset({"image"}) if bidi else frozenset()
        self.ids = ids
        self.image_token_id, self.audio_token_id = ids["image_token_id"], ids["audio_token_id"]

    def media_token_ids(self) -> dict[str, int]:
        return {"image": self.image_token_id, "audio": self.audio_token_id}

    def media_layout(self) -> MediaLayout:
        i, image, audio = self.ids, self.image_token_id, self.audio_token_id
        kinds = [("image", KindLayout((image,), image, (i["boi_token_id"],), (i["eoi_token_id"],)))]
        if "audio" in self.media_kinds:
            kinds.append(("audio", KindLayout((audio,), audio, (i["boa_token_id"],), (i["eoa_token_id"],))))
        return MediaLayout(tuple(kinds))

    def encode_media(self, items: Sequence[ImageInput]) -> mx.array:
        """A row's images and clips (model/engine/image_rows.py) -> their soft tokens, in order:
        each image through the vision tower alone; a clip's first `runs` encoder frames (its
        valid ones, Hugging Face's count)."""
        out = []
        for item in items:
            if item.kind == "image":
                out.append(self.embed_vision(self.vision_tower(mx.array(item.pixels), item.grid_thw)))
                continue
            _, frames, valid = item.grid_thw
            padding = (mx.arange(frames) >= valid)[None]  # (the mel frames past the clip's end)
            encoded, _ = self.audio_tower(mx.array(item.pixels)[None], padding)
            features = self.embed_audio(encoded)[0]
            n = item.runs[0]
            if features.shape[0] < n:  # (never for a clip the features were made for)
                features = mx.concatenate([features, mx.zeros((n - features.shape[0], features.shape[1]))])
            out.append(features[:n])
        return mx.concatenate(out)

    def _is_media(self, tokens: mx.array) -> mx.array:
        return (tokens == self.image_token_id) | (tokens == self.audio_token_id)

    def embed_with_images(self, tokens: mx.array, image_features: mx.array) -> mx.array:
        """[1, L] tokens -> [1, L, hidden] embeddings (scaled) whose pad rows are the features."""
        h = self.model.embed_tokens(tokens) * self.args.hidden_size**0.5
        is_media = self._is_media(tokens)
        count = int(np.asarray(is_media).sum())
        if count != image_features.shape[0]:
            raise ValueError(f"{count} image-pad tokens but {image_features.shape[0]} image features")
        if count == 0:
            return h
        index = mx.where(is_media, mx.cumsum(is_media.astype(mx.int32), axis=-1) - 1, 0)
        return mx.where(mx.expand_dims(is_media, -1), image_features[index].astype(h.dtype), h)

    def __call__(
        self,
        tokens: mx.array,
        caches: Sequence[LayerCache],
        *,
        unfused_attention: bool = False,
        after_layer: AfterLayer | None = None,
        embeddings: mx.array | None = None,
    ) -> mx.array:
        """`embeddings` ([B, L, hidden], from `embed_with_images`) replace the token lookup of a
        prompt with media; its pads' per-layer inputs are token 0's."""
        if embeddings is None:
            return super().__call__(tokens, caches, unfused_attention=unfused_attention, after_layer=after_layer)
        a, body, h = self.args, self.model, embeddings
        is_media = self._is_media(tokens)
        per_layer = None
        if a.hidden_size_per_layer_input:
            per_layer = body.per_layer_inputs(mx.where(is_media, 0, tokens), h)
        L = h.shape[1]
        masks: dict[str, Any] = {kind: caches[a.layer_types.index(kind)].make_mask(L) for kind in set(a.layer_types)}
        if self.atomic_media and L > 1 and SLIDING in masks:
            masks[SLIDING] = self._bidirectional(masks[SLIDING], caches[a.layer_types.index(SLIDING)], tokens)
        shared: list[Any] = [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            src, pli = a.kv_source(i), per_layer if per_layer is None else per_layer[:, :, i, :]
            cache, kv = (caches[i], None) if src == i else (None, shared[src])
            h, shared[i] = layer(h, masks[a.layer_types[i]], cache, pli, kv)
            if after_layer is not None:
                after_layer(i, h)
        return body.norm(h)

    def _bidirectional(self, mask: Any, cache: LayerCache, tokens: mx.array) -> mx.array:
        """A sliding layer's mask for this chunk, each image's tokens also seeing the later ones of
        the same image (the whole image is in the chunk: `atomic_media`)."""
        L = tokens.shape[1]
        if not isinstance(mask, mx.array):  # "causal": no key is out of the window yet
            mask = causal_mask(L, min(cache.offset, self.args.sliding_window - 1))
        is_image = np.asarray(tokens[0] == self.image_token_id)
        starts = is_image & ~np.concatenate([[False], is_image[:-1]])
        block = np.where(is_image, np.cumsum(starts) - 1, -1)
        later = np.arange(L)[None, :] > np.arange(L)[:, None]
        same = (block[:, None] == block[None, :]) & (block[:, None] >= 0) & later
        pad = np.zeros((L, mask.shape[-1] - L), dtype=bool)
        return mask | mx.array(np.concatenate([pad, same], axis=1))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The text model's keys as gemma4_text's; the towers' as `vision_tower.*`,
        `embed_vision.*`, `audio_tower.*`, `embed_audio.*` (PyTorch conv layouts moved)."""
        towers: dict[str, mx.array] = {}
        text: dict[str, mx.array] = {}
        for key, value in weights.items():
            bare = key.removeprefix("model.")
            if bare.split(".")[0] in _TOWERS:
                if "rotary_emb" not in bare:
                    towers[bare] = value
            else:
                text[key] = value
        if not any(k.startswith("vision_tower.") for k in towers):  # a text-only conversion
            for name in _TOWERS:
                self.pop(name, None)
            self.media_kinds, self.atomic_media = frozenset(), frozenset()
            return super().sanitize(text)
        if "audio" not in self.media_kinds:
            towers = {k: v for k, v in towers.items() if not k.startswith(("audio_tower.", "embed_audio."))}
        if not self.vision_tower.args.use_clipped_linears:
            clips = ("input_min", "input_max", "output_min", "output_max")
            towers = {k: v for k, v in towers.items() if not (k.startswith("vision_tower.") and k.endswith(clips))}
        if "audio" in self.media_kinds:
            towers = self.audio_tower.sanitize(towers, "audio_tower.")
        return {**super().sanitize(text), **towers}


def build(config: dict[str, Any], has_lm_head: bool) -> LanguageModel:
    text_model = gemma4_text.build(config, has_lm_head)
    if not config.get("vision_config") or "text_config" not in config:
        return text_model
    assert isinstance(text_model, Gemma4TextModel)
    text = config["text_config"]
    ids = {
        "image_token_id": int(config.get("image_token_id", 258880)),
        "audio_token_id": int(config.get("audio_token_id", 258881)),
        "boi_token_id": int(config.get("boi_token_id", 255999)),
        "eoi_token_id": int(config.get("eoi_token_id", 258882)),
        "boa_token_id": int(config.get("boa_token_id", 256000)),
        "eoa_token_id": int(config.get("eoa_token_id", 258883)),
    }
    audio = AudioArgs.from_config(config["audio_config"]) if config.get("audio_config") else None
    bidi = text.get("use_bidirectional_attention") == "vision"
    return Gemma4Model(text_model.args, VisionArgs.from_config(config["vision_config"]), audio, ids, bidi)
