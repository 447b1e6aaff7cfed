"""Store's agents, sessions and messages on real SQLite files (and PostgreSQL when
AGENTKV_TEST_POSTGRES_URL is set): order, windows, counts, reopening, deletes, export, concurrent
and cancelled appends. Leases, schema, snapshots and SQLite specifics have files of their own
(``test_store_leases.py``, ``test_store_schema.py``, ``test_store_snapshots.py``, ``test_store_sqlite.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from _stores import CONVERSATION, append_all, make_snapshot, new_conversation

from agentkv.chat.messages import Message
from agentkv.errors import AgentNotFound, ConversationNotFound, UserError
from agentkv.memory import Store


async def test_messages_come_back_in_append_order_with_seqs_1_to_n(store: Store) -> None:
    sid = await new_conversation(store)
    await append_all(store, sid, CONVERSATION)
    stored = await store.messages(sid)
    assert [m.seq for m in stored] == [1, 2, 3, 4, 5]
    assert [m.message for m in stored] == CONVERSATION
    assert [m.token_count for m in stored] == [10, 11, 12, 13, 14]
    assert all(m.in_window and m.replaced_by_seq is None for m in stored)


async def test_out_of_window_messages_stay_stored_with_their_summary(store: Store) -> None:
    sid = await new_conversation(store)
    await append_all(store, sid, CONVERSATION)
    summary = await store.append_message(sid, Message.user("[summary] asked 1+1, got 2"),
                                         token_count=8)
    await store.mark_out_of_window(sid, [2, 3, 4], replaced_by_seq=summary.seq)

    assert [m.seq for m in await store.messages(sid, in_window_only=True)] == [1, 5, 6]
    everything = await store.messages(sid)
    assert len(everything) == 6
    assert [(m.in_window, m.replaced_by_seq) for m in everything[1:4]] == [(False, 6)] * 3
    with pytest.raises(UserError, match=r"\[42\]"):
        await store.mark_out_of_window(sid, [1, 42])
    with pytest.raises(UserError, match="replace itself"):
        await store.mark_out_of_window(sid, [6], replaced_by_seq=6)


async def test_list_sessions_counts_messages_and_tokens(store: Store) -> None:
    busy = await new_conversation(store, "busy")
    await new_conversation(store, "empty")
    await append_all(store, busy, CONVERSATION[:3])  # token counts 10, 11, 12
    await store.mark_out_of_window(busy, [1])

    summaries = {s.id: s for s in await store.list_conversations()}
    assert (summaries["busy"].message_count, summaries["busy"].total_tokens,
            summaries["busy"].in_window_tokens) == (3, 33, 23)
    assert (summaries["empty"].message_count, summaries["empty"].total_tokens) == (0, 0)
    assert [s.id for s in await store.list_conversations()] == ["busy", "empty"]  # newest update first


async def test_agents_upsert_and_sessions_need_a_stored_agent(store: Store) -> None:
    with pytest.raises(AgentNotFound, match="upsert_agent"):
        await store.create_conversation("nobody")
    await store.upsert_agent("helper", "v1", ["a"], {})
    await store.upsert_agent("helper", "v2", ["a", "b"], {"top_k": 4})
    agent = await store.get_agent("helper")
    assert (agent.instructions, agent.tool_names, agent.settings) == ("v2", ("a", "b"), {"top_k": 4})

    session = await store.create_conversation("helper", conversation_id="s1", metadata={"user": "ann"})
    assert (await store.get_conversation("s1")).metadata == {"user": "ann"} == session.metadata
    with pytest.raises(UserError, match="already exists"):
        await store.create_conversation("helper", conversation_id="s1")
    with pytest.raises(UserError, match="JSON"):
        await store.create_conversation("helper", metadata={"when": object()})
    with pytest.raises(ConversationNotFound):
        await store.get_conversation("absent")


async def test_history_survives_reopening_the_store(store_url: str, tmp_path: Path) -> None:
    first = Store(store_url, snapshot_dir=tmp_path / "snaps")
    sid = await new_conversation(first)
    await append_all(first, sid, CONVERSATION)
    await first.close()
    second = Store(store_url, snapshot_dir=tmp_path / "snaps")
    assert [m.message for m in await second.messages(sid)] == CONVERSATION
    await second.close()


async def test_delete_session_removes_rows_and_snapshot_files(store: Store) -> None:
    doomed, kept = await new_conversation(store, "doomed"), await new_conversation(store, "kept")
    await append_all(store, doomed, CONVERSATION)
    await append_all(store, kept, CONVERSATION[:2])
    doomed_files = [(await store.save_snapshot(doomed, make_snapshot(4, s))).path for s in (1, 2)]
    kept_file = (await store.save_snapshot(kept, make_snapshot(4, 3))).path

    await store.delete_conversation(doomed)
    assert not any(path.exists() for path in doomed_files) and kept_file.exists()
    with pytest.raises(ConversationNotFound):
        await store.messages(doomed)
    with pytest.raises(ConversationNotFound):
        await store.delete_conversation(doomed)
    assert len(await store.messages(kept)) == 2
    assert [s.id for s in await store.list_conversations()] == ["kept"]


async def test_export_jsonl_writes_openai_chat_messages_one_per_line(store: Store) -> None:
    sid = await new_conversation(store)
    await append_all(store, sid, CONVERSATION)
    exported = await store.export_jsonl(sid)
    lines = exported.splitlines()
    assert exported.endswith("\n") and len(lines) == len(CONVERSATION) + 1
    rows = [json.loads(line) for line in lines]
    assert rows == [{"role": "system", "content": "Be brief."}, *(m.to_openai() for m in CONVERSATION)]
    rows = rows[1:]
    assert rows[2]["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"expr": "1+1"}'}
    assert rows[3] == {"role": "tool", "content": "2", "tool_call_id": "call_1", "name": "calc"}


async def test_concurrent_appends_keep_every_message_with_unique_seqs(store: Store) -> None:
    sid = await new_conversation(store)
    async with anyio.create_task_group() as tg:
        for i in range(40):
            tg.start_soon(lambda i=i: store.append_message(sid, Message.user(f"m{i}"),
                                                           token_count=1))
    stored = await store.messages(sid)
    assert [m.seq for m in stored] == list(range(1, 41))
    assert sorted(m.message.content for m in stored) == sorted(f"m{i}" for i in range(40))


async def test_cancelled_appends_leave_a_gapless_history(store: Store) -> None:
    sid = await new_conversation(store)
    with anyio.move_on_after(0.05):
        async with anyio.create_task_group() as tg:
            for i in range(30):
                tg.start_soon(lambda i=i: store.append_message(sid, Message.user(f"m{i}"),
                                                               token_count=1))
    await anyio.sleep(0.3)  # worker threads finish the transactions they had started
    stored = await store.messages(sid)
    contents = [m.message.content for m in stored]
    assert [m.seq for m in stored] == list(range(1, len(stored) + 1))
    assert len(set(contents)) == len(contents)


async def test_an_agent_without_instructions_is_stored_as_one_without_a_system_turn(store: Store) -> None:
    await store.upsert_agent("bare", None, [], {})
    assert (await store.get_agent("bare")).instructions is None
    await store.upsert_agent("bare", "", [], {})  # an empty system turn is another thing
    assert (await store.get_agent("bare")).instructions == ""
