"""Time the quantized linear forms of backends/quant_gpu.py against the weight-only reference, per row count.

    python -m moeserve.bench.quant_gpu [--out 4096] [--in 4096] [--rows 1 8 16 64 512]

The one measurement the GPU layouts still need: up to how many rows torch._weight_int8pack_mm (a CUDA kernel with
no tensor core) beats dequantize-then-cuBLAS (quant_gpu.INT8PACK_MAX_ROWS, set without a GPU), and whether tinygemm
or _scaled_mm lose to the reference at a prompt's rows. Each form is timed on the device it runs on (CUDA events on
a GPU), in bfloat16, with the bytes its weight streams per call and the GB/s that makes. On a CPU it runs the CPU
twins of the ops (tests/bench/test_quant_gpu_bench.py), which says nothing about a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moeserve.runtime.backends.quant_gpu import linear_form
from moeserve.runtime.quant import QuantLinear, QuantSpec
from moeserve.runtime.quant_fp8 import Fp8Linear, fp8_unavailable

FORMATS = ("int8", "int4", "fp8")


def _ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_forms(out_features: int = 4096, in_features: int = 4096, rows: tuple[int, ...] = (1, 8, 16, 64, 512),
               device: str = "cuda", repeats: int = 20) -> list[dict]:
    """One row per (format, rows): the form's and the reference's median ms and the form's weight GB/s."""
    dev = torch.device(device)
    w = torch.randn(out_features, in_features, device=dev) * in_features**-0.5
    table = []
    for fmt in FORMATS:
        if fmt == "fp8" and dev.type == "cuda" and fp8_unavailable(dev) is not None:
            continue
        ref = Fp8Linear.of(w) if fmt == "fp8" else QuantLinear.of(w, QuantSpec.parse(fmt))
        form = linear_form(ref, torch.bfloat16, max_rows=1 << 30)  # the op at every count: the crossover is the point
        if form is None:
            continue
        weight_bytes = ref.qweight.numel() * ref.qweight.element_size() + ref.scale.numel() * ref.scale.element_size()
        for n in rows:
            x = torch.randn(n, in_features, device=dev, dtype=torch.bfloat16)
            with torch.inference_mode():
                t_form, t_ref = _ms(lambda: form(x), dev, repeats), _ms(lambda: ref(x), dev, repeats)
            table.append({"format": fmt, "form": type(form).__name__, "rows": n, "form_ms": round(t_form, 4),
                          "reference_ms": round(t_ref, 4), "form_weight_GBps": round(weight_bytes / t_form / 1e6, 1)})
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=int, default=4096)
    p.add_argument("--in", dest="in_", type=int, default=4096)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 512])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (the ops' CPU twins)"
    print(f"{where}, torch {torch.__version__}, weight [{args.out}, {args.in_}], bfloat16 rows")
    print(f"{'format':7} {'form':16} {'rows':>5} {'form ms':>9} {'ref ms':>9} {'weight GB/s':>11}")
    for r in time_forms(args.out, args.in_, tuple(args.rows), args.device):
        print(f"{r['format']:7} {r['form']:16} {r['rows']:>5} {r['form_ms']:>9.4f} {r['reference_ms']:>9.4f} "
              f"{r['form_weight_GBps']:>11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
