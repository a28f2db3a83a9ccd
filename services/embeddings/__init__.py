"""The content-addressed image-embedding store shared by encoder, prefill and gateway."""
