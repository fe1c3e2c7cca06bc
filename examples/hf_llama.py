"""A small Llama of Hugging Face Transformers on tvmflash, checked against Transformers' "sdpa".

    pip install -e '.[transformers]'
    python examples/hf_llama.py            # on the GPU if there is one, else the CPU

The model is built from a ``LlamaConfig`` with random weights (no download). tvmflash is registered
as a Transformers attention implementation (``tvmflash.integrations.transformers``), then:
- logits: the largest difference from sdpa's, beside sdpa's own from "eager" (the noise level);
- greedy generation: the same tokens as sdpa's;
- one training step on packed sequences (``DataCollatorWithFlattening``: no padding, each sequence's
  attention its own through ``flash_attn_varlen_func``), with the loss and gradients of sdpa on the same
  sequences padded into a batch;
- batched generation of prompts of different lengths, left-padded: sdpa's tokens;
- continuous batching (``generate_batch``): the tokens of one ``generate`` a prompt (on CUDA its decode
  steps run ``flash_attn_with_kvcache`` over the paged cache's block table).

float32 everywhere: tvmflash serves it on the CPU and every GPU, and its rounding is far below the gaps
between a random model's top logits, so the greedy tokens compare exactly.
"""

from __future__ import annotations

import inspect
import logging

import torch
import transformers
from transformers import (ContinuousBatchingConfig, DataCollatorWithFlattening, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM)

from tvmflash.integrations import transformers as tvmflash_hf

PAD = 0  # the pad token; the sequences' tokens are drawn from 3 .. vocab - 1


def build_model(device, layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """A Llama of ``layers`` layers, width 128, 4 query heads sharing 2 K/V heads (GQA) of head_dim 32,
    random float32 weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=PAD, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(config).to(device)


def sequences(lengths, vocab: int = 128, seed: int = 1) -> list[list[int]]:
    """Random token sequences of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def padded(seqs, device, left: bool = False) -> dict:
    """``seqs`` as one batch padded to the longest (on the right, or the left as for generation), with its
    attention mask and labels (-100 on the padding)."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = torch.tensor(s), 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def compare_logits(model, input_ids) -> tuple[float, float]:
    """(max |tvmflash - sdpa|, max |sdpa - eager|) of the logits of ``input_ids``."""
    logits = {}
    for impl in ("eager", "sdpa", tvmflash_hf.NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(input_ids).logits
    diff = lambda a, b: (logits[a] - logits[b]).abs().max().item()  # noqa: E731
    return diff(tvmflash_hf.NAME, "sdpa"), diff("sdpa", "eager")


def generate(model, impl: str, batch: dict, new_tokens: int) -> torch.Tensor:
    """The ``new_tokens`` greedy tokens after each row of ``batch`` (its ids and mask), with ``impl``."""
    model.set_attn_implementation(impl)
    out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         max_new_tokens=new_tokens, do_sample=False)
    return out[:, batch["input_ids"].shape[1]:]


def gradients(model, impl: str, batch: dict) -> tuple[float, dict]:
    """The loss of ``batch`` and the gradient of every parameter, with ``impl``."""
    model.set_attn_implementation(impl)
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def packed_training_step(model, seqs, lr: float = 0.5) -> dict:
    """One SGD step of tvmflash on ``seqs`` packed into one row (DataCollatorWithFlattening: position_ids
    restart at each sequence, which Transformers' flash path turns into cu_seqlens), checked against sdpa
    on the same sequences padded into a batch: both count the same predicted tokens, so the losses and
    gradients are the same. Returns the losses, the gradients' largest difference and magnitude, and the
    packed loss after the step."""
    device = next(model.parameters()).device
    packed = {k: v.to(device) for k, v in DataCollatorWithFlattening()([{"input_ids": s} for s in seqs]).items()}
    model.train()
    loss_sdpa, grads_sdpa = gradients(model, "sdpa", padded(seqs, device))
    loss, grads = gradients(model, tvmflash_hf.NAME, packed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p -= lr * grads[name]
        after = model(**packed).loss.item()
    model.eval()
    return {"loss": loss, "loss_sdpa": loss_sdpa, "after": after,
            "grad_diff": max((grads[n] - grads_sdpa[n]).abs().max().item() for n in grads),
            "grad_max": max(g.abs().max().item() for g in grads_sdpa.values())}


def continuous_batching(model, prompts, new_tokens: int, **options) -> list[list[int]]:
    """The greedy tokens after each prompt from ``generate_batch``, with a small paged cache (``options``:
    more of ``ContinuousBatchingConfig``'s)."""
    model.set_attn_implementation(tvmflash_hf.NAME)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    # A cache of 16 pages of 32 tokens: left alone, Transformers sizes it to 90% of the free memory. The
    # page's rows are `block_size` in Transformers 5.17 and `page_size` in later releases.
    rows = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    paging = ContinuousBatchingConfig(**{rows: 32}, num_blocks=16, max_batch_tokens=64, **options)
    out = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=paging)
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


def main():
    transformers.logging.set_verbosity_error()  # its notes on generation defaults, not our report
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = tvmflash_hf.register()
    model = build_model(device).eval()
    cfg = model.config
    print(f"tvmflash as Transformers {transformers.__version__}'s attn_implementation={name!r} "
          f"(torch {torch.__version__}, {device}, float32)")
    print(f"model: Llama, random weights, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads "
          f"({cfg.num_key_value_heads} K/V) of head_dim {cfg.hidden_size // cfg.num_attention_heads}\n")

    batch = padded(sequences([24, 24]), device)
    ours, noise = compare_logits(model, batch["input_ids"])
    print(f"logits           max |tvmflash - sdpa| {ours:.1e}   (sdpa vs eager: {noise:.1e})")

    new = 8
    same = torch.equal(generate(model, "sdpa", batch, new), generate(model, name, batch, new))
    print(f"greedy tokens    {'equal to' if same else 'DIFFERENT from'} sdpa's ({batch['input_ids'].shape[0]} x {new})")

    seqs = sequences([5, 11, 8], seed=2)
    step = packed_training_step(model, seqs)
    print(f"packed training  {len(seqs)} sequences of {', '.join(str(len(s)) for s in seqs)} tokens in one row "
          f"(flash_attn_varlen_func):\n"
          f"                 loss {step['loss']:.6f} (sdpa, padded: {step['loss_sdpa']:.6f}), max |grad - sdpa's| "
          f"{step['grad_diff']:.1e} of max |grad| {step['grad_max']:.1e}; after one SGD step {step['after']:.6f}")

    prompts = sequences([5, 9, 3], seed=3)
    left = padded(prompts, device, left=True)
    tokens = generate(model, name, left, new)
    same = torch.equal(generate(model, "sdpa", left, new), tokens)
    print(f"batched generate {len(prompts)} prompts of {', '.join(str(len(p)) for p in prompts)} tokens, "
          f"left-padded: {'equal to' if same else 'DIFFERENT from'} sdpa's")
    for row in tokens.tolist():
        print(f"                 {row}")

    got = continuous_batching(model, prompts, new)
    path = "decode steps on flash_attn_with_kvcache + block_table" if device == "cuda" else \
        "flash_attn_varlen_func; Transformers takes its block-table decode path on CUDA only"
    print(f"generate_batch   {'equal to' if got == tokens.tolist() else 'DIFFERENT from'} generate's ({path})")


if __name__ == "__main__":
    main()
