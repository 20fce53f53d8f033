"""The Open Inference Protocol (v2) over gRPC: ``inference.GRPCInferenceService`` on grpcio."""
