"""Training configuration: one typed dataclass, the only place a setting is defined.

Each field is declared with ``setting(default, doc, ...)`` (``settings.py``): its description
(the first sentence becomes the ``--help`` line and ``config show``), its command-line flag, the
values or range it accepts, whether it may change when a run is resumed or a sweep run again,
its row in the model card, and whether a tracker may be told it as it is. The ``train`` and
``tune`` options, the config file parser, ``config show``, ``validate``, a sweep's identity
(``sweep/request.py``), the model card's recipe and the config trackers get are all generated
from these fields, so adding a setting is one line here (docs/development.md, "Adding a setting").

The worker boundary is a plain dict (``dataclasses.asdict``) turned back into a
``TrainConfig`` at once on the other side (``TrainConfig(**d)``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass

from imgtrain.checkpoint_policy import DEFAULT_METRIC, SELECTION_METRICS
from imgtrain.errors import ImgtrainError
from imgtrain.ops.files import name_problem
from pathlib import Path

from imgtrain.settings import RUNS, Setting, option, setting, settings_of

BACKENDS = ("ray", "local")
INGESTS = ("ray-data", "torch")
OPTIMIZERS = ("adamw", "sgd", "lamb", "lars")
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("onecycle", "cosine", "step", "constant")  # each one's curve: training/recipe.py
AUGMENT_POLICIES = ("none", "randaugment", "trivialaugment", "autoaugment")  # each one's transform: data/photo_augment.py
STRATEGIES = ("ddp", "fsdp")
WANDB_FORBIDDEN = "/\\#?%:"  # W&B refuses these in project names


def parse_workers(text: str) -> tuple[int, int]:
    """'2' -> (0, 2): a fixed world size; '1-4' -> (1, 4): elastic. (min_workers, workers)"""
    low, sep, high = str(text).partition("-")
    try:
        return (int(low), int(high)) if sep else (0, int(low))
    except ValueError:
        raise ImgtrainError(f"--workers {text!r} is not a number N or a range MIN-MAX such as 1-4") from None


AUTO = "auto"
AUTO_LR = AUTO  # --lr auto: lr-find's suggestion (training/lr_find.py), decided before the run starts
LR_GIVEN = "given"  # lr_source of an LR the user set (a flag or a config file): never scaled for them
FIT_BATCH = AUTO  # --batch-size auto: the largest that fits the memory (training/batch_fit.py)


def _number_or_auto(cast, flag: str, kind: str):
    """The parser of a flag that takes ``auto`` or a number (``cast``): 'auto' -> AUTO."""
    def parse(text: str):
        if str(text).strip().lower() == AUTO:
            return AUTO
        try:
            return cast(text)
        except ValueError:
            raise ImgtrainError(f"{flag} {text!r} is not {kind} or auto") from None
    return parse


parse_lr = _number_or_auto(float, "--lr", "a number")  # its range is checked with the others
parse_batch_size = _number_or_auto(int, "--batch-size", "a whole number")  # 0: chosen from the split's size
AUTO_PARSERS = {"lr": parse_lr, "batch_size": parse_batch_size}  # the fields that take auto


@dataclass
class TrainConfig:
    data: str = setting("", "Prepared data set directory (``imgtrain data prepare ...``); not needed to resume.",
                        place=True)
    name: str = setting("", "Run name; the run lives in ``{storage}/{name}``. Same name again resumes.")
    storage: str = setting(RUNS, "Where runs live: a local path, a shared filesystem path (NFS) on a cluster, "
                           "or an object store (``s3://bucket/prefix``; endpoint and credentials from the environment).",
                           resumable=True, place=True)

    backend: str = setting("ray", "Where the loop runs: ``ray`` (Ray Train workers) or ``local`` (one plain "
                           "PyTorch process).", choices=BACKENDS)
    ingest: str = setting("ray-data", "How rows reach the workers: ``ray-data`` (Ray Data) or ``torch`` (Parquet "
                          "files into a DataLoader). Either way each worker takes its share of every global batch "
                          "in the run's one seeded order.", choices=INGESTS)
    strategy: str = setting("ddp", "How the workers hold the model: ``ddp`` (each holds all of it, gradients are "
                            "averaged) or ``fsdp`` (FSDP2: each holds 1/N of the weights, gradients, optimizer state "
                            "and weight average; a block's weights are gathered only while it runs). Checkpoints "
                            "hold the plain model.pt either way; a run keeps its strategy when resumed.",
                            choices=STRATEGIES)
    workers: int = setting(2, "Data-parallel training workers: N, or MIN-MAX for elastic training (continues with "
                           "fewer when nodes leave, grows back when they return).", range="[1, 10000]", resumable=True,
                           recipe=17, metavar="N|MIN-MAX", parse=parse_workers)
    min_workers: int = setting(0, "Elastic training (``--workers MIN-MAX``): the fewest workers to go on with when "
                               "nodes leave; 0 = a fixed ``workers``. The global batch stays the same at every "
                               "world size.", range="[0, 10000]", resumable=True, cli=False)
    use_gpu: bool = setting(False, "One GPU per worker, or CPUs only. Fails fast when the cluster has too few GPUs.",
                            flag="--gpu/--cpu", resumable=True)
    cpus_per_worker: float = setting(1.0, "Logical CPUs each worker reserves in Ray. Threads are set separately "
                                     "(threads_per_worker).", range="(0, 1024]", resumable=True)
    threads_per_worker: int = setting(0, "torch intra-op threads per worker; 0 = this node's cores divided by "
                                      "workers on it, or 2 for a worker on a GPU (its host work is small).", range="[0, 1024]", resumable=True)
    address: str | None = setting(None, "Ray cluster to join (``HOST:6379``, ``auto``, ``ray://host:10001``); unset "
                                  "starts a local cluster.", resumable=True, run_only=True)
    preprocess_cpus: int = setting(0, "CPUs each worker's data pipeline decodes and augments with (streamed data "
                                   "sets); 0 = the logical CPUs the training workers leave free, shared among them.",
                                   range="[0, 1024]", resumable=True)
    decode: str = setting("cpu", "Photos stored as JPEG: where they are decoded and augmented. ``cpu``: in the "
                          "decoding tasks; ``gpu``: on each worker's GPU (nvJPEG, the same crops, flips and policy "
                          "operations from the same seeds, pixels within a grey level or two); ``auto``: the GPU when "
                          "each GPU has fewer CPUs than the augmentation policy needs to feed it (docs/training.md), "
                          "the CPUs otherwise and on CPU-only workers. May change when a run is resumed.",
                          choices=("cpu", "gpu", "auto"), resumable=True)
    dashboard: bool = setting(False, "Start the Ray dashboard with a local cluster (about ten more processes; off to "
                              "start fast).", resumable=True, run_only=True)

    model: str = setting("resnet18", "The architecture: a torchvision classification model (resnet18/34/50, "
                         "mobilenet_v3_small/large, efficientnet_b0, convnext_tiny, vit_b_16, ...) or ``timm:NAME`` "
                         "(``pip install 'imgtrain[timm]'``). The first layer takes the data set's channels and the "
                         "classifier its classes. The default is the tutorial's ResNet-18.", recipe=1)
    stem: str = setting("auto", "The model's first layers: ``standard``; ``small`` for small images (a 3x3 "
                        "stride-1 first convolution and no max-pool, as CIFAR ResNets have: more resolution kept, "
                        "about 16x the compute of a ResNet's standard stem); ``auto``: small for images of at most "
                        "16 px a side, standard otherwise (28x28 MNIST keeps the tutorial's model).",
                        choices=("auto", "standard", "small"))
    init_from: str | None = setting(None, "Start from these weights: a state-dict file (.pt/.pth/.safetensors, e.g. "
                                    "torchvision's or timm's) or an imgtrain run or checkpoint folder. Tensors are "
                                    "matched by name; the first convolution is adapted to the channels, the "
                                    "classifier made new for another class count; a file for another "
                                    "architecture is refused.", place=True)
    pretrained: bool = setting(False, "Start from the model's published ImageNet weights (downloaded once into "
                               "torch's hub cache; offline, fails at once: use --init-from with a file).", recipe=2)
    freeze_backbone: int = setting(0, "Train only the classifier for the first N epochs (the other weights stay "
                                   "as loaded; BatchNorm statistics still adapt).", range="[0, 100000]")
    backbone_lr_scale: float = setting(1.0, "The learning rate of every layer but the classifier, as a fraction of "
                                       "--lr (fine-tuning: 0.1 is usual).", range="(0, 1]")

    teacher: str | None = setting(None, "Knowledge distillation: a teacher the student learns from, beside the "
                                  "labels (its outputs softened by --distill-temperature): a run (its name in "
                                  "--storage, or its folder), a checkpoint or an export folder, whose classes are "
                                  "the data set's (docs/training.md, \"Distillation\").", place=True,
                                  metavar="RUN|PATH", help="Distil from this teacher: a run, checkpoint or export "
                                                           "whose softened outputs the student learns beside the labels.")
    distill_temperature: float = setting(1.0, "Distillation: the temperature both models' logits are divided by "
                                         "before their softmaxes are compared (Hinton et al. 2015). 1: the student "
                                         "learns the teacher's probabilities as they are. CIFAR-100's long schedules "
                                         "use 4, whose flattened targets cost a student trained for a few epochs "
                                         "10 points; chosen on val: docs/training.md.", range="(0, 100]")
    distill_weight: float = setting(0.5, "Distillation: the weight of the KL term (scaled by T^2, Hinton's rule, so "
                                    "its gradients keep their size whatever T); the labels' cross-entropy gets "
                                    "1 - this.", range="[0, 1]")
    distill_mode: str = setting("auto", "Distillation: ``cached`` (the teacher's logits of every training image "
                                "computed once, stored beside the data set and looked up by row id), ``online`` "
                                "(the teacher runs on every step's own images, in each worker) or ``auto``: "
                                "online when --augment, --mixup or --cutmix make every step's images new, cached "
                                "otherwise.", choices=("auto", "cached", "online"),
                                help="Distillation: cached (the teacher's logits computed once, beside the data set), "
                                     "online (the teacher at every step), or auto: online when the images are "
                                     "augmented or mixed.")
    teacher_sha256: str = setting("", "The sha256 of the teacher's model file as the run began: a resumed run "
                                  "refuses a teacher changed since.", cli=False)
    distillation: str = setting("", "The teacher a distilled run learnt from: its location, checksum, mode, "
                                "temperature and weight, as the run began; empty otherwise.", cli=False, recipe=21)

    epochs: int = setting(12, "Passes over the training split.", range="[1, 100000]", resumable=True, recipe=3)
    batch_size: int = setting(0, "Global batch size, split across workers; 0 (the default) chooses it from the "
                              "training split: 128, halved while an epoch would have fewer than 8 steps, not below "
                              "16, and a split too small for 8 steps of 16 cut into equal steps (rows // steps). "
                              "The run's config.json keeps the batch chosen; a resumed run trains on with it. When "
                              "it does not divide, the first ``batch_size % workers`` ranks take one extra sample, "
                              "so the global batch is exact. An epoch is ``train rows // batch_size`` steps at "
                              "every world size. ``auto``: the largest power of two (up to 1,024, and 8 steps an "
                              "epoch) whose training step fits the memory: tried on the GPU, estimated on a CPU "
                              "from one measured step and the free memory; the LR then scales with it unless --lr "
                              "is given (docs/training.md).", range="[0, 1048576]", recipe=4,
                              metavar="N|auto", parse=parse_batch_size,
                              help="Global batch size, split across workers. 0 (the default): chosen from the "
                                   "training split's size (128, less for a small split), the same on every machine; "
                                   "auto: the largest power of two whose training step fits this machine's memory "
                                   "(tried on the GPU, estimated on a CPU), the LR scaled with it unless --lr is "
                                   "given; the run records the batch chosen.")
    batch_source: str = setting("", "How the run's batch size was chosen when --batch-size auto chose it: the "
                                "figures it was decided from; empty otherwise.", cli=False, recipe=20)
    optimizer: str = setting("adamw", "The optimizer: ``adamw``, ``sgd`` (Nesterov, --momentum), or ``lamb`` or "
                             "``lars`` for large global batches (timm's: ``pip install 'imgtrain[timm]'``). LAMB and "
                             "LARS leave biases and normalisation weights undecayed, as timm does; LAMB clips the "
                             "gradient norm to 1, timm's default.", choices=OPTIMIZERS, recipe=6)
    momentum: float = setting(0.9, "Momentum of ``sgd`` and ``lars`` (the one-cycle schedule cycles it between "
                              "0.85 and 0.95 itself; AdamW and LAMB use their betas).", range="[0, 1)")
    lr: float = setting(3e-3, "Peak learning rate of the schedule. ``auto``: the learning-rate range test's "
                        "suggestion (``imgtrain lr-find``), run first on the training split; with --batch-size auto "
                        "and no --lr, the default scaled with the batch (docs/training.md).", range="(0, 10]",
                        recipe=5, metavar="LR|auto", parse=parse_lr)
    lr_source: str = setting("", "How the run's LR was chosen: ``lr-find ...`` (--lr auto), ``scaled ...`` "
                             "(--batch-size auto, no --lr) or ``given`` (--lr, or ``lr`` in a config file: a "
                             "library caller sets it to keep its LR as it is); empty otherwise.", cli=False, recipe=19)
    weight_decay: float = setting(0.05, "Weight decay: decoupled for AdamW, L2 for SGD (where about 5e-4 is "
                                  "usual).", range="[0, 10]", recipe=8)
    schedule: str = setting("onecycle", "LR schedule, stepped every optimizer step: ``onecycle`` (torch's "
                            "OneCycleLR, warm-up by --warmup-fraction), ``cosine`` (to --min-lr at the end), ``step`` "
                            "(times --decay-rate every --decay-epochs epochs) or ``constant``; the last three warm up "
                            "linearly over --warmup-epochs.", choices=SCHEDULES, recipe=7)
    warmup_fraction: float = setting(0.15, "Share of steps spent warming the LR up to its peak (one-cycle "
                                     "pct_start); --warmup-epochs replaces it when set.", range="[0, 1)")
    warmup_epochs: float = setting(0.0, "Epochs of linear LR warm-up, from near 0 to --lr (may be fractional: "
                                   "rounded to whole steps). For onecycle it replaces --warmup-fraction when set "
                                   "(above 0).", range="[0, 100000]")
    min_lr: float = setting(0.0, "The LR the cosine schedule ends at, after the last step (a classifier or "
                            "fine-tuning group at a fraction of --lr ends at that fraction of it).", range="[0, 10]")
    decay_epochs: int = setting(30, "The step schedule multiplies the LR by --decay-rate every this many epochs "
                                "(timm's --decay-epochs).", range="[1, 100000]")
    decay_rate: float = setting(0.1, "The step schedule's factor at each decay (timm's --decay-rate).",
                                range="(0, 1]")
    layer_decay: float = setting(0.0, "Fine-tuning: layer-wise LR decay, the classifier at the full LR and each "
                                 "layer below it at this factor of the one above (0.75: the layer under the "
                                 "classifier 0.75, the next 0.56, ...); 0 = off. timm models use timm's layer "
                                 "grouping, torchvision's their stem, blocks in order, then the classifier "
                                 "(docs/training.md).", range="[0, 1]")
    label_smoothing: float = setting(0.0, "Cross-entropy label smoothing. Off: on the embedded split 0.1 cost "
                                     "0.2-0.4 points (docs/NOTES.md).", range="[0, 1)", recipe=9)
    accumulate: int = setting(1, "Gradient accumulation: each worker's share of the global batch goes through the "
                              "model in N pieces, their gradients summed into one optimizer step. The gradient is "
                              "the whole batch's (BatchNorm sees the smaller pieces); --batch-size, steps, "
                              "checkpoints and the data order stay as they are. For batches too large for memory.",
                              range="[1, 1048576]")
    clip_grad_norm: float = setting(0.0, "Clip the gradients' global L2 norm to this value before each optimizer "
                                    "step (``torch.nn.utils.clip_grad_norm_``); the norm before clipping is in the "
                                    "step records. 0 = no clipping.", range="[0, 1000000]")
    drop_path: float | None = setting(None, "Stochastic depth (drop path) rate for models that have it: timm's "
                                      "(``drop_path_rate``) and torchvision's ConvNeXt, EfficientNet, Swin and "
                                      "MaxViT (``stochastic_depth_prob``); the deepest block drops at this rate, "
                                      "earlier ones less. Unset keeps each model's own (torchvision's: 0.1-0.5, "
                                      "timm's: 0); refused for a model without it (resnet18).", range="[0, 1)")
    grad_checkpointing: bool = setting(False, "Activation (gradient) checkpointing for timm models that support it "
                                       "(``set_grad_checkpointing``): blocks recompute their activations in the "
                                       "backward pass, less memory for about a third more compute. The same "
                                       "gradients, so a run may be resumed with or without it.", resumable=True)
    augment: bool = setting(True, "Random augmentation of the training images: the preset's (below).")
    preset: str = setting("auto", "Augmentation and evaluation transforms: ``digits`` (a random affine: rotation, "
                          "zoom, shift), ``photos`` (random resized crop and horizontal flip; resize and centre crop "
                          "for evaluation), or ``auto``: the data set's own (digits for small grayscale images).",
                          choices=("auto", "digits", "photos"), recipe=10)
    max_rotate_deg: float = setting(15.0, "Largest random rotation, degrees.", range="[0, 180]")
    max_shift: float = setting(0.1, "Largest random shift, as a fraction of the image size.", range="[0, 1]")
    max_scale: float = setting(0.15, "Largest random zoom in or out, as a fraction.", range="[0, 1)")
    crop_min_area: float = setting(0.6, "Photos: the smallest share of the image a random crop keeps (the largest "
                                   "is all of it). ImageNet recipes use 0.08, for long training on a million images; "
                                   "from scratch on a few thousand, 0.08 and 0.35 lost 45 and 18 points against 0.6 "
                                   "(BENCHMARKS.md, issue 18).", range="(0, 1]")
    augment_policy: str = setting("none", "Photos: an automatic augmentation policy after the crop and flip, "
                                  "torchvision's ``randaugment`` (2 operations of ``--augment-magnitude``), "
                                  "``trivialaugment`` (one operation, random strength) or ``autoaugment`` (the "
                                  "ImageNet policy); ``none``. Runs in the decoding tasks, on their CPUs.",
                                  choices=AUGMENT_POLICIES, recipe=11)
    augment_magnitude: int = setting(9, "RandAugment's strength, of 31 levels (0-30); timm's and torchvision's "
                                     "default is 9.", range="[0, 30]")
    color_jitter: float = setting(0.0, "Photos: random brightness, contrast and saturation, each by up to this "
                                  "factor (0.4 in timm's ImageNet recipe); 0 = off.", range="[0, 1]")
    random_erasing: float = setting(0.0, "Photos: the probability of erasing a random rectangle of a training image "
                                    "with the data set's mean colour (0.25 in timm's recipe); 0 = off.",
                                    range="[0, 1]")
    mixup: float = setting(0.0, "Mixup's alpha (0.2-0.8 in timm's recipes): each image blended with its mirror in "
                           "the global batch by a Beta(alpha, alpha) weight, the targets blended alike; 0 = off. "
                           "Training accuracy then counts the label with the larger share.", range="[0, 100]",
                           recipe=12)
    cutmix: float = setting(0.0, "CutMix's alpha (1.0 in timm's recipes): a box of the mirror image pasted in, the "
                            "targets weighed by the areas; 0 = off.", range="[0, 100]", recipe=13)
    mix_switch_prob: float = setting(0.5, "With both --mixup and --cutmix: the share of mixed steps that use CutMix.",
                                     range="[0, 1]")
    mix_prob: float = setting(1.0, "The share of steps that mix (when --mixup or --cutmix is on).", range="[0, 1]")
    mix_off_epochs: int = setting(0, "Train the last N epochs without mixing (timm's --mixup-off-epoch, counted "
                                  "from the end).", range="[0, 100000]")
    class_weights: str = setting("none", "``auto``: weigh each class's loss by the inverse of its share of the "
                                 "training split (scikit-learn's \"balanced\": n / (classes x n_class)), so a rare "
                                 "class counts as much as a frequent one; the training loss shown is then the "
                                 "weighted one, validation's stays plain. ``none``: every image counts the same. "
                                 "Multi-label data: each label's positive term weighed by its negatives / "
                                 "positives in the training split (BCE's ``pos_weight``).",
                                 choices=("none", "auto"))
    sampling: str = setting("shuffle", "The rows of an epoch: ``shuffle`` (each once, in a seeded order) or "
                            "``balanced`` (as many rows drawn with replacement, each class equally likely: rare "
                            "classes repeat, frequent ones are partly left out; still a function of seed and "
                            "epoch). A streamed data set draws each window of about 16k rows this way.",
                            choices=("shuffle", "balanced"))
    multi_label_loss: str = setting("bce", "Multi-label data: the loss of each label's sigmoid, ``bce`` (binary "
                                    "cross-entropy) or ``asl`` (the asymmetric loss of Ridnik et al. 2021, which "
                                    "weighs down the many easy negatives: --asl-gamma-neg, --asl-gamma-pos, "
                                    "--asl-clip). Single-label data trains with the cross-entropy whatever it is.",
                                    choices=("bce", "asl"))
    asl_gamma_neg: float = setting(4.0, "The asymmetric loss's focusing exponent of the negatives.",
                                   range="[0, 100]")
    asl_gamma_pos: float = setting(0.0, "The asymmetric loss's focusing exponent of the positives.",
                                   range="[0, 100]")
    asl_clip: float = setting(0.05, "The asymmetric loss's probability margin: a negative's probability is lowered "
                              "by it (and one below it costs nothing).", range="[0, 1)")
    ema_decay: float = setting(0.98, "Per-step decay of an exponential moving average of the weights, which is "
                               "what gets evaluated and saved as model.pt; 0 turns it off. Smooths the "
                               "epoch-to-epoch jitter. The decay warms up as (1 + n) / (10 + n) at step n and "
                               "stops at this value: 0.98 from step 440 on, so a shorter run (the demo takes "
                               "372 steps) averages the same whatever it is set to.", range="[0, 1)", recipe=14)
    bn_momentum: float = setting(0.1, "Momentum of every BatchNorm layer's running statistics (as timm's "
                                 "--bn-momentum), PyTorch's default. torchvision's MobileNet-V3 and EfficientNet "
                                 "define 0.01, for 600-epoch ImageNet runs: in a run of a few hundred steps their "
                                 "statistics lag so far behind the weights that evaluation predicted one class for "
                                 "every image (docs/NOTES.md). 0 keeps each model's own.", range="[0, 1]")
    bn_calibration: int = setting(512, "Before each validation, recompute every BatchNorm layer's statistics "
                                  "in the evaluated model from this many training images, preprocessed as for "
                                  "evaluation (no augmentation); model.pt keeps them. The statistics gathered "
                                  "during training come from augmented images, which evaluation never sees "
                                  "(docs/NOTES.md). 0 keeps those.", range="[0, 1000000]")
    seed: int = setting(0, "Seeds model init, shuffling and augmentation.", range="[0, 4294967295]", recipe=18)

    channels_last: bool = setting(True, "NHWC memory layout for convolutions: measured 5-10% faster on CPU here, "
                                  "and the usual choice on GPUs. The saved state_dict loads into a model of either "
                                  "layout.")
    precision: str = setting("fp32", "Training precision: ``fp32``; ``bf16`` (forward pass and loss under bfloat16 "
                             "autocast, no loss scaling needed; GPUs with bfloat16: A100, H100); or ``fp16`` "
                             "(float16 autocast with a gradient scaler, for GPUs without bfloat16: T4, V100). "
                             "Weights, gradients and optimizer state stay float32. On a CPU bf16 is slower without "
                             "bfloat16 instructions, fp16 several times slower. With fp16 a step whose gradients "
                             "overflow is skipped and the scale lowered; the scale is checkpointed. Validation runs "
                             "in float32, so recorded accuracies match a later ``imgtrain evaluate``.",
                             choices=PRECISIONS, recipe=16)
    compile: bool = setting(False, "Compile the training forward and backward pass with ``torch.compile``. The "
                            "first steps pay for the compilation (tens of seconds); worth it on GPUs for long runs.",
                            resumable=True)
    data_on_device: bool = setting(False, "Keep the training split in device memory and gather each batch there (no "
                                   "host-to-device copy per step); for data sets small enough to hold in memory. On "
                                   "a CPU it changes nothing.", resumable=True)
    eval_batch_size: int = setting(500, "Batch size per worker for validation (no gradients, so larger is fine).",
                                   range="[1, 1048576]")
    log_every_steps: int = setting(10, "Every N steps each rank sends a progress record to the driver (fire and "
                                   "forget, no barrier).", range="[1, 1000000000]", resumable=True)
    num_to_keep: int = setting(1, "Checkpoints kept, ranked by --select-metric; the latest is always kept in "
                               "addition.", range="[1, 1000]")
    select_metric: str = setting(DEFAULT_METRIC, "The validation metric that ranks checkpoints: which one is "
                                 "``best`` (evaluate, serve, predict), which ``--num-to-keep`` keeps, and what "
                                 "``--early-stop`` watches. ``val_loss`` is minimised, ``val_accuracy`` and "
                                 "``val_f1_macro`` (the unweighted mean of the per-class F1 scores) maximised, "
                                 "and for multi-label data ``val_map`` (the mean of the labels' average "
                                 "precisions) too.",
                                 choices=tuple(SELECTION_METRICS))
    early_stop: int = setting(0, "Stop training when --select-metric has not improved for this many epochs (its "
                              "best by more than --early-stop-min-delta); 0 = train every epoch. Decided from the "
                              "epoch history the checkpoints carry: a resumed run stops at the same epoch.",
                              range="[0, 100000]")
    early_stop_min_delta: float = setting(0.0, "The least change of --select-metric that counts as an improvement "
                                          "for --early-stop.", range="[0, 1000000]")
    average_last: int = setting(0, "After the last epoch, save a checkpoint holding the uniform average of the "
                                "last K epochs' evaluated weights (the moving average's when --ema-decay is on), "
                                "its BatchNorm statistics recomputed (--bn-calibration) and validated; it competes "
                                "as ``best`` and is ``--checkpoint average``. 0 = off.", range="[0, 100000]", recipe=15)
    max_failures: int = setting(0, "Worker-group failures Ray Train retries from the latest checkpoint before "
                                "giving up; -1 = without limit.", range="[-1, 1000]", resumable=True)
    checkpoint_every_steps: int = setting(0, "Also checkpoint every N optimizer steps inside an epoch (0 = only at "
                                          "epoch ends). A crash then costs at most N steps, and the epoch resumes "
                                          "exactly where it stopped.", range="[0, 1000000000]", resumable=True)
    stall_timeout_s: float = setting(300.0, "Seconds without progress (outside a collective the others wait in) "
                                     "after which a rank is named, its Python stacks and log files printed, and "
                                     "killed, failing or retrying the run (before its first step, at least 120 s); "
                                     "0 = wait forever.",
                                     flag="--stall-timeout", range="[0, 604800]", resumable=True, run_only=True)
    deterministic: bool = setting(False, "Deterministic kernels only (torch.use_deterministic_algorithms): a "
                                  "resumed run ends with the same weights as an uninterrupted one.", resumable=True)
    ledger: bool = setting(False, "Record the sample ids every rank trains on at every step in "
                           "``ledger/rank-R.jsonl``.", resumable=True)
    limit_train_batches: int = setting(0, "Smoke mode: stop each epoch after N steps (0 = whole epoch).",
                                       range="[0, 1000000000]", resumable=True)

    mlflow: str | None = setting(None, "MLflow tracking URI (``sqlite:///mlflow.db``, ``http://host:5000``): log "
                                 "params, step and epoch metrics and the final model there. Needs ``pip install "
                                 "'imgtrain[mlflow]'``.", resumable=True, run_only=True,
                                 secret=True)
    mlflow_experiment: str = setting("imgtrain", "MLflow experiment the run is logged under (created when "
                                     "missing).", resumable=True, run_only=True)
    tensorboard: bool = setting(False, "Write TensorBoard event files to ``{run}/tensorboard``. Needs ``pip install "
                                "'imgtrain[tensorboard]'``.", resumable=True, run_only=True)
    wandb: str | None = setting(None, "Weights & Biases project: log params, step and epoch metrics and the final "
                                "model to a W&B run there (``WANDB_MODE=offline``: to ``{run}/wandb`` only, for "
                                "``wandb sync``). Needs ``pip install 'imgtrain[wandb]'``.", resumable=True,
                                run_only=True)
    wandb_entity: str | None = setting(None, "W&B entity (user or team) the ``--wandb`` project belongs to; unset: "
                                       "your default entity.", resumable=True, run_only=True)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def effective_workers(self) -> int:
        return 1 if self.backend == "local" else self.workers

    def fewest_workers(self) -> int:
        """The smallest world size the run may train at (``min_workers`` when elastic)."""
        return 1 if self.backend == "local" else (self.min_workers or self.workers)


@dataclass
class LrFindOptions:
    """``imgtrain lr-find``'s own options (the training settings it tests with are TrainConfig's)."""

    steps: int = option(100, "Steps of the exponential LR ramp (fastai and Lightning take 100); it stops sooner "
                        "when the loss diverges.", range="[13, 100000]")
    start_lr: float = option(1e-7, "The ramp's first learning rate (fastai's).", range="(0, 10]")
    end_lr: float = option(10.0, "The ramp's last learning rate (fastai's).", range="(0, 100]")
    out: Path = option(Path("lr_find"), "Where the curve goes: OUT.csv (step, lr, loss, smoothed loss) and OUT.png "
                       "(the smoothed loss against the LR, the suggestion marked).")


# ---------------------------------------------------------------- the fields, as data


def settings() -> tuple[Setting, ...]:
    """Every field of TrainConfig, as declared (``settings.Setting``)."""
    return settings_of(TrainConfig)


def by_name() -> dict[str, Setting]:
    return {s.name: s for s in settings()}


def flag(name: str) -> str:
    """The command-line spelling of a field: ``--batch-size``, ``--gpu``, ``--stall-timeout``."""
    return by_name()[name].flag.split("/")[0]


# ---------------------------------------------------------------- checking and resolving


def range_problem(name: str, value, interval: str) -> str | None:
    """Why ``value`` is outside ``interval`` ("[0, 1)": brackets include the bound), or None."""
    lo_text, hi_text = interval[1:-1].split(",")
    lo, hi = float(lo_text), float(hi_text)
    if isinstance(value, float) and not math.isfinite(value):
        return f"{flag(name)} must be a finite number, got {value}"
    if value < lo or value == lo and interval[0] == "(":
        bound = "at least" if interval[0] == "[" else "above"
        return f"{flag(name)} must be {bound} {lo_text.strip()}, got {value}"
    if value > hi or value == hi and interval[-1] == ")":
        bound = "at most" if interval[-1] == "]" else "below"
        return f"{flag(name)} must be {bound} {hi_text.strip()}, got {value}"
    return None


def validate(cfg: TrainConfig, problems: list[str] = ()) -> None:
    """Check every field; raise one ImgtrainError listing every problem found, after the
    ``problems`` already found elsewhere (a config file's unknown keys and wrong types)."""
    issues = list(problems)
    if not cfg.name:
        issues.append("--name is required (the run is stored under {storage}/{name})")
    elif problem := name_problem(cfg.name):
        issues.append(f"--name {cfg.name[:80]!r} {problem}")
    for s in settings():
        value = getattr(cfg, s.name)
        if s.choices and value not in s.choices:
            issues.append(f"{flag(s.name)} {value!r} is not one of {', '.join(s.choices)}")
        elif isinstance(value, str) and s.type in (int, float):  # only auto is text
            if not is_auto(s.name, value):
                issues.append(f"{flag(s.name)} {value!r} is not a number")
        elif s.range and value is not None and (problem := range_problem(s.name, value, s.range)):
            issues.append(problem)
    if cfg.min_workers > cfg.workers:
        issues.append(f"--workers {cfg.min_workers}-{cfg.workers}: the minimum must be between 1 and the maximum")
    batch = cfg.batch_size if isinstance(cfg.batch_size, int) else AUTO_BATCH  # auto: checked once chosen
    if 1 <= batch < cfg.effective_workers():
        issues.append(
            f"--batch-size {cfg.batch_size} is smaller than --workers {cfg.workers}: "
            "every worker needs at least one sample per step; raise the batch size or use fewer workers"
        )
    if cfg.decode == "gpu" and not cfg.use_gpu:
        issues.append("--decode gpu decodes photos on the workers' GPUs and this run trains on CPUs: add --gpu, "
                      "or use --decode cpu or auto")
    if cfg.strategy == "fsdp" and cfg.backend == "local":
        issues.append("--strategy fsdp shards the model over Ray Train workers; --backend local is one process: "
                      "use --strategy ddp or --backend ray")
    if 1 <= cfg.effective_workers() <= batch and cfg.accumulate > batch // cfg.effective_workers():
        issues.append(f"--accumulate {cfg.accumulate} is more pieces than the {cfg.batch_size // cfg.effective_workers()} "
                      f"samples of a worker's share of --batch-size {cfg.batch_size}: use at most that many")
    if cfg.strategy == "fsdp" and cfg.compile:
        issues.append("--compile is not supported with --strategy fsdp yet: drop one of them")
    if cfg.mlflow is not None and not cfg.mlflow.strip():
        issues.append("--mlflow needs a tracking URI, e.g. sqlite:///mlflow.db")
    issues += wandb_problems(cfg)
    if cfg.init_from and cfg.pretrained:
        issues.append("--init-from and --pretrained both give initial weights: pass one")
    if cfg.average_last > cfg.epochs:
        issues.append(f"--average-last {cfg.average_last} averages more epochs than the run's --epochs "
                      f"{cfg.epochs}: use at most {cfg.epochs}")
    if cfg.freeze_backbone and cfg.freeze_backbone >= cfg.epochs:
        issues.append(f"--freeze-backbone {cfg.freeze_backbone} would freeze all {cfg.epochs} epochs: use fewer")
    if cfg.optimizer in ("lamb", "lars") and importlib.util.find_spec("timm") is None:
        issues.append(f"--optimizer {cfg.optimizer} is timm's: pip install 'imgtrain[timm]'")
    if cfg.warmup_epochs and cfg.warmup_epochs >= cfg.epochs:
        issues.append(f"--warmup-epochs {cfg.warmup_epochs:g} would warm up for all {cfg.epochs} epochs: use fewer")
    issues += schedule_problems(cfg)
    for name in ("asl_gamma_neg", "asl_gamma_pos", "asl_clip"):
        if getattr(cfg, name) != getattr(TrainConfig, name) and cfg.multi_label_loss != "asl":
            issues.append(f"{flag(name)} is the asymmetric loss's: add --multi-label-loss asl or drop {flag(name)}")
    if cfg.min_lr and cfg.schedule != "cosine":
        issues.append(f"--min-lr is the cosine schedule's floor; --schedule {cfg.schedule} has none: drop --min-lr "
                      "or use --schedule cosine")
    elif not isinstance(cfg.lr, str) and cfg.min_lr >= cfg.lr > 0:  # auto: checked once chosen
        issues.append(f"--min-lr {cfg.min_lr:g} must be below --lr {cfg.lr:g}, the peak the cosine falls from")
    if not cfg.mlflow_experiment.strip():
        issues.append("--mlflow-experiment must not be empty")
    if issues:
        raise ImgtrainError("invalid configuration: " + "; ".join(issues))


def is_auto(name: str, value) -> bool:
    """Whether ``value`` is ``auto`` for the field ``name`` (--lr auto, --batch-size auto)."""
    return name in AUTO_PARSERS and value == AUTO


def read_text(values: dict) -> dict:
    """``values`` (flags or a file's entries) with the text of --lr and --batch-size read
    (``auto``, or a number)."""
    return {k: AUTO_PARSERS[k](v) if k in AUTO_PARSERS and isinstance(v, str) else v for k, v in values.items()}


def read_autos(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``"auto"`` (the Python API's spelling) read as the fields' auto values."""
    return dataclasses.replace(cfg, **read_text({name: getattr(cfg, name) for name in AUTO_PARSERS}))


def wandb_problems(cfg: TrainConfig) -> list[str]:
    """A W&B project or entity that W&B would refuse after Ray has started, or an entity without a project."""
    issues = []
    for flag, value in (("--wandb", cfg.wandb), ("--wandb-entity", cfg.wandb_entity)):
        if value is not None and (not value.strip() or set(value) & set(WANDB_FORBIDDEN) or len(value) > 128):
            issues.append(f"{flag} {value!r} is not a W&B name: up to 128 characters, none of {WANDB_FORBIDDEN}"
                          + (" (the entity goes in --wandb-entity)" if flag == "--wandb" and "/" in value else ""))
    if cfg.wandb_entity is not None and cfg.wandb is None:
        issues.append("--wandb-entity is the entity of a --wandb project: give --wandb PROJECT too")
    return issues


def schedule_problems(cfg: TrainConfig) -> list[str]:
    """Settings of a schedule or optimizer the run does not use, set away from their defaults:
    they would change nothing, which is not what whoever set them meant."""
    def changed(name: str) -> bool:
        return getattr(cfg, name) != getattr(TrainConfig, name)

    issues = []
    if changed("momentum") and cfg.optimizer not in ("sgd", "lars"):
        issues.append(f"--momentum is for --optimizer sgd or lars; {cfg.optimizer} has betas: drop --momentum")
    for name in ("decay_epochs", "decay_rate"):
        if changed(name) and cfg.schedule != "step":
            issues.append(f"{flag(name)} is the step schedule's: use --schedule step or drop {flag(name)}")
    if changed("warmup_fraction") and cfg.schedule != "onecycle":
        issues.append(f"--warmup-fraction is the one-cycle schedule's; --schedule {cfg.schedule} warms up over "
                      "--warmup-epochs")
    elif changed("warmup_fraction") and cfg.warmup_epochs:
        issues.append("--warmup-fraction and --warmup-epochs both set the one-cycle warm-up: pass one")
    return issues


def resolve(overrides: dict, stored: dict | None = None) -> TrainConfig:
    """Defaults, then the stored config of the run being resumed, then what the user set."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ImgtrainError(f"unknown config field(s): {', '.join(unknown)}")
    base = {k: v for k, v in (stored or {}).items() if k in known}
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.get("lr") not in (None, AUTO_LR):  # kept as given, even at the default's value (--batch-size auto)
        given["lr_source"] = LR_GIVEN
    return TrainConfig(**{**base, **given})


def changed_fields(old: dict, new: dict) -> list[str]:
    """Fields that differ between a stored run config and a new request, resumable ones excepted."""
    resumable = {s.name for s in settings() if s.resumable}
    return sorted(k for k in new if k not in resumable and k in old and old[k] != new[k])


# ---------------------------------------------------------------- batch arithmetic


def steps_per_epoch(n_train: int, global_batch: int, limit: int = 0) -> int:
    """Steps per epoch: whole global batches of the training split (the rest of the epoch's
    order, fewer than one batch, is left out), the same at every world size. 0 means too
    little data."""
    steps = n_train // global_batch
    return min(steps, limit) if limit else steps


# --batch-size 0: the batch chosen from the training split's size (``auto_batch_size``)
AUTO_BATCH = 0
DEFAULT_BATCH = 128  # the recipe's batch (docs/training.md "The default recipe"), for splits of 1,024 rows or more
AUTO_MIN_STEPS = 8  # halved while an epoch would have fewer steps: one step an epoch diverged (issue 46)
AUTO_FLOOR = 16  # ...but not below this: BatchNorm's statistics come from a worker's share of it
FEW_STEPS = 4  # an epoch of fewer steps than this gets a warning, whoever chose the batch


def auto_batch_size(n_train: int, fewest_samples: int = 1) -> int:
    """The global batch of ``--batch-size 0``: 128, halved while an epoch of ``n_train`` rows would
    have fewer than AUTO_MIN_STEPS steps, down to AUTO_FLOOR; a split too small for that many
    steps at the floor is cut into equal steps (``n_train // steps``), so fewer than ``steps``
    rows sit out an epoch instead of up to a whole batch. ``fewest_samples``: what one step needs
    (one sample per worker per ``--accumulate`` piece); the batch is never below it.

    A pure function of the split's size and those settings: a run records the result in its
    config.json, and a resumed run keeps it, so exact resumption holds.

    >>> auto_batch_size(4000), auto_batch_size(1000), auto_batch_size(160), auto_batch_size(100), auto_batch_size(20)
    (128, 64, 16, 16, 20)
    """
    floor = max(AUTO_FLOOR, fewest_samples)
    batch = max(DEFAULT_BATCH, fewest_samples)
    while n_train // batch < AUTO_MIN_STEPS and batch // 2 >= floor:
        batch //= 2
    if n_train // batch < AUTO_MIN_STEPS:  # at the floor: spread the rows over whole steps
        batch = max(n_train // max(1, n_train // batch), fewest_samples)
    return batch


def per_worker_batch_sizes(global_batch: int, world_size: int) -> list[int]:
    """Split a global batch across ranks: equal shares, the remainder to the first ranks.

    >>> per_worker_batch_sizes(128, 3)
    [43, 43, 42]
    """
    base, extra = divmod(global_batch, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def rank_share(global_batch: int, world_size: int, rank: int) -> slice:
    """This rank's part of a global batch: positions [start, start + size) within it."""
    sizes = per_worker_batch_sizes(global_batch, world_size)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])
