"""What agentkv tells you about itself: cache breaks (why the KV was not reused), the cached
path's self-check against a fresh prefill, and OpenTelemetry spans. Imports nothing above the
engine's protocol and the chat renderer.
"""
