"""The prefix cache: a radix tree from token prefixes to KV (``radix``), shared by both backends;
the paged backend's block-sharing form is ``engine.paged.prefix``."""
