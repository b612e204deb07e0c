"""Step 1, the policy: which linears of a layer are row-parallel, how attention heads are laid out, what stays
whole. `schema`: the policy files and their checks against the real model; `derive`: a policy for an
architecture without a file; `kinds`: what a module is (packed experts, a router, a state-space mixer);
`layers`: what a model's repeated layers are made of (each kind of layer is derived, split and checked on its own);
`verify`: a policy nobody has checked, checked numerically against the unsharded layers; `configs`: a model's
config read alike everywhere (its text part)."""
