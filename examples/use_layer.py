# One DSv4 C layer (ratio 4) split over 2 context-parallel ranks, forward and backward.
#   CPU: python examples/use_layer.py                              (spawns 2 gloo ranks, tiny shapes)
#   GPU: torchrun --nproc-per-node 2 examples/use_layer.py         (NCCL, one GPU per rank, flash shapes)
import os

import torch
import torch.distributed as dist

from dsv4cp import DSv4Attention, DSv4Config, PackedSeqs
from dsv4cp.cp.launch import spawn


def step(rank: int, world: int, device: torch.device) -> None:
    on_gpu = device.type == "cuda"
    cfg = DSv4Config.preset("flash" if on_gpu else "tiny")  # or "pro"; override fields as keywords
    dtype = torch.bfloat16 if on_gpu else torch.float32
    # The WHOLE batch's document offsets, identical on every rank: 4 documents (one empty), each padded
    # to a multiple of 4 rows, then tail padding up to 8192 rows.
    packed = PackedSeqs.from_lengths([3000, 120, 0, 4900], pad_to_multiple=4, total=8192).to(device)
    torch.manual_seed(0)  # the same weights on every rank
    layer = DSv4Attention(cfg, compress_ratio=4, overlap="async", recompute=True).to(device, dtype)
    # Rank r holds rows [r*T/cp, (r+1)*T/cp) of the packed layer input [T, hidden].
    x = torch.randn(packed.total, cfg.hidden, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    rows = packed.total // world
    x_local = x[rank * rows:(rank + 1) * rows].requires_grad_()

    out, indexer_loss = layer(x_local, packed, cp_group=dist.group.WORLD)
    # out: this rank's [rows, hidden] slice; indexer_loss: this rank's share of the indexer KL loss.
    (out.float().square().mean() + indexer_loss).backward()  # parameter grads: per-rank partial sums

    total_loss = indexer_loss.detach().clone()
    dist.all_reduce(total_loss)  # the global indexer loss is the sum over ranks
    if rank == 0:
        print(f"cp={world} {cfg.name}: out {tuple(out.shape)} {out.dtype}, indexer loss {total_loss.item():.6f}, "
              f"|dx| {x_local.grad.float().norm().item():.4f}")


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # under torchrun: one process per GPU
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        step(dist.get_rank(), dist.get_world_size(), device)
        dist.destroy_process_group()
    else:  # no launcher: dsv4cp's spawns 2 local processes and sets up their gloo process group
        spawn(step, 2)
