"""Predicted GPU memory per rank of a QLoRA run, DDP vs FSDP2, from the sizes of what it holds (docs/distributed.md).

    python benchmarks/fsdp_memory.py                 # the docs table: 8B / 32B / 70B on 1, 2, 4, 8 GPUs
    python benchmarks/fsdp_memory.py --seq 4096 --rank 64
    python benchmarks/fsdp_memory.py --one-gpu       # docs/gpu.md: Qwen3 1.7B / 8B / 32B on one GPU, loss on / off

A prediction, not a measurement (no GPU is needed): each term is a count of bytes, stated below, so that a
measured run can be checked term by term. What this project's FSDP run holds on each GPU (bf16 compute, nf4
with double quantisation, LoRA on every linear layer, gradient checkpointing, the fused loss):

    sharded, / N:   4-bit weights   0.5 B/param + absmax 1/64 B + second-level 4/(64*256) B  = 0.516 B/param
                    other weights   4 B/param (embeddings, head, norms: fp32 after prepare_model_for_kbit_training)
                    LoRA            16 B/param (fp32 weight 4 + fp32 grad 4 + Adam moments 8)
    whole, x 1:     gathered units  one decoder layer's weights in bf16 storage, twice (the next one prefetched),
                                    and the head (+ tied embedding) kept gathered through the step, bf16
                    activations     checkpoints: layers x tokens x hidden x 2 B; one layer recomputed:
                                    tokens x (6 x hidden + 3 x intermediate) x 2 B x 2 (values and grads);
                                    fused loss: 1,024 tokens x vocab x 4 B x 2 (the model's own loss instead:
                                    tokens x vocab x 4 B x 3.25, float32 logits, log-softmax and their gradients
                                    alive at once, as benchmarks/bench_train.py fitted it on a CPU)
                    runtime         1.5 GB (CUDA context, allocator slack, communication buffers)

DDP is FSDP with N = 1 and nothing gathered: every rank holds everything. The load peak is separate: each rank
loads the whole 4-bit model onto its own GPU before it is sharded (accelerate skips its rank-0 loading for
4-bit weights), so it needs the 4-bit weights and the other weights (upcast to fp32) at once.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GB = 1e9
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # packed nf4 + 8-bit absmax per 64 + fp32 absmax-of-absmax per 256 blocks


@dataclass(frozen=True)
class Arch:
    name: str
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False

    @property
    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer: q, k, v, o, gate, up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, m = self.hidden, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, m), (h, m), (m, h)]

    @property
    def linear_params(self) -> int:
        return self.layers * sum(i * o for i, o in self.linear_shapes)

    @property
    def other_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + (2 * self.layers + 1) * self.hidden

    def lora_params(self, rank: int) -> int:
        return self.layers * sum(rank * (i + o) for i, o in self.linear_shapes)


MODELS = {
    "8B": Arch("Llama 3.1 8B", 32, 4096, 14336, 128256, 32, 8, 128),
    "32B": Arch("Qwen3 32B", 64, 5120, 25600, 151936, 64, 8, 128),
    "70B": Arch("Llama 3.1 70B", 80, 8192, 28672, 128256, 64, 8, 128),
    "70B-2": Arch("Llama 2 70B", 80, 8192, 28672, 32000, 64, 8, 128),
    "1.7B": Arch("Qwen3 1.7B", 28, 2048, 6144, 151936, 16, 8, 128, tied=True),
    "qwen3-8B": Arch("Qwen3 8B", 36, 4096, 12288, 151936, 32, 8, 128),
}
OWN_LOSS_BUFFERS = 3.25  # float32 vocabulary-sized buffers per token with the model's own loss (bench_train.py)


def predict(arch: Arch, gpus: int, *, fsdp: bool, seq: int = 2048, batch: int = 1, rank: int = 16,
            fused: bool = True) -> dict:
    """GB per GPU of each term (module doc) and the load peak; ``fused=False``: the model's own loss."""
    n = gpus if fsdp else 1
    tokens = seq * batch
    layer_bf16 = sum(i * o for i, o in arch.linear_shapes) * NF4_BYTES  # a layer's 4-bit bytes, bf16 storage
    head_bf16 = arch.vocab * arch.hidden * 2
    terms = {
        "4-bit weights": arch.linear_params * NF4_BYTES / n,
        "other weights": arch.other_params * 4 / n,
        "LoRA + grads + Adam": arch.lora_params(rank) * 16 / n,
        "gathered": (2 * layer_bf16 + head_bf16) if fsdp and gpus > 1 else 0.0,
        "activations": (arch.layers * tokens * arch.hidden * 2
                        + tokens * (6 * arch.hidden + 3 * arch.intermediate) * 2 * 2
                        + (1024 * arch.vocab * 4 * 2 if fused else tokens * arch.vocab * 4 * OWN_LOSS_BUFFERS)),
        "runtime": 1.5 * GB,
    }
    out = {k: v / GB for k, v in terms.items()}
    out["total"] = sum(out.values())
    out["load peak"] = (arch.linear_params * NF4_BYTES + arch.other_params * 4 + 1.5 * GB) / GB
    return out


def table(seq: int, rank: int) -> str:
    lines = [f"seq {seq} x batch 1, LoRA r={rank} on every linear layer, bf16, gradient checkpointing, fused loss",
             "", "| model | GPUs | DDP per GPU | FSDP per GPU | load peak | FSDP fits 24 / 48 / 80 GB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for key in ("8B", "32B", "70B"):
        arch = MODELS[key]
        ddp = predict(arch, 1, fsdp=False, seq=seq, rank=rank)["total"]
        for gpus in (1, 2, 4, 8):
            f = predict(arch, gpus, fsdp=True, seq=seq, rank=rank)
            need = max(f["total"], f["load peak"])
            fits = " / ".join("yes" if need <= cap else "no" for cap in (24, 48, 80))
            lines.append(f"| {arch.name} | {gpus} | {ddp:.1f} GB | {f['total']:.1f} GB | {f['load peak']:.1f} GB "
                         f"| {fits} |")
    return "\n".join(lines)


def one_gpu_table(seq: int, rank: int) -> str:
    """docs/gpu.md: one GPU, the fused loss against the model's own, batch 1 and 2 (what scripts/gpu_check.sh
    measures at 2 x 2,048 tokens)."""
    lines = [f"seq {seq}, LoRA r={rank} on every linear layer, bf16, gradient checkpointing, one GPU", "",
             "| model | fused loss, batch 1 | own loss, batch 1 | fused loss, batch 2 | own loss, batch 2 "
             "| load peak |",
             "| --- | --- | --- | --- | --- | --- |"]
    for key in ("1.7B", "qwen3-8B", "32B"):
        arch = MODELS[key]
        cells = [predict(arch, 1, fsdp=False, seq=seq, batch=batch, rank=rank, fused=fused)["total"]
                 for batch in (1, 2) for fused in (True, False)]
        load = predict(arch, 1, fsdp=False, seq=seq, rank=rank)["load peak"]
        lines.append(f"| {arch.name} | " + " | ".join(f"{c:.1f} GB" for c in cells) + f" | {load:.1f} GB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--terms", metavar="MODEL", choices=sorted(MODELS), help="print each term for 1, 2, 4, 8 GPUs")
    p.add_argument("--one-gpu", action="store_true", help="Qwen3 1.7B / 8B / 32B on one GPU, fused loss on and off")
    args = p.parse_args(argv)
    if args.one_gpu:
        print(one_gpu_table(args.seq, args.rank))
        return
    if args.terms:
        for gpus in (1, 2, 4, 8):
            terms = predict(MODELS[args.terms], gpus, fsdp=True, seq=args.seq, rank=args.rank)
            print(gpus, {k: round(v, 2) for k, v in terms.items()})
        return
    print(table(args.seq, args.rank))


if __name__ == "__main__":
    main()
