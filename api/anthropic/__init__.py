"""Anthropic Messages: `routes` (/v1/messages, count_tokens), `translate` (the prompt part of
a body), `controls` (thinking, output_config, context edits, metadata), `encode` (the event stream
and whole messages)."""
