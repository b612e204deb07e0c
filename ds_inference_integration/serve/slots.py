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
then and when the highest slot in use changes. A sliding-window model keeps every key here too (a row's prefill runs
with transformers' plain cache, which keeps them all); its window is the step's mask's (`decode(window=...)`).

State-space and linear-attention layers (Mamba's and Mamba2's mixers, gated delta nets, short convolutions: every
layer transformers keeps as a `LinearAttentionLayer`, alone or beside attention in one layer) keep a state per slot
(`SlotStateLayer`: each convolution state `[slots, channels, kernel]`, each recurrent state `[slots, ...]`), written
once from a row's prefill. A decoding step gives the model the first `hi` slots' states as views, which its layers
update in place as they update transformers' own; a slot below `hi` holding a row that does not decode in the step
(admitted in it) has its states put back after the step (`decode`, `done`). Layers of any other kind are refused by
`check_layers` in one line naming the layer, and the model is then served by the batch engine."""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)


class SlotLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False

    def __init__(self, slots: int):
        super().__init__()
        self.slots = slots
        # (slot ids, positions, hi, width, whether every slot below hi decodes)
        self.plan: tuple[torch.Tensor, torch.Tensor, int, int, bool] | None = None
        # a step of tokens in one sequence (`SlotCache.tokens`): (each token's slot, its position, hi, width)
        self.flat: tuple[torch.Tensor, torch.Tensor, int, int] | None = None

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
        first `hi` slots' first `width` columns (views). A step of tokens in one sequence (`flat`): each token's key
        and value at its slot's position, and every slot's first `width` columns returned as one sequence (`[1, heads,
        hi x width, dim]`, a copy), which the step's mask limits to each token's own slot and past."""
        if self.flat is not None:
            slots, positions, hi, width = self.flat
            self.grow(width)
            self.keys[slots, :, positions] = key_states[0].transpose(0, 1)
            self.values[slots, :, positions] = value_states[0].transpose(0, 1)
            keys, values = self.keys[:hi, :, :width], self.values[:hi, :, :width]
            return (keys.transpose(0, 1).reshape(1, keys.shape[1], hi * width, keys.shape[3]),
                    values.transpose(0, 1).reshape(1, values.shape[1], hi * width, values.shape[3]))
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


class SlotStateLayer(LinearAttentionLayer):
    """A state-space or linear-attention layer's states for every slot: each of its convolution and recurrent states
    (transformers' `LinearAttentionLayer` keeps them `[batch, ...]`) as `[slots, ...]`, written once from a row's
    prefill (`write_state`). While a step runs (`begin`) the layer's own states are views of the first `hi` slots,
    which the model's mixers read and update in place (`causal_conv1d_update`, `update_recurrent_state`'s copy), so no
    state is copied per step; the states of slots below `hi` whose rows do not decode in the step are kept aside and
    put back (`end`): a step overwrites every state it runs over, and a row admitted in it would otherwise lose its
    prompt's state to the pad token fed at its slot."""

    def __init__(self, slots: int, number_of_states: int = 1):
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        self.slots = slots
        self.stored: dict[tuple[str, int], torch.Tensor] = {}  # ("conv_states" | "recurrent_states", i) -> [slots, ...]
        self.kept: dict | None = None
        self.seen = 0

    def write_state(self, slot: int, theirs: LinearAttentionCacheLayerMixin, row: int) -> None:
        """Row `row` of a prefilled layer's states (transformers' own) into `slot`."""
        for index in range(theirs.number_of_states):
            for name in ("conv_states", "recurrent_states"):
                state = getattr(theirs, name)[index]
                if state is None:
                    continue
                stored = self.stored.get((name, index))
                if stored is None:
                    stored = self.stored[(name, index)] = state.new_zeros((self.slots, *state.shape[1:]))
                    self.device, self.dtype = state.device, state.dtype
                stored[slot] = state[row]
            if theirs.conv_kernel_size.get(index) is not None:
                self.conv_kernel_size[index] = theirs.conv_kernel_size[index]

    def begin(self, hi: int, keep: list[int], seen: int) -> None:
        """A step over slots 0..hi-1: the layer's states are views of its slots' (updated in place by the step);
        `keep`'s slots (below `hi`, not decoding) are kept aside, put back by `end`."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device) if keep else None
        self.kept = {} if index is None else {k: (index, stored[index].clone()) for k, stored in self.stored.items()}
        for (name, i), stored in self.stored.items():
            getattr(self, name)[i] = stored[:hi]
            getattr(self, f"is_{name}_initialized")[i] = True
            self.has_previous_state[i] = True
        self.seen = seen

    def end(self) -> None:
        for key, (index, saved) in (self.kept or {}).items():
            self.stored[key][index] = saved
        self.kept = None
        for name, i in self.stored:
            getattr(self, name)[i] = None

    def reorder(self, into: torch.Tensor, come: torch.Tensor) -> None:
        for stored in self.stored.values():
            stored[into] = stored[come]

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1


class SlotHybridLayer(SlotStateLayer, SlotLayer):
    """A layer holding both a state (its linear-attention part) and keys and values (its attention: Falcon-H1's and
    Zamba's layers run both), as transformers' `LinearAttentionAndFullAttentionLayer`."""

    def __init__(self, slots: int, number_of_states: int = 1):
        SlotLayer.__init__(self, slots)
        SlotStateLayer.__init__(self, slots, number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:  # keys and values (two positional), else a state's
        if len(args) == 2 and not kwargs:
            SlotLayer.lazy_initialization(self, *args)
        else:
            SlotStateLayer.lazy_initialization(self, **kwargs)

    def get_seq_length(self) -> int:
        return SlotLayer.get_seq_length(self)

class CrossSlotLayer(SlotLayer):
    """One cross-attention layer's keys and values for every slot (`[slots, heads, source width, head_dim]`),
    written once when a row is admitted (its encoder ran once: `write_prompt`, as a self-attention slot is written)
    and read as they are at every step: the decoder reads `keys` and `values` directly once its cross-attention is
    marked updated, so while a step runs they are the views of its first `hi` slots and the step's source width.
    A beam request's beams hold one copy, in its first slot: while a step runs beside such a group (`index`: each
    slot's holder, where one differs from the slot) the step's keys and values are gathered from the holders, one
    layer at a time (a copy of that layer's, for the step), where each beam held a copy for the request's life: a
    request of B beams holds 1/B of the cross-attention memory it held, and a step beside beam groups costs the
    gather (the embedded T5, 8 rows and two 4-beam groups in 16 slots, 1 thread, 40 steps a run, 6 runs each way
    alternating, 2026-12-07: a step's median 3.1 ms against 3.0 with a copy per beam, runs spread 2.9-4.4)."""

    def __init__(self, slots: int):
        super().__init__(slots)
        self.view = None
        self.index: torch.Tensor | None = None  # each of the step's slots' holder, where a beam reads another's
        self.fill: dict[int, int] | None = None  # slot -> source length, of rows whose first step this is

    def _read(self, stored):
        if self.view is None or stored is None:
            return stored
        if self.index is not None:
            return stored[self.index, :, :self.view[1]]
        return stored[:self.view[0], :, :self.view[1]]

    @property
    def keys(self):
        return self._read(self._keys)

    @keys.setter
    def keys(self, value):
        self._keys = value

    @property
    def values(self):
        return self._read(self._values)

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


# a prefilled layer's kind (`layer_kind`) -> the slot layer that holds it
KINDS = {"attention": SlotLayer, "state": SlotStateLayer, "hybrid": SlotHybridLayer}


def layer_kind(layer) -> str | None:
    """What a layer of transformers' cache keeps, as this cache holds it: "attention" (plain keys and values of every
    past position), "state" (a linear-attention layer's states), "hybrid" (both), "none" (a layer that keeps nothing:
    NemotronH's MLP layers); None: a kind not held per row."""
    if type(layer) is DynamicLayer:
        return "attention"
    if type(layer) is LinearAttentionLayer:
        return "state"
    if type(layer) is LinearAttentionAndFullAttentionLayer:
        return "hybrid"
    if type(layer) is DummyLayer:
        return "none"
    return None


class SlotCache(Cache):
    """A slot layer for each layer of the model (`kinds`: each layer's `layer_kind`, or a number of attention layers),
    and the plan of the step being run."""

    def __init__(self, kinds: int | list[str], slots: int, cross: bool = False):
        kinds = ["attention"] * kinds if isinstance(kinds, int) else list(kinds)
        layers = [DummyLayer() if kind == "none" else KINDS[kind](slots) for kind in kinds]
        super().__init__(layers=layers)
        self.slots = slots
        self.attention = [each for each in layers if isinstance(each, SlotLayer)]  # keys and values
        self.states = [each for each in layers if isinstance(each, SlotStateLayer)]  # states (a hybrid's in both)
        self.cross = Cache(layers=[CrossSlotLayer(slots) for _ in range(len(layers))]) if cross else None
        self.sources = [1] * slots  # each slot's source length (an encoder-decoder's)
        self.holder = list(range(slots))  # the slot whose cross-attention keys each slot reads (a beam: its first's)

    def write_prompt(self, slot: int, prefilled: Cache, row: int, length: int, source: int = 0,
                     offset: int = 0, holder: int | None = None) -> None:
        """Row `row` of a prefill (its `length` positions from `offset`: a packed prefill's rows follow each other in
        one sequence; an encoder-decoder's first `source` source positions of its cross-attention) into `slot`;
        `holder`: a slot that holds the same cross-attention keys already (a beam's first), read instead of a copy."""
        own = prefilled.self_attention_cache if self.cross is not None else prefilled
        for mine, theirs in zip(self.layers, own.layers):
            if isinstance(mine, SlotLayer):
                mine.write_prompt(slot, theirs.keys[row:row + 1, :, offset:offset + length],
                                  theirs.values[row:row + 1, :, offset:offset + length])
            if isinstance(mine, SlotStateLayer):
                mine.write_state(slot, theirs, row)
        if self.cross is not None:
            self.sources[slot] = source
            self.holder[slot] = slot if holder is None else holder
            if holder is None:
                for mine, theirs in zip(self.cross.layers, prefilled.cross_attention_cache.layers):
                    mine.write_prompt(slot, theirs.keys[row:row + 1, :, :source],
                                      theirs.values[row:row + 1, :, :source])

    def shrink(self) -> None:
        """Every layer back to its first width (16 columns), contents dropped: for when no row is held."""
        for each in (*self.attention, *(self.cross.layers if self.cross is not None else ())):
            if each.is_initialized and each.width() > 16:
                keys, values = each.keys, each.values
                each.keys = keys.new_zeros((*keys.shape[:2], 16, keys.shape[3]))
                each.values = values.new_zeros((*values.shape[:2], 16, values.shape[3]))

    def write_cross(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]], source: int) -> None:
        """A joining row's cross-attention keys and values (each layer's `[1, heads, width >= source, dim]`, projected
        from its encoder output) into `slot`, its first `source` positions."""
        self.sources[slot], self.holder[slot] = source, slot
        for mine, (keys, values) in zip(self.cross.layers, layers):
            mine.write_prompt(slot, keys[:, :, :source], values[:, :, :source])

    def reorder(self, slots: list[int], sources: list[int]) -> None:
        """Beam search's reorder within one request: slot slots[i] continues the self-attention past of sources[i]
        (a copy of the group's own slots, keys and states; its cross-attention is the same in every beam)."""
        if slots != sources:
            into, come = torch.tensor(slots), torch.tensor(sources)
            for each in self.attention:
                each.keys[into] = each.keys[come]
                each.values[into] = each.values[come]
            for each in self.states:
                each.reorder(into, come)

    def join(self, sources: dict[int, int]) -> None:
        """Rows whose first decoder step is the next (slot -> source length): their cross-attention keys are written
        by that step (`CrossSlotLayer.update`)."""
        for slot, length in sources.items():
            self.sources[slot], self.holder[slot] = length, slot
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
        shared = self.holder[:hi] != list(range(hi))
        index = torch.tensor(self.holder[:hi], device=self.attention[0].keys.device) if shared else None
        for each in self.cross.layers:
            each.view, each.index = (hi, width), index
        lengths = torch.tensor(self.sources[:hi], device=self.attention[0].keys.device)
        return (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).long()

    def decode(self, positions: dict[int, int], window: int | None = None, hi: int | None = None,
               fixed: bool = False, held=None) -> tuple:
        """Plan a step over slots 0..hi-1 (hi: the highest slot in `positions`, + 1, unless given), slot s writing at
        `positions[s]`; returns the step's `position_ids` (`[hi, 1]`) and additive 4D mask (`[hi, 1, 1, width]`: 0 on
        each row's own past and new token, the dtype's lowest elsewhere; a slot not decoding sees its column 0 only,
        so no row of the softmax is empty, and its output is not used); and, with a sliding `window`, the mask of the
        sliding layers, which also hides what lies `window` or more positions back (transformers' sliding overlay: a
        key at k is seen from q when q - window < k <= q; the keys themselves are all kept), else None. `fixed`: the
        step's width is the cache's whole width (grown first where a row needs it), so that with a fixed `hi` the
        step's shapes change only when the cache grows (log2 times), as CUDA graphs and `torch.compile` need.
        State layers run over the same slots; those of `held`'s slots (default: every slot) below `hi` that do not
        decode are put back after the step (`done`). A model with no attention layer is given no mask (None, None)."""
        hi, width = (max(positions) + 1 if hi is None else hi), max(positions.values()) + 1
        if fixed and self.attention:
            for each in self.attention:
                each.grow(width)
            width = self.attention[0].width()
        if self.states:
            keep = [s for s in range(hi) if s not in positions and (held is None or s in held)]
            for each in self.states:
                each.begin(hi, keep, width - 1)
        if not self.attention:
            device = self.states[0].device
            return torch.tensor([positions.get(s, 0) for s in range(hi)], device=device)[:, None], None, None
        layer = self.attention[0]
        device, dtype = layer.keys.device, layer.keys.dtype
        slots = torch.tensor(sorted(positions), device=device)
        pos = torch.tensor([positions[s] for s in sorted(positions)], device=device)
        plan = (slots, pos, hi, width, len(positions) == hi)
        for each in self.attention:
            each.plan = plan
        every = torch.zeros(hi, dtype=torch.long, device=device).index_copy(0, slots, pos)
        columns = torch.arange(width, device=device)
        seen = columns[None, :] <= every[:, None]
        masks = [seen] if window is None else [seen, seen & (columns[None, :] > every[:, None] - window)]
        masks = [torch.where(m, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :] for m in masks]
        return every[:, None], masks[0], (masks[1] if window is not None else None)

    def tokens(self, places: list[tuple[int, int]], hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Plan a step of tokens in one sequence (`places`: each token's (slot, position)): rows admitted in the step
        (their prompts, from position 0) beside the running rows' next tokens, one forward for both (vLLM's step
        shape). Returns the step's `position_ids` (`[1, tokens]`) and additive 4D mask (`[1, 1, tokens, hi x
        width]`: a token sees its own slot's columns up to its position). Attention layers only (`flat`)."""
        layer = self.attention[0]
        device, dtype = layer.keys.device, layer.keys.dtype
        slots = torch.tensor([slot for slot, _ in places], device=device)
        positions = torch.tensor([position for _, position in places], device=device)
        width = int(positions.max()) + 1
        for each in self.attention:
            each.flat = (slots, positions, hi, width)
        columns = torch.arange(hi * width, device=device)
        seen = (columns[None, :] // width == slots[:, None]) & (columns[None, :] % width <= positions[:, None])
        mask = torch.where(seen, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]
        return positions[None], mask

    def done(self) -> None:
        for each in self.attention:
            each.plan, each.flat = None, None
        for each in self.states:
            each.end()
        for each in self.cross.layers if self.cross is not None else ():
            each.view, each.fill, each.index = None, None, None


def check_layers(prefilled: Cache) -> str | None:
    """Why a model's cache cannot be held a slot per row (None: it can), naming the first layer that cannot: each
    layer (an encoder-decoder's self- and cross-attention alike) must be one `layer_kind` knows: transformers'
    plain `DynamicLayer` (keys and values of every past position, 4D), a `LinearAttentionLayer` (states), both in one
    layer, or a layer that keeps nothing."""
    from transformers import EncoderDecoderCache

    if isinstance(prefilled, EncoderDecoderCache):
        if any(layer_kind(each) not in ("attention", None) for each in prefilled.self_attention_cache.layers):
            return "its decoder keeps states beside a cross-attention: not held per row"
        layers = [*prefilled.self_attention_cache.layers, *prefilled.cross_attention_cache.layers]
    else:
        layers = prefilled.layers
    for i, layer in enumerate(layers):
        kind = layer_kind(layer)
        if kind is None:
            return (f"its layer {i} keeps a {type(layer).__name__}, not keys and values of every position nor a "
                    f"linear-attention state")
        if kind in ("attention", "hybrid") and (layer.keys is None or layer.keys.dim() != 4):
            return f"its layer {i} keeps no 4D keys"
    return None


def layer_kinds(prefilled: Cache) -> list[str]:
    """Each layer's `layer_kind` (of a cache `check_layers` passed)."""
    own = getattr(prefilled, "self_attention_cache", prefilled)
    return [layer_kind(each) for each in own.layers]


def state_layers(model) -> bool:
    """Whether the model's cache, as transformers builds it from its config, keeps a state-space or linear-attention
    state in some layer."""
    from transformers import DynamicCache

    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001 - a config transformers cannot build a cache from: its prefill's cache decides
        return False
    return any(isinstance(each, LinearAttentionCacheLayerMixin) for each in layers)
