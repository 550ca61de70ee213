"""LoRA adapters over HTTP with the FakeWorker: /v1/adapters routes and their access rule, the
per-request `adapter` field and `model` alias on every protocol, /v1/models, the unmount race,
and admission's budget."""

from __future__ import annotations

import attrs
import trio

from actors.worker_api import AdapterReport
from model.lora.adapters import AdapterStillLeaving
from tests.fakes import FakeWorker
from tests.helpers.adapters_server import server

CHAT = "/v1/chat/completions"
REMOTE = {"client": ("203.0.113.9", 40000)}
MESSAGES = [{"role": "user", "content": "hi"}]
# The engine's words for a DoRA adapter in a stack (model/lora/stack.py), the API's too.
DORA_ALONE = "adapter 'd1' is a DoRA adapter, which cannot be stacked with another: select it alone"


async def error_of(response, status: int) -> dict:
    assert response.status_code == status, await response.get_data()
    return (await response.get_json())["error"]


async def test_mount_list_unmount_and_their_errors(autojump_clock):
    async with server() as (client, handles, worker):
        assert (await (await client.get("/v1/adapters")).get_json())["data"] == []
        mounted = await client.post("/v1/adapters", json={"id": "a", "path": "/adapters/a"})
        assert mounted.status_code == 200
        body = await mounted.get_json()
        assert body["id"] == "a" and body["path"] == "/adapters/a" and body["model"] == "fake-model:a"
        assert (body["type"], body["rank"], body["bytes"]) == ("lora", 8, 1000)
        listed = (await (await client.get("/v1/adapters")).get_json())["data"]
        assert [a["id"] for a in listed] == ["a"]

        again = await client.post("/v1/adapters", json={"id": "a", "path": "/adapters/other"})
        assert (await error_of(again, 409))["code"] == "adapter_already_mounted"
        bad = await client.post("/v1/adapters", json={"id": "b", "path": "/adapters/bad"})
        error = await error_of(bad, 400)
        assert error["type"] == "invalid_request_error" and "shapes do not fit" in error["message"]
        assert (await error_of(await client.post("/v1/adapters", json={"path": "/x"}), 400))["param"] == "id"
        assert (await error_of(await client.post("/v1/adapters", json={"id": "c"}), 400))["param"] == "path"
        for bad_id in ["none", "../a", ".hidden", "a+b", "m:a", "a b"]:
            refused = await error_of(await client.post("/v1/adapters", json={"id": bad_id, "path": "/adapters/a"}), 400)
            assert (refused["param"], refused["code"]) == ("id", "adapter_not_mountable"), bad_id
        assert "b" not in worker.adapters and [a.id for a in handles.adapters.infos()] == ["a"]

        gone = await client.delete("/v1/adapters/a")
        assert gone.status_code == 200 and await gone.get_json() == {"id": "a", "unmounted": True}
        assert worker.adapters == {}
        missing = await client.delete("/v1/adapters/a")
        assert (await error_of(missing, 404))["code"] == "adapter_not_found"


async def test_path_defaults_to_the_adapters_dir(autojump_clock):
    async with server(adapters_dir="/srv/adapters") as (client, _, worker):
        assert (await client.post("/v1/adapters", json={"id": "a"})).status_code == 200
        assert worker.adapters["a"].path == "/srv/adapters/a"


async def test_adapter_routes_follow_the_admin_rule(autojump_clock):
    async with server() as (client, _, _):
        for method, path in [("GET", "/v1/adapters"), ("POST", "/v1/adapters"), ("DELETE", "/v1/adapters/a")]:
            response = await client.open(path, method=method, json={"id": "a", "path": "/p"}, scope_base=REMOTE)
            assert (await error_of(response, 403))["code"] == "admin_forbidden", path
        assert (await client.get("/v1/adapters/available", scope_base=REMOTE)).status_code == 403
    async with server(admin_token="tok", api_key="key") as (client, _, _):
        response = await client.get("/v1/adapters", scope_base=REMOTE, headers={"Authorization": "Bearer key"})
        assert (await error_of(response, 401))["code"] == "invalid_admin_token"
        response = await client.post(
            "/v1/adapters", json={"id": "a", "path": "/p"}, scope_base=REMOTE, headers={"x-admin-token": "tok"}
        )
        assert response.status_code == 200
        # A request naming it still needs only the API key.
        chat = {"messages": MESSAGES, "max_tokens": 2, "adapter": "a"}
        response = await client.post(CHAT, json=chat, scope_base=REMOTE, headers={"Authorization": "Bearer key"})
        assert response.status_code == 200


async def test_models_list_mounted_adapters(autojump_clock):
    async with server() as (client, handles, _):
        await handles.adapters.mount("a", "/p/a")
        await handles.adapters.mount("b", "/p/b")
        data = (await (await client.get("/v1/models")).get_json())["data"]
        assert [m["id"] for m in data] == ["fake-model", "fake-model:a", "fake-model:b"]
        assert data[1]["object"] == "model" and data[1]["parent"] == "fake-model" and "owned_by" in data[1]
        one = await client.get("/v1/models/fake-model:b")
        assert one.status_code == 200 and (await one.get_json())["parent"] == "fake-model"
        await handles.adapters.unmount("a")
        data = (await (await client.get("/v1/models")).get_json())["data"]
        assert [m["id"] for m in data] == ["fake-model", "fake-model:b"]
        assert (await client.get("/v1/models/fake-model:a")).status_code == 404


def _bodies(**extra):
    """One request per protocol: (path, body, the envelope's error reader)."""
    return [
        (CHAT, {"messages": MESSAGES, "max_tokens": 2, **extra}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, **extra}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, **extra}),
        ("/v1/messages", {"model": "fake-model", "messages": MESSAGES, "max_tokens": 2, **extra}),
    ]


async def test_every_protocol_passes_the_adapters_to_the_row_and_names_them_in_the_reply(autojump_clock):
    async with server() as (client, handles, worker):
        await handles.adapters.mount("a", "/p/a")
        await handles.adapters.mount("b", "/p/b")
        for extra, want in [
            ({"adapter": "a"}, ("a",)),
            ({"adapter": "b+a"}, ("b", "a")),
            ({"adapter": "none"}, ()),
            ({}, ()),
            ({"model": "fake-model:a"}, ("a",)),
            ({"model": "fake-model:a+b", "adapter": "a+b"}, ("a", "b")),
        ]:
            for path, body in _bodies(**extra):
                if path == "/v1/messages" and "model" in extra:
                    body["model"] = extra["model"]
                before = set(worker.specs)
                response = await client.post(path, json=body)
                assert response.status_code == 200, (path, extra, await response.get_data())
                (row,) = set(worker.specs) - before
                assert worker.specs[row].adapters == want, (path, extra)
                named = "fake-model" + (":" + "+".join(want) if want else "")
                assert (await response.get_json())["model"] == named, (path, extra)


async def test_an_unknown_adapter_is_400_in_each_protocols_shape(autojump_clock):
    async with server() as (client, handles, worker):
        await handles.adapters.mount("a", "/p/a")
        for extra, param in [
            ({"adapter": "zzz"}, "adapter"),
            ({"adapter": "a+zzz"}, "adapter"),
            ({"adapter": "a+a"}, "adapter"),
            ({"adapter": 3}, "adapter"),
            ({"model": "fake-model:zzz"}, "model"),
            ({"model": "fake-model:a", "adapter": "none"}, "adapter"),
        ]:
            for path, body in _bodies(**extra):
                if path == "/v1/messages" and "model" in extra:
                    body["model"] = extra["model"]
                response = await client.post(path, json=body)
                assert response.status_code == 400, (path, extra)
                payload = await response.get_json()
                if path == "/v1/messages":
                    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
                else:
                    error = payload["error"]
                    assert error["type"] == "invalid_request_error" and error["param"] == param, (path, extra)
        assert worker.specs == {}  # nothing was queued
        # An unknown base name is still a 404.
        response = await client.post(CHAT, json={"messages": MESSAGES, "model": "other:a"})
        assert (await error_of(response, 404))["code"] == "model_not_found"


class EngineLikeWorker(FakeWorker):
    """The fake, with the engine's adapter kinds (a path naming "dora" mounts a DoRA adapter) and
    its leaving adapters (model/lora/adapters.py): the id stays taken until its rows close, and
    mounting it again from its own path keeps it."""

    def __init__(self) -> None:
        super().__init__(prefill_cost=0.1, join_cost=0.1, step_cost=1.0)
        self.left: dict[str, AdapterReport] = {}

    async def mount_adapter(self, adapter_id: str, path: str) -> AdapterReport:
        if adapter_id in self.leaving_adapters:
            if path != self.left[adapter_id].path:
                raise AdapterStillLeaving(f"adapter {adapter_id!r} is still unmounting: 1 running request(s) use it")
            self.leaving_adapters.discard(adapter_id)
            self.adapters[adapter_id] = self.left.pop(adapter_id)
            return self.adapters[adapter_id]
        report = await super().mount_adapter(adapter_id, path)
        if "dora" in path:
            report = self.adapters[adapter_id] = attrs.evolve(report, fine_tune_type="dora")
        return report

    async def unmount_adapter(self, adapter_id: str) -> bool:
        report = self.adapters.get(adapter_id)
        gone = await super().unmount_adapter(adapter_id)
        if not gone and report is not None:
            self.left[adapter_id] = report
        return gone


async def test_a_dora_adapter_in_a_stack_is_400_before_the_request_is_queued(autojump_clock):
    async with server(EngineLikeWorker()) as (client, handles, worker):
        await handles.adapters.mount("a2", "/p/a2")
        assert (await handles.adapters.mount("d1", "/p/dora1")).fine_tune_type == "dora"
        for extra, param in [
            ({"adapter": "a2+d1"}, "adapter"),
            ({"adapter": "d1+a2"}, "adapter"),
            ({"model": "fake-model:a2+d1"}, "model"),
            ({"model": "fake-model:a2+d1", "adapter": "a2+d1"}, "model"),  # (the model name is read first)
        ]:
            for stream in (False, True):
                for path, body in _bodies(**extra, stream=stream):
                    if path == "/v1/messages" and "model" in extra:
                        body["model"] = extra["model"]
                    response = await client.post(path, json=body)
                    assert response.status_code == 400, (path, extra, stream, await response.get_data())
                    payload = await response.get_json()
                    if path == "/v1/messages":
                        assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
                        assert payload["error"]["message"].endswith(DORA_ALONE), payload
                    else:
                        error = payload["error"]
                        assert (error["param"], error["code"]) == (param, "adapter_not_stackable"), (path, extra)
                        assert error["message"].endswith(DORA_ALONE), error["message"]
        assert worker.specs == {}  # nothing was queued
        alone = await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2, "adapter": "d1"})
        assert alone.status_code == 200 and (await alone.get_json())["model"] == "fake-model:d1"


async def test_mounting_an_adapter_again_while_it_drains(autojump_clock):
    async with server(EngineLikeWorker()) as (client, handles, worker):
        await handles.adapters.mount("a2", "/p/a2")
        done: list[int] = []

        async def ask() -> None:
            response = await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 20, "adapter": "a2"})
            done.append(response.status_code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await trio.sleep(3)  # decoding now
            assert await (await client.delete("/v1/adapters/a2")).get_json() == {"id": "a2", "unmounted": False}
            assert handles.adapters.nbytes == 0
            other = await client.post("/v1/adapters", json={"id": "a2", "path": "/p/a2-v2"})
            error = await error_of(other, 409)
            assert (error["code"], error["param"], error["type"]) == ("adapter_draining", "id", "invalid_request_error")
            assert "still unmounting" in error["message"]
            same = await client.post("/v1/adapters", json={"id": "a2", "path": "/p/a2"})  # kept: unmount cancelled
            assert same.status_code == 200 and (await same.get_json())["path"] == "/p/a2"
            listed = (await (await client.get("/v1/adapters")).get_json())["data"]
            assert [a["id"] for a in listed] == ["a2"] and handles.adapters.nbytes == 1000
            again = await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2, "adapter": "a2"})
            assert again.status_code == 200
            plain = await client.post("/v1/adapters", json={"id": "a2", "path": "/p/a2"})
            assert (await error_of(plain, 409))["code"] == "adapter_already_mounted"
        assert done == [200] and "a2" in worker.adapters and worker.leaving_adapters == set()


async def test_an_adapter_unmounted_before_the_row_opens_fails_that_request_alone(autojump_clock):
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    async with server(worker) as (client, handles, _):
        await handles.adapters.mount("a", "/p/a")
        del worker.adapters["a"]  # the worker lost it after the route's check (the race)
        results: dict[str, object] = {}

        async def ask(name: str, extra: dict) -> None:
            response = await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 3, **extra})
            results[name] = (response.status_code, await response.get_json())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "base", {})
            nursery.start_soon(ask, "lora", {"adapter": "a"})
            nursery.start_soon(ask, "lora_stream", {"adapter": "a", "stream": True})
        status, body = results["lora"]
        assert status == 400 and body["error"]["code"] == "adapter_not_mounted"
        assert results["lora_stream"][0] == 400
        status, body = results["base"]
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        assert handles.admission.in_flight == 0 and worker.violations == []


async def test_unmount_while_a_row_uses_it_is_false(autojump_clock):
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=1.0)
    async with server(worker) as (client, handles, _):
        await handles.adapters.mount("a", "/p/a")
        done: list[int] = []

        async def ask() -> None:
            response = await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 20, "adapter": "a"})
            done.append(response.status_code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await trio.sleep(3)  # decoding now
            response = await client.delete("/v1/adapters/a")
            assert await response.get_json() == {"id": "a", "unmounted": False}
            refused = await client.post(CHAT, json={"messages": MESSAGES, "adapter": "a"})
            assert refused.status_code == 400
        assert done == [200] and worker.leaving_adapters == set()


async def test_mounted_adapters_come_out_of_the_memory_budget(autojump_clock):
    async with server(memory_budget_gb=2.0) as (client, handles, _):
        before = handles.ceiling
        await handles.adapters.mount("a", "/p/a")  # 1000 bytes
        await handles.adapters.mount("b", "/p/b")  # 2000 bytes
        assert handles.ceiling.adapter_bytes == 3000 == handles.adapters.nbytes
        assert handles.ceiling.usable_bytes == before.usable_bytes - 3000
        assert handles.admission.ceiling == handles.ceiling
        stats = await (await client.get("/stats")).get_json()
        assert stats["admission"]["adapter_bytes"] == 3000
        await handles.adapters.unmount("a")
        assert handles.ceiling.usable_bytes == before.usable_bytes - 2000
        await handles.adapters.unmount("b")
        assert handles.ceiling == before
