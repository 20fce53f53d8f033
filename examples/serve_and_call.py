"""Serve a model over the Open Inference Protocol (v2) and call it over HTTP with the standard
library alone (tritonclient and curl work the same way).

    python examples/serve_and_call.py
"""

import json
import urllib.request

import torch

from paraloom.models import LeNet
from paraloom.serving import ServerThread, create_app


def call(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


if __name__ == "__main__":
    torch.manual_seed(0)
    model = LeNet(image_size=8).eval()
    with ServerThread(create_app(model, name="lenet", workers=2)) as server:
        meta = call(f"{server.url}/v2/models/lenet")
        print("inputs", meta["inputs"])
        answer = call(f"{server.url}/v2/models/lenet/infer", {"inputs": [
            {"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.5] * 64}]})
    output = answer["outputs"][0]
    with torch.no_grad():
        expected = model(torch.full((1, 1, 8, 8), 0.5))[0]
    print("output", output["name"], output["shape"])
    print("equals the model's own:", torch.allclose(torch.tensor(output["data"]), expected,
                                                     atol=1e-5))
