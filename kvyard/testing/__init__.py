"""What tests, benchmarks and the demo build on: small models with random weights, a local tokenizer,
and simulated replicas served from a background thread."""
