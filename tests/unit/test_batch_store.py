"""The batch store on SQLite and on a real PostgreSQL server: claims, leases, exactly-once output."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from postgres_server import PostgresServer

from goodput_gateway.batch.db import Database
from goodput_gateway.batch.store import Store
from goodput_gateway.batch.validate import parse_input


@pytest.fixture(scope="module")
def postgres():
    server = PostgresServer().start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """A URL for a fresh, empty store."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/batch.db"
    return request.getfixturevalue("postgres").fresh_database(f"b{uuid.uuid4().hex[:12]}")


def jsonl(n: int, model: str = "tiny") -> bytes:
    return "".join(
        json.dumps(
            {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": model, "messages": [{"role": "user", "content": f"hi {i}"}]},
            }
        )
        + "\n"
        for i in range(n)
    ).encode()


async def started_batch(store: Store, lines: int, model: str = "tiny") -> str:
    data = jsonl(lines, model)
    f = await store.create_file("batch", "in.jsonl", data)
    batch_id = await store.create_batch("/v1/chat/completions", f["id"], "24h", {"team": "a"})
    parsed = parse_input(data)
    assert await store.start_batch(batch_id, parsed.model, parsed.lines)
    return batch_id


async def test_two_gateways_claiming_at_once_never_get_the_same_line(database_url):
    # two stores, two connections: what two gateway replicas do
    stores = [Store(Database(database_url)) for _ in range(2)]
    try:
        batch_id = await started_batch(stores[0], 200)

        async def drain(store: Store, owner: str) -> list[int]:
            got: list[int] = []
            while claimed := await store.claim(batch_id, owner, 7, lease=60):
                for line in claimed:
                    got.append(line.idx)
                    assert await store.finish_line(line, owner, 200, "r", {"ok": line.idx}, None)
            return got

        held = await stores[0].claim(batch_id, "a", 5, lease=60)
        taken = await stores[1].claim(batch_id, "b", 5, lease=60)  # while a holds its five
        assert [x.idx for x in held] == [0, 1, 2, 3, 4] and [x.idx for x in taken] == [5, 6, 7, 8, 9]
        for store, owner, lines in ((stores[0], "a", held), (stores[1], "b", taken)):
            for line in lines:
                assert await store.finish_line(line, owner, 200, "r", {"ok": line.idx}, None)
        a, b = await asyncio.gather(drain(stores[0], "a"), drain(stores[1], "b"))
        assert not set(a) & set(b)
        assert sorted(a + b) == list(range(10, 200))
    finally:
        for s in stores:
            s.db.close()


async def test_a_line_whose_owner_stopped_renewing_goes_to_another_and_only_its_result_counts(database_url):
    store = Store(Database(database_url))
    try:
        batch_id = await started_batch(store, 3)
        first = await store.claim(batch_id, "dead", 3, lease=0.2)
        assert len(first) == 3
        assert await store.claim(batch_id, "alive", 3, lease=60) == []  # leased: nobody else takes them
        await asyncio.sleep(0.3)
        second = await store.claim(batch_id, "alive", 3, lease=60)
        assert [line.idx for line in second] == [0, 1, 2]
        assert all(line.attempts == 2 for line in second)
        # the dead owner's late answer is refused; the live owner's is recorded once
        assert not await store.finish_line(first[0], "dead", 200, "x", {"late": True}, None)
        for line in second:
            assert await store.finish_line(line, "alive", 200, "y", {"idx": line.idx}, None)
        assert not await store.finish_line(second[0], "alive", 200, "y", {"again": True}, None)
        assert await store.to_finalize() == [(batch_id, "completed")]
        assert await store.finalize(batch_id, "completed", lease=30)
        assert not await store.finalize(batch_id, "completed", lease=30)  # once
        batch = await store.get_batch(batch_id)
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert batch["error_file_id"] is None
        out = [json.loads(x) for x in (await store.file_content(batch["output_file_id"])).decode().splitlines()]
        assert [o["custom_id"] for o in out] == ["req-0", "req-1", "req-2"]
        assert [o["response"]["body"] for o in out] == [{"idx": 0}, {"idx": 1}, {"idx": 2}]
    finally:
        store.db.close()


async def test_a_line_left_by_a_dead_owner_keeps_its_batch_open_until_another_finishes_it(database_url):
    # a gateway killed mid-batch: its claimed line's lease lapses before anyone claims it again
    store = Store(Database(database_url))
    try:
        batch_id = await started_batch(store, 2)
        done, dead = await store.claim(batch_id, "killed", 2, lease=0.2)
        assert await store.finish_line(done, "killed", 200, "x", {"idx": 0}, None)
        await asyncio.sleep(0.3)
        assert await store.to_finalize() == []  # not completed with line 1 never answered
        again = await store.claim(batch_id, "restarted", 2, lease=60)
        assert [line.idx for line in again] == [dead.idx]
        assert await store.finish_line(again[0], "restarted", 200, "y", {"idx": 1}, None)
        assert await store.to_finalize() == [(batch_id, "completed")]
        assert await store.finalize(batch_id, "completed", lease=30)
        assert (await store.get_batch(batch_id))["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    finally:
        store.db.close()


async def test_failed_lines_go_to_the_error_file_and_a_cancelled_batch_reports_the_rest(database_url, tmp_path):
    store = Store(Database(database_url), file_dir=tmp_path / "files")
    try:
        batch_id = await started_batch(store, 4)
        lines = await store.claim(batch_id, "g", 2, lease=60)
        assert await store.finish_line(lines[0], "g", 200, "a", {"fine": 1}, None)
        assert await store.finish_line(lines[1], "g", 400, "b", {"error": {"message": "bad"}}, None)
        assert await store.cancel_batch(batch_id) == "cancelling"
        assert await store.claim(batch_id, "g", 2, lease=60) == []  # no new work once cancelling
        assert await store.to_finalize() == [(batch_id, "cancelled")]
        assert await store.finalize(batch_id, "cancelled", lease=30)
        batch = await store.get_batch(batch_id)
        assert batch["status"] == "cancelled" and batch["cancelled_at"]
        assert batch["metadata"] == {"team": "a"}
        output = (await store.file_content(batch["output_file_id"])).decode().splitlines()
        errors = [json.loads(x) for x in (await store.file_content(batch["error_file_id"])).decode().splitlines()]
        assert [json.loads(x)["custom_id"] for x in output] == ["req-0"]
        assert [e["custom_id"] for e in errors] == ["req-1", "req-2", "req-3"]
        assert errors[0]["response"]["status_code"] == 400
        assert errors[1]["error"]["code"] == "batch_cancelled" and errors[1]["response"] is None
        assert (tmp_path / "files" / batch["output_file_id"]).exists()  # bytes in the file directory
        assert await store.delete_file(batch["output_file_id"])
        assert not (tmp_path / "files" / batch["output_file_id"]).exists()
        assert await store.file_content(batch["output_file_id"]) is None
    finally:
        store.db.close()


async def test_files_and_batches_list_newest_first_by_page(database_url):
    store = Store(Database(database_url))
    try:
        ids = [await started_batch(store, 1) for _ in range(5)]
        page1 = await store.list_batches(None, 3)
        page2 = await store.list_batches(page1[-1]["id"], 3)
        assert [b["id"] for b in page1 + page2] == ids[::-1]
        files = await store.list_files("batch", None, 100, "asc")
        assert len(files) == 5 and files == sorted(files, key=lambda f: f["id"])
    finally:
        store.db.close()


async def test_pending_lines_are_counted_by_model_until_done(database_url):
    store = Store(Database(database_url))
    try:
        first = await started_batch(store, 5)
        await started_batch(store, 3, "embedder")
        assert await store.pending_lines() == {"tiny": 5, "embedder": 3}
        claimed = await store.claim(first, "gw-a", 2, 30)
        assert await store.pending_lines() == {"tiny": 5, "embedder": 3}  # claimed lines are not done yet
        for line in claimed:
            assert await store.finish_line(line, "gw-a", 200, "r", {"ok": line.idx}, None)
        assert await store.pending_lines() == {"tiny": 3, "embedder": 3}
    finally:
        store.db.close()
