"""Step 2, loading: the model built on meta, and each rank reading only its shard. `loaders`: `load_model` (full,
shard-aware, pre-sharded) and the `PendingLoad` the skeleton it returns carries to step 3; `skeleton`: the model
on meta; `keys`: which checkpoint tensor fills each parameter; `readers`: the loaders that read them; `checkpoint`:
the safetensors reader; `presharded`: the directory format of `ds-inference shard`; `slices`: the record of which
rows a split tensor keeps."""
