"""The expert-parallel MoE layer against the single-process one, on 2 gloo processes.

Each rank holds half the experts, routes its own tokens through the group and must get
the output the full layer computes for those tokens. Covered: learned and hash routing,
both row exchanges (all_to_all, all_gather), different token counts per rank, a rank
with no tokens at all (``idle()``), and the per-rank expert bytes (exactly half).
"""

from __future__ import annotations

import math
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.convert import quantize_int8
from xspec.models.deepseek_v4.moe import MoE
from xspec.models.resident import QuantLinear, StoredWeight, make_resident
from xspec.parallel.expert import ExpertParallel, routed_expert_bytes
from xspec.parallel.runtime import Parallel
from xspec.parallel.topology import Topology

WORLD = 2


def _full_moe(hash_routed: bool) -> MoE:
    args = DeepseekV4Args.tiny()
    moe = MoE(args, hash_routed, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(7)
    for name, t in moe.state_dict(keep_vars=True).items():
        if name.endswith("tid2eid"):
            order = torch.rand(t.shape[0], args.n_routed_experts, generator=gen).argsort(dim=1)
            t.copy_(order[:, : t.shape[1]])
        else:
            t.data = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[-1])
    return moe


def _w8a8_layout(moe: MoE) -> dict[str, StoredWeight]:
    """W8A8 storage (int8 weight, per-channel scale and offset) of ``moe``'s experts."""
    out = {}
    for key, w in moe.state_dict().items():
        if "experts" in key and key.endswith(".weight"):
            n, k = w.shape
            tensors = {
                "weight": ([n, k], torch.int8),
                "weight_scale": ([n, 1], torch.float32),
                "weight_offset": ([n, 1], torch.float32),
            }
            out[key.removesuffix(".weight")] = StoredWeight("w8a8", tensors)
    return out


def _w8a8_experts(moe: MoE) -> MoE:
    """``moe`` with its routed and shared experts resident in W8A8, quantized from its
    float weights (the same on every rank)."""
    floats = {k: t.detach().clone() for k, t in moe.state_dict().items() if "experts" in k}
    make_resident(moe, _w8a8_layout(moe), dtype=torch.float32, compute="dequant")
    for key, w in floats.items():
        q, scale = quantize_int8(w)
        lin = moe.get_submodule(key.removesuffix(".weight"))
        lin.weight.copy_(q)
        lin.weight_scale.copy_(scale)
        lin.weight_offset.zero_()
    return moe.float()  # restacks: quantized experts hold no float stacks


def _tokens(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    args = DeepseekV4Args.tiny()
    return torch.randn(n, args.hidden_size, generator=gen), torch.randint(
        0, args.vocab_size, (n,), generator=gen
    )


@torch.no_grad()
def _worker(rank: int, port: int, exchange: str, quantized: bool, failures: dict) -> None:
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
        )
        topo = Topology(world=WORLD, rank=rank, dp=WORLD, ep=WORLD)
        ep = ExpertParallel(Parallel(topo, 30.0, dist.new_group([0, 1]), exchange))
        for hash_routed in (False, True):
            full = _full_moe(hash_routed)
            if quantized:
                full = _w8a8_experts(full)
            shard = MoE(
                DeepseekV4Args.tiny(),
                hash_routed,
                dtype=torch.float32,
                device="cpu",
                expert_parallel=ep,
                tag=3,
            )
            if quantized:  # the local experts resident too, loaded from the full layer
                make_resident(shard, _w8a8_layout(full), dtype=torch.float32, compute="dequant")
                shard = shard.float()
                assert isinstance(shard.experts[ep.local(8)[0]].w1, QuantLinear)
            missing, unexpected = shard.load_state_dict(full.state_dict(), strict=False)
            assert not missing, missing
            assert all(f".experts.{e}." not in k for k in unexpected for e in ep.local(8))
            assert routed_expert_bytes(shard) * 2 == routed_expert_bytes(full)
            for n in (5, 1, 0):  # rank 1 takes other sizes: 9, 3, none at all
                x, ids = _tokens(rank, n if rank == 0 else {5: 9, 1: 3, 0: 0}[n])
                if rank == 1 and n == 0:
                    shard.idle()  # no rows: still serves rank 0's
                    continue
                got, want = shard(x, ids), full(x, ids)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        dist.destroy_process_group()
    except BaseException:
        failures[rank] = traceback.format_exc()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("exchange", "quantized"),
    [("all_to_all", False), ("all_gather", False), ("all_to_all", True)],
)
def test_expert_parallel_moe_equals_the_full_layer(exchange, quantized):
    """``quantized``: W8A8 experts resident on every rank, each dequantized per call."""
    failures = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), exchange, quantized, failures), nprocs=WORLD, join=True)
    assert not failures, "\n".join(failures.values())
