"""One decode step's attention for one layer: over a contiguous KV buffer (today's layout) vs over
the same KV held in a shuffled pool of fixed blocks and gathered each step through a block table
(paged KV without a paged-attention kernel: MLX's fused attention takes only dense buffers).

    python benchmarks/paged_gather_cost.py --rows 8 --context 4096 --dtype bfloat16
"""

import argparse
import json
import time

import mlx.core as mx

p = argparse.ArgumentParser()
p.add_argument("--rows", type=int, default=8)
p.add_argument("--context", type=int, default=4096)
p.add_argument("--block", type=int, default=256)
p.add_argument("--dtype", default="float32")
p.add_argument("--iters", type=int, default=30)
a = p.parse_args()
dt = getattr(mx, a.dtype)
B, Hk, Hq, D, L, bs = a.rows, 8, 32, 128, a.context, a.block
nb = L // bs
keys = mx.random.normal((B, Hk, L, D)).astype(dt)
values = mx.random.normal((B, Hk, L, D)).astype(dt)
# the pool: every row's blocks, shuffled
perm = mx.random.permutation(B * nb)
pool_k = keys.transpose(0, 2, 1, 3).reshape(B * nb, bs, Hk, D)[mx.argsort(perm)]
pool_v = values.transpose(0, 2, 1, 3).reshape(B * nb, bs, Hk, D)[mx.argsort(perm)]
table = perm.reshape(B, nb)
q = mx.random.normal((B, Hq, 1, D)).astype(dt)
scale = D**-0.5
mx.eval(keys, values, pool_k, pool_v, table, q)


def contiguous():
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)


def paged():
    k = pool_k[table].reshape(B, L, Hk, D).transpose(0, 2, 1, 3)
    v = pool_v[table].reshape(B, L, Hk, D).transpose(0, 2, 1, 3)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)


assert mx.allclose(contiguous(), paged(), atol=1e-3).item()
res = {}
for name, f in (("contiguous", contiguous), ("paged_gather", paged)) * 2:
    for _ in range(3):
        mx.eval(f())
    t = time.perf_counter()
    for _ in range(a.iters):
        mx.eval(f())
    res[name] = (time.perf_counter() - t) / a.iters * 1e3
res["ratio"] = res["paged_gather"] / res["contiguous"]
print(json.dumps({**vars(a), "ms_per_layer_step": res}))
