"""Published models' shapes as presets of the one config (Net's fields): counted, planned and trained through
their model's spec like any other run (python -m spmd.plan --preset NAME).

Each is (its title, the fields). `seq` is the context a training step runs at.
"""

from __future__ import annotations

from spmd.model.llama import llama_ffn

PRESETS: dict[str, tuple[str, dict]] = {
    # Meta's Llama 3 model card / params.json: ffn_dim_multiplier 1.3, multiple_of 1024 (8B) and 4096 (70B)
    "llama3-8b": (
        "Llama 3 8B",
        dict(model="llama", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192),
    ),
    "llama3-70b": (
        "Llama 3 70B",
        dict(model="llama", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=8192),
    ),
    # torchtitan's debug model: dim 256, 6 layers, 16 heads (kv heads = heads), vocab 2048, ffn by Llama's rule
    # with multiple_of 256 (768); its debug training runs at seq_len 2048
    "debug": (
        "torchtitan's debug Llama",
        dict(model="llama", layers=6, hidden=256, heads=16, kv_heads=16, ffn=llama_ffn(256), vocab=2048, seq=2048),
    ),
    # xai-org/grok-1's model.py: 64 layers, emb 6144, 48 query and 8 kv heads of 128, 8 experts top-2 of widening
    # factor 8 (32768 with its rounding), vocab 131072, seq 8192, the embedding tied to the head. Counted here with
    # spmd's block (2 RMSNorms, SwiGLU experts); Grok-1's 4 norms a block add 2 x 64 x 6144 = 0.8 M
    "grok-1": (
        "Grok-1",
        dict(
            model="llama",
            layers=64,
            hidden=6144,
            heads=48,
            kv_heads=8,
            ffn=32768,
            vocab=131072,
            tie_embeddings=True,
            seq=8192,
            experts=8,
            top_k=2,
        ),
    ),
    # OpenAI's GPT-2 small (the 2019 paper's 117M; 124M as counted with its position table)
    "gpt2-124m": (
        "GPT-2 124M",
        dict(model="gpt2", layers=12, hidden=768, heads=12, ffn=3072, vocab=50257, seq=1024, tie_embeddings=True),
    ),
}
