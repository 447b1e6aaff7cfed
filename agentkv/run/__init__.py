"""The agent loop: one run of a conversation — render, generate, parse tool calls, run tools,
repeat — and what it works on.

- ``loop``: the runner (``run_turns``), the only place that sequences a model call;
- ``conversation``: ``Conversation``, what a user holds (agent, window, KV session);
- ``call_checks``: ``CallChecks``, what a conversation carries from one model call to the next
  (the cache break to report, the operations log, the self-check rate);
- ``call_settings``: what one model call is asked for (config capped to the window, grammar);
- ``reply``: what one model call amounts to (an answer, tool calls, a broken call);
- ``input``: what a run accepts (text, messages, tool results, decisions);
- ``approvals``: tool calls that wait for a human decision.

The runtime (``agentkv.runtime``) owns the engine and the store and calls into this package;
nothing here imports the runtime, the store or the server.
"""
