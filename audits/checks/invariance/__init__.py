"""``fa4-audit invariance``: batch, decode, split-KV, paged-KV and pack_gqa invariance of a kernel's
output and LSE, measured and predicted by a model, and (``--mods``) the mod properties
block-sparse vs dense and mask_mod / score_mod vs the flags (docs/invariance.md)."""
