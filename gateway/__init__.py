"""gateway service."""
