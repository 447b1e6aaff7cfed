"""``agentkv serve``: an OpenAI-compatible HTTP server whose conversations keep their KV.

Stateless clients resend the whole history each turn; the server runs each request on the live
KV session sharing the longest prefix with it, so only the new tokens are prefilled, and says so
in ``usage.prompt_tokens_details.cached_tokens``::

    from agentkv.server import create_app
    app = create_app(open_engine(), api_key="sk-local")     # serve with uvicorn

Layer: above the runtime (server → runtime → runner → policies → engine).
"""

from agentkv.server.app import create_app

__all__ = ["create_app"]
