"""The lockstep of an expert-parallel rank (ep_rank.py's module docstring has the protocol): before each step, the
group agrees on its maxima in one collective; after it, a rank that made fewer forward passes than agreed makes
empty ones, so that every rank reaches each MoE layer's exchange as often as the others."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeserve.runtime.expert_parallel import EPGroup, ExpertParallelError, ExpertParallelExperts, LockstepError
from moeserve.runtime.model import Transformer

__all__ = ["Lockstep", "UNKNOWN"]

UNKNOWN = 1 << 62  # a step's token count where a rank cannot know it beforehand (the lockstep's all-to-all)


class Lockstep:
    """The step protocol (ep_rank.py's module docstring) for one rank's model: `agree` before a step, `pad` after it. It
    counts the model's forward passes (a forward pre-hook), and refuses one past the agreed number."""

    def __init__(self, group: EPGroup, model: Transformer, graph: bool = False):
        if group.world_size > 1 and (not model.moe_layers or not all(isinstance(m.experts, ExpertParallelExperts)
                                                                     for m in model.moe_layers)):
            raise ExpertParallelError("the lockstep runs a model whose MoE layers' experts are ExpertParallelExperts "
                                      "(load it with load_rank_engine)")
        self.group, self.model = group, model
        self.layers = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
        self.calls = 0  # forward passes made since the last `agree`
        self.allowed = 0  # the most this step may make: the group's agreed maximum
        self.graph = graph  # this rank's decode can run a compiled step (through the fixed exchange)
        self.fixed_step = False  # this step's: every rank runs its compiled decode or nothing (agreed)
        model.register_forward_pre_hook(self._count)

    def _count(self, module: nn.Module, args) -> None:
        self.calls += 1
        if self.calls > self.allowed:
            raise LockstepError(f"rank {self.group.rank} was about to make model call {self.calls} of a step for "
                                f"which the group agreed on {self.allowed}: a path that calls the model more often "
                                f"than its plan counts")

    def agree(self, calls: int, finished: bool, tokens: int | None = None, eager: bool = False) -> tuple[int, bool]:
        """(the most calls any rank makes this step, whether every rank is finished), and every MoE layer told the
        most tokens any rank passes it this step (`step_tokens`: the packed exchange's size; `tokens` None, not
        known beforehand, on any rank: the variable exchange) and whether the step is a fixed one (`fixed_step`:
        no rank's step is `eager` and every rank has the graph). One all-to-all of four numbers, whose maxima are
        taken here: one message each way between any two ranks, where gloo's all-reduce makes two rounds."""
        R = self.group.world_size
        mine = [calls, 0 if finished else 1, UNKNOWN if tokens is None else tokens, int(eager or not self.graph)]
        if R == 1:  # nobody to agree with
            most, anyone_left, most_tokens, any_eager = mine
        else:
            t = torch.tensor(mine * R, dtype=torch.int64, device=self.group.device)
            got = torch.empty_like(t)
            dist.all_to_all_single(got, t, group=self.group.group)
            most, anyone_left, most_tokens, any_eager = got.view(R, len(mine)).amax(0).tolist()
        self.fixed_step = not any_eager
        for layer in self.layers:
            layer.step_tokens = None if most_tokens >= UNKNOWN else most_tokens
            layer.fixed_on = self.fixed_step
        self.calls, self.allowed = 0, most
        return most, anyone_left == 0

    @torch.inference_mode()
    def empty_pass(self) -> None:
        """Every MoE layer called on 0 tokens: it takes part in exactly the exchanges a real forward makes (the same
        modules decide them), with nothing to send."""
        p = self.model.tok_embeddings.weight
        x_1TD = torch.zeros(1, 0, self.model.cfg.d_model, dtype=p.dtype, device=p.device)
        for layer in self.model.moe_layers:
            layer(x_1TD)

    def exchanges_per_pass(self) -> list[int]:
        """Each of `layers`' exchange calls in one forward pass (two for a VQ mixed layer whose discrete path is no
        table), counted by hooks over one empty pass that every rank makes together: the fixed exchange counts
        nothing itself, and a hook traced into a compiled step would be one of its guards."""
        calls = [0] * len(self.layers)

        def counter(i: int):
            def count(module: nn.Module, args) -> None:
                calls[i] += 1
            return count

        hooks = [layer.register_forward_pre_hook(counter(i)) for i, layer in enumerate(self.layers)]
        try:
            self.empty_pass()
        finally:
            for h in hooks:
                h.remove()
        return calls

    def pad(self) -> int:
        """Empty passes up to the agreed number; how many (none in a group of one: no other rank waits)."""
        n = self.allowed - self.calls if self.group.world_size > 1 else 0
        for _ in range(n):
            self.empty_pass()
        self.calls = self.allowed
        self.fixed_step = False
        for layer in self.layers:  # past the step: a call outside one (a table's build) takes the variable exchange
            layer.step_tokens, layer.fixed_on = None, False
        return n
