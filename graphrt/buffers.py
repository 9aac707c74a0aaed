"""The static step buffers: one device arena, a ring of pinned host twins, one copy a step.

Layout of a bucket of S sequences and T tokens (byte offsets from the arena's start, every
field 16-byte aligned):

    slot_mapping     [T]        int64  cache slot of each new token, -1 = padding
    positions        [P, T]     int64  position rows of each new token (0 for padding): P =
                                       cfg.position_rows, 1 unless the model takes several
                                       (multimodal RoPE); its sequence position unless the
                                       step gives others
    input_ids        [T]        int64  the step's token ids (0 for padding)
    query_start_loc  [S + 1]    int32  cumulative new tokens; padding repeats the total
    seq_lens         [S]        int32  context + new tokens; 0 for padding
    prefix_ranges    [S, R, 2]  int32  half-open ranges, empty (0, 0) when unused
    embed_index      [T]        int32  row of ``inputs_embeds`` holding the token's input
                                       embedding, -1 = none (only when cfg.embed_dim > 0)
    block_table      [B, S]     int32  stored column-major (block j of every sequence
                                       together), seen by the kernels as an [S, B] view

Beside the arena, when ``cfg.embed_dim > 0``, one device buffer ``inputs_embeds
[max_num_tokens, embed_dim]`` (cfg.dtype) takes the step's given embeddings (a vision
encoder's output, say) by a device-to-device copy of their rows, packed from row 0;
``embed_index`` says which token each row belongs to, and travels in the one pinned copy.

Each bucket has its own compact layout at the start of the arena, so a step copies only
its bucket's fields, and the block table goes last, column-major, so that a step whose
longest sequence needs W blocks copies just its first W columns: the bytes copied follow
the step's size and longest context, never max_model_len. A kernel never reads a block
past its sequence's length, so columns left over from older steps are harmless.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from graphrt.config import RuntimeConfig
from graphrt.kernels.metadata import AttentionMetadata
from graphrt.step import Step

_ALIGN = 16


@dataclass(frozen=True)
class Layout:
    """Byte offsets of one bucket's fields in the arena (see the module doc)."""

    num_seqs: int
    num_tokens: int
    max_ranges: int
    max_blocks: int
    offsets: dict
    block_table_offset: int
    position_rows: int = 1

    @staticmethod
    def make(num_seqs: int, num_tokens: int, max_ranges: int, max_blocks: int, *, embeds: bool = False,
             position_rows: int = 1) -> "Layout":
        fields = [("slot_mapping", 8 * num_tokens), ("positions", 8 * position_rows * num_tokens),
                  ("input_ids", 8 * num_tokens),
                  ("query_start_loc", 4 * (num_seqs + 1)), ("seq_lens", 4 * num_seqs),
                  ("prefix_ranges", 4 * num_seqs * max_ranges * 2)]
        if embeds:
            fields.append(("embed_index", 4 * num_tokens))
        offsets, at = {}, 0
        for name, nbytes in fields:
            offsets[name] = at
            at += -(-nbytes // _ALIGN) * _ALIGN
        return Layout(num_seqs, num_tokens, max_ranges, max_blocks, offsets, at, position_rows)

    @property
    def nbytes(self) -> int:
        return self.block_table_offset + 4 * self.max_blocks * self.num_seqs

    def copy_bytes(self, block_columns: int) -> int:
        """Bytes a step must copy when its sequences use ``block_columns`` block-table columns."""
        return self.block_table_offset + 4 * block_columns * self.num_seqs

    def views(self, flat):
        """Typed views of every field over ``flat``, a uint8 torch tensor or numpy array."""
        lib = _TORCH if isinstance(flat, torch.Tensor) else _NUMPY
        s, t, o = self.num_seqs, self.num_tokens, self.offsets

        def view(name: str, itemsize: int, count: int):
            return flat[o[name]: o[name] + count * itemsize].view(lib[itemsize])

        bt = flat[self.block_table_offset: self.nbytes].view(lib[4]).reshape(self.max_blocks, s)
        return dict(
            slot_mapping=view("slot_mapping", 8, t),
            # [T] for one position row (what most models read), [P, T] for several
            positions=(view("positions", 8, t) if self.position_rows == 1 else
                       view("positions", 8, self.position_rows * t).reshape(self.position_rows, t)),
            input_ids=view("input_ids", 8, t),
            query_start_loc=view("query_start_loc", 4, s + 1),
            seq_lens=view("seq_lens", 4, s),
            prefix_ranges=view("prefix_ranges", 4, s * self.max_ranges * 2).reshape(s, self.max_ranges, 2),
            embed_index=view("embed_index", 4, t) if "embed_index" in o else None,
            block_table=bt.T,                                     # [S, B], strides (1, S)
        )


_TORCH = {4: torch.int32, 8: torch.int64}
try:
    from graphrt._fast import copy_h2d as _copy_h2d
except ImportError:           # built without the C helper (or an older build of it)
    _copy_h2d = None
# (stream id, device index, device type) of a device's current stream, what
# torch.cuda.current_stream() wraps in a new Stream object on every call
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
_NUMPY = {4: np.int32, 8: np.int64}


@dataclass
class DeviceViews:
    """What a captured step reads: the bucket's metadata and its per-token inputs."""

    layout: Layout
    meta: AttentionMetadata
    positions: torch.Tensor      # [T] int64, or [P, T] with cfg.position_rows = P > 1
    input_ids: torch.Tensor      # [T] int64
    embed_index: torch.Tensor | None     # [T] int32, -1 = no given embedding (None: embed_dim 0)
    inputs_embeds: torch.Tensor | None   # [T, embed_dim] cfg.dtype, rows packed from 0


class StepBuffers:
    """Owns the device arena and its pinned staging ring; nothing else on the step path
    allocates. ``stage`` packs a validated step into the next free staging slot and issues
    the step's single non-blocking copy on the current stream."""

    def __init__(self, cfg: RuntimeConfig, device: torch.device | str, *, ring: int = 3):
        if ring < 2:
            raise ValueError(f"ring must be >= 2 so the host can stage ahead, got {ring}")
        self.cfg = cfg
        self.device = torch.device(device)
        self.capacity = self.layout(cfg.max_num_seqs, cfg.max_num_tokens)
        nbytes = self.capacity.nbytes
        pin = self.device.type == "cuda"
        self.arena = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        # [max_num_tokens, embed_dim]: given input embeddings, filled device-to-device
        self.inputs_embeds = (torch.zeros(cfg.max_num_tokens, cfg.embed_dim, dtype=cfg.dtype, device=self.device)
                              if cfg.embed_dim else None)
        self.staging = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(ring)]
        self._staging_np = [s.numpy() for s in self.staging]
        self._host_views: dict[tuple, dict[str, np.ndarray]] = {}
        self._events: list[torch.cuda.Event | None] = [None] * ring
        self._next = 0
        self._cuda = self.device.type == "cuda"
        self._device_index = (self.device.index if self.device.index is not None or not self._cuda
                              else torch.cuda.current_device())
        self._stream_key: tuple | None = None        # (stream id, device index, device type) of _stream
        self._stream: torch.cuda.Stream | None = None
        self._stream_handle = 0                      # cudaStream_t of _stream
        self._event_handles = [0] * ring                   # cudaEvent_t of each slot's event
        self._direct = _copy_h2d is not None   # copy through graphrt._fast.copy_h2d while the driver takes it
        self._copy_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.wait_seconds = 0.0      # host time spent waiting for a free slot (back-pressure)

    def layout(self, num_seqs: int, num_tokens: int) -> Layout:
        """The arena layout of a bucket of num_seqs sequences and num_tokens tokens."""
        return Layout.make(num_seqs, num_tokens, self.cfg.max_prefix_ranges, self.cfg.max_blocks_per_seq,
                           embeds=self.cfg.embed_dim > 0, position_rows=self.cfg.position_rows)

    def device_views(self, layout: Layout) -> DeviceViews:
        """Typed device views of the arena under ``layout``: the AttentionMetadata
        (query_start_loc [S+1] i32, seq_lens [S] i32, block_table [S, B] i32 column-major,
        prefix_ranges [S, R, 2] i32, slot_mapping [T] i64), positions ([T] i64, or [P, T] with
        several position rows), input_ids [T] i64, and with embeddings embed_index [T] i32 and
        inputs_embeds [T, embed_dim]."""
        v = layout.views(self.arena)
        meta = AttentionMetadata(query_start_loc=v["query_start_loc"], seq_lens=v["seq_lens"],
                                 block_table=v["block_table"], prefix_ranges=v["prefix_ranges"],
                                 slot_mapping=v["slot_mapping"])
        embeds = None if self.inputs_embeds is None else self.inputs_embeds[: layout.num_tokens]
        return DeviceViews(layout, meta, v["positions"], v["input_ids"], v["embed_index"], embeds)

    def pack(self, step: Step, layout: Layout, input_ids: np.ndarray | None = None,
             embed_rows: np.ndarray | None = None, positions: np.ndarray | None = None) -> int:
        """Write ``step`` (validated, fitting ``layout``) into the next free pinned slot and
        return the slot; ``embed_rows`` (checked) are the tokens whose embeddings the step
        brings, in the order of their rows; ``positions`` (checked, [P, num_tokens]) the
        tokens' position rows where the step gives them (default: each token's sequence
        position in every row). Waits on the GPU only when every slot still has a copy in
        flight, that is when the host is ``ring`` steps ahead."""
        slot = self._next
        self._next = (slot + 1) % len(self.staging)
        event = self._events[slot]
        if event is not None and not event.query():   # query() does not block; a slot still in flight does
            t0 = time.perf_counter()
            event.synchronize()
            self.wait_seconds += time.perf_counter() - t0
        key = (layout.num_seqs, layout.num_tokens, slot)
        v = self._host_views.get(key)
        if v is None:
            v = self._host_views[key] = layout.views(self._staging_np[slot])
        pos = v["positions"]                          # [T] or [P, T]
        rows = pos if pos.ndim == 1 else pos[0]
        step.pack(self.cfg.block_size, query_start_loc=v["query_start_loc"], seq_lens=v["seq_lens"],
                  block_table=v["block_table"], prefix_ranges=v["prefix_ranges"],
                  slot_mapping=v["slot_mapping"], positions=rows)
        n = step.num_tokens
        if positions is not None:                     # given: over the sequence positions just packed
            pos.reshape(-1, pos.shape[-1])[:, :n] = positions
        elif pos.ndim == 2:                           # several rows, none given: each one the sequence position
            pos[1:] = pos[0]
        ids = v["input_ids"]
        if input_ids is None:
            ids[:] = 0
        else:
            ids[:n] = input_ids
            if ids.shape[0] > n:
                ids[n:] = 0
        index = v["embed_index"]
        if index is not None:
            index[:] = -1
            if embed_rows is not None:
                index[embed_rows] = np.arange(len(embed_rows), dtype=np.int32)
        return slot

    def copy(self, slot: int, nbytes: int, *, strict: bool = False) -> int:
        """The step's one host-to-device copy: the first ``nbytes`` of ``slot`` into the
        arena, non-blocking on the current stream; an event marks when the slot is free."""
        views = self._copy_views.get((slot, nbytes))
        if views is None:             # slicing costs ~1.5 us a tensor: keep the (few) pairs a run uses
            if len(self._copy_views) >= 4096:
                self._copy_views.clear()
            target, source = self.arena[:nbytes], self.staging[slot][:nbytes]
            views = self._copy_views[(slot, nbytes)] = (target, source, target.data_ptr(), source.data_ptr())
        target, source, target_ptr, source_ptr = views
        if strict and not source.is_pinned():
            raise RuntimeError("graphrt strict mode: the staging copy source is pageable; that copy would "
                               "synchronise the host with the GPU")
        if not self._cuda:
            target.copy_(source)
            return nbytes
        stream = self._current_stream()
        event = self._events[slot]
        if event is not None and self._direct:
            # the same copy and record through the driver; the event exists (recorded once by torch)
            done = _copy_h2d(target_ptr, source_ptr, nbytes, self._stream_handle, self._event_handles[slot])
            if done == 0:
                return nbytes
            self._direct = False      # the driver refused: torch's path from now on
            if done == 1:             # the copy is queued, the record is not
                event.record(stream)
                return nbytes
        target.copy_(source, non_blocking=True)
        if event is None:
            event = self._events[slot] = torch.cuda.Event()
        event.record(stream)
        self._event_handles[slot] = event.cuda_event        # created by its first record
        return nbytes

    def _current_stream(self) -> torch.cuda.Stream:
        """The device's current stream; ``torch.cuda.current_stream()`` costs ~4 us a call,
        the raw query below a fraction of that, and the Stream object (and its handle) is
        kept while the current stream stays the same."""
        if _RAW_STREAM is None:       # a torch without the raw query: the public call
            stream = torch.cuda.current_stream(self._device_index)
            self._stream_handle = stream.cuda_stream
            return stream
        raw = _RAW_STREAM(self._device_index)
        if raw != self._stream_key:
            self._stream_key = raw
            self._stream = torch.cuda.Stream(stream_id=raw[0], device_index=raw[1], device_type=raw[2])
            self._stream_handle = self._stream.cuda_stream
        return self._stream

    def __del__(self):
        # copies queued through the driver did not tell torch's pinned-memory cache that the
        # staging slots are in use: let them finish before the slots go back to it
        for event in getattr(self, "_events", ()):
            if event is not None:
                try:
                    event.synchronize()
                except Exception:
                    pass

    def stage_empty(self, layout: Layout) -> None:
        """An all-padding step (no tokens, slots -1): what warm-up and capture run on."""
        v = layout.views(self.arena)
        v["query_start_loc"].zero_()
        v["seq_lens"].zero_()
        v["prefix_ranges"].zero_()
        v["block_table"].zero_()
        v["slot_mapping"].fill_(-1)
        v["positions"].zero_()
        v["input_ids"].zero_()
        if v["embed_index"] is not None:
            v["embed_index"].fill_(-1)

