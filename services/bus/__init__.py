"""The wire layer every service stands on (NATS + protobuf).

- ``subjects``: every subject and queue-group name.
- ``connection``: ``Bus``, one NATS connection per process (request/publish/subscribe);
  ``client_options``: its reconnect policy and logging callbacks.
- ``handlers``: ``Incoming`` messages and the crash-proof handler runner.
- ``messages`` / ``codec``: protobuf encode/decode; validated tensors (codec imports torch).
- ``chunked`` / ``chunk_receiver``: flow-controlled transfer of payloads > max_payload
  (``chunk_wire``: frame layout; ``chunk_inbox``: the per-bus ack inbox).
- ``heartbeat``: load heartbeats and the ``InstanceRegistry`` that routers read.
- ``deadline``, ``errors``: unix-ms deadlines; the ``BusError`` family.

Nothing is imported here, so ``import services.bus.subjects`` stays torch-free.
"""
