"""Training throughput: the trainer against a bare torch loop of the same model, on this device.

  python bench/train_throughput.py [--device cpu|cuda] [--sizes 64,224] [--modes finetune,tail]
                                   [--precisions fp32,bf16] [--batch-size N] [--steps N] [--rounds R]
                                   [--imagefolders DIR] [--export-imagefolders DIR]

ProxyAnchor on efficientnet_lite0 (ImageNet weights), kanji glyphs rendered at the input size, the
fine-tune recipe's BatchNorm (statistics frozen), no probe, seed 0.  For each mode × size × precision:

  input      augmented training images per second from the input path alone (no model): the
             per-epoch loader (a DataLoader built every epoch, one worker), the streaming loader
             (persistent workers, --workers auto) and the decoded-image cache with batched
             augmentation (the default in fine-tune mode); tail mode: the cached prefix maps;
  trainer    images per second through the trainer's own epoch loop (`Run.run_epoch`: the sampler,
             the source's batches and augmentation, the step with its gradient clipping and its read-back
             of the loss): validation and checkpoints excluded, no regularizer;
  bare       images per second of a plain loop over the same model, loss, optimizer (the trainer's
             AdamW groups), precision and batch size, the inputs already on the device, no
             augmentation: eager, eager in channels_last, and compiled (--compile-sizes: CUDA
             graphs on CUDA, inductor on the CPU); the best of them is the reference;
  epoch      a whole training epoch as `train` runs it: training, validation and the checkpoint writes.

A machine without the kanji fonts (a lent GPU machine) trains on the same images as ImageFolders:
`--export-imagefolders DIR` renders the 200-class set here at each of --sizes into DIR/<size>px/,
and `--imagefolders DIR` there loads them through `--dataset imagefolder` (resize mode `resize`
as kanji's; the ImageFolder split draws other classes of the same count, and its augmentation may
flip).  Each row records its data.

Trainer and bare loops alternate for --rounds rounds in this one process, so the shared machine's
load hits both alike: rates are medians over rounds, the ratio the median of each round's ratio.
Prints a table and writes bench/results/train_throughput/<device>.json after each setting, one row
per setting (rows of settings measured by an earlier run stay, each with its date and command).  On
the CPU the default batch is smaller (--batch-size) and steps are few: a CPU step of this model
takes seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from core.atomic import write_json
from core.logs import setup_logging
from training.config import TrainConfig
from training.samplers import epoch_batches
from training.trainer import Run, augment_generator

INPUT_CLASSES = 200  # the input path's data set: 1,840 training and 460 validation images (23 fonts)
INPUT_BATCH = 120


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_classes(num_classes: int) -> int:
    """Training classes of kanji with `num_classes` characters: half are test, a fifth of the rest
    (at least 2) validation (data/kanji.py, data/splits.py)."""
    trainval = num_classes - num_classes // 2
    return trainval - (max(round(trainval * 0.2), 2) if trainval >= 4 else 0)


def sized_classes(args, size: int) -> tuple[int, tuple[str, ...]]:
    """(characters, fonts) giving about --steps full batches per epoch: 200 classes × 23 fonts on
    CUDA (1,840 training images); on the CPU, 8 fonts (images per class) and as few classes as the
    steps need."""
    if (args.device == "cuda" and args.steps is None) or args.imagefolders:
        return INPUT_CLASSES, ()
    from data.kanji import find_fonts

    fonts = tuple(f[0] for f in find_fonts()[:8])
    steps = args.steps or (2 if size >= 128 else 8)  # a CPU step at 224 px takes seconds
    need = max(args.batch_size // 4, math.ceil(steps * args.batch_size / len(fonts)))
    n = 4
    while train_classes(n) < need:
        n += 1
    return n, fonts


def config(args, mode: str, size: int, precision: str, out: Path, classes: int, fonts=(),
           batch_size: int | None = None, **kw) -> TrainConfig:
    """The benchmark's run: ProxyAnchor, efficientnet_lite0, kanji at `size` px."""
    extra = dict(train_blocks=2) if mode == "tail" else dict(mode="finetune")
    if args.imagefolders:  # the kanji images exported by --export-imagefolders, for a machine without the fonts
        kw |= dict(dataset="imagefolder", resize_mode="resize", data_root=str(Path(args.imagefolders) / f"{size}px"))
    else:
        kw |= dict(dataset="kanji", kanji_fonts=fonts, data_root=args.data_root)
    return TrainConfig(num_classes=classes, image_size=size,
                       backbone="efficientnet_lite0", loss="proxy_anchor", batch_size=batch_size or args.batch_size,
                       m_per_class=4,
                       probe_epochs=0, bn_freeze="on", precision=precision, device=args.device, out=str(out),
                       cache_dir=args.cache_dir, progress=False, seed=0, overwrite=True,
                       **extra, **kw)


def epoch_images(run: Run) -> int:
    """Images in one of the run's training epochs (the sampler's batches)."""
    cfg = run.cfg
    return sum(map(len, epoch_batches(run.source.labels, cfg.batch_size, cfg.m_per_class, None,
                                      np.random.RandomState(0))))


# ---------------------------------------------------------------- the input path alone
def input_epoch(source, run: Run, epoch: int) -> float:
    """Augmented training images per second from one epoch of `source.batches`."""
    cfg, n, t = run.cfg, 0, time.perf_counter()
    batches = epoch_batches(source.labels, cfg.batch_size, cfg.m_per_class, None, np.random.RandomState(epoch))
    for x, _, _ in source.batches(batches, augment_generator(cfg.seed, epoch)):
        n += 0 if x is None else len(x)
    sync(run.device)
    return n / (time.perf_counter() - t)


class PerEpochLoader:
    """The per-epoch loader, the baseline of the input path: a DataLoader (one worker) built every
    epoch, each image decoded and augmented on its own."""

    def __init__(self, run: Run):
        from model.preprocess import transform_for

        self.run, self.labels = run, np.asarray(run.splits.train.labels)
        self.spec = transform_for(run.backbone, run.dcfg, augment=True)

    def batches(self, batches, generator=None):
        from torch.utils.data import DataLoader

        from data.loader import ImageDataset, collate_skip

        loader = DataLoader(ImageDataset(self.run.splits.train, self.spec.build()), batch_sampler=batches,
                            num_workers=1, collate_fn=collate_skip, pin_memory=self.run.device.type == "cuda")
        for x, y, _, bad in loader:
            yield x.to(self.run.device, non_blocking=True), y, bad

    def close(self) -> None:
        pass


def input_rates(args, mode: str, size: int, tmp: Path, run: Run) -> dict:
    """The input path alone, its loaders alternating epoch by epoch (median rates); fine-tune mode on
    the 200-class set (a loader's start-up per epoch is then spread as in a real epoch), tail mode
    on the run's own prefix maps."""
    from training.batches import ImageBatches

    if mode == "tail":
        return {"input_images_per_s": statistics.median(input_epoch(run.source, run, e)
                                                        for e in range(args.input_epochs))}
    if run.cfg.num_classes != INPUT_CLASSES or run.cfg.kanji_fonts or run.cfg.batch_size != INPUT_BATCH:
        run = Run(config(args, mode, size, "fp32", tmp / "input", INPUT_CLASSES, batch_size=INPUT_BATCH))
        run.setup()
    sources = {"input_before_images_per_s": PerEpochLoader(run),
               "input_streaming_images_per_s": ImageBatches(source_config(run)),
               "input_images_per_s": run.source}
    rates: dict[str, list] = {k: [] for k in sources}
    try:
        for e in range(args.input_epochs):
            for k, src in sources.items():
                rates[k].append(input_epoch(src, run, e))
    finally:
        for src in sources.values():
            src.close()
    return {k: statistics.median(v) for k, v in rates.items()}


def source_config(run: Run):
    from training.batches import SourceConfig

    cfg = run.cfg
    return SourceConfig(backbone=run.backbone, splits=run.splits, transform=run.transform, dcfg=run.dcfg,
                        cache_dir=cfg.cache_dir, progress=False, device=run.device,
                        n_train=cfg.n_train_blocks(len(run.backbone.stages())), bn_freeze=cfg.freezes_bn())


# ---------------------------------------------------------------- the bare loop
class Bare:
    """A plain training loop on fixed inputs already on the device: a copy of the run's model and loss
    in one memory layout (the copy keeps its parameters where they are, as CUDA graphs need), the
    trainer's optimizer groups, the run's trained stages, autocast at its precision."""

    def __init__(self, run: Run, x: torch.Tensor, y: torch.Tensor, memory_format, compile_: bool):
        import copy

        from training.batches import set_trainable
        from training.step import build_optimizer

        cfg = run.cfg
        self.run, self.y = run, y
        self.model, self.loss = copy.deepcopy(run.model), copy.deepcopy(run.loss)
        self.model.backbone.to(memory_format=memory_format)
        self.x = x.contiguous(memory_format=memory_format)
        n_train = cfg.n_train_blocks(len(self.model.backbone.stages()))
        self.model.train()
        set_trainable(self.model.backbone, n_train, True, cfg.freezes_bn())
        self.opt = build_optimizer(cfg, self.model, self.loss, [], n_train)
        backbone, start = self.model.backbone, len(self.model.backbone.stages()) - n_train

        def encode(x):
            return backbone.run_stages(x, start)

        self.encode = encode
        if compile_:
            from model.device import compiled

            self.encode = compiled(encode, run.device)

    def steps(self, n: int) -> float:
        """Images per second over `n` steps."""
        from model.device import autocast

        device = self.run.device
        sync(device)
        t = time.perf_counter()
        for _ in range(n):
            with autocast(device, self.run.cfg.precision):
                f = self.encode(self.x)
            loss = self.loss(self.model.neck(f.float()), self.y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        sync(device)
        return n * len(self.y) / (time.perf_counter() - t)


# ---------------------------------------------------------------- one setting
def measure(args, mode: str, size: int, precision: str, tmp: Path, inputs: dict) -> dict:
    """One row; `inputs` keeps the input path's rates per (mode, size): they do not depend on the precision."""
    device = torch.device(args.device)
    row = {"device": args.device, "mode": mode, "size": size, "precision": precision, "batch_size": args.batch_size,
           "date": datetime.date.today().isoformat(),
           "data": (f"imagefolder: the 200-class kanji set exported at {size} px" if args.imagefolders
                    else "kanji")}
    classes, fonts = sized_classes(args, size)
    t = time.perf_counter()
    run = Run(config(args, mode, size, precision, tmp / "run", classes, fonts))
    run.setup()
    row["setup_s"] = round(time.perf_counter() - t, 1)  # data, caches (a cache hit when run before)
    row["memory_format"] = "channels_last" if run.memory_format == torch.channels_last else "contiguous"
    if (mode, size) not in inputs:
        threads = torch.get_num_threads()
        torch.set_num_threads(args.input_threads or threads)
        try:
            inputs[mode, size] = input_rates(args, mode, size, tmp, run) | {"input_threads": torch.get_num_threads()}
        finally:
            torch.set_num_threads(threads)
    row |= inputs[mode, size]
    # the bare loops' inputs: one augmented batch (or prefix maps), on the device
    batches = epoch_batches(run.source.labels, run.cfg.batch_size, run.cfg.m_per_class, None,
                            np.random.RandomState(0))
    x, y, _ = next(iter(run.source.batches(batches[:1], augment_generator(0, 0))))
    x = x.to(device)
    ids = torch.tensor([run.label_map[int(v)] for v in y], device=device)
    variants = {"eager": (torch.contiguous_format, False), "channels_last": (torch.channels_last, False)}
    if size in args.compile_sizes:  # CUDA: CUDA graphs (reduce-overhead); the CPU: inductor's default
        variants["cuda_graphs" if device.type == "cuda" else "compiled"] = (run.memory_format, True)
    bare = {k: Bare(run, x, ids, fmt, comp) for k, (fmt, comp) in variants.items()}
    trainer_rates, bare_rates = [], {k: [] for k in bare}
    n_steps, n_images = len(batches), epoch_images(run)
    # warm-up: one epoch of the trainer, a few bare steps (mkldnn/cuDNN choices, compilation)
    run.run_epoch(run.source, run.step, 0)
    for b in bare.values():
        b.steps(min(3, n_steps))
    for r in range(args.rounds):
        sync(device)
        t = time.perf_counter()
        run.run_epoch(run.source, run.step, r + 1)
        sync(device)
        trainer_rates.append(n_images / (time.perf_counter() - t))
        for k, b in bare.items():
            bare_rates[k].append(b.steps(n_steps))
        print(f"  round {r + 1}: trainer {trainer_rates[-1]:.1f} img/s, "
              + ", ".join(f"{k} {v[-1]:.1f}" for k, v in bare_rates.items()), flush=True)
    run.source.close()
    row["trainer_images_per_s"] = statistics.median(trainer_rates)
    row["bare_variants"] = {k: statistics.median(v) for k, v in bare_rates.items()}
    best = max(row["bare_variants"], key=row["bare_variants"].get)
    row["bare_best"] = best
    row["bare_images_per_s"] = row["bare_variants"][best]
    # each round's trainer epoch against the bare loop timed right after it: the load drifts less within a round
    row["ratio"] = statistics.median(t / b for t, b in zip(trainer_rates, bare_rates[best], strict=True))
    row["round_ratios"] = [t / b for t, b in zip(trainer_rates, bare_rates[best], strict=True)]
    row["steps_per_epoch"] = n_steps
    row["images_per_epoch"] = n_images
    row["rounds"] = args.rounds
    if args.whole_epoch:
        row["epoch_images_per_s"] = whole_epoch(args, mode, size, precision, tmp, classes, fonts)
    return row


def whole_epoch(args, mode: str, size: int, precision: str, tmp: Path, classes: int, fonts) -> float:
    """Training images per second over a whole second epoch of `train` (training, validation, the
    checkpoint writes); the run is stopped there, before its test evaluation."""
    stamps = []

    class Stop(Exception):
        pass

    def hook(epoch):
        stamps.append(time.perf_counter())
        if epoch == 2:
            raise Stop

    cfg = dataclasses.replace(config(args, mode, size, precision, tmp / "epoch", classes, fonts), epochs=3)
    runs = []

    class Hooked(Run):
        def setup(self, resuming=False):
            super().setup(resuming)
            runs.append(self)

    try:
        Hooked(cfg, on_epoch_end=hook).fit()
    except Stop:
        pass
    return epoch_images(runs[0]) / (stamps[1] - stamps[0])


def export_imagefolders(args) -> None:
    """Render the 200-class kanji set (every font) at each of --sizes and copy its images to
    DIR/<size>px/<code point>/<font>.png, an ImageFolder."""
    import shutil

    from core.errors import UserError
    from data.kanji import KanjiConfig, prepare_kanji

    out = Path(args.export_imagefolders)
    for size in (int(s) for s in args.sizes.split(",")):
        dest = out / f"{size}px"
        if dest.exists():
            raise UserError(f"{dest} exists; remove it or export elsewhere")
        rendered = prepare_kanji(KanjiConfig(root=args.data_root or KanjiConfig.root, num_classes=INPUT_CLASSES,
                                             image_size=size))
        shutil.copytree(rendered / "images", dest)
        print(f"{dest}: {sum(1 for _ in dest.rglob('*.png')):,} images")


def save(args, rows: list[dict], meta: dict) -> list[dict]:
    """Merge `rows` (with `meta`) into OUT/<device>.json: rows of settings not measured this time
    stay, each with its own date and command.  Written after every setting, so a run stopped at a
    time limit keeps what it measured."""
    path = Path(args.out) / f"{args.device}.json"
    kept = json.loads(path.read_text())["rows"] if path.is_file() else []
    key = ("mode", "size", "precision")
    measured = {tuple(r[k] for k in key) for r in rows}
    merged = [r for r in kept if tuple(r[k] for k in key) not in measured] + [r | meta for r in rows]
    merged.sort(key=lambda r: (r["mode"], r["size"], r["precision"]))
    write_json(path, {"rows": merged})
    return merged


# ---------------------------------------------------------------- report
def table(rows: list[dict]) -> str:
    lines = ["| mode | size | precision | input before | input streaming | input (default) | trainer | "
             "bare (best) | ratio | whole epoch |", "|---|---|---|---|---|---|---|---|---|---|"]

    def f(v):
        return "—" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"

    for r in rows:
        lines.append(f"| {r['mode']} | {r['size']} | {r['precision']} | {f(r.get('input_before_images_per_s'))} | "
                     f"{f(r.get('input_streaming_images_per_s'))} | {f(r['input_images_per_s'])} | "
                     f"{f(r['trainer_images_per_s'])} | {f(r['bare_images_per_s'])} ({r['bare_best']}) | "
                     f"{r['ratio']:.2f} | {f(r.get('epoch_images_per_s'))} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"),
                    help="where to train (default: CUDA when available)")
    ap.add_argument("--sizes", default="64,224", help="input sizes in px (default: %(default)s)")
    ap.add_argument("--modes", default="finetune,tail", help="training modes (default: %(default)s)")
    ap.add_argument("--precisions", default=None,
                    help="forward precisions (default: fp32,bf16 on CUDA, fp32 on the CPU)")
    ap.add_argument("--batch-size", type=int, default=None, help="batch size (default: 120 on CUDA, 32 on the CPU)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps per epoch, the data set sized for them (default: on CUDA the 200-class set, "
                         "16 steps of 120; on the CPU 8 at 64 px, 2 from 128 px)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="trainer epochs and bare loops, alternated (default: 3 on CUDA, 5 on the CPU)")
    ap.add_argument("--input-epochs", type=int, default=6,
                    help="epochs of each input path alone, alternated (default: %(default)s)")
    ap.add_argument("--compile-sizes", default=None,
                    help="sizes whose bare loop is also timed compiled (torch.compile: CUDA graphs on CUDA, inductor "
                         "on the CPU; the warm-up pays the compilation), or none "
                         "(default: 64,224 on CUDA, none on the CPU)")
    ap.add_argument("--no-whole-epoch", dest="whole_epoch", action="store_false",
                    help="skip the whole-epoch measurement (training + validation + checkpoints)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--input-threads", type=int, default=0,
                    help="torch threads while the input path is timed alone (0: as --threads)")
    ap.add_argument("--cache-dir", default="cache/train_throughput",
                    help="decoded-image and prefix caches, kept between runs (default: %(default)s)")
    ap.add_argument("--data-root", default=None, help="kanji render cache (default: the data set's)")
    ap.add_argument("--imagefolders", default=None,
                    help="train on the ImageFolders DIR/<size>px that --export-imagefolders made (a machine "
                         "without the kanji fonts) (default: render kanji here)")
    ap.add_argument("--export-imagefolders", default=None, metavar="DIR",
                    help="render the 200-class kanji set at each of --sizes into DIR/<size>px/ and exit")
    ap.add_argument("--out", default="bench/results/train_throughput", help="results folder (default: %(default)s)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.precisions = args.precisions or ("fp32,bf16" if cuda else "fp32")
    args.batch_size = args.batch_size or (120 if cuda else 32)
    args.rounds = args.rounds or (3 if cuda else 5)
    sizes = args.compile_sizes or ("64,224" if cuda else "none")
    args.compile_sizes = [] if sizes == "none" else [int(s) for s in sizes.split(",") if s]
    if args.threads:
        torch.set_num_threads(args.threads)
    setup_logging()
    if args.export_imagefolders:
        export_imagefolders(args)
        return
    if args.imagefolders and args.steps is not None:
        print("error: --imagefolders holds the 200-class set; it takes no --steps", file=sys.stderr)
        sys.exit(2)
    rows: list[dict] = []
    inputs: dict = {}
    started = time.time()
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE") if k in os.environ}
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "env": env,
            "device_name": torch.cuda.get_device_name() if cuda else "cpu",
            "command": "python bench/train_throughput.py " + " ".join(sys.argv[1:])}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            for size in (int(s) for s in args.sizes.split(",")):
                for precision in args.precisions.split(","):
                    print(f"{mode} {size} px {precision}", flush=True)
                    rows.append(measure(args, mode, size, precision, Path(tmp), inputs))
                    print(table(rows[-1:]), flush=True)
                    merged = save(args, rows, meta | {"seconds": round(time.time() - started)})
    print(table(merged))
    print(json.dumps(meta))

if __name__ == "__main__":
    main()
