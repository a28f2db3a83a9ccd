"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar),
compiled by llguidance for the model's tokenizer and enforced token by token in the
engine's sampler (docs/structured-outputs.md)."""
