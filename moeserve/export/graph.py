"""A few lines over `onnx.helper` for writing graphs by hand: unique value names, numpy initializers,
and `g.op("MatMul", a, b)` returning the output name, so a graph reads like the forward pass it mirrors.

The exporter writes graphs by hand rather than tracing the model: every operator in them is chosen
(the portable graph must stay inside TensorRT's ONNX parser's set, the fused one must reach ONNX
Runtime's MoE operator), axes stay dynamic without guard-rewriting, and routing, which is data
dependent, needs no tracing at all.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17  # the newest TensorRT's ONNX parser list (tensorrt_onnx_ops.json) was checked against
IR_VERSION = 8  # opset 17's IR; ONNX Runtime refuses IR versions newer than it knows
MS_DOMAIN = "com.microsoft"


class Graph:
    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._used: Counter[str] = Counter()
        self._consts: dict[tuple, str] = {}

    def fresh(self, hint: str) -> str:
        self._used[hint] += 1
        n = self._used[hint]
        return hint if n == 1 else f"{hint}_{n}"

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        self._used[name] += 1
        return name

    def output(self, value: str, name: str, elem_type: int, shape: list) -> None:
        """Expose `value` as graph output `name` (an Identity where the names differ)."""
        if value != name:
            self.nodes.append(helper.make_node("Identity", [value], [name], name=self.fresh(f"out_{name}")))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def weight(self, array: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(self, value, dtype=np.int64) -> str:
        """A small constant (shapes, axes, scalars), shared by every node that asks for the same value."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight(array, "c")
        return self._consts[key]

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", hint: str | None = None,
           **attrs) -> str | tuple[str, ...]:
        base = hint or op_type.lower()
        outs = [self.fresh(base) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh(f"n_{base}"),
                                           domain=domain or None, **attrs))
        return outs[0] if outputs == 1 else tuple(outs)

    def model(self, metadata: dict[str, str]) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        opsets = [helper.make_opsetid("", OPSET)]
        if any(n.domain == MS_DOMAIN for n in self.nodes):
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="moeserve")
        model.ir_version = IR_VERSION
        helper.set_model_props(model, metadata)
        return model

    # ---- the few compound pieces every graph uses ----------------------------------------------------
    def linear(self, x: str, w_OI: np.ndarray, hint: str) -> str:
        """x [..., I] @ W^T with W stored [out, in] as torch keeps it (no transposed copy)."""
        return self.op("MatMul", x, self.weight(np.ascontiguousarray(w_OI.T), hint), hint=hint)

    def l2_normalize(self, x: str, eps: float = 1e-12) -> str:
        """x / max(||x||, eps) over the last axis: torch.nn.functional.normalize."""
        norm = self.op("ReduceL2", x, axes=[-1], keepdims=1)
        return self.op("Div", x, self.op("Max", norm, self.const(eps, np.float32)))

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        return self.op("Unsqueeze", x, self.const(axes))

    def reshape(self, x: str, shape: list[int]) -> str:
        return self.op("Reshape", x, self.const(shape))


FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
