"""The model repository (Triton's and KServe's word): the models a server serves and where they
come from.

``models``: ``ModelRepository``, the models served now by name (lookups, the index, load and
unload at run time), one for both transports. ``directory``: ``ModelsDir``, a models directory
on disk (``paraloom serve --models-dir DIR``) and the configs and version policies in it.
``files``: ``ModelFiles``, the files a remote load may read, and the load parameters refused.
"""

from paraloom.serving.repository.directory import Found, ModelConfig, ModelsDir, VersionPolicy
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
    "check_load_parameters",
]
