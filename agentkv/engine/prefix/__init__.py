"""The prefix cache: a radix tree from token prefixes to KV (``radix``; its edges' KV cut and
joined by ``kv_chunks``; counters in ``stats``), shared by both backends;
the paged backend's block-sharing form is ``engine.paged.prefix``."""
