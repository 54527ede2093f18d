"""What a run audits: the named suites and their cases (``cases``), a kernel's declared domain
(``domain``), suite files (``suite_file``), the case selection every subcommand shares
(``selection``), the input families (``inputs``) and the Hypothesis strategies (``strategies``)."""
