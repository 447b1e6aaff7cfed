"""Decoding, pure over logits and ids: the prompt's checks and alignment counts (``alignment``),
the per-token loop (``loop``), sampling (``sampling``),
beam search (``beam``, ``beam_decode``), llguidance grammar constraints (``constraints``),
incremental detokenizing (``detokenize``) and step counts (``step_counts``)."""
