"""Serving with the Open Inference Protocol (v2, KServe / Triton compatible), HTTP and gRPC.

``create_app(pool_or_model, name=...)`` builds a Starlette app over a ``ParallelInference`` pool;
``create_repository_app(models_dir)`` one over every model in a directory; ``serve(...)`` runs
it under uvicorn (``grpc_port=`` adds the gRPC endpoint); ``ServerThread`` runs it in the
background. Needs the ``serve`` extra: ``pip install paraloom[serve]``.
"""

from paraloom.serving.app import create_app, create_repository_app
from paraloom.serving.datatypes import DATATYPES
from paraloom.serving.server import ServerThread, serve
from paraloom.serving.signature import ModelSignature, TensorSpec, infer_signature

__all__ = [
    "DATATYPES",
    "ModelSignature",
    "ServerThread",
    "TensorSpec",
    "create_app",
    "create_repository_app",
    "infer_signature",
    "serve",
]
