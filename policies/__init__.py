"""The shipped injection policies (one TOML file per model family). Installed as the package
`ds_inference_integration.policies` (pyproject.toml maps this directory there); read with
`importlib.resources`, so an installed wheel finds them as a checkout does."""
