"""State-space, linear-attention and convolution mixers split by their heads or channels (`shard/mixers.py`), in this process:
each rank a thread holding its own split copy of one zoo model's mixer, DeepSpeed's inference all-reduce replaced by
one that sums the threads' tensors in rank order. Every rank's output must be the whole mixer's. Through real ranks,
both loading paths and generation with the cache, the same layouts are `policy check`'s (`test_policies_tp.py`,
`policy matrix` at tp 2 and 4)."""

import copy
import threading

import pytest
import torch

from conftest import assert_close_up_to_rounding, rounding_ratio
from ds_inference_integration import InferenceSetupError
from ds_inference_integration.load.skeleton import model_class_for
from ds_inference_integration.policy.kinds import is_ssm_mixer, ssm_layout
from ds_inference_integration.shard.mixers import split_ssm_mixer, ssm_mixers
from ds_inference_integration.tools.architecture_zoo import ZOO


class ThreadRanks:
    """A TP group of threads: `all_reduce` sums every rank's tensor in rank order and gives each rank the sum."""

    def __init__(self, size: int):
        self.size, self.barrier, self.slots = size, threading.Barrier(size, timeout=30), [None] * size
        self.calls = 0

    def handle(self, rank: int) -> tuple:
        return (self, rank)

    @staticmethod
    def all_reduce(tensor, op=None, group=None, **kwargs):
        ranks, rank = group
        ranks.slots[rank] = tensor.clone()
        ranks.barrier.wait()
        total = sum(ranks.slots[1:], ranks.slots[0].clone())
        ranks.barrier.wait()
        if rank == 0:
            ranks.calls += 1
        tensor.copy_(total)
        return tensor


def first_mixer(name, layout=None):
    config = ZOO[name]()
    torch.manual_seed(0)
    model = model_class_for(config).from_config(config).eval()
    mixer = next(m for m in model.modules() if is_ssm_mixer(m) and layout in (None, ssm_layout(m)))
    return mixer, config.get_text_config().hidden_size


def call(mixer, x):
    if hasattr(mixer, "slope_rate"):  # a lightning attention's signature: (hidden, position_embeddings, mask) -> (out, state)
        return mixer(x, None, None)[0]
    return mixer(x)


def run_ranks(mixer, tp, x, monkeypatch):
    from deepspeed import comm

    ranks = ThreadRanks(tp)
    monkeypatch.setattr(comm, "inference_all_reduce", ThreadRanks.all_reduce)
    outputs, errors = [None] * tp, []
    shards = []
    for rank in range(tp):
        mine = copy.deepcopy(mixer)
        split_ssm_mixer(mine, tp, rank, ranks.handle(rank))
        shards.append(mine)

    def work(rank):
        try:
            with torch.no_grad():
                outputs[rank] = call(shards[rank], x)
        except Exception as e:  # reported below, with the rank
            errors.append((rank, e))
            ranks.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return outputs, shards, ranks


@pytest.mark.parametrize("name, tp, layout", [
    ("mamba2", 2, "mamba2"), ("mamba2", 4, "mamba2"),  # one group of B and C: a copy per rank, the norm's sums reduced
    ("mamba2_groups4", 2, "mamba2"), ("mamba2_groups4", 4, "mamba2"),  # groups split: the norm as it is
    ("falcon_h1_norm", 2, "mamba2"), ("falcon_h1_norm", 4, "mamba2"),  # its norm counts groups, norm before the gate
    ("falcon_h1", 2, "mamba2"),  # mup multipliers per projected feature, no norm
    ("bamba", 4, "mamba2"), ("nemotron_h", 4, "mamba2"),
    ("mamba", 2, "mamba"), ("mamba", 4, "mamba"), ("jamba", 2, "mamba"),  # x_proj's partial sums reduced mid-mixer
    ("qwen3_next", 2, "delta_net"), ("qwen3_next", 4, "delta_net"),  # 2 key heads: a copy per rank at tp 4
    ("qwen3_5_text", 2, "delta_net"), ("qwen3_5_text", 4, "delta_net"),
    ("lfm2", 2, "short_conv"), ("lfm2", 4, "short_conv"),
    ("minimax", 2, "lightning"), ("minimax", 4, "lightning"),  # its norm over every head's output: sums reduced
    ("moonshine", 2, "packed_mlp"), ("granitemoehybrid", 4, "packed_mlp"),  # [gate | up] in one linear: halves
])
def test_every_rank_of_a_split_mixer_gives_the_whole_mixers_output(name, tp, layout, monkeypatch):
    mixer, hidden = first_mixer(name, layout)
    torch.manual_seed(1)
    x = torch.randn(2, 7, hidden)
    with torch.no_grad():
        want = call(mixer, x)
    outputs, shards, ranks = run_ranks(mixer, tp, x, monkeypatch)
    for rank, out in enumerate(outputs):
        assert_close_up_to_rounding(out, want, msg=f"{name} tp {tp} rank {rank}")
    whole = sum(p.numel() for p in mixer.parameters())
    held = [sum(p.numel() for p in s.parameters()) for s in shards]
    assert max(held) < whole / tp * 1.3, (held, whole)  # the heads' share, plus copies of shared groups and norms
    shapes = {n: tuple(p.shape) for n, p in mixer.named_parameters()}
    for shard in shards:  # every split parameter records which part of the whole it holds, for shard-aware loading
        for n, p in shard.named_parameters():
            if tuple(p.shape) != shapes[n]:
                assert getattr(p, "tensor_slices", None), n


def test_a_wrong_norm_split_is_caught(monkeypatch):
    """The check above can fail: a norm that divides each rank's sum of squares by its own width (what the mixer's
    norm would do with its weight merely sliced) parts from the whole mixer."""
    from ds_inference_integration.shard import mixers

    mixer, hidden = first_mixer("mamba2")
    x = torch.randn(2, 7, hidden)
    with torch.no_grad():
        want = mixer(x)
    monkeypatch.setattr(mixers.RanksGatedRMSNorm, "forward", lambda self, h, gate=None: mixers.F.rms_norm(
        (h.float() * mixers.F.silu(gate.float())), (h.shape[-1],), self.weight, self.variance_epsilon))
    outputs, _, _ = run_ranks(mixer, 2, x, monkeypatch)
    assert rounding_ratio(outputs[0], want) > 1000  # far beyond what summation order moves


def test_heads_that_do_not_divide_the_ranks_are_one_line_naming_the_valid_sizes():
    mixer, _ = first_mixer("mamba2")  # 4 heads, 1 group
    with pytest.raises(InferenceSetupError, match=r"Mamba2Mixer: 4 SSM heads in 1 groups do not split over --tp_size 3; "
                                                  r"valid tp sizes: 1, 2, 4$"):
        split_ssm_mixer(mixer, 3, 0, None)


def test_a_mixers_entry_naming_another_module_is_one_line():
    config = ZOO["lfm2"]()
    model = model_class_for(config).from_config(config)
    layer = model.model.layers[0]
    assert [type(m).__name__ for m in ssm_mixers(layer, ("conv",))] == ["Lfm2ShortConv"]  # not its inner conv
    assert ssm_mixers(layer, ("conv",), skip={id(layer.conv)}) == []  # inside a module the policy keeps whole
    with pytest.raises(InferenceSetupError, match=r"mixers 'feed_forward' in Lfm2DecoderLayer is Lfm2MLP, not a "
                                                  r"state-space mixer of a known layout"):
        ssm_mixers(layer, ("feed_forward",))


def test_a_derived_policy_with_mixers_is_written_and_read_back_with_its_own_identity(tmp_path):
    """`ds-inference policy suggest` prints the `mixers` key; read back, the policy is the same. A policy without
    mixers keeps the identity it had before the key existed (pre-sharded directories name it)."""
    import dataclasses

    from ds_inference_integration.policy.derive import derive_policy
    from ds_inference_integration.policy.schema import load_policy, policy_identity, policy_to_toml

    config = ZOO["nemotron_h"]()
    policy = derive_policy(model_class_for(config).from_config(config))
    assert policy.mixers == {"NemotronHBlock": ("mixer@NemotronHMamba2Mixer",)}
    path = tmp_path / "nemotron_h.toml"
    path.write_text(policy_to_toml(policy))
    assert 'mixers = ["mixer@NemotronHMamba2Mixer"]' in path.read_text()
    back = load_policy(path)
    assert back.mixers == policy.mixers and back.layers == policy.layers
    assert policy_identity(dataclasses.replace(policy, mixers={})) != policy_identity(policy)
