"""Reading a layer's behaviour where its names say nothing: the layer run on one token, on the CPU, whatever device
its parameters are on (a skeleton's are on `meta`: nothing is read or allocated at their size).

* `Probe.layer_inputs`: the model's own forward, run until it calls the layer, gives the layer's inputs (masks,
  rotary tables and biases as the model makes them). Every op that reads a large `meta` tensor is run on `meta` for
  its output's shape and answered with a seeded random CPU tensor of that shape (`MetaSafe`): a linear, an embedding
  or an expert's matrices cost what their output does, one token's worth; a small one (a norm's weight) stands as
  ones. It all runs on a twin of the model whose parameters are on `meta` (`Probe.model`), whatever the model's are.
* `Probe.flow`: where each linear's input comes from: the layer's inputs, other linears (tags follow every op; a
  linear's output is tagged by the linear alone), and attention products (two activations multiplied: q . k and
  probabilities . v). The layer's output tells which linears write back into what it returns.
* `Probe.heads`: which output rows of a linear become which head's query, key and value: the linear answers the
  index of each of its rows (+1), and the attention products' operands, read at position 0 where rotary tables
  are the identity, give those indices back per head (a scale on a head's query or key divides out).
* `Probe.split`, `Probe.rank_inputs`: a rank's split simulated before it is made: the linears' shapes and the
  attributes a rank would hold, the layer's per-head inputs cut to its heads; `layouts.py` asks whether the products
  then read this rank's heads.
* `Probe.pairs_halves`, `Probe.biases`, `Probe.head_inputs`: whether a linear's two halves are read apart and paired
  row by row (a packed [gate | up]); which modules outside the layers make what the attention adds after its scores,
  and which of a layer's inputs hold such a bias for every head.

Deterministic (seeded, CPU, fp32), so every rank derives the same policy."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ..configs import text_config
from ..schema import is_linear

# two activations multiplied: the attention scores (q . k) and what they weigh (probabilities . v)
PRODUCTS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.baddbmm,
            torch.Tensor.baddbmm, torch.einsum, F.scaled_dot_product_attention}
INPUT, ATTENTION = "input", "attention"


class _Reached(Exception):
    def __init__(self, args, kwargs):
        super().__init__()
        self.call = (args, kwargs)


def _cpu(value):
    if isinstance(value, torch.device) and value.type == "meta" or value == "meta":
        return torch.device("cpu")
    return value


# a meta tensor this small (a norm's weight, a bias) is made real, of ones, where an op reads it: values then flow
# through it as through a norm with unit weights (a per-head norm on the query scales each head, which `decode` reads)
SMALL = 1 << 16


class MetaSafe(TorchFunctionMode):
    """Ops on `meta` tensors answered on the CPU: where each meta tensor an op reads is small (`SMALL`), the op runs on
    a real tensor of ones in its place (zeros for integers; the same one each time); else it runs on meta for the
    output's shape, answered with a seeded random tensor of that shape. A tensor asked for on `meta` is made on the
    CPU."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)
        self._ones: dict[int, tuple] = {}

    def _stand_in(self, t):
        if not (isinstance(t, torch.Tensor) and t.is_meta):
            return t
        if id(t) not in self._ones:
            fill = torch.ones if t.is_floating_point() else torch.zeros
            self._ones[id(t)] = (t, fill(t.shape, dtype=t.dtype))  # (the meta tensor kept: its id stays its own)
        return self._ones[id(t)][1]

    def _real(self, t):
        if isinstance(t, torch.Tensor) and t.is_meta:
            if t.is_floating_point():
                return torch.randn(t.shape, generator=self.generator, dtype=t.dtype)
            return torch.zeros(t.shape, dtype=t.dtype)
        return t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_cpu(a) for a in args)
        flat, _ = tree_flatten((args, kwargs))
        metas = [t for t in flat if isinstance(t, torch.Tensor) and t.is_meta]
        if metas and all(t.numel() <= SMALL for t in metas):
            args, kwargs = tree_map(self._stand_in, (args, kwargs))
            return func(*args, **kwargs)
        if metas:
            on_meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*on_meta[0], **on_meta[1])
            return tree_map(self._real, out)
        return func(*args, **kwargs)


class _Flow(MetaSafe):
    """`MetaSafe` that tags tensors with where they came from (by id, the tensors kept alive while it runs)."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.tags: dict[int, frozenset] = {}
        self.kept: list = []
        self.products: list[tuple[list[torch.Tensor], list[frozenset]]] = []

    def tag(self, t, tags) -> None:
        if isinstance(t, torch.Tensor):
            self.tags[id(t)] = frozenset(tags)
            self.kept.append(t)

    def of(self, t) -> frozenset:
        return self.tags.get(id(t), frozenset()) if isinstance(t, torch.Tensor) else frozenset()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = super().__torch_function__(func, types, args, kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        tags = frozenset().union(*(self.of(t) for t in tensors))
        if func in PRODUCTS and sum(bool(self.of(t) - {INPUT}) for t in tensors) >= 2:
            self.products.append((tensors, [self.of(t) for t in tensors]))
            tags |= {ATTENTION}
        if tags:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.tags[id(o)] = self.of(o) | tags
                    self.kept.append(o)
            name = getattr(func, "__name__", "")
            if args and isinstance(args[0], torch.Tensor) and (name == "__setitem__" or name.endswith("_")
                                                               and not name.endswith("__")):
                self.tags[id(args[0])] = self.of(args[0]) | tags  # in place: the tensor written holds both
        return out


def _linears(layer: nn.Module) -> dict[str, nn.Module]:
    return {p: m for p, m in layer.named_modules() if p and is_linear(m)}


def out_features(linear: nn.Module) -> int:
    return linear.weight.shape[1] if type(linear).__name__ == "Conv1D" else linear.weight.shape[0]


@dataclass
class LayerFlow:
    """Where each linear of a layer reads from (`sources`: linear paths, INPUT, ATTENTION), which linears write into
    what the layer returns (`ends`), and which linears' outputs reach an attention product (`attention`)."""

    sources: dict[str, frozenset]
    ends: frozenset
    attention: frozenset
    # the linears whose outputs reach both operands of an attention's scores (q . k): a fused query and key
    scores_both: frozenset = frozenset()

    def row_parallel(self) -> list[str]:
        """The linears that write back into what the layer returns from what linears of the layer computed (not
        from its input alone): an attention's output projection, an MLP's last linear."""
        return sorted(p for p in self.ends if (self.sources.get(p, frozenset()) - {INPUT, ATTENTION}) - self.ends)


@dataclass
class HeadRows:
    """Which output rows of a linear each head reads: `q[h]` the rows of query head h, `k[h]` / `v[h]` those of the key
    and value query head h is scored against and reads (a key/value head repeated for the query heads of its group),
    each a list of row indices; a role the linear does not hold is absent."""

    size: int
    q: list[list[int]] = field(default_factory=list)
    k: list[list[int]] = field(default_factory=list)
    v: list[list[int]] = field(default_factory=list)

    def kv_heads(self) -> list[list[int]]:
        """The distinct key heads in the order the query heads reach them."""
        return list({tuple(r): r for r in self.k}.values())


def decode(t: torch.Tensor, size: int) -> list[list[int]] | None:
    """The row indices an operand of a product holds, one list per head ([..., head_dim] or, transposed, [..., head_dim,
    1]): within each head, values s x (index + 1) for a constant s (a scale on the query; a norm over each head's
    features, as RMS norms on the query and key are, gives each head its own). None where they are not such values
    (a norm that centres them, a sum of several linears)."""
    d = t.shape[-1] if t.shape[-1] > 1 else t.shape[-2]
    v = t.detach().double().reshape(-1)
    if v.numel() % d or (v <= 0).any():
        return None
    heads = []
    for block in v.reshape(-1, d):
        u = torch.unique(block)
        if len(u) < 2:
            return None
        s = float((u[1:] - u[:-1]).min())
        for _ in range(3):  # least squares on the nearest integers: the rounding of the scaled values averages out
            n = torch.round(block / s)
            if (n <= 0).any():
                return None
            s = float((block * n).sum() / (n * n).sum())
        r = block / s
        index = torch.round(r)
        if (r - index).abs().max() > 0.05:
            return None
        index = index.long() - 1
        if index.min() < 0 or index.max() >= size:
            return None
        heads.append(index.tolist())
    return heads


class Probe:
    """The probes of one model, run when first asked and kept (one forward to each layer kind's first call, one layer
    run per question)."""

    def __init__(self, model: nn.Module):
        self.original = model
        self._twin: nn.Module | None = None
        self._paths = {id(m): name for name, m in model.named_modules()}
        self.failure: str | None = None
        self._inputs: dict[int, tuple | None] = {}
        self._flows: dict[int, LayerFlow | None] = {}
        self._heads: dict[tuple, HeadRows | None] = {}

    @property
    def model(self) -> nn.Module:
        """A twin of the model the probes run: its parameters on meta, everything else copied. A model's forward can
        change the model (BigBird rebuilds its attention for an input shorter than its blocks; Baichuan makes its
        ALiBi mask on its first run): the model derived from is never run."""
        if self._twin is None:
            import copy

            memo = {id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)
                    for p in self.original.parameters()}
            # an object a module holds in a public attribute (a skeleton's pending load, with its open checkpoint; a
            # config) is the twin's too, not copied: some cannot be (safetensors' handles)
            for module in self.original.modules():
                for name, value in vars(module).items():
                    if not name.startswith("_") and not isinstance(value, (torch.Tensor, nn.Module, int, float, str,
                                                                            bool, type(None))):
                        memo.setdefault(id(value), value)
            self._twin = copy.deepcopy(self.original, memo)
        return self._twin

    def twin(self, module: nn.Module) -> nn.Module:
        """The twin's module at the path `module` has in the model derived from (the same one, if it is the twin's)."""
        path = self._paths.get(id(module))
        return module if path is None else self.model.get_submodule(path)

    def _model_inputs(self) -> dict | None:
        config = self.model.config
        from ..verify import SPEECH_INPUTS, main_input_name

        if main_input_name(self.model) in SPEECH_INPUTS:
            return None  # a speech encoder's input: its text layers only are probed through text
        vocab = getattr(text_config(config), "vocab_size", None) or 8
        token = torch.tensor([[min(5, vocab - 1)]])
        inputs = {"input_ids": token, "attention_mask": torch.ones_like(token), "use_cache": False}
        if getattr(config, "is_encoder_decoder", False):
            start = getattr(config, "decoder_start_token_id", None)
            inputs["decoder_input_ids"] = torch.tensor([[start if isinstance(start, int) else 0]])
        return inputs

    def layer_inputs(self, layer: nn.Module) -> tuple | None:
        """(args, kwargs) of the layer's first call in the model's forward on one token (position 0), or None."""
        layer = self.twin(layer)
        if id(layer) not in self._inputs:
            self._inputs[id(layer)] = self._run_until(layer)
        return self._inputs[id(layer)]

    def _run_until(self, layer: nn.Module) -> tuple | None:
        inputs = self._model_inputs()
        if inputs is None:
            return None

        def reached(module, args, kwargs):
            raise _Reached(args, kwargs)

        handle = layer.register_forward_pre_hook(reached, with_kwargs=True)
        try:
            # as generate calls it, then with the positions a model's forward may not make itself (its own
            # `prepare_inputs_for_generation` does: ChatGLM-6B's, among published remote code)
            failed = None
            for given in (inputs, {**inputs, "position_ids": torch.zeros_like(inputs["input_ids"])}):
                try:
                    with torch.no_grad(), MetaSafe():
                        self.model(**given)
                except _Reached as r:
                    return r.call
                except Exception as e:  # noqa: BLE001 (whatever the model's own code raises: the probe is not run)
                    failed = failed or e
        finally:
            handle.remove()
        if failed is not None:
            from ...errors import first_line

            self.failure = f"{type(failed).__name__}: {first_line(failed)[:160]}"
        return None

    def _run(self, layer: nn.Module, answers: dict[str, torch.Tensor] | None = None, inputs: tuple | None = None
             ) -> tuple[_Flow, object, dict, dict]:
        """The layer on its inputs (or `inputs`: (args, kwargs)) under `_Flow`; each linear in `answers` returns those
        values (one per output row, the same at every position). Returns the mode, the layer's output, each linear's
        input tags and its input."""
        layer = self.twin(layer)
        args, kwargs = inputs or self.layer_inputs(layer)
        mode = _Flow()
        sources: dict[str, frozenset] = {}
        seen: dict[str, torch.Tensor] = {}
        handles = []
        for path, linear in _linears(layer).items():
            def before(module, a, path=path):
                sources.setdefault(path, mode.of(a[0]))
                seen.setdefault(path, a[0])

            def after(module, a, out, path=path):
                if answers and path in answers:
                    out = answers[path].to(out.dtype).expand(*out.shape[:-1], answers[path].shape[0]).clone()
                mode.tag(out, {path})
                return out

            handles += [linear.register_forward_pre_hook(before), linear.register_forward_hook(after)]
        try:
            with torch.no_grad(), mode:
                for value in (*args, *kwargs.values()):
                    mode.tag(value, {INPUT})
                out = layer(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        return mode, out, sources, seen

    def biases(self, layer: nn.Module, candidates: list[str]) -> set[str]:
        """Which of the modules at `candidates` (paths from the model) make something the layer's attention adds
        after its scores: their output reaches what the attention's output projection reads, and no operand of the
        attention products (a rotary table does, through the query and key)."""
        inputs = self._model_inputs()
        if inputs is None or not candidates:
            return set()
        layer = self.twin(layer)
        mode = _Flow()
        read: set[str] = set()

        class Done(Exception):
            pass

        def tagging(path):
            def after(module, args, out):
                for o in tree_flatten(out)[0]:
                    mode.tag(o, mode.of(o) | {path})
            return after

        def finished(module, args, out):
            raise Done

        handles = [layer.register_forward_hook(finished)]
        handles += [self.model.get_submodule(p).register_forward_hook(tagging(p)) for p in candidates]
        for linear in _linears(layer).values():
            handles.append(linear.register_forward_pre_hook(lambda module, a: read.update(mode.of(a[0]))))
        try:
            with torch.no_grad(), mode:
                self.model(**inputs)
        except Done:
            pass
        except Exception:  # noqa: BLE001
            return set()
        finally:
            for h in handles:
                h.remove()
        operands = {t for _, tags in mode.products for tag in tags for t in tag}
        return {p for p in candidates if p in read and p not in operands}

    def head_inputs(self, layer: nn.Module, heads: int) -> dict[str, int]:
        """The layer's inputs (keyword name, or positional index as text) holding one entry per head on an axis (as a
        negative index) that its attention adds after its scores: they reach what its output projection reads and
        no operand of the attention products (a rotary table reaches the query and the key)."""
        layer = self.twin(layer)
        call = self.layer_inputs(layer)
        if call is None or heads < 2:
            return {}
        args, kwargs = call
        candidates = {}
        for key, value in [*((str(i), a) for i, a in enumerate(args) if i), *kwargs.items()]:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                axis = next((i for i, n in enumerate(value.shape) if n == heads), None)
                if axis is not None:
                    candidates[key] = (value, axis - value.ndim)
        if not candidates:
            return {}
        mode = _Flow()
        read: set = set()
        handles = [linear.register_forward_pre_hook(lambda module, a: read.update(mode.of(a[0])))
                   for linear in _linears(layer).values()]
        try:
            with torch.no_grad(), mode:
                for key, (value, _) in candidates.items():
                    mode.tag(value, {f"input {key}"})
                layer(*args, **kwargs)
        except Exception:  # noqa: BLE001 (the model's own code on the probe's stand-ins)
            return {}
        finally:
            for h in handles:
                h.remove()
        operands = {t for _, tags in mode.products for tag in tags for t in tag}
        return {key: axis for key, (_, axis) in candidates.items()
                if f"input {key}" in read and f"input {key}" not in operands}

    def flow(self, layer: nn.Module) -> LayerFlow | None:
        """The layer's `LayerFlow`, or None where it could not be run."""
        layer = self.twin(layer)
        if id(layer) not in self._flows:
            self._flows[id(layer)] = None
            if self.layer_inputs(layer) is not None:
                try:
                    mode, out, sources, _ = self._run(layer)
                except Exception as e:  # noqa: BLE001
                    from ...errors import first_line

                    self.failure = f"{type(e).__name__}: {first_line(e)[:160]}"
                else:
                    first = out[0] if isinstance(out, (tuple, list)) else out
                    fed = {t for _, tags in mode.products for tg in tags for t in tg} - {INPUT, ATTENTION}
                    both = set()
                    for _, tags in mode.products:
                        operands = [t - {INPUT} for t in tags if t - {INPUT}]
                        if len(operands) >= 2 and ATTENTION not in operands[0]:
                            both |= operands[0] & operands[1]
                    self._flows[id(layer)] = LayerFlow(sources, frozenset(mode.of(first) - {INPUT, ATTENTION}),
                                                       frozenset(fed), frozenset(both))
        return self._flows[id(layer)]

    def heads(self, layer: nn.Module, paths: str | tuple[str, ...], rows: list[int] | None = None,
              inputs: tuple | None = None, sizes: list[int] | None = None) -> HeadRows | None:
        """Which output rows of the linears at `paths` each head reads (`HeadRows`), the rows of several linears
        numbered as if their outputs were concatenated in that order (separate query, key and value projections
        read as one [Q | K | V]): each linear answers the indices of its rows. With `rows` (indices in that
        numbering, the linears' full widths `sizes`), each linear holds only those of its rows (a split simulated),
        in that order, on `inputs`."""
        layer = self.twin(layer)
        paths = (paths,) if isinstance(paths, str) else tuple(paths)
        key = (id(layer), paths)
        if rows is None and key in self._heads:
            return self._heads[key]
        sizes = list(sizes) if sizes else [out_features(layer.get_submodule(p)) for p in paths]
        starts = [sum(sizes[:i]) for i in range(len(paths))]
        size = sum(sizes)
        wanted = rows if rows is not None else list(range(size))
        answers = {p: torch.tensor([r for r in wanted if a <= r < a + n], dtype=torch.float64) + 1
                   for p, a, n in zip(paths, starts, sizes)}
        found = None
        if self.layer_inputs(layer) is not None:
            try:
                found = self._heads_from(self._run(layer, answers, inputs)[0], set(paths), size)
            except Exception:  # noqa: BLE001 (a split simulated that the module's code refuses)
                found = None
        if rows is None:
            self._heads[key] = found
        return found

    def _heads_from(self, mode: _Flow, paths: set[str], size: int) -> HeadRows | None:
        found = HeadRows(size)
        for tensors, tags in mode.products:
            operands = [(t, tag) for t, tag in zip(tensors, tags) if tag - {INPUT}]  # not baddbmm's buffer
            scores = ATTENTION not in operands[0][1]  # q . k; else probabilities . v
            for i, (t, tag) in enumerate(operands[:2]):
                role = ("q" if i == 0 else "k") if scores else ("v" if i == 1 else None)
                read = tag - {INPUT}
                if role and len(read) == 1 and read <= paths and not getattr(found, role):
                    decoded = decode(t, size)
                    if decoded is None:
                        return None
                    setattr(found, role, decoded)
        return found if (found.q or found.k or found.v) else None

    def pairs_halves(self, layer: nn.Module, path: str, reader: str) -> bool:
        """Whether the linear at `reader` reads `path`'s output as two halves paired row by row, one of them through
        an activation (x * act(gate), act(gate) * up): `path` answering [its row indices | ones], or [ones | its row
        indices], makes `reader`'s input proportional to the row indices of the half that is not activated."""
        layer = self.twin(layer)
        size = out_features(layer.get_submodule(path))
        if size % 2 or self.layer_inputs(layer) is None:
            return False
        half = torch.arange(1, size // 2 + 1, dtype=torch.float64)
        for answer in (torch.cat([half, torch.ones_like(half)]), torch.cat([torch.ones_like(half), half])):
            try:
                seen = self._run(layer, {path: answer})[3]
            except Exception:  # noqa: BLE001
                return False
            x = seen.get(reader)
            if x is None or x.shape[-1] != size // 2:
                continue
            row = x.detach().double().reshape(-1, size // 2)[0]
            if row[0] != 0 and torch.allclose(row / row[0], half, rtol=1e-4):
                return True
        return False

    def rank_inputs(self, layer: nn.Module, heads: int, mine: range) -> tuple:
        """The layer's inputs as a rank gets them: each tensor but the first (the hidden states) with one entry per
        head on an axis cut to this rank's heads (an ALiBi bias made outside the layer, which DeepSpeed or a
        policy's `head_biases` cuts so: BLOOM's, MPT's, JAIS's)."""
        args, kwargs = self.layer_inputs(layer)

        def cut(value):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and heads > 1:
                axis = next((i for i, n in enumerate(value.shape) if n == heads), None)
                if axis is not None:
                    return value.narrow(axis, mine.start, len(mine))
            return value

        return (args[:1] + tuple(cut(a) for a in args[1:]), {k: cut(v) for k, v in kwargs.items()})

    @contextlib.contextmanager
    def split(self, layer: nn.Module, shapes: dict[str, tuple[int, int]], values: dict[tuple[nn.Module, str], object]):
        """While open: the linears at `shapes` hold weights of those shapes ([out, in], on meta) and each attribute
        in `values` ((module, name) -> value; a name "config.X" sets X on a copy of the module's config) holds its
        value: a rank's split, simulated; put back after."""
        layer = self.twin(layer)
        values = {(self.twin(module), name): value for (module, name), value in values.items()}
        saved_weights = []
        saved_values = []
        try:
            for path, (out, inp) in shapes.items():
                linear = layer.get_submodule(path)
                saved_weights.append((linear, linear._parameters.get("weight"), linear._parameters.get("bias")))
                linear._parameters["weight"] = nn.Parameter(torch.empty(out, inp, device="meta"), requires_grad=False)
                if linear._parameters.get("bias") is not None:
                    linear._parameters["bias"] = nn.Parameter(torch.empty(out, device="meta"), requires_grad=False)
            for (module, name), value in values.items():
                owner, attr = module, name
                if name.startswith("config."):
                    saved_values.append((module, "config", module.__dict__.get("config", module.config)))
                    import copy

                    module.config = copy.copy(module.config)
                    owner, attr = module.config, name.removeprefix("config.")
                before = getattr(owner, attr)
                setattr(owner, attr, value)  # a property without a setter raises here, before it is saved
                saved_values.append((owner, attr, before))
            yield
        finally:
            for owner, attr, value in reversed(saved_values):
                setattr(owner, attr, value)
            for linear, weight, bias in saved_weights:
                linear._parameters["weight"] = weight
                if bias is not None:
                    linear._parameters["bias"] = bias


ACTIVE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar("ds_inference_probe", default=None)


@contextlib.contextmanager
def probing(model: nn.Module):
    """While open, `active()` is a `Probe` of `model` (the derivation's mechanisms read it where names say nothing)."""
    token = ACTIVE.set(Probe(model))
    try:
        yield ACTIVE.get()
    finally:
        ACTIVE.reset(token)


def active() -> Probe | None:
    return ACTIVE.get()
