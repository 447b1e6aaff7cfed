"""The stateful backend (NPU, reference): one compiled model, an InferRequest per slot, KV in the
request's variable state (``engine``, ``slot``, ``ov_state``); ``StatefulEngine`` is a sibling
of ``PagedEngine`` under ``openvino.engine.OpenVINOEngine``."""
