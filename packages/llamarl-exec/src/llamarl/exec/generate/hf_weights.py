"""The hf generator's weights and the syncs that replace them: in place between requests; during a
generate pulled into staging while decoding goes on, and swapped in between two decoding steps.

Two copies of the synced tensors take turns (double buffering): `x`, the memory the model's parameters
held when the generator joined the group, is where every sync lands (the `WeightReceiver` writes
there, its views of it built once); `y`, a second copy allocated at the first in-flight sync, serves
while a sync lands in `x`. An in-flight sync, from a step boundary to a later one:

1. `begin` (a step boundary): the parameters point at `y`, which holds what `x` holds (a pointer swap,
   no copy), and the pull into `x` starts on a thread (`llamarl.comm.adapters.staged`);
2. decoding goes on with `y`; once the sync is whole and verified, the same thread also packs the new
   linear weights for oneDNN (`packed_linear`), so no step repacks them;
3. `swap` (the next step boundary after that): the parameters point back at `x`, with the new packed
   copies: the only pause, a few pointer assignments per tensor;
4. a thread copies `x` into `y` while decoding goes on, so that `y` is ready for the next sync (and a
   receiver of changed-only syncs finds in `x` the sync before, as it needs).

Memory: `y` is one more copy of the synced tensors (the model's weights, or only its LoRA adapters),
kept from the first in-flight sync on; between a pull's end and its swap, the packed linear weights
exist twice. Generators that never sync in flight (lock-step schedules) allocate nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import torch

from llamarl.comm import WeightReceiver, WeightSyncGroup
from llamarl.comm.adapters.staged import StagedReceiver
from llamarl.comm.layouts import named_tensors_of
from llamarl.exec.generate.packed_linear import PackedLinear, pack_weight, weights_changed

# How long a copy between the two buffers may take before it counts as stuck (a memory copy of a model).
_COPY_TIMEOUT_S = 300.0


class HFWeights:
    """The synced tensors of an hf generator's `model` (`destination`: the model, or its LoRA adapter
    tensors), received over `group` (module doc). `last_pull_s` / `last_swap_s`: how long the last
    in-flight sync took to arrive (decoding went on) and to swap in (decoding paused)."""

    def __init__(
        self,
        group: WeightSyncGroup,
        model: torch.nn.Module,
        destination: torch.nn.Module | Mapping[str, torch.Tensor],
    ) -> None:
        self.model = model
        self.group = group
        self.live = named_tensors_of(destination)  # the parameters (and buffers) the model computes with
        self.receiver = WeightReceiver(group, destination)  # writes into the memory they hold now: x
        self._x = {name: t.data for name, t in self.live.items()}
        self._y: dict[str, torch.Tensor] | None = None
        self._on_x = True  # which buffer the parameters point at
        self._copy: threading.Thread | None = None  # x -> y, after a swap
        self._staged = StagedReceiver(self.receiver, after_pull=self._pack_staged)
        ids = {id(t): name for name, t in self.live.items()}
        self._packed_layers = [
            (m, ids[id(m.weight)])
            for m in model.modules()
            if isinstance(m, PackedLinear) and id(m.weight) in ids
        ]
        self._prepared: dict[int, torch.Tensor] = {}  # id(layer) -> packed copy of its weight in x
        self._pull_timeout_s = 0.0  # how long the pull begun waits for the trainer's announcement
        self.last_pull_s: float | None = None
        self.last_swap_s: float | None = None

    @property
    def num_tensors(self) -> int:
        """How many tensors each sync delivers."""
        return len(self.live)

    @property
    def pulling(self) -> bool:
        """An in-flight sync was begun and not yet swapped in (or failed)."""
        return self._staged.pending

    def ready(self) -> bool:
        """Whether the sync begun is whole (or failed): `swap` would not wait."""
        return self._staged.done()

    def receive(self, timeout_s: float) -> int:
        """One sync, now, into the weights the model computes with (nothing decodes meanwhile)."""
        self._finish_copy()  # (it reads x, which the sync writes)
        try:
            version = self.receiver.receive(timeout_s)
        finally:
            if not self._on_x:  # a failed in-flight sync left the model on y: x holds the sync now
                self._point_live(self._x, {})
            # Written through `.data`, which the packed layers cannot see (also a partial write).
            weights_changed(self.model)
        self._start_copy()
        return version

    def begin(self, timeout_s: float) -> None:
        """At a step boundary: the model moves to `y` (same values) and the next sync is pulled into `x`
        on a thread, waiting at most `timeout_s` for the trainer to announce it."""
        if self._on_x:
            self._finish_copy()
            if self._y is None:  # the first in-flight sync: `y` is made, once (a copy, in this pause)
                self._y = {name: t.clone() for name, t in self._x.items()}
            self._point_live(self._y, None)
        self._staged.start(timeout_s)
        self._pull_timeout_s = timeout_s

    def swap(self) -> int:
        """At a step boundary: waits for the sync begun (not at all when `ready()`; else as long as its
        pull may take to fail on its own deadlines), then points the model at it. On failure the model
        keeps the weights it had (on `y`), unharmed."""
        version = self._staged.wait(self._pull_timeout_s + self.group.timeout_s)
        self.last_pull_s = self._staged.pull_s
        begun = time.perf_counter()
        prepared, self._prepared = self._prepared, {}
        retired = self._point_live(self._x, prepared)
        self.last_swap_s = time.perf_counter() - begun
        self._start_copy(retired)
        return version

    def close(self) -> None:
        """Waits for a copy in progress and releases the receiver's buffers (the group is the caller's)."""
        self._finish_copy()
        self._staged.close()

    def _point_live(
        self, target: dict[str, torch.Tensor], packed: dict[int, torch.Tensor] | None
    ) -> list[torch.Tensor]:
        """Points every synced parameter at `target`'s memory; the packed layers take `packed`'s copies
        (None: the values did not change, their copies stay; {}: repacked at their next call). Returns
        the packed copies replaced, for the caller to free off the decoding thread (freeing a model's
        worth of memory takes tens of milliseconds here)."""
        for name, param in self.live.items():
            param.data = target[name]
        retired = []
        for layer, _ in self._packed_layers:
            if packed is None:
                layer.adopt(None)
                continue
            if layer._packed is not None:
                retired.append(layer._packed)
            if id(layer) in packed:
                layer.adopt(packed[id(layer)])
            else:
                layer._packed, layer._packed_of = None, None
        self._on_x = target is self._x
        return retired

    def _pack_staged(self) -> None:
        """(The pull's thread, once the sync in `x` is whole.) Packs its linear weights for oneDNN."""
        self._prepared = {id(layer): pack_weight(self._x[name]) for layer, name in self._packed_layers}

    def _start_copy(self, retired: list[torch.Tensor] | None = None) -> None:
        """Copies `x` into `y` on a thread (decoding reads `x` meanwhile), once there is a `y`, and
        frees the `retired` tensors there."""
        y = self._y
        if y is None:
            return

        def copy() -> None:
            if retired:
                retired.clear()
            with torch.no_grad():
                for name, t in self._x.items():
                    y[name].copy_(t)

        self._copy = threading.Thread(target=copy, name="llamarl-hf-weights-copy", daemon=True)
        self._copy.start()

    def _finish_copy(self) -> None:
        copy, self._copy = self._copy, None
        if copy is None:
            return
        copy.join(_COPY_TIMEOUT_S)
        if copy.is_alive():
            raise RuntimeError(f"copying the hf generator's weights took over {_COPY_TIMEOUT_S:.0f} s")
