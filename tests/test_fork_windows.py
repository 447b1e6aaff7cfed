"""Forks' windows: a fork sees the shared messages' window as its parent had it at the fork point,
then its own moves; nothing a parent (or a fork) does later changes another session's window. A
random-operation test against a model where every fork is a full copy; databases of schema 9 read
the same windows after migration 10. SQLite, and PostgreSQL where AGENTKV_TEST_POSTGRES_URL is set."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, inspect, text

from _old_schema import old_agent, old_session, schema_at

from agentkv.chat.messages import Message
from agentkv.memory import Store
from agentkv.memory.schema import utcnow


def contents(stored) -> list[str]:
    return [m.message.content for m in stored]


async def window(store: Store, conversation_id: str) -> list[str]:
    return contents(await store.messages(conversation_id, in_window_only=True))


async def conversation(store: Store, count: int) -> str:
    await store.upsert_agent("api", None, [], {})
    session = await store.create_conversation("api")
    for index in range(1, count + 1):
        await store.append_message(session.id, Message.user(f"m{index}"), token_count=1)
    return session.id


# -- the bugs, one by one --------------------------------------------------------------------

async def test_a_parents_rewind_leaves_its_forks_window_as_it_was(store: Store):
    parent = await conversation(store, 4)
    await store.replace_in_window(parent, [1, 2], Message.user("summary"), token_count=1)
    fork = await store.fork_conversation(parent)
    assert await window(store, fork.id) == ["m3", "m4", "summary"]
    assert await store.rewind(parent, 4) == 1
    assert await window(store, parent) == ["m1", "m2", "m3", "m4"]
    assert await window(store, fork.id) == ["m3", "m4", "summary"]
    out = {m.seq: m.replaced_by_seq for m in await store.messages(fork.id) if not m.in_window}
    assert out == {1: 5, 2: 5}


async def test_a_move_after_a_fork_is_not_the_forks_even_before_the_parents_next_message(store: Store):
    parent = await conversation(store, 4)
    fork = await store.fork_conversation(parent)  # at 4, the parent's newest
    await store.mark_out_of_window(parent, [1])  # a move the parent makes before its next message
    assert await window(store, fork.id) == ["m1", "m2", "m3", "m4"]
    await store.append_message(parent, Message.user("m5"), token_count=1)
    later = await store.fork_conversation(parent, at=4)  # at 4 again, now as it was just before m5 came
    assert await window(store, later.id) == ["m2", "m3", "m4"]
    earlier = await store.fork_conversation(parent, at=3)
    assert await window(store, earlier.id) == ["m1", "m2", "m3"]


async def test_a_fork_rewinding_before_its_parents_summary_gets_the_summarised_messages_back(store: Store):
    parent = await conversation(store, 4)
    await store.replace_in_window(parent, [1, 2], Message.user("summary"), token_count=1)
    fork = await store.fork_conversation(parent)
    assert await store.rewind(fork.id, 4) == 1
    assert await window(store, fork.id) == ["m1", "m2", "m3", "m4"]
    assert await window(store, parent) == ["m3", "m4", "summary"]


async def test_rewind_leaves_every_message_after_its_point_out_even_one_a_later_summary_replaced(store: Store):
    session = await conversation(store, 6)
    await store.replace_in_window(session, [5, 6], Message.user("summary"), token_count=1)
    assert await store.rewind(session, 4) == 1
    assert await window(store, session) == ["m1", "m2", "m3", "m4"]
    assert await store.rewind(session, 6) == 0  # back to just after m6: what the summary replaced returns
    assert await window(store, session) == ["m1", "m2", "m3", "m4", "m5", "m6"]


async def test_a_message_appended_out_of_the_window_is_out_for_the_forks_after_it(store: Store):
    session = await conversation(store, 2)
    await store.append_message(session, Message.user("aside"), token_count=1, in_window=False)
    fork = await store.fork_conversation(session)
    assert await window(store, fork.id) == ["m1", "m2"]
    before = await store.fork_conversation(session, at=2)
    assert await window(store, before.id) == ["m1", "m2"]


# -- random operations against a model where forks are copies ---------------------------------

@dataclass
class Copy:
    """What a session should see, kept as if every fork had copied its parent's messages."""

    contents: list[str]
    states: list[tuple[bool, int | None]]
    """Per seq - 1: (in the window, replaced by)."""
    before: list[list[tuple[bool, int | None]]] = field(default_factory=list)
    """Per seq - 1: ``states`` just before that message came."""
    fork_seq: int = 0

    def append(self, content: str) -> int:
        self.before.append(list(self.states))
        self.contents.append(content)
        self.states.append((True, None))
        return len(self.states)

    def in_window(self) -> list[int]:
        return [seq for seq, (inside, _) in enumerate(self.states, 1) if inside]

    def rewind(self, after: int) -> int:
        leaving = 0
        for seq, (inside, replaced_by) in enumerate(self.states, 1):
            if seq > after and inside:
                self.states[seq - 1] = (False, None)
                leaving += 1
            elif seq <= after and not inside and (replaced_by or 0) > after:
                self.states[seq - 1] = (True, None)
        return leaving

    def fork(self, at: int) -> Copy:
        states = self.states if at == len(self.states) else self.before[at]
        return Copy(self.contents[:at], list(states[:at]), copy.deepcopy(self.before[:at]), fork_seq=at)

    def seen(self) -> list[tuple[str, bool, int | None]]:
        return [(c, inside, replaced_by) for c, (inside, replaced_by) in zip(self.contents, self.states)]


KINDS = ["append", "compact", "compact", "truncate", "rewind", "rewind", "fork", "fork"]
OPERATIONS = st.tuples(st.integers(0, 6), st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6)),
    min_size=4, max_size=12))
"""How many messages the first session starts with, then (kind, which session, x, y) per operation."""


async def seen(store: Store, conversation_id: str) -> list[tuple[str, bool, int | None]]:
    return [(m.message.content, m.in_window, m.replaced_by_seq) for m in await store.messages(conversation_id)]


async def check_against_copies(store: Store, operations) -> None:
    """Run the operations on the store and on copies: a fork's copy is its parent's window at the
    fork point, and no copy changes another, so a parent's window is what it would be without forks."""
    await store.upsert_agent("api", None, [], {})
    root = (await store.create_conversation("api", conversation_id=uuid.uuid4().hex)).id
    model = {root: Copy([], [])}
    start, steps = operations
    for index in range(start):
        model[root].append(f"m{index}")
        await store.append_message(root, Message.user(f"m{index}"), token_count=1)
    count = 0
    for kind, pick, x, y in steps:
        sid = sorted(model)[pick % len(model)]
        mine = model[sid]
        count += 1
        label = f"c{count}"
        inside = mine.in_window()
        if kind == "append" or (kind in ("compact", "truncate") and not inside):
            mine.append(label)
            await store.append_message(sid, Message.user(label), token_count=1)
        elif kind == "compact":
            chosen = sorted({inside[x % len(inside)], inside[y % len(inside)]})
            summary = mine.append(label)
            for seq in chosen:
                mine.states[seq - 1] = (False, summary)
            await store.replace_in_window(sid, chosen, Message.user(label), token_count=1)
        elif kind == "truncate":
            seq = inside[x % len(inside)]
            mine.states[seq - 1] = (False, None)
            await store.mark_out_of_window(sid, [seq])
        elif kind == "rewind":
            after = x % (len(mine.states) + 1)
            assert await store.rewind(sid, after) == mine.rewind(after)
        else:
            at = x % (len(mine.states) + 1)
            fork = await store.fork_conversation(sid, at=at, new_id=f"{root}-{count}")
            model[fork.id] = mine.fork(at)
        assert await seen(store, sid) == mine.seen(), sid
    for sid, expected in model.items():
        assert await seen(store, sid) == expected.seen(), sid
    listed = {s.id: s.in_window_tokens for s in await store.list_conversations()}
    for sid, expected in model.items():  # the rows' own flags: each session's window of its own messages
        assert listed[sid] == sum(1 for inside, _ in expected.states[expected.fork_seq:] if inside)


@pytest.fixture
def memory_store() -> Iterator[Store]:
    """One SQLite store in memory for every example (each makes sessions of its own)."""
    store = Store("sqlite://")
    yield store
    anyio.run(store.close)


@pytest.fixture
def postgres_store(store_url: str, tmp_path: Path) -> Iterator[Store]:
    """One store on a fresh PostgreSQL database for every example."""
    if not store_url.startswith("postgresql"):
        pytest.skip("the SQLite run is the test above, on a database in memory")
    store = Store(store_url, snapshot_dir=tmp_path / "s")
    yield store
    anyio.run(store.close)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=OPERATIONS)
def test_every_forks_window_is_its_parents_at_the_fork_point_then_its_own(operations, memory_store: Store):
    anyio.run(check_against_copies, memory_store, operations)


@pytest.mark.postgres
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=OPERATIONS)
def test_every_forks_window_is_its_parents_at_the_fork_point_then_its_own_on_postgresql(operations,
                                                                                        postgres_store: Store):
    anyio.run(check_against_copies, postgres_store, operations)


# -- schema 9 databases ----------------------------------------------------------------------

LEGACY_SESSIONS = [("p", None, None), ("a", "p", 7), ("b", "p", 5), ("c", "a", 7),
                   ("q", None, None), ("d", "q", 2), ("e", "q", 4)]
"""Written by schema 9's code: p compacted 1-2 into s7, forked a at 7, compacted 3-4 into s8; a cut
5, then compacted 6 and its own a8 into a9; b forked p at 5, c forked a at 7 and cut 3. q is older
than schema 5 (no out_since_seq): 1-2 replaced by s3, q4 cut; d and e fork it at 2 and 4."""
LEGACY_MESSAGES = [  # session, seq, content, in_window, replaced_by_seq, out_since_seq
    ("p", 1, "m1", False, 7, 7), ("p", 2, "m2", False, 7, 7), ("p", 3, "m3", False, 8, 8),
    ("p", 4, "m4", False, 8, 8), ("p", 5, "m5", True, None, None), ("p", 6, "m6", True, None, None),
    ("p", 7, "s7", True, None, None), ("p", 8, "s8", True, None, None), ("a", 8, "a8", False, 9, 9),
    ("a", 9, "a9", True, None, None), ("c", 8, "c8", True, None, None),
    ("q", 1, "q1", False, 3, None), ("q", 2, "q2", False, 3, None), ("q", 3, "s3", True, None, None),
    ("q", 4, "q4", False, None, None), ("q", 5, "q5", True, None, None),
]
LEGACY_MARKS = [("a", 5, None, 7), ("a", 6, 9, 9), ("c", 3, None, 8)]  # session, seq, replaced_by, out_since
LEGACY_WINDOWS = {"p": ["m5", "m6", "s7", "s8"], "a": ["m3", "m4", "s7", "a9"],
                  "b": ["m1", "m2", "m3", "m4", "m5"], "c": ["m4", "m6", "s7", "c8"],
                  "q": ["s3", "q5"], "d": ["q1", "q2"], "e": ["s3"]}
"""What schema 9's code read (checked by running it on these rows)."""


def schema_9_database(store_url: str) -> None:
    engine = create_engine(store_url)
    now = utcnow().replace(tzinfo=None)
    with engine.begin() as conn:
        schema_at(conn, 9)
        old_agent(conn, "old")
        for sid, parent, fork_seq in LEGACY_SESSIONS:
            old_session(conn, sid, "old", parent_id=parent, fork_seq=fork_seq)
        for sid, seq, content, inside, replaced_by, since in LEGACY_MESSAGES:
            conn.execute(text("INSERT INTO messages (session_id, seq, role, content, tool_calls, token_count, "
                              "in_window, replaced_by_seq, created_at, out_since_seq) VALUES "
                              "(:sid, :seq, 'user', :content, '[]', 1, :inside, :replaced_by, :now, :since)"),
                         {"sid": sid, "seq": seq, "content": content, "inside": inside,
                          "replaced_by": replaced_by, "now": now, "since": since})
        for sid, seq, replaced_by, since in LEGACY_MARKS:
            conn.execute(text("INSERT INTO branch_marks (session_id, seq, replaced_by_seq, out_since_seq) "
                              "VALUES (:sid, :seq, :replaced_by, :since)"),
                         {"sid": sid, "seq": seq, "replaced_by": replaced_by, "since": since})
    engine.dispose()


async def test_a_schema_9_database_reads_the_same_windows_and_its_forks_keep_them(store_url: str,
                                                                                  tmp_path: Path):
    schema_9_database(store_url)
    store = Store(store_url, snapshot_dir=tmp_path / "s")
    assert {sid: await window(store, sid) for sid in LEGACY_WINDOWS} == LEGACY_WINDOWS
    assert [(m.seq, m.replaced_by_seq) for m in await store.messages("a") if not m.in_window] == [
        (1, 7), (2, 7), (5, None), (6, 9), (8, 9)]
    engine = create_engine(store_url)
    assert "branch_marks" not in inspect(engine).get_table_names()
    engine.dispose()
    # the moves made since come after every older one, and are their session's alone
    assert await store.rewind("p", 6) == 2
    assert await window(store, "p") == ["m1", "m2", "m3", "m4", "m5", "m6"]
    assert await store.rewind("a", 7) == 1
    assert await window(store, "a") == ["m3", "m4", "m6", "s7"]
    fork = await store.fork_conversation("a", at=8)  # as a was just before its a9
    assert await window(store, fork.id) == ["m3", "m4", "m6", "s7", "a8"]
    await store.replace_in_window("q", [5], Message.user("s6"), token_count=1)
    assert await window(store, "q") == ["s3", "s6"]
    expected = {**LEGACY_WINDOWS, "p": ["m1", "m2", "m3", "m4", "m5", "m6"], "a": ["m3", "m4", "m6", "s7"],
                "q": ["s3", "s6"]}
    assert {sid: await window(store, sid) for sid in expected} == expected
    await store.close()
