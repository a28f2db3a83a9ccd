"""prefill_svc service."""
