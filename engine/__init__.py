"""ordinal's engine: behaviour as a library (no grpc imports).

The services under ``services/`` translate protos to these types and delegate here.
"""
