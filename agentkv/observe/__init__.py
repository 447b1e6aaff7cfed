"""What agentkv tells you about itself: cache breaks (why the KV was not reused), the cached
path's self-check against a fresh prefill, OpenTelemetry spans, and Prometheus metrics read from
the server's and the engine's counters. Imports nothing above the
engine's protocol and the chat renderer.
"""
