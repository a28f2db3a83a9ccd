"""decode_svc service."""
