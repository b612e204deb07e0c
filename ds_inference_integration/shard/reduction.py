"""`--reduce_dtype fp32`: in half precision, each row-parallel layer's partial product is kept in fp32, the ranks'
partials are summed in fp32, and the sum is rounded to the model's dtype once.

Without it each rank rounds its partial product to bf16/fp16 before the all-reduce, so a tp-N layer rounds N
times where one device rounds once: the outputs of a correct split part from one device wherever the model's top
choices are that close (README, "What "the same" means"). With it the sharded layer rounds once, as one device
does; what is left is the order of the fp32 additions. The partial product in fp32 is `torch.mm(..., out_dtype=
torch.float32)` on CUDA (the bf16/fp16 kernel's own fp32 accumulator, no copy of the weight); on CPU, where that
kernel does not exist (torch 2.13: "Could not run 'aten::mm.dtype' ... 'CPU' backend"), the input and this
rank's weight are upcast for the product. The figures and the cost are in the README.

The layers: DeepSpeed's `LinearAllreduce` and `LmHeadLinearAllreduce` (their forward rewritten here with the same
slicing and bias), our `mixers.RowShard`, and the packed experts' all-reduced output (summed in fp32; the experts'
own products stay in the model's dtype).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..arguments import REDUCE_DTYPES  # noqa: F401  (the flag's values, with the flags)


def partial_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T with an fp32 result."""
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        flat = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        return flat.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x.float(), weight.float())


def _row_parallel_in_fp32(module: nn.Module, group, lm_head: bool):
    from deepspeed import comm as dist

    def forward(input: torch.Tensor) -> torch.Tensor:
        if lm_head:  # DeepSpeed's LmHeadLinearAllreduce: this rank's columns of the input, as its own forward cuts
            sizes = module._partition_sizes
            start = sum(sizes[:module.tp_index])
            input = input[..., start:start + sizes[module.tp_index]]
        out = partial_product(input, module.weight)
        dist.inference_all_reduce(out, group=group)
        out = out.to(input.dtype)
        return out if module.bias is None else out + module.bias

    return forward


def reduce_in_fp32(model: nn.Module) -> int:
    """Make every row-parallel layer of the sharded `model` sum in fp32 (see the module's docstring); returns how
    many layers it changed. Only meaningful in fp16/bf16; in fp32 the caller leaves it off."""
    from deepspeed.module_inject.layers import LinearAllreduce, LmHeadLinearAllreduce

    from .mixers import RowShard

    changed = 0
    for module in model.modules():
        if isinstance(module, LinearAllreduce):
            module.forward = _row_parallel_in_fp32(module, module.mp_group, isinstance(module, LmHeadLinearAllreduce))
        elif isinstance(module, RowShard):
            module.forward = _row_parallel_in_fp32(module, module.group, False)
        elif hasattr(module, "all_reduce_dtype"):  # experts.split_experts: the output hook reads it
            module.all_reduce_dtype = torch.float32
        else:
            continue
        changed += 1
    return changed
