BACKENDS = ("auto", "torch", "onnx")  # Engine over torch, or over ONNX Runtime (OnnxRunner); auto: by the model path
