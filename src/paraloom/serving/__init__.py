"""HTTP serving with the Open Inference Protocol (v2, KServe / Triton compatible).

``create_app(pool_or_model, name=...)`` builds a Starlette app over a ``ParallelInference`` pool;
``serve(...)`` runs it under uvicorn; ``ServerThread`` runs it in the background. Needs the
``serve`` extra: ``pip install paraloom[serve]``.
"""

from paraloom.serving.app import create_app
from paraloom.serving.datatypes import DATATYPES
from paraloom.serving.server import ServerThread, serve
from paraloom.serving.signature import ModelSignature, TensorSpec, infer_signature

__all__ = [
    "DATATYPES",
    "ModelSignature",
    "ServerThread",
    "TensorSpec",
    "create_app",
    "infer_signature",
    "serve",
]
