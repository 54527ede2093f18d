"""Reports: the record of a run (``build``, ``schema``), its renderings (markdown in ``build``,
``html``, error ``maps``, the one-line ``summary``) and the commands that reproduce a case."""
