"""encoder_svc service."""
