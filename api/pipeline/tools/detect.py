"""Which tool-call format a model speaks, from its chat template (and, failing that, its family)."""

from __future__ import annotations

# Scanned in mlx-lm's `_infer_tool_parser` priority order, restricted to the formats we parse:
# qwen3_coder must win over hermes because both templates contain "<tool_call>".
_TEMPLATE_SIGNATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qwen3_coder", ("<tool_call>\\n<function=",)),
    ("qwen3_coder", ("<tool_call>\n<function=",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("hermes", ("<tool_call>", "tool_call.name")),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>",)),
    ("llama3_json", ('"parameters": dictionary of argument name',)),
    # Llama 3.x templates that render calls as {"name": …, "parameters": …} without the
    # Meta system-prompt wording (custom / fine-tuned checkpoints).
    ("llama3_json", ("<|start_header_id|>", '"parameters"')),
)

# Only used when the template names no format (or there is no template).
_FAMILY_DEFAULTS = {
    "qwen2": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "qwen3_next": "hermes",
    "qwen2_5_vl": "hermes",
    # Qwen3.5's templates teach the XML call format of Qwen3-Coder.
    "qwen3_5": "qwen3_coder",
    "qwen3_5_moe": "qwen3_coder",
    "mistral": "mistral",
    "llama": "llama3_json",
}


def detect_tool_format(chat_template: str | None, model_type: str | None) -> str | None:
    if chat_template:
        for tool_format, needles in _TEMPLATE_SIGNATURES:
            if all(needle in chat_template for needle in needles):
                return tool_format
    return _FAMILY_DEFAULTS.get(model_type or "")
