"""Generated gRPC stubs: run scripts/gen_protos.py."""
