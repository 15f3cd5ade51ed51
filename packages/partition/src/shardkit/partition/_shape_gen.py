"""Generate the shipped shape files from published model configurations (no downloads).

Run ``python -m shardkit.partition._shape_gen [OUT_DIR]`` to rewrite the JSON files in
``shardkit/partition/shapes/``. Each generator reproduces the reference implementation's
parameter registration order (``named_parameters()``, tied weights listed once) from the
configuration numbers alone; the docstrings cite the configuration and the parameter count it
must produce.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__: list[str] = []

_Param = tuple[str, list[int], str, bool]


def _gpt2(n_embd: int, n_layer: int, vocab: int = 50257, n_positions: int = 1024) -> list[_Param]:
    """HF ``GPT2LMHeadModel`` (lm_head tied to wte, listed once). Conv1D weights are
    ``[in, out]``."""
    d = n_embd
    out: list[_Param] = [
        ("transformer.wte.weight", [vocab, d], "float32", True),
        ("transformer.wpe.weight", [n_positions, d], "float32", True),
    ]
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        out += [
            (p + "ln_1.weight", [d], "float32", True),
            (p + "ln_1.bias", [d], "float32", True),
            (p + "attn.c_attn.weight", [d, 3 * d], "float32", True),
            (p + "attn.c_attn.bias", [3 * d], "float32", True),
            (p + "attn.c_proj.weight", [d, d], "float32", True),
            (p + "attn.c_proj.bias", [d], "float32", True),
            (p + "ln_2.weight", [d], "float32", True),
            (p + "ln_2.bias", [d], "float32", True),
            (p + "mlp.c_fc.weight", [d, 4 * d], "float32", True),
            (p + "mlp.c_fc.bias", [4 * d], "float32", True),
            (p + "mlp.c_proj.weight", [4 * d, d], "float32", True),
            (p + "mlp.c_proj.bias", [d], "float32", True),
        ]
    out += [
        ("transformer.ln_f.weight", [d], "float32", True),
        ("transformer.ln_f.bias", [d], "float32", True),
    ]
    return out


def _bert_base() -> list[_Param]:
    """HF ``BertModel`` for bert-base-uncased: vocab 30522, hidden 768, 12 layers,
    intermediate 3072, 512 positions, 2 token types, with pooler (109,482,240 params)."""
    d, ff, vocab = 768, 3072, 30522
    out: list[_Param] = [
        ("embeddings.word_embeddings.weight", [vocab, d], "float32", True),
        ("embeddings.position_embeddings.weight", [512, d], "float32", True),
        ("embeddings.token_type_embeddings.weight", [2, d], "float32", True),
        ("embeddings.LayerNorm.weight", [d], "float32", True),
        ("embeddings.LayerNorm.bias", [d], "float32", True),
    ]
    for i in range(12):
        p = f"encoder.layer.{i}."
        for proj in ("query", "key", "value"):
            out += [
                (p + f"attention.self.{proj}.weight", [d, d], "float32", True),
                (p + f"attention.self.{proj}.bias", [d], "float32", True),
            ]
        out += [
            (p + "attention.output.dense.weight", [d, d], "float32", True),
            (p + "attention.output.dense.bias", [d], "float32", True),
            (p + "attention.output.LayerNorm.weight", [d], "float32", True),
            (p + "attention.output.LayerNorm.bias", [d], "float32", True),
            (p + "intermediate.dense.weight", [ff, d], "float32", True),
            (p + "intermediate.dense.bias", [ff], "float32", True),
            (p + "output.dense.weight", [d, ff], "float32", True),
            (p + "output.dense.bias", [d], "float32", True),
            (p + "output.LayerNorm.weight", [d], "float32", True),
            (p + "output.LayerNorm.bias", [d], "float32", True),
        ]
    out += [
        ("pooler.dense.weight", [d, d], "float32", True),
        ("pooler.dense.bias", [d], "float32", True),
    ]
    return out


def _resnet50() -> list[_Param]:
    """torchvision ``resnet50``: Bottleneck blocks [3, 4, 6, 3], width 64, expansion 4,
    1000 classes (25,557,032 params; BatchNorm running stats are buffers, not params)."""
    out: list[_Param] = [
        ("conv1.weight", [64, 3, 7, 7], "float32", True),
        ("bn1.weight", [64], "float32", True),
        ("bn1.bias", [64], "float32", True),
    ]
    inplanes = 64
    for layer, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for b in range(blocks):
            p = f"layer{layer}.{b}."
            out += [
                (p + "conv1.weight", [planes, inplanes, 1, 1], "float32", True),
                (p + "bn1.weight", [planes], "float32", True),
                (p + "bn1.bias", [planes], "float32", True),
                (p + "conv2.weight", [planes, planes, 3, 3], "float32", True),
                (p + "bn2.weight", [planes], "float32", True),
                (p + "bn2.bias", [planes], "float32", True),
                (p + "conv3.weight", [planes * 4, planes, 1, 1], "float32", True),
                (p + "bn3.weight", [planes * 4], "float32", True),
                (p + "bn3.bias", [planes * 4], "float32", True),
            ]
            if b == 0:
                out += [
                    (p + "downsample.0.weight", [planes * 4, inplanes, 1, 1], "float32", True),
                    (p + "downsample.1.weight", [planes * 4], "float32", True),
                    (p + "downsample.1.bias", [planes * 4], "float32", True),
                ]
            inplanes = planes * 4
    out += [("fc.weight", [1000, 2048], "float32", True), ("fc.bias", [1000], "float32", True)]
    return out


def _attention(prefix: str, d: int, kv: int, dtype: str) -> list[_Param]:
    """HF ``self_attn`` projections (bias-free; ``kv < d`` is grouped-query attention)."""
    return [
        (prefix + "self_attn.q_proj.weight", [d, d], dtype, True),
        (prefix + "self_attn.k_proj.weight", [kv, d], dtype, True),
        (prefix + "self_attn.v_proj.weight", [kv, d], dtype, True),
        (prefix + "self_attn.o_proj.weight", [d, d], dtype, True),
    ]


def _llama(
    hidden: int,
    intermediate: int,
    layers: int,
    vocab: int,
    dtype: str,
    kv_hidden: int | None = None,
) -> list[_Param]:
    """HF ``LlamaForCausalLM``: bias-free projections, RMSNorm weights, untied lm_head."""
    d, kv = hidden, kv_hidden or hidden
    out: list[_Param] = [("model.embed_tokens.weight", [vocab, d], dtype, True)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            *_attention(p, d, kv, dtype),
            (p + "mlp.gate_proj.weight", [intermediate, d], dtype, True),
            (p + "mlp.up_proj.weight", [intermediate, d], dtype, True),
            (p + "mlp.down_proj.weight", [d, intermediate], dtype, True),
            (p + "input_layernorm.weight", [d], dtype, True),
            (p + "post_attention_layernorm.weight", [d], dtype, True),
        ]
    out += [
        ("model.norm.weight", [d], dtype, True),
        ("lm_head.weight", [vocab, d], dtype, True),
    ]
    return out


def _vit_large_16(num_classes: int = 1000) -> list[_Param]:
    """timm ``vit_large_patch16_224`` (torchvision ``vit_l_16`` has the same shapes): patch 16,
    224 px (196 patches + class token), width 1024, 24 blocks, MLP 4096, 1000 classes
    (304,326,632 params). The class token and position embedding are registered first."""
    d, ff = 1024, 4096
    out: list[_Param] = [
        ("cls_token", [1, 1, d], "float32", True),
        ("pos_embed", [1, 197, d], "float32", True),
        ("patch_embed.proj.weight", [d, 3, 16, 16], "float32", True),
        ("patch_embed.proj.bias", [d], "float32", True),
    ]
    for i in range(24):
        p = f"blocks.{i}."
        out += [
            (p + "norm1.weight", [d], "float32", True),
            (p + "norm1.bias", [d], "float32", True),
            (p + "attn.qkv.weight", [3 * d, d], "float32", True),
            (p + "attn.qkv.bias", [3 * d], "float32", True),
            (p + "attn.proj.weight", [d, d], "float32", True),
            (p + "attn.proj.bias", [d], "float32", True),
            (p + "norm2.weight", [d], "float32", True),
            (p + "norm2.bias", [d], "float32", True),
            (p + "mlp.fc1.weight", [ff, d], "float32", True),
            (p + "mlp.fc1.bias", [ff], "float32", True),
            (p + "mlp.fc2.weight", [d, ff], "float32", True),
            (p + "mlp.fc2.bias", [d], "float32", True),
        ]
    out += [
        ("norm.weight", [d], "float32", True),
        ("norm.bias", [d], "float32", True),
        ("head.weight", [num_classes, d], "float32", True),
        ("head.bias", [num_classes], "float32", True),
    ]
    return out


def _mixtral(
    hidden: int, intermediate: int, layers: int, experts: int, vocab: int, kv_hidden: int
) -> list[_Param]:
    """HF ``MixtralForCausalLM`` (per-expert ``w1``/``w2``/``w3`` layout of transformers 4.x):
    grouped-query attention, a router ``gate`` and ``experts`` SwiGLU MLPs per layer, RMSNorm
    weights, untied lm_head, bfloat16."""
    d, dtype = hidden, "bfloat16"
    out: list[_Param] = [("model.embed_tokens.weight", [vocab, d], dtype, True)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            *_attention(p, d, kv_hidden, dtype),
            (p + "block_sparse_moe.gate.weight", [experts, d], dtype, True),
        ]
        for e in range(experts):
            q = p + f"block_sparse_moe.experts.{e}."
            out += [
                (q + "w1.weight", [intermediate, d], dtype, True),
                (q + "w2.weight", [d, intermediate], dtype, True),
                (q + "w3.weight", [intermediate, d], dtype, True),
            ]
        out += [
            (p + "input_layernorm.weight", [d], dtype, True),
            (p + "post_attention_layernorm.weight", [d], dtype, True),
        ]
    out += [
        ("model.norm.weight", [d], dtype, True),
        ("lm_head.weight", [vocab, d], dtype, True),
    ]
    return out


_MODELS: dict[str, tuple[str, int, Callable[[], list[_Param]]]] = {
    "gpt2-small": (
        "HF gpt2 config: n_embd 768, n_layer 12, n_positions 1024, vocab 50257; "
        "GPT2LMHeadModel, lm_head tied",
        124_439_808,
        lambda: _gpt2(768, 12),
    ),
    "gpt2-medium": (
        "HF gpt2-medium config: n_embd 1024, n_layer 24, n_positions 1024, vocab 50257",
        354_823_168,
        lambda: _gpt2(1024, 24),
    ),
    "gpt2-xl": (
        "HF gpt2-xl config: n_embd 1600, n_layer 48, n_positions 1024, vocab 50257",
        1_557_611_200,
        lambda: _gpt2(1600, 48),
    ),
    "bert-base": (
        "HF bert-base-uncased config: hidden 768, 12 layers, intermediate 3072, vocab 30522, "
        "max_position 512, type_vocab 2; BertModel with pooler",
        109_482_240,
        _bert_base,
    ),
    "resnet50": (
        "torchvision resnet50: Bottleneck [3, 4, 6, 3], 1000 classes",
        25_557_032,
        _resnet50,
    ),
    "llama2-7b": (
        "Llama-2-7b config: hidden 4096, intermediate 11008, 32 layers, 32 heads, vocab "
        "32000, untied lm_head, torch_dtype float16; LlamaForCausalLM",
        6_738_415_616,
        lambda: _llama(4096, 11008, 32, 32000, "float16"),
    ),
    "vit-l16": (
        "timm vit_large_patch16_224 (= torchvision vit_l_16): patch 16, 224 px, width 1024, "
        "24 blocks, MLP 4096, 1000 classes; VisionTransformer",
        304_326_632,
        _vit_large_16,
    ),
    "mistral-7b": (
        "Mistral-7B-v0.1 config: hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV "
        "heads (grouped-query attention), vocab 32000, untied lm_head, torch_dtype bfloat16; "
        "MistralForCausalLM",
        7_241_732_096,
        lambda: _llama(4096, 14336, 32, 32000, "bfloat16", kv_hidden=1024),
    ),
    "mixtral-8x7b": (
        "Mixtral-8x7B-v0.1 config: hidden 4096, intermediate 14336, 32 layers, 8 experts, 32 "
        "heads, 8 KV heads, vocab 32000, untied lm_head, torch_dtype bfloat16; "
        "MixtralForCausalLM (transformers 4.x per-expert layout)",
        46_702_792_704,
        lambda: _mixtral(4096, 14336, 32, 8, 32000, kv_hidden=1024),
    ),
}


def _document(name: str) -> dict[str, Any]:
    source, expected, build = _MODELS[name]
    params = build()
    total = sum(_prod(shape) for _, shape, _, _ in params)
    if total != expected:  # generator bug, caught before anything is written
        raise RuntimeError(f"{name}: generated {total} params, published count is {expected}")
    return {
        "name": name,
        "source": source,
        "num_parameters": total,
        "params": [
            {"name": n, "shape": shape, "dtype": dtype, "requires_grad": rg}
            for n, shape, dtype, rg in params
        ],
    }


def _prod(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _render(name: str) -> str:
    """The exact text of a shape file: one parameter per line, so diffs stay readable."""
    doc = _document(name)
    rows = ",\n".join("    " + json.dumps(p, separators=(", ", ": ")) for p in doc["params"])
    head = {k: v for k, v in doc.items() if k != "params"}
    head_text = json.dumps(head, indent=2)[:-2]  # drop the closing "\n}"
    return f'{head_text},\n  "params": [\n{rows}\n  ]\n}}\n'


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out_dir = Path(args[0]) if args else Path(__file__).parent / "shapes"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _MODELS:
        (out_dir / f"{name}.json").write_text(_render(name))
        print(f"wrote {out_dir / (name + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
