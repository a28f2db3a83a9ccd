"""Generated protobuf and gRPC code; regenerate with ``python -m protos.generate``.

Do not edit the ``*_pb2*`` files by hand: tests/unit/test_protos_drift.py fails when
they differ from what the ``.proto`` sources give.
"""
