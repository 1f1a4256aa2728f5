"""How sharp does synchronous training make the loss, against what a delay tolerates?

Trains the MNIST residual CNN of ``configs/mnist.yaml`` with plain SGD, synchronously, and
every ``--every`` steps estimates the top Hessian eigenvalue of the training loss by power
iteration (Hessian-vector products on ``--probe`` batches). Prints it next to ``2/lr``,
where synchronous gradient descent stops being stable, and the bound for gradients ``tau``
updates old (:func:`pipemare.optim.stability.delayed_gd_bound`)::

    python -m pipemare.experiments.studies.sharpness --lr 0.05 --delay 7

Sharpness that climbs to ``2/lr`` whatever ``lr`` is (Cohen et al., "Gradient descent on
neural networks typically occurs at the edge of stability", ICLR 2021) is why a smaller
learning rate does not rescue a deeply delayed pipeline.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from pipemare.experiments.tasks.classifiers import mnist_resnet
from pipemare.experiments.tasks.datamodules import MNISTDataModule
from pipemare.optim.stability import delayed_gd_bound


def top_eigenvalue(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], iterations: int = 30
) -> float:
    """The Hessian eigenvalue of largest magnitude of the mean loss over ``batches``."""
    params = [p for p in model.parameters() if p.requires_grad]
    v = [torch.randn_like(p) for p in params]
    estimate = 0.0
    for _ in range(iterations):
        norm = torch.sqrt(sum((a * a).sum() for a in v))
        v = [a / norm for a in v]
        hv = [torch.zeros_like(p) for p in params]
        for x, y in batches:
            loss = nn.functional.cross_entropy(model(x), y)
            grads = torch.autograd.grad(loss, params, create_graph=True)
            dot = sum((g * a).sum() for g, a in zip(grads, v, strict=True))
            for acc, h in zip(hv, torch.autograd.grad(dot, params), strict=True):
                acc += h / len(batches)
        estimate = float(sum((h * a).sum() for h, a in zip(hv, v, strict=True)))
        v = hv
    return estimate


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--every", type=int, default=60, help="steps between estimates")
    parser.add_argument("--probe", type=int, default=4, help="batches of 64 in the estimate")
    parser.add_argument("--delay", type=int, default=7, help="the delay to compare with")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    data = MNISTDataModule()
    data.setup()
    probe = [b for _, b in zip(range(args.probe), data.train_dataloader(), strict=False)]
    model = mnist_resnet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    bound = delayed_gd_bound(args.delay) / args.lr
    print(f"stable sharpness: synchronous < {2 / args.lr:.1f}, delay {args.delay} < {bound:.1f}")
    step = 0
    for _ in range(args.epochs):
        for x, y in data.train_dataloader():
            if step % args.every == 0:
                print(f"step {step:4d}  top Hessian eigenvalue {top_eigenvalue(model, probe):8.2f}")
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            step += 1


if __name__ == "__main__":
    main()
