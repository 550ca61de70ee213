"""POST /v1/adapters against the real engine: an adapter_config.json with fields of the wrong
type or a non-finite scale is a 400 invalid_request_error naming the field (these were 500s, or
for a NaN scale an adapter that mounted and answered `!!!!`), and a path that cannot be read is
one message whether or not it exists. The listing of --adapters-dir marks the same directories
incompatible with the same reason."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from model.text.tokenizer import Tokenizer
from tests.fixtures.lora import write_adapter
from tests.helpers.workers import gpu_worker

UNREADABLE = "adapter 'x': PATH is not a readable adapter directory (adapter_config.json + adapters.safetensors)"


@asynccontextmanager
async def real_server(model_dir: Path, **config: Any) -> AsyncIterator[Any]:
    """The app over the real GPU worker (which mounts adapters), as the server builds it."""
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery,
            gpu_worker(model_dir),
            options=serve_options(batch=2, **config),
            make_tokenizer=lambda info: Tokenizer.from_dir(model_dir, eos_token_ids_from_config=info.eos_token_ids),
        )
        yield create_app(handles).test_client()
        nursery.cancel_scope.cancel()


def broken(root: Path, model_dir: Path, name: str, change: dict) -> Path:
    path = write_adapter(root / name, model_dir)
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    params = {**config["lora_parameters"], **change.pop("lora_parameters", {})}
    file.write_text(json.dumps({**config, **change, "lora_parameters": params}))  # (NaN as JSON's NaN)
    return path


BAD = {
    "keys": ({"lora_parameters": {"keys": [[1]]}}, '"lora_parameters.keys" must be a list of module paths'),
    "layers": ({"num_layers": [1]}, '"num_layers" must be an integer (got [1])'),
    "scale": ({"lora_parameters": {"scale": [1, 2]}}, '"lora_parameters.scale" must be a finite number (got [1, 2])'),
    "nan": ({"lora_parameters": {"scale": float("nan")}}, '"lora_parameters.scale" must be a finite number (got NaN)'),
}


@pytest.mark.parametrize("name", sorted(BAD))
async def test_a_bad_config_field_is_a_400_naming_it(qwen3_dir, tmp_path, name):
    change, expected = BAD[name]
    path = broken(tmp_path / "adapters", qwen3_dir, name, dict(change))
    async with real_server(qwen3_dir, adapters_dir=str(path.parent)) as client:
        response = await client.post("/v1/adapters", json={"id": "x", "path": str(path)})
        error = (await response.get_json())["error"]
        assert response.status_code == 400, error
        assert error["type"] == "invalid_request_error" and error["code"] == "adapter_not_mountable"
        assert error["message"].startswith("adapter 'x': ") and expected in error["message"], error
        assert (await (await client.get("/v1/adapters")).get_json())["data"] == []  # nothing mounted
        [listed] = (await (await client.get("/v1/adapters/available")).get_json())["data"]
        assert listed["compatible"] is False and expected in listed["reason"]


async def test_unreadable_paths_share_one_message(qwen3_dir, tmp_path):
    no_weights = write_adapter(tmp_path / "no-weights", qwen3_dir)
    (no_weights / "adapters.safetensors").unlink()
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("x")
    async with real_server(qwen3_dir) as client:
        messages = set()
        for path in (tmp_path / "absent", tmp_path / "empty", tmp_path / "a-file", no_weights, Path("/etc")):
            response = await client.post("/v1/adapters", json={"id": "x", "path": str(path)})
            assert response.status_code == 400
            messages.add((await response.get_json())["error"]["message"].replace(str(path), "PATH"))
    assert messages == {UNREADABLE}
