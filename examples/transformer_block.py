"""A small pre-norm transformer block trained a few steps with cupyops.torch and
with torch's own ops from the same seed.

The block: RMSNorm, causal self-attention whose probabilities come from
cupyops.torch.FusedSoftmax (scale, causal mask and dropout in one kernel;
torch.softmax of the masked, scaled scores where cupyops has no
fused_softmax), RMSNorm, a SwiGLU MLP. With dropout 0 both runs draw the
same weights and batches, so their losses agree within TOLERANCE; with
dropout on (different masks on each side) the step times are reported.

Usage (repository root, a CUDA GPU and torch): PYTHONPATH=. python examples/transformer_block.py
(--profile: also torch.profiler's busiest ops, host and GPU, over three steps of each)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import cupyops.torch as ct

TOLERANCE = 2e-3   # relative, per step's loss, float32
WARMUP_STEPS = 2   # of each timed run, left out of the step times


class TransformerBlock(torch.nn.Module):
    """x + attention(rms_norm(x)), then + swiglu_mlp(rms_norm(x)); `use_cupyops` picks the ops."""

    def __init__(self, width: int, heads: int, dropout: float, use_cupyops: bool):
        super().__init__()
        norm = ct.RMSNorm if use_cupyops else torch.nn.RMSNorm
        self.heads, self.dropout, self.use_cupyops = heads, dropout, use_cupyops
        self.scale = (width // heads) ** -0.5
        self.norm1, self.norm2 = norm(width), norm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.gate, self.up = torch.nn.Linear(width, 4 * width), torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)
        self.fused = (ct.FusedSoftmax(causal=True, scale=self.scale, dropout=dropout)
                      if use_cupyops and hasattr(ct, "FusedSoftmax") else None)

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        """dropout(softmax(scores * scale, causal)): FusedSoftmax, else softmax of the masked scores."""
        if self.fused is not None:
            return self.fused(scores)
        seq = scores.shape[-1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=scores.device).tril()
        masked = (scores * self.scale).masked_fill(~causal, float("-inf"))
        p = ct.softmax(masked, -1) if self.use_cupyops else torch.softmax(masked, -1)
        return F.dropout(p, self.dropout, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        p = self.probabilities(q @ k.transpose(-1, -2))
        x = x + self.proj((p @ v).transpose(1, 2).reshape(batch, seq, width))
        h = self.norm2(x)
        mlp = ct.swiglu(self.gate(h), self.up(h)) if self.use_cupyops else F.silu(self.gate(h)) * self.up(h)
        return x + self.down(mlp)


def train(use_cupyops: bool, options, dropout: float) -> tuple:
    """(losses, seconds of each step) of options.steps AdamW steps from seed options.seed."""
    torch.manual_seed(options.seed)
    block = TransformerBlock(options.width, options.heads, dropout, use_cupyops).cuda()
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3)
    generator = torch.Generator(device="cuda").manual_seed(options.seed)
    losses, times = [], []
    for _ in range(options.steps):
        x = torch.randn(options.batch, options.seq, options.width, device="cuda", generator=generator)
        torch.cuda.synchronize()
        began = time.perf_counter()
        loss = (block(x) - x.roll(1, dims=1)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        losses.append(loss.item())
    return losses, times


def profile(use_cupyops: bool, options) -> None:
    """Prints torch.profiler's ten busiest ops by host time and by GPU time over three steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    warm = argparse.Namespace(**{**vars(options), "steps": 2})
    train(use_cupyops, warm, options.dropout)
    with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as recorded:
        train(use_cupyops, argparse.Namespace(**{**vars(options), "steps": 3}), options.dropout)
    averages = recorded.key_averages()
    print(f"== {'cupyops' if use_cupyops else 'torch'}: three steps")
    for sort in ("self_cpu_time_total", "self_device_time_total"):
        print(averages.table(sort_by=sort, row_limit=10, max_name_column_width=60))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each, interleaved")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's busiest ops")
    options = parser.parse_args()
    if not hasattr(ct, "FusedSoftmax"):
        print("cupyops has no fused_softmax: attention probabilities by cupyops.torch.softmax of the masked scores")
    ours, _ = train(True, options, 0.0)
    theirs, _ = train(False, options, 0.0)
    print(f"{'step':>4s} {'cupyops loss':>13s} {'torch loss':>11s}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(ours, theirs)):
        worst = max(worst, abs(a - b) / abs(b))
        print(f"{step:4d} {a:13.6f} {b:11.6f}")
    print(f"dropout 0: largest relative difference {worst:.2e} (tolerance {TOLERANCE:.0e})")
    steps = {True: [], False: []}
    for _ in range(options.rounds):   # the two interleaved, so that drift on the machine hits both
        for use_cupyops in (True, False):
            steps[use_cupyops] += train(use_cupyops, options, options.dropout)[1][WARMUP_STEPS:]
    ours_ms, theirs_ms = (1e3 * statistics.median(steps[use_cupyops]) for use_cupyops in (True, False))
    print(f"dropout {options.dropout}: median step time cupyops {ours_ms:.3f} ms, torch {theirs_ms:.3f} ms "
          f"(torch / cupyops {theirs_ms / ours_ms:.3f}) over {len(steps[True])} steps each")
    if options.profile:
        profile(True, options)
        profile(False, options)
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
