"""The step after sharding for a server: the same sharded model behind HTTP, batching across requests.

The front (`app`: the routes; `server`: its state; `batching`: the queue and when a batch leaves; `replicas`:
the rank processes it starts and watches; `protocol`: the request bodies and their checks; `metrics`) runs in
one process; each replica's ranks run `engine`, which loads and shards as predict does and generates in
lock-step. `ds-inference serve MODEL_DIR --tp_size T` starts it (the `[serve]` extra)."""
