"""What the student's distillation sees, measured inside real training steps (issue 50): for every
step of a distilled run, the teacher's accuracy on exactly the images the student trains on (its
augmented view) and on the batch's images before the step's own augmentation (the digits preset's
affine, applied in the step; the photos preset's crops and flips come with the batch, so the two
are the same there), the teacher logits' dtype, the size of the
two terms' gradients with respect to the student's logits (``w * T^2 * KL`` against
``(1 - w) * CE``) and the cosine between the step's gradient and the one the labels alone give.
The per-step numbers are summarised per epoch.

    python bench/distill_diagnose.py DATA TEACHER [--student timm:test_resnet] [--epochs 3]
        [--temperature T] [--weight W] [--mode online|cached] [--no-augment]

It wraps ``distill.Signal``'s two methods to look at their inputs and outputs and returns what
they return: the run is the run imgtrain would train. One torch thread, the local backend.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill import test_accuracy, train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data")
    parser.add_argument("teacher")
    parser.add_argument("--student", default="timm:test_resnet")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--weight", type=float, default=None)
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--no-augment", dest="augment", action="store_false")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    from imgtrain.data.tensors import to_model_input
    from imgtrain.training import distill

    torch.set_num_threads(1)
    steps, seen = [], {}
    logits_of, loss_of = distill.Signal.logits, distill.Signal.loss

    def logits(self, batch, x):
        taught = logits_of(self, batch, x)
        y = batch["label"]
        stored = None
        if self.teacher is not None:  # online: the batch's images before the step's affine, same teacher
            stored = self.teacher.logits_of_inputs(to_model_input(batch["image"], self.mean, self.std), self.mean, self.std)
        seen.update(y=y, on_view=(taught.argmax(1) == y).float().mean().item(), dtype=str(taught.dtype),
                    on_stored=None if stored is None else (stored.argmax(1) == y).float().mean().item())
        return taught

    def loss(self, student, teacher, hard):
        t, w = self.temperature, self.weight
        s = student.detach().float().requires_grad_(True)
        ce = F.cross_entropy(s, seen["y"], reduction="sum")  # the plain labels' term (no mixing in this check)
        kd = F.kl_div(F.log_softmax(s / t, 1), F.log_softmax(teacher.float() / t, 1), reduction="sum", log_target=True)
        g_alone = torch.autograd.grad(ce, s, retain_graph=True)[0]  # what the student alone follows
        g_kd = torch.autograd.grad(w * t * t * kd, s)[0]
        g_step = (1 - w) * g_alone + g_kd
        steps.append(dict(seen, g_ce=(1 - w) * g_alone.norm().item(), g_kd=g_kd.norm().item(),
                          cos=F.cosine_similarity(g_step.flatten(), g_alone.flatten(), 0).item(),
                          student=(student.argmax(1) == seen["y"]).float().mean().item()))
        return loss_of(self, student, teacher, hard)

    distill.Signal.logits, distill.Signal.loss = logits, loss
    more = {k: v for k, v in {"distill_temperature": args.temperature, "distill_weight": args.weight}.items() if v is not None}
    storage = Path(tempfile.mkdtemp(prefix="distill-diagnose-"))
    result, _, _ = train(Path(args.data), storage, "diagnosed", args.student, args.epochs, args.seed, teacher=args.teacher,
                         distill_mode=args.mode, augment=args.augment, **more)
    per_epoch = max(1, len(steps) // args.epochs)
    print(f"{len(steps)} steps; teacher logits {steps[0]['dtype']}; test accuracy {test_accuracy(result):.4f}")
    for e in range(args.epochs):
        part = steps[e * per_epoch:(e + 1) * per_epoch]
        mean = lambda key: statistics.mean(s[key] for s in part)  # noqa: E731
        stored = "-" if part[0]["on_stored"] is None else f"{mean('on_stored'):.3f}"
        print(f"epoch {e}: teacher right on the student's view {mean('on_view'):.3f}, before the step's augmentation {stored}; "
              f"student right {mean('student'):.3f}; |grad| w T^2 KL {mean('g_kd'):.2f}, (1 - w) CE {mean('g_ce'):.2f}; "
              f"cosine of the step's with the labels' alone {mean('cos'):.2f}")


if __name__ == "__main__":
    main()
