"""OMoE: the orthogonal optimizer for experts (paper 003, section 3.2), a wrapper around any torch optimizer.

Steps are numbered from 1 by the wrapper. Step i is an O step when i % s == 0, else an R step (Algorithm 3):

  R step (eq. 6)       the base optimizer updates every parameter, untouched; the wrapper records, for each
                       (layer, expert, linear map), the mean input row x̄ that map saw in the step's forward.
  O step (eq. 7-10)    each recorded x̄ of the window i - s <= î <= i updates that expert's projector by RLS,
                         k = P x̄ / (a + x̄ᵀ P x̄),   P <- P - k x̄ᵀ P,   a = a0 * lambda^(i / n)
                       then each expert's gradient G_m [out, in] becomes G_m P̄_m, P̄_m the mean projector of
                       the *other* experts, and only expert parameters are stepped, by the same base optimizer
                       (its state, e.g. AdamW's moments, is shared between R and O steps, as the paper says).

P_m (starting at I) approximately projects onto the complement of the span of expert m's past mean inputs, so an
update G_m P̄_m leaves the other experts' input directions (almost) alone: W_m + ΔW_m maps those inputs as before
and the experts are pushed apart instead of collapsing onto one function (the paper's Table 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moeserve.runtime.experts import Experts

# w1 and w3 read the same input rows (x, over D), so one projector "in" serves both; w2 reads the hidden
# rows h (over F) and has its own projector "hidden". The w3 observation is skipped: it repeats w1's rows.
_PROJ_OF_MAP = {"w1": "in", "w3": "in", "w2": "hidden"}
PROJECTORS = ("in", "hidden")


@dataclass
class OMoEConfig:
    every: int = 5  # s, the skipping step: every s-th step is an O step (the paper uses 5)
    a0: float = 1.0  # alpha_0 of eq. 10; smaller = a sharper projector (closer to an exact null-space)
    decay: float = 0.1  # lambda: alpha decays as a0 * lambda^(i/n)
    total_steps: int = 1000  # n, the number of steps the decay is spread over
    # Scale each x̄ to unit length before RLS. The paper's a is absolute, but mean hidden rows are tiny (|x̄|^2 ~ 1e-3
    # measured on the tiny preset), so a0 = 1 would leave P ~ I and OMoE a no-op. With unit inputs a is scale-free:
    # a = 1 halves the gradient along a newly seen direction, a -> 0 removes it.
    unit_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("every", "total_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"OMoEConfig field '{name}' = {v!r}: expected an integer >= 1")
        for name, hi, expected in (("a0", math.inf, "a finite number > 0"), ("decay", 1.0, "a number in (0, 1]")):
            v = getattr(self, name)
            ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and 0 < v <= hi
            if not ok:
                raise ValueError(f"OMoEConfig field '{name}' = {v!r}: expected {expected}")


@torch.no_grad()
def rls_update(P_EII: Tensor, x_EI: Tensor, a: float, has_E: Tensor | None = None) -> Tensor:
    """One RLS step of eq. 9-10 for every expert at once: P <- P - k x̄ᵀ P with k = P x̄ / (a + x̄ᵀ P x̄).

    P is symmetric (it starts at I and each step keeps it so), hence x̄ᵀ P = (P x̄)ᵀ and the update is
    P - u uᵀ with u = P x̄ / sqrt(a + x̄ᵀ P x̄): one fused pass over P, and symmetric to the last bit, where the
    literal k (x̄ᵀ P) would drift by rounding. By Sherman-Morrison, after x̄_1..x̄_t,
    P = (I + sum_j x̄_j x̄_jᵀ / a)^-1, which shrinks the component of P x̄_j along every eigen-direction to at most sqrt(a)/2: an a
    small against |x̄|^2 makes P a near-exact projector onto the complement of the recorded inputs. Experts
    with has_E False are left as they are (a zero x̄ is a no-op).
    """
    if has_E is not None:
        x_EI = x_EI * has_E[:, None].to(x_EI.dtype)
    Px_EI = torch.einsum("eij,ej->ei", P_EII, x_EI)
    u_EI = Px_EI / (a + (x_EI * Px_EI).sum(-1)).sqrt()[:, None]
    return torch.baddbmm(P_EII, u_EI[:, :, None], u_EI[:, None, :], alpha=-1)


class _Recorder:
    """The `observer` OMoE installs on one Experts module (see `InputObserver` in runtime/experts.py).

    It records only training forwards (module in train mode and autograd on): evaluation and generation
    must not move the projectors. A deepcopy of the model gets no observer (`__deepcopy__` returns None),
    so a copied model never feeds a wrapper that does not own it.
    """

    def __init__(self, owner: OMoE, layer: str, module: Experts):
        self.owner, self.layer, self.module = owner, layer, module

    def __call__(self, expert: int, map_name: str, x_NI: Tensor) -> None:
        if map_name == "w3" or not (self.module.training and torch.is_grad_enabled()):
            return
        self.owner._record(self.layer, _PROJ_OF_MAP[map_name], expert, x_NI)

    def __deepcopy__(self, memo: dict) -> None:
        return None


class OMoE:
    """OMoE(model, base, cfg): R steps are `base.step()` alone; every `cfg.every`-th step is an O step.

    Use it in place of the base optimizer: forward, backward, `step()`, `zero_grad()`. `is_o_step()` says
    what the next step will be (for logging). torch's LR schedulers insist on an `Optimizer` instance: give
    them `omoe.base`, whose `param_groups` are the very objects this wrapper's `param_groups` returns.
    """

    def __init__(self, model: nn.Module, base: torch.optim.Optimizer, cfg: OMoEConfig):
        self.model, self.base, self.cfg = model, base, cfg
        self.step_count = 0
        self.experts: dict[str, Experts] = {
            (name or "experts"): m for name, m in model.named_modules() if isinstance(m, Experts)
        }
        if not self.experts:
            raise ValueError("OMoE: the model has no moeserve.runtime.experts.Experts module to optimise")
        self._expert_params = {id(p) for m in self.experts.values() for p in (m.w1, m.w2, m.w3) if p is not None}
        # Projectors per (layer, "in"|"hidden"), stacked over experts [E, I, I], float32, start at I.
        self.projectors: dict[tuple[str, str], Tensor] = {}
        for name, m in self.experts.items():
            E, F, D = m.w1.shape
            for proj, dim in (("in", D), ("hidden", F)):
                eye = torch.eye(dim, dtype=torch.float32, device=m.w1.device)
                self.projectors[(name, proj)] = eye.expand(E, dim, dim).clone()
            m.observer = _Recorder(self, name, m)
        # In-flight sums of the current step's forward(s): key -> (sum [E, I], rows [E]).
        self._acc: dict[tuple[str, str], tuple[Tensor, Tensor]] = {}
        # Window since the last O step: key -> list of (x̄ [E, I], has [E]) one per recorded step, oldest first.
        self._pending: dict[tuple[str, str], list[tuple[Tensor, Tensor]]] = {k: [] for k in self.projectors}

    # ---- recording (R steps, Algorithm 3 line 7: O.add(X)) ---------------------------------------------
    def _record(self, layer: str, proj: str, expert: int, x_NI: Tensor) -> None:
        key = (layer, proj)
        if key not in self._acc:
            E, I = self.projectors[key].shape[:2]
            dev = self.projectors[key].device
            self._acc[key] = (torch.zeros(E, I, device=dev), torch.zeros(E, device=dev))
        s_EI, n_E = self._acc[key]
        s_EI[expert] += x_NI.detach().float().sum(0).to(s_EI.device)
        n_E[expert] += x_NI.shape[0]

    def _flush(self) -> None:
        """Close the step: the rows seen since the last step() become one x̄ per (layer, expert, map).

        Under gradient accumulation that is the mean over all micro-batches of the step, i.e. x̄ of the
        step's whole mini-batch, which is what the paper's x̄_{l-1}(î) is."""
        for key, (s_EI, n_E) in self._acc.items():
            has_E = n_E > 0
            if has_E.any():
                self._pending[key].append((s_EI / n_E.clamp(min=1)[:, None], has_E))
        self._acc = {}

    def mean_inputs(self, layer: str, proj: str) -> tuple[Tensor, Tensor]:
        """The window the next O step will fold into P: x̄ [S, E, I] and has [S, E], including the rows
        recorded since the last step() (a diagnostic; the state is not changed)."""
        x_SEI, has_SE = self._stack_pending((layer, proj))
        if (layer, proj) in self._acc:
            s_EI, n_E = self._acc[(layer, proj)]
            x_SEI = torch.cat([x_SEI.to(s_EI.device), (s_EI / n_E.clamp(min=1)[:, None])[None]])
            has_SE = torch.cat([has_SE.to(n_E.device), (n_E > 0)[None]])
        return x_SEI, has_SE

    # ---- optimizer surface ------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.base.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def is_o_step(self, i: int | None = None) -> bool:
        """Whether step i (default: the next one, step_count + 1) is an O step: i % every == 0."""
        return (self.step_count + 1 if i is None else i) % self.cfg.every == 0

    def alpha(self, i: int) -> float:
        """alpha of eq. 10 at step i: a0 * lambda^(i / n), decaying so later projectors get sharper."""
        return self.cfg.a0 * self.cfg.decay ** (i / self.cfg.total_steps)

    def step(self) -> None:
        """Take step i = step_count + 1: an R step (eq. 6) or, when i % every == 0, an O step (eq. 7-10)."""
        self.step_count += 1
        i = self.step_count
        self._flush()
        if not self.is_o_step(i):
            self.base.step()  # R step: exactly the base optimizer, gradients untouched
            return
        with torch.no_grad():
            a = self.alpha(i)
            for key, entries in self._pending.items():  # eq. 9-10 with every x̄(î), i - s <= î <= i
                P = self.projectors[key]
                for x_EI, has_E in entries:
                    if self.cfg.unit_inputs:
                        x_EI = torch.nn.functional.normalize(x_EI, dim=-1)
                    P = rls_update(P, x_EI.to(P.device), a, has_E.to(P.device))
                self.projectors[key] = P
            for name, m in self.experts.items():  # eq. 7-8: G_m <- G_m P̄_m
                E = m.n_experts
                for proj, maps in (("in", (m.w1, m.w3)), ("hidden", (m.w2,))):
                    P = self.projectors[(name, proj)]
                    # Mean of the other experts' projectors, (sum - P_m) / (E - 1); with one expert nothing
                    # else is to be kept clear of, so its gradient passes unchanged.
                    Pbar = (P.sum(0, keepdim=True) - P) / (E - 1) if E > 1 else None
                    for w in maps:
                        if w is None or w.grad is None or Pbar is None:
                            continue
                        w.grad.copy_(torch.bmm(w.grad.float(), Pbar.to(w.grad.device)).to(w.grad.dtype))
            for group in self.base.param_groups:  # only θ (the experts) moves in an O step
                for p in group["params"]:
                    if id(p) not in self._expert_params:
                        p.grad = None
        self.base.step()
        for entries in self._pending.values():
            entries.clear()

    # ---- state (flat tensors only, for safetensors) -------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        """`omoe.{layer}.{proj}.P` [E, I, I], `.pending` [S, E, I], `.pending_mask` [S, E] (bool), and
        `omoe.step` (0-dim int64). Layer = the Experts module's qualified name, e.g. `layers.1.ffn.experts`.
        Rows recorded since the last step() are not included: save between steps. The base optimizer's
        state is the caller's to save."""
        out: dict[str, Tensor] = {"omoe.step": torch.tensor(self.step_count, dtype=torch.int64)}
        for (layer, proj), P in self.projectors.items():
            x, has = self._stack_pending((layer, proj))
            out[f"omoe.{layer}.{proj}.P"] = P.detach().clone()
            out[f"omoe.{layer}.{proj}.pending"] = x
            out[f"omoe.{layer}.{proj}.pending_mask"] = has
        return out

    def _stack_pending(self, key: tuple[str, str]) -> tuple[Tensor, Tensor]:
        (E, I), dev = self.projectors[key].shape[:2], self.projectors[key].device
        entries = self._pending[key]
        if not entries:
            return torch.zeros(0, E, I, device=dev), torch.zeros(0, E, dtype=torch.bool, device=dev)
        return torch.stack([x for x, _ in entries]).clone(), torch.stack([h for _, h in entries]).clone()

    def load_state_dict(self, d: dict[str, Tensor]) -> None:
        """Restore exactly what `state_dict` saved. Raises ValueError naming the key on a missing key, a
        shape that does not fit this model, or an `omoe.` key this model has no place for."""
        def get(key: str, shape: tuple[int | None, ...]) -> Tensor:
            if key not in d:
                raise ValueError(f"OMoE state: missing key '{key}'")
            t = d[key]
            if not isinstance(t, Tensor) or t.dim() != len(shape) or any(
                    s is not None and s != n for s, n in zip(shape, t.shape)):
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                want = tuple("S" if s is None else s for s in shape)
                raise ValueError(f"OMoE state: key '{key}' has shape {got}, expected {want}")
            return t

        step = int(get("omoe.step", ()).item())
        projectors, pending = {}, {}
        for (layer, proj), P in self.projectors.items():
            E, I = P.shape[:2]
            base = f"omoe.{layer}.{proj}"
            projectors[(layer, proj)] = get(f"{base}.P", (E, I, I)).to(P.device, torch.float32).clone()
            x = get(f"{base}.pending", (None, E, I))
            has = get(f"{base}.pending_mask", (x.shape[0], E))
            pending[(layer, proj)] = [(x[s].to(P.device, torch.float32).clone(), has[s].to(P.device, torch.bool))
                                      for s in range(x.shape[0])]
        known = {"omoe.step"} | {f"omoe.{l}.{p}.{f}" for l, p in self.projectors for f in ("P", "pending", "pending_mask")}
        for key in d:
            if key.startswith("omoe.") and key not in known:
                raise ValueError(f"OMoE state: unexpected key '{key}' (this model has no such expert layer)")
        self.step_count, self.projectors, self._pending, self._acc = step, projectors, pending, {}
