"""Text around the model: `tokenizer`, `detokenizer` (streamed text), `chat_template` (a
sandboxed Jinja environment), `grammar` (structured outputs' constraints), `tool_grammar`
(tool calls in each model's markup)."""
