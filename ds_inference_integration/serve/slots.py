"""A key/value cache with a slot per row, for the step engine (`serve/steps.py`): rows of different lengths share a
decoding step, and a row joins or leaves without the other rows' cache being copied or re-padded.

Each attention layer keeps `[slots, heads, width, head_dim]` keys and values (this rank's heads: a sharded layer's
first write sizes it); an encoder-decoder's cross-attention layers keep `[slots, heads, source width, head_dim]`,
written once per row (its encoder runs once). The rows admitted at one step are prefilled together through
transformers' own `DynamicCache` (generate's prefill) and each row's keys and values are copied into its slot: an
admission costs the admitted rows' lengths, whatever the batch holds. A decoding step runs every slot below the highest one in use
(`decode`): each row's new key is written at that row's own position, and the layer returns views of the first
`hi` slots and `width` columns, which the step's 4D mask limits to each row's own past. No copy is made per step.

The width grows by doubling as rows need it (a copy of the whole cache, log2(longest row) times in a server's
life), so memory follows the longest row held so far, not `--max_model_len` x slots; the step's shapes change only
then and when the highest slot in use changes. Layers this cache cannot hold a row of (state-space and
linear-attention states, anything but plain keys and values) are refused by `check_layers`, and the model is then
served by the batch engine. A
sliding-window model keeps every key here too (a row's prefill runs with transformers' plain cache, which keeps
them all); its window is the step's mask's (`decode(window=...)`)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer


class SlotLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False

    def __init__(self, slots: int):
        super().__init__()
        self.slots = slots
        # (slot ids, positions, hi, width, whether every slot below hi decodes)
        self.plan: tuple[torch.Tensor, torch.Tensor, int, int, bool] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, key_dim = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros((self.slots, heads, 16, key_dim))
        self.values = value_states.new_zeros((self.slots, value_states.shape[1], 16, value_states.shape[3]))
        self.is_initialized = True

    def width(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def grow(self, width: int) -> None:
        """At least `width` columns, doubling: the one copy of the whole cache, log2 times in a row's life."""
        if width <= self.width():
            return
        new = max(width, 2 * self.width())
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_zeros((*old.shape[:2], new, old.shape[3]))
            grown[:, :, :old.shape[2]] = old
            setattr(self, name, grown)

    def write_prompt(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A prefilled row's keys and values (`[1, heads, length, dim]`) into its slot, columns 0.. length - 1."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        length = keys.shape[2]
        self.grow(length)
        self.keys[slot, :, :length] = keys[0]
        self.values[slot, :, :length] = values[0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """A decoding step: the new key and value (`[hi, heads, 1, dim]`) of each decoding row at its slot's own
        position (other slots below `hi` are not written: a row admitted this step keeps its prompt); returns the
        first `hi` slots' first `width` columns (views)."""
        slots, positions, hi, width, every = self.plan
        self.grow(width)
        self.keys[slots, :, positions] = key_states[:, :, 0] if every else key_states[slots, :, 0]
        self.values[slots, :, positions] = value_states[:, :, 0] if every else value_states[slots, :, 0]
        return self.keys[:hi, :, :width], self.values[:hi, :, :width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.plan[3] if self.plan else 0), 0

    def get_seq_length(self) -> int:
        return (self.plan[3] - 1) if self.plan else 0

    def get_max_length(self) -> int:
        return -1


class CrossSlotLayer(SlotLayer):
    """One cross-attention layer's keys and values for every slot (`[slots, heads, source width, head_dim]`),
    written once when a row is admitted (its encoder ran once: `write_prompt`, as a self-attention slot is written)
    and read as they are at every step: the decoder reads `keys` and `values` directly once its cross-attention is
    marked updated, so while a step runs they are the views of its first `hi` slots and the step's source width."""

    def __init__(self, slots: int):
        super().__init__(slots)
        self.view = None
        self.fill: dict[int, int] | None = None  # slot -> source length, of rows whose first step this is

    @property
    def keys(self):
        return self._keys if self.view is None or self._keys is None else self._keys[:self.view[0], :, :self.view[1]]

    @keys.setter
    def keys(self, value):
        self._keys = value

    @property
    def values(self):
        return (self._values if self.view is None or self._values is None
                else self._values[:self.view[0], :, :self.view[1]])

    @values.setter
    def values(self, value):
        self._values = value

    def update(self, key_states, value_states, *args, **kwargs):
        """A step with rows joining (`fill`): the layer computed keys and values from every row's encoder output
        (`[hi, heads, source width, dim]`; the running rows' are of a stand-in, not kept); the joining rows' own are
        written into their slots, once, and every row reads its slot's."""
        if not self.fill:
            raise RuntimeError("a slot's cross-attention keys are written once, when its row joins")
        for slot, length in self.fill.items():
            self._keys[slot, :, :length] = key_states[slot, :, :length]
            self._values[slot, :, :length] = value_states[slot, :, :length]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.view[1] if self.view else 0), 0

    def get_seq_length(self) -> int:
        return self.view[1] if self.view else 0

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """One `SlotLayer` per attention layer of the model, and the plan of the step being run."""

    def __init__(self, layers: int, slots: int, cross: bool = False):
        super().__init__(layers=[SlotLayer(slots) for _ in range(layers)])
        self.slots = slots
        self.cross = Cache(layers=[CrossSlotLayer(slots) for _ in range(layers)]) if cross else None
        self.sources = [1] * slots  # each slot's source length (an encoder-decoder's)

    def write_prompt(self, slot: int, prefilled: Cache, row: int, length: int, source: int = 0,
                     offset: int = 0) -> None:
        """Row `row` of a prefill (its `length` positions from `offset`: a packed prefill's rows follow each other in
        one sequence; an encoder-decoder's first `source` source positions of its cross-attention) into `slot`."""
        own = prefilled.self_attention_cache if self.cross is not None else prefilled
        for mine, theirs in zip(self.layers, own.layers):
            mine.write_prompt(slot, theirs.keys[row:row + 1, :, offset:offset + length],
                              theirs.values[row:row + 1, :, offset:offset + length])
        if self.cross is not None:
            self.sources[slot] = source
            for mine, theirs in zip(self.cross.layers, prefilled.cross_attention_cache.layers):
                mine.write_prompt(slot, theirs.keys[row:row + 1, :, :source], theirs.values[row:row + 1, :, :source])

    def shrink(self) -> None:
        """Every layer back to its first width (16 columns), contents dropped: for when no row is held."""
        for each in (*self.layers, *(self.cross.layers if self.cross is not None else ())):
            if each.is_initialized and each.width() > 16:
                keys, values = each.keys, each.values
                each.keys = keys.new_zeros((*keys.shape[:2], 16, keys.shape[3]))
                each.values = values.new_zeros((*values.shape[:2], 16, values.shape[3]))

    def write_cross(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]], source: int) -> None:
        """A joining row's cross-attention keys and values (each layer's `[1, heads, width >= source, dim]`, projected
        from its encoder output) into `slot`, its first `source` positions."""
        self.sources[slot] = source
        for mine, (keys, values) in zip(self.cross.layers, layers):
            mine.write_prompt(slot, keys[:, :, :source], values[:, :, :source])

    def reorder(self, slots: list[int], sources: list[int]) -> None:
        """Beam search's reorder within one request: slot slots[i] continues the self-attention past of sources[i]
        (a copy of the group's own slots; its cross-attention is the same in every beam)."""
        if slots != sources:
            into, come = torch.tensor(slots), torch.tensor(sources)
            for each in self.layers:
                each.keys[into] = each.keys[come]
                each.values[into] = each.values[come]

    def join(self, sources: dict[int, int]) -> None:
        """Rows whose first decoder step is the next (slot -> source length): their cross-attention keys are written
        by that step (`CrossSlotLayer.update`)."""
        for slot, length in sources.items():
            self.sources[slot] = length
        for each in self.cross.layers:
            each.grow(max(sources.values()))
            each.fill = dict(sources)

    def for_step(self):
        """What the model is given as its cache for a decoding step: this cache, or for an encoder-decoder the pair
        (self-attention, cross-attention) with the cross-attention marked computed, unless rows join (`join`): the
        layers then compute every row's from the step's encoder output, and keep the joining rows'."""
        if self.cross is None:
            return self
        from transformers import EncoderDecoderCache

        pair = EncoderDecoderCache(self, self.cross)
        pair.is_updated = {i: not self.cross.layers[i].fill for i in range(len(self.layers))}
        return pair

    def source_mask(self, hi: int, fixed: bool = False) -> torch.Tensor:
        """An encoder-decoder step's cross-attention mask (`[hi, width]`: 1 on each slot's own source), and the
        cross views set to that width: the longest source among the first `hi` slots, or (`fixed`) the width the
        cross-attention cache holds (it changes only when the cache grows)."""
        width = self.cross.layers[0].width() if fixed else max(self.sources[:hi])
        for each in self.cross.layers:
            each.view = (hi, width)
        lengths = torch.tensor(self.sources[:hi], device=self.layers[0].keys.device)
        return (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).long()

    def decode(self, positions: dict[int, int], window: int | None = None, hi: int | None = None,
               fixed: bool = False) -> tuple:
        """Plan a step over slots 0..hi-1 (hi: the highest slot in `positions`, + 1, unless given), slot s writing at
        `positions[s]`; returns the step's `position_ids` (`[hi, 1]`) and additive 4D mask (`[hi, 1, 1, width]`: 0 on
        each row's own past and new token, the dtype's lowest elsewhere; a slot not decoding sees its column 0 only,
        so no row of the softmax is empty, and its output is not used); and, with a sliding `window`, the mask of the
        sliding layers, which also hides what lies `window` or more positions back (transformers' sliding overlay: a
        key at k is seen from q when q - window < k <= q; the keys themselves are all kept), else None. `fixed`: the
        step's width is the cache's whole width (grown first where a row needs it), so that with a fixed `hi` the
        step's shapes change only when the cache grows (log2 times), as CUDA graphs and `torch.compile` need."""
        hi, width = (max(positions) + 1 if hi is None else hi), max(positions.values()) + 1
        if fixed:
            for each in self.layers:
                each.grow(width)
            width = self.layers[0].width()
        layer = self.layers[0]
        device, dtype = layer.keys.device, layer.keys.dtype
        slots = torch.tensor(sorted(positions), device=device)
        pos = torch.tensor([positions[s] for s in sorted(positions)], device=device)
        plan = (slots, pos, hi, width, len(positions) == hi)
        for each in self.layers:
            each.plan = plan
        every = torch.zeros(hi, dtype=torch.long, device=device).index_copy(0, slots, pos)
        columns = torch.arange(width, device=device)
        seen = columns[None, :] <= every[:, None]
        masks = [seen] if window is None else [seen, seen & (columns[None, :] > every[:, None] - window)]
        masks = [torch.where(m, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :] for m in masks]
        return every[:, None], masks[0], (masks[1] if window is not None else None)

    def done(self) -> None:
        for each in self.layers:
            each.plan = None
        for each in self.cross.layers if self.cross is not None else ():
            each.view, each.fill = None, None


def check_layers(prefilled: Cache) -> str | None:
    """Why a model's cache cannot be held a slot per row (None: it can): each of its layers (an encoder-decoder's
    self- and cross-attention alike) must be transformers' plain `DynamicLayer` (keys and values of every past
    position, one tensor per layer)."""
    from transformers import EncoderDecoderCache

    if isinstance(prefilled, EncoderDecoderCache):
        layers = [*prefilled.self_attention_cache.layers, *prefilled.cross_attention_cache.layers]
    else:
        layers = prefilled.layers
    for i, layer in enumerate(layers):
        if type(layer) is not DynamicLayer:
            return f"its layer {i} keeps a {type(layer).__name__} (a state, not keys and values): not held per row yet"
        if layer.keys is None or layer.keys.dim() != 4:
            return f"its layer {i} keeps no 4D keys"
    return None
