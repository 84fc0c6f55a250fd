"""The job `make gpu-check` launches: an MLP with BatchNorm and dropout (DDP over NCCL when there are 2+ ranks).

Dropout and a ``torch.randn`` on the device make the losses depend on every
rank's CUDA RNG, so an exact resume proves that state came back too. BatchNorm's
running statistics are written in place by every forward, while an async save's
device-to-host copy may still run: a snapshot that read them late would not resume
bitwise (the final snapshots are compared too). ``--compile`` wraps the model in
``torch.compile``. With
``--expect-dir`` each rank also writes the model's weights at every save step,
taken right after the step, while the async save of that step is still being
written and the next steps already change the weights: a torn staging copy
shows up as a snapshot that differs from them.

    ckptrun launch --nproc-per-node gpu bench/gpu_job.py --steps 12
"""

import argparse
from pathlib import Path

import ckptrun.runtime as ckr
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--save-every", type=int, default=0, help="with --expect-dir: the launch's --save-every-steps")
parser.add_argument("--expect-dir", default=None, help="write each rank's weights at every save step here")
parser.add_argument("--compile", action="store_true", help="torch.compile the model")
args = parser.parse_args()

run = ckr.init(config=vars(args))
data = torch.utils.data.TensorDataset(torch.randn(2048, 64, generator=torch.Generator().manual_seed(0)),
                                      torch.randn(2048, 1, generator=torch.Generator().manual_seed(1)))
loader = ckr.DataLoader(data, batch_size=32, seed=run.env.seed)
layers = [nn.Linear(64, args.hidden), nn.BatchNorm1d(args.hidden), nn.GELU(), nn.Dropout(0.2)]
layers += [m for _ in range(args.layers - 1) for m in (nn.Linear(args.hidden, args.hidden), nn.GELU())]
net = nn.Sequential(*layers, nn.Linear(args.hidden, 1)).to(run.device)
model = DDP(net, device_ids=None if run.device.type == "cpu" else [run.device.index]) if run.world_size > 1 else net
model = torch.compile(model) if args.compile else model
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
run.track(model=model, optimizer=optimizer, loader=loader)
run.restore()


def forward(batch):
    noise = torch.randn(1, device=run.device)  # CUDA RNG outside dropout as well
    return model(batch[0].to(run.device)) + noise


def loss(output, batch):
    return (output - batch[1].to(run.device)).pow(2).mean()


for batch in run.batches(loader, steps=args.steps):
    run.train_step([batch], forward=forward, loss=loss, max_norm=1.0)
    if args.expect_dir and run.step % args.save_every == 0:
        weights = {k: v.detach().cpu() for k, v in net.state_dict().items()}
        torch.save(weights, Path(args.expect_dir) / f"step-{run.step}-rank{run.rank}.pt")
run.finish()
