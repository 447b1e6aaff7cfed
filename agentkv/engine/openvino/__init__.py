"""What both backends share of OpenVINO: their parent ``OpenVINOEngine`` (``engine``: model,
tokenizer, compile options, numerics, fingerprint, constraints), model resolution (default
model, GGUF → IR, ``models``), compilation with its cache fallback (``compile``), the plugin's
numerics (``numerics``) and openvino-genai's tokenizer (``tokenizer``). It sits above
``session/`` (the parent is a ``SlotEngine``) and below its two children, ``stateful/`` and
``paged/``, which never import each other."""
