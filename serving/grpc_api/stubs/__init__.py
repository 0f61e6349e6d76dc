"""Generated gRPC stubs of `meshserve/v1/generation.proto` (scripts/gen_protos.py writes them)."""
