"""An exact prefix cache: a prompt that shares a prefix with a recent one restores the
model's state where a cold prefill of it would pass, instead of prefilling that prefix again.
Its logits are bitwise those of a cold prefill.

mlx-vlm prefills in chunks of the prefill step size S from position 0; the last chunk ends
one token short of the prompt and the final token runs with the logits. A chunk's arithmetic
depends on the chunk (its row count, the keys it attends over, the GDN chunked scan), so a
state computed in other chunks rounds differently. Snapshots are therefore taken only at a
cold prefill's own chunk boundaries, and a request restores only a boundary its own cold
prefill passes (a multiple of S, or its length - 1) and prefills the rest in the same chunks.

A snapshot is the whole model state at a boundary: attention KV, each GatedDeltaNet layer's
convolution and recurrent state with its cache metadata and, on the speculative route, the
target's tap hidden states of every position (the drafter builds its context from them).
KV and taps are kept once per prompt (a boundary's are their first positions), GDN states
once per boundary. MLX arrays are immutable values and a cache's in-place update writes a
new buffer while another handle shares the old one; snapshots hold their own handles and a
restore hands out new ones, so no request's cache can change a stored array.

A drafter whose layers all slide reads only its window's last positions of the prompt's
taps (mlx-vlm's sliding layers skip the rest), so for requests whose rounds RequestDecoder
runs the prompt batch keeps only the prefill chunks those positions fall in (with a store,
also those before the last aligned boundaries, where a next turn resumes): speculation's
memory stays flat in the prompt's length. The entry then stores the taps from where the kept
ones start, and a boundary is restored only where they cover the positions the drafter reads:
on that route a prompt's older boundaries (a shared system prompt, an edit further back) are
not kept, only those near its end.

The engine installs PrefixPromptBatch in place of mlx-vlm's PromptProcessingBatch (its
BatchGenerator looks the class up on mlx_vlm.generate), with or without a store; dflash2_audit
lists both. The store is used on mlx-vlm's one worker thread only.
"""

from collections import OrderedDict
from dataclasses import dataclass
from hashlib import sha256

import mlx.core as mx
import numpy as np
from mlx_vlm.apc import media_token_spans, multimodal_token_ids_from_config
from mlx_vlm.generate.ar import PromptProcessingBatch, _slice_sequence_aligned_prompt_kwarg
from mlx_vlm.models.cache import ArraysCache, BatchKVCache, KVCache

from dflash2_rounds import context_window, served_state, serves_rounds

# The cache layers a snapshot knows how to copy (quantized KV is not among them).
SNAPSHOT_TYPES = (KVCache, BatchKVCache, ArraysCache)
KV_FIELDS = ("keys", "values")
# Prompt arguments that change no prefill arithmetic once position ids are given (those
# are part of the key): the others turn the cache off for the request.
UNKEYED_PROMPT_ARGUMENTS = {"position_ids", "rope_deltas", "image_grid_thw", "video_grid_thw"}
RECENT_BOUNDARIES = 2  # aligned boundaries always kept at a prompt's end


def kept_boundaries(positions, step: int) -> set:
    """Which boundaries of a prompt stay stored: the final one (its length - 1, which only
    that prompt's repeats restore), the last RECENT_BOUNDARIES aligned ones (where the next
    turn of a conversation resumes), and older aligned ones at power-of-two multiples of the
    step (shared system prompts, edits further back): a handful per prompt, not one per
    chunk, since at the 27B shape each costs about 150 MB of GDN state."""
    aligned = sorted(p for p in positions if p % step == 0)
    kept = {p for p in positions if p % step} | set(aligned[-RECENT_BOUNDARIES:])
    return kept | {p for p in aligned if (p // step) & (p // step - 1) == 0}


def taps_cover(taps_start: int, position: int, window) -> bool:
    """Whether taps from `taps_start` hold what a drafter reading its last `window` positions
    (None: all of them) needs at a boundary."""
    return taps_start <= position - min(position, window or position)


def usable(position: int, common: int, length: int, step: int) -> bool:
    """Whether a cold prefill of a prompt of this length passes this boundary, and the
    prompt agrees with the stored one up to it."""
    return 0 < position <= min(common, length - 1) and (position % step == 0 or position == length - 1)


@dataclass(frozen=True)
class PromptKey:
    """What the state at a position depends on: each position's token and position ids
    (rows), and each image or video by the content of its embeddings (media)."""

    rows: np.ndarray  # (length, 1 + position id rows), int64
    media: tuple  # ((start, end, sha256 of the embeddings), ...)

    def common_prefix(self, other: "PromptKey") -> int:
        if self.rows.shape[1] != other.rows.shape[1]:  # one-row against multimodal position ids
            return 0
        n = min(len(self.rows), len(other.rows))
        differing = np.flatnonzero((self.rows[:n] != other.rows[:n]).any(axis=1))
        common = int(differing[0]) if differing.size else n
        theirs = {start: digest for start, _, digest in other.media}
        for start, _, digest in self.media:
            if start < common and theirs.get(start) != digest:
                common = start
        return common


@dataclass
class Entry:
    """One prompt's stored states. layout: what a restore needs to match (cache layer
    types, the drafter's tap layers, the step); boundaries: position -> per-layer cache
    copies without KV; kv: per layer (keys, values) over the last boundary's positions, or
    None; taps: per tap layer (1, last boundary - taps_start, width), or None."""

    layout: tuple
    key: PromptKey
    boundaries: dict
    kv: list
    taps: list = None
    taps_start: int = 0  # the position of the taps' first row (a sliding drafter's prefill left out the rest)

    def covers(self, position: int, window) -> bool:
        """Whether the taps hold what the drafter needs at this boundary (taps_cover)."""
        return self.taps is None or taps_cover(self.taps_start, position, window)

    def arrays(self):
        for layers in self.boundaries.values():
            for layer in layers:
                yield from _arrays(vars(layer))
        yield from _arrays([self.kv, self.taps])


class PrefixStore:
    """Entries of recent prompts, least recently used first, within a byte budget."""

    def __init__(self, budget_gb: float):
        self.budget = int(budget_gb * 1e9)
        self.entries = OrderedDict()  # id(entry) -> entry

    def nbytes(self) -> int:
        unique = {id(array): array.nbytes for entry in self.entries.values() for array in entry.arrays()}
        return sum(unique.values())

    def lookup(self, layout, key: PromptKey, length: int, window=None):
        """(entry, position) of the longest usable boundary, or (None, 0); window: the
        drafter's, as Entry.covers takes it."""
        step = layout[-1]
        best, position = None, 0
        for entry in self.entries.values():
            if entry.layout != layout:
                continue
            common = key.common_prefix(entry.key)
            found = max((p for p in entry.boundaries if usable(p, common, length, step) and entry.covers(p, window)),
                        default=0)
            if found > position:
                best, position = entry, found
        if best is not None:
            self.entries.move_to_end(id(best))
        return best, position

    def add(self, entry: Entry, source: Entry = None, restored: int = 0):
        """Stores an entry; drops its source when every aligned boundary of the source lives on
        in it (only the source's final boundary, a repeat of that exact prompt, is given up);
        then evicts least recently used entries until the budget holds."""
        step = entry.layout[-1]
        if source is not None and max((p for p in source.boundaries if p % step == 0), default=0) <= restored:
            self.entries.pop(id(source), None)
        self.entries[id(entry)] = entry
        while self.entries and self.nbytes() > self.budget:
            self.entries.popitem(last=False)

    def summary(self) -> str:
        return f"{len(self.entries)} prompts, {self.nbytes() / 1e9:.2f} of {self.budget / 1e9:.2f} GB"


# ---------------------------------------------------------------------------------------
# Copies of cache layers that share the (immutable) arrays but no handle or container


def _handles(value):
    if isinstance(value, mx.array):
        return value[...]
    if isinstance(value, (list, tuple)):
        return type(value)(_handles(item) for item in value)
    if isinstance(value, dict):
        return {name: _handles(item) for name, item in value.items()}
    return value


def _arrays(value):
    if isinstance(value, mx.array):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _arrays(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _arrays(item)


def _copy_layer(layer, skip=()):
    copy = type(layer).__new__(type(layer))
    copy.__dict__.update({name: _handles(value) for name, value in vars(layer).items() if name not in skip})
    return copy


def snapshot_layers(cache) -> tuple:
    """Every layer's state at a boundary, KV left out (the entry keeps it once)."""
    return tuple(_copy_layer(layer, KV_FIELDS) for layer in cache)


def restore_layers(layers: tuple, kv: list, position: int) -> list:
    """Fresh cache layers holding a boundary's state."""
    restored = []
    for layer, pair in zip(layers, kv):
        layer = _copy_layer(layer)
        if pair is not None:
            layer.keys, layer.values = (array[..., :position, :] for array in pair)
        restored.append(layer)
    return restored


def snapshot_kv(cache, position: int) -> list:
    return [None if getattr(layer, "keys", None) is None else
            (layer.keys[..., :position, :], layer.values[..., :position, :]) for layer in cache]


# ---------------------------------------------------------------------------------------
# The prompt batch


class PrefixPromptBatch(PromptProcessingBatch):
    """mlx-vlm's prompt processing for one prompt, starting from the longest usable stored
    boundary, recording the boundaries it passes and storing them when its prefill ends.
    With no store, or a prompt the cache does not cover, it is mlx-vlm's own."""

    store: PrefixStore = None  # set by the engine

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The drafter's window where the prompt's earlier taps may go (see the module's doc).
        self._tap_window = None
        if (self._speculative_prefill.kwargs and len(self.uids) == 1
                and serves_rounds(served_state(self.draft_model), self.greedy_sampling)):
            self._tap_window = context_window(self.draft_model)
        self._taps_start = 0
        self._layout = self._prefix_layout()
        # Taps kept: the window's, and with a store the window before each of the last
        # RECENT_BOUNDARIES aligned boundaries too (where the next turn resumes).
        self._taps_kept = self._tap_window
        if self._tap_window is not None and self._layout is not None:
            self._taps_kept += RECENT_BOUNDARIES * self.prefill_step_size
        self._key, self._source, self._restored, self._boundaries = None, None, 0, {}
        if self._layout is None:
            return
        self._key = self._prompt_key()
        self._source, self._restored = self.store.lookup(self._layout, self._key, self._inputs_embeds.shape[1],
                                                         self._tap_window)
        if self._source is not None:
            self._restore(self._source, self._restored)

    def _prefix_layout(self):
        """The layout an entry must match, or None where the cache does not apply: no store,
        several rows, APC, no chunked prefill, an unknown prompt argument, a cache layer
        a snapshot cannot copy."""
        kwargs = self._prompt_kwargs
        if (self.store is None or len(self.uids) != 1 or self._apc_manager is not None
                or self._right_pad_per_row is not None or not self.prefill_step_size
                or self._inputs_embeds is None or "position_ids" not in kwargs
                or set(k for k, v in kwargs.items() if isinstance(v, mx.array)) - UNKEYED_PROMPT_ARGUMENTS
                or any(type(layer) not in SNAPSHOT_TYPES for layer in self.prompt_cache)):
            return None
        taps = tuple(self._speculative_prefill.kwargs.get("capture_layer_ids") or ())
        return tuple(type(layer).__name__ for layer in self.prompt_cache), taps, self.prefill_step_size

    def _prompt_key(self) -> PromptKey:
        tokens = np.array(self._input_ids[0], dtype=np.int64)
        positions = self._prompt_kwargs["position_ids"]
        positions = np.array(positions.reshape(-1, positions.shape[-1]), dtype=np.int64).T
        media = []
        config = getattr(self.model, "config", None)
        for start, end in media_token_spans(tokens.tolist(), multimodal_token_ids_from_config(config)):
            embeddings = np.array(self._inputs_embeds[0, start:end])
            media.append((start, end, sha256(embeddings.tobytes()).hexdigest()))
        return PromptKey(np.concatenate([tokens[:, None], positions], axis=1), tuple(media))

    def _restore(self, entry: Entry, position: int):
        """The state at `position`, as if prompt_step had prefilled up to it."""
        self.prompt_cache = restore_layers(entry.boundaries[position], entry.kv, position)
        if entry.taps is not None:
            kept = position - entry.taps_start
            if self._taps_kept is not None:
                kept = min(kept, self._taps_kept)
            self._taps_start = position - kept
            start = self._taps_start - entry.taps_start
            self._speculative_prefill.chunks = [[tap[:, start:position - entry.taps_start] for tap in entry.taps]]
        self._inputs_embeds = self._inputs_embeds[:, position:]
        self._input_ids = self._input_ids[:, position:]
        for name in self._prompt_length_aware_keys:
            self._prompt_kwargs[name] = _slice_sequence_aligned_prompt_kwarg(
                name, self._prompt_kwargs[name], start=position)
        self._processed_prompt_columns = position
        self._cached_tokens_per_row = [position]
        # Boundaries up to here are the source's (same tokens, same arrays).
        self._boundaries = {p: layers for p, layers in entry.boundaries.items() if p <= position}
        self._drop_uncovered_boundaries()

    def prompt_step(self) -> int:
        processed = super().prompt_step()
        if processed:
            self._drop_unread_taps()
        if processed and self._layout is not None:
            position = self._processed_prompt_columns
            self._boundaries[position] = snapshot_layers(self.prompt_cache)
            kept = kept_boundaries(self._boundaries, self.prefill_step_size)
            self._boundaries = {p: layers for p, layers in self._boundaries.items() if p in kept}
            self._drop_uncovered_boundaries()
        return processed

    def _drop_uncovered_boundaries(self):
        """With a sliding drafter, a boundary whose taps went can never be restored: its
        snapshot goes as soon as they do (after a restore or a prefill step), not stored."""
        self._boundaries = {p: layers for p, layers in self._boundaries.items()
                            if taps_cover(self._taps_start, p, self._tap_window)}

    def _drop_unread_taps(self):
        """With a sliding drafter, the prefill chunks' taps before the last `_taps_kept` positions go."""
        if self._taps_kept is None:
            return
        chunks = self._speculative_prefill.chunks
        while len(chunks) > 1 and sum(chunk[0].shape[1] for chunk in chunks[1:]) >= self._taps_kept:
            self._taps_start += chunks.pop(0)[0].shape[1]

    def generate(self, *args, **kwargs):
        entry = None
        last = self._processed_prompt_columns
        if self._layout is not None and last > self._restored:
            taps = None
            chunks = self._speculative_prefill.chunks
            if chunks:  # one array per tap layer; the final token's taps join it as before
                taps = [mx.concatenate(parts, axis=1) for parts in zip(*chunks)]
                self._speculative_prefill.chunks = [taps]
            entry = Entry(self._layout, self._key, self._boundaries, snapshot_kv(self.prompt_cache, last),
                          _handles(taps), self._taps_start)
        generation = super().generate(*args, **kwargs)
        if entry is not None:
            self.store.add(entry, self._source, self._restored)
        return generation
