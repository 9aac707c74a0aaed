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
    temperature      [S]        float32  each sequence's sampling settings (only when
    top_k            [S]        int32    cfg.sampling; ``graphrt.sampling.SamplingParams``),
    top_p            [S]        float32  read by ``StepContext.sample``; padding samples
    min_p            [S]        float32  greedily (temperature 0)
    seed             [S]        int64
    request          [S]        int32  speculative steps (only when cfg.speculative): the row of
    offset           [S]        int32  the device-owned state each sequence is, and where its
                                       first token sits against that row's length
                                       (graphrt.speculative; -1 / 0 for padding)
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

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from graphrt.config import RuntimeConfig
from graphrt.kernels.metadata import AttentionMetadata
from graphrt.sampling import SamplingParams
from graphrt.step import Step

_ALIGN = 16
_ITEMSIZE = {np.int64: 8, np.int32: 4, np.float32: 4}


@dataclass(frozen=True)
class Field:
    """One staged field of the arena: its element type, its shape in a bucket, what an
    all-padding step holds, and the option it comes with (None: always)."""

    name: str
    dtype: type                 # np.int64 / np.int32 / np.float32
    rows: str                   # "tokens" [T], "seqs" [S], "seqs+1" [S + 1], "ranges" [S, R, 2],
                                # "positions" [T] (one position row) or [P, T]
    empty: int | float          # an all-padding step's value
    option: str | None = None   # "embeds" (cfg.embed_dim > 0), "sampling" (cfg.sampling), "speculative"


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed")
# The fields in arena order (the block table goes after them: see the module doc). A new
# staged field is one entry here, plus what fills it in ``StepBuffers.pack``.
FIELDS = (
    Field("slot_mapping", np.int64, "tokens", -1),
    Field("positions", np.int64, "positions", 0),
    Field("input_ids", np.int64, "tokens", 0),
    Field("query_start_loc", np.int32, "seqs+1", 0),
    Field("seq_lens", np.int32, "seqs", 0),
    Field("prefix_ranges", np.int32, "ranges", 0),
    Field("embed_index", np.int32, "tokens", -1, "embeds"),
    Field("temperature", np.float32, "seqs", 0.0, "sampling"),    # padding rows sample greedily
    Field("top_k", np.int32, "seqs", 0, "sampling"),
    Field("top_p", np.float32, "seqs", 1.0, "sampling"),
    Field("min_p", np.float32, "seqs", 0.0, "sampling"),
    Field("seed", np.int64, "seqs", 0, "sampling"),
    Field("request", np.int32, "seqs", -1, "speculative"),       # a row of graphrt.speculative.SpecState
    Field("offset", np.int32, "seqs", 0, "speculative"),         # first token's position - that row's length
)
_EMPTY = {f.name: f.empty for f in FIELDS}     # a padding sequence's (or token's) value of each field


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
             position_rows: int = 1, sampling: bool = False, speculative: bool = False) -> "Layout":
        options = (None, "embeds" if embeds else None, "sampling" if sampling else None,
                   "speculative" if speculative else None)
        offsets, at = {}, 0
        for f in FIELDS:
            if f.option in options:
                offsets[f.name] = at
                count = math.prod(_shape(f.rows, num_seqs, num_tokens, max_ranges, position_rows))
                at += -(-count * _ITEMSIZE[f.dtype] // _ALIGN) * _ALIGN
        return Layout(num_seqs, num_tokens, max_ranges, max_blocks, offsets, at, position_rows)

    @property
    def nbytes(self) -> int:
        return self.block_table_offset + 4 * self.max_blocks * self.num_seqs

    def copy_bytes(self, block_columns: int) -> int:
        """Bytes a step must copy when its sequences use ``block_columns`` block-table columns."""
        return self.block_table_offset + 4 * block_columns * self.num_seqs

    def views(self, flat):
        """Typed views over ``flat`` (a uint8 torch tensor or numpy array) of every field of
        ``FIELDS`` (None where its option is off) and of the block table, [S, B] with strides
        (1, S)."""
        torch_flat = isinstance(flat, torch.Tensor)
        views = {}
        for f in FIELDS:
            at = self.offsets.get(f.name)
            if at is None:
                views[f.name] = None
                continue
            shape = _shape(f.rows, self.num_seqs, self.num_tokens, self.max_ranges, self.position_rows)
            nbytes = math.prod(shape) * _ITEMSIZE[f.dtype]
            part = flat[at: at + nbytes]
            views[f.name] = (part.view(_TORCH[f.dtype]) if torch_flat else part.view(f.dtype)).reshape(shape)
        bt = flat[self.block_table_offset: self.nbytes]
        bt = bt.view(torch.int32) if torch_flat else bt.view(np.int32)
        views["block_table"] = bt.reshape(self.max_blocks, self.num_seqs).T
        return views


def _shape(rows: str, s: int, t: int, r: int, p: int) -> tuple:
    """A field's shape in a bucket of s sequences, t tokens, r ranges and p position rows."""
    if rows == "tokens" or (rows == "positions" and p == 1):
        return (t,)
    if rows == "seqs":
        return (s,)
    if rows == "seqs+1":
        return (s + 1,)
    return (s, r, 2) if rows == "ranges" else (p, t)


_TORCH = {np.int32: torch.int32, np.int64: torch.int64, np.float32: torch.float32}
try:
    from graphrt._fast import copy_h2d as _copy_h2d
except ImportError:           # built without the C helper (or an older build of it)
    _copy_h2d = None
# (stream id, device index, device type) of a device's current stream, what
# torch.cuda.current_stream() wraps in a new Stream object on every call
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)


@dataclass
class DeviceViews:
    """What a captured step reads: the bucket's metadata and its per-token inputs."""

    layout: Layout
    meta: AttentionMetadata
    positions: torch.Tensor      # [T] int64, or [P, T] with cfg.position_rows = P > 1
    input_ids: torch.Tensor      # [T] int64
    embed_index: torch.Tensor | None     # [T] int32, -1 = no given embedding (None: embed_dim 0)
    inputs_embeds: torch.Tensor | None   # [T, embed_dim] cfg.dtype, rows packed from 0
    sampling: dict | None = None         # [S] per field of SAMPLING_FIELDS (None: cfg.sampling off)
    speculative: dict | None = None      # request, offset [S] int32 (None: cfg.speculative off)


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
        self._sampling_cache: tuple | None = None   # (the last tuple of SamplingParams, its packed arrays)

    def layout(self, num_seqs: int, num_tokens: int) -> Layout:
        """The arena layout of a bucket of num_seqs sequences and num_tokens tokens."""
        return Layout.make(num_seqs, num_tokens, self.cfg.max_prefix_ranges, self.cfg.max_blocks_per_seq,
                           embeds=self.cfg.embed_dim > 0, position_rows=self.cfg.position_rows,
                           sampling=self.cfg.sampling, speculative=self.cfg.speculative)

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
        sampling = {name: v[name] for name in SAMPLING_FIELDS} if self.cfg.sampling else None
        speculative = {"request": v["request"], "offset": v["offset"]} if self.cfg.speculative else None
        return DeviceViews(layout, meta, v["positions"], v["input_ids"], v["embed_index"], embeds, sampling,
                           speculative)

    def pack(self, step: Step, layout: Layout, input_ids: np.ndarray | None = None,
             embed_rows: np.ndarray | None = None, positions: np.ndarray | None = None,
             sampling: list | None = None, requests: np.ndarray | None = None,
             offsets: np.ndarray | None = None) -> int:
        """Write ``step`` (validated, fitting ``layout``) into the next free pinned slot and
        return the slot; ``embed_rows`` (checked) are the tokens whose embeddings the step
        brings, in the order of their rows; ``positions`` (checked, [P, num_tokens]) the
        tokens' position rows where the step gives them (default: each token's sequence
        position in every row). Waits on the GPU only when every slot still has a copy in
        flight, that is when the host is ``ring`` steps ahead. ``sampling`` (checked
        ``SamplingParams``, one a sequence; None: greedy) fills the sampling fields where
        cfg.sampling is on; ``requests`` / ``offsets`` (checked ints, one per sequence) the
        speculative fields where cfg.speculative is on (default: request -1, offset 0)."""
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
        if v["temperature"] is not None:
            self._fill_sampling(sampling or (), v)
        if v["request"] is not None:
            n = step.num_seqs
            for name, values in (("request", requests), ("offset", offsets)):
                v[name][n:] = _EMPTY[name]
                v[name][:n] = _EMPTY[name] if values is None else values
        return slot

    def _fill_sampling(self, sampling, v: dict) -> None:
        """The sampling fields of a slot. Packing settings is a Python pass over them (~70 us
        for 256 sequences on a CPU core), so a tuple passed again (the same object: tuples
        and SamplingParams are immutable) reuses the arrays packed from it last time."""
        cached = self._sampling_cache
        if cached is not None and cached[0] is sampling and len(sampling) <= v["temperature"].shape[0]:
            n = len(sampling)
            for name in SAMPLING_FIELDS:
                v[name][:n] = cached[1][name]
                v[name][n:] = _EMPTY[name]
            return
        fields = {name: v[name] for name in SAMPLING_FIELDS}
        SamplingParams.fill(sampling, **fields, checked=True)      # Runtime.step checked them
        if isinstance(sampling, tuple) and sampling:
            self._sampling_cache = (sampling, {name: a[: len(sampling)].copy() for name, a in fields.items()})

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
        """An all-padding step (no tokens, slots -1, greedy sampling): what warm-up and
        capture run on."""
        v = layout.views(self.arena)
        for f in FIELDS:
            if v[f.name] is not None:
                v[f.name].fill_(f.empty)
        v["block_table"].zero_()
