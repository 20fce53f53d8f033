"""A handler for ``paraloom serve --models-dir DIR --allow-handlers``: text in, a label and a
score out, around a model that takes 16 features per row (here, letter frequencies).

Put it beside the weights: ``DIR/sentiment/handler.py`` and ``DIR/sentiment/model.safetensors``
(``paraloom.save(MLP(in_features=16, hidden=[8], num_classes=2), ...)``).
"""

import numpy as np
import torch

INPUTS = [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
OUTPUTS = [{"name": "label", "datatype": "BYTES", "shape": [-1]},
           {"name": "score", "datatype": "FP32", "shape": [-1]}]
LABELS = np.array(["negative", "positive"], dtype=object)


def features(text: bytes) -> np.ndarray:
    counts = np.zeros(16, np.float32)
    for byte in text.lower():
        counts[byte % 16] += 1
    return counts / max(1, len(text))


def preprocess(inputs: dict[str, np.ndarray]) -> torch.Tensor:
    """One request's strings (a numpy array of bytes) -> the model's input rows."""
    if any(len(text) == 0 for text in inputs["text"]):
        raise ValueError("an empty text has no sentiment")
    return torch.from_numpy(np.stack([features(text) for text in inputs["text"]]))


def postprocess(logits: torch.Tensor) -> dict[str, np.ndarray]:
    """The model's output for those rows -> every output OUTPUTS declares."""
    score, index = torch.softmax(logits, dim=1).max(dim=1)
    return {"label": LABELS[index.numpy()], "score": score.numpy()}
