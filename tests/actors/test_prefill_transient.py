"""Admission bills the prefill transient of the chunk in use and the model's shape."""

from __future__ import annotations

import trio

from actors.options import options as serve_options
from actors.root import start_actors
from model.engine.prefill_memory import prefill_transient_bytes
from tests.fakes import FakeTokenizer
from tests.helpers.workers import gpu_worker

# An 8B llama's config.json keys (32 heads of 128 over 8 KV heads, MLP 14336).
LLAMA_8B = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
}


def test_the_transient_follows_the_chunk_and_the_shape():
    per_token = 2 * (4 * 4096 + (32 + 2 * 8) * 128 + 3 * 14336)  # bf16 activations of one token
    assert prefill_transient_bytes(LLAMA_8B, chunk=2048, dtype_bytes=2) == 2048 * (per_token + 4 * 32 * 2048)
    sizes = [prefill_transient_bytes(LLAMA_8B, chunk=c, dtype_bytes=2) for c in (512, 2048, 8192)]
    assert sizes == sorted(sizes) and sizes[2] > 4 * sizes[1]  # the scores grow with the square
    # a routed-experts model's MLP is its experts' per token; a multimodal one's text part counts
    moe = {**LLAMA_8B, "intermediate_size": 0, "moe_intermediate_size": 768, "num_experts_per_tok": 8}
    assert prefill_transient_bytes(moe, chunk=64, dtype_bytes=2) > prefill_transient_bytes(
        {**moe, "num_experts_per_tok": 1}, chunk=64, dtype_bytes=2
    )
    assert prefill_transient_bytes({"text_config": LLAMA_8B}, chunk=64, dtype_bytes=2) == prefill_transient_bytes(
        LLAMA_8B, chunk=64, dtype_bytes=2
    )


async def _ceiling(model_dir, chunk: int, budget_gb: float):
    worker = gpu_worker(model_dir, eos_token_ids=[], prefill_chunk=chunk, memory_budget_gb=budget_gb)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery,
            worker,
            options=worker.options,
            make_tokenizer=lambda info: FakeTokenizer(),
        )
        nursery.cancel_scope.cancel()
    return handles


async def test_a_larger_prefill_chunk_leaves_a_smaller_memory_context(qwen3_dir):
    with trio.fail_after(120):
        small = await _ceiling(qwen3_dir, 256, 0.3)
        large = await _ceiling(qwen3_dir, 4096, 0.3)
    assert small.info.prefill_transient_bytes < large.info.prefill_transient_bytes
    assert small.ceiling.memory_context(1) > large.ceiling.memory_context(1)
    stats = large.stats()["admission"]
    assert stats["prefill_transient_bytes"] == large.info.prefill_transient_bytes
    # A tiny model is billed a small transient: its budget is not swallowed by an 8B's constant.
    assert stats["usable_bytes"] > 0 and small.info.prefill_transient_bytes < 10**7
    assert serve_options(prefill_chunk=4096).engine.prefill_chunk == 4096
