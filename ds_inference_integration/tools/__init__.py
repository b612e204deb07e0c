"""Our tools, apart from the library a user's script imports: the `ds-inference` commands (`cli`), the policy
checker (`policy_check`), the command that writes pre-sharded directories (`shard_command`), the benchmarks
(`bench`, `bench_memory`) and the one way they start, watch and end local ranks (`ranks`)."""
