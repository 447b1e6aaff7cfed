"""Stored API responses and rewinding a session, on SQLite and PostgreSQL: a response covers its
session's messages so far, is read by its owner only, and takes its session with it when it was the
last; ``rewind`` takes a run's leftovers out of the window and puts back what their summary replaced,
but never a stored response's messages when asked to keep them (another replica continued first)."""

from __future__ import annotations

import pytest

from agentkv.chat.messages import Message
from agentkv.errors import (
    ConversationExists,
    ConversationNotFound,
    LeaseLost,
    ResponseNotFound,
    ResponseSuperseded,
    UserError,
)
from agentkv.memory import Store


async def conversation(store: Store, *texts: str) -> str:
    await store.upsert_agent("api", None, [], {})
    session = await store.create_conversation("api")
    for index, text in enumerate(texts):
        message = Message.user(text) if index % 2 == 0 else Message.assistant(text)
        await store.append_message(session.id, message, token_count=3)
    return session.id


async def test_a_response_covers_the_messages_so_far_and_only_its_owner_reads_it(store: Store):
    sid = await conversation(store, "Hi", "Hello!")
    saved = await store.save_response("resp_1", sid, {"id": "resp_1", "output": []}, owner="tenant-a")
    assert saved.last_seq == 2 and saved.conversation_id == sid
    assert (await store.get_response("resp_1", owner="tenant-a")).body == {"id": "resp_1", "output": []}
    for owner in ("tenant-b", ""):
        with pytest.raises(ResponseNotFound, match="another API key"):
            await store.get_response("resp_1", owner=owner)
    with pytest.raises(UserError, match="already stored"):
        await store.save_response("resp_1", sid, {}, owner="tenant-a")
    with pytest.raises(ConversationNotFound):
        await store.save_response("resp_2", "no-such-session", {})


async def test_responses_are_listed_newest_first_and_the_last_one_takes_its_session_along(store: Store):
    sid = await conversation(store, "Hi", "Hello!")
    await store.save_response("resp_1", sid, {})
    await store.append_message(sid, Message.user("More"), token_count=2)
    await store.append_message(sid, Message.assistant("Sure."), token_count=2)
    await store.save_response("resp_2", sid, {})
    assert [r.id for r in await store.responses(sid)] == ["resp_2", "resp_1"]
    with pytest.raises(ResponseNotFound):
        await store.delete_response("resp_2", owner="someone else")
    assert await store.delete_response("resp_1") is False
    assert len(await store.messages(sid)) == 4
    assert await store.delete_response("resp_2") is True
    with pytest.raises(ConversationNotFound):
        await store.get_conversation(sid)


async def test_deleting_a_session_deletes_its_responses(store: Store):
    sid = await conversation(store, "Hi", "Hello!")
    await store.save_response("resp_1", sid, {})
    await store.delete_conversation(sid)
    with pytest.raises(ResponseNotFound):
        await store.get_response("resp_1")


async def test_rewind_takes_later_messages_out_and_puts_back_what_their_summary_replaced(store: Store):
    sid = await conversation(store, "a", "b", "c", "d")
    await store.append_message(sid, Message.user("left over"), token_count=2)  # seq 5: a run that never ended
    await store.replace_in_window(sid, [1, 2], Message.user("summary of a, b"), token_count=4)  # seq 6
    assert [m.seq for m in await store.messages(sid, in_window_only=True)] == [3, 4, 5, 6]
    assert await store.rewind(sid, 4) == 2
    window = await store.messages(sid, in_window_only=True)
    assert [m.seq for m in window] == [1, 2, 3, 4]
    assert all(m.replaced_by_seq is None for m in window)
    assert len(await store.messages(sid)) == 6  # nothing deleted
    assert await store.rewind(sid, 4) == 0  # idempotent
    assert await store.last_seq(sid) == 6


async def test_a_rewind_that_keeps_responses_refuses_to_take_out_a_stored_responses_messages(store: Store):
    sid = await conversation(store, "Hi", "Hello!")
    first = await store.save_response("resp_1", sid, {})
    await store.append_message(sid, Message.user("Left by a run that died"), token_count=4)
    assert await store.rewind(sid, first.last_seq, keep_responses=True) == 1  # no response covers it: it leaves
    await store.append_message(sid, Message.user("Another replica's turn"), token_count=4)
    await store.append_message(sid, Message.assistant("Its answer"), token_count=3)
    await store.save_response("resp_2", sid, {})
    with pytest.raises(ResponseSuperseded, match="resp_2") as raised:
        await store.rewind(sid, first.last_seq, keep_responses=True)
    assert raised.value.newer_response_id == "resp_2"
    window = [m.message.content for m in await store.messages(sid, in_window_only=True)]
    assert window == ["Hi", "Hello!", "Another replica's turn", "Its answer"]  # nothing left the window


async def test_a_response_saved_with_a_lease_another_holder_took_is_refused(store: Store):
    sid = await conversation(store, "Hi", "Hello!")
    stale = await store.acquire_lease(sid, "replica-a", 30)
    await store.release_lease(sid, force=True)
    await store.acquire_lease(sid, "replica-b", 30)
    with pytest.raises(LeaseLost):
        await store.save_response("resp_1", sid, {}, fence=stale)
    assert await store.responses(sid) == []


async def test_a_second_session_under_a_taken_id_is_a_session_exists_error(store: Store):
    await store.upsert_agent("api", None, [], {})
    await store.create_conversation("api", conversation_id="conv-1")
    with pytest.raises(ConversationExists, match="conv-1"):
        await store.create_conversation("api", conversation_id="conv-1")
