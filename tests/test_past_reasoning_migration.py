"""Agent rows written before ``past_reasoning="auto"`` held "shift" whether it was chosen or not:
migration 11 makes them "auto", so an agent resumed from its row keeps an exact engine's KV
exact; "reprefill" rows stay; SQLite files and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import create_engine, text

from _old_schema import schema_at

from agentkv.memory import Store
from agentkv.memory.schema import utcnow
from agentkv.run.past_reasoning import shifts_past_reasoning
from agentkv.runtime.stored_agent import agent_from_record
from agentkv.testing import ScriptedEngine


def _database_at_schema_10(store_url: str) -> None:
    engine = create_engine(store_url)
    now = utcnow().replace(tzinfo=None)
    with engine.begin() as conn:
        schema_at(conn, 10)
        for name, mode in (("defaulted", "shift"), ("rereads", "reprefill"), ("older", None)):
            settings = {"tool_choice": "auto", **({"past_reasoning": mode} if mode else {})}
            conn.execute(text("INSERT INTO agents (name, instructions, tool_names, settings, updated_at) "
                              "VALUES (:name, 'Be brief.', '[]', :settings, :now)"),
                         {"name": name, "settings": json.dumps(settings), "now": now})
    engine.dispose()


async def test_agents_stored_with_the_old_default_shift_resume_as_auto_and_keep_exact_kv_exact(
        store_url: str, tmp_path: Path) -> None:
    _database_at_schema_10(store_url)
    exact, default = ScriptedEngine(exact=True), ScriptedEngine()
    async with Store(store_url, snapshot_dir=tmp_path / "s") as store:
        agents = {name: agent_from_record(await store.get_agent(name)) for name in ("defaulted", "rereads", "older")}
    assert {name: agent.past_reasoning for name, agent in agents.items()} == {
        "defaulted": "auto", "rereads": "reprefill", "older": "auto"}
    assert not shifts_past_reasoning(agents["defaulted"], exact)
    assert shifts_past_reasoning(agents["defaulted"], default)  # still shifts where the KV is not exact
