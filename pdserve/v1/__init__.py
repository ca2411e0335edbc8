"""Generated protobuf/gRPC stubs for the ``pdserve.v1`` API.

Do not edit the ``*_pb2*.py(i)`` files by hand; regenerate them from
``proto/pdserve/v1/*.proto`` with ``python scripts/gen_protos.py``.
"""
