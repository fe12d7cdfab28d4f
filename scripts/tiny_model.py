"""Build a tiny random model folder, offline, for checking a fork's plumbing in seconds.

    python -m scripts.tiny_model DIR [--family llama|qwen2] [--layers 2] [--dtype float32]

It has the offline default's tokenizer and chat template (smollm2-135m, shipped by a pip
package, so no network is needed) and random weights of a tiny shape: a few blocks, 64-wide.
Nothing it writes is ever right, so a run on it checks that the pieces connect (rollout,
reward, update, checkpoint, report), not that anything is learned; DIR then goes wherever a
model goes: `model.name=DIR`, `model.planner=DIR`, `eval.py --model DIR`.

    python -m scripts.tiny_model models/tiny
    python train.py configs/smoke.yaml model.name=models/tiny

The test suite builds its tiny models here too (tests/conftest.py), so what a fork checks on
is what the tests run on.
"""

import argparse

import torch

FAMILIES = ("llama", "qwen2")


def build(out: str, family: str = "llama", layers: int = 2, dtype: str = "float32", seed: int = 0,
          positions: int = 4096) -> str:
    """Write a random `family` model of `layers` blocks with the default's tokenizer to `out`,
    `positions` long (the preflight holds each module's longest call against it)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from support.models import DEFAULT_MODEL, resolve_model

    if family not in FAMILIES:
        raise SystemExit(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    tok = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    config, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    torch.manual_seed(seed)
    model = model_class(config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                               tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    with torch.no_grad():
        # Default init gives near-uniform logits; a larger output scale makes greedy choices
        # decisive (near-ties make comparisons between two code paths fragile) while
        # sampling stays varied.
        model.lm_head.weight.normal_(0, 0.3)
        if family == "qwen2":  # init leaves the q/k/v biases at 0, where a bias bug would hide
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.tiny_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", metavar="DIR", help="the folder to write (created)")
    ap.add_argument("--family", default="llama", choices=FAMILIES)
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers {args.layers}: at least 1")
    build(args.out, args.family, args.layers, args.dtype)
    print(f"wrote a random {args.layers}-block {args.family} with the default's tokenizer to {args.out}; "
          f"use it as model.name={args.out} or model.planner={args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
