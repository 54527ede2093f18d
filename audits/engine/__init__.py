"""The engine: evaluates cases on kernels (``evaluate``), in worker processes (``worker``), with a
journal that survives a crash (``journal``) and shards across processes and GPUs (``shards``)."""
