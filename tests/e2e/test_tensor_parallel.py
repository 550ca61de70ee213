"""`--tensor-parallel 2`: two processes on MLX's ring backend (localhost) serve one model.

The sharded forward equals the whole model's (two ring ranks, allclose logits, same argmax);
a server split over two ranks answers greedy requests with the token ids of the single-process
server and of mlx_lm; an aborted stream leaves both ranks healthy; SIGINT exits 0 and leaves no
follower behind; a follower that dies makes the server fail the request and exit 1, not hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from actors.tp.leader import _free_ports
from tests.e2e.server_process import wait_until_serving

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 9, 20, 33, 7, 100, 41, 250]
MAX_TOKENS = 16

# Not `slow`: these are CI's proof of tensor parallelism (about 9 s on two cores).
pytestmark = [
    pytest.mark.skipif(not mx.distributed.is_available(backend="ring"), reason="MLX's ring backend is not built in"),
]

_SHARD_SCRIPT = """
import json, sys
import mlx.core as mx
from model.kv.cache import make_caches
from model.load.loader import load_model
from model.nn.tensor_parallel import shard_model

group = mx.distributed.init(strict=True, backend="ring")
model = load_model(sys.argv[1]).model
tokens = mx.array([[1, 5, 9, 20, 33, 7, 60, 61]])
whole = model.logits(model(tokens, make_caches(len(model.layers))))
mx.eval(whole)
shard_model(model, group)
split = model.logits(model(tokens, make_caches(len(model.layers))))
mx.eval(split)
print(json.dumps({
    "rank": group.rank(),
    "close": mx.allclose(split, whole, rtol=1e-4, atol=1e-4).item(),
    "argmax": (split.argmax(-1) == whole.argmax(-1)).all().item(),
    "kv_heads": model.args.num_key_value_heads,
    "q_rows": model.layers[0].self_attn.q_proj.weight.shape[0],
}))
"""


def _ring(tmp_path: Path, n: int) -> Path:
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(n)]))
    return hostfile


@pytest.mark.parametrize("quant", [None, "q4"])
def test_the_sharded_forward_equals_the_whole_model(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, quant: str | None
) -> None:
    model_dir = tiny_model_factory("qwen3", quant=quant, group_size=32)
    hostfile = _ring(tmp_path, 2)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SHARD_SCRIPT, str(model_dir)],
            cwd=ROOT,
            env={**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    for rank, out in enumerate(outs):
        # 4 heads / 2 KV heads of 16 dims: each rank holds 2 query heads and 1 KV head.
        assert out == {"rank": rank, "close": True, "argmax": True, "kv_heads": 1, "q_rows": 32}


def _start(model_dir: Path, tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "actors.serve", "--model", str(model_dir), "--prompt-cache", "0", *extra]
        + ["--port", str(_free_ports(1)[0])],
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    return proc, wait_until_serving(proc, log, 120), log


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _greedy_ids(base: str) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0}
    body["return_tokens_as_token_ids"] = True  # the legacy logprobs block names tokens "token_id:<id>"
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return [int(t.removeprefix("token_id:")) for t in response.json()["choices"][0]["logprobs"]["tokens"]]


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    return proc.wait(timeout=30)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("qwen3")  # 4 heads, 2 KV heads: divides by 2


@pytest.fixture
def split_server(model_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    proc, base, _ = _start(model_dir, tmp_path, "tp2", "--tensor-parallel", "2")
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_greedy_tokens_equal_the_single_process_server_and_mlx_lm_and_survive_an_abort(
    model_dir: Path, tmp_path: Path, split_server: tuple[subprocess.Popen, str]
) -> None:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    proc, base = split_server
    single, single_base, _ = _start(model_dir, tmp_path, "tp1")
    try:
        expected = _greedy_ids(single_base)
    finally:
        assert _stop(single) == 0
    model = load(str(model_dir))[0]
    reference = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=MAX_TOKENS)]
    assert expected == reference
    assert _greedy_ids(base) == expected

    # A stream cut after a few chunks: its row leaves both ranks; the next request is whole.
    body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for i, _line in enumerate(response.iter_lines()):
            if i >= 6:
                break
    assert _greedy_ids(base) == expected
    assert proc.poll() is None and httpx.get(f"{base}/health", timeout=5).status_code == 200


def test_sigint_exits_0_and_leaves_no_follower(split_server: tuple[subprocess.Popen, str]) -> None:
    proc, base = split_server
    followers = _children(proc.pid)
    assert len(followers) == 1 and _alive(followers[0])
    assert _greedy_ids(base)
    assert _stop(proc) == 0
    deadline = time.monotonic() + 10
    while _alive(followers[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(followers[0])


def test_a_dead_follower_fails_the_request_and_the_server_exits_1(split_server: tuple[subprocess.Popen, str]) -> None:
    proc, base = split_server
    (follower,) = _children(proc.pid)
    os.kill(follower, signal.SIGKILL)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert response.status_code in (500, 503), response.text
    assert proc.wait(timeout=60) == 1
