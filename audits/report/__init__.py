"""Reports: the record of a run (``build``; its case records, ``records``; its shape and the
upgrades of what older versions wrote, ``schema``), its renderings (markdown in ``build``,
``html``, error ``maps``, the one-line ``summary``) and the commands that reproduce a case."""
