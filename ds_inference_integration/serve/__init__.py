"""The step after sharding for a server: the same sharded model behind HTTP, batching across requests.

The front (`app`: the routes; `asgi`: the layers around them and the signals; `server`: its state; `batching`: the
queue and when a batch leaves; `replicas`: the rank processes it starts and watches; `bodies`: a body's bytes
decoded and checked off the event loop; `protocol`: the request bodies and their checks; `text`: completion text
and chat content as clients rebuild them; `settings`: the flags and the model directory; `metrics`) runs in one
process and talks to each replica's leader over `wire`; each replica's ranks run `engine`, which loads and shards
as predict does and generates in lock-step under each row's `rules` and `sampling`: by the step engine (`steps`,
with `slots` and `beams`) where it can, else the batch engine (one generate a batch). `ds-inference serve MODEL_DIR --tp_size T`
starts it (the `[serve]` extra)."""
