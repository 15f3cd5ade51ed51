"""How packages/optim/tests/data/v2 was written (kept as a record; the tests do not run it).

``torchrun --standalone --nproc-per-node 2 writer.py OUT`` with shardkit-optim 0.3.2 (format
``shardkit.optim.sharded/2``): world 2, Adam over two param groups (betas: a tuple in the
param_groups record), bf16 params with fp32 master weights (``master/`` items), 3 steps.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from shardkit.optim import ShardedOptimizer, __version__, save_sharded
from torch import nn

out = Path(sys.argv[1])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(torch.bfloat16)
ps = list(model.parameters())
groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.02}]
opt = ShardedOptimizer(groups, optim=torch.optim.Adam, lr=0.01, betas=(0.8, 0.99), master_dtype=torch.float32)
for s in range(3):
    g = torch.Generator().manual_seed(s)
    opt.zero_grad()
    model(torch.randn(6, 4, generator=g).to(torch.bfloat16)).float().square().mean().backward()
    opt.step()
save_sharded(opt, out / "ckpt")
sd = opt.state_dict(all_ranks=True)
if dist.get_rank() == 0:
    torch.save(sd, out / "expected.pt")
    (out / "WRITER").write_text(f"shardkit-optim {__version__}, torch {torch.__version__}, world 2\n")
dist.barrier()
dist.destroy_process_group()
