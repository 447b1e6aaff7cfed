"""The CLI's longer help texts, written for a new user: what a value is, its unit, what its default does.

``typer.Option(None, "--db", metavar="URL", help=DB_HELP)``; ``tests/test_cli_help.py`` reads every
``--help`` and refuses internal notes (a bare status code as a default, module paths, reST).
"""

from __future__ import annotations

DB_HELP = ("Database of the store, as a SQLAlchemy URL: sqlite:///path/agentkv.db or "
           "postgresql+psycopg2://user:password@host/db (default: $AGENTKV_DB_URL, else $AGENTKV_HOME/agentkv.db).")
MODEL_HELP = ("GGUF file or OpenVINO IR directory (default: $AGENTKV_MODEL, else SmolLM2-135M-Instruct, "
              "converted on first use); $AGENTKV_ENGINE picks the engine (see below).")
CONVERSATION_HELP = "The conversation's id (`agentkv conversations list` shows them)."
AGENT_HELP = ("Agent name (default: the conversation's agent, else 'assistant', or 'assistant+tools' with --tools, "
              "'assistant+system-HASH' with --system: each stored as itself). A stored agent is used as stored; "
              "options may not give it other instructions or tools.")
CHAT_TOOLS_HELP = ("Give the agent the calculator and clock tools (or none). Each message is then answered by one "
                   "tool call, whose result is the answer: the default model does not pick tools by itself, nor "
                   "read their results back.")
CHAT_POLICY_HELP = ("What leaves the window when the prompt outgrows --max-prompt-len (default: the stored "
                    "agent's, else none: a message that no longer fits ends in an error saying so).")
SERVE_POLICY_HELP = ("What leaves the window of a stored conversation that outgrows --max-prompt-len. Without one, "
                     "a request that no longer fits is refused with HTTP 413 (context_length_exceeded): set a "
                     "policy to keep long conversations going.")
ENGINE_HELP = ("paged: KV in shared blocks, requests batched together (the default on CPU and GPU); stateful: "
               "one KV cache per conversation (NPU). Default: $AGENTKV_ENGINE, else paged.")
MAX_SESSIONS_HELP = ("Conversations whose KV stays in memory between requests, for chat requests and for stored "
                     "conversations each (past it, the one idle longest is closed; a stored one keeps its history "
                     "and snapshot).")
KV_REUSE_HELP = ("Continue from the KV a kept conversation already holds when a chat request extends it (off: the "
                 "model reads every request's whole prompt again).")
SNAPSHOTS_HELP = ("Where KV snapshots go: s3://bucket/prefix (AWS_* credentials and endpoint), file:///dir or a "
                  "directory (default: $AGENTKV_SNAPSHOT_URL, else beside the database).")
KV_HOST_HELP = ("Host memory in MiB for recently used KV blocks, in front of the snapshot store (0: none; "
                "default: 256).")
KV_DISK_HELP = ("A local directory caching KV blocks in front of an S3 snapshot store, so a conversation this "
                "machine saw restores without a download (default: none).")
KV_DISK_GB_HELP = ("Most GiB of KV blocks on this machine's disk: the --kv-disk cache, or with a snapshot "
                   "directory the blocks kept there (the least recently used go first; default: no bound).")
EXACT_HELP = ("Exact numerics (f32 KV, no dynamic quantisation): the same greedy answers on every replica and "
              "after every restore, about 2x slower to read a long prompt.")
LEASE_WAIT_HELP = ("Seconds a request waits for a conversation another replica is running before it is refused "
                   "with HTTP 409.")
DRAIN_HELP = ("On SIGTERM, seconds /ready answers 503 while requests are still served (so a proxy's health "
              "check moves traffic away) before the server stops.")
