"""What both backends read from OpenVINO: model resolution (default model, GGUF → IR,
``models``), compilation with its cache fallback (``compile``), the plugin's numerics
(``numerics``) and openvino-genai's tokenizer (``tokenizer``)."""
