"""A composed run as data: the mesh, what fsdp shards, sequence parallelism, the pipeline schedule;
and the sizes every rank derives from it (its layers, its share of a layer, its rows), in one place
that the engine and the closed-form cost both read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spmd.layout import block_range, block_size, block_sizes, join_adjacent, select
from spmd.model.blocks import Rows, Share
from spmd.model.config import Net
from spmd.model.moe import capacity
from spmd.model.registry import spec_of
from spmd.parallel.context import CP_CORES, RING, CpCore, check_context, token_chunks, tokens_held
from spmd.parallel.dims import Dims
from spmd.parallel.rank_plan import Piece, RankPlan, UnitPlan
from spmd.parallel.schedules import schedule_named, stage_of
from spmd.parallel.sharding import REPLICATED, SHARDINGS, ZERO, Sharding

RECOMPUTE = ("none", "selective", "full")  # keep every activation; recompute attention's core; keep layer inputs


@dataclass(frozen=True)
class Layout:
    dims: Dims
    zero: int = 3  # what the fsdp axis shards (ZERO presets)
    reshard: bool = True  # ZeRO-3: reshard after forward (FSDP2's default) or keep the gathered layers
    sp: bool = False  # sequence parallel on the tp axis
    schedule: str = "1f1b"  # the pipeline's (any registered schedule; with pp=1 it orders the micro-batches)
    cp: CpCore = RING  # how attention crosses the cp axis: its chunks, attention, bytes, flops and text
    recompute: str = "none"  # activation recomputation (RECOMPUTE)
    overlap: bool = True  # prefetch FSDP's next layer and reduce gradients in the background (--no-overlap: not)

    def __post_init__(self):
        if self.cp not in CP_CORES.values():
            raise ValueError(f"Layout.cp takes a cp core (context.core_named of --cp's value), got {self.cp!r}")
        if self.zero not in ZERO:
            raise ValueError(f"--zero must be one of {', '.join(map(str, ZERO))}, got {self.zero}")
        schedule_named(self.schedule)
        if not self.reshard and self.zero != 3:
            raise ValueError(
                f"--no-reshard keeps gathered parameters: only --zero 3 gathers them (got --zero {self.zero})"
            )
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.sp and "tp" not in self.dims.mesh.names:
            raise ValueError("--sp splits the tp axis's activations by rows: give the mesh a tp axis (tp=2, ...)")

    @property
    def sharding(self) -> Sharding:
        if "fsdp" not in self.dims.mesh.names:
            return REPLICATED
        return SHARDINGS[self.zero, self.reshard]

    def check(self, net: Net) -> None:
        """Every reason this layout cannot run `net`, as a ValueError naming the flag."""
        d, t, p = self.dims, self.dims.size("tp"), self.dims.size("pp")
        schedule_named(self.schedule).check(p, net.microbatches, net.chunks)
        if p * net.chunks > net.layers:
            stages = f"pp={p} x {net.chunks} chunks = {p * net.chunks} stages" if net.chunks > 1 else f"pp={p} stages"
            raise ValueError(f"{stages} but only --layers {net.layers}: a stage needs at least one layer")
        if net.ffn < t:
            raise ValueError(f"--ffn {net.ffn} is smaller than tp={t}: a tensor-parallel rank would hold no column")
        spec = spec_of(net)
        spec.check_tensor(net, t)
        if spec.has_attention:
            check_context(self.cp, d.size("cp"), net.seq, [spec.share(net, t, j).heads for j in range(t)])
        elif d.size("cp") > net.seq:
            raise ValueError(f"--seq {net.seq} is shorter than cp={d.size('cp')}: a cp rank would hold no token")
        ep = d.size("ep")
        if ep > 1 and not net.experts:
            raise ValueError(
                f"--mesh {d.mesh}: ep={ep} splits a mixture of experts' experts: add --experts E "
                f"(a multiple of {ep}), or use dp or fsdp for a dense model"
            )
        if ep > 1 and net.experts % ep:
            raise ValueError(
                f"--experts {net.experts} is not a multiple of ep={ep}: every ep rank holds as many "
                f"experts (its dense weights' reduction over ep depends on it)"
            )
        fewest = min(block_size(net.batch, d.data_size, r) for r in range(d.data_size))
        if fewest < net.microbatches:
            raise ValueError(
                f"--batch {net.batch} over the data axes (dp x fsdp x ep = {d.data_size}) leaves a rank "
                f"{fewest} sequences, fewer than --microbatches {net.microbatches}"
            )
        held = min(self.tokens(net))
        if self.sp and (fewest // net.microbatches) * held < t:
            raise ValueError(
                f"--sp: a micro-batch of {(fewest // net.microbatches) * held} rows is fewer than the "
                f"tp={t} ranks it is split over (each needs a row)"
            )

    # --- what one rank holds ------------------------------------------------------------------------------

    def for_rank(self, net: Net, rank: int) -> RankPlan:
        """What `rank` holds of `net` under this layout, derived once: the engine, the closed form, the checkpoint
        and the planner read the plan rather than ask the layout again."""
        return self.for_ranks(net, [rank])[0]

    def for_ranks(self, net: Net, ranks) -> list[RankPlan]:
        """for_rank of each of `ranks`; ranks alike but for their pipeline stage derive their share, rows and
        their units' sizes and shards by kind once (the planner asks for every stage)."""
        d, plans = self.dims, []
        alike: dict[tuple, tuple] = {}
        for rank in ranks:
            off_pp = tuple(d.coord(axis, rank) for axis in d.mesh.names if axis != "pp")
            if off_pp not in alike:
                alike[off_pp] = (*self._data_part(net, rank), {})
            share, sequences, rows, group, kinds_alike, largest, of_kind = alike[off_pp]
            chunks = tuple(tuple(chunk) for chunk in self.chunks(net, rank))
            units = self._unit_plans(net, rank, share, [u for chunk in chunks for u in chunk], of_kind)
            plans.append(RankPlan(rank, share, chunks, units, sequences, rows, group, kinds_alike, largest))
        return plans

    def _data_part(self, net: Net, rank: int) -> tuple:
        """(share, sequences, rows, group pairs, alike micro-batches, largest rows) of `rank`: what it holds of a
        layer and of the batch, the same on every pipeline stage."""
        d = self.dims
        share = spec_of(net).share(net, d.size("tp"), d.coord("tp", rank), d.size("ep"), d.coord("ep", rank))
        held = [hi - lo for lo, hi in (self.sequences(net, peer) for peer in self.ep_peers(rank))]
        alike = tuple(self.alike_microbatches(net, held))
        every = [self._rows(net, rank, held, k) for k, _ in alike]  # one micro-batch of each alike run
        rows = tuple(r for (r, _), (_, n) in zip(every, alike, strict=True) for _ in range(n))
        group = tuple(g for (_, g), (_, n) in zip(every, alike, strict=True) for _ in range(n))
        largest = Rows(*(max(getattr(r, f) for r, _ in every) for f in ("local", "matmul", "sequences", "pairs")))
        return share, self.sequences(net, rank), rows, group, alike, largest

    @property
    def fsdp_over_ep(self) -> bool:
        """Whether FSDP (ZeRO-3) shards the dense weights over fsdp x ep (torchtitan's dp_shard spans the ep ranks):
        a rank holds 1/(fsdp ep) of each, the experts 1/fsdp of its ep rank's."""
        d = self.dims
        return self.sharding.params and d.size("fsdp") > 1 and d.size("ep") > 1

    def _unit_plans(self, net: Net, rank: int, share: Share, units: list[int], of_kind: dict) -> tuple[UnitPlan, ...]:
        """Per unit: its kind and size (the tensor slice), its pieces (their shards), and what ep sums of this
        rank's optimizer part of it (its shard, or all of it): the elements before a mixture of experts' experts
        (the unit's dense prefix), all of any other unit; nothing under FSDP over ep (the dense weights' gradients
        are reduce-scattered over ep instead). Units of one kind differ only in their index: each kind is sized
        once, into `of_kind` (shared by the ranks of one share and fsdp and ep coordinates)."""
        spec = spec_of(net)
        plans = []
        for unit in units:
            kind = spec.kind(net, unit)
            if kind not in of_kind:
                size, dense = spec.unit_size(net, kind, share), spec.dense_prefix(net, kind, share)
                if self.fsdp_over_ep:
                    runs = [(0, dense, True), (dense, size, False)] if dense < size else [(0, size, True)]
                    of_kind[kind] = (size, tuple(self._piece(rank, *run) for run in runs), 0)
                else:
                    piece = self._piece(rank, 0, size, False)
                    start, part = (
                        (piece.shard[0], piece.shard[1] - piece.shard[0]) if self.sharding.optimizer else (0, size)
                    )
                    of_kind[kind] = (size, (piece,), min(max(dense - start, 0), part))
            plans.append(UnitPlan(unit, kind, *of_kind[kind]))
        return tuple(plans)

    def _piece(self, rank: int, start: int, stop: int, over_ep: bool) -> Piece:
        """The run [start, stop) of a unit's slice in blocks over fsdp, and (over_ep) this rank's block over ep."""
        d = self.dims
        b0, b1 = block_range(stop - start, d.size("fsdp"), d.coord("fsdp", rank))
        block = (start + b0, start + b1)
        ep: tuple[int, ...] = ()
        shard = block
        if over_ep:
            ep = tuple(block_sizes(b1 - b0, d.size("ep")))
            e0, e1 = block_range(b1 - b0, d.size("ep"), d.coord("ep", rank))
            shard = (block[0] + e0, block[0] + e1)
        return Piece(start, stop, tuple(block_sizes(stop - start, d.size("fsdp"))), block, ep, shard)

    def kind(self, net: Net, unit: int) -> str:
        return spec_of(net).kind(net, unit)

    def tensor_index(self, net: Net, rank: int, unit: int):
        """Where this rank's tensor (and ep) slice of `unit` lives in the full flat unit (a unit's worth of int64:
        do not keep)."""
        d = self.dims
        tp, ep = (d.size("tp"), d.coord("tp", rank)), (d.size("ep"), d.coord("ep", rank))
        return spec_of(net).tensor_slice(net, self.kind(net, unit), *tp, *ep)

    def first_holder(self, net: Net, rank: int, unit: int, index) -> np.ndarray:
        """Which of `index` (elements of `unit`) no lower (ep, tp) coordinate than this rank's also holds: a value
        every tp rank holds (a gain) is this rank's to write or count only on tp rank 0, a mixture of experts'
        dense weights only on ep rank 0 (unless FSDP shards them over ep: then each shard is one ep rank's)."""
        d = self.dims
        first = spec_of(net).first_holders(
            net, self.kind(net, unit), d.coord("tp", rank), d.coord("ep", rank), self.fsdp_over_ep
        )
        return first[index]

    def chunks(self, net: Net, rank: int) -> list[list[int]]:
        """The global units of each of this rank's pipeline chunks (the schedule's placement: stage c x pp + rank,
        or a V): the stage's blocks, and the model's units before the first block on the first stage, after the
        last on the last."""
        p, r, spec = self.dims.size("pp"), self.dims.coord("pp", rank), spec_of(net)
        blocks, last = spec.block_units(net), p * net.chunks - 1
        units = spec.unit_count(net)
        chunks = []
        for c in range(net.chunks):
            stage = stage_of(r, c, p, schedule_named(self.schedule).placement)
            lo, hi = block_range(net.layers, p * net.chunks, stage)
            mine = blocks[lo:hi]
            before = list(range(blocks[0])) if stage == 0 else []
            after = list(range(blocks[-1] + 1, units)) if stage == last else []
            chunks.append(before + mine + after)
        return chunks

    def sequences(self, net: Net, rank: int) -> tuple[int, int]:
        """This rank's sequences of the batch (split over dp x fsdp x ep)."""
        return block_range(net.batch, self.dims.data_size, self.dims.data_rank(rank))

    def tokens(self, net: Net) -> list[int]:
        """Tokens of every sequence each cp rank holds (all of them without a cp axis)."""
        return tokens_held(net.seq, self.dims.size("cp"), self.cp)

    def token_chunks(self, net: Net):
        return token_chunks(net.seq, self.dims.size("cp"), self.cp)

    def pieces(self, net: Net, rank: int, k: int, split: bool = True) -> list[tuple[int, int]]:
        """The global rows of micro-batch k this rank holds between the tensor-parallel regions, in the order
        it holds them: whole sequences; under cp each sequence's chunks of this cp rank; under SP a tp block
        of those (unless not `split`: the rows its matmuls see, every tp rank's in order)."""
        s0, s1 = self.sequences(net, rank)
        k0, k1 = block_range(s1 - s0, net.microbatches, k)
        mine = self.token_chunks(net)[self.dims.coord("cp", rank)]
        pieces = [
            ((s0 + b) * net.seq + c.start, (s0 + b) * net.seq + c.start + c.size) for b in range(k0, k1) for c in mine
        ]
        if self.sp and split:
            total = sum(hi - lo for lo, hi in pieces)
            pieces = select(pieces, *block_range(total, self.dims.size("tp"), self.dims.coord("tp", rank)))
        return join_adjacent(pieces)  # one sequence after another is one slice (a token a sequence: 1024 -> 1)

    def alike_microbatches(self, net: Net, held: list[int]) -> list[tuple[int, int]]:
        """(k, how many micro-batches have k's rows) covering every micro-batch: a micro-batch's rows follow from
        the sequences it holds on this rank and its ep peers (`held`: how many each holds), each a block split
        (the first n % m one more), so the micro-batches between two such remainders are alike and one of them
        is asked."""
        m = net.microbatches
        cuts = sorted({0, m, *(n % m for n in held)})
        return [(lo, hi - lo) for lo, hi in zip(cuts, cuts[1:], strict=False)]

    def _rows(self, net: Net, rank: int, held: list[int], k: int) -> tuple[Rows, int]:
        """Micro-batch k's Rows on `rank` and every (row, expert) pair of its ep group (each row's top_k), from the
        sequences each ep rank holds (`held`, in ep order). Its pairs: those its experts may compute, its rows'
        top_k each, or over ep every ep rank's (all of them may choose this rank's experts), with a capacity at
        most C a sequence for each of its experts (only kept pairs are sent)."""
        d, m = self.dims, net.microbatches
        tokens = self.tokens(net)[d.coord("cp", rank)]  # an ep group shares its cp coordinate
        sequences = [block_size(n, m, k) for n in held]
        mine = sequences[d.coord("ep", rank)]
        matmul, group = mine * tokens, sum(sequences) * tokens * net.top_k
        local = block_size(matmul, d.size("tp"), d.coord("tp", rank)) if self.sp else matmul
        pairs = group if net.experts else 0
        if net.experts and d.size("ep") > 1 and net.capacity_factor:
            kept = capacity(net.seq, net.top_k, net.experts, net.capacity_factor)
            pairs = min(group, sum(sequences) * (net.experts // d.size("ep")) * kept)
        return Rows(local=local, matmul=matmul, sequences=mine, pairs=pairs), group

    def ep_peers(self, rank: int) -> list[int]:
        """The ranks of this rank's ep group, in ep order (itself alone without an ep axis)."""
        d = self.dims
        if d.size("ep") == 1:
            return [rank]
        coords = d.mesh.coords(rank)
        return [d.mesh.rank_of({**coords, "ep": e}) for e in range(d.size("ep"))]

    def describe(self) -> str:
        d = self.dims
        parts = [f"mesh {d.mesh}"]
        if "fsdp" in d.mesh.names:
            parts.append(f"fsdp shards as {self.sharding.name}" + ("" if self.reshard else ", no reshard"))
        if d.size("cp") > 1:
            parts.append(f"cp {self.cp.name}")
        if d.size("tp") > 1:
            parts.append("tp with SP" if self.sp else "tp (Megatron)")
        if self.recompute != "none":
            parts.append(f"{self.recompute} recomputation")
        if not self.overlap:
            parts.append("no overlap")
        if d.size("pp") > 1:
            parts.append(f"pp {self.schedule}")
        return ", ".join(parts)
