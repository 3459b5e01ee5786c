"""The generated kvpool.v1 stubs, with a clear error when the build has not generated them."""

try:
    from kvpool.v1 import attach_pb2, kvpool_pb2, kvpool_pb2_grpc, layout_pb2  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvpool: the generated stubs (kvpool.v1.*_pb2) are not importable: build the "
        "`kvpool_python` target (cmake --build <build>) and put <build>/python on PYTHONPATH "
        f"beside client/python ({e})"
    ) from e

__all__ = ["attach_pb2", "kvpool_pb2", "kvpool_pb2_grpc", "layout_pb2"]
