"""Answer 64 threads at once with 2 replicas: concurrent requests are merged into batches.

    python examples/parallel_inference.py
"""

import threading

import torch

from paraloom import ParallelInference
from paraloom.datasets import digits
from paraloom.models import LeNet

if __name__ == "__main__":
    torch.manual_seed(0)
    model = LeNet(image_size=8).eval()
    x = digits("test").tensors[0]
    outputs: list[torch.Tensor | None] = [None] * 64
    with ParallelInference(model, inference_mode="batched", workers=2, batch_limit=32,
                           example_input=x[:1]) as pi:
        def client(i: int) -> None:
            outputs[i] = pi.output(x[i: i + 1])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        histogram = pi.stats()["batch_size_histogram"]
    with torch.no_grad():
        expected = model(x[:64])
    got = torch.cat([o for o in outputs if o is not None])
    print(f"answers equal the model's own: {torch.allclose(got, expected, atol=1e-5)}")
    print(f"batch sizes: {histogram}")
