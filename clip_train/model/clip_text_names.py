"""The weights of open_clip's CLIP text transformer (``TextTransformer``) under their names in
transformers' ``CLIPTextModel``, one table read both ways: by ``init_from=open_clip:`` and by the export.

open_clip's attention keeps the query, key and value projections stacked in one ``in_proj`` tensor
(rows q, k, v), transformers keeps three; its ``text_projection`` is applied as ``x @ P``, so the
run's ``text.proj.weight`` is ``P`` transposed.
"""

from __future__ import annotations

from transformers import CLIPTextConfig

# open_clip's name inside resblock i → the CLIPTextModel names inside encoder.layers.i ({p}: weight, bias)
BLOCK = {
    "ln_1.{p}": ("layer_norm1.{p}",),
    "attn.in_proj_{p}": ("self_attn.q_proj.{p}", "self_attn.k_proj.{p}", "self_attn.v_proj.{p}"),
    "attn.out_proj.{p}": ("self_attn.out_proj.{p}",),
    "ln_2.{p}": ("layer_norm2.{p}",),
    "mlp.c_fc.{p}": ("mlp.fc1.{p}",),
    "mlp.c_proj.{p}": ("mlp.fc2.{p}",),
}
OUTSIDE_BLOCKS = {
    "token_embedding.weight": ("embeddings.token_embedding.weight",),
    "positional_embedding": ("embeddings.position_embedding.weight",),
    "ln_final.weight": ("final_layer_norm.weight",),
    "ln_final.bias": ("final_layer_norm.bias",),
}
PROJECTION = "text_projection"  # (width, embed_dim) in open_clip, the run's text.proj.weight transposed


def encoder_names(layers: int) -> dict[str, tuple[str, ...]]:
    """open_clip's names relative to its text tower → the ``CLIPTextModel`` names they stack, in order."""
    names = dict(OUTSIDE_BLOCKS)
    for i in range(layers):
        for theirs, ours in BLOCK.items():
            for p in ("weight", "bias"):
                names[f"transformer.resblocks.{i}.{theirs.format(p=p)}"] = tuple(
                    f"encoder.layers.{i}.{name.format(p=p)}" for name in ours
                )
    return names


def open_clip_text_cfg(config: CLIPTextConfig, context_length: int) -> dict:
    """open_clip's ``text_cfg`` for the same transformer (QuickGELU is a model-level flag there) with
    ``context_length`` positions, which open_clip's tokenizer then pads and truncates to."""
    return {
        "context_length": context_length,
        "vocab_size": config.vocab_size,
        "width": config.hidden_size,
        "heads": config.num_attention_heads,
        "layers": config.num_hidden_layers,
        "mlp_ratio": config.intermediate_size / config.hidden_size,
        "norm_kwargs": {"eps": config.layer_norm_eps},
    }
