"""The gRPC front end: the server (`server`: `meshserve.v1.Generation`, health and reflection, on
the engine loop), the Python clients (`client`), structured output on the wire
(`structured_messages`), the service definition (`proto/`) and its generated stubs (`stubs/`,
written by scripts/gen_protos.py).
"""
