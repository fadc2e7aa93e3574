"""The scheduler service: SGLang's public gRPC API (``SglangScheduler`` from smg-grpc-proto) over the engine."""
