"""Transfer plans: from source and destination layouts to streams of buckets, computed identically on
every rank (pure functions, no processes, unit-testable).

How a plan is made:

1. Destination ranks with identical layouts (data-parallel replicas) form a *replica class*; the class
   is planned once, as if it were one rank.
2. Each piece a class needs is cut along the boundaries of the source boxes that overlap it (the grid of
   their edges); each cell comes straight from a source rank that holds it whole, the least loaded one
   so far (so a replicated trainer spreads the work, and an FSDP2 trainer sends each shard from its
   owner): nothing is gathered on one rank.
3. Cells from one source rank to one class form a *stream*, delivered along a relay chain: the source
   sends each bucket to the class's first member, which forwards it to the next while unpacking it
   itself (a pipelined chain broadcast: the source sends the bytes once, not once per replica). Chains
   of different streams start at different members so the forwarding load is spread.
4. Each stream is packed into buckets of at most ``bucket_bytes`` payload; boxes too large for the space
   left are split along their leading dims. On the wire a box may change precision (``wire_kind``).

Every rank runs its part of all streams in one global order, bucket index first, then stream id
(``TransferPlan.schedule``), and posts the messages it exchanges with each peer in that same order (a
stream's manifest right after its last direct bucket), as its peer does: that keeps the point-to-point
traffic deadlock-free and correctly paired under NCCL's rules (tags ignored, one ordered stream per
pair), not only under gloo's tags.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from llamarl.comm.layouts import DestLayout, DestTensor, Piece, SourceLayout, dtype_from_str

__all__ = [
    "ALIGN_BYTES",
    "Bucket",
    "Entry",
    "PlanError",
    "Stream",
    "TransferPlan",
    "entry_nbytes",
    "make_plan",
    "wire_kind",
]

Shape = tuple[int, ...]

# Every entry starts on an 8-byte boundary, so any dtype can be viewed in place and the checksum can
# read the bucket as int64 words.
ALIGN_BYTES = 8
# Message tags give a bucket's index 15 bits (the 16th marks a stream's manifest, see _transfer).
MAX_BUCKETS_PER_STREAM = 0x7FFF
FP8 = "float8_e4m3fn"
BF16 = "bfloat16"


class PlanError(ValueError):
    """The layouts do not fit together (a name, shape or dtype mismatch, a slice no source holds)."""


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def wire_kind(src_dtype: str, ndim: int, wire_dtype: str | None) -> str:
    """How a tensor travels: ``"raw"`` (its own bytes), ``"bfloat16"`` or ``"float8_e4m3fn"``.

    Only floating tensors wider than the wire type are cast; fp8 (e4m3, one float32 scale per row of
    the box) applies to tensors of 2 or more dims (linear and embedding weights), while 1-d tensors
    (norms, biases), whose precision matters more and whose size does not, go as bf16.
    """
    dtype = dtype_from_str(src_dtype)
    if wire_dtype is None or not dtype.is_floating_point:
        return "raw"
    if wire_dtype == FP8 and ndim >= 2 and dtype.itemsize > 1:
        return FP8
    if wire_dtype in (BF16, FP8) and dtype.itemsize > 2:
        return BF16
    if wire_dtype not in (BF16, FP8):
        raise PlanError(f"unsupported wire dtype {wire_dtype!r} (use bfloat16 or float8_e4m3fn)")
    return "raw"


def entry_nbytes(sizes: Shape, src_dtype: str, wire: str) -> int:
    """Bytes a box of ``sizes`` takes in a bucket (aligned). fp8 boxes carry ``sizes[0]`` float32 scales."""
    numel = math.prod(sizes)
    if wire == "raw":
        return _align(numel * dtype_from_str(src_dtype).itemsize)
    if wire == BF16:
        return _align(numel * 2)
    if wire == FP8:
        return _align(4 * (sizes[0] if sizes else 1) + numel)
    raise PlanError(f"unknown wire kind {wire!r}")


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One box in a bucket: read from the source's local tensor, written into the destination's."""

    src_name: str  # trainer's parameter name
    src_offsets: Shape  # box start in the full source parameter
    sizes: Shape  # box shape
    src_dtype: str  # dtype held by the source
    wire: str  # "raw", "bfloat16" or "float8_e4m3fn"
    dst_name: str  # engine's tensor name (same for every member of the replica class)
    dst_offsets: Shape  # box start in the local destination tensor
    byte_offset: int  # where the box starts in the bucket
    nbytes: int  # bytes it takes (aligned)


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """A flat buffer's worth of entries."""

    index: int  # position in its stream
    entries: tuple[Entry, ...]  # in byte order
    payload_bytes: int  # sum of the entries' (aligned) sizes
    # Direct bucket: one raw entry, contiguous in the destination tensor, received straight into it;
    # its trailer travels in the stream's manifest (one message after the stream's last direct bucket).
    # Direct buckets come first in a stream, those sent from the source's memory before the others.
    direct: bool = False
    # A direct bucket whose box is not one run of the source's local tensor (a column slice): the
    # source packs it into a staging buffer first. Otherwise it is sent from the tensor's own memory.
    src_copy: bool = False


@dataclass(frozen=True, kw_only=True)
class Stream:
    """Everything one source rank sends to one replica class, relayed along ``chain``."""

    stream_id: int  # position in the plan
    src: int  # source group rank
    chain: tuple[int, ...]  # destination group ranks: src -> chain[0] -> chain[1] -> ...
    buckets: tuple[Bucket, ...]

    @functools.cached_property
    def num_direct(self) -> int:
        """Direct buckets of the stream (they come first)."""
        return sum(b.direct for b in self.buckets)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the whole stream."""
        return sum(b.payload_bytes for b in self.buckets)

    def upstream(self, rank: int) -> int:
        """Who sends this stream's buckets to ``rank`` (a member of the chain)."""
        i = self.chain.index(rank)
        return self.src if i == 0 else self.chain[i - 1]

    def downstream(self, rank: int) -> int | None:
        """Who ``rank`` forwards this stream's buckets to, if anyone."""
        if rank == self.src:
            return self.chain[0]
        i = self.chain.index(rank)
        return self.chain[i + 1] if i + 1 < len(self.chain) else None


@dataclass(kw_only=True)
class TransferPlan:
    """All streams of one sync; the same object on every rank."""

    streams: list[Stream] = field(default_factory=list)
    source_ranks: tuple[int, ...] = ()
    dest_ranks: tuple[int, ...] = ()
    bucket_bytes: int = 0  # payload limit used to cut the buckets

    def schedule(self, rank: int) -> list[tuple[Stream, Bucket]]:
        """``rank``'s part of the sync, in the global order (bucket index, then stream id)."""
        mine = [s for s in self.streams if s.src == rank or rank in s.chain]
        num_rounds = max((len(s.buckets) for s in mine), default=0)
        return [(s, s.buckets[i]) for i in range(num_rounds) for s in mine if i < len(s.buckets)]

    def bytes_sent_by(self) -> dict[int, int]:
        """Payload bytes each source rank puts on the wire (relays not counted)."""
        out = dict.fromkeys(self.source_ranks, 0)
        for s in self.streams:
            out[s.src] += s.nbytes
        return out

    def num_buckets(self) -> int:
        """Buckets in the plan (each sent once by its source)."""
        return sum(len(s.buckets) for s in self.streams)

    def describe(self) -> str:
        """One line per stream: who sends how much to whom."""
        lines = [
            f"plan: {len(self.streams)} streams, {self.num_buckets()} buckets of <= {self.bucket_bytes} B"
        ]
        for s in self.streams:
            chain = " -> ".join(str(r) for r in s.chain)
            lines.append(
                f"  stream {s.stream_id}: {s.src} -> {chain}: {s.nbytes} B in {len(s.buckets)} buckets"
            )
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Planning


@dataclass(frozen=True)
class _Cell:
    src_name: str
    src_offsets: Shape
    sizes: Shape
    src_dtype: str
    dst_name: str
    dst_offsets: Shape
    src_local_offsets: Shape  # the holder's box in the full parameter
    src_local_sizes: Shape  # the holder's local tensor shape
    src_local_contiguous: bool  # whether the holder's local tensor is contiguous at all
    dst_shape: Shape  # the destination tensor's local shape
    dst_dtype: str


def is_contiguous_box(offsets: Shape, sizes: Shape, shape: Shape) -> bool:
    """Whether a box of a row-major contiguous tensor of ``shape`` is one contiguous run of memory:
    after its first dim longer than 1, every dim must be whole."""
    del offsets  # where the box starts does not matter, only which dims it cuts
    dims = [d for d, n in enumerate(sizes) if n > 1]
    return not dims or all(sizes[d] == shape[d] for d in range(dims[0] + 1, len(shape)))


def _is_direct(cell: _Cell, wire: str, min_bytes: int) -> bool:
    """Whether a cell can be received in place: raw bytes, one run of the destination tensor."""
    return (
        wire == "raw"
        and cell.dst_dtype == cell.src_dtype
        and math.prod(cell.sizes) * dtype_from_str(cell.src_dtype).itemsize >= min_bytes
        and is_contiguous_box(cell.dst_offsets, cell.sizes, cell.dst_shape)
    )


def _src_contiguous(cell: _Cell, sizes: Shape) -> bool:
    """Whether a box of ``sizes`` cut from a cell is one run of memory in its source's local tensor
    (then it is sent from there)."""
    return cell.src_local_contiguous and is_contiguous_box(cell.src_offsets, sizes, cell.src_local_sizes)


def _box_contains(outer_off: Shape, outer_sz: Shape, off: Shape, sz: Shape) -> bool:
    return all(o <= a and a + s <= o + z for o, z, a, s in zip(outer_off, outer_sz, off, sz, strict=True))


def _check_sources(sources: Mapping[int, SourceLayout]) -> tuple[dict[str, tuple[Shape, str]], str | None]:
    """Sources must agree on every parameter's full shape and dtype, and on the wire dtype."""
    meta: dict[str, tuple[Shape, str]] = {}
    wire_dtypes = {layout.wire_dtype for layout in sources.values()}
    if len(wire_dtypes) > 1:
        raise PlanError(f"source ranks disagree on the wire dtype: {sorted(map(str, wire_dtypes))}")
    for rank, layout in sorted(sources.items()):
        for t in layout.tensors.values():
            if not _box_contains((0,) * len(t.full_shape), t.full_shape, t.offsets, t.sizes):
                raise PlanError(
                    f"source rank {rank}: {t.name} box {t.offsets}+{t.sizes} outside {t.full_shape}"
                )
            seen = meta.setdefault(t.name, (t.full_shape, t.dtype))
            if seen != (t.full_shape, t.dtype):
                raise PlanError(
                    f"source ranks disagree on {t.name}: {seen} vs {(t.full_shape, t.dtype)} (rank {rank})"
                )
    return meta, next(iter(wire_dtypes)) if wire_dtypes else None


def _split_cells(
    piece_src_off: Shape, sizes: Shape, holders: list[tuple[int, Shape, Shape]]
) -> list[tuple[Shape, Shape, list[int]]]:
    """Cut a box along the edges of the source boxes overlapping it; return ``(offsets, sizes,
    holder_ranks)`` for each cell (holder_ranks: sources holding the cell whole)."""
    cuts_per_dim = []
    for d, (o, s) in enumerate(zip(piece_src_off, sizes, strict=True)):
        cuts = {o, o + s}
        for _, h_off, h_sz in holders:
            for c in (h_off[d], h_off[d] + h_sz[d]):
                if o < c < o + s:
                    cuts.add(c)
        cuts_per_dim.append(sorted(cuts))
    cells = []
    for intervals in itertools.product(*(list(itertools.pairwise(c)) for c in cuts_per_dim)):
        off = tuple(a for a, _ in intervals)
        sz = tuple(b - a for a, b in intervals)
        owners = [r for r, h_off, h_sz in holders if _box_contains(h_off, h_sz, off, sz)]
        cells.append((off, sz, owners))
    return cells


def _entry(cell: _Cell, delta: Shape, sizes: Shape, wire: str, byte_offset: int, nbytes: int) -> Entry:
    """The box of ``sizes`` at ``delta`` within ``cell``, placed at ``byte_offset`` of its bucket."""
    return Entry(
        src_name=cell.src_name,
        src_offsets=tuple(a + b for a, b in zip(cell.src_offsets, delta, strict=True)),
        sizes=sizes,
        src_dtype=cell.src_dtype,
        wire=wire,
        dst_name=cell.dst_name,
        dst_offsets=tuple(a + b for a, b in zip(cell.dst_offsets, delta, strict=True)),
        byte_offset=byte_offset,
        nbytes=nbytes,
    )


class _BucketPacker:
    """Fills the buckets of one stream, a box at a time: direct buckets (one entry each) and packed
    buckets (entries end to end, at most ``bucket_bytes`` of payload)."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.direct: list[tuple[tuple[Entry, ...], bool]] = []  # (entries, src_copy)
        self.packed: list[tuple[Entry, ...]] = []
        self.entries: list[Entry] = []  # the packed bucket being filled
        self.used = 0  # its payload bytes so far

    def close(self) -> None:
        """Ends the packed bucket being filled (if it holds anything)."""
        if self.entries:
            self.packed.append(tuple(self.entries))
        self.entries, self.used = [], 0

    def add_direct(self, cell: _Cell, delta: Shape, sizes: Shape, wire: str) -> list[tuple[Shape, Shape]]:
        """Puts the largest leading part of the box that fits ``bucket_bytes`` in a direct bucket of its
        own (split so that streams still interleave); returns the rest, as ``(delta, sizes)`` boxes."""
        cost = functools.partial(entry_nbytes, src_dtype=cell.src_dtype, wire=wire)
        fit = _split_to_fit(delta, sizes, cost, self.bucket_bytes)
        if fit is None:
            raise PlanError(f"bucket_bytes={self.bucket_bytes} cannot hold one element of {cell.src_name}")
        (h_delta, h_sizes), rest = fit
        head = _entry(cell, h_delta, h_sizes, wire, 0, cost(h_sizes))
        self.direct.append(((head,), not _src_contiguous(cell, h_sizes)))
        return rest

    def add_packed(self, cell: _Cell, delta: Shape, sizes: Shape, wire: str) -> list[tuple[Shape, Shape]]:
        """Puts the largest leading part of the box that fits the space left in the packed bucket
        being filled; returns the rest (the whole box again when nothing fitted: it goes to the next
        bucket)."""
        cost = functools.partial(entry_nbytes, src_dtype=cell.src_dtype, wire=wire)
        fit = _split_to_fit(delta, sizes, cost, self.bucket_bytes - self.used)
        if fit is None:
            if not self.entries:
                raise PlanError(
                    f"bucket_bytes={self.bucket_bytes} cannot hold one element of {cell.src_name}"
                )
            self.close()
            return [(delta, sizes)]
        (h_delta, h_sizes), rest = fit
        nbytes = cost(h_sizes)
        self.entries.append(_entry(cell, h_delta, h_sizes, wire, self.used, nbytes))
        self.used += nbytes
        if rest:
            self.close()  # the remainder did not fit: this bucket is full
        return rest

    def buckets(self) -> tuple[Bucket, ...]:
        """The stream's buckets, indexed in sending order: direct ones first, then the packed ones."""
        self.close()
        # Direct buckets sent from the source's memory come first, so a source posts them all at once
        # and packs the rest while they travel: messages between two ranks go in bucket order (NCCL
        # matches them in the order they are posted), so a later one cannot overtake an earlier one.
        self.direct.sort(key=lambda d: d[1])  # stable: cell order within each kind
        buckets = [
            Bucket(index=i, entries=es, payload_bytes=sum(e.nbytes for e in es), direct=True, src_copy=copy)
            for i, (es, copy) in enumerate(self.direct)
        ]
        buckets += [
            Bucket(index=len(buckets) + i, entries=es, payload_bytes=sum(e.nbytes for e in es))
            for i, es in enumerate(self.packed)
        ]
        return tuple(buckets)


def _bucketize(
    cells: list[_Cell], wire_dtype: str | None, bucket_bytes: int, direct_min_bytes: int
) -> tuple[Bucket, ...]:
    """Pack cells into buckets of at most ``bucket_bytes`` payload, splitting boxes that do not fit.

    Large cells contiguous at the destination become direct buckets (one entry each, split at
    ``bucket_bytes`` so streams still interleave); the others share packed buckets.
    """
    packer = _BucketPacker(bucket_bytes)
    # Work items, used as a stack: (cell, delta offsets within the cell, sizes)
    todo: list[tuple[_Cell, Shape, Shape]] = [(c, (0,) * len(c.sizes), c.sizes) for c in reversed(cells)]
    while todo:
        cell, delta, sizes = todo.pop()
        wire = wire_kind(cell.src_dtype, len(cell.sizes), wire_dtype)
        add = packer.add_direct if _is_direct(cell, wire, direct_min_bytes) else packer.add_packed
        rest = add(cell, delta, sizes, wire)
        todo.extend((cell, d, s) for d, s in reversed(rest))
    return packer.buckets()


def _split_to_fit(
    delta: Shape, sizes: Shape, cost: Callable[[Shape], int], space: int
) -> tuple[tuple[Shape, Shape], list[tuple[Shape, Shape]]] | None:
    """The largest leading part of a box that fits in ``space`` bytes, and the rest (in order).

    Splits along the first dim longer than 1; if not even one slab along it fits, splits that slab
    further. Returns None when nothing fits.
    """
    if cost(sizes) <= space:
        return (delta, sizes), []
    dims = [d for d, s in enumerate(sizes) if s > 1]
    if not dims:
        return None
    d = dims[0]

    def with_len(n: int) -> Shape:
        return tuple(n if i == d else s for i, s in enumerate(sizes))

    lo, hi = 0, sizes[d]  # largest n with cost(n slabs) <= space; cost grows with n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(with_len(mid)) <= space:
            lo = mid
        else:
            hi = mid - 1
    rest_delta = tuple(x + (lo if i == d else 0) for i, x in enumerate(delta))
    if lo > 0:
        return (delta, with_len(lo)), [(rest_delta, with_len(sizes[d] - lo))]
    # Not even one slab fits: split the first slab along its next dims.
    sub = _split_to_fit(delta, with_len(1), cost, space)
    if sub is None:
        return None
    head, sub_rest = sub
    after = (tuple(x + (1 if i == d else 0) for i, x in enumerate(delta)), with_len(sizes[d] - 1))
    return head, [*sub_rest, after]


@dataclass
class _SourceIndex:
    """What the planner knows of the source ranks, and the work it gave each so far."""

    meta: dict[str, tuple[Shape, str]]  # parameter name -> (full shape, dtype)
    wire_dtype: str | None
    holders: dict[str, list[tuple[int, Shape, Shape]]]  # name -> (rank, box offsets, box sizes)
    contiguous: dict[tuple[int, str], bool]  # (rank, name) -> whether its local tensor is contiguous
    load: dict[int, int]  # rank -> bytes it sends so far
    used_names: set[str] = field(default_factory=set)  # parameters some destination wants

    @classmethod
    def build(cls, sources: Mapping[int, SourceLayout]) -> _SourceIndex:
        """Checks that the sources agree (`_check_sources`) and indexes who holds which box."""
        meta, wire_dtype = _check_sources(sources)
        holders: dict[str, list[tuple[int, Shape, Shape]]] = {}
        contiguous: dict[tuple[int, str], bool] = {}
        for rank, layout in sorted(sources.items()):
            for t in layout.tensors.values():
                if math.prod(t.sizes) > 0:
                    holders.setdefault(t.name, []).append((rank, t.offsets, t.sizes))
                    contiguous[(rank, t.name)] = t.contiguous
        return cls(meta, wire_dtype, holders, contiguous, load=dict.fromkeys(sources, 0))

    def check_piece(self, dest_rank: int, t: DestTensor, p: Piece) -> str:
        """Raises ``PlanError`` unless the sources hold what piece ``p`` of ``t`` asks for, in a dtype
        that can reach ``t``'s; returns the source dtype."""
        if p.src_name not in self.meta:
            raise PlanError(
                f"destination rank {dest_rank}: tensor {t.name!r} needs {p.src_name!r}, which no "
                f"source rank holds (source names: {sorted(self.meta)[:8]}...)"
            )
        full_shape, src_dtype = self.meta[p.src_name]
        if not _box_contains((0,) * len(full_shape), full_shape, p.src_offsets, p.sizes):
            raise PlanError(
                f"destination rank {dest_rank}: {t.name!r} wants "
                f"{p.src_name}[{p.src_offsets}+{p.sizes}], outside its shape {full_shape} "
                "on the source"
            )
        if not _box_contains((0,) * len(t.shape), t.shape, p.dst_offsets, p.sizes):
            raise PlanError(f"destination rank {dest_rank}: piece {p} falls outside {t.name} {t.shape}")
        if t.dtype != src_dtype and (
            self.wire_dtype is None
            or not dtype_from_str(t.dtype).is_floating_point
            or not dtype_from_str(src_dtype).is_floating_point
        ):
            raise PlanError(
                f"dtype mismatch for {t.name!r} on destination rank {dest_rank}: "
                f"source {p.src_name} is {src_dtype}, destination is {t.dtype} "
                "(set the sender's wire_dtype to cast floats)"
            )
        return src_dtype

    def cells(self, t: DestTensor, p: Piece, src_dtype: str) -> list[tuple[int, _Cell]]:
        """The cells of piece ``p`` of ``t``, each with the source rank that sends it: of those that
        hold it whole, the least loaded so far (whose load then grows by its bytes)."""
        holders = self.holders.get(p.src_name, [])
        holder_box = {r: (h_off, h_sz) for r, h_off, h_sz in holders}
        out = []
        for off, sz, owners in _split_cells(p.src_offsets, p.sizes, holders):
            if not owners:
                raise PlanError(f"{p.src_name}[{off}+{sz}] (for {t.name}) is held whole by no source rank")
            src = min(owners, key=lambda r: (self.load[r], r))
            self.load[src] += math.prod(sz) * dtype_from_str(src_dtype).itemsize
            dst_off = tuple(d + (o - s) for d, o, s in zip(p.dst_offsets, off, p.src_offsets, strict=True))
            cell = _Cell(
                p.src_name,
                off,
                sz,
                src_dtype,
                t.name,
                dst_off,
                src_local_offsets=holder_box[src][0],
                src_local_sizes=holder_box[src][1],
                src_local_contiguous=self.contiguous[(src, p.src_name)],
                dst_shape=t.shape,
                dst_dtype=t.dtype,
            )
            out.append((src, cell))
        return out


def _class_cells(index: _SourceIndex, dest_rank: int, layout: DestLayout) -> dict[int, list[_Cell]]:
    """Every cell a replica class needs (``layout`` is its members', ``dest_rank`` the first of them),
    grouped by the source rank that sends it, in the order of the layout's tensors and pieces."""
    cells_by_src: dict[int, list[_Cell]] = {}
    for t in layout.tensors.values():
        covered = 0
        for p in t.pieces:
            src_dtype = index.check_piece(dest_rank, t, p)
            index.used_names.add(p.src_name)
            covered += math.prod(p.sizes)
            for src, cell in index.cells(t, p, src_dtype):
                cells_by_src.setdefault(src, []).append(cell)
        if covered != math.prod(t.shape):
            raise PlanError(
                f"destination rank {dest_rank}: the pieces of {t.name!r} cover {covered} of "
                f"{math.prod(t.shape)} elements"
            )
    return cells_by_src


def make_plan(
    sources: Mapping[int, SourceLayout],
    dests: Mapping[int, DestLayout],
    *,
    bucket_bytes: int = 64 << 20,
    strict: bool = True,
    direct_min_bytes: int = 256 << 10,
) -> TransferPlan:
    """Compute the transfer plan from every rank's layout (keys: group ranks).

    ``strict``: every source parameter must be wanted by some destination (catches name mismatches on
    both sides). Boxes of at least ``direct_min_bytes`` that are contiguous at the destination and keep
    their dtype are received in place, in buckets of their own (``Bucket.direct``; sent from the source
    tensor's memory too where the box is contiguous there); the rest is packed. Raises
    ``PlanError`` with the rank and name at fault when the layouts do not fit.
    """
    if bucket_bytes < 64:
        raise PlanError(f"bucket_bytes={bucket_bytes} is too small")
    if not sources:
        raise PlanError("no source rank in the group")
    if set(sources) & set(dests):
        raise PlanError(f"ranks {sorted(set(sources) & set(dests))} are both source and destination")
    index = _SourceIndex.build(sources)
    # 1. Replica classes: destination ranks with identical layouts.
    classes: dict[str, list[int]] = {}
    for rank, layout in sorted(dests.items()):
        classes.setdefault(json.dumps(layout.to_json(), sort_keys=True), []).append(rank)
    streams: list[Stream] = []
    for members in classes.values():
        for src, cells in sorted(_class_cells(index, members[0], dests[members[0]]).items()):
            # Rotate chains so the forwarding work of a class is spread over its members.
            k = len(streams) % len(members)
            chain = tuple(members[k:] + members[:k])
            buckets = _bucketize(cells, index.wire_dtype, bucket_bytes, direct_min_bytes)
            if len(buckets) > MAX_BUCKETS_PER_STREAM:
                raise PlanError(
                    f"{len(buckets)} buckets from source rank {src} to ranks {chain}: at most "
                    f"{MAX_BUCKETS_PER_STREAM} per stream (raise bucket_bytes or direct_min_bytes)"
                )
            streams.append(Stream(stream_id=len(streams), src=src, chain=chain, buckets=buckets))
    unused = sorted(set(index.meta) - index.used_names)
    if strict and unused:
        raise PlanError(
            f"source parameters no destination wants: {unused[:8]}{'...' if len(unused) > 8 else ''} "
            "(a name mismatch? pass strict=False to allow)"
        )
    return TransferPlan(
        streams=streams,
        source_ranks=tuple(sorted(sources)),
        dest_ranks=tuple(sorted(dests)),
        bucket_bytes=bucket_bytes,
    )


def plan_summary(plan: TransferPlan) -> dict[str, int]:
    """Counts for logs and tests."""
    return {
        "num_streams": len(plan.streams),
        "num_buckets": plan.num_buckets(),
        "payload_bytes": sum(s.nbytes for s in plan.streams),
    }
