"""GET /v1/adapters/available: `--adapters-dir`'s adapter directories and whether their shapes
fit the served model, judged from the safetensors header and config.json alone."""

from __future__ import annotations

import json

from api.adapters.catalog import header_shapes, read_model_config, scan
from tests.fixtures.lora import write_adapter
from tests.helpers.adapters_server import server


def test_shapes_against_the_model(tiny_model_factory, tmp_path):
    model = tiny_model_factory("qwen3")
    other = tiny_model_factory("qwen3", intermediate_size=96)  # another MLP width
    write_adapter(tmp_path / "fits", model, rank=4)
    write_adapter(tmp_path / "fits-dora", model, rank=2, fine_tune_type="dora", keys=["self_attn.q_proj", "lm_head"])
    write_adapter(tmp_path / "other", other, rank=4)
    write_adapter(tmp_path / "full", model)
    config = json.loads((tmp_path / "full" / "adapter_config.json").read_text())
    (tmp_path / "full" / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "full"}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text('{"lora_parameters": {"rank": 4, "scale": 1}}')
    (tmp_path / "not-an-adapter").mkdir()  # no adapter_config.json: not listed
    (tmp_path / "stray.txt").write_text("x")

    entries = {e["id"]: e for e in scan(tmp_path, read_model_config(model))}
    assert sorted(entries) == ["broken", "fits", "fits-dora", "full", "other"]
    fits = entries["fits"]
    assert fits["compatible"] is True and "reason" not in fits
    assert (fits["fine_tune_type"], fits["rank"], fits["num_layers"]) == ("lora", 4, -1)
    assert fits["path"] == str(tmp_path / "fits")
    assert entries["fits-dora"]["compatible"] is True and entries["fits-dora"]["fine_tune_type"] == "dora"
    assert entries["other"]["compatible"] is False and "shape" in entries["other"]["reason"]
    assert entries["full"]["compatible"] is False and "full fine-tune" in entries["full"]["reason"]
    assert entries["broken"]["compatible"] is False and "adapters.safetensors" in entries["broken"]["reason"]
    # Without the model's sizes nothing can be said.
    assert scan(tmp_path, None)[1]["compatible"] == "unknown"


def test_header_shapes_read_the_table_only(tiny_model_factory, tmp_path):
    model = tiny_model_factory("qwen3")
    write_adapter(tmp_path / "a", model, rank=3, num_layers=1, keys=["mlp.down_proj"])
    shapes = header_shapes(tmp_path / "a" / "adapters.safetensors")
    config = json.loads((model / "config.json").read_text())
    last = config["num_hidden_layers"] - 1
    assert shapes == {
        f"model.layers.{last}.mlp.down_proj.lora_a": [config["intermediate_size"], 3],
        f"model.layers.{last}.mlp.down_proj.lora_b": [3, config["hidden_size"]],
    }


async def test_the_route_lists_the_directory(tiny_model_factory, tmp_path):
    model = tiny_model_factory("qwen3")
    write_adapter(tmp_path / "a", model)
    write_adapter(tmp_path / "none", model)  # a directory whose name cannot be an id
    async with server(model=str(model), adapters_dir=str(tmp_path)) as (client, handles, _):
        await handles.adapters.mount("a", str(tmp_path / "a"))  # (the fake worker mounts any path)
        body = await (await client.get("/v1/adapters/available")).get_json()
        assert body["adapters_dir"] == str(tmp_path)
        listed = [(e["id"], e["compatible"], e["mounted"]) for e in body["data"]]
        assert listed == [("a", True, True), ("none", False, False)]
        assert "reserved" in body["data"][1]["reason"]
    async with server() as (client, _, _):
        body = await (await client.get("/v1/adapters/available")).get_json()
        assert body == {"object": "list", "adapters_dir": None, "data": []}
