"""Speculative decoding: proposers (n-gram, EAGLE), verification and KV rollback."""
