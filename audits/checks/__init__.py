"""The audits beside the case runner, each a library that the command line (``audits.cli``)
drives: ``ex2`` (the exp2 emulation swept bit for bit), ``fidelity`` (model against production),
``static`` (production's compiled kernels read as instructions), ``invariance`` (properties across
calls) and ``fuzz`` (a Hypothesis search over cases)."""
