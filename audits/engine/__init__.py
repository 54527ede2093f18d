"""The engine: one run (``audit``) under its options (``options``), evaluating cases on kernels
(``evaluate``), each kernel in this process or a worker process (``worker``), with a journal that
survives a crash (``journal``), spread over ``--jobs`` child processes (``jobs``, ``child``) and
sharded across processes and GPUs (``shards``); why a run stopped early (``stop``)."""
