"""A slot never resets (or reads, or writes) its request while a step is still inside infer."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.model


async def test_a_reset_during_a_running_step_waits_for_it_instead_of_failing(engine_plain):
    holder = await engine_plain.open_session()
    errors: list[BaseException] = []
    try:
        async with engine_plain.pool.lease(holder) as slot:
            ids = np.array([list(range(300, 1300))], dtype=np.int64)  # ~1 s of prefill

            def step() -> None:
                try:
                    slot.feed(ids, past_len=0)
                except BaseException as error:  # noqa: BLE001 - reported below
                    errors.append(error)

            worker = threading.Thread(target=step)
            worker.start()
            time.sleep(0.1)  # the step is inside infer now: the situation Ctrl-C leaves behind
            with pytest.raises(RuntimeError, match="busy"):
                slot.request.reset_state()  # the raw request refuses...
            slot.reset()  # ...the slot waits for the step, then resets
            worker.join()
            assert not errors and slot.length() == 0
    finally:
        await holder.close()

