#!/usr/bin/env python
"""Fine-tuning benchmark: a ViT fine-tuned with each optimizer, compared on memory, speed and accuracy.

    # speed: synthetic images made on the device, three alternating repeats of each optimizer
    python benchmarks/benchmark_adam_8bit.py --no_pretrained --optim Adam,AdamWTorchFused,AdamW8bit --repeats 3
    # accuracy: the pre-trained ViT-B on resisc45 (downloads the weights and the dataset)
    python benchmarks/benchmark_adam_8bit.py --model "timm/vit_base_patch16_224.augreg_in21k" --dataset resisc45 \
        --amp bf16 --optim Adam

``--optim`` takes one name or a comma list; each optimizer trains the same model from the same starting weights,
on the same batches, in turn, for ``--repeats`` rounds (the order rotated each round, so that none always runs
first). The default data, ``--dataset synthetic``, is made on the device a batch at a time, so the timed loop
measures the model and the optimizer, not a DataLoader; ``resisc45`` (or an image folder) goes through a
DataLoader with augmentation, as a real fine-tune does. The first ``--warmup_steps`` steps of each run are not
timed (compiles fall there); throughput counts the steps after them, and the optimizer's own time per step is
CUDA events around ``optimizer.step()`` (the wall clock on a CPU), median over those steps.

Each optimizer's runs are summarized and appended as one JSON line to ``--results`` (default
``results/finetune.jsonl``): the median over the repeats, and each repeat's figures in ``*_runs`` lists.
``benchmarks/render_finetune_table.py`` turns that file into a Markdown table, where a throughput difference
inside the run-to-run spread reads "within noise", and a PNG chart. ``--help`` lists every flag.

Only torch and torchao_optim are imported at module level: timm, datasets, torchvision, bitsandbytes,
wandb and tqdm are imported when a run needs them, and a missing or broken one is reported as a one-line
error (exit code 2), as is any other bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import gc
import importlib
import inspect
import json
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # optimizers.py, render_finetune_table.py sit here
import optimizers  # noqa: E402  (the optimizer table every benchmark shares; it imports torchao_optim)
from render_finetune_table import format_duration, markdown_table  # noqa: E402

RESISC45_ID = "timm/resisc45"
RESISC45_CLASSES = 45
DEFAULT_MODEL = "timm/vit_base_patch16_224.augreg_in21k"
DEFAULT_RESULTS = "results/finetune.jsonl"
PROFILE_ITERATIONS = 50
DEFAULT_WARMUP_STEPS = 5
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".ppm")


class BenchmarkError(Exception):
    """Bad input or a missing dependency: reported as one line on stderr, exit code 2."""


# ---- optional packages ------------------------------------------------------------------------------
_PIP_NAMES = {"PIL": "pillow", "torchvision.transforms": "torchvision"}


def require(module: str, purpose: str):
    """Import ``module`` or raise a BenchmarkError saying what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        pip_name = _PIP_NAMES.get(module, _PIP_NAMES.get(top, top))
        if err.name in (None, top, module):
            raise BenchmarkError(
                f"{purpose} needs the '{pip_name}' package, which is not installed (pip install {pip_name})"
            ) from None
        raise BenchmarkError(f"{purpose} needs '{pip_name}', which failed to import: {_first_line(err)}") from None
    except (
        Exception
    ) as err:  # e.g. timm's torchvision built for another torch: "operator torchvision::nms does not exist"
        hint = ""
        if "torchvision" in str(err):
            hint = f"; install the torchvision release built for torch {torch.__version__.split('+')[0]}"
        raise BenchmarkError(
            f"{purpose} needs '{module}', which is installed but failed to import "
            f"({type(err).__name__}: {_first_line(err)}){hint}"
        ) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ---- optimizers: the table every benchmark shares (benchmarks/optimizers.py) ----------------------------
def optimizer_names() -> list[str]:
    return optimizers.names()


def _unknown(kind: str, name: str, known: Sequence[str], show_all: bool = True) -> BenchmarkError:
    by_lower = {k.lower(): k for k in known}
    close = [by_lower[c] for c in difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.75)]
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    listing = f" (choose from: {', '.join(known)})" if show_all else ""
    return BenchmarkError(f"unknown {kind} {name!r}{hint}{listing}")


def check_optimizer(name: str) -> None:
    """Raise BenchmarkError if ``name`` is unknown or its package is missing."""
    if optimizers.resolve(name) is None:
        raise _unknown("optimizer", name, optimizer_names())
    missing = optimizers.missing_package(name)
    if missing is not None:
        require(missing[0], f"--optim {name}")


def make_optimizer(
    name: str, params: Iterable, lr: float, weight_decay: float = 0.0, compile: bool = True
) -> torch.optim.Optimizer:
    """The optimizer ``--optim name`` selects, over ``params``; ``compile`` applies to torchao_optim's only."""
    check_optimizer(name)
    return optimizers.build(name, params, lr=lr, weight_decay=weight_decay, compile=compile)


# ---- learning rate ----------------------------------------------------------------------------------
def cosine_lr(step: int, total_steps: int, base_lr: float, warmup_steps: int, final_lr: float = 0.0) -> float:
    """The learning rate for 0-based ``step``: linear warm-up to ``base_lr`` over ``warmup_steps`` steps,
    then a cosine decay to ``final_lr`` at ``total_steps`` (:func:`optimizers.lr_at`)."""
    return optimizers.lr_at(step, base_lr, warmup_steps, total_steps, final_lr / base_lr if base_lr else 0.0)


# ---- data -------------------------------------------------------------------------------------------
class SyntheticImages:
    """``n`` random images (uniform pixels in [-1, 1]) with random labels, made on the training device a batch
    at a time by :meth:`batches`: nothing crosses from the host, so a timed loop over them measures the model and
    the optimizer, not an input pipeline. Batch ``b`` depends only on ``(seed, b)`` and the batch size, so every
    epoch, every run and every optimizer sees the same batches (shuffled by batch, per epoch)."""

    def __init__(self, n: int, n_classes: int, img_size: int, seed: int):
        self.n, self.n_classes, self.img_size, self.seed = n, n_classes, img_size, seed

    def __len__(self) -> int:
        return self.n

    def batches(self, batch_size: int, device: torch.device, shuffle: bool, drop_last: bool) -> SyntheticBatches:
        return SyntheticBatches(self, batch_size, torch.device(device), shuffle, drop_last)


class SyntheticBatches:
    """The batches of a :class:`SyntheticImages`, iterated like a DataLoader: ``(images, labels)`` on the device."""

    def __init__(self, images: SyntheticImages, batch_size: int, device: torch.device, shuffle: bool, drop_last: bool):
        self.images, self.batch_size, self.device, self.shuffle = images, batch_size, device, shuffle
        full, rest = divmod(images.n, batch_size)
        self.sizes = [batch_size] * full + ([rest] if rest and not drop_last else [])
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self):
        seed = self.images.seed
        order = range(len(self.sizes))
        if self.shuffle:
            order = torch.randperm(len(self.sizes), generator=torch.Generator().manual_seed(seed + self.epoch)).tolist()
        self.epoch += 1
        gen = torch.Generator(device=self.device)
        size = self.images.img_size
        for b in order:
            gen.manual_seed(seed * 1_000_003 + b)
            n = self.sizes[b]
            images = torch.rand(n, 3, size, size, generator=gen, device=self.device) * 2 - 1
            labels = torch.randint(self.images.n_classes, (n,), generator=gen, device=self.device)
            yield images, labels


class HFImages(torch.utils.data.Dataset):
    """A Hugging Face image-classification split (``image``, ``label`` columns) with a transform."""

    def __init__(self, split, transform):
        self.split, self.transform = split, transform

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int):
        row = self.split[i]
        return self.transform(row["image"].convert("RGB")), int(row["label"])


class FolderImages(torch.utils.data.Dataset):
    """(path, label) pairs read with PIL, with a transform."""

    def __init__(self, samples: list[tuple[str, int]], transform):
        self.samples, self.transform = samples, transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.samples[i]
        with Image.open(path) as image:
            return self.transform(image.convert("RGB")), label


def scan_image_folder(root: Path, classes: list[str] | None = None) -> tuple[list[str], list[tuple[str, int]]]:
    """``root/<class>/<image>`` -> (sorted class names, [(path, class index)])."""
    found = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if classes is None:
        classes = found
    elif not set(found) <= set(classes):
        raise BenchmarkError(f"{root} has classes that the training folder lacks: {sorted(set(found) - set(classes))}")
    index = {c: i for i, c in enumerate(classes)}
    samples = [
        (str(p), index[c])
        for c in found
        for p in sorted((root / c).rglob("*"))
        if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
    ]
    if not classes or not samples:
        raise BenchmarkError(f"no images found in {root} (expected {root}/<class name>/<image>.jpg)")
    return classes, samples


def folder_splits(root: Path, seed: int, val_fraction: float = 0.2):
    """(classes, train samples, validation samples) of an image folder: ``root/train`` beside
    ``root/val`` (or ``validation``, ``test``) if present, else ``root/<class>/`` split by ``seed``."""
    if (root / "train").is_dir():
        val_dir = next((root / d for d in ("val", "validation", "test") if (root / d).is_dir()), None)
        if val_dir is None:
            raise BenchmarkError(f"{root} has train/ but no val/, validation/ or test/ folder")
        classes, train = scan_image_folder(root / "train")
        _, val = scan_image_folder(val_dir, classes)
        return classes, train, val
    classes, samples = scan_image_folder(root)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, int(len(samples) * val_fraction))
    return classes, [samples[i] for i in order[n_val:]], [samples[i] for i in order[:n_val]]


def check_dataset(dataset: str) -> None:
    """Fail early on a dataset that cannot be loaded."""
    if dataset == "resisc45":
        require("datasets", "--dataset resisc45")
    elif dataset != "synthetic":
        path = Path(dataset)
        if not path.exists():
            raise BenchmarkError(
                f"dataset path {dataset!r} does not exist (--dataset takes 'resisc45', 'synthetic' or an image folder)"
            )
        if not path.is_dir():
            raise BenchmarkError(
                f"dataset path {dataset!r} is not a folder (expected <path>/<class>/<image>, "
                f"or <path>/train/<class>/ and <path>/val/<class>/)"
            )


def image_transforms(img_size: int, mean, std):
    """(train, eval) transforms of PIL images: random resized crop and flip for training, resize for eval."""
    T = require("torchvision.transforms", "image preprocessing")
    to_tensor = [T.ToTensor(), T.Normalize(mean, std)]
    train = T.Compose([T.RandomResizedCrop(img_size), T.RandomHorizontalFlip()] + to_tensor)
    val = T.Compose([T.Resize(img_size), T.CenterCrop(img_size)] + to_tensor)
    return train, val


def load_splits(args) -> tuple[int, Any, Any]:
    """(number of classes, train split, validation split) before any transform: Hugging Face splits,
    lists of (path, label), or None for synthetic data."""
    if args.dataset == "synthetic":
        return RESISC45_CLASSES, None, None
    if args.dataset == "resisc45":
        datasets = require("datasets", "--dataset resisc45")
        try:
            train = datasets.load_dataset(RESISC45_ID, split="train")
            val = datasets.load_dataset(RESISC45_ID, split="validation")
        except Exception as err:
            raise BenchmarkError(
                f"could not load the {RESISC45_ID} dataset ({type(err).__name__}: "
                f"{_first_line(err)}); it needs internet access, or a local cache"
            ) from None
        return train.features["label"].num_classes, train, val
    classes, train, val = folder_splits(Path(args.dataset), args.seed)
    return len(classes), train, val


def build_datasets(args, splits: tuple[int, Any, Any], img_size: int, mean, std):
    """(train set, validation set) of ``load_splits``'s splits, transformed for a model of ``img_size``."""
    n_classes, train, val = splits
    if args.dataset == "synthetic":
        return (
            SyntheticImages(args.synthetic_train_size, n_classes, img_size, args.seed),
            SyntheticImages(args.synthetic_val_size, n_classes, img_size, args.seed + 1),
        )
    require("PIL", "reading images")
    train_tf, val_tf = image_transforms(img_size, mean, std)
    wrap = HFImages if args.dataset == "resisc45" else FolderImages
    return wrap(train, train_tf), wrap(val, val_tf)


# ---- model ------------------------------------------------------------------------------------------
_TIMM_SOURCES = ("hf-hub:", "hf_hub:", "local-dir:")


def timm_model_name(name: str) -> str:
    """``name`` as timm.create_model takes it: ``timm/<arch>.<tag>`` (the Hub id of timm's own weights)
    becomes ``<arch>.<tag>``, which timm resolves to the same weights."""
    return name[len("timm/") :] if name.startswith("timm/") else name


def check_model(name: str):
    """Import timm and check that it knows ``name``'s architecture; returns the timm module."""
    timm = require("timm", "building --model")
    name = timm_model_name(name)
    if name.startswith(_TIMM_SOURCES):
        return timm
    if "/" in name:
        raise BenchmarkError(
            f"--model {name!r} is neither a timm model name nor timm/<name>; for another Hub "
            f"repo or a local folder write hf-hub:{name} or local-dir:{name}"
        )
    arch = name.split(".")[0]
    if not timm.is_model(arch):
        raise _unknown("timm model", arch, timm.list_models(), show_all=False)
    return timm


def build_model(name: str, n_classes: int, pretrained: bool, model_kwargs: dict[str, Any] | None = None):
    """A timm model with an ``n_classes`` head; ``name`` may carry the ``timm/`` prefix and a pretrained tag."""
    timm = check_model(name)
    try:
        return timm.create_model(
            timm_model_name(name), pretrained=pretrained, num_classes=n_classes, **(model_kwargs or {})
        )
    except TypeError as err:
        raise BenchmarkError(
            f"--model_kwargs {json.dumps(model_kwargs)} rejected by {name}: {_first_line(err)}"
        ) from None
    except Exception as err:
        if not pretrained:
            raise
        raise BenchmarkError(
            f"could not load pretrained {name} ({type(err).__name__}: {_first_line(err)}); "
            f"downloading weights needs internet access (or pass --no_pretrained)"
        ) from None


def model_data_config(model) -> tuple[int, tuple[float, ...], tuple[float, ...]]:
    """(image size, normalization mean, std) the model expects."""
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    mean = tuple(cfg.get("mean", (0.5, 0.5, 0.5)))
    std = tuple(cfg.get("std", (0.5, 0.5, 0.5)))
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)  # reflects an img_size override
    if size is None:
        size = cfg.get("input_size", (3, 224, 224))[-1]
    if isinstance(size, (tuple, list)):
        size = size[-1]
    return int(size), mean, std


# ---- devices, precision, memory ---------------------------------------------------------------------
def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as err:
        raise BenchmarkError(f"invalid --device {name!r}: {_first_line(err)}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchmarkError(f"--device {name} requested but CUDA is not available (use --device cpu)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise BenchmarkError(f"--device {name} requested but MPS is not available (use --device cpu)")
    return device


def check_amp(amp: str, device: torch.device) -> None:
    if amp == "fp16" and device.type != "cuda":
        raise BenchmarkError(
            f"--amp fp16 (autocast with a GradScaler) needs CUDA, not {device.type}; use --amp bf16 or --amp none"
        )
    if amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise BenchmarkError(
            f"--amp bf16 is not supported by {torch.cuda.get_device_name(device)}; use --amp fp16 or --amp none"
        )


def autocast(amp: str, device: torch.device):
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def peak_memory(device: torch.device) -> tuple[float, str]:
    """(GB, what was measured): CUDA's max allocated memory, else the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, "cuda_max_allocated"
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux
    return rss_bytes / 1e9, "cpu_peak_rss"


MEMORY_LABELS = {
    "cuda_max_allocated": "max memory allocated (torch.cuda.max_memory_allocated)",
    "cpu_peak_rss": "peak RSS of the process (CPU run; includes the Python process, not comparable to CUDA)",
}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    return device.type


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- arguments --------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2 (through main), instead of usage + message
        raise BenchmarkError(f"{message} (see --help)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def get_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="benchmark_adam_8bit.py",
        description="Fine-tune a timm model (synthetic data by default, resisc45 for accuracy) and compare "
        "optimizers on max memory, throughput, the optimizer's own time per step and validation accuracy. "
        "Results are appended to --results as JSON lines, one per optimizer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="timm model name, optionally with the timm/ prefix and a pretrained tag"
    )
    p.add_argument(
        "--model_kwargs",
        type=_json_object,
        default={},
        metavar="JSON",
        help='extra timm.create_model kwargs, e.g. \'{"img_size": 32, "depth": 2}\'',
    )
    p.add_argument("--no_pretrained", action="store_true", help="random initial weights (no download)")
    p.add_argument(
        "--amp",
        choices=["none", "bf16", "fp16"],
        default="bf16",
        help="autocast dtype; fp16 adds a GradScaler and needs CUDA",
    )
    p.add_argument(
        "--optim",
        default="AdamWDTQ8bit",
        metavar="NAME[,NAME...]",
        help="an optimizer, or a comma list of them run in turn from the same starting weights, one of: "
        + "; ".join(f"{e.name} = {e.description}" for e in optimizers.optimizer_table().values()),
    )
    p.add_argument(
        "--repeats",
        type=_positive_int,
        default=1,
        help="rounds of every --optim (the order rotated each round); the results give the median over them and "
        "the table their spread, and says 'within noise' where the spreads overlap",
    )
    p.add_argument(
        "--warmup_steps",
        type=_non_negative_int,
        default=None,
        help=f"untimed steps at the start of each run, where compiles fall (default {DEFAULT_WARMUP_STEPS}, fewer "
        "in a run that short); throughput and the optimizer's time count the steps after them",
    )
    p.add_argument(
        "--no_optim_compile",
        action="store_true",
        help="run torchao_optim's optimizer updates eagerly instead of compiled",
    )
    p.add_argument("--lr", type=_non_negative_float, default=1e-4, help="learning rate (the peak, with a schedule)")
    p.add_argument(
        "--weight_decay",
        type=_non_negative_float,
        default=0.0,
        help="L2 penalty for the Adam optimizers, decoupled weight decay for the AdamW ones",
    )
    p.add_argument(
        "--cosine_lr_scheduler",
        action="store_true",
        help="linear warm-up over --warmup_fraction of the steps, then cosine decay to 0",
    )
    p.add_argument(
        "--warmup_fraction",
        type=_non_negative_float,
        default=0.05,
        help="fraction of the steps spent warming up, with --cosine_lr_scheduler",
    )
    p.add_argument("--n_epochs", type=_positive_int, default=10, help="passes over the training set")
    p.add_argument("--batch_size", type=_positive_int, default=64, help="images per optimizer step")
    p.add_argument("--max_steps", type=_positive_int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--seed", type=int, default=2024, help="seeds the new head, the data order and synthetic data")
    p.add_argument("--n_workers", type=int, default=4, help="DataLoader worker processes (not for synthetic data)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--dataset",
        default="synthetic",
        help=f"'synthetic' (random images and labels made on the device: no input pipeline in the timed loop), "
        f"'resisc45' (Hugging Face {RESISC45_ID}, through a DataLoader with augmentation: for accuracy), or an "
        f"image folder: <path>/<class>/<image> or <path>/{{train,val}}/<class>/<image>",
    )
    p.add_argument("--synthetic_train_size", type=_positive_int, default=1024, help="images in the synthetic train set")
    p.add_argument(
        "--synthetic_val_size", type=_positive_int, default=256, help="images in the synthetic validation set"
    )
    p.add_argument("--device", default=None, help="torch device; default cuda if available, else cpu")
    p.add_argument(
        "--profile",
        action="store_true",
        help=f"write a Chrome trace of the first {PROFILE_ITERATIONS} iterations (torch.profiler)",
    )
    p.add_argument(
        "--profile_path",
        default=None,
        help="where --profile writes its trace; default trace-<run name>.json beside --results",
    )
    p.add_argument("--results", default=DEFAULT_RESULTS, help="JSON-lines file each run appends its summary to")
    p.add_argument("--log_interval", type=_positive_int, default=10, help="steps between loss records")
    p.add_argument("--project", default=None, help="log to this wandb project (needs wandb)")
    p.add_argument(
        "--run_name", default=None, help="wandb run name and table label, for one --optim; default: the --optim name"
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate everything that needs no model: unknown names and missing packages fail here."""
    args = get_parser().parse_args(argv)
    names = optim_list(args.optim)
    for name in names:
        check_optimizer(name)
    if args.run_name is not None and len(names) > 1:
        raise BenchmarkError(f"--run_name labels one optimizer's run; --optim {args.optim!r} names {len(names)}")
    check_dataset(args.dataset)
    if args.n_workers < 0:
        raise BenchmarkError(f"--n_workers must be >= 0, got {args.n_workers}")
    check_amp(args.amp, resolve_device(args.device))
    if args.project is not None:
        require("wandb", "--project (wandb logging)")
    require("tqdm", "the progress bar")
    check_model(args.model)  # last: everything above is checked without timm
    return args


# ---- training ---------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device, amp: str) -> float:
    """Top-1 accuracy on ``loader``."""
    model.eval()
    correct = total = 0
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with autocast(amp, device):
            logits = model(images)
        correct += int((logits.argmax(-1) == labels).sum())
        total += labels.numel()
    model.train()
    return correct / max(1, total)


def make_loaders(args, train_set, val_set, device: torch.device):
    """(train batches, validation batches): made on ``device`` for synthetic data, else DataLoaders. Called once
    per run, so that every run sees the batches in the same order."""
    if isinstance(train_set, SyntheticImages):
        train = train_set.batches(args.batch_size, device, shuffle=True, drop_last=True)
        if len(train) == 0:
            raise BenchmarkError(
                f"--batch_size {args.batch_size} is larger than the training set ({len(train_set)} images)"
            )
        return train, val_set.batches(args.batch_size, device, shuffle=False, drop_last=False)
    common = dict(num_workers=args.n_workers, pin_memory=device.type == "cuda", persistent_workers=False)
    train = torch.utils.data.DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
        **common,
    )
    val = torch.utils.data.DataLoader(val_set, batch_size=args.batch_size, shuffle=False, **common)
    if len(train) == 0:
        raise BenchmarkError(
            f"--batch_size {args.batch_size} is larger than the training set ({len(train_set)} images)"
        )
    return train, val


def warmup_steps(args, total_steps: int) -> int:
    """Untimed steps at the start of each run: ``--warmup_steps``, or by default 5 (fewer in a run of 5 steps
    or less, which keeps one timed step)."""
    if args.warmup_steps is None:
        return max(0, min(DEFAULT_WARMUP_STEPS, total_steps - 1))
    if args.warmup_steps >= total_steps:
        raise BenchmarkError(
            f"--warmup_steps {args.warmup_steps} leaves no timed step in a run of {total_steps} steps "
            f"(--n_epochs, --max_steps)"
        )
    return args.warmup_steps


class StepTimer:
    """Times of ``optimizer.step()`` in the loop: CUDA events around each call on a GPU (read after the epoch's
    synchronize, so timing adds no sync), ``time.perf_counter`` elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[Any, Any]] = []
        self.ms: list[float] = []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, start, end) -> None:
        self.pending.append((start, end))

    def collect(self) -> None:
        """Read the pending times (call after a synchronize)."""
        for start, end in self.pending:
            self.ms.append(start.elapsed_time(end) if self.cuda else 1e3 * (end - start))
        self.pending.clear()


def train_and_evaluate(
    args,
    model: nn.Module,
    train_loader,
    val_loader,
    device: torch.device,
    wandb_run=None,
    optim_name: str | None = None,
    run_name: str | None = None,
    profile: bool | None = None,
) -> dict[str, Any]:
    """Fine-tune ``model`` (already on ``device``) with ``optim_name`` (default ``--optim``) and evaluate after
    each epoch; the run's summary. The first :func:`warmup_steps` steps train but are not timed (compiles fall
    there); throughput counts the timed steps, and the optimizer's own time per step is the median over them."""
    from tqdm import tqdm

    optim_name = optim_name or args.optim
    run_name = run_name or args.run_name or optim_name
    profile = args.profile if profile is None else profile
    optim = make_optimizer(
        optim_name, model.parameters(), args.lr, args.weight_decay, compile=not args.no_optim_compile
    )
    if args.compile:
        model = torch.compile(model)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None

    total_steps = args.n_epochs * len(train_loader)
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    warmup = warmup_steps(args, total_steps)
    lr_warmup_steps = int(args.warmup_fraction * total_steps)

    profiler, profile_path = None, None
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile_path = Path(args.profile_path or Path(args.results).parent / f"trace-{run_name}.json")
        kwargs = {}
        if "acc_events" in inspect.signature(torch.profiler.profile).parameters:
            kwargs["acc_events"] = True  # one recording, from start to stop: nothing to clear in between
        profiler = torch.profiler.profile(activities=activities, **kwargs)
        profiler.__enter__()

    def stop_profiler(n_iterations: int) -> None:
        nonlocal profiler
        if profiler is None:
            return
        synchronize(device)
        profiler.__exit__(None, None, None)
        profile_path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(profile_path))
        profiler = None
        print(f"Chrome trace of the first {n_iterations} iterations written to {profile_path}", file=sys.stderr)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    step, n_images, train_time = 0, 0, 0.0
    timed_images, timed_time = 0, 0.0
    step_timer = StepTimer(device)
    loss_curve: list[tuple[int, float]] = []
    val_acc_per_epoch: list[float] = []
    interval_loss, interval_steps = torch.zeros((), device=device), 0
    last_loss = float("nan")
    bar = tqdm(total=total_steps, desc=run_name, dynamic_ncols=True)
    for epoch in range(args.n_epochs):
        synchronize(device)
        epoch_start = time.perf_counter()
        timed_start = epoch_start if step >= warmup else None
        for images, labels in train_loader:
            if args.cosine_lr_scheduler:
                lr = cosine_lr(step, total_steps, args.lr, lr_warmup_steps)
                for group in optim.param_groups:
                    group["lr"] = lr
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with autocast(args.amp, device):
                logits = model(images)
            loss = F.cross_entropy(logits.float(), labels)
            optim.zero_grad(set_to_none=True)
            timed = step >= warmup
            if scaler is not None:
                scaler.scale(loss).backward()
                start = step_timer.mark() if timed else None
                scaler.step(optim)
                if timed:
                    step_timer.add(start, step_timer.mark())
                scaler.update()
            else:
                loss.backward()
                start = step_timer.mark() if timed else None
                optim.step()
                if timed:
                    step_timer.add(start, step_timer.mark())
            step += 1
            n_images += labels.numel()
            if timed:
                timed_images += labels.numel()
            elif step == warmup:  # the warm-up ends here: time from when its work is done
                synchronize(device)
                timed_start = time.perf_counter()
            interval_loss += loss.detach()
            interval_steps += 1
            if profiler is not None:
                profiler.step()
                if step == PROFILE_ITERATIONS:
                    stop_profiler(step)
            if step % args.log_interval == 0 or step == total_steps:
                last_loss = interval_loss.item() / interval_steps
                loss_curve.append((step, last_loss))
                interval_loss.zero_()
                interval_steps = 0
                elapsed = train_time + time.perf_counter() - epoch_start
                bar.set_postfix(loss=f"{last_loss:.4f}", imgs_per_s=f"{n_images / elapsed:.1f}")
                if wandb_run is not None:
                    wandb_run.log(
                        {
                            "loss": last_loss,
                            "lr": optim.param_groups[0]["lr"],
                            "imgs_per_s": n_images / elapsed,
                            "epoch": epoch,
                        },
                        step=step,
                    )
            bar.update(1)
            if step >= total_steps:
                break
        synchronize(device)
        now = time.perf_counter()
        train_time += now - epoch_start
        if timed_start is not None:
            timed_time += now - timed_start
        step_timer.collect()
        acc = evaluate(model, val_loader, device, args.amp)
        val_acc_per_epoch.append(acc)
        bar.write(f"epoch {epoch + 1}: step {step}, loss {last_loss:.4f}, val accuracy {acc:.2%}")
        if wandb_run is not None:
            wandb_run.log({"val_acc": acc, "epoch": epoch + 1}, step=step)
        if step >= total_steps:
            break
    bar.close()
    stop_profiler(step)  # a run of fewer than PROFILE_ITERATIONS steps

    memory_gb, memory_kind = peak_memory(device)
    del optim
    return {
        "run_name": run_name,
        "optim": optim_name,
        "model": args.model,
        "pretrained": not args.no_pretrained,
        "amp": args.amp,
        "dataset": args.dataset,
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "cosine_lr_scheduler": args.cosine_lr_scheduler,
        "batch_size": args.batch_size,
        "n_epochs": args.n_epochs,
        "max_steps": args.max_steps,
        "seed": args.seed,
        "compile": args.compile,
        "optim_compile": not args.no_optim_compile,
        "steps": step,
        "images": n_images,
        "warmup_steps": warmup,
        "timed_steps": len(step_timer.ms),
        "memory_gb": memory_gb,
        "memory_kind": memory_kind,
        "train_time_s": train_time,
        "timed_time_s": timed_time,
        "throughput_imgs_s": timed_images / timed_time if timed_time > 0 else float("nan"),
        "optim_step_ms": statistics.median(step_timer.ms) if step_timer.ms else float("nan"),
        "optim_step_timer": "cuda_events" if step_timer.cuda else "perf_counter",
        "val_acc": val_acc_per_epoch[-1] if val_acc_per_epoch else float("nan"),
        "val_acc_per_epoch": val_acc_per_epoch,
        "final_loss": last_loss,
        "loss_curve": loss_curve,
        "profile_trace": str(profile_path) if profile_path is not None else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def aggregate(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One optimizer's repeats as one results line: the first run's settings, loss curve and accuracy per epoch;
    the median over the repeats in the fields a single run has (the largest memory), and every repeat's figure
    in ``*_runs`` lists, from which the table takes the spread."""
    row = dict(runs[0])

    def median(key):
        return statistics.median(r[key] for r in runs)

    row.update(
        repeats=len(runs),
        train_time_s=median("train_time_s"),
        timed_time_s=median("timed_time_s"),
        throughput_imgs_s=median("throughput_imgs_s"),
        throughput_runs=[r["throughput_imgs_s"] for r in runs],
        optim_step_ms=median("optim_step_ms"),
        optim_step_ms_runs=[r["optim_step_ms"] for r in runs],
        memory_gb=max(r["memory_gb"] for r in runs),
        val_acc=median("val_acc"),
        val_acc_runs=[r["val_acc"] for r in runs],
        final_loss=median("final_loss"),
    )
    return row


def summary_text(result: dict[str, Any]) -> str:
    repeats = result.get("repeats", 1)
    throughput = f"{result['throughput_imgs_s']:.1f} imgs/s"
    step_ms = f"{result['optim_step_ms']:.3f} ms" if "optim_step_ms" in result else "n/a"
    if repeats > 1:
        runs = result["throughput_runs"]
        throughput += f" (median of {repeats} repeats; {min(runs):.1f}–{max(runs):.1f})"
        step_ms += f" ({min(result['optim_step_ms_runs']):.3f}–{max(result['optim_step_ms_runs']):.3f})"
    timed = f", {result['warmup_steps']} warm-up steps untimed" if result.get("warmup_steps") else ""
    return "\n".join(
        [
            f"== {result['run_name']}: {result['model']}, amp {result['amp']}, {result['steps']} steps on "
            f"{result['device']} ==",
            f"memory:        {result['memory_gb']:.2f} GB, {MEMORY_LABELS[result['memory_kind']]}",
            f"training time: {format_duration(result['train_time_s'])} ({result['train_time_s']:.1f} s)",
            f"throughput:    {throughput}{timed}",
            f"optimizer:     {step_ms} per step ({result.get('optim_step_timer', 'n/a')})",
            f"val accuracy:  {result['val_acc']:.2%}",
        ]
    )


def append_result(path: str, result: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as f:
        f.write(json.dumps(result) + "\n")


def optim_list(spec: str) -> list[str]:
    """``--optim``'s names: one, or a comma list."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise BenchmarkError(f"--optim {spec!r} names no optimizer")
    if len(set(names)) != len(names):
        raise BenchmarkError(f"--optim {spec!r} names an optimizer twice; use --repeats to run one again")
    return names


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The benchmark from parsed arguments: build the model once, then for ``--repeats`` rounds train it with
    each ``--optim`` in turn (the order rotated each round), every run from the same starting weights, batches
    and seed; one aggregated result per optimizer, in ``--optim``'s order."""
    device = resolve_device(args.device)
    check_amp(args.amp, device)
    wandb = require("wandb", "--project (wandb logging)") if args.project is not None else None
    names = optim_list(args.optim)
    torch.manual_seed(args.seed)

    splits = load_splits(args)
    model = build_model(args.model, splits[0], pretrained=not args.no_pretrained, model_kwargs=args.model_kwargs)
    img_size, mean, std = model_data_config(model)
    train_set, val_set = build_datasets(args, splits, img_size, mean, std)
    model.to(device)
    # on the host: a copy on the device would count in every run's peak memory
    start = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            model.load_state_dict(start)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(args.seed)
            train_loader, val_loader = make_loaders(args, train_set, val_set, device)
            label = args.run_name or name
            wandb_run = None
            if wandb is not None:
                wandb_run = wandb.init(
                    project=args.project,
                    name=label if args.repeats == 1 else f"{label} #{r + 1}",
                    config={**vars(args), "optim": name},
                )
            try:
                result = train_and_evaluate(
                    args,
                    model,
                    train_loader,
                    val_loader,
                    device,
                    wandb_run,
                    optim_name=name,
                    run_name=label,
                    profile=args.profile and r == 0,
                )
            finally:
                if wandb_run is not None:
                    wandb_run.finish()
            runs[name].append(result)
            if args.repeats > 1:
                print(
                    f"repeat {r + 1}/{args.repeats} {name}: {result['throughput_imgs_s']:.1f} imgs/s, "
                    f"optimizer {result['optim_step_ms']:.3f} ms/step",
                    file=sys.stderr,
                )
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return [aggregate(runs[n]) for n in names]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        results = run(args)
    except BenchmarkError as err:
        print(f"benchmark_adam_8bit.py: error: {err}", file=sys.stderr)
        return 2
    for result in results:
        result["argv"] = list(sys.argv[1:] if argv is None else argv)
        print(summary_text(result))
        append_result(args.results, result)
    if len(results) > 1:
        print()
        print(markdown_table(results))
    print(f"appended to {args.results} (render with: python benchmarks/render_finetune_table.py {args.results})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
