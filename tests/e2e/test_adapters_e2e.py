"""LoRA adapters through a real `python -m actors.serve` subprocess and a tiny model: an adapter
given with `--adapter` changes greedy output when a request names it; another mounts and
unmounts over /v1/adapters; /v1/models lists what is mounted; a DoRA adapter stacked with
another is a 400 before anything is queued, streams included."""

from __future__ import annotations

import sys

import httpx
import pytest

from tests.e2e.server_process import end, wait_until_serving
from tests.e2e.server_process import launch_quick as launch
from tests.fixtures.lora import write_adapter

STARTUP_LIMIT_S = 120.0

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def test_adapters_on_a_real_server(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("qwen3")
    first = write_adapter(tmp_path / "adapters" / "a", model_dir, seed=1)
    second = write_adapter(tmp_path / "adapters" / "b", model_dir, seed=2, rank=2)
    log_path = tmp_path / "server.log"
    proc = launch(["--model", str(model_dir), "--adapter", f"a={first}", "--adapters-dir", str(first.parent)], log_path)
    try:
        base = wait_until_serving(proc, log_path, STARTUP_LIMIT_S)
        with httpx.Client(base_url=base, timeout=60) as client:
            served = client.get("/v1/models").json()["data"][0]["id"]

            def complete(**extra: object) -> list[str]:
                body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 8, "temperature": 0.0, "logprobs": 0, **extra}
                body["return_tokens_as_token_ids"] = True  # tokens as "token_id:<id>"
                response = client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                return response.json()["choices"][0]["logprobs"]["tokens"]

            plain = complete(adapter="none")
            adapted = complete(adapter="a")
            assert adapted != plain
            assert complete(model=f"{served}:a") == adapted
            assert complete() == adapted  # the one --adapter is the default of requests naming none
            assert complete(adapter="none") == plain  # the base model is untouched (and its cache entries too)

            mounted = client.post("/v1/adapters", json={"id": "b", "path": str(second)})
            assert mounted.status_code == 200, mounted.text
            assert (mounted.json()["rank"], mounted.json()["bytes"] > 0) == (2, True)
            assert complete(adapter="b") != plain
            assert complete(adapter="a+b") not in (plain, adapted)
            ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
            assert ids == [served, f"{served}:a", f"{served}:b"]
            available = client.get("/v1/adapters/available").json()["data"]
            assert [(e["id"], e["compatible"], e["mounted"]) for e in available] == [
                ("a", True, True),
                ("b", True, True),
            ]

            dora = write_adapter(tmp_path / "adapters" / "d", model_dir, seed=3, fine_tune_type="dora")
            assert client.post("/v1/adapters", json={"id": "d", "path": str(dora)}).json()["type"] == "dora"
            assert complete(adapter="d") != plain
            for extra in [{"adapter": "a+d"}, {"model": f"{served}:d+b"}, {"adapter": "a+d", "stream": True}]:
                chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
                refused = client.post("/v1/chat/completions", json=chat)
                assert refused.status_code == 400, (extra, refused.text)
                assert refused.json()["error"]["code"] == "adapter_not_stackable", extra
            assert client.delete("/v1/adapters/d").json() == {"id": "d", "unmounted": True}

            gone = client.delete("/v1/adapters/b")
            assert gone.json() == {"id": "b", "unmounted": True}
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [served, f"{served}:a"]
            refused = client.post("/v1/completions", json={"prompt": "hi", "adapter": "b"})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "adapter"
            assert complete(adapter="a") == adapted
    finally:
        code = end(proc)
    assert code == 0, log_path.read_text()


def test_a_bad_adapter_flag_fails_start_up_in_one_line(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("qwen3")
    log_path = tmp_path / "server.log"
    proc = launch(["--model", str(model_dir), "--adapter", f"a={tmp_path / 'missing'}"], log_path)
    code = proc.wait(timeout=STARTUP_LIMIT_S)
    errors = [line for line in log_path.read_text().splitlines() if "cannot serve" in line]
    assert code == 2 and len(errors) == 1 and "--adapter a=" in errors[0], log_path.read_text()
