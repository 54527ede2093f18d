"""Verdicts: the gate and its thresholds (its structured ``findings``), the diagnosis of failing
cases, the separators that tell failing from passing cases, and coverage of the declared domain."""
