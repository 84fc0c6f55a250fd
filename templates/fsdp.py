"""A small GPT sharded with FSDP2 (``fully_shard``), trained under ckptrun on data it generates.

Each rank holds only its shard of every parameter and of the AdamW moments;
ckptrun saves and restores those shards as they are (each rank writes what it
owns) and can resume them at another world size (`--allow-reshard`). The same
script runs on CPU ranks (gloo) and on GPUs (NCCL): the model goes to
``run.device``, which is LOCAL_RANK's GPU when CUDA is available. The defaults
are tiny so that two CPU ranks run 20 steps in seconds; scale --n-layer,
--n-embd and --block-size up for a real run.

    ckptrun launch --nproc-per-node 2 fsdp.py --steps 200
    torchrun --nproc-per-node 2 fsdp.py        # the same script without the supervisor
"""

import argparse

import ckptrun.runtime as ckr
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

# ----------------------------------------------------------------------------- config
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=20, help="optimizer steps in total")
parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank, per micro-batch")
parser.add_argument("--global-batch", type=int, default=None,
                    help="sequences per optimizer step, whatever the world size (the accumulation follows); "
                         "default: 48, rounded to a multiple of batch-size x ranks (48 on 1, 2, 3 or 6 ranks)")
parser.add_argument("--block-size", type=int, default=32, help="context length in tokens")
parser.add_argument("--vocab-size", type=int, default=64)
parser.add_argument("--n-layer", type=int, default=2)
parser.add_argument("--n-head", type=int, default=2)
parser.add_argument("--n-embd", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--weight-decay", type=float, default=0.1)
parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping (0: off)")
parser.add_argument("--samples", type=int, default=4096, help="sequences in the generated dataset")
args = parser.parse_args()

run = ckr.init(config=vars(args))  # process group (gloo on CPU, gloo + NCCL on CUDA), seeds, determinism


# ----------------------------------------------------------------------------- data
class MarkovText(torch.utils.data.Dataset):
    """Token sequences from a fixed random bigram chain: learnable, generated the same on every rank."""

    def __init__(self, samples: int, block_size: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        transitions = torch.softmax(4 * torch.randn(vocab, vocab, generator=generator), dim=1)
        tokens = torch.empty(samples, block_size + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (samples,), generator=generator)
        for t in range(block_size):
            tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=generator).squeeze(1)
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i, :-1], self.tokens[i, 1:]


# ckr.DataLoader keeps one global position: a resume (at any world size) starts at the first unconsumed sample
loader = ckr.DataLoader(MarkovText(args.samples, args.block_size, args.vocab_size), batch_size=args.batch_size,
                        shuffle=True, seed=run.env.seed)


# ----------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(args.n_embd), nn.LayerNorm(args.n_embd)
        self.qkv, self.proj = nn.Linear(args.n_embd, 3 * args.n_embd), nn.Linear(args.n_embd, args.n_embd)
        self.mlp = nn.Sequential(nn.Linear(args.n_embd, 4 * args.n_embd), nn.GELU(), nn.Linear(4 * args.n_embd, args.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, args.n_head, C // args.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(args.vocab_size, args.n_embd)
        self.wpe = nn.Embedding(args.block_size, args.n_embd)
        self.blocks = nn.ModuleList(Block() for _ in range(args.n_layer))
        self.ln_f = nn.LayerNorm(args.n_embd)
        self.lm_head = nn.Linear(args.n_embd, args.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# every rank builds the same full model (same seed), then keeps its shard; a large model would be
# built on the meta device and materialised shard by shard (to_empty + init) instead
model = GPT().to(run.device)
if dist.is_initialized():  # torchrun or ckptrun launch; a plain `python fsdp.py` trains unsharded
    mesh = init_device_mesh(run.device.type, (run.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # one unit per block: its parameters gather just before it runs
    fully_shard(model, mesh=mesh)  # the root: embeddings, final norm and head
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

run.track(model=model, optimizer=optimizer, loader=loader)  # the shards and their AdamW moments, as they are
run.restore()  # from the snapshot this attempt resumes from, if any
if "lr" in run.changed:  # `ckptrun resume --allow-change lr -- --lr X`: the restored state holds the old rate
    run.set_lr(args.lr)


# ----------------------------------------------------------------------------- train
def forward(batch) -> torch.Tensor:
    return model(batch[0].to(run.device))


def next_token_loss(logits: torch.Tensor, batch) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch[1].to(run.device).flatten())


micro = args.batch_size * run.world_size  # sequences in one micro-batch of every rank
global_batch = args.global_batch or micro * max(1, round(48 / micro))
for step_batches in run.batches(loader, steps=args.steps, global_batch=global_batch):
    # one micro-batch comes as (inputs, targets); several as a list of them
    micro_batches = [step_batches] if isinstance(step_batches[0], torch.Tensor) else step_batches
    loss = run.train_step(micro_batches, forward=forward, loss=next_token_loss, max_norm=args.max_norm or None)
    if run.rank == 0 and (run.step % 10 == 0 or run.step == args.steps):
        print(f"step {run.step:5d}  loss {loss:.4f}", flush=True)

run.finish()  # final snapshot, completion event, process group closed
