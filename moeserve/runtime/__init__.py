BACKENDS = ("auto", "torch", "onnx")  # Engine on torch, OnnxEngine on ONNX Runtime; auto: by the model path
