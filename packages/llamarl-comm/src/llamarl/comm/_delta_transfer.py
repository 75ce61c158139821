"""One sync of a group that sends changed-only syncs, on one rank: ``DeltaSend`` (a source) and
``DeltaReceive`` (a destination, relays included).

Every bucket travels as two messages on its pair: a fixed-size header (``Header``: ids, versions, the
encoding, the payload's size, checksums), then its payload, whose size only the header tells. A
destination posts a bucket's payload receive once its header arrived, and the next header only after
that, so the two sides of a pair post the same messages in the same order (``_lanes.plan_lanes(...,
delta=True)``), as NCCL needs; an empty payload (nothing changed) is skipped by both.

In a full sync (the first on a group generation, and every ``anchor_every``-th) every payload is the
bucket's wire bytes, which every rank also keeps as its base for the next delta; in a delta sync each
source encodes each bucket against its shadow (``delta.encode_delta``), and each destination applies
that to its own copy of the base sync's bytes (``_staging.DeltaBase``). Either way the header carries
the checksum of the bucket's new wire bytes, which every destination verifies on what it rebuilt, and
a delta's payload also carries a checksum of its own bytes (all of them: it is small), so a payload
damaged in transit, a delta applied to the wrong base and a base that changed under the receiver are
all refused, naming the upstream rank and the bucket.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from llamarl.comm._lanes import HEADER, PAYLOAD, SKIP, Message, Pending
from llamarl.comm._staging import NUM_SLOTS, SourceLocals, wire_len
from llamarl.comm._sync_part import SyncPart
from llamarl.comm.buckets import checksum_tensor
from llamarl.comm.delta import FULL, KIND_NAMES, Encoded, apply_delta, encode_delta, encoded_nbytes
from llamarl.comm.plan import Bucket, Stream
from llamarl.comm.transport import WeightSyncError

HEADER_WORDS = 10
HEADER_BYTES = 8 * HEADER_WORDS
_MAGIC = 0x4C4C524C44454C54  # "LLRLDELT": a header, not payload bytes paired with a header's receive
IN_TRANSIT = "damaged in transit"
BASE_DIFFERS = (
    "this rank's copy of sync {}'s weights is not the sender's: a lost or misapplied delta, or weights "
    "changed since; the next sync is a full one"
)


@dataclass(frozen=True)
class Header:
    """What precedes a bucket's payload: the sync and bucket it belongs to, the encoding, the payload's
    size, the checksum of the bucket's new wire bytes and of the payload's own bytes (0: none)."""

    policy_version: int
    sync_index: int
    base_sync: int  # the sync whose bytes a delta applies to; -1 in a full sync
    stream_id: int
    bucket_index: int
    kind: int  # delta.FULL, SPARSE or BITMAP
    nbytes: int  # payload bytes (0: no payload message)
    changed: int  # bytes whose value changed since the base sync (-1 in a full sync)

    def write(
        self, out_u8: torch.Tensor, bucket_sum: torch.Tensor | None, payload_sum: torch.Tensor | None
    ) -> None:
        """Into ``out_u8[:HEADER_BYTES]``; the sums stay on the device (no host sync)."""
        ident = (self.stream_id << 32) | self.bucket_index
        fields = [self.policy_version, self.sync_index, self.base_sync, ident, self.kind, self.nbytes]
        words = torch.tensor([0, 0, _MAGIC, *fields, self.changed], dtype=torch.int64, device=out_u8.device)
        if bucket_sum is not None:
            words[0] = bucket_sum
        if payload_sum is not None:
            words[1] = payload_sum
        out_u8[:HEADER_BYTES].view(torch.int64).copy_(words)

    @classmethod
    def read(cls, buf_u8: torch.Tensor) -> tuple[Header, int, int, int]:
        """``(header, bucket_sum, payload_sum, magic)`` from ``buf_u8[:HEADER_BYTES]``."""
        bucket_sum, payload_sum, magic, version, sync, base, ident, kind, nbytes, changed = (
            buf_u8[:HEADER_BYTES].view(torch.int64).tolist()
        )
        header = cls(version, sync, base, ident >> 32, ident & 0xFFFFFFFF, kind, nbytes, changed)
        return header, bucket_sum, payload_sum, magic


@dataclass
class Moved:
    """What one sync moved on this rank."""

    bytes: int = 0  # on the wire: headers and payloads
    full_bytes: int = 0  # what a full sync moves: the buckets' payloads
    buckets: int = 0
    changed: int = 0  # wire bytes whose value changed (a delta sync)


class _DeltaPart(SyncPart):
    """What both sides of a changed-only group's sync add: the delta's base sync, its headers, counts."""

    def __init__(self, *, base_sync: int | None, **common: Any) -> None:
        super().__init__(delta=True, **common)
        self.base_sync = base_sync  # None: a full sync
        self.result = Moved()

    def _payload_sum(self, payload: torch.Tensor) -> torch.Tensor | None:
        """A delta payload's own checksum, over every word (it is small); None with checksums off."""
        return checksum_tensor(payload) if self.checksum_stride else None

    def _header(self, stream: Stream, bucket: Bucket, kind: int, nbytes: int, changed: int) -> Header:
        base = -1 if self.base_sync is None else self.base_sync
        return Header(
            self.policy_version, self.sync_index, base, stream.stream_id, bucket.index, kind, nbytes, changed
        )

    def _count(self, bucket: Bucket, header: Header) -> None:
        self.result.bytes += HEADER_BYTES + header.nbytes
        self.result.full_bytes += bucket.payload_bytes
        self.result.buckets += 1
        self.result.changed += max(0, header.changed)

    def _check_unposted(self) -> None:
        unposted = self.pairs.unposted()
        if any(unposted.values()):
            raise WeightSyncError(f"rank {self.rank}: sync ended with messages never posted: {unposted}")


class DeltaSend(_DeltaPart):
    """A source's part of one sync: each bucket of the schedule, as a header and a payload.

    A bucket's new wire bytes are packed into a send slot (or read in place: a direct bucket of the
    source's memory) and encoded against its shadow into the same slot, whose sends are waited before
    the slot is reused (``NUM_SLOTS`` per stream); a full payload is sent from the shadow itself."""

    def __init__(self, *, locals_: SourceLocals, **common: Any) -> None:
        super().__init__(**common)
        self.locals_ = locals_
        self.src_views = self.staging.source_views(locals_)
        self.slot_sends: dict[tuple[int, int], list[Pending]] = {}
        self.slot_uses: dict[int, int] = {}

    def run(self) -> Moved:
        """Send every bucket of this rank's streams; wait until every send completed."""
        for stream, bucket in self.plan.schedule(self.rank):
            self._send(stream, bucket)
        for key in list(self.slot_sends):
            self._wait_slot(key)
        self._check_unposted()
        return self.result

    def _send(self, stream: Stream, bucket: Bucket) -> None:
        key, slot = self._slot(stream)
        header_buf, out = slot[:HEADER_BYTES], slot[HEADER_BYTES:]
        shadow = self.staging.shadow(stream, bucket)
        if self.base_sync is None:
            self._fill_shadow(stream, bucket, shadow)
            bucket_sum = self._checksum(self.staging.views, ("dsum", stream.stream_id, bucket.index), shadow)
            encoded = Encoded(FULL, shadow.numel(), -1)
        else:
            cur = self._current(stream, bucket, out, key[1])
            bucket_sum = self._checksum(self.src_views, ("dsum", stream.stream_id, bucket.index, key[1]), cur)
            encoded = encode_delta(cur, shadow, out)  # (reads cur whole before writing out)
        payload = shadow if encoded.kind == FULL else out[: encoded.nbytes]
        payload_sum = None if encoded.kind == FULL else self._payload_sum(payload)
        header = self._header(stream, bucket, encoded.kind, encoded.nbytes, encoded.changed)
        header.write(header_buf, bucket_sum, payload_sum)
        sends = [self.pairs.send(stream, bucket, header_buf, part=HEADER)]
        if encoded.nbytes:
            sends.append(self.pairs.send(stream, bucket, payload, part=PAYLOAD))
        else:
            self.pairs.skip_send(stream, bucket, part=PAYLOAD)
        self.slot_sends[key] = sends
        self._count(bucket, header)

    def _fill_shadow(self, stream: Stream, bucket: Bucket, shadow: torch.Tensor) -> None:
        """(A full sync) the bucket's wire bytes, packed or copied straight into its shadow."""
        if bucket.direct and not bucket.src_copy:
            shadow.copy_(self._direct_source(stream, bucket))
            return
        key = ("shadow-pack", stream.stream_id, bucket.index)
        self.staging.source_packer(self.src_views, shadow, key, bucket, self.locals_).run()

    def _current(self, stream: Stream, bucket: Bucket, out: torch.Tensor, slot: int) -> torch.Tensor:
        """(A delta sync) the bucket's new wire bytes: in the source's memory, or packed into ``out``."""
        if bucket.direct and not bucket.src_copy:
            return self._direct_source(stream, bucket)
        key = ("slot-pack", stream.stream_id, bucket.index, slot)
        self.staging.source_packer(self.src_views, out, key, bucket, self.locals_).run()
        return out[: wire_len(bucket)]

    def _direct_source(self, stream: Stream, bucket: Bucket) -> torch.Tensor:
        key = ("send", stream.stream_id, bucket.index)
        payload = self.src_views.get(key)
        if payload is None:
            payload = self.src_views[key] = self.staging.direct_source(bucket, self.locals_)
        return payload

    def _slot(self, stream: Stream) -> tuple[tuple[int, int], torch.Tensor]:
        """The stream's next send slot ``[HEADER_BYTES + largest bucket]``, once its last sends are done."""
        uses = self.slot_uses.get(stream.stream_id, 0)
        self.slot_uses[stream.stream_id] = uses + 1
        key = (stream.stream_id, uses % NUM_SLOTS)
        self._wait_slot(key)
        return key, self.staging.delta_buffer(stream, f"send-{key[1]}", HEADER_BYTES)

    def _wait_slot(self, key: tuple[int, int]) -> None:
        for pending in self.slot_sends.pop(key, []):
            pending.wait(self.group, "sending weights")


class DeltaReceive(_DeltaPart):
    """A destination's part of one sync: each bucket's header, then its payload, forwarded down the
    chain, applied to this rank's copy of the base sync's bytes, verified, unpacked."""

    def __init__(self, *, dst_tensors: dict[str, torch.Tensor], **common: Any) -> None:
        super().__init__(**common)
        self.dst_tensors = dst_tensors
        self.headers: dict[tuple[int, int], Header] = {}

    def run(self) -> Moved:
        """Receive every bucket of the streams this rank is in; forward them where it relays."""
        for peer in self.pairs.lanes:
            self.pairs.post_receives_ahead(peer)  # each upstream's first header
        self.group.put(self.pairs.ready_key(self.rank), True)
        for stream, bucket in self.plan.schedule(self.rank):
            self._receive(stream, bucket)
        self._check_unposted()
        with contextlib.suppress(Exception):  # best effort, as in a full-group sync
            self.group.delete(self.pairs.ready_key(self.rank))
        return self.result

    def _receive_target(self, msg: Message) -> tuple[torch.Tensor, None] | str | None:
        """A header lands in the stream's header buffer; a payload, once its header is read, in place
        (a full payload: straight into the base) or in the stream's landing buffer."""
        stream, bucket = msg.stream, msg.bucket
        if msg.part == HEADER:
            return self.staging.header_buffer(stream, "in", HEADER_BYTES), None
        header = self.headers.get((stream.stream_id, bucket.index))
        if header is None:
            return None  # its size is not known yet
        if not header.nbytes:
            return SKIP
        if header.kind == FULL:
            return self.staging.delta_base(stream, bucket, self.dst_tensors).bytes, None
        return self.staging.delta_buffer(stream, "landing")[: header.nbytes], None

    def _receive(self, stream: Stream, bucket: Bucket) -> None:
        upstream = stream.upstream(self.rank)
        posted = self.pairs.take_receive(stream, bucket, part=HEADER)
        posted.pending.wait(self.group, "receiving a bucket header")
        header, bucket_sum, payload_sum = self._read_header(posted.payload, stream, bucket, upstream)
        header_out = self._keep_header(stream, posted.payload)
        self.headers[(stream.stream_id, bucket.index)] = header
        self.pairs.post_receives_ahead(upstream)  # the payload (or its skip), then the next header
        payload = None
        if header.nbytes:
            received = self.pairs.take_receive(stream, bucket, part=PAYLOAD)
            received.pending.wait(self.group, "receiving weights")
            payload = received.payload
            if header.kind != FULL:
                payload_sum_here = self._payload_sum(payload)
                self._verify(payload_sum_here, payload_sum, "payload", IN_TRANSIT, bucket, stream, upstream)
        forwards = self._forward(stream, bucket, header_out, payload)
        base = self.staging.delta_base(stream, bucket, self.dst_tensors)
        if header.kind != FULL:
            self._apply(header, payload, base.bytes, base.repack, stream, upstream)
        rebuilt = self._checksum(self.staging.views, ("dsum", stream.stream_id, bucket.index), base.bytes)
        why = IN_TRANSIT if header.kind == FULL else BASE_DIFFERS.format(self.base_sync)
        self._verify(rebuilt, bucket_sum, "rebuilt bytes", why, bucket, stream, upstream)
        if base.unpack is not None:
            base.unpack.run()
        for pending in forwards:  # before the next bucket reuses the buffers they send from
            pending.wait(self.group, "forwarding weights")
        self._count(bucket, header)

    def _read_header(
        self, buf: torch.Tensor, stream: Stream, bucket: Bucket, upstream: int
    ) -> tuple[Header, int, int]:
        header, bucket_sum, payload_sum, magic = Header.read(buf)
        want = self._header(stream, bucket, header.kind, header.nbytes, header.changed)
        problem = "not this bucket's" if magic != _MAGIC or header != want else self._misfit(header, bucket)
        if problem:
            raise WeightSyncError(
                f"rank {self.rank}: the header of bucket {bucket.index} of stream {stream.stream_id} from "
                f"peer rank {upstream} is {header} (magic {magic:#x}): {problem}; expected {want}",
                peer=upstream,
                bucket=bucket.index,
            )
        return header, bucket_sum, payload_sum

    def _misfit(self, header: Header, bucket: Bucket) -> str | None:
        """Why a header of this sync's bucket cannot be right (None: it can)."""
        n = wire_len(bucket)
        if header.kind == FULL:
            return None if header.nbytes == n else f"a full payload of {header.nbytes} bytes, not {n}"
        if self.base_sync is None or header.kind not in KIND_NAMES:
            return (
                f"a payload of kind {header.kind} in a {'full' if self.base_sync is None else 'delta'} sync"
            )
        if not 0 <= header.changed <= n or header.nbytes != encoded_nbytes(header.kind, n, header.changed):
            return f"{header.nbytes} payload bytes do not encode {header.changed} changes of {n} bytes"
        return None

    def _keep_header(self, stream: Stream, header_in: torch.Tensor) -> torch.Tensor | None:
        """(A relay) a copy of the header to forward: the next header lands in its buffer as soon as
        the payload's receive is posted."""
        if stream.downstream(self.rank) is None:
            return None
        header_out = self.staging.header_buffer(stream, "out", HEADER_BYTES)
        return header_out.copy_(header_in[:HEADER_BYTES])

    def _forward(
        self, stream: Stream, bucket: Bucket, header_out: torch.Tensor | None, payload: torch.Tensor | None
    ) -> list[Pending]:
        """Relay the header and payload down the chain (None: this rank ends the chain)."""
        if header_out is None:
            return []
        sends = [self.pairs.send(stream, bucket, header_out, part=HEADER)]
        if payload is None:
            self.pairs.skip_send(stream, bucket, part=PAYLOAD)
        else:
            sends.append(self.pairs.send(stream, bucket, payload, part=PAYLOAD))
        return sends

    def _apply(
        self,
        header: Header,
        payload: torch.Tensor | None,
        base: torch.Tensor,
        repack: Any,
        stream: Stream,
        upstream: int,
    ) -> None:
        """Rebuild the bucket's new wire bytes: the base sync's (refilled from the destination tensors
        where they hold them), with the delta applied."""
        if repack is not None:
            repack.run()
        empty = base.new_empty(0)
        try:
            apply_delta(header.kind, payload if payload is not None else empty, header.changed, base)
        except (ValueError, IndexError, RuntimeError) as exc:
            raise WeightSyncError(
                f"rank {self.rank}: the delta of bucket {header.bucket_index} of stream {stream.stream_id} "
                f"from peer rank {upstream} does not apply: {exc}",
                peer=upstream,
                bucket=header.bucket_index,
            ) from exc

    def _verify(
        self,
        computed: torch.Tensor | None,
        sent: int,
        what: str,
        why: str,
        bucket: Bucket,
        stream: Stream,
        upstream: int,
    ) -> None:
        """Raise naming the upstream rank and bucket when a checksum disagrees (``why``: the likely cause)."""
        if computed is None or int(computed) == sent:
            return
        raise WeightSyncError(
            f"rank {self.rank}: checksum mismatch in the {what} of bucket {bucket.index} of stream "
            f"{stream.stream_id} from peer rank {upstream}: computed {int(computed)}, sent {sent} ({why})",
            peer=upstream,
            bucket=bucket.index,
        )
