"""cache_svc service."""
