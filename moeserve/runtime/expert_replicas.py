"""Redundant experts driven by live load (issue 38, item 4): each rank of an expert-parallel group has room for K
copies of other ranks' experts per MoE layer; every M steps the ranks agree on the load, place copies of the hot
experts where they lower the busiest rank's rows, and move the copies' weights; the exchange (expert_parallel.py)
then splits each expert's rows between its copies.

Shape legend: L MoE layers, E experts, R ranks, K replica slots per rank and layer.

    window of exchanges -> all_reduce(SUM) [L, E + R]: rows routed to each expert, rows each rank computed
                        -> place_replicas per layer (every rank, on the same numbers: the same placement)
                        -> ExpertParallelExperts.set_replicas: the copies' weights from their owners, all_to_all
                        -> the exchange splits expert e's rows from each sender over e's copies (split_rows)

The placement rule (`place_replicas`): an expert's load is shared equally by its copies; repeatedly, take the
busiest rank, and its hottest expert (by the rows each copy carries) that some rank with a free slot does not yet
hold; put a copy on the least loaded such rank if that lowers the ranks' loads (sorted, busiest first,
lexicographically); stop when no move of the busiest rank's experts does, or no slot is free. Owners never move, so
every expert keeps its owner's copy; a rank never holds two copies of one expert. Pure Python on integers and
float divisions in a fixed order: the same load gives the same placement on every rank.

The routing rule (`split_rows`): each sender splits its n rows of an expert over the expert's m copies (owner
first, then replicas by rank) in equal integer parts, the remainder rows rotating over the copies from one call to
the next, so that single decode rows alternate. Only the sender must know the rule: the counts all-to-all tells
each receiver what it gets.

The copies' weights come from their owners over the group (an all_to_all_single per weight tensor, as bytes), not
from the checkpoint: they travel once per placement that changes, only the copies a rank newly holds, and the
group's fabric is the fastest path there is between GPUs (NVLink, InfiniBand), where a re-read of the checkpoint
would cost a disk read of every layer's slice of the expert (load_expert_slice reads whole expert rows of every
layer). It also serves what the checkpoint does not hold: in-memory models, and the quantized slices as the ranks
hold them. Every tensor of a shard travels: a gpt-oss expert's biases with its weights. A replica is the owner's
weights bit for bit, so its rows' results are the owner's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moeserve.runtime.backends.expert_shards import BiasedExpertShard, ExpertShard, QuantExpertShard

__all__ = ["Rebalance", "Replication", "copies_of", "imbalance", "place_replicas", "rank_rows", "split_rows"]

Shard = ExpertShard | QuantExpertShard | BiasedExpertShard


# ---- the placement (pure: tested alone) ------------------------------------------------------------------------
def copies_of(ranges: Sequence[range], replicas: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per expert, the ranks holding a copy of it: its owner first, then the ranks holding a replica, in rank order."""
    copies = [[r] for r, rg in enumerate(ranges) for _ in rg]
    for r, ids in enumerate(replicas):
        for e in ids:
            copies[e].append(r)
    return copies


def rank_rows(load_E: Sequence[float], ranges: Sequence[range], replicas: Sequence[Sequence[int]]) -> list[float]:
    """The rows each rank computes for `load_E` when each expert's rows are shared equally by its copies."""
    rows = [0.0] * len(ranges)
    for e, ranks in enumerate(copies_of(ranges, replicas)):
        for r in ranks:
            rows[r] += load_E[e] / len(ranks)
    return rows


def imbalance(rows_R: Sequence[float]) -> float:
    """The busiest rank's rows over the mean (1.0: balanced; R: one rank does everything); 1.0 with no rows."""
    total = sum(rows_R)
    return 1.0 if total <= 0 else max(rows_R) * len(rows_R) / total


def place_replicas(load_E: Sequence[int], ranges: Sequence[range], room: int) -> list[list[int]]:
    """Per rank, the experts (sorted) whose copies it holds beside its own, at most `room` each, for the load
    `load_E` (rows routed to each expert, summed over the group): the greedy rule of the module docstring.
    Deterministic: the same arguments give the same placement."""
    R, E = len(ranges), len(load_E)
    if [e for rg in ranges for e in rg] != list(range(E)):
        raise ValueError(f"ranges {list(ranges)} do not split {E} experts into contiguous ranks")
    if isinstance(room, bool) or not isinstance(room, int) or room < 0:
        raise ValueError(f"room = {room!r}: expected an integer >= 0 (replica slots per rank)")
    if any(n < 0 for n in load_E):
        raise ValueError(f"load {list(load_E)}: expected rows >= 0 per expert")
    replicas: list[list[int]] = [[] for _ in range(R)]
    copies = copies_of(ranges, replicas)
    rows = rank_rows(load_E, ranges, replicas)
    while any(len(ids) < room for ids in replicas):
        busiest = max(range(R), key=lambda r: (rows[r], -r))
        hosted = [e for e in range(E) if busiest in copies[e] and load_E[e] > 0]
        for e in sorted(hosted, key=lambda e: (-load_E[e] / len(copies[e]), e)):
            open_ranks = [r for r in range(R) if len(replicas[r]) < room and r not in copies[e]]
            if not open_ranks:
                continue
            dst = min(open_ranks, key=lambda r: (rows[r], r))
            trial = [ids + [e] if r == dst else ids for r, ids in enumerate(replicas)]
            new_rows = rank_rows(load_E, ranges, trial)
            if sorted(new_rows, reverse=True) < sorted(rows, reverse=True):
                replicas, rows = trial, new_rows
                copies = copies_of(ranges, replicas)
                break
        else:
            break  # no copy of the busiest rank's experts lowers the loads
    return [sorted(ids) for ids in replicas]


def split_rows(n: int, m: int, phase: int) -> list[int]:
    """n rows over m copies: equal integer parts, the n % m remainder rows to copies chosen by `phase` (0 <= phase <
    m), so that a phase rotating from call to call spreads them evenly. Sums to n."""
    return [(n * (i + 1) + phase) // m - (n * i + phase) // m for i in range(m)]


# ---- a shard's weights as tensors to move ----------------------------------------------------------------------
def shard_tensors(shard: Shard) -> dict[str, Tensor]:
    """A shard's stacked weights by name, each [E_local, ...] (the expert axis first)."""
    if isinstance(shard, QuantExpertShard):
        return dict(shard.experts.named_buffers())
    if isinstance(shard, BiasedExpertShard):  # weights and biases (gpt-oss): a copy without its biases is not its owner
        return {name: p.detach() for name, p in shard.experts.named_parameters()}
    return {name: getattr(shard, name).detach() for name in ("w1", "w2", "w3") if getattr(shard, name) is not None}


def shard_like(like: Shard, expert_ids: list[int], tensors: dict[str, Tensor]) -> Shard:
    """A shard of the same kind as `like` holding `expert_ids`, from `tensors` (shard_tensors' names), laid out on
    the C kernel where `like` is."""
    if isinstance(like, QuantExpertShard):
        shard = QuantExpertShard.of_tensors(expert_ids, like.experts.spec, like.experts.act, tensors)
    elif isinstance(like, BiasedExpertShard):
        e = like.experts
        shard = BiasedExpertShard.of_tensors(expert_ids, e.act, e.limit, e.alpha, tensors)
    else:
        shard = ExpertShard(expert_ids, tensors["w1"], tensors["w2"], tensors.get("w3"))
    if like.kernel is not None:
        shard.prepare_inference()
    return shard


def as_bytes(t: Tensor) -> Tensor:
    """[n, ...] of any dtype as [n, bytes] uint8 (what every backend moves, bf16 and int4 included)."""
    return t.contiguous().view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


# ---- the periodic rebalance (a collective, between steps) ------------------------------------------------------
@dataclass
class Rebalance:
    """One placement's numbers, per MoE layer (what a metrics endpoint reads: issue 38, item 6)."""

    step: int  # the steps with work counted when it ran
    load: list[list[int]]  # [L][E] rows routed to each expert in the window, summed over the group
    before: list[float]  # imbalance the window measured: rows each rank computed, under the placement then in force
    owners_only: list[float]  # what the window's load gives with no replicas (= before in the first window)
    after: list[float]  # what the window's load gives under the placement now in force (predicted: equal split)
    replicas: list[list[list[int]]]  # [L][R] the placement now in force (the new one, or the one kept)
    moved: int  # expert copies whose weights travelled (each layer's and rank's new copies)


@dataclass
class Replication:
    """The rebalance of one rank's MoE layers: `after_step` once per lockstep step with work (every rank does the
    same, so they rebalance together), `rebalance` every `every` of them. `room` replica slots per rank and layer.
    A layer keeps the copies it has unless the new placement's imbalance, on the window's load, is lower than theirs
    by more than `keep_within`: a window's noise alone moves no weights."""

    layers: list[nn.Module]  # expert_parallel.ExpertParallelExperts (which imports this module: not named here)
    room: int
    every: int
    keep_within: float = 0.02
    steps: int = 0
    history: list[Rebalance] = field(default_factory=list)
    _seen: list[tuple[Tensor, int]] = field(default_factory=list)  # each layer's counters at the last rebalance

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("replication needs at least one expert-parallel MoE layer")
        if isinstance(self.room, bool) or not isinstance(self.room, int) or self.room < 0 or self.every < 1:
            raise ValueError(f"room = {self.room!r}, every = {self.every!r}: expected an integer >= 0 and >= 1")
        self._seen = [(ep.routed_E.clone(), ep.stats.rows_computed) for ep in self.layers]

    def after_step(self) -> Rebalance | None:
        self.steps += 1
        return self.rebalance() if self.steps % self.every == 0 else None

    def rebalance(self) -> Rebalance:
        """Agree on the window's load (one all-reduce), place the replicas of every layer and move their weights.
        Every rank of the group calls it together."""
        first = self.layers[0]
        group, E = first.group, first.n_experts
        R, me = group.world_size, group.rank
        window = torch.zeros(len(self.layers), E + R, dtype=torch.int64, device="cpu")
        for i, (ep, (routed, computed)) in enumerate(zip(self.layers, self._seen)):
            window[i, :E] = ep.routed_E - routed
            window[i, E + me] = ep.stats.rows_computed - computed
        window = window.to(group.device)
        dist.all_reduce(window, op=dist.ReduceOp.SUM, group=group.group)
        window = window.cpu().tolist()
        self._seen = [(ep.routed_E.clone(), ep.stats.rows_computed) for ep in self.layers]
        report = Rebalance(self.steps, [], [], [], [], [], 0)
        for ep, row in zip(self.layers, window):
            load, computed = row[:E], row[E:]
            placement = place_replicas(load, ep.ranges, self.room) if sum(load) else ep.placement
            if imbalance(rank_rows(load, ep.ranges, ep.placement)) <= imbalance(
                    rank_rows(load, ep.ranges, placement)) + self.keep_within:
                placement = ep.placement
            report.moved += ep.set_replicas(placement)
            report.load.append(load)
            report.before.append(imbalance(computed))
            report.owners_only.append(imbalance(rank_rows(load, ep.ranges, [[]] * R)))
            report.after.append(imbalance(rank_rows(load, ep.ranges, placement)))
            report.replicas.append(placement)
        self.history.append(report)
        return report
