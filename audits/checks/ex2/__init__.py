"""The exp2 emulation audit: exhaustive sweeps, PTX reading and their reports (docs/ex2.md)."""
