"""OpenAI's `prompt_cache_retention: "24h"` on the real engine (tiny qwen3 model, CPU, in process):
a Responses turn puts its system part and its conversation protected for 24 h, and the next turn,
continued with previous_response_id, reports the prefix it read as `cached_tokens`."""

from __future__ import annotations

import trio

from api.cache_hints import RETENTION_24H_S
from tests.realserver import real_server

LIMIT_S = 120
INSTRUCTIONS = " ".join(f"Rule {i}: answer briefly and name the colour {i % 7}." for i in range(60))


async def test_24h_retention_protects_the_prefixes_and_the_next_turn_reads_them(qwen3_dir):
    with trio.fail_after(LIMIT_S):
        async with real_server(qwen3_dir, prompt_cache_bytes=1 << 30) as server:
            body = {"input": "What is red?", "instructions": INSTRUCTIONS, "max_output_tokens": 4, "temperature": 0}
            first = await server.client.post("/v1/responses", json={**body, "prompt_cache_retention": "24h"})
            assert first.status_code == 200, await first.get_data()
            answer = await first.get_json()
            assert answer["prompt_cache_retention"] == "24h"

            def held(engine):
                return sorted(
                    len(e.ids) for e in engine.prompt_cache._entries.values() if e.retain_s == RETENTION_24H_S
                )

            lengths = await server.worker.inner.run_exclusive(held)
            prompt_tokens = answer["usage"]["input_tokens"]
            assert len(lengths) == 2 and 256 <= lengths[0] < lengths[1] < prompt_tokens  # system part, conversation

            follow = {"input": "And blue?", "previous_response_id": answer["id"], "max_output_tokens": 4}
            second = await server.client.post("/v1/responses", json=follow)
            assert second.status_code == 200, await second.get_data()
            cached = (await second.get_json())["usage"]["input_tokens_details"]["cached_tokens"]
            assert cached >= lengths[1]
