"""The fine-tuning benchmark (benchmarks/benchmark_adam_8bit.py) and its table renderer.

Everything but the last tests runs without timm: the optimizer factory, argument checks and their
one-line errors, the learning-rate schedule, the data sets, the training loop on a small torch model and
the results table. The smoke test at the end fine-tunes a tiny timm ViT on synthetic data with each
optimizer, and is skipped where timm cannot be imported.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from benchmark_scripts import BENCHMARKS, load_benchmark
from torch import nn

import torchao_optim

bench = load_benchmark("benchmark_adam_8bit", "_finetune_benchmark_adam_8bit")
render = load_benchmark("render_finetune_table", "_finetune_render_finetune_table")


def _available_optimizers():
    return [n for n in bench.optimizer_names() if bench.optimizers.missing_package(n) is None]


def _error_line(capsys):
    """stderr of a failed main(): exactly one line, the script's own error."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("benchmark_adam_8bit.py: error: "), err
    return lines[0]


# ---- optimizers ---------------------------------------------------------------------------------------
def test_optimizer_names():
    names = bench.optimizer_names()
    for required in ("Adam", "AdamW", "AdamBnb8bit", "AdamWBnb8bit", "AdamDTQ8bit", "AdamWDTQ8bit"):
        assert required in names
    for fmt in torchao_optim.list_state_formats():
        assert f"Adam-{fmt}" in names and f"AdamW-{fmt}" in names
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name", _available_optimizers())
def test_make_optimizer_builds_and_steps(name):
    torch.manual_seed(0)
    model = nn.Linear(128, 64)  # 8192 weights: past min_quant_size, so our formats quantize them
    opt = bench.make_optimizer(name, model.parameters(), lr=3e-4, weight_decay=0.01, compile=False)
    scale = getattr(opt, "lr_scale", 1.0)  # SGD and Lion run at a multiple of AdamW's lr (benchmarks/optimizers.py)
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-4 * scale)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.01 / scale)
    before = model.weight.detach().clone()
    model(torch.randn(8, 128)).square().mean().backward()
    opt.step()
    assert not torch.equal(before, model.weight)
    assert torch.isfinite(model.weight).all()

    expected = {
        "Adam": torch.optim.Adam,
        "AdamW": torch.optim.AdamW,
        "AdamDTQ8bit": torchao_optim.AdamDTQ8bit,
        "AdamWDTQ8bit": torchao_optim.AdamW8bit,
    }
    if name in expected:
        assert type(opt) is expected[name]
    if name.startswith("Adam-") or name.startswith("AdamW-"):
        cls = torchao_optim.AdamW if name.startswith("AdamW-") else torchao_optim.Adam
        assert isinstance(opt, cls) and opt.param_groups[0]["state_format"] == name.split("-", 1)[1]
    if isinstance(opt, torchao_optim.Adam):
        assert opt.param_groups[0]["decoupled_weight_decay"] == name.startswith("AdamW")
        state_format = opt.param_groups[0]["state_format"]
        fmt = torch.Tensor if state_format == "none" else torchao_optim.get_state_format(state_format)
        assert type(opt.state[model.weight]["exp_avg"]) is fmt
    if "Bnb" in name:
        assert type(opt).__module__.startswith("bitsandbytes")


def test_missing_bitsandbytes_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if not installed
    with pytest.raises(bench.BenchmarkError, match=r"needs the 'bitsandbytes' package.*pip install bitsandbytes"):
        bench.make_optimizer("AdamBnb8bit", nn.Linear(4, 4).parameters(), lr=1e-3)
    assert bench.main(["--optim", "AdamWBnb8bit", "--dataset", "synthetic", "--device", "cpu"]) == 2
    assert "pip install bitsandbytes" in _error_line(capsys)


# ---- argument checks and their errors -------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optim", "nope"], r"unknown optimizer 'nope' \(choose from: Adam, AdamW, "),
        (["--optim", "AdamWDTQ8bt"], r"unknown optimizer 'AdamWDTQ8bt'; did you mean 'AdamWDTQ8bit'"),
        (["--amp", "fp8"], r"argument --amp: invalid choice: 'fp8'"),
        (["--batch_size", "0"], r"--batch_size: expected a positive integer"),
        (["--lr", "-1"], r"--lr: expected a non-negative number"),
        (["--model_kwargs", "[1]"], r"--model_kwargs: expected a JSON object"),
        (["--model_kwargs", "{oops"], r"--model_kwargs: not valid JSON"),
        (["--dataset", "synthetic", "--device", "cpu", "--amp", "fp16"], r"--amp fp16 .* needs CUDA"),
        (["--dataset", "synthetic", "--device", "cpu", "--n_workers", "-1"], r"--n_workers must be >= 0"),
        (["--dataset", "synthetic", "--device", "nonsense"], r"invalid --device 'nonsense'"),
        (["--optim", "Adam,nope"], r"unknown optimizer 'nope'"),
        (["--optim", "Adam,AdamW8bit,Adam"], r"--optim 'Adam,AdamW8bit,Adam' names an optimizer twice"),
        (["--optim", ","], r"--optim ',' names no optimizer"),
        (["--optim", "Adam,AdamW", "--run_name", "mine"], r"--run_name labels one optimizer's run; .* names 2"),
        (["--repeats", "0"], r"--repeats: expected a positive integer, got '0'"),
        (["--warmup_steps", "-1"], r"--warmup_steps: expected a non-negative integer, got '-1'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    assert bench.main(argv) == 2
    line = _error_line(capsys)
    assert re.search(message, line), line


def test_missing_dataset_path(tmp_path, capsys):
    missing = tmp_path / "no_such_folder"
    assert bench.main(["--dataset", str(missing), "--device", "cpu"]) == 2
    assert f"dataset path '{missing}' does not exist" in _error_line(capsys)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert bench.main(["--dataset", str(a_file), "--device", "cpu"]) == 2
    assert "is not a folder" in _error_line(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the message for a machine without CUDA")
def test_cuda_unavailable(capsys):
    assert bench.main(["--dataset", "synthetic", "--device", "cuda"]) == 2
    assert "CUDA is not available" in _error_line(capsys)


@pytest.mark.parametrize(
    "package, argv",
    [
        ("timm", ["--dataset", "synthetic", "--device", "cpu"]),
        ("datasets", ["--dataset", "resisc45", "--device", "cpu"]),
        ("wandb", ["--dataset", "synthetic", "--device", "cpu", "--project", "finetune"]),
        ("tqdm", ["--dataset", "synthetic", "--device", "cpu"]),
    ],
)
def test_missing_optional_package(package, argv, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, package, None)
    assert bench.main(argv) == 2
    line = _error_line(capsys)
    assert f"needs the '{package}' package, which is not installed (pip install {package})" in line


def test_package_that_fails_to_import(tmp_path, monkeypatch):
    # timm beside a torchvision built for another torch fails with a RuntimeError, not an ImportError
    (tmp_path / "broken_vision_pkg.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(bench.BenchmarkError) as info:
        bench.require("broken_vision_pkg", "building --model")
    message = str(info.value)
    assert "installed but failed to import (RuntimeError: operator torchvision::nms does not exist)" in message
    assert "torchvision release built for torch" in message


def test_command_line_error_is_one_line_without_traceback():
    # -W ignore: torch's own import-time warnings (e.g. no numpy installed) are not the script's output
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(BENCHMARKS / "benchmark_adam_8bit.py"), "--optim", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("benchmark_adam_8bit.py: error: unknown optimizer 'nope'")


@pytest.mark.parametrize("columns", ["40", "80", "200"])
def test_help_lists_every_optimizer(capsys, monkeypatch, columns):
    # argparse wraps the help to the terminal's width (COLUMNS), and breaks lines at hyphens too (a long name
    # such as AdamW-powerlaw8 across two lines): the names are looked for in the help without its whitespace
    monkeypatch.setenv("COLUMNS", columns)
    with pytest.raises(SystemExit) as info:
        bench.get_parser().parse_args(["--help"])
    assert info.value.code == 0
    out = "".join(capsys.readouterr().out.split())
    for name in bench.optimizer_names():
        if "-test_" in name:  # formats other test modules register in this process; --help is built without them
            continue
        assert name in out, f"{name} is not in --help (COLUMNS={columns})"


# ---- learning rate, data --------------------------------------------------------------------------------
def test_cosine_lr():
    total, warmup, base = 100, 10, 1e-3
    lrs = [bench.cosine_lr(s, total, base, warmup) for s in range(total + 1)]
    assert all(isinstance(lr, float) for lr in lrs)
    assert lrs[0] == pytest.approx(base / warmup)
    assert lrs[:warmup] == pytest.approx([base * (s + 1) / warmup for s in range(warmup)])
    assert lrs[warmup] == pytest.approx(base)
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :]))
    assert lrs[(total + warmup) // 2] == pytest.approx(base / 2)
    assert lrs[total] == pytest.approx(0.0, abs=1e-12)
    assert bench.cosine_lr(5, 10, 1.0, 0) == pytest.approx(0.5)  # no warm-up
    assert bench.cosine_lr(37, total, base, warmup) == lrs[37]  # stateless


def _epoch(loader):
    return [(images.clone(), labels.clone()) for images, labels in loader]


def test_synthetic_batches_are_made_on_the_device_and_the_same_for_every_run():
    a, b, c = (bench.SyntheticImages(10, 45, 16, seed) for seed in (0, 0, 1))
    assert len(a) == 10
    loader = a.batches(4, torch.device("cpu"), shuffle=True, drop_last=True)
    assert len(loader) == 2
    first, second = _epoch(loader), _epoch(loader)
    for images, labels in first:
        assert images.shape == (4, 3, 16, 16) and images.dtype == torch.float32 and images.device.type == "cpu"
        assert -1 <= images.min() and images.max() <= 1 and 0 <= labels.min() and labels.max() < 45
    # every epoch shows the same batches, each whole (shuffled by batch), so a model can fit them
    assert sorted(float(x.sum()) for x, _ in first) == sorted(float(x.sum()) for x, _ in second)
    assert not torch.equal(first[0][0], first[1][0])
    # a new loader (the next optimizer's run) replays the same sequence; another seed gives other images
    again = _epoch(b.batches(4, torch.device("cpu"), shuffle=True, drop_last=True))
    assert all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(first, again))
    other = _epoch(c.batches(4, torch.device("cpu"), shuffle=True, drop_last=True))
    assert not any(torch.equal(x, y) for (x, _), (y, _) in zip(first, other))
    # evaluation keeps the short last batch
    val = a.batches(4, torch.device("cpu"), shuffle=False, drop_last=False)
    assert [len(labels) for _, labels in val] == [4, 4, 2]


def test_image_folder_layouts(tmp_path):
    def make(root, classes, n):
        for c in classes:
            (root / c).mkdir(parents=True)
            for i in range(n):
                (root / c / f"{i}.jpg").write_bytes(b"")
            (root / c / "notes.txt").write_text("not an image")

    make(tmp_path / "split" / "train", ["b", "a"], 3)
    make(tmp_path / "split" / "val", ["a"], 2)
    classes, train, val = bench.folder_splits(tmp_path / "split", seed=0)
    assert classes == ["a", "b"]
    assert len(train) == 6 and len(val) == 2 and {label for _, label in val} == {0}

    make(tmp_path / "flat", ["x", "y", "z"], 5)
    classes, train, val = bench.folder_splits(tmp_path / "flat", seed=0)
    assert classes == ["x", "y", "z"] and len(train) == 12 and len(val) == 3
    assert bench.folder_splits(tmp_path / "flat", seed=0)[2] == val  # deterministic
    assert not set(train) & set(val)

    make(tmp_path / "mismatch" / "train", ["a"], 1)
    make(tmp_path / "mismatch" / "val", ["a", "c"], 1)
    with pytest.raises(bench.BenchmarkError, match=r"classes that the training folder lacks: \['c'\]"):
        bench.folder_splits(tmp_path / "mismatch", seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(bench.BenchmarkError, match="no images found"):
        bench.folder_splits(tmp_path / "empty", seed=0)


def _require(*modules):
    for name in modules:
        try:
            __import__(name)
        except Exception as err:  # ImportError, or torchvision built for another torch (RuntimeError)
            pytest.skip(f"needs {name}, which cannot be imported here ({type(err).__name__})")


def _make_images(root, classes, n, size=40):
    from PIL import Image

    for k, c in enumerate(classes):
        (root / c).mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", (size, size + 8), (40 * k, 7 * i, 100)).save(root / c / f"{i}.png")


def test_image_folder_dataset_reads_images(tmp_path):
    _require("PIL", "torchvision.transforms")
    _make_images(tmp_path / "data" / "train", ["forest", "river"], 3)
    _make_images(tmp_path / "data" / "val", ["forest", "river"], 1)
    args = bench.get_parser().parse_args(["--dataset", str(tmp_path / "data")])
    splits = bench.load_splits(args)
    assert splits[0] == 2
    train, val = bench.build_datasets(args, splits, 16, (0.5,) * 3, (0.5,) * 3)
    assert len(train) == 6 and len(val) == 2
    image, label = val[1]
    assert image.shape == (3, 16, 16) and label == 1
    assert train[0][0].shape == (3, 16, 16)


def test_resisc45_loads_through_hugging_face_datasets(monkeypatch):
    _require("PIL", "torchvision.transforms", "datasets")
    import datasets
    from PIL import Image

    names = [f"class{i}" for i in range(45)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    calls = []

    def fake_load_dataset(path, split):  # offline stand-in for the Hub download
        calls.append((path, split))
        images = [Image.new("RGB", (256, 256), (i, 0, 0)) for i in range(4)]
        return datasets.Dataset.from_dict({"image": images, "label": [0, 5, 44, 3]}, features=features)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    args = bench.get_parser().parse_args(["--dataset", "resisc45"])
    splits = bench.load_splits(args)
    assert calls == [("timm/resisc45", "train"), ("timm/resisc45", "validation")]
    assert splits[0] == 45
    train, val = bench.build_datasets(args, splits, 24, (0.5,) * 3, (0.5,) * 3)
    image, label = val[2]
    assert image.shape == (3, 24, 24) and label == 44
    assert train[1][0].shape == (3, 24, 24)


def test_resisc45_download_failure_is_a_clear_error(monkeypatch):
    _require("datasets")
    import datasets

    def offline(path, split):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(bench.BenchmarkError, match=r"could not load the timm/resisc45 dataset \(ConnectionError"):
        bench.load_splits(bench.get_parser().parse_args(["--dataset", "resisc45"]))


# ---- the training loop, on a small torch model ------------------------------------------------------------
def test_training_loop_without_timm(tmp_path, capsys):
    results = tmp_path / "results" / "finetune.jsonl"
    args = bench.get_parser().parse_args(
        [
            "--dataset",
            "synthetic",
            "--device",
            "cpu",
            "--optim",
            "AdamWDTQ8bit",
            "--no_optim_compile",
            "--batch_size",
            "4",
            "--n_epochs",
            "3",
            "--max_steps",
            "5",
            "--synthetic_train_size",
            "12",
            "--synthetic_val_size",
            "8",
            "--n_workers",
            "0",
            "--cosine_lr_scheduler",
            "--lr",
            "1e-3",
            "--log_interval",
            "2",
            "--profile",
            "--results",
            str(results),
        ]
    )
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 45))
    train_set, val_set = bench.build_datasets(args, bench.load_splits(args), 8, (0.5,) * 3, (0.5,) * 3)
    train_loader, val_loader = bench.make_loaders(args, train_set, val_set, torch.device("cpu"))
    result = bench.train_and_evaluate(args, model, train_loader, val_loader, torch.device("cpu"))

    assert result["steps"] == 5 and result["images"] == 20
    # the first steps are untimed (4 by default in a run of 5: one stays timed); the rest time the optimizer
    assert result["warmup_steps"] == 4 and result["timed_steps"] == 1
    assert result["optim_step_timer"] == "perf_counter" and result["optim_step_ms"] > 0
    assert result["timed_time_s"] < result["train_time_s"]
    assert result["throughput_imgs_s"] == pytest.approx(4 / result["timed_time_s"])
    assert len(result["val_acc_per_epoch"]) == 2  # 3 steps an epoch: stopped in the second
    assert 0.0 <= result["val_acc"] <= 1.0
    assert [s for s, _ in result["loss_curve"]] == [2, 4, 5]
    assert all(loss == loss and loss > 0 for _, loss in result["loss_curve"])
    assert result["memory_kind"] == "cpu_peak_rss" and result["memory_gb"] > 0
    assert result["train_time_s"] > 0 and result["throughput_imgs_s"] > 0
    trace = Path(result["profile_trace"])
    assert trace == results.parent / "trace-AdamWDTQ8bit.json"
    assert "traceEvents" in json.loads(trace.read_text())

    summary = bench.summary_text(result)
    assert "peak RSS" in summary and "val accuracy" in summary and "imgs/s" in summary
    bench.append_result(str(results), result)
    bench.append_result(str(results), result)
    rows = render.load_results([str(results)])
    assert len(rows) == 2 and rows[0]["optim"] == "AdamWDTQ8bit"
    assert "| AdamWDTQ8bit (bf16) #1 |" in render.markdown_table(rows)


class _TinyClassifier(nn.Sequential):
    """A stand-in for a timm model: what run() reads of one (its expected input size) and a 8x8 image input."""

    pretrained_cfg = {"input_size": (3, 8, 8)}

    def __init__(self, n_classes):
        super().__init__(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, n_classes))


def _finetune_args(tmp_path, *extra):
    return bench.get_parser().parse_args(
        [
            "--device",
            "cpu",
            "--no_optim_compile",
            "--batch_size",
            "4",
            "--n_epochs",
            "2",
            "--synthetic_train_size",
            "16",
            "--synthetic_val_size",
            "8",
            "--results",
            str(tmp_path / "finetune.jsonl"),
            *extra,
        ]
    )


def test_repeats_alternate_the_optimizers_from_the_same_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(
        bench, "build_model", lambda name, n_classes, pretrained, model_kwargs: _TinyClassifier(n_classes)
    )
    calls = []
    train = bench.train_and_evaluate

    def recording(args, model, train_loader, val_loader, device, wandb_run=None, **kw):
        first_batch = next(iter(train_loader))[0]
        calls.append((kw["optim_name"], [p.detach().clone() for p in model.parameters()], first_batch))
        return train(args, model, train_loader, val_loader, device, wandb_run, **kw)

    monkeypatch.setattr(bench, "train_and_evaluate", recording)
    args = _finetune_args(tmp_path, "--optim", "AdamWTorchFused,AdamW8bit", "--repeats", "3", "--warmup_steps", "2")
    rows = bench.run(args)

    # the order turns each round, so neither optimizer always runs first
    assert [name for name, _, _ in calls] == ["AdamWTorchFused", "AdamW8bit", "AdamW8bit", "AdamWTorchFused"] + [
        "AdamWTorchFused",
        "AdamW8bit",
    ]
    # every run starts from the same weights and sees the same first batch
    for _, weights, batch in calls[1:]:
        assert all(torch.equal(a, b) for a, b in zip(calls[0][1], weights))
        assert torch.equal(calls[0][2], batch)

    assert [r["optim"] for r in rows] == ["AdamWTorchFused", "AdamW8bit"]
    for row in rows:
        assert row["repeats"] == 3 and row["steps"] == 8 and row["warmup_steps"] == 2 and row["timed_steps"] == 6
        assert len(row["throughput_runs"]) == len(row["optim_step_ms_runs"]) == len(row["val_acc_runs"]) == 3
        assert row["throughput_imgs_s"] == sorted(row["throughput_runs"])[1]  # the median of three
        assert row["optim_step_ms"] == sorted(row["optim_step_ms_runs"])[1]
        assert all(t > 0 for t in row["throughput_runs"] + row["optim_step_ms_runs"])
    # the same optimizer from the same weights on the same batches trains the same way every time
    assert rows[0]["val_acc_runs"][0] == rows[0]["val_acc_runs"][1] == rows[0]["val_acc_runs"][2]
    table = render.markdown_table(rows)
    assert "| vs AdamWTorchFused |" in table.splitlines()[0] and "(reference)" in table


def test_warmup_steps_default_and_bad_value(tmp_path):
    args = _finetune_args(tmp_path)
    assert bench.warmup_steps(args, 100) == 5
    assert bench.warmup_steps(args, 3) == 2  # a short run keeps one timed step
    args = _finetune_args(tmp_path, "--warmup_steps", "8")
    with pytest.raises(bench.BenchmarkError, match=r"--warmup_steps 8 leaves no timed step in a run of 8 steps"):
        bench.warmup_steps(args, 8)


# ---- the results table --------------------------------------------------------------------------------
REFERENCE = [  # the reference table's figures, as results lines
    ("Adam", 5.26, 551, 0.9362),
    ("AdamBnb8bit", 4.78, 550, 0.9306),
    ("AdamWDTQ8bit", 4.78, 555, 0.9414),
]


def _write_results(path):
    rows = [
        dict(
            optim=o,
            model="timm/vit_base_patch16_224.augreg_in21k",
            amp="bf16",
            device="cuda",
            device_name="NVIDIA GeForce RTX 4070 Ti SUPER",
            steps=2950,
            memory_gb=m,
            memory_kind="cuda_max_allocated",
            train_time_s=t,
            throughput_imgs_s=188800 / t,
            val_acc=a,
            loss_curve=[[10 * i, 3.8 / (1 + i)] for i in range(1, 30)],
        )
        for o, m, t, a in REFERENCE
    ]
    rows.append(
        dict(
            optim="Adam",
            run_name="Adam on cpu",
            model="vit_tiny_patch16_224",
            amp="none",
            device="cpu",
            steps=3,
            memory_gb=0.61,
            memory_kind="cpu_peak_rss",
            train_time_s=1.25,
            throughput_imgs_s=9.6,
            val_acc=0.0,
            loss_curve=[],
        )
    )
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return rows


def test_markdown_table(tmp_path):
    path = tmp_path / "finetune.jsonl"
    _write_results(path)
    table = render.markdown_table(render.load_results([str(path)]))
    lines = table.splitlines()
    assert lines[0] == (
        "| Optimizer | Model | AMP | Device | Steps | Max memory (GB) | Training time | "
        "Throughput (imgs/s) | Val accuracy |"
    )
    assert lines[2] == (
        "| Adam | vit_base_patch16_224.augreg_in21k | bf16 | NVIDIA GeForce RTX 4070 Ti SUPER | "
        "2950 | 5.26 | 9m 11s | 342.6 | 93.62% |"
    )
    assert "| AdamBnb8bit |" in lines[3] and "| 9m 10s |" in lines[3] and "93.06%" in lines[3]
    assert "| AdamWDTQ8bit |" in lines[4] and "| 4.78 |" in lines[4] and "94.14%" in lines[4]
    assert lines[5] == "| Adam on cpu | vit_tiny_patch16_224 | none | cpu | 3 | 0.61 (peak RSS) | 1.2s | 9.6 | 0.00% |"
    assert "torch.cuda.max_memory_allocated()" in table and "peak resident set size" in table


def _repeated(optim, throughput_runs, step_ms_runs):
    return dict(
        optim=optim,
        model="vit_base_patch16_224",
        amp="bf16",
        device="cuda",
        device_name="NVIDIA H200",
        steps=160,
        repeats=len(throughput_runs),
        memory_gb=2.0,
        memory_kind="cuda_max_allocated",
        train_time_s=9.0,
        throughput_imgs_s=sorted(throughput_runs)[len(throughput_runs) // 2],
        throughput_runs=throughput_runs,
        optim_step_ms=sorted(step_ms_runs)[len(step_ms_runs) // 2],
        optim_step_ms_runs=step_ms_runs,
        val_acc=0.02,
    )


def test_throughput_inside_the_spread_is_within_noise():
    rows = [
        _repeated("Adam", [1262.0, 1378.0, 1300.0], [1.7, 1.9, 1.8]),
        _repeated("AdamDTQ8bit", [1098.0, 1388.0, 1250.0], [0.45, 0.5, 0.47]),  # ranges overlap
        _repeated("AdamW4bit", [1500.0, 1520.0, 1510.0], [0.38, 0.4, 0.39]),  # apart: 1510 vs 1300
        _repeated("AdamWTorchForeach", [1000.0, 1010.0, 1020.0], [1.79, 1.8, 1.81]),  # apart, slower
    ]
    lines = render.markdown_table(rows).splitlines()
    assert lines[0] == (
        "| Optimizer | Model | AMP | Device | Steps | Max memory (GB) | Training time | Throughput (imgs/s) | "
        "vs Adam | Optimizer step (ms) | Val accuracy |"
    )
    assert "| 1300.0 (1262.0–1378.0) | (reference) | 1.800 (1.700–1.900) |" in lines[2]
    assert "| 1250.0 (1098.0–1388.0) | within noise | 0.470 (0.450–0.500) |" in lines[3]
    assert "| 1510.0 (1500.0–1520.0) | +16.2% |" in lines[4]
    assert "| 1010.0 (1000.0–1020.0) | -22.3% |" in lines[5]
    assert (
        lines[-1] == "Highest throughput first (≈: within noise): AdamW4bit > Adam ≈ AdamDTQ8bit > AdamWTorchForeach."
    )

    # against another reference, the same rule
    lines = render.markdown_table(rows, reference="AdamDTQ8bit").splitlines()
    assert "| vs AdamDTQ8bit |" in lines[0] and "| within noise |" in lines[2] and "| (reference) |" in lines[3]
    assert "| +20.8% |" in lines[4]  # 1500-1520 lies above 1098-1388: apart, 1510 against 1250
    with pytest.raises(render.RenderError, match=r"--reference 'Lion' is none of the table's rows \(Adam, "):
        render.markdown_table(rows, reference="Lion")

    # a run measured once has no spread to judge a difference by, and the table says so
    single = dict(rows[2], throughput_runs=[1510.0], repeats=1)
    lines = render.markdown_table([rows[0], single]).splitlines()
    assert "| 1510.0 | no spread (1 repeat) |" in lines[3]
    assert "Highest throughput first" not in "\n".join(lines)


def test_format_duration_and_labels():
    assert render.format_duration(551) == "9m 11s"
    assert render.format_duration(42.0) == "42.0s"
    assert render.format_duration(3725) == "1h 2m 5s"
    assert bench.format_duration(555) == "9m 15s"
    rows = [
        dict(optim="Adam", amp="bf16"),
        dict(optim="Adam", amp="none"),
        dict(optim="AdamW", amp="bf16"),
        dict(optim="AdamW", amp="bf16"),
        dict(optim="Adam", run_name="mine", amp="bf16"),
    ]
    assert render.labels(rows) == ["Adam (bf16)", "Adam (none)", "AdamW (bf16) #1", "AdamW (bf16) #2", "mine"]


def test_render_main_writes_markdown(tmp_path, capsys):
    path = tmp_path / "finetune.jsonl"
    _write_results(path)
    assert render.main([str(path), "--no_png"]) == 0
    md = (tmp_path / "finetune.md").read_text()
    assert "| Adam | vit_base_patch16_224.augreg_in21k |" in md
    assert md in capsys.readouterr().out
    assert not (tmp_path / "finetune.png").exists()


def test_render_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG chart needs matplotlib")
    path = tmp_path / "finetune.jsonl"
    _write_results(path)
    png = tmp_path / "chart" / "table.png"
    assert render.main([str(path), "--png", str(png), "--md", str(tmp_path / "t.md")]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize(
    "content, message",
    [
        (None, r"results file '.*' does not exist"),
        ("", r"no results in"),
        ('{"optim": "Adam"}\nnot json\n', r":1: not a benchmark result \(missing memory_gb"),
        ("[1, 2]\n", r":1: not a benchmark result"),
        (
            '{"optim": "Adam", "memory_gb": 1, "memory_kind": "cpu_peak_rss", "train_time_s": 1, '
            '"throughput_imgs_s": 1, "val_acc": 0}\n{oops\n',
            r":2: not valid JSON",
        ),
    ],
)
def test_render_bad_input(tmp_path, capsys, content, message):
    path = tmp_path / "finetune.jsonl"
    if content is not None:
        path.write_text(content)
    assert render.main([str(path), "--no_png"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("render_finetune_table.py: error: ")
    assert re.search(message, err), err


# ---- smoke test: a tiny timm ViT, synthetic data, each optimizer ------------------------------------------
TINY_VIT = [
    "--model",
    "vit_tiny_patch16_224",
    "--no_pretrained",
    "--model_kwargs",
    json.dumps(dict(img_size=32, patch_size=8, depth=1, embed_dim=64, num_heads=2)),
]


def _require_timm():
    try:
        import timm  # noqa: F401
    except Exception as err:  # ImportError, or a torchvision that does not match torch (RuntimeError)
        pytest.skip(
            f"the smoke test needs timm, which cannot be imported here ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        )


@pytest.mark.parametrize("optim", _available_optimizers())
def test_smoke_tiny_vit(optim, tmp_path, capsys):
    _require_timm()
    results = tmp_path / "finetune.jsonl"
    argv = TINY_VIT + [
        "--optim",
        optim,
        "--no_optim_compile",
        "--amp",
        "bf16",
        "--device",
        "cpu",
        "--dataset",
        "synthetic",
        "--synthetic_train_size",
        "12",
        "--synthetic_val_size",
        "8",
        "--batch_size",
        "4",
        "--max_steps",
        "3",
        "--n_workers",
        "0",
        "--cosine_lr_scheduler",
        "--results",
        str(results),
    ]
    assert bench.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "training time:" in out and "val accuracy:" in out and "peak RSS" in out
    (row,) = render.load_results([str(results)])
    assert row["optim"] == optim and row["steps"] == 3 and row["argv"] == argv
    assert row["loss_curve"] and all(loss == loss for _, loss in row["loss_curve"])
    assert f"| {optim} | vit_tiny_patch16_224 | bf16 |" in render.markdown_table([row])


def test_smoke_unknown_timm_model(capsys):
    _require_timm()
    assert bench.main(["--model", "vit_tiny_patch16_225", "--dataset", "synthetic", "--device", "cpu"]) == 2
    assert "unknown timm model 'vit_tiny_patch16_225'; did you mean 'vit_tiny_patch16_224'" in _error_line(capsys)
