"""How a family's prompts hold media, as plain values the API reads (api/images.py): for each kind
it takes (image, video, audio), the tokens a media part renders as, its pad token, and the tokens
around each of its pad runs.

A media part becomes its placeholder in the message text (any chat template renders text); once
the prompt is tokenized, each placeholder grows into its item's runs: for each run, its label's
tokens (a video frame's time), `open`, the run's pad tokens, `close`. Qwen's image placeholder is
`<|vision_start|><|image_pad|><|vision_end|>` and grows into the start, the pads, the end, as
Hugging Face's processors expand it; Gemma 4's is `<|image|>` (one token) and grows into
`<|image>`, the pads, `<image|>`.
"""

from __future__ import annotations

import attrs

KINDS = ("image", "video", "audio")


@attrs.frozen
class KindLayout:
    placeholder: tuple[int, ...]  # the tokens one media part renders as, its pad among them
    pad: int
    open: tuple[int, ...] = ()  # before each run's pads
    close: tuple[int, ...] = ()  # after them
    label: str = ""  # each run's label before it, formatted with its `seconds` ("" = none)

    def run_tokens(self, pads: int, label: list[int]) -> list[int]:
        return [*label, *self.open, *[self.pad] * pads, *self.close]


@attrs.frozen
class MediaLayout:
    kinds: tuple[tuple[str, KindLayout], ...]  # (kind, layout) for each kind the model takes

    def get(self, kind: str) -> KindLayout | None:
        return dict(self.kinds).get(kind)

    def names(self) -> frozenset[str]:
        return frozenset(kind for kind, _ in self.kinds)
