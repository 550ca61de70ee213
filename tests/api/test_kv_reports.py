"""The KV storage scheme as the HTTP surface reports it: /stats `kv_quant`, /v1/models `kv_scheme`."""

from __future__ import annotations

from contextlib import asynccontextmanager

import attrs
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from actors.worker_api import kv_fields
from api.app import create_app
from model.kv.scheme import resolve
from model.options import KVOptions
from tests.fakes import FakeTokenizer, FakeWorker


@asynccontextmanager
async def server(mode: str, *, group_size: int = 64, start: int = 5000):
    fake = FakeWorker()
    options = KVOptions(kv_quant=mode, kv_group_size=group_size, quantized_kv_start=start)
    scheme = resolve(options, model_dir=None, num_layers=4)
    info = attrs.evolve(
        fake.info, **kv_fields(scheme, num_layers=4, dtype_name="bfloat16", dtype_bytes=2, prefill_chunk=256)
    )
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, FakeWorker(info=info), options=serve_options(), make_tokenizer=lambda info: FakeTokenizer()
        )
        yield create_app(handles).test_client()
        nursery.cancel_scope.cancel()


async def test_stats_and_models_name_a_quantized_scheme(autojump_clock):
    async with server("4", group_size=32, start=1000) as client:
        stats = await (await client.get("/stats")).get_json()
        assert stats["kv_quant"] == {
            "mode": "kv4",
            "group_size": 32,
            "start": 1000,
            "bits": 4,
            "ratio": (0.5 + 4 / 32) / 2,
            "quantized_from": 1024,  # the first 256-token chunk end at or past 1000
            "paged": False,
        }
        models = await (await client.get("/v1/models")).get_json()
        assert [m["kv_scheme"] for m in models["data"]] == ["kv4"]
        one = await (await client.get("/v1/models/fake-model")).get_json()
        assert one["kv_scheme"] == "kv4"


async def test_full_precision_is_reported_as_bf16_with_nothing_quantized(autojump_clock):
    async with server("off", start=5000) as client:
        stats = await (await client.get("/stats")).get_json()
        assert stats["kv_quant"] == {
            "mode": "bf16",
            "group_size": None,
            "start": 5000,
            "bits": None,
            "ratio": 1.0,
            "quantized_from": 0,
            "paged": False,
        }
        assert (await (await client.get("/v1/models")).get_json())["data"][0]["kv_scheme"] == "bf16"
