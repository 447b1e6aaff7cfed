"""The agent loop: one run of a conversation — render, generate, parse tool calls, run tools,
repeat — and what it works on.

- ``loop``: the runner (``run_turns``), the only place that sequences a model call;
- ``conversation``: ``Conversation``, what a user holds (agent, window, KV session);
- ``input``: what a run accepts (text, messages, tool results, decisions);
- ``approvals``: tool calls that wait for a human decision;
- ``call_checks``: what the loop checks around each model call (cache breaks, self-check).

The runtime (``agentkv.runtime``) owns the engine and the store and calls into this package;
nothing here imports the runtime, the store or the server.
"""
