"""Export: ONNX graphs (portable, fused, vq-table), TensorRT engines, and the parity report of each."""

MODES = ("portable", "fused", "vq-table")  # here, not in onnx_graph.py, so the CLI lists them without importing onnx
