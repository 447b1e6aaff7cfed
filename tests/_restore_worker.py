"""Subprocess side of the restore-equivalence test: a new process resumes sessions from disk snapshots.

    python tests/_restore_worker.py <profile> <jobs.json>

``jobs.json`` holds the shared system prompt ids and, per conversation, a snapshot file and the
next prompt; prints one JSON line: the generated ids of each conversation, in order.
"""

from __future__ import annotations

import json
import sys

import anyio

from agentkv.engine.base import GenerationConfig
from agentkv.kv.snapshot import KVSnapshot


async def main(profile: str, jobs_path: str) -> None:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from _numerics import numerics_engine

    jobs = json.loads(open(jobs_path).read())
    engine = numerics_engine(profile, num_slots=1)
    engine.register_prefix(jobs["system"])
    answers, restored = [], []
    for job in jobs["conversations"]:
        session = await engine.open_session()
        await session.restore(KVSnapshot.from_file(job["snapshot"], expected_fingerprint=engine.fingerprint))
        result = await session.generate(job["prompt"], GenerationConfig(max_new_tokens=jobs["max_new_tokens"]))
        answers.append(list(result.token_ids))
        restored.append([result.metrics.restored_tokens, result.metrics.prefilled_tokens, result.metrics.kv_exact])
        await session.close()
    await engine.aclose()
    print(json.dumps({"answers": answers, "metrics": restored}))


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
