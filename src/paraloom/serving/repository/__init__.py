"""The model repository (Triton's and KServe's word): the models a server serves and where they
come from.

``models``: ``ModelRepository``, the models served now by name (lookups, the index, load and
unload at run time), one for both transports. ``directory``: ``ModelsDir``, a models directory
on disk (``paraloom serve --models-dir DIR``); ``config``: a model's config and version policy.
``files``: ``ModelFiles``, the files a remote load may read, and the load parameters refused.
"""

from paraloom.serving.repository.config import ModelConfig, VersionPolicy
from paraloom.serving.repository.directory import Found, ModelsDir, Versions
from paraloom.serving.repository.files import ModelFiles, check_load_parameters
from paraloom.serving.repository.models import IndexEntry, ModelRepository

__all__ = [
    "Found",
    "IndexEntry",
    "ModelConfig",
    "ModelFiles",
    "ModelRepository",
    "ModelsDir",
    "VersionPolicy",
    "Versions",
    "check_load_parameters",
]
