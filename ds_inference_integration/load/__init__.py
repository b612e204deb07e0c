"""Step 2, loading: the model built on meta, and each rank reading only its shard. `loaders`: `load_model` and
the loaders (full, shard-aware, pre-sharded); `checkpoint`: the safetensors reader; `presharded`: the
directory format of `ds-inference shard`; `slices`: the record of which rows a split tensor keeps."""
