"""Three ``agentkv serve`` replicas (a tiny zoo model, ``MODEL``) on one PostgreSQL database and one S3 prefix,
behind HAProxy configured by ``deploy/haproxy.cfg`` (``agentkv.testing.cluster.LocalCluster``), the
official ``openai`` client in front: stickiness of a chain without a session header, a crashed
replica's conversation restored from S3 on another, concurrent conversations stored intact, two
replicas racing for one conversation, and a replica drained and re-added (issue 26).

Needs ``AGENTKV_TEST_POSTGRES_URL`` (``scripts/start_postgres.sh``), ``AGENTKV_TEST_S3_URL`` and the
``AWS_*`` variables (``eval "$(bash scripts/start_s3.sh)"``) and HAProxy (``scripts/start_haproxy.sh``)."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from zoo_helpers import ZOO

from agentkv.memory import Store
from agentkv.testing.cluster import ClusterError, LocalCluster, haproxy_binary

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model

PG_URL = os.environ.get("AGENTKV_TEST_POSTGRES_URL")
S3_URL = os.environ.get("AGENTKV_TEST_S3_URL")
try:
    haproxy_binary()
    HAPROXY_MISSING = ""
except ClusterError as missing:
    HAPROXY_MISSING = str(missing)
if not PG_URL or not S3_URL:
    pytest.skip("needs AGENTKV_TEST_POSTGRES_URL (bash scripts/start_postgres.sh) and AGENTKV_TEST_S3_URL "
                "(eval \"$(bash scripts/start_s3.sh)\")", allow_module_level=True)
if HAPROXY_MISSING:
    pytest.skip(HAPROXY_MISSING, allow_module_level=True)

INSTRUCTIONS = "You answer in one short sentence."
QUESTIONS = ("Name a fruit.", "Name a colour.", "Name an animal.", "Name a country.", "Name a river.",
             "Name a planet.")
MAX_TOKENS = 8
DRAIN_S = 3
"""--drain-seconds: HAProxy marks a draining replica down within ~1.4 s (fall 2: inter 1 s, fastinter 200 ms)."""
NEW_TOKENS_MAX = 40
"""Tokens a continued turn may prefill: the new user turn and its template markup, not the history."""
MODEL = ZOO / "qwen2_5"
"""The replicas' model: a tiny random-weight Qwen2.5 (tests/data/zoo) with its family's chat template.
What is tested is routing, stores and handovers, not answers; three replicas start in ~10 s on two
cores where the default model's took ~45 s (three graphs each to compile, measured)."""
SERVE_ARGS = ("--model", str(MODEL), "--exact", "--drain-seconds", str(DRAIN_S))
"""Exact numerics: greedy answers are the same on every replica, restored or not."""


@dataclass(frozen=True)
class Turn:
    """One answered /v1/responses request, with the headers the proxy and the server set."""

    id: str
    served_by: str
    conversation_id: str
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    text: str
    question: str

    @property
    def history(self) -> int:
        """Tokens whose KV this turn leaves behind: its prompt and its answer but the last sampled
        token, which is never fed through the model."""
        return self.input_tokens + self.output_tokens - 1


def ask(client: Any, question: str, previous: Turn | None = None, *, stream: bool = False) -> Turn:
    """One turn, greedy and short, chained to ``previous`` by previous_response_id (no header);
    ``stream``: read it as server-sent events (the headers come before the first event)."""
    chained = {"previous_response_id": previous.id} if previous is not None else {}
    raw = client.responses.with_raw_response.create(model="any", instructions=INSTRUCTIONS, input=question,
                                                    temperature=0, max_output_tokens=MAX_TOKENS, stream=stream,
                                                    **chained)
    if stream:
        events = list(raw.parse())
        assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
        body = events[-1].response
    else:
        body = raw.parse()
    assert raw.headers["X-Response-Id"] == body.id
    usage = body.usage
    return Turn(body.id, raw.headers.get("X-Served-By", "?"), raw.headers["X-Session-Id"], usage.input_tokens,
                usage.output_tokens, usage.input_tokens_details.cached_tokens, body.output_text, question)


def chain(client: Any, questions: tuple[str, ...], previous: Turn | None = None, *,
          streamed: tuple[int, ...] = ()) -> list[Turn]:
    """The turns of one conversation, in order; those numbered in ``streamed`` (0-based) streamed."""
    turns: list[Turn] = []
    for n, question in enumerate(questions):
        turns.append(ask(client, question, turns[-1] if turns else previous, stream=n in streamed))
    return turns


def openai_client(url: str, cluster: LocalCluster) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key=cluster.api_key, max_retries=0, timeout=180)


def stored_exchanges(cluster: LocalCluster, conversation_id: str) -> list[tuple[str, str]]:
    """The conversation's (role, content) of user and assistant messages, as PostgreSQL holds them."""
    async def read() -> list[tuple[str, str]]:
        store = Store(cluster.db, snapshots=cluster.snapshots)
        try:
            return [(m.message.role, m.message.content) for m in await store.messages(conversation_id)
                    if m.message.role in ("user", "assistant")]
        finally:
            await store.close()
    return asyncio.run(read())


def restores(cluster: LocalCluster, replicas: list[int]) -> float:
    """agentkv_snapshot_restores_total summed over ``replicas``."""
    total = 0.0
    for i in replicas:
        text = httpx.get(cluster.replica_url(i) + "/metrics", timeout=10).text
        total += sum(float(m) for m in re.findall(r"^agentkv_snapshot_restores_total(?:\{[^}]*\})? (\S+)$", text, re.M))
    return total


def wait_for_snapshot(cluster: LocalCluster, conversation_id: str, tokens: int, via: int, timeout_s: float = 30,
                      why: str = "") -> dict:
    """Poll replica ``via``'s locality answer until the newest stored snapshot covers ``tokens``."""
    deadline = time.monotonic() + timeout_s
    answer: dict = {}
    while time.monotonic() < deadline:
        answer = httpx.get(f"{cluster.replica_url(via)}/v1/conversations/{conversation_id}/locality", timeout=10,
                           headers={"Authorization": f"Bearer {cluster.api_key}"}).json()
        if answer.get("locality") == "snapshot" and answer.get("tokens", 0) >= tokens:
            return answer
        time.sleep(0.2)
    raise AssertionError(f"no snapshot of {conversation_id} covering {tokens} tokens after {timeout_s} s: "
                         f"{answer} {why}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    from conftest import fresh_postgres_database  # tests/conftest.py: an empty database, dropped afterwards

    assert PG_URL and S3_URL
    logs = tmp_path_factory.mktemp("cluster")
    for db in fresh_postgres_database(PG_URL):
        began = time.monotonic()
        with LocalCluster(3, db=db, snapshots=f"{S3_URL.rstrip('/')}/scaleout-{uuid.uuid4().hex[:12]}",
                          serve_args=SERVE_ARGS, log_dir=logs) as running:
            print(f"\ncluster up in {time.monotonic() - began:.1f} s; replicas ready after "
                  f"{[round(running.startup_seconds(i)[0], 1) for i in range(3)]} s; "
                  f"logs in {logs}")
            yield running


@pytest.fixture(scope="module")
def proxy(cluster: LocalCluster) -> Any:
    return openai_client(cluster.proxy_url, cluster)


@pytest.fixture(scope="module")
def first_chain(proxy: Any) -> list[Turn]:
    """Five turns of one conversation through the proxy, previous_response_id only; the third and
    fifth streamed (the proxy learns a stream's response id from its headers)."""
    return chain(proxy, QUESTIONS[:5], streamed=(2, 4))


def test_a_chain_without_session_header_stays_on_one_replica_and_reuses_its_kv(first_chain):
    assert {t.served_by for t in first_chain} == {first_chain[0].served_by}
    assert {t.conversation_id for t in first_chain} == {first_chain[0].conversation_id}
    for previous, turn in zip(first_chain, first_chain[1:]):
        assert turn.cached_tokens >= previous.input_tokens, (previous, turn)
        assert turn.input_tokens - turn.cached_tokens <= NEW_TOKENS_MAX, turn


def test_a_killed_replicas_conversation_continues_on_another_replica_from_its_s3_snapshot(
        cluster, proxy, first_chain):
    # the uninterrupted run: the same six turns as another conversation, before anything is killed
    reference = chain(proxy, QUESTIONS)
    assert [t.text for t in reference[:5]] == [t.text for t in first_chain]  # --exact: greedy is reproducible
    owner = cluster.replica_of(first_chain[-1].served_by)
    others = [i for i in range(3) if i != owner]
    wait_for_snapshot(cluster, first_chain[-1].conversation_id, first_chain[-1].history, via=others[0])
    restored_before = restores(cluster, others)
    cluster.kill(owner)  # kill -9: the proxy learns it from the refused connection, then the health check
    moved = ask(proxy, QUESTIONS[5], first_chain[-1])
    assert moved.served_by != cluster.replicas[owner].name and moved.conversation_id == first_chain[0].conversation_id
    assert restores(cluster, others) >= restored_before + 1  # its KV came from S3, not a re-prefill
    # the restored KV covers the whole history: prompt and answer of turn five but its last sampled token
    assert moved.cached_tokens >= first_chain[-1].history, moved
    assert moved.input_tokens - moved.cached_tokens <= NEW_TOKENS_MAX, moved
    assert moved.cached_tokens == reference[5].cached_tokens  # as much as the live KV gave
    assert moved.text == reference[5].text  # and the restored KV is the live one, bit for bit
    began = time.monotonic()
    cluster.start(owner)  # back to three for the scenarios below
    print(f"\n{cluster.replicas[owner].name} restarted in {time.monotonic() - began:.1f} s")


def test_concurrent_conversations_through_the_proxy_each_stay_on_one_replica_and_are_stored_once(
        cluster, proxy):
    conversations: dict[int, list[Turn]] = {}
    failures: list[BaseException] = []

    def converse(c: int) -> None:
        try:
            conversations[c] = chain(proxy, tuple(f"Conversation {c}: {q}" for q in QUESTIONS[:4]))
        except BaseException as error:  # an HTTP error is what the test is about
            failures.append(error)

    threads = [threading.Thread(target=converse, args=(c,)) for c in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not failures, failures  # no 5xx (and no other error)
    assert len(conversations) == 6
    for turns in conversations.values():
        assert {t.served_by for t in turns} == {turns[0].served_by}, [t.served_by for t in turns]
        assert {t.conversation_id for t in turns} == {turns[0].conversation_id}
        expected = [m for t in turns for m in (("user", t.question), ("assistant", t.text))]
        assert stored_exchanges(cluster, turns[0].conversation_id) == expected


def test_two_replicas_asked_to_continue_one_conversation_at_once_run_it_once(cluster):
    clients = [openai_client(cluster.replica_url(i), cluster) for i in (0, 1)]
    first = ask(clients[0], "Name a fruit.")
    start = threading.Barrier(2)
    outcomes: dict[int, Turn | BaseException] = {}

    def race(i: int, question: str) -> None:
        start.wait()
        try:
            outcomes[i] = ask(clients[i], question, first)
        except BaseException as error:
            outcomes[i] = error

    threads = [threading.Thread(target=race, args=(i, q)) for i, q in ((0, "Name a colour."), (1, "Name a city."))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    answered = [o for o in outcomes.values() if isinstance(o, Turn)]
    refused = [o for o in outcomes.values() if not isinstance(o, Turn)]
    assert len(answered) == 1 and len(refused) == 1, outcomes
    [refusal] = refused
    assert isinstance(refusal, openai.ConflictError), refusal
    assert refusal.code in ("response_superseded", "conversation_busy"), refusal.body
    [winner] = answered
    assert stored_exchanges(cluster, first.conversation_id) == [
        ("user", first.question), ("assistant", first.text), ("user", winner.question), ("assistant", winner.text)]
    # the refused request changed nothing: the newest snapshot is the winner's, not an older KV
    # restored for the refused request and saved again on its way out
    wait_for_snapshot(cluster, first.conversation_id, winner.history, via=2, timeout_s=10,
                      why="(the newest snapshot is older than the winner's turn: did the refused request save one?)")
    [won] = [i for i, o in outcomes.items() if isinstance(o, Turn)]
    again = ask(clients[won], "Name a planet.", winner)  # the winner's replica goes on from its live KV
    assert again.cached_tokens >= winner.history, again


def test_a_drained_replica_hands_its_conversations_over_through_s3_and_serves_again_when_readded(
        cluster, proxy):
    opened = [chain(proxy, (f"Drain {c}: {QUESTIONS[0]}", f"Drain {c}: {QUESTIONS[1]}")) for c in range(3)]
    drained = cluster.replica_of(opened[0][-1].served_by)
    held = [turns for turns in opened if turns[-1].served_by == cluster.replicas[drained].name]
    exit_code: list[int] = []
    stopper = threading.Thread(target=lambda: exit_code.append(cluster.stop(drained)))
    # new conversations all through the drain: answered by the draining replica until the proxy
    # marks it down, by the others afterwards, never a 5xx
    background: list[Turn | BaseException] = []

    def keep_asking() -> None:
        while stopper.is_alive():
            try:
                background.append(ask(proxy, "Say hi."))
            except BaseException as error:
                background.append(error)

    stopper.start()
    asker = threading.Thread(target=keep_asking)
    asker.start()
    cluster.wait_proxy_state(drained, up=False, timeout_s=DRAIN_S + 10)
    moved = [ask(proxy, f"Drain {c}: {QUESTIONS[2]}", turns[-1]) for c, turns in enumerate(held)]
    stopper.join(timeout=120)
    asker.join(timeout=120)
    assert exit_code == [0]
    assert background and all(isinstance(b, Turn) for b in background), background
    for turns, turn in zip(held, moved):
        assert turn.served_by != cluster.replicas[drained].name and turn.conversation_id == turns[-1].conversation_id
        assert turn.cached_tokens >= turns[-1].history, turn  # from the snapshot written on the way out
        assert turn.input_tokens - turn.cached_tokens <= NEW_TOKENS_MAX, turn
    began = time.monotonic()
    cluster.start(drained)
    print(f"\n{cluster.replicas[drained].name} re-added in {time.monotonic() - began:.1f} s")
    served = {ask(proxy, f"Back {k}: {QUESTIONS[3]}").served_by for k in range(9)}
    assert cluster.replicas[drained].name in served, served


CONTEXT = ("Here is some context for the question: rivers carve valleys slowly, moving sediment from the "
           "mountains down to the sea, and engineers measure bridges under different wind speeds.")


def chat_turn(client: Any, messages: list[dict], conversation_id: str | None) -> tuple[str, str, str, int, int]:
    """One chat completion of the whole ``messages`` (greedy, short), with ``X-Session-Id`` when given:
    the answer, the replica, the session id it carried, prompt tokens and cached prompt tokens."""
    headers = {"X-Session-Id": conversation_id} if conversation_id else {}
    raw = client.chat.completions.with_raw_response.create(
        model="any", messages=messages, temperature=0, max_tokens=MAX_TOKENS, extra_headers=headers)
    body = raw.parse()
    usage = body.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return (body.choices[0].message.content or "", raw.headers.get("X-Served-By", "?"), raw.headers["X-Session-Id"],
            usage.prompt_tokens, cached or 0)


def saves_done(url: str, timeout_s: float = 30.0) -> None:
    """Wait until the replica at ``url`` has written the KV of the turns it answered (its
    ``agentkv_kv_saves_pending`` is 0): a kill after that loses no answered turn's KV."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics").text  # /metrics needs no key
        if re.search(r"^agentkv_kv_saves_pending 0(\.0)?$", text, re.MULTILINE):
            return
        time.sleep(0.05)
    raise AssertionError(f"{url} still writes a turn's KV after {timeout_s} s")


@pytest.mark.parametrize("named", [True, False], ids=["x-session-id", "no-header"])
def test_a_chat_completion_conversation_continues_on_another_replica_from_the_store_after_kill(
        cluster, proxy, named):
    """Chat completions keep no session row: after each turn the replica keeps the KV's full blocks in
    the store, findable by their tokens. Its replica killed, the next turn on another replica
    prefills at most the new message and one block (the partial block the store does not keep)."""
    messages: list[dict] = [{"role": "system", "content": INSTRUCTIONS}]
    conversation_id = f"chat-{uuid.uuid4().hex[:8]}" if named else None
    served = ""
    for question in QUESTIONS[:3]:  # long turns: a history a re-prefill would not fit in the bound below
        messages.append({"role": "user", "content": f"{CONTEXT} {question}"})
        answer, served, carried, _, _ = chat_turn(proxy, messages, conversation_id)
        messages.append({"role": "assistant", "content": answer})
        assert not named or carried == conversation_id
    owner = cluster.replica_of(served)
    saves_done(cluster.replica_url(owner))  # NOTE: a turn's KV is written after its answer (server/kv_saves.py)
    cluster.kill(owner)
    try:
        messages.append({"role": "user", "content": QUESTIONS[3]})
        _, moved_to, _, prompt, cached = chat_turn(proxy, messages, conversation_id)
        assert moved_to != cluster.replicas[owner].name
        assert prompt - cached <= NEW_TOKENS_MAX + 32, (prompt, cached)
    finally:
        cluster.start(owner)
