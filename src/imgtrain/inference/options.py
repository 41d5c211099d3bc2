"""The options of ``evaluate``, ``predict``, ``export``, ``report``, ``serve`` and ``calibrate``, each declared
once (``settings.option``): the CLI's flags, defaults and help, and the defaults of the Python
functions (``batch.evaluate(checkpoint=EvaluateOptions.checkpoint, ...)``), come from here.
``InferenceOptions`` (how images are run through the model) and ``Limits`` (what one request to
the server may cost) are passed whole. Imports neither numpy nor FastAPI: ``imgtrain --help`` reads it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from imgtrain.inference import export_formats
from imgtrain.settings import option, settings_of, storage_option

DEFAULT_TOP_K = 3
DEFAULT_BATCH_SIZE = 500
MAX_ACCURACY_DROP = 0.01  # --quantize int8 is refused when it costs more test accuracy than this
ON_ERROR = ("skip", "fail")  # an unreadable input file
# Test-time augmentation: none, or flip (the softmax averaged over the image and its mirror image).
TTA = ("none", "flip")
INGRESS = ("auto", "direct", "proxy")
BACKENDS = ("ray", "local")
# Out-of-distribution scores (ood.py says what each is), the first the default.
OOD_METHODS = ("energy", "max-logit", "max-softmax", "mahalanobis")


# ---------------------------------------------------------------- shared by several commands


def checkpoint_option():
    return option("best", "best (by the run's --select-metric), latest, average (--average-last's), or a "
                  "checkpoint directory.")


def tta_option():
    return option("none", "Test-time augmentation: none, or flip (the probabilities averaged over each image and its "
                  "mirror image: two forward passes; for photos, not digits).", choices=TTA)


def engine_option():
    exports = "; ".join(f"{name}: an export folder of --format {spec.name} (imgtrain export)"
                        for name, spec in export_formats.ENGINES.items() if spec is not None)
    return option("torch", f"torch: a run or checkpoint; {exports}.", choices=tuple(export_formats.ENGINES))


def ood_score_option():
    return option(OOD_METHODS[0], "The out-of-distribution score of each image (higher: more like the training data): "
                  "energy (logsumexp of the logits), max-logit, max-softmax (the calibrated confidence), or mahalanobis "
                  "(the penultimate features' distance to the nearest class, fitted by calibration: best against "
                  "images unlike any class); an export engine gives the first three (mahalanobis, and every score of "
                  "an export made before exports output their logits: max-softmax).", choices=OOD_METHODS)


def reject_option():
    return option(None, "Answer 'unknown' for an image whose out-of-distribution score is below this threshold; "
                  "auto: the one keeping 95% of the validation split (stored by calibration).",
                  metavar="auto|THRESHOLD")


def address_option():
    return option(None, "Join this Ray cluster; default: start one.")


# ---------------------------------------------------------------- running the model over many images


@dataclass
class InferenceOptions:
    """How ``evaluate`` and ``predict`` run images through the model."""

    backend: str = option("ray", "ray (Ray Data actor pool) or local (this process).", choices=BACKENDS)
    batch_size: int = option(DEFAULT_BATCH_SIZE, "Images per inference batch.")
    concurrency: int = option(1, "Inference actors in the Ray Data pool.")  # GPU: one GPU each
    threads: int = option(0, "torch threads per actor; 0 = cores / concurrency.")
    use_gpu: bool = option(False, "One GPU per inference actor.", flag="--gpu")
    address: str | None = address_option()
    top_k: int = option(DEFAULT_TOP_K, "Classes listed per image, most probable first.")
    tta: str = tta_option()
    ood_score: str = ood_score_option()
    engine: str = engine_option()  # another than torch: an export folder instead of a checkpoint (export_engine.py)

    def validate(self) -> None:
        from imgtrain.errors import ImgtrainError

        problems = []
        engines = export_formats.ENGINES  # as registered now: a format registered after this import too
        if self.engine not in engines:
            problems.append(f"engine must be one of {', '.join(engines)}, got {self.engine!r}")
        if self.engine != "torch" and self.use_gpu:  # an export's engine runs on the CPUs
            problems.append(f"--engine {self.engine} runs on CPUs here; drop --gpu")
        if self.backend not in BACKENDS:
            problems.append(f"backend must be ray or local, got {self.backend!r}")
        if self.batch_size < 1:
            problems.append(f"batch size must be at least 1, got {self.batch_size}")
        if self.concurrency < 1:
            problems.append(f"concurrency must be at least 1, got {self.concurrency}")
        if self.threads < 0:
            problems.append(f"threads must be 0 (auto) or more, got {self.threads}")
        if self.top_k < 1:
            problems.append(f"top-k must be at least 1, got {self.top_k}")
        if self.tta not in TTA:
            problems.append(f"tta must be one of {', '.join(TTA)}, got {self.tta!r}")
        if self.ood_score not in OOD_METHODS:
            problems.append(f"--ood-score must be one of {', '.join(OOD_METHODS)}, got {self.ood_score!r}")
        if problems:
            raise ImgtrainError("; ".join(problems))

    def threads_per_actor(self) -> int:
        from imgtrain.cluster import threads_for

        return threads_for(self.concurrency, self.threads)


# ---------------------------------------------------------------- each command's own


@dataclass(frozen=True)
class EvaluateOptions:
    checkpoint: str = checkpoint_option()
    storage: str = storage_option()
    split: str = option("test", "Split of the data set to evaluate on.")
    data: str | None = option(None, "Another prepared data set, a folder or s3://... (default: the run's).")
    label_issues: int = option(0, "Also list the N training images whose label the model most confidently "
                               "disagrees with (confident learning; see the report).")
    ood: str | None = option(None, "A folder of images of none of the classes: report how well the "
                             "out-of-distribution score tells them from the split (AUROC, FPR at 95% TPR).")


@dataclass(frozen=True)
class PredictOptions:
    checkpoint: str = checkpoint_option()
    storage: str = storage_option()
    on_error: str = option("skip", "Unreadable image files: skip (reported) or fail.", choices=ON_ERROR)
    split: str = option("test", "Prepared data set input: the split to predict.")
    image_column: str = option("image", "Parquet input: the image column.")
    overwrite: bool = option(False, "Replace an existing --out file (and --explain's files).", flag="--overwrite")
    reject: str | None = reject_option()
    explain: str | None = option(None, "Also write where the model looked, per image, into this folder: its "
                                 "Grad-CAM map of the predicted class as an overlay PNG and as the map itself (.npy, "
                                 "float32 in [0, 1], at the image's own size). A checkpoint only, not an export.",
                                 metavar="DIR")


@dataclass(frozen=True)
class ExportOptions:
    checkpoint: str = checkpoint_option()
    storage: str = storage_option()
    data: str | None = option(None, "The data set to verify on (default: the run's).")
    split: str = option("test", "The split the export is verified and measured on.")
    overwrite: bool = option(False, "Replace an existing --out folder.", flag="--overwrite")
    quantize: str = option("none", "int8 (with --format onnx): ONNX Runtime's static quantization, calibrated on "
                           "training images.")
    max_accuracy_drop: float = option(MAX_ACCURACY_DROP, "--quantize int8 is refused when it costs more test "
                                      "accuracy than this fraction.")


@dataclass(frozen=True)
class CalibrateOptions:
    checkpoint: str = checkpoint_option()
    storage: str = storage_option()
    data: str | None = option(None, "The data set whose val split it is fitted on (default: the run's).")


@dataclass(frozen=True)
class ReportOptions:
    checkpoint: str = checkpoint_option()
    storage: str = storage_option()


# ---------------------------------------------------------------- serving


@dataclass(frozen=True)
class ServeOptions:
    checkpoint: str = checkpoint_option()
    storage: str = storage_option()
    host: str = option("127.0.0.1", "Interface to listen on (0.0.0.0 exposes it to the network; there is no "
                       "authentication or TLS: put a reverse proxy in front).")
    port: int = option(8000, "HTTP port.")
    replicas: int = option(1, "Model replicas (Ray Serve deployment); each takes an equal share of the cores. On 2 "
                           "cores, two served no more than one (BENCHMARKS.md).")
    address: str | None = address_option()
    openapi: bool = option(False, "Also serve the API schema at /openapi.json.", flag="--openapi")
    ingress: str = option("auto", "direct: the replica answers HTTP itself (Serve's direct ingress: 2-3x the requests "
                          "per second under load on 2 cores); proxy: through Ray Serve's proxy, needed for several "
                          "replicas or a joined cluster. auto: direct where it can.", choices=INGRESS)
    tta: str = tta_option()
    engine: str = engine_option()
    ood_score: str = ood_score_option()
    reject: str | None = reject_option()


@dataclass(frozen=True)
class Limits:
    """What one request may cost the server (``requests.py`` applies them)."""

    max_request_bytes: int = option(1 << 20, "Larger request bodies are refused with 413.")
    # Never more than images.MAX_DECODE_PIXELS, whatever is asked (``image_pixels``).
    max_image_pixels: int = option(0, "Larger images are refused with 413 before decoding; 0 = 64 x the model's "
                                   "input, at least 1 megapixel.")  # a 64 KiB PNG can hold 16.7 MP, ~80 MiB decoded
    max_batch_images: int = option(64, "Most images in one request.")  # JSON batches
    # 504 from the replica (408 from Ray's proxy) instead of waiting on
    request_timeout_s: float = option(30.0, "Seconds before an unanswered request gets 504 with Retry-After.",
                                      flag="--request-timeout")
    # One deadline for the whole body, not one per read: a client sending a byte every few seconds would
    # renew a per-read timeout forever, and hold its connection and memory. 1 MiB in 5 s is 200 KiB/s.
    body_timeout_s: float = option(5.0, "Seconds for a request's whole body to arrive; a slower one gets 408 (a "
                                   "client trickling bytes holds no place for longer).", flag="--body-timeout")
    max_queued_requests: int = option(100, "Requests waiting per replica (besides the batch being computed) before "
                                      "new ones get 503 with Retry-After, at once.")
    max_batch_size: int = option(32, "Most images per forward pass, gathered from concurrent requests.")
    batch_wait_ms: float = option(0.0, "Extra wait for a batch to fill. 0 (measured best): each forward pass takes "
                                  "the requests that arrived during the last one.")

    def problems(self) -> list[str]:
        may_be_zero = ("max_image_pixels", "batch_wait_ms")
        return [f"{s.flag} must be {'0 or ' if s.name in may_be_zero else ''}a positive number, got {value}"
                for s in settings_of(Limits) if not (0 < (value := getattr(self, s.name)) < math.inf
                                                     or s.name in may_be_zero and value == 0)]

    def image_pixels(self, shape) -> int:
        # Capped: 64 times a large model's input is up to 3.2 gigapixels (10 GB decoded as RGB), and
        # nothing larger than MAX_DECODE_PIXELS is decoded anywhere else.
        from imgtrain.data.images import MAX_DECODE_PIXELS

        asked = self.max_image_pixels or max(64 * shape[0] * shape[1], 1 << 20)
        return min(asked, MAX_DECODE_PIXELS)
