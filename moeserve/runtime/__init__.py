COMPILE_MODES = ("auto", "on", "off")  # the decode step compiled (compiled.py); here so that the CLI's --help imports no torch
BACKENDS = ("auto", "torch", "onnx")  # Engine over torch, or over ONNX Runtime (OnnxBackend); auto: by the model path
QUANT_FORMATS = ("int8", "int4")  # weight-only quantization (quant.py): per output channel, or in groups of 32
GPU_QUANT_FORMATS = ("fp8",)  # quantized at load on a GPU with fp8 arithmetic only (quant_fp8.py)
SCHEDULERS = ("continuous", "batch")  # scheduler.py's policies: requests join running steps, or run to completion
