"""A GPT-style model's training step and generation loop: torch's default SDPA against the same code
with gemmgen activated behind it (gemmgen.activate(), SDPA restricted to its flash path).

    python bench/model.py [--layers 12] [--width 1024] [--heads 16] [--seq-len 2048 8192]
                          [--tokens 16384] [--rounds 5] [--out FILE.md]

The model is plain PyTorch (pre-norm blocks, causal self-attention through
F.scaled_dot_product_attention, a 4x MLP, tied embeddings), bf16 weights, nothing gemmgen-specific
in its code. Per sequence length, B = --tokens / N sequences:

- training step: forward, cross-entropy loss, backward and an AdamW step on random tokens;
  tokens/s = B * N / time per step;
- generation: a 512-token prompt (prefill) then 256 greedy steps of one token each with a
  preallocated key-value cache (SDPA on the cache's first t keys), batch 8; tokens/s = 8 * 256 /
  time of the 256 steps (the prompt's time excluded).

Each side is timed in --rounds rounds in alternating order (warm-up first), each round its median
step time; reported: the median over rounds. The gemmgen side checks with
gemmgen.integrations.torch_sdpa.counts() that its attention ran on gemmgen.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, median_wall_s, publish  # noqa: E402

import gemmgen  # noqa: E402
from gemmgen.integrations import torch_sdpa  # noqa: E402

VOCAB = 32000


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                start: int = 0) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, w // self.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, N, d]
        if cache is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            kc, vc = cache
            kc[:, :, start:start + n], vc[:, :, start:start + n] = k, v
            k, v = kc[:, :, :start + n], vc[:, :, :start + n]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1)  # a prompt: Nq = Nk, top-left
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, w))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(torch.nn.Module):
    def __init__(self, layers: int, width: int, heads: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor, caches=None, start: int = 0) -> torch.Tensor:
        x = self.embed(ids)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i], start)
        return self.norm(x) @ self.embed.weight.t()


def train_step(model, opt, ids):
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@torch.no_grad()
def generate(model, prompt, steps: int, width: int, heads: int) -> float:
    """Seconds of `steps` greedy decode steps after the prompt (the prompt's prefill not counted)."""
    b, n = prompt.shape
    caches = [(torch.empty(b, heads, n + steps, width // heads, device="cuda", dtype=torch.bfloat16),
               torch.empty(b, heads, n + steps, width // heads, device="cuda", dtype=torch.bfloat16))
              for _ in model.blocks]
    nxt = model(prompt, caches, 0)[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for t in range(steps):
        nxt = model(nxt, caches, n + t)[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    return time.perf_counter() - start


@contextlib.contextmanager
def side(name: str):
    """torch's default SDPA, or gemmgen activated with SDPA restricted to its flash path."""
    if name == "torch":
        yield
        return
    gemmgen.activate()
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            yield
    finally:
        gemmgen.deactivate()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq-len", nargs="+", type=int, default=[2048, 8192])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per training step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="timed steps per round")
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT(args.layers, args.width, args.heads).to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rows, sides = [], ("torch", "gemmgen")
    for n in args.seq_len:
        ids = torch.randint(0, VOCAB, (args.tokens // n, n + 1), device="cuda")
        for name in sides:  # warm-up: selection, first launches, optimizer state
            with side(name):
                train_step(model, opt, ids)
        got = {name: [] for name in sides}
        for r in range(args.rounds):
            for name in (sides if r % 2 == 0 else sides[::-1]):
                with side(name):
                    got[name].append(median_wall_s(lambda: train_step(model, opt, ids), args.reps))
        t = {name: statistics.median(v) for name, v in got.items()}
        rows.append((f"training step, N={n}, B={args.tokens // n}", *(ids.shape[0] * n / t[s] for s in sides)))
        print(rows[-1], flush=True)
    prompt = torch.randint(0, VOCAB, (8, 512), device="cuda")
    got = {name: [] for name in sides}
    for name in sides:
        with side(name):
            generate(model, prompt, 8, args.width, args.heads)
    for r in range(args.rounds):
        for name in (sides if r % 2 == 0 else sides[::-1]):
            with side(name):
                got[name].append(generate(model, prompt, 256, args.width, args.heads))
    t = {name: statistics.median(v) for name, v in got.items()}
    rows.append(("generation, batch 8, 512-token prompt, 256 steps", *(8 * 256 / t[s] for s in sides)))
    counts = torch_sdpa.counts()
    ran = {op: c for op, c in counts.items() if c.get("gemmgen")}
    head = header(f"GPT-style model, {args.layers} layers, width {args.width}, {args.heads} heads (d "
                  f"{args.width // args.heads}), bf16; torch's default SDPA against gemmgen.activate() with SDPA "
                  f"restricted to its flash path; median over {args.rounds} rounds in alternating order of "
                  f"the median of {args.reps} steps; command: python bench/model.py {' '.join(sys.argv[1:])}".rstrip())
    table = ["| workload | torch SDPA tokens/s | gemmgen tokens/s | gemmgen / torch |", "|---|---|---|---|"]
    table += [f"| {label} | {a:,.0f} | {b:,.0f} | {b / a:.2f} |" for label, a, b in rows]
    text = head + "\n\n" + "\n".join(table) + f"\n\n- calls run on gemmgen per op: {ran}\n" + \
        f"- calls torch's kernel kept while gemmgen was active: {torch_sdpa.fallback_reasons() or 'none'}\n"
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
