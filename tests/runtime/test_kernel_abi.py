"""The C kernel's interface as its header declares it (kernel_abi.parse_header), and the checks made when the
library loads: a library of another ABI number, a ctypes Structure that is not its struct, and an op that
disagrees with its torch reference are each refused by name, the kernel then unavailable; the header's prototypes
give the ctypes types the C code takes, and a type the parser does not know is an error, not a guess."""

from __future__ import annotations

import ctypes

import pytest
import torch

from moeserve.runtime.backends import cpu_kernel, kernel_abi, kernel_checks, kernel_decode
from moeserve.runtime.backends.kernel_abi import KernelError, parse_header

requires_kernel = pytest.mark.skipif(not cpu_kernel.available(),
                                     reason=f"the C kernel is not built here: {cpu_kernel.unavailable_reason()}")


@pytest.fixture
def reload():
    """_library() loaded again under the test's patches, and again (unpatched) after it."""
    cpu_kernel._library.cache_clear()
    yield lambda: (cpu_kernel._library.cache_clear(), cpu_kernel.unavailable_reason())[1]
    cpu_kernel._library.cache_clear()


def test_prototypes_become_ctypes_argtypes():
    header = parse_header("""
        #define MOESERVE_KERNEL_ABI 7 /* a comment */
        typedef unsigned short bf16;
        void scale(const float *x, long n, int threads, float by);
        int step(const struct model *m, bf16 *const *kc, long *ids);
        int probe(void);
    """)
    assert header.abi == 7
    assert header.functions == {
        "scale": (None, [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float]),
        "step": (ctypes.c_int, [ctypes.c_void_p] * 3),
        "probe": (ctypes.c_int, []),
    }


@pytest.mark.parametrize("proto", ["void f(double x);", "void f(size_t n);", "void f(const struct other *s);",
                                   "float *f(long n);", "void f(unsigned n);", "void (*f)(long n);"])
def test_a_type_the_parser_does_not_know_is_an_error(proto):
    with pytest.raises(KernelError, match="not one the bindings know|not a prototype the bindings read"):
        parse_header(f"#define MOESERVE_KERNEL_ABI 1\n{proto}\n")


def test_the_shipped_header_declares_every_op_the_python_calls():
    header = parse_header(cpu_kernel.HEADER.read_text())
    assert header.abi == kernel_abi.ABI
    ops = {"linear_nt", "experts_ffn", "moe_ffn", "rms_norm", "attend_decode", "route_tokens", "decode_step",
           "linear_q", "moe_ffn_q"}
    assert set(header.functions) == {"moeserve_kernel_abi", "bf16_native", *ops, *(f"{op}_bf16" for op in ops)}
    assert header.functions["linear_nt"] == (None, [ctypes.c_void_p, ctypes.c_long] * 3 + [ctypes.c_long] * 3
                                             + [ctypes.c_int])
    assert header.functions["linear_q_bf16"] == (ctypes.c_int, [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 2
                                                 + [ctypes.c_int, ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 4
                                                 + [ctypes.c_int])
    assert header.functions["route_tokens_bf16"] == (ctypes.c_int, [ctypes.c_void_p] + [ctypes.c_long] * 2
                                                     + [ctypes.c_void_p] * 3 + [ctypes.c_int])
    assert [name for name, _ in header.structs["router"]] == ["w", "emb", "P", "E", "K", "tau", "gate", "renormalize"]
    kernel_abi.check_structures(header)  # the Structures as they are: no error


@requires_kernel
def test_a_library_of_another_abi_is_refused(reload, monkeypatch):
    monkeypatch.setattr(kernel_abi, "ABI", kernel_abi.ABI + 1)
    why = reload()
    assert why == f"the built library's kernel ABI is {kernel_abi.ABI - 1}, not the {kernel_abi.ABI} this moeserve " \
                  f"binds: not used"
    assert not cpu_kernel.available() and cpu_kernel.identity() is None
    with pytest.raises(KernelError, match="kernel ABI"):
        cpu_kernel.linear(torch.ones(1, 8), torch.ones(2, 8))
    monkeypatch.undo()
    assert reload() is None


class _SwappedRouter(ctypes.Structure):  # struct router with tau and gate the wrong way round
    _fields_ = [("w", ctypes.c_void_p), ("emb", ctypes.c_void_p), ("P", ctypes.c_long), ("E", ctypes.c_long),
                ("K", ctypes.c_long), ("gate", ctypes.c_int), ("tau", ctypes.c_float), ("renormalize", ctypes.c_int)]


class _ShortModel(ctypes.Structure):  # struct model without its last field
    _fields_ = kernel_abi._Model._fields_[:-1]


class _TypedLayer(ctypes.Structure):  # struct layer with eps2 a double
    _fields_ = [(n, ctypes.c_double if n == "eps2" else t) for n, t in kernel_abi._Layer._fields_]


@requires_kernel
@pytest.mark.parametrize("name,cls,field", [
    ("router", _SwappedRouter, "field 5 is gate: c_int, the header's is tau: float"),
    ("model", _ShortModel, "field 19 is nothing, the header's is head_group: long"),
    ("layer", _TypedLayer, "field 7 is eps2: c_double, the header's is eps2: float"),
])
def test_a_structure_that_is_not_its_struct_is_refused(name, cls, field, reload, monkeypatch):
    monkeypatch.setitem(kernel_abi.STRUCTS, name, cls)
    why = reload()
    assert why == f"{cls.__qualname__} does not match the header's struct: {field}"
    with pytest.raises(KernelError, match="does not match the header's struct"):
        kernel_decode.KernelRouter(torch.randn(4, 8), 2)


def _off(reference):
    return lambda *a, **kw: reference(*a, **kw) * 1.5


@requires_kernel
@pytest.mark.parametrize("op,reference,named", [
    ("linear_nt", "linear_reference", "F.linear"),
    ("rms_norm", "rms_norm_reference", "F.rms_norm"),
    ("attend_decode", "attention_reference", "SDPA"),
    ("moe_ffn", "experts_reference", "experts.moe_reference \\(swiglu\\)"),
])
def test_an_op_that_disagrees_with_its_reference_is_named(op, reference, named, reload, monkeypatch):
    monkeypatch.setattr(kernel_checks, reference, _off(getattr(kernel_checks, reference)))
    why = reload()
    assert why is not None and why.startswith(f"the built kernel's {op} disagrees with {named.replace(chr(92), '')} "
                                              f"(error ")
    assert why.endswith("in float32: not used") and not cpu_kernel.available()


@requires_kernel
def test_a_router_that_disagrees_is_named(reload, monkeypatch):
    route = kernel_checks.router_reference

    def swapped(router, x):  # the reference's first two experts the other way round
        ref = route(router, x)
        ref.expert_ids = ref.expert_ids.flip(-1)
        return ref

    monkeypatch.setattr(kernel_checks, "router_reference", swapped)
    assert reload().startswith("the built kernel's route_tokens disagrees with routing.py's softmax router (experts ")


@requires_kernel
def test_a_step_that_is_not_its_parts_is_named(reload, monkeypatch):
    """decode_step is compared bit for bit: one rounding of difference in one part is enough."""
    rms = kernel_checks._rms_norm
    monkeypatch.setattr(kernel_checks, "CHECKS", {"decode_step": kernel_checks.check_decode_step})
    monkeypatch.setattr(kernel_checks, "_rms_norm", lambda lib, x, w, eps: rms(lib, x, w, eps * 1.5))
    assert reload() == ("the built kernel's decode_step disagrees with its parts called one by one (its logits "
                        "differ) in float32: not used")


@requires_kernel
def test_every_op_of_the_built_library_agrees_with_its_reference_without_touching_the_global_rng():
    state = torch.random.get_rng_state()
    assert kernel_checks.self_check(cpu_kernel._library()) is None
    assert torch.equal(torch.random.get_rng_state(), state)
