"""Train a small character-level GPT-2 on tinyshakespeare (CPU, a few minutes).

Usage: python jobs/shakespeare/train.py [--iters N] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
EOS = "<|endoftext|>"
BLOCK, WARMUP = 256, 100


def build_tokenizer(chars: list[str]) -> PreTrainedTokenizerFast:
    vocab = {c: i for i, c in enumerate(chars)}
    vocab[EOS] = len(chars)
    # BPE without merges: each character (newlines and spaces included) is its own token, an unknown one EOS. The
    # same ids as a WordLevel model behind a one-character Split pre-tokenizer, in half the time (tokenizers pays
    # for each pre-token).
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=EOS))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS)


def lr_at(it: int, iters: int, peak: float) -> float:
    if it < WARMUP:
        return peak * (it + 1) / WARMUP
    progress = (it - WARMUP) / max(1, iters - WARMUP)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))  # cosine down to peak / 10


def get_batch(data: torch.Tensor, gen: torch.Generator, batch: int, device: str) -> torch.Tensor:
    starts = torch.randint(len(data) - BLOCK, (batch,), generator=gen)
    return torch.stack([data[s : s + BLOCK] for s in starts.tolist()]).to(device)


@torch.no_grad()
def estimate_loss(model: GPT2LMHeadModel, data: torch.Tensor, batches: int, seed: int) -> float:
    model.eval()
    gen, device = torch.Generator().manual_seed(seed), model.device.type
    losses = [model(input_ids=(x := get_batch(data, gen, 32, device)), labels=x).loss.item() for _ in range(batches)]
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=1800)
    parser.add_argument("--out", type=Path, default=HERE / "model")
    parser.add_argument("--lr", type=float, default=7e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=150)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    start = time.time()

    torch.manual_seed(1337)
    torch.set_num_threads(2)
    text = (HERE / "tinyshakespeare.txt").read_text(encoding="utf-8")
    chars = sorted(set(text))
    tokenizer = build_tokenizer(chars)
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]

    eos_id = len(chars)
    config = GPT2Config(
        vocab_size=len(chars) + 1, n_positions=BLOCK, n_embd=128, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=eos_id, eos_token_id=eos_id,
        pad_token_id=eos_id, tie_word_embeddings=True,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab={config.vocab_size} params={n_params:,} iters={args.iters}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1337)

    t0 = time.time()
    model.train()
    for it in range(args.iters):
        for group in opt.param_groups:
            group["lr"] = lr_at(it, args.iters, args.lr)
        x = get_batch(train_data, gen, args.batch_size, args.device)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (it + 1) % args.eval_every == 0 or it == 0:
            val = estimate_loss(model, val_data, 10, seed=it)
            elapsed = time.time() - t0
            print(f"iter {it + 1:5d}  train {loss.item():.4f}  val {val:.4f}  {elapsed:6.0f}s", flush=True)
    train_seconds = time.time() - t0

    train_loss = estimate_loss(model, train_data, 50, seed=1)
    val_loss = estimate_loss(model, val_data, 50, seed=2)
    print(f"final: train {train_loss:.4f}  val {val_loss:.4f}  ({train_seconds:.0f}s training)", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.to("cpu").save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    info = {
        "val_loss": round(val_loss, 4),
        "train_loss": round(train_loss, 4),
        "iterations": args.iters,
        "train_loop_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.time() - start, 1),
        "parameters": n_params,
        "batch_size": args.batch_size,
        "peak_lr": args.lr,
        "block_size": BLOCK,
        "command": " ".join(["python", *sys.argv]),
        "torch_version": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    (args.out / "training.json").write_text(json.dumps(info, indent=2) + "\n")


if __name__ == "__main__":
    main()
