"""Generated gRPC stubs for proto/*.proto (see tools/gen_proto.py)."""
