"""Decoding, pure over logits and ids: the prompt's checks and alignment counts (``alignment``),
the per-token loop as a generator of model steps (``token_steps``, ``model_steps``) and its two
drivers — on the event loop (``loop``) or in one worker thread (``threaded``, ``thread_channel``) —,
sampling (``sampling``), grammar fast-forward (``fast_forward``), prompt-lookup drafts
(``prompt_lookup``), beam search (``beam``, ``beam_decode``), llguidance grammar constraints
(``constraints``), incremental detokenizing (``detokenize``) and step counts (``step_counts``)."""
