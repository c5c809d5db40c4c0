"""The C kernel's binary interface as Python reads it: kernels/moeserve_kernels.h parsed into ctypes prototypes
(parse_header), its ABI number, and the ctypes Structures that mirror its structs, each checked against the header
field by field when the library loads (check_structures): the header is the one declaration the C code and these
bindings both follow, so an argument or a field out of place is an error at load, not a weight read as another.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from moeserve.errors import MoeServeError

ABI = 4  # the MOESERVE_KERNEL_ABI the bindings here, in cpu_kernel.py and in kernel_decode.py are written for
DTYPES = (torch.float32, torch.bfloat16)


class KernelError(MoeServeError, RuntimeError):
    """The kernel was asked for where it is not available (the message says why)."""


def check_abi(lib: ctypes.CDLL) -> None:
    """The library's moeserve_kernel_abi() is the ABI these bindings were written for, or KernelError."""
    fn = lib.moeserve_kernel_abi
    fn.restype, fn.argtypes = ctypes.c_int, []
    if fn() != ABI:
        raise KernelError(f"the built library's kernel ABI is {fn()}, not the {ABI} this moeserve binds: not used")


# ---- the header, parsed --------------------------------------------------------------------------
SCALARS = {"float": ctypes.c_float, "int": ctypes.c_int, "long": ctypes.c_long}
POINTEES = {"void", "float", "int", "long", "bf16", "struct router", "struct layer", "struct model"}


@dataclass(frozen=True)
class CType:
    """A declaration's C type: its base ("float", "struct router", ...) and how many pointers deep."""

    base: str
    pointers: int

    @property
    def ctype(self) -> type | None:
        """As ctypes passes it: any pointer as a void pointer (a tensor's data_ptr(), a byref, an array), a scalar
        as itself, void (a return type) as None."""
        if self.pointers:
            return ctypes.c_void_p
        return None if self.base == "void" else SCALARS[self.base]


@dataclass(frozen=True)
class Header:
    functions: dict[str, tuple[type | None, list[type]]]  # name: (restype, argtypes)
    structs: dict[str, list[tuple[str, CType]]]  # name (without "struct"): its fields in order
    abi: int


def parse_type(decl: str, what: str, embedded: tuple[str, ...] = ()) -> CType:
    """A declaration's type without its name ("const float *", "bf16 *const *", "long"): the types the header
    uses and no others, so that a new one is taught here rather than guessed at. `embedded`: the structs a
    struct's field may hold by value."""
    words = decl.replace("*", " * ").split()
    pointers = words.count("*")
    base = " ".join(w for w in words if w not in ("*", "const"))
    if pointers and base in POINTEES or not pointers and (base in SCALARS or base in embedded):
        return CType(base, pointers)
    if base == "void" and not pointers and what.endswith("returns"):
        return CType(base, 0)
    raise KernelError(f"{what}: the C type {decl.strip()!r} is not one the bindings know")


def _split_name(decl: str, what: str) -> tuple[str, str]:
    m = re.fullmatch(r"(.*?[\s*])(\w+)", decl.strip())
    if m is None:
        raise KernelError(f"{what}: cannot read the declaration {decl.strip()!r}")
    return m.group(1), m.group(2)


def parse_header(text: str) -> Header:
    """moeserve_kernels.h's prototypes as ctypes (restype, argtypes), its structs' fields, its ABI number. Strict:
    anything it does not understand is a KernelError, not a binding guessed wrong."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    abi = re.search(r"^\s*#define MOESERVE_KERNEL_ABI (\d+)\s*$", text, flags=re.M)
    if abi is None:
        raise KernelError("the header defines no MOESERVE_KERNEL_ABI")
    text = re.sub(r"^\s*#.*$", " ", text, flags=re.M)
    text = text.replace("typedef unsigned short bf16;", " ")
    structs: dict[str, list[tuple[str, CType]]] = {}
    for m in re.finditer(r"struct (\w+)\s*\{(.*?)\};", text, flags=re.S):
        fields = structs[m.group(1)] = []
        for member in filter(str.strip, m.group(2).split(";")):  # "const void *n1, *wq" or "long P, E, K"
            first, *more = member.split(",")
            lead, name = _split_name(first, f"struct {m.group(1)}")
            base = lead.replace("*", " ")
            for decl, name in [(lead, name)] + [_split_name(base + d, f"struct {m.group(1)}") for d in more]:
                fields.append((name, parse_type(decl, f"struct {m.group(1)}.{name}",
                                                embedded=tuple(f"struct {s}" for s in structs))))
    text = re.sub(r"struct (\w+)\s*\{.*?\};", " ", text, flags=re.S)
    functions = {}
    for proto in filter(str.strip, text.split(";")):
        m = re.fullmatch(r"\s*([\w\s*]+?[\s*])(\w+)\s*\(([^()]*)\)\s*", proto)
        if m is None:
            raise KernelError(f"the header's {' '.join(proto.split())!r} is not a prototype the bindings read")
        ret, name, params = m.groups()
        args = [] if params.strip() in ("void", "") else params.split(",")
        restype = parse_type(ret, f"{name} returns")
        if restype.pointers:  # nothing returns memory: who would own it?
            raise KernelError(f"{name} returns: the C type {ret.strip()!r} is not one the bindings know")
        functions[name] = (restype.ctype, [parse_type(_split_name(a, name)[0], f"{name}({a.strip()})").ctype for a in args])
    return Header(functions, structs, int(abi.group(1)))


def check_structure(cls: type[ctypes.Structure], fields: list[tuple[str, CType]],
                    structs: dict[str, type[ctypes.Structure]]) -> None:
    """cls's _fields_ are the header struct's, name by name and type by type in order (a pointer: c_void_p or a
    ctypes POINTER to the same struct; a struct held by value: its Structure in `structs`), or KernelError."""
    def same(t: type, c: CType) -> bool:
        if c.pointers:
            if t is ctypes.c_void_p:
                return True
            target = structs.get(c.base.removeprefix("struct "))
            return c.pointers == 1 and target is not None and t is ctypes.POINTER(target)
        if c.base.startswith("struct "):
            return t is structs.get(c.base.removeprefix("struct "))
        return t is SCALARS[c.base]

    got = [(f[0], f[1]) for f in cls._fields_]
    for i in range(max(len(got), len(fields))):
        g = got[i] if i < len(got) else None
        w = fields[i] if i < len(fields) else None
        if g is None or w is None or g[0] != w[0] or not same(g[1], w[1]):
            have = "nothing" if g is None else f"{g[0]}: {g[1].__name__}"
            want = "nothing" if w is None else f"{w[0]}: {w[1].base}{' *' * w[1].pointers}"
            raise KernelError(f"{cls.__qualname__} does not match the header's struct: field {i} is {have}, "
                              f"the header's is {want}")


# ---- the structs ---------------------------------------------------------------------------------------------------
GATES = ("softmax", "sigmoid")  # the order of router.c's GATE_ enum


def _check_weights(what: str, dtype: torch.dtype, want: dict[str, tuple[Tensor, tuple[int, ...]]]) -> None:
    for name, (t, shape) in want.items():
        if (t.dtype != dtype or dtype not in DTYPES or tuple(t.shape) != shape or not t.is_contiguous()
                or not t.is_cpu):
            raise KernelError(f"{what}: {name} must be a contiguous {dtype} CPU tensor of shape {list(shape)} "
                              f"(float32 or bfloat16), not {t.dtype} {list(t.shape)}")


class _Router(ctypes.Structure):  # moeserve_kernels.h's struct router
    _fields_ = [("w", ctypes.c_void_p), ("emb", ctypes.c_void_p), ("P", ctypes.c_long), ("E", ctypes.c_long),
                ("K", ctypes.c_long), ("tau", ctypes.c_float), ("gate", ctypes.c_int), ("renormalize", ctypes.c_int)]


def router_args(w_PD: Tensor, top_k: int, gate: str = "softmax", renormalize: bool = False,
                embeddings: Tensor | None = None, tau: float = 1.0) -> tuple[_Router, tuple[Tensor, Tensor | None]]:
    """KernelRouter's struct router, checked, and the tensors it points into (to be held while it is used)."""
    P, D = w_PD.shape
    E = P if embeddings is None else embeddings.shape[0]
    _check_weights("router", w_PD.dtype, {"w": (w_PD, (P, D))})
    if gate not in GATES or not 0 < top_k <= E or not tau > 0:
        raise KernelError(f"router: gate {gate!r} (one of {GATES}), top_k {top_k} of {E} experts, tau {tau} > 0")
    emb = None
    if embeddings is not None:
        if embeddings.shape != (E, P):
            raise KernelError(f"router: embeddings [{E}, {P}] for a projection to {P}, not {list(embeddings.shape)}")
        emb = torch.nn.functional.normalize(embeddings.detach().float(), dim=-1).contiguous()
    args = _Router(w_PD.data_ptr(), None if emb is None else emb.data_ptr(), P, E, top_k, tau, GATES.index(gate),
                   int(renormalize))
    return args, (w_PD, emb)


class _Layer(ctypes.Structure):  # struct layer
    _fields_ = [*((n, ctypes.c_void_p) for n in ("n1", "wq", "wk", "wv", "wo", "n2")), ("eps1", ctypes.c_float),
                ("eps2", ctypes.c_float), ("router", _Router),
                *((n, ctypes.c_void_p) for n in ("w1", "w3", "w2")), *((n, ctypes.c_long) for n in ("s1", "s3", "s2")),
                # ABI 2: quantized weights (fmt 0: none; a _Layer filled up to s2 is a float layer)
                *((n, ctypes.c_void_p) for n in ("cq", "ck", "cv", "co", "c1", "c3", "c2")),
                *((n, ctypes.c_long) for n in ("t1", "t3", "t2")), ("fmt", ctypes.c_int), ("group", ctypes.c_long),
                # ABI 3: attention's maps' own formats (an int4 layer keeping some at int8)
                *((n, ctypes.c_int) for n in ("fq", "fk", "fv", "fo")), *((n, ctypes.c_long) for n in ("gq", "gk", "gv", "go")),
                # ABI 4: QK-norm (qk 0: none; 1 per head, 2 over the whole projection)
                ("qn", ctypes.c_void_p), ("kn", ctypes.c_void_p), ("qk_eps", ctypes.c_float), ("qk", ctypes.c_int)]


class _Model(ctypes.Structure):  # struct model
    _fields_ = [*((n, ctypes.c_long) for n in ("L", "D", "H", "G", "Dh", "F", "V")), ("layers", ctypes.POINTER(_Layer)),
                ("norm", ctypes.c_void_p), ("head", ctypes.c_void_p), ("eps", ctypes.c_float),
                *((n, ctypes.c_void_p) for n in ("emb", "cos", "sin")),
                *((n, ctypes.c_long) for n in ("n_emb", "n_pos", "window")),
                ("head_scale", ctypes.c_void_p), ("head_fmt", ctypes.c_int), ("head_group", ctypes.c_long)]


STRUCTS = {"router": _Router, "layer": _Layer, "model": _Model}  # the header's structs, by name


def check_structures(header: Header) -> None:
    """Each Structure here is its struct in the header, field by field (cpu_kernel._library calls this at load);
    KernelError names the first that is not."""
    if set(header.structs) != set(STRUCTS):
        raise KernelError(f"the header declares structs {sorted(header.structs)}, kernel_decode.py mirrors "
                          f"{sorted(STRUCTS)}")
    for name, cls in STRUCTS.items():
        check_structure(cls, header.structs[name], STRUCTS)
