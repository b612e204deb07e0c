"""Step 3, sharding: `deepspeed.init_inference` in place, with what DeepSpeed cannot split done here first.
`setup`: `setup_inference`, everything one rank does before predicting; `inject`: `shard_model`; `attention`,
`experts`, `mixers`: head, expert and state-space splits; `reduction`: fp32 sums of row-parallel partials;
`weight_share`: what each rank holds against the policy's target."""
