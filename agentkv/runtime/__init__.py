"""The runtime: owns one engine and one store, opens and resumes conversations, runs one turn
at a time per conversation, and persists each turn.

- ``runtime``: ``Runtime`` (``await runtime.run(conversation, "hi")``);
- ``branches``: forks, rewinds and edits of a stored conversation (their KV and window);
- ``persistence``: what a run writes to the store (messages, calls, snapshots);
- ``stored_agent``: an ``Agent`` to and from its stored row.
"""
