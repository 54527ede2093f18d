"""Fidelity: the FA4 numerics model against production, call for call (docs/model-and-fidelity.md)."""
