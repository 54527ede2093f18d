"""``fa4-audit invariance``: batch, decode, split-KV, paged-KV and pack_gqa invariance of a kernel's
output and LSE, measured and predicted by a model (docs/invariance.md)."""
