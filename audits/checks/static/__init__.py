"""The static audit: production's compiled kernels read as instruction facts (docs/static.md)."""
