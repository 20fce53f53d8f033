"""The Open Inference Protocol (v2) over gRPC: ``inference.GRPCInferenceService`` on uvicorn's
HTTP/2 (``asgi``, ``http2``) or on grpcio's grpc.aio (``service``), with the same handlers."""
