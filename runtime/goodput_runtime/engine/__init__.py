"""The engine: a step is schedule → execute → update (``core``), driven by ``async_engine`` for the
server, which sees it through ``client.EngineClient``. Bookkeeping (scheduler, block manager, sequences)
is plain Python; ``model_runner`` is the only owner of tensors."""
