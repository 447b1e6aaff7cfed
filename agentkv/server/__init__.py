"""``agentkv serve``: an OpenAI-compatible HTTP server whose conversations keep their KV.

Stateless clients resend the whole history each turn; the server runs each request on the live
KV session sharing the longest prefix with it, so only the new tokens are prefilled, and says so
in ``usage.prompt_tokens_details.cached_tokens``. Responses (``/v1/responses``) are stored with
their conversation: ``previous_response_id`` continues it on its KV, after a restart too::

    from agentkv.server import AgentDefaults, create_app
    app = create_app(open_engine(), store=Store.from_env(), api_key="sk-local",
                     defaults=AgentDefaults(instructions="Be brief."))     # serve with uvicorn

Layer: above the runtime (server → runtime → runner → policies → engine).
"""

from agentkv.server.app import create_app
from agentkv.server.request_agents import AgentDefaults

__all__ = ["AgentDefaults", "create_app"]
