"""agentkv: an async agent runtime whose conversations keep their KV cache alive."""
