"""``fa4-audit invariance``: batch and decode invariance of fixed-length kernels (docs/invariance.md)."""
