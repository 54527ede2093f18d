"""What a run audits: a case (``case``), the named suites each defined once as a function of the
domain they are built in (``cases``; their mod and varlen cases in ``mod_cases`` and
``varlen_cases``, the release axes and how rows are placed in a domain in ``axes``), a kernel's
declared domain (``domain``), suite files (``suite_file``), the case selection every subcommand
shares (``selection``), the input families (``inputs``) and the Hypothesis strategies
(``strategies``)."""
