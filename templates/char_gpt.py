"""A character-level GPT (nanoGPT-shaped) on a small text, trained under ckptrun.

Everything an exact resume needs is tracked: the model (DDP across ranks), AdamW,
a warm-up + cosine schedule, an EMA of the weights, and the data position. The
step uses gradient accumulation and clipping. The defaults are tiny so that two
CPU ranks run 20 steps in seconds; scale --n-layer, --n-embd and --block-size up
(and point --data-path at your own text) for a real run.

    ckptrun launch --nproc-per-node 2 char_gpt.py --steps 200
    torchrun --nproc-per-node 2 char_gpt.py        # the same script without the supervisor
"""

import argparse
import math
from pathlib import Path

import ckptrun.runtime as ckr
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

# ----------------------------------------------------------------------------- config
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=20, help="optimizer steps in total")
parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank, per micro-batch")
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--block-size", type=int, default=64, help="context length in characters")
parser.add_argument("--n-layer", type=int, default=2)
parser.add_argument("--n-head", type=int, default=2)
parser.add_argument("--n-embd", type=int, default=64)
parser.add_argument("--dropout", type=float, default=0.1)
parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
parser.add_argument("--min-lr", type=float, default=3e-4, help="the cosine decays to this")
parser.add_argument("--warmup-steps", type=int, default=5)
parser.add_argument("--weight-decay", type=float, default=0.1)
parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping (0: off)")
parser.add_argument("--ema-decay", type=float, default=0.95)
parser.add_argument("--data-path", default=None, help="a UTF-8 text file (default: data/tiny.txt beside this script)")
parser.add_argument("--num-workers", type=int, default=0)
parser.add_argument("--sample-chars", type=int, default=120, help="characters to sample from the EMA model at the end")
args = parser.parse_args()

run = ckr.init(config=vars(args))  # process group, seeds, determinism, heartbeats

# ----------------------------------------------------------------------------- data
text = Path(args.data_path or Path(__file__).parent / "data" / "tiny.txt").read_text(encoding="utf-8")
chars = sorted(set(text))  # the vocabulary: every character of the text
stoi = {c: i for i, c in enumerate(chars)}
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)


class Windows(torch.utils.data.Dataset):
    """Every window of block_size + 1 characters: the input and, shifted by one, the targets."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size - 1

    def __getitem__(self, i: int):
        chunk = self.data[i:i + self.block_size + 1]
        return chunk[:-1], chunk[1:]


# ckr.DataLoader remembers how many batches were consumed, so a resumed run sees the ones it had not
loader = ckr.DataLoader(Windows(data, args.block_size), batch_size=args.batch_size, shuffle=True,
                        num_workers=args.num_workers, seed=run.env.seed)


# ----------------------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(args.n_embd, 3 * args.n_embd)
        self.proj = nn.Linear(args.n_embd, args.n_embd)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, args.n_head, C // args.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=args.dropout if self.training else 0.0)
        return self.dropout(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(args.n_embd), CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(args.n_embd)
        self.mlp = nn.Sequential(nn.Linear(args.n_embd, 4 * args.n_embd), nn.GELU(),
                                 nn.Linear(4 * args.n_embd, args.n_embd), nn.Dropout(args.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, args.n_embd)
        self.wpe = nn.Embedding(args.block_size, args.n_embd)
        self.drop = nn.Dropout(args.dropout)
        self.blocks = nn.ModuleList(Block() for _ in range(args.n_layer))
        self.ln_f = nn.LayerNorm(args.n_embd)
        self.lm_head = nn.Linear(args.n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, generator: torch.Generator) -> torch.Tensor:
        for _ in range(new_tokens):
            logits = self(idx[:, -args.block_size:])[:, -1, :]
            next_id = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
        return idx


model = GPT(len(chars))
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay))  # before DDP wraps the model
model = DDP(model) if run.world_size > 1 else model

# weight decay on matrices and embeddings, not on biases and norms (as nanoGPT does)
params = list(model.parameters())  # a tied weight appears once
groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
          {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def lr_factor(step: int) -> float:
    """Linear warm-up, then cosine decay from lr to min_lr over the remaining steps."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return (args.min_lr + cosine * (args.lr - args.min_lr)) / args.lr


scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

run.track(model=model, optimizer=optimizer, scheduler=scheduler, ema=ema, loader=loader)
run.restore()  # from the snapshot this attempt resumes from, if any
if "lr" in run.changed:  # `ckptrun resume --allow-change lr -- --lr X`: the restored state holds the old rate
    run.set_lr(args.lr)


# ----------------------------------------------------------------------------- train
def next_char_loss(logits: torch.Tensor, batch) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


for micro_batches in run.batches(loader, steps=args.steps, accumulate=args.accumulate):
    micro_batches = micro_batches if args.accumulate > 1 else [micro_batches]
    # one optimizer step: autocast per the precision policy, accumulation (DDP syncs the last
    # micro-batch only), clipping, the EMA update, metrics, and a snapshot when one is due
    loss = run.train_step(micro_batches, forward=lambda batch: model(batch[0]), loss=next_char_loss,
                          max_norm=args.max_norm or None)
    if run.rank == 0 and (run.step % 10 == 0 or run.step == args.steps):
        print(f"step {run.step:5d}  loss {loss:.4f}  lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

run.finish()  # final snapshot, completion event, process group closed

# ----------------------------------------------------------------------------- sample
if run.rank == 0 and args.sample_chars > 0:
    ema.module.eval()  # the EMA weights usually sample better than the last step's
    prompt = torch.tensor([[stoi[text[0]]]])
    out = ema.module.generate(prompt, args.sample_chars, torch.Generator().manual_seed(0))
    print("sample (EMA weights):\n" + "".join(chars[i] for i in out[0].tolist()), flush=True)
