"""fp8_accuracy: how far fp8 weights move a model's next-token distributions from bf16, on the Qwen3-0.6B and
Llama-3.1-8B shapes.

The weights are dummy, drawn at the checkpoint's scale: every linear and embedding weight from a Student-t
distribution (heavy tails, as trained weights have; --tail-df, 0 for a normal one) scaled to the standard deviation
the checkpoint's config gives its initializer (initializer_range, 0.02 for both), norm weights one. Random weights
give next-token distributions far flatter than a trained model's, on which any noise flips the greedy token: the
final norm's weight is scaled so that the bf16 logits have standard deviation --logit-std (on one calibration prompt;
0 leaves them). The fp8 model is the same model with model.quantization=fp8 (per-channel weight scales). A fixed
prompt set (--num-prompts prompts of --prompt-len random ids < 10000, seed 0) runs through both, teacher-forced:
- prefill: the logits at every prompt position in one step (on an fp8 GPU: up to fp8.FP8_GEMM_MAX_ROWS positions,
  128, the weight-only GEMM; past it the activations are quantized to fp8 per token too, torch._scaled_mm: pass a
  --prompt-len above 128 to measure that);
- decode: --decode-steps single-token steps fed the bf16 model's greedy tokens (on an fp8 GPU: the weight-only GEMV).
For each: the mean KL divergence KL(bf16 || fp8) of the next-token distributions (nats), the share of positions
whose greedy token agrees, and the bf16 model's mean top-1 probability (how peaked its distributions are).
On CPU (no fp8 kernels) the fp8 model holds dequantized weights, so only the weights' rounding is measured.

Usage: python -m benchmarks.fp8_accuracy [--models qwen3_0_6b llama3_1_8b] [--num-prompts 16] [--prompt-len 128]
                                         [--decode-steps 32] [--tail-df 4] [--logit-std 3] [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from torch import nn

from batchgen.layers.attention import Attention, AttentionMetadata
from batchgen.layers.fp8_loading import finish_fp8
from batchgen.layers.norms import RMSNorm
from batchgen.models.loader import DTYPES, load_hf_config, load_model
from benchmarks.common import (
    LLAMA31_8B,
    QWEN3,
    add_out_argument,
    benchmark_model_config,
    cuda_available,
    environment,
    markdown_table,
    random_prompt,
    save_json,
)

BLOCK_SIZE = 16


@torch.no_grad()
def draw_weights(model: nn.Module, std: float, tail_df: float, seed: int = 0) -> None:
    """Every weight but the norms' from a Student-t with tail_df degrees of freedom (a normal for 0) of standard
    deviation std; norm weights one, biases zero."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if isinstance(module, RMSNorm) or name == "bias":
                param.fill_(1.0 if name == "weight" else 0.0)
            elif tail_df > 0:
                # t = z / sqrt(chi2 / df); its variance is df / (df - 2)
                normal = torch.randn(param.shape, generator=generator, device=param.device)
                chi2 = torch.empty_like(normal).exponential_(generator=generator).mul_(2)  # chi2 with 2 dof
                for _ in range(int(tail_df) // 2 - 1):
                    chi2.add_(torch.empty_like(normal).exponential_(generator=generator).mul_(2))
                t = normal / (chi2 / tail_df).sqrt_()
                param.copy_(t * std / math.sqrt(tail_df / (tail_df - 2)))
            else:
                param.copy_(torch.randn(param.shape, generator=generator, device=param.device) * std)


class ContiguousCache:
    """A paged KV cache for one sequence at a time, its blocks in order: prefill and decode steps of the model outside
    the engine."""

    def __init__(self, model: nn.Module, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        self.num_blocks = -(-max_len // BLOCK_SIZE)
        self.device = device
        for layer in model.modules():
            if isinstance(layer, Attention):
                shape = (self.num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
                layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
                layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def meta(self, start: int, count: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and metadata of `count` new tokens after `start` cached ones."""
        positions = torch.arange(start, start + count, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),
            seq_lens=torch.tensor([start + count], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(self.num_blocks, dtype=torch.int32, device=self.device)[None],
            query_start_loc=torch.tensor([0, count], dtype=torch.int32, device=self.device),
            max_query_len=count, max_seq_len=start + count, is_decode=count == 1,
        )
        return positions, meta


@torch.no_grad()
def logits_of(model: nn.Module, cache: ContiguousCache, tokens: list[int], start: int) -> torch.Tensor:
    """(len(tokens), vocab) float32 logits of tokens fed after `start` cached positions."""
    positions, meta = cache.meta(start, len(tokens))
    ids = torch.tensor(tokens, device=cache.device)
    return model.compute_logits(model(ids, positions, meta)).float()


class Agreement:
    """Sums of KL(bf16 || fp8), greedy agreement and the bf16 top-1 probability over positions."""

    def __init__(self) -> None:
        self.positions, self.kl, self.agree, self.top1 = 0, 0.0, 0, 0.0

    def add(self, reference: torch.Tensor, quantized: torch.Tensor) -> None:  # (N, vocab) logits each
        log_p, log_q = reference.log_softmax(-1), quantized.log_softmax(-1)
        self.kl += float((log_p.exp() * (log_p - log_q)).sum())
        self.agree += int((reference.argmax(-1) == quantized.argmax(-1)).sum())
        self.top1 += float(log_p.exp().amax(-1).sum())
        self.positions += reference.shape[0]

    def row(self, model: str, path: str) -> dict[str, Any]:
        n = max(self.positions, 1)
        return {"model": model, "path": path, "positions": self.positions, "mean_kl": self.kl / n,
                "greedy_agreement": self.agree / n, "bf16_top1_prob": self.top1 / n}


def measure(name: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    model_config = benchmark_model_config(name, args.tiny)
    hf_config = load_hf_config(model_config)
    dtype = DTYPES[model_config.dtype]
    std = getattr(hf_config, "initializer_range", None) or 0.02
    reference, quantized = (load_model(model_config, hf_config, dtype, device) for _ in range(2))
    for model in (reference, quantized):
        draw_weights(model, std, args.tail_df)  # the same seed: the same weights
    max_len = args.prompt_len + args.decode_steps
    if args.logit_std:
        calibration = random_prompt(args.prompt_len, seed=args.num_prompts)
        logits = logits_of(reference, ContiguousCache(reference, max_len, device, dtype), calibration, 0)
        for model in (reference, quantized):
            getattr(model, model.decoder_name).norm.weight.mul_(args.logit_std / float(logits.std()))
    finish_fp8(quantized, device)
    runs = [(model, ContiguousCache(model, max_len, device, dtype)) for model in (reference, quantized)]
    prefill, decode = Agreement(), Agreement()
    for i in range(args.num_prompts):
        prompt = random_prompt(args.prompt_len, seed=i)
        expected, actual = (logits_of(model, cache, prompt, 0) for model, cache in runs)
        prefill.add(expected, actual)
        token = int(expected[-1].argmax())
        for step in range(args.decode_steps):
            expected, actual = (logits_of(model, cache, [token], args.prompt_len + step) for model, cache in runs)
            decode.add(expected, actual)
            token = int(expected[-1].argmax())
    return [prefill.row(name, "prefill"), decode.row(name, "decode")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[QWEN3, LLAMA31_8B],
                        help="conf/model/<name>.yaml shapes, with dummy weights")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--tail-df", type=float, default=4.0,
                        help="degrees of freedom of the weights' Student-t (even, > 2); 0: a normal distribution")
    parser.add_argument("--logit-std", type=float, default=3.0,
                        help="the bf16 logits' standard deviation the final norm is scaled to; 0: as drawn")
    parser.add_argument("--tiny", action="store_true", help="two-layer models of the same shapes (CPU test)")
    add_out_argument(parser)
    args = parser.parse_args()
    if args.tail_df and (args.tail_df <= 2 or args.tail_df % 2):
        parser.error(f"--tail-df {args.tail_df}: give an even number above 2, or 0")
    device = torch.device("cuda" if cuda_available() else "cpu")
    rows = [row for name in args.models for row in measure(name, args, device)]
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    name = "fp8_accuracy" + ("_tiny" if args.tiny else "")
    save_json(args.out, name, {"environment": environment(), "settings": settings, "results": rows})
    headers = ["model", "path", "positions", "mean_kl", "greedy_agreement", "bf16_top1_prob"]
    print(f"\n## {name} ({environment()['device']}; {args.num_prompts} prompts of {args.prompt_len} tokens, "
          f"{args.decode_steps} decode steps each; weights Student-t df {args.tail_df:g} at initializer_range, logit "
          f"std {args.logit_std:g})\n")
    print(markdown_table(headers, [[row[h] for h in headers] for row in rows]))


if __name__ == "__main__":
    main()
