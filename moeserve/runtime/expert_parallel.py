"""Expert parallelism: each rank of a group holds 1/N of every MoE layer's experts, and the layer's routed rows
travel to the rank that owns their expert and back, inside the forward pass.

Shape legend: T tokens, D model dim, K experts per token, N routed rows (assignments), E experts, R ranks.

    x_TD, routing -> dispatch (experts.py: rows sorted by expert)
                  -> all_to_all counts    [E] per rank out, [R, E_local] in: what each rank will send here
                  -> all_to_all rows      in dispatch order; they arrive grouped by source rank, then by expert
                  -> reorder expert-major -> this rank's experts (ExpertShard: the C kernel where it runs)
                  -> reorder back -> all_to_all rows back -> combine (experts.py) -> y_TD

Rank r owns experts [r*E/R, (r+1)*E/R) (expert_shards.contiguous_ranges), so a rank's slice of the sorted rows is
one contiguous block and the dispatch order is already the send order. The rest of the model (attention, KV
cache, dense layers, routers) is whole on every rank: each rank runs its own requests (data-parallel attention,
as vLLM and SGLang do with expert parallelism) and meets the others only at the MoE layers. That makes the
exchange a collective every rank must reach together; the lockstep that guarantees it is ep_rank.py's.

Every router reaches the experts through `MoELayer.experts` (moe.py): softmax, sigmoid, xmoe, and vq, whose mixed
layer calls it for its continuous path. A VQ layer with vq_input='code' is laid out as a table of f_j(v_j)
(backends/eager.py, TableMoELayer): the table is built through this exchange once, when the backend lays the
model out, which every rank does at load, so each rank holds the whole table and the discrete path makes no
exchange at serving time. Paths that would call experts past this module are refused by name: the compiled
decode step on the variable exchange (compiled.model_uncompilable names it; on the fixed one it compiles), the CPU
kernel's whole-step decode (it needs the layer's experts as FusedExperts, which these are not:
ep_rank.load_rank_engine checks). A quantized checkpoint's ranks load their slice's integers and scales as stored
(QuantExpertShard), and the exchange moves activations only, so it is the same for every weight format. Experts
with biases or the clamped SwiGLU (gpt-oss's BiasedExperts) are a BiasedExpertShard of the slice's weights and
biases, computed by BiasedExperts' own math; each row comes back as its expert's whole output, down bias included,
so combine's gate multiplies all of it, as BiasedExperts does.

With redundant experts (expert_replicas.py: off by default), a rank also holds copies of other ranks' hot experts
in slots after its own, the same placement on every rank. Each sender splits an expert's rows over its copies and
sends them in the order of each rank's slots (its own experts, then its copies), so the counts all-to-all is
[slots] per rank instead of [E_local], and a receiver computes its own experts and its copies as two shards. A copy
is its owner's weights, so a row's result is the owner's: bit-identical where the expert computes each row alone
(the C kernel), within float rounding where a GEMM's blocking depends on how many rows it gets (torch).

Three exchanges, the same result (within float rounding):

  variable  (exchange; outside a step, or a step whose size is not known beforehand) the counts go first and come
            back to the host, which sizes the row buffers and the splits: each rank moves exactly the rows it
            routed, and the experts compute exactly the rows they got. Three collectives a layer call, a host sync,
            and shapes that depend on the routing.
  packed    (exchange with `packed`; a rank's steps, the default) the counts ride with the rows: each rank sends
            every rank a block of a header row (the counts of the receiver's slots, as int32) and C rows, its rows
            first, C = the step's most tokens * K, the step's most tokens agreed by the lockstep's one collective
            before the step (ep_rank.py: `step_tokens`); the receiver reads the header, computes the real rows only,
            and returns a block of C rows the same way. Two collectives a layer call instead of three, for R times
            the bytes at worst; a block larger than PACKED_MAX_BYTES (a long prefill chunk) takes the variable one.
            Each collective costs a round trip and every rank's wait for the slowest, which on CPU ranks is most of
            an exchange (docs/bench/log.md), so the rows it pads are the cheaper side. Replicas and every shard
            type go through it as through the variable one: only the sizes travel differently.
  fixed     (use_fixed, exchange_fixed) each rank sends every rank a block of C = max_tokens * K rows, its rows
            for that rank's experts (sorted by expert) then zeros, and the per-expert counts in a second
            fixed-size call; the receiver reads each row's expert from the counts on the device, runs its experts
            on all R * C rows with padding masked (experts.expert_rows) and returns R * C rows the same way. Every
            all-to-all has equal splits and a size fixed at use_fixed, the functional collectives
            (torch.distributed._functional_collectives) trace under torch.compile, and nothing reads the device
            from the host: a compiled step holds it whole (fullgraph, gloo too), and a CUDA graph replays it. vLLM's
            low-latency all-to-all (DeepEP) sizes its buffers the same way, by the most tokens a rank may send.

Which one: fixed where the step is compiled or captured (a CUDA graph cannot hold a host sync or a buffer sized by
one, so there is no choice), packed or variable otherwise. Variable moves and computes only the routed rows; fixed
moves R * C rows each way on every call, empty passes included, and its experts run on every padded row, which on a
decode step of a few tokens is a few kilobytes and a few small GEMMs a layer, but on a prefill chunk would be R
times the rows and E_local times the FLOPs. So a rank sets its buffers up once (use_fixed, every rank with the same
max_tokens: the buffers' size is part of the collective), and its lockstep turns them on (`fixed_on`) only for the
steps in which every rank runs its compiled decode step or nothing: a step with a prefill chunk or a scoring slice
on any rank runs eager on every rank, through the packed or variable exchange (ep_rank.py; vLLM's data-parallel
ranks agree the same way on whether a step runs its CUDA graphs). Every call of a step then takes the same exchange
on every rank, whatever its tokens. Buffers per batch bucket (C = bucket * K, smaller at small batches) would need
the ranks to agree on a bucket per pass, which the lockstep's collective could carry (`step_tokens`) but the fixed
path does not read yet. The fixed path has no redundant experts and no quantized shards (their row splits are made
on the host), no biased ones (gpt-oss's: expert_rows has no biases nor the clamped SwiGLU, and use_fixed refuses
them by name), and counts nothing itself: a count kept in Python and touched inside a compiled step becomes one of
its guards, so the rank counts its fixed calls per pass (ep_rank.py), and rows would need the host. Its experts
compute on torch's GEMMs, where a grouped GEMM (torch grouped_mm over rows sorted by expert) is the drop-in that
would not waste FLOPs on padding.
"""

from __future__ import annotations

import bisect
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from moeserve.errors import MoeServeError, UserError
from moeserve.runtime.backends.expert_shards import BiasedExpertShard, ExpertShard, QuantExpertShard, contiguous_ranges
from moeserve.runtime.backends.experts import expert_counts
from moeserve.runtime.expert_replicas import as_bytes, copies_of, shard_like, shard_tensors, split_rows
from moeserve.runtime.experts import BiasedExperts, Experts, combine, dispatch, expert_rows

__all__ = ["EPGroup", "ExpertParallelError", "ExpertParallelExperts", "ExchangeStats", "FixedBuffers", "LockstepError",
           "join_group", "use_fixed_exchange"]

# upper bounds (s) of the per-call all-to-all histogram (ExchangeStats.all_to_all_buckets; the served
# moeserve_ep_all_to_all_seconds): 2 gloo ranks on 2 CPU cores take 1-3 ms a layer call (moeserve bench ep)
A2A_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# the largest block (C rows of one sender for one receiver) the packed exchange sends: past it a call takes the
# variable exchange, whose third collective costs less than sending R times the rows (module docstring)
PACKED_MAX_BYTES = 1 << 20
ADDRESS = re.compile(r"^tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")


class ExpertParallelError(UserError):
    """An expert-parallel group or rank asked for something it cannot be: a bad address, rank or world size, more
    ranks than experts, a feature that would call the experts past the exchange, or a call the fixed exchange cannot
    size (more tokens than its buffers, a compiled step on the variable exchange)."""


class LockstepError(MoeServeError, RuntimeError):
    """The ranks of a group no longer reach the MoE layers together (a rank made more model calls than the group
    agreed, or a collective failed): the group is broken and must be restarted as a unit."""


@dataclass(frozen=True)
class EPGroup:
    """This process's place in an expert-parallel group: one torch.distributed process group, NCCL on GPUs and
    gloo on CPUs, whose ranks each hold a contiguous 1/N of every MoE layer's experts."""

    rank: int
    world_size: int
    backend: str  # "gloo" or "nccl"
    device: torch.device  # where the exchanged tensors live: cpu for gloo, this rank's GPU for nccl
    group: dist.ProcessGroup | None = field(default=None, repr=False)  # None: the default (WORLD) group

    def experts_of(self, n_experts: int, rank: int | None = None) -> range:
        """The global ids of the experts `rank` (default: this one) holds."""
        if self.world_size > n_experts:
            raise ExpertParallelError(f"{self.world_size} ranks for {n_experts} experts: every rank needs at least "
                                      f"one expert; use at most {n_experts} ranks")
        return contiguous_ranges(n_experts, self.world_size)[self.rank if rank is None else rank]

    def leave(self) -> None:
        """Destroy the process group (every rank calls this once its loop has stopped)."""
        if dist.is_initialized():
            dist.destroy_process_group(self.group)


def join_group(init_method: str, rank: int, world_size: int, *, device: str | torch.device = "cpu",
               backend: str | None = None, timeout_s: float = 300.0) -> EPGroup:
    """Join the expert-parallel group that rendezvouses at `init_method` ('tcp://host:port': rank 0 listens there;
    under Ray, the rank-0 actor's address). Blocks until all `world_size` ranks have joined. `backend` defaults to
    NCCL on a CUDA device and gloo on the CPU. A collective that waits longer than `timeout_s` (a rank died or
    hung) raises instead of waiting forever, so a broken group fails as a unit; it must exceed the longest single
    forward pass of any rank, which the others wait through at each MoE layer."""
    address = ADDRESS.match(init_method) if isinstance(init_method, str) else None
    if address is None or not 0 < int(address[2]) < 65536:
        raise ExpertParallelError(f"init_method = {init_method!r}: expected 'tcp://HOST:PORT' (rank 0's address)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ExpertParallelError(f"world_size = {world_size!r}: expected an integer >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ExpertParallelError(f"rank = {rank!r}: expected an integer in [0, {world_size})")
    if not timeout_s > 0:
        raise ExpertParallelError(f"timeout_s = {timeout_s!r}: expected a number of seconds > 0")
    dev = torch.device(device)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ExpertParallelError(f"backend = {backend!r}: expected 'gloo' (CPU) or 'nccl' (CUDA)")
    if backend == "nccl" and (dev.type != "cuda" or not torch.cuda.is_available() or not dist.is_nccl_available()):
        raise ExpertParallelError(f"backend 'nccl' needs a CUDA device and torch built with NCCL; device is {dev}, "
                                  f"CUDA {'available' if torch.cuda.is_available() else 'not available'}")
    if backend == "gloo" and dev.type != "cpu":
        raise ExpertParallelError(f"backend 'gloo' exchanges CPU tensors; device is {dev} (use 'nccl')")
    if dist.is_initialized():
        raise ExpertParallelError("this process already belongs to a torch.distributed group: one expert-parallel "
                                  "group per process (leave the other first)")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), device_id=dev if backend == "nccl" else None)
    return EPGroup(rank, world_size, backend, dev)


@dataclass
class ExchangeStats:
    """What one layer's exchanges have cost on this rank since it was made: the per-rank all-to-all metrics of a
    server (issue 38, item 6) read these. On gloo the collectives are synchronous, so their wall time is the
    all-to-all time; on NCCL it would be the launch only (CUDA events would be needed)."""

    calls: int = 0
    packed: int = 0  # of those, through the packed exchange (two collectives; the others three, or the fixed path's)
    all_to_all_s: float = 0.0  # in the layer call's all_to_all_single calls, summed
    # per call, its all-to-all seconds counted in A2A_BUCKETS (a call of t s in the first bucket whose bound is
    # >= t, the last one past every bound): a histogram at one bisect per layer call
    all_to_all_buckets: list[int] = field(default_factory=lambda: [0] * (len(A2A_BUCKETS) + 1))
    rows_sent: int = 0  # to other ranks (not counting rows for this rank's own experts)
    rows_received: int = 0  # from other ranks
    rows_computed: int = 0  # by this rank's experts and replicas, its own rows included (its share of the load)


@dataclass(frozen=True)
class FixedBuffers:
    """The constants of the fixed-size exchange (ExpertParallelExperts.use_fixed), on the exchange's device so that
    nothing is copied from the host inside a captured step. C = max_tokens * K rows per (sender, receiver) pair."""

    max_tokens: int  # the most tokens any rank passes the layer in one call, the same on every rank
    owner_E2: Tensor  # [E + 2] the rank owning each expert; R (nowhere: the dropped rows' slot) for E and E + 1
    send_RX: Tensor  # [R, X] the global ids of each rank's experts, padded with E + 1 (never counted) to X = max E_r


class ExpertParallelExperts(nn.Module):
    """A layer's experts on one rank of an EP group: called as an `Experts` is (MoELayer.experts), it holds only
    this rank's contiguous slice (`local`, global ids group.experts_of(E)) and exchanges the routed rows with the
    other ranks' slices (module docstring). Every rank must call it together, with its own tokens or none."""

    def __init__(self, group: EPGroup, n_experts: int, local: ExpertShard | QuantExpertShard | BiasedExpertShard):
        super().__init__()
        want = list(group.experts_of(n_experts))
        if local.expert_ids != want:
            raise ExpertParallelError(f"rank {group.rank} of {group.world_size} holds experts {want[0]}..{want[-1]} "
                                      f"of {n_experts}; given {local.expert_ids}")
        self.group, self.n_experts, self.local = group, n_experts, local
        self.ranges = contiguous_ranges(n_experts, group.world_size)
        self.stats = ExchangeStats()
        # rows this rank routed to each expert, in all (on the host: the model may be being built on the meta device)
        self.routed_E = torch.zeros(n_experts, dtype=torch.int64, device="cpu")
        # redundant copies (expert_replicas.py), the same on every rank: per rank, the other ranks' experts it holds
        self.placement: list[list[int]] = [[] for _ in range(group.world_size)]
        # this rank's copies: placement[rank], stacked
        self.replicas: ExpertShard | QuantExpertShard | BiasedExpertShard | None = None
        self._copies: list[list[tuple[int, int]]] | None = None  # per expert, (rank, slot) of each copy; None: none
        self.fixed: FixedBuffers | None = None  # the fixed-size exchange's buffers (use_fixed); None: it has none
        self.fixed_on = False  # calls take the fixed exchange (use_fixed turns it on; a rank's lockstep, per step)
        # the most tokens any rank passes this layer in the current step, agreed by the lockstep (ep_rank.py) before
        # it and cleared after: the size of the packed exchange's blocks (None: unknown, the variable exchange)
        self.step_tokens: int | None = None
        self.packed_max_bytes = PACKED_MAX_BYTES

    @classmethod
    def of(cls, experts: Experts | BiasedExperts, group: EPGroup) -> "ExpertParallelExperts":
        """This rank's slice copied out of a whole layer's experts (tests, benchmarks)."""
        shard = BiasedExpertShard if isinstance(experts, BiasedExperts) else ExpertShard
        return cls(group, experts.n_experts, shard.of(experts, group.experts_of(experts.n_experts)))

    def prepare_inference(self) -> bool:
        """The local experts on the CPU kernel where it runs (ExpertShard.prepare_inference); whether they are."""
        return self.local.prepare_inference()

    def forward(self, x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor, keep_TK: Tensor | None = None) -> Tensor:
        if self.fixed_on:
            return self.exchange_fixed(x_TD, expert_ids_TK, gates_TK, keep_TK)
        d = dispatch(x_TD, expert_ids_TK, gates_TK, self.n_experts, keep_TK)
        return combine(d, self.exchange(d.x_ND, d.counts, self.packed_rows(*expert_ids_TK.shape, x_TD)), x_TD)

    def packed_rows(self, T: int, K: int, x_TD: Tensor) -> int | None:
        """The rows C a (sender, receiver) block holds in the packed exchange for this call, or None for the variable
        one: packed where the lockstep agreed on the step's most tokens (`step_tokens`) and a block of C = that * K
        rows is at most PACKED_MAX_BYTES. Every rank decides the same, from agreed numbers and the same model."""
        if self.step_tokens is None:
            return None
        if T > self.step_tokens:
            raise LockstepError(f"rank {self.group.rank} passed {T} tokens to a MoE layer in a step whose ranks agreed "
                                f"on at most {self.step_tokens}: a model call larger than its plan counts")
        D, size = x_TD.shape[1], x_TD.element_size()
        C = self.step_tokens * K
        fits = D * size % 4 == 0 and D * size // 4 >= max(map(len, self.ranges)) + max(map(len, self.placement))
        return C if fits and C * D * size <= self.packed_max_bytes else None

    def use_fixed(self, max_tokens: int, on: bool = True) -> "ExpertParallelExperts":
        """Buffers for the fixed-size exchange (exchange_fixed), for calls of at most `max_tokens` tokens on any rank,
        taken from the next call on (`on`; else once `fixed_on` is set). Every rank of the group sets the same
        `max_tokens`, and turns it on for the same calls: the buffers' size is part of the collective. Plain
        (unquantized) local experts, no replicas: a quantized shard's and the replicas' row splits are sized on the
        host."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ExpertParallelError(f"max_tokens = {max_tokens!r}: expected an integer >= 1 (the most tokens a "
                                      f"rank passes one layer call)")
        if not isinstance(self.local, ExpertShard):  # quantized, or with biases / the clamped SwiGLU (gpt-oss)
            raise ExpertParallelError(f"the fixed exchange computes plain weights (no biases, no clamped SwiGLU); "
                                      f"this rank's experts are a {type(self.local).__name__}: use the variable "
                                      f"exchange")
        if any(self.placement):
            raise ExpertParallelError(f"the fixed exchange has no redundant experts; placement {self.placement}")
        R, E, dev = self.group.world_size, self.n_experts, self.group.device
        X = max(map(len, self.ranges))
        owner = [r for r, rg in enumerate(self.ranges) for _ in rg] + [R, R]
        send = [[*rg, *[E + 1] * (X - len(rg))] for rg in self.ranges]
        self.fixed = FixedBuffers(max_tokens, torch.tensor(owner, dtype=torch.int64, device=dev),
                                  torch.tensor(send, dtype=torch.int64, device=dev))
        self.fixed_on = on
        return self

    def exchange_fixed(self, x_TD: Tensor, expert_ids_TK: Tensor, gates_TK: Tensor,
                       keep_TK: Tensor | None = None) -> Tensor:
        """The layer's output as forward's, through buffers whose size depends on nothing but `use_fixed`'s
        max_tokens (module docstring): each rank sends each rank C = max_tokens * K rows, its rows for that
        rank's experts first (sorted by expert), zeros after, and the per-expert counts beside them; the receiver
        reads each row's expert from the counts (a searchsorted on the device) and returns C rows the same way.
        No host sync and no shape that depends on the routing: a compiled step traces it and a CUDA graph holds
        it. Dropped assignments (keep_TK False) are sorted last and sent nowhere."""
        fx = self.fixed
        if fx is None:
            raise ExpertParallelError("the fixed exchange has no buffers: call use_fixed first (every rank, the same "
                                      "max_tokens)")
        T, K = expert_ids_TK.shape
        if T > fx.max_tokens:
            raise ExpertParallelError(f"{T} tokens in one call to a fixed exchange sized for {fx.max_tokens} "
                                      f"(use_fixed's max_tokens, the same on every rank)")
        R, E, D, C = self.group.world_size, self.n_experts, x_TD.shape[1], fx.max_tokens * K
        g = self.group.group if self.group.group is not None else dist.group.WORLD
        ids_N = expert_ids_TK.reshape(-1)
        if keep_TK is not None:
            ids_N = torch.where(keep_TK.reshape(-1), ids_N, E)  # a dropped row: expert E, owned by no rank
        order_N = ids_N.argsort(stable=True)
        ids_N = ids_N[order_N]  # rank r's rows are one block (contiguous ranges), in rank order, dropped ones last
        counts_E2 = expert_counts(ids_N, E + 2)  # [E] counted, E dropped, E + 1 none: the padding of send_RX
        dest_N = fx.owner_E2[ids_N]  # R for a dropped row
        to_rank = torch.zeros(R + 1, dtype=torch.int32, device=ids_N.device).index_add_(0, fx.owner_E2, counts_E2)
        first_R1 = to_rank.cumsum(0) - to_rank  # where each rank's block starts in the sorted rows
        pos_N = torch.arange(ids_N.shape[0], device=ids_N.device) - first_R1[dest_N]
        slot_N = torch.where(dest_N < R, dest_N * C + pos_N, R * C)  # row R * C: the dropped rows' scratch
        tok_N = order_N // K
        x_send = x_TD.new_zeros(R * C + 1, D).index_copy_(0, slot_N, x_TD[tok_N])[:R * C]
        counts_in = funcol.all_to_all_single(counts_E2[fx.send_RX].reshape(-1), None, None, g)
        x_in = funcol.all_to_all_single(x_send, None, None, g)
        y_in = self._compute_fixed(x_in, counts_in.view(R, -1), C)
        y_back = funcol.all_to_all_single(y_in, None, None, g)
        y_N = torch.cat([y_back, y_back.new_zeros(1, D)])[slot_N]  # a dropped row reads the zero row
        gates_N = gates_TK.reshape(-1)[order_N]
        return torch.zeros_like(x_TD).index_add_(0, tok_N, (y_N * gates_N[:, None].to(y_N.dtype)).to(x_TD.dtype))

    def _compute_fixed(self, x_ND: Tensor, counts_RX: Tensor, C: int) -> Tensor:
        """This rank's experts on the received [R * C] rows: block r holds counts_RX[r, e] rows of local expert e
        in turn, then padding. Row j of a block belongs to the first expert whose running count exceeds j (past
        the last: X, no expert), so padding comes out zero (experts.expert_rows)."""
        R, X = counts_RX.shape
        ends_RX = counts_RX.to(torch.int64).cumsum(1)
        j_RC = torch.arange(C, device=x_ND.device).expand(R, C).contiguous()
        local_N = torch.searchsorted(ends_RX, j_RC, right=True).reshape(-1)
        shard = self.local
        return expert_rows(x_ND, local_N, shard.w1, shard.w2, shard.w3)

    def exchange(self, x_ND: Tensor, counts: list[int], packed: int | None = None) -> Tensor:
        """The experts' outputs for rows sorted by expert (`counts` [E] of each), in the same order, whichever rank
        computed them. Each rank calls it once per layer call, with zero rows if it has none. With replicas, each
        expert's rows are split over its copies (expert_replicas.split_rows) and sent in the order of the ranks'
        slots (their own experts, then their replicas). `packed`: C, the rows of a block of the packed exchange
        (module docstring; every rank gives the same), else the variable one."""
        R, g, dev, me = self.group.world_size, self.group.group, self.group.device, self.group.rank
        counts_E = torch.tensor(counts, dtype=torch.int64, device="cpu")
        self.routed_E += counts_E
        if self._copies is None:  # every expert on its owner alone: the sorted rows are already in send order
            send_S, order_N = counts_E, None
            slots = [len(r) for r in self.ranges]
        else:
            send_S, order_N = self._route(counts)
            slots = [len(r) + len(ids) for r, ids in zip(self.ranges, self.placement)]
        to_rank = [int(t.sum()) for t in send_S.split(slots)]  # rows this rank sends each rank
        S_me = slots[me]
        x_send = x_ND if order_N is None else x_ND[order_N.to(x_ND.device)]
        t0 = time.perf_counter()
        if packed is None:
            recv_RS = torch.empty(R * S_me, dtype=torch.int64, device=dev)
            dist.all_to_all_single(recv_RS, send_S.to(dev), [S_me] * R, slots, group=g)
            recv_RS = recv_RS.view(R, S_me).cpu()
            from_rank = recv_RS.sum(1).tolist()  # rows each rank sends here
            x_in = x_ND.new_empty(sum(from_rank), x_ND.shape[1])
            dist.all_to_all_single(x_in, x_send.contiguous(), from_rank, to_rank, group=g)
        else:
            recv_RS, x_in = self._send_packed(x_send, send_S, slots, to_rank, packed)
            from_rank = recv_RS.sum(1).tolist()
        t1 = time.perf_counter()
        order = expert_major(recv_RS)
        y_in = self._compute(x_in if order is None else x_in[order], recv_RS.sum(0).tolist())
        if order is not None:
            y_in = torch.empty_like(y_in).index_copy_(0, order.to(y_in.device), y_in)
        t2 = time.perf_counter()
        if packed is None:
            y_send = x_ND.new_empty(x_ND.shape[0], y_in.shape[1])
            dist.all_to_all_single(y_send, y_in.contiguous(), to_rank, from_rank, group=g)
        else:
            y_send = unpack(all_to_all_blocks(pack(y_in, from_rank, packed), g), to_rank)
        s = self.stats
        s.calls += 1
        s.packed += packed is not None
        a2a_s = (t1 - t0) + (time.perf_counter() - t2)
        s.all_to_all_s += a2a_s
        s.all_to_all_buckets[bisect.bisect_left(A2A_BUCKETS, a2a_s)] += 1
        s.rows_sent += sum(to_rank) - to_rank[me]
        s.rows_received += sum(from_rank) - from_rank[me]
        s.rows_computed += sum(from_rank)
        if order_N is None:
            return y_send
        return torch.empty_like(y_send).index_copy_(0, order_N.to(y_send.device), y_send)

    def _send_packed(self, x_send: Tensor, send_S: Tensor, slots: list[int], to_rank: list[int],
                     C: int) -> tuple[Tensor, Tensor]:
        """The packed exchange's one call out: to each rank a block of a header row (its slots' row counts, as int32)
        and C rows, its rows first; (the counts received, [R, S_me] on the host; the rows received, by source)."""
        R, me = self.group.world_size, self.group.rank
        out = x_send.new_empty(R, 1 + C, x_send.shape[1])
        head = out[:, 0].view(torch.int32)
        for r, n in enumerate(send_S.split(slots)):
            head[r, :len(n)] = n.to(head.device)
        pack(x_send, to_rank, C, out[:, 1:])
        got = all_to_all_blocks(out, self.group.group)
        recv_RS = got[:, 0].view(torch.int32)[:, :slots[me]].to(torch.int64).cpu()
        return recv_RS, unpack(got[:, 1:], recv_RS.sum(1).tolist())

    def _route(self, counts: list[int]) -> tuple[Tensor, Tensor]:
        """(rows this rank sends to each (rank, slot), every rank's slots in turn; the sorted rows' indices in that
        order): expert e's rows split over its copies, the split's remainder rotating with the call count."""
        blocks: dict[tuple[int, int], tuple[int, int]] = {}  # (rank, slot) -> (first row, rows)
        start, turn = 0, self.stats.calls + self.group.rank
        for e, (n, copies) in enumerate(zip(counts, self._copies)):
            for copy, part in zip(copies, split_rows(n, len(copies), (turn + e) % len(copies))):
                blocks[copy] = (start, part)
                start += part
        send, index = [], []
        for r, (rg, ids) in enumerate(zip(self.ranges, self.placement)):
            for slot in range(len(rg) + len(ids)):
                first, n = blocks[(r, slot)]
                send.append(n)
                if n:
                    index.append(torch.arange(first, first + n, device="cpu"))
        order_N = torch.cat(index) if index else torch.zeros(0, dtype=torch.int64, device="cpu")
        return torch.tensor(send, dtype=torch.int64, device="cpu"), order_N

    def _compute(self, x_ND: Tensor, counts: list[int]) -> Tensor:
        """This rank's slots on their rows (sorted by slot): its own experts, then its replicas."""
        E_local = len(self.local.expert_ids)
        n_local = sum(counts[:E_local])
        y_ND = self.local(x_ND[:n_local], counts[:E_local])
        if n_local == x_ND.shape[0]:
            return y_ND
        return torch.cat([y_ND, self.replicas(x_ND[n_local:], counts[E_local:])])

    def set_replicas(self, placement: list[list[int]]) -> int:
        """Hold the copies `placement` gives this rank (per rank, the sorted ids of other ranks' experts it holds),
        their weights sent by their owners, and route rows to every copy from the next call. Every rank calls it
        together with the same placement (expert_replicas.Replication); nothing is exchanged when it is the
        placement already in force. How many copies the group's ranks newly hold."""
        R, me = self.group.world_size, self.group.rank
        placement = [sorted(ids) for ids in placement]
        if len(placement) != R or any(len(set(ids)) != len(ids) or any(
                not 0 <= e < self.n_experts or e in self.ranges[r] for e in ids) for r, ids in enumerate(placement)):
            raise ExpertParallelError(f"placement {placement}: expected, for each of {R} ranks, distinct ids of other "
                                      f"ranks' experts (of {self.n_experts}, ranks' own {self.ranges})")
        if placement == self.placement:
            return 0
        if self.fixed is not None:
            raise ExpertParallelError(f"placement {placement}: the fixed exchange has no redundant experts")
        new = [[e for e in ids if e not in old] for ids, old in zip(placement, self.placement)]  # copies to send
        mine = self.ranges[me]
        out_splits = [sum(e in mine for e in ids) for ids in new]  # to each rank, its new copies of my experts
        in_splits = [sum(e in rg for e in new[me]) for rg in self.ranges]  # from each owner, my new copies
        send_index = torch.tensor([e - mine.start for ids in new for e in ids if e in mine], dtype=torch.int64,
                                  device="cpu")
        received_from = [e for rg in self.ranges for e in new[me] if e in rg]  # the order the copies arrive in
        held = shard_tensors(self.replicas) if self.replicas is not None else {}
        kept = self.placement[me]
        stacked = {}
        for name, t in shard_tensors(self.local).items():
            got = torch.empty((sum(in_splits), *as_bytes(t[:1]).shape[1:]), dtype=torch.uint8, device=t.device)
            dist.all_to_all_single(got, as_bytes(t[send_index.to(t.device)]) if len(send_index) else
                                   torch.empty((0, *got.shape[1:]), dtype=torch.uint8, device=t.device),
                                   in_splits, out_splits, group=self.group.group)
            got = got.view(t.dtype).view(sum(in_splits), *t.shape[1:])
            rows = [got[received_from.index(e)] if e in received_from else held[name][kept.index(e)]
                    for e in placement[me]]
            stacked[name] = torch.stack(rows) if rows else None
        self.replicas = shard_like(self.local, placement[me], stacked) if placement[me] else None
        self.placement = placement
        self._copies = None
        if any(placement):
            slot = [{e: i for i, e in enumerate([*rg, *ids])} for rg, ids in zip(self.ranges, placement)]
            self._copies = [[(r, slot[r][e]) for r in ranks] for e, ranks in enumerate(copies_of(self.ranges,
                                                                                                  placement))]
        return sum(map(len, new))


def use_fixed_exchange(model: nn.Module, max_tokens: int, on: bool = True) -> int:
    """Give every expert-parallel MoE layer of `model` the fixed-size exchange's buffers (ExpertParallelExperts.
    use_fixed), as a rank whose decode step is compiled or captured must (module docstring: which exchange, and
    why). Every rank calls it with the same `max_tokens`, the most tokens any call made while it is on passes a
    layer; `on`: every call from now on (else the lockstep turns it on per step). How many layers it set."""
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    for layer in layers:
        layer.use_fixed(max_tokens, on)
    return len(layers)


def pack(x_ND: Tensor, splits: list[int], C: int, out: Tensor | None = None) -> Tensor:
    """Rows split into per-rank blocks of C rows ([R, C, D]), block r holding split r's rows first; the padding is
    left as it was (never read)."""
    out = x_ND.new_empty(len(splits), C, x_ND.shape[1]) if out is None else out
    for r, rows in enumerate(x_ND.split(splits)):
        out[r, :rows.shape[0]] = rows
    return out


def unpack(blocks_RCD: Tensor, splits: list[int]) -> Tensor:
    """The first splits[r] rows of each block r, in rank order: pack's inverse."""
    return torch.cat([blocks_RCD[r, :n] for r, n in enumerate(splits)])


def all_to_all_blocks(blocks: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Block r to rank r, and rank r's block to this one at index r: one all_to_all_single of equal splits."""
    got = torch.empty_like(blocks)
    dist.all_to_all_single(got, blocks, group=group)
    return got


def expert_major(recv_RE: Tensor) -> Tensor | None:
    """The row order that turns rows grouped by source rank, then expert ([R, E_local] counts, row-major), into rows
    grouped by expert, then source rank: index i of the result is the received row that goes i-th. None where the
    two orders are the same (one rank sends everything, or there is one local expert)."""
    R, E = recv_RE.shape
    if R == 1 or E == 1 or int((recv_RE.sum(1) > 0).sum()) <= 1:
        return None
    blocks = torch.arange(int(recv_RE.sum())).split(recv_RE.reshape(-1).tolist())  # block r*E + e
    return torch.cat([blocks[r * E + e] for e in range(E) for r in range(R)])
