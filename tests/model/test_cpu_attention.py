"""model.kernels.cpu_attention: blocked causal attention must give MLX's own CPU bits, not close ones."""

import mlx.core as mx
import numpy as np
import pytest

from model.kernels import cpu_attention

pytestmark = pytest.mark.skipif(mx.default_device().type != mx.cpu, reason="MLX's CPU fallback")


def _same_bits(a: mx.array, b: mx.array) -> bool:
    return np.array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32))


# (batch, q heads, kv heads, queries, keys, head_dim): a solo prompt, a right-padded group, a
# chunk after a cached prefix (queries are the last positions), GQA 1/2/4, MHA, a long prompt
# (the key lengths where a shorter p @ v product rounds differently), a length under one block.
SHAPES = [
    (1, 4, 2, 265, 265, 64),
    (7, 4, 2, 290, 290, 64),
    (1, 4, 2, 100, 612, 64),
    (2, 16, 8, 333, 333, 128),
    (1, 4, 4, 1100, 1100, 64),
    (1, 8, 2, 129, 2048, 32),
    (3, 4, 2, 17, 17, 64),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_blocked_causal_attention_is_mlx_bit_for_bit(shape):
    B, hq, hk, L, kL, D = shape
    rng = np.random.default_rng(sum(shape))
    q, k, v = (
        mx.array((rng.standard_normal((B, h, n, D)) * s).astype(np.float32))
        for h, n, s in ((hq, L, 3.0), (hk, kL, 3.0), (hk, kL, 1.0))
    )
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal")
    # forced block sizes, one block (the softmax split over CPU streams), and the automatic choice
    for block in (16, cpu_attention.BLOCK, 100, L, None):
        assert _same_bits(cpu_attention.causal_attention(q, k, v, D**-0.5, block=block), theirs), block


def test_it_applies_to_causal_float32_prefills_it_can_make_cheaper():
    n = 3 * cpu_attention.BLOCK
    q = mx.zeros((1, 4, n, 64))
    keys = lambda before: mx.zeros((1, 2, before + n, 64))  # noqa: E731
    assert cpu_attention.applies(q, keys(0), "causal")  # blocks (and the self-check agreed with MLX)
    assert cpu_attention.applies(q, keys(n - 2 * cpu_attention.BLOCK), "causal")
    # a suffix after a long cached prefix: only a split softmax helps, which needs a second core
    several_cores = len(cpu_attention._streams()) > 1
    assert cpu_attention.applies(q, keys(4 * n), "causal") == several_cores
    few = cpu_attention.MIN_SPLIT_QUERIES - 1
    assert not cpu_attention.applies(mx.zeros((1, 4, few, 64)), mx.zeros((1, 2, few + 500, 64)), "causal")
    assert not cpu_attention.applies(q, keys(0), None)
    assert not cpu_attention.applies(q, keys(0), mx.ones((1, 1), mx.bool_))
    assert not cpu_attention.applies(q.astype(mx.bfloat16), keys(0).astype(mx.bfloat16), "causal")


def test_a_disagreeing_build_falls_back_to_mlx(monkeypatch):
    monkeypatch.setattr(cpu_attention, "_state", {"enabled": True, "checked": False})
    monkeypatch.setattr(cpu_attention, "causal_attention", lambda q, k, v, scale, block=None: q * 0)
    assert not cpu_attention.applies(mx.zeros((1, 4, 200, 64)), mx.zeros((1, 2, 200, 64)), "causal")
    assert cpu_attention._state == {"enabled": False, "checked": True}


def test_a_second_mlx_thread_gets_streams_of_its_own():
    """MLX streams belong to the thread that made them: a later server's MLX thread (or a
    restarted worker) must not reuse the first one's."""
    import threading

    rng = np.random.default_rng(5)
    q = mx.array(rng.standard_normal((1, 4, 40, 64)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 300, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 300, 64)).astype(np.float32))
    want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"))
    got = []
    for _ in range(2):
        t = threading.Thread(target=lambda: got.append(np.array(cpu_attention.causal_attention(q, k, v, 0.125))))
        t.start()
        t.join()
    assert len(got) == 2 and all(np.array_equal(g.view(np.uint32), want.view(np.uint32)) for g in got)
