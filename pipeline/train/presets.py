"""Named training presets, each a whole configuration with its command and expected result, and the
command line of the training jobs: a preset plus flags made from the config's fields.

Presets derive from one another (`small` is `tiny` with changes) through `TrainConfig.replace`, which
takes field names across sections, as the flags do. Add a preset by writing a function here and naming
it in PRESETS; measured results live in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from pipeline import cli
from pipeline.train.config import TrainConfig


def tiny() -> TrainConfig:
    """A ViT small enough to learn the synthetic shapes on 2 CPU workers in about a minute.

        python jobs/make_shards.py --synthetic 512 --out /tmp/shards
        python jobs/pretrain.py --preset tiny --data /tmp/shards --out /tmp/run

    Expected: training accuracy above 90% on the synthetic classes by the last steps; the tests
    and `make demo` use this preset.
    """
    return TrainConfig().replace(
        model="vit_tiny_test",
        image_size=32,
        num_classes=10,
        batch_size=64,
        micro_batch_size=32,
        lr=2e-3,
        weight_decay=0.05,
        warmup_steps=20,
        max_steps=240,
        shuffle_buffer=256,
        num_workers=2,
        use_gpu=False,
        log_every=20,
        checkpoint_every=120,
        keep_checkpoints=2,
        max_failures=1,
        # With --objective mae: a decoder the size of the encoder's blocks, not MAE's 512 x 8.
        decoder_dim=32,
        decoder_depth=1,
        decoder_num_heads=4,
    )


def small() -> TrainConfig:
    """Real 32-64 px images (Fashion-MNIST, CIFAR-10 ...) on 2 CPU workers: `tiny` with 4-pixel patches
    (`vit_mini4`, 8x8 = 64 tokens at 32 px), larger batches and milder crops than ImageNet's 8-100% of
    the area, since a crop of a small image has few pixels left to show.

        # shards /tmp/fmnist/train-*.tar and test-*.tar (jobs/benchmarks/fashion_mnist.py packs them)
        python jobs/pretrain.py --preset small --data '/tmp/fmnist/train-*.tar' --out /tmp/small --cpu
        python jobs/embed.py --weights /tmp/small --data '/tmp/fmnist/train-*.tar' --out /tmp/small-emb-train
        python jobs/embed.py --weights /tmp/small --data '/tmp/fmnist/test-*.tar' --out /tmp/small-emb-test
        python jobs/evaluate.py --train /tmp/small-emb-train --test /tmp/small-emb-test

    Expected (BENCHMARKS.md, "Learning"): about 6 minutes on 2 CPU workers; a linear probe on the
    embeddings scores about 75% on Fashion-MNIST's test images, and with `--max-steps 1600` over 82%.
    With ``--checkpoint-every 100 --probe-data PROBE --probe-eval-data TEST`` each checkpoint is probed
    beside training: on 2,000 and 1,000 of those images the linear probe reads 60%, 69%, 70% and 71% at
    steps 100 to 400 (k-NN 54%, 62%, 67%, 70%; a random encoder's: 64% and 53%).
    """
    return tiny().replace(
        model="vit_mini4",
        scale=(0.6, 1.0),
        batch_size=128,
        micro_batch_size=64,
        warmup_steps=30,
        max_steps=400,
        shuffle_buffer=1024,
        log_every=25,
        checkpoint_every=150,
        decoder_dim=64,
        decoder_depth=2,
    )


def small_mae() -> TrainConfig:
    """`small` as a masked autoencoder (He et al. 2022): no labels read, 75% of each image's patches hidden
    from the encoder, the decoder 64 wide and 2 deep; a checkpoint every 100 of its 400 steps, so that the
    checkpoint probe (``--probe-data``) shows, checkpoint by checkpoint, what its loss does not: how good
    its encoder's embeddings are. On the demo's shards:

        python jobs/make_shards.py --synthetic 512 --out /tmp/shards
        python jobs/make_shards.py --synthetic 128 --seed 1 --out /tmp/held-out
        python jobs/pretrain.py --preset small_mae --data /tmp/shards --out /tmp/mae \
            --probe-data /tmp/shards --probe-eval-data /tmp/held-out

    Expected (BENCHMARKS.md, "Learning"): about 8 minutes on 2 CPU workers; the probe rises from the
    random encoder's 64% (linear probe on the 128 held-out images; k-NN 30%) to 76%, 88%, 93% and 89% at
    steps 100 to 400 (k-NN 27%, 40%, 48%, 47%), while the reconstruction loss falls from 0.66 (step 50) to 0.27.
    """
    return small().replace(objective="mae", label_key=None, checkpoint_every=100)


def small_recipe() -> TrainConfig:
    """`small` with DeiT's augmentation and regularization (Touvron et al. 2021; "How to train your
    ViT", Steiner et al. 2021, on why they matter most with little data): RandAugment with 2 ops at
    magnitude 9, Mixup 0.8 and CutMix 1.0 (one of them per micro-batch), label smoothing 0.1 and
    stochastic depth 0.1, at the same steps and learning rate.

        python jobs/pretrain.py --preset small_recipe --data '/tmp/fmnist/train-*.tar' --out /tmp/recipe --cpu

    Expected (BENCHMARKS.md, "Learning"): on a 5,000-image subset of Fashion-MNIST at 1,200 steps its
    classifier scores 64.4% on the test images against `small`'s 76.8%: at that budget plain training
    does not overfit yet, and the recipe only slows it. RandAugment costs about 8 of those points on
    these images (grey fill on black backgrounds, Solarize): with ``--randaug-ops 0`` the recipe is 3.9
    points behind at 1,200 steps and 1.8 at 2,400 (77.0% against 78.8%); on 1,000 images for 1,200 steps,
    where plain training overfits, 1.0 behind (74.7% against 75.7%), and lighter pieces do not win there
    either. It is for larger models and longer runs than these: with ``--model vit_s4`` (a ViT-S) on a
    GPU, ``jobs/benchmarks/gpu.sh`` item ``learn-5k-s4`` compares the two (first H100 runs, cut short: at
    step 1,800 of 2,400, lr 2.5e-4, 62.7% against plain's 78.8%, plain not yet overfitting).
    """
    return small().replace(
        randaug_ops=2,
        randaug_magnitude=9,
        mixup_alpha=0.8,
        cutmix_alpha=1.0,
        label_smoothing=0.1,
        drop_path_rate=0.1,
    )


def gpu_node() -> TrainConfig:
    """What the GPU presets share: 8 workers, each on a GPU with 4 CPUs for its data, a log line every
    50 steps (a node of 8 GPUs; more nodes: --num-workers)."""
    return TrainConfig().replace(num_workers=8, use_gpu=True, cpus_per_worker=4, log_every=50)


def deit_s16_224() -> TrainConfig:
    """DeiT-S on ImageNet-1k from scratch (Touvron et al. 2021, "Training data-efficient image
    transformers", Table 9): AdamW at lr 5e-4 x batch / 512 with weight decay 0.05, batch 1024, 300
    epochs (375k steps of 1,281,167 images) with 5 warmup epochs and cosine decay to 1e-5, no gradient
    clipping, label smoothing 0.1, stochastic depth 0.1, Mixup 0.8, CutMix 1.0 (switched at 0.5),
    RandAugment with 2 ops at magnitude 9, a linear head on the [CLS] token. DeiT's repeated augmentation
    and random erasing are not part of it, nor are two details of its RandAugment (timm's
    ``rand-m9-mstd0.5-inc1``): the magnitude's noise (std 0.5) and applying each op with probability
    0.5 (`pipeline.data.augment` applies every op it draws, as the RandAugment paper does).

        python jobs/pretrain.py --preset deit_s16_224 --data 's3://bucket/in1k/train-{000000..001023}.tar' \
            --eval-data 's3://bucket/in1k/val-{000000..000063}.tar' --out s3://bucket/runs/deit-s16

    Expected: DeiT-S reports 79.8% top-1 on ImageNet-1k's validation set; not yet measured here.
    """
    return gpu_node().replace(
        model="vit_s16",
        model_overrides={"head": "finetune"},
        image_size=224,
        num_classes=1000,
        batch_size=1024,
        micro_batch_size=128,
        optimizer="adamw",
        lr=5e-4 * 1024 / 512,
        min_lr=1e-5,
        weight_decay=0.05,
        warmup_steps=6_255,
        max_steps=375_300,
        lr_schedule="cosine",
        grad_clip=0.0,
        label_smoothing=0.1,
        drop_path_rate=0.1,
        mixup_alpha=0.8,
        cutmix_alpha=1.0,
        scale=(0.08, 1.0),
        train_interpolation="bicubic",
        randaug_ops=2,
        randaug_magnitude=9,
        checkpoint_every=2000,
        eval_every=5000,
    )


def deit_b16_224() -> TrainConfig:
    """DeiT-B: `deit_s16_224` on ViT-B/16, everything else alike (Touvron et al. 2021, Table 9).

        python jobs/pretrain.py --preset deit_b16_224 --data 's3://bucket/in1k/train-{000000..001023}.tar' \
            --eval-data 's3://bucket/in1k/val-{000000..000063}.tar' --out s3://bucket/runs/deit-b16

    Expected: DeiT-B reports 81.8% top-1 on ImageNet-1k's validation set; not yet measured here.
    """
    return deit_s16_224().replace(model="vit_b16", micro_batch_size=64)


def finetune() -> TrainConfig:
    """The ViT paper's fine-tuning recipe (Dosovitskiy et al. 2021, Sec. 4.1 and Appendix B.1.1): SGD
    with momentum 0.9, no weight decay, cosine decay after 500 warmup steps, global-norm clipping at 1,
    batch 512, at a higher resolution than pretraining (384 px after 224); the paper searched lr over
    {0.003, 0.01, 0.03, 0.06} and trained 10k steps (20k for ImageNet). Model, patch size and
    preprocessing come from --weights; a new linear head replaces the pretraining head. Not the paper's:
    the head starts from a linear probe of the pretrained features (``--head-init probe``, LP-FT: Kumar
    et al. 2022), which measured better than the paper's zero head (BENCHMARKS.md, "Learning");
    ``--head-init zero`` is the paper's.

        python jobs/finetune.py --weights s3://bucket/runs/b16 --data 's3://bucket/task/train-{000..063}.tar' \
            --eval-data 's3://bucket/task/val-{000..007}.tar' --num-classes 100 --out s3://bucket/runs/b16-ft

    Its augmentation is ImageNet-scale: random-resized crops of 8-100% of the image's area with
    horizontal flips, sized for 384 px photos of a million-image set. On a task of a few thousand small
    images, see `finetune_small`.

    Expected: eval_accuracy in metrics.jsonl at every --eval-every and at the end; not yet measured on
    GPUs (BENCHMARKS.md, "Learning", has the CPU figures on small images).
    """
    return gpu_node().replace(
        image_size=384,
        head_init="probe",
        optimizer="sgd",
        momentum=0.9,
        weight_decay=0.0,
        lr=0.01,
        lr_schedule="cosine",
        grad_clip=1.0,
        batch_size=512,
        micro_batch_size=64,
        warmup_steps=500,
        max_steps=10_000,
        checkpoint_every=1000,
        eval_every=1000,
    )


def finetune_small() -> TrainConfig:
    """`finetune` for a small task (thousands of images, tens of pixels): crops keep 60-100% of the
    image's area rather than 8-100% (a crop of a small image has few pixels left to show), layer-wise lr
    decay 0.75 trains the early blocks more gently than the head, and a budget sized for such a set
    (batch 128, 1,000 steps); the head starts from a linear probe, as `finetune`'s does. Where a mirror
    image is another class (digits, text), add ``--no-hflip``.

        python jobs/finetune.py --preset finetune_small --weights /tmp/small --data '/tmp/fmnist/train-*.tar' \
            --eval-data '/tmp/fmnist/test-*.tar' --image-size 48 --num-classes 10 --out /tmp/ft --cpu \
            --num-workers 2

    Expected (BENCHMARKS.md, "Learning"; 300 steps of 32 at 48 px from a `small` run at 32 px): 68.2%
    on scikit-learn's digits against its starting model's linear probe's 67.1% (`finetune`: 61.6%), and
    72.9% on 5,000 Fashion-MNIST images, under that probe's 73.9%; lr 0.003 or 0.03, no layer decay,
    900 steps or fine-tuning at 32 px each ended between 72.8% and 73.3%, unflipped crops of the
    evaluation crop's size at 73.8% and 73.5% (two seeds).
    """
    return finetune().replace(
        scale=(0.6, 1.0),
        layer_decay=0.75,
        batch_size=128,
        micro_batch_size=16,
        warmup_steps=50,
        max_steps=1000,
        checkpoint_every=250,
        eval_every=250,
    )


def finetune_mae() -> TrainConfig:
    """MAE's fine-tuning recipe (He et al. 2022, Appendix A.1; its code's ViT-B command): `finetune`
    with AdamW (betas 0.9, 0.999), lr 5e-4 x batch / 256, weight decay 0.05, layer-wise lr decay 0.65,
    drop path 0.1, Mixup 0.8, CutMix 1.0 and label smoothing 0.1, for weights pretrained with
    `--objective mae` (or any other). MAE's RandAugment and random erasing are not part of it here.

        python jobs/finetune.py --preset finetune_mae --weights s3://bucket/runs/mae-b16 \
            --data 's3://bucket/in1k/train-{000000..001023}.tar' --image-size 224 --num-classes 1000 \
            --eval-data 's3://bucket/in1k/val-{000000..000063}.tar' --out s3://bucket/runs/mae-b16-ft

    Expected: not yet measured (MAE reports 83.6% top-1 on ImageNet-1k for ViT-B/16 after 100 epochs).
    """
    return finetune().replace(
        image_size=224,
        optimizer="adamw",
        betas=(0.9, 0.999),
        lr=5e-4 * 512 / 256,
        weight_decay=0.05,
        layer_decay=0.65,
        drop_path_rate=0.1,
        mixup_alpha=0.8,
        cutmix_alpha=1.0,
        label_smoothing=0.1,
    )


def vit_b16_224() -> TrainConfig:
    """ViT-B/16 at 224 px, the paper's ImageNet-21k recipe (Dosovitskiy et al. 2021, Table 3):
    Adam (0.9, 0.999), batch 4096, lr 1e-3, weight decay 0.03, 10k warmup steps, linear decay,
    global-norm clipping at 1; 90 epochs of ImageNet-21k (14.2M images) are about 312k steps.

        python jobs/pretrain.py --preset vit_b16_224 --data s3://bucket/in21k/train-{000000..002047}.tar \\
            --out s3://bucket/runs/b16 --num-workers 8

    Expected: about 1,900 images/s per H100 at 50% MFU (3 x 35.2 GFLOPs an image); not yet measured.
    """
    return gpu_node().replace(
        model="vit_b16",
        image_size=224,
        num_classes=21843,
        batch_size=4096,
        micro_batch_size=128,
        lr=1e-3,
        weight_decay=0.03,
        warmup_steps=10_000,
        max_steps=312_000,
        lr_schedule="linear",
        checkpoint_every=2000,
    )


def vit_h14_224() -> TrainConfig:
    """ViT-H/14 at 224 px, the paper's recipe for its largest model (Dosovitskiy et al. 2021,
    Table 3): the B/16 recipe above with lr 3e-4 and weight decay 0.1; batch 4096 is 8 GPUs x 64
    images x 8 accumulation steps.
    14 epochs of a 300M-image set are about 1M steps; 90 epochs of ImageNet-21k about 312k.

        python jobs/pretrain.py --preset vit_h14_224 --data s3://bucket/in21k/train-{000000..002047}.tar \\
            --out s3://bucket/runs/h14 --num-workers 8

    Expected: about 490 images/s per H100 at 50% MFU (3 x 334.8 GFLOPs an image against 989 TFLOP/s
    dense bf16); not yet measured on a GPU (BENCHMARKS.md records what has been).
    """
    return vit_b16_224().replace(
        model="vit_h14",
        micro_batch_size=64,
        lr=3e-4,
        weight_decay=0.1,
        log_every=20,
        checkpoint_every=1000,
    )


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "tiny": tiny,
    "small": small,
    "small_recipe": small_recipe,
    "small_mae": small_mae,
    "finetune": finetune,
    "finetune_small": finetune_small,
    "finetune_mae": finetune_mae,
    "deit_s16_224": deit_s16_224,
    "deit_b16_224": deit_b16_224,
    "vit_b16_224": vit_b16_224,
    "vit_h14_224": vit_h14_224,
}


def training_parser(
    prog: str,
    description: str,
    default_preset: str,
    *,
    exclude: Sequence[str] = (),
    required: Sequence[str] = (),
) -> argparse.ArgumentParser:
    """The command line of a training job: ``--preset``, a flag per `TrainConfig` setting (less
    ``exclude``), and Ray's flags."""
    parser = cli.JobParser(prog=prog, description=description)
    parser.add_argument(
        "--preset",
        default=default_preset,
        choices=sorted(PRESETS),
        help=f"base configuration (default: {default_preset})",
    )
    cli.add_settings(
        parser, TrainConfig, defaults=PRESETS[default_preset](), exclude=exclude, required=required
    )
    cli.add_ray_flags(parser)
    return parser


def resolve(args: argparse.Namespace, **fixed: object) -> TrainConfig:
    """The preset, with the fields ``fixed`` sets and then the flags given."""
    return PRESETS[args.preset]().replace(**fixed, **cli.overrides(args, TrainConfig))


# Fine-tuning takes the model and the objective from --weights (its soft targets are its own).
NOT_FINETUNE_FLAGS = (
    "model",
    "objective",
    "mask_ratio",
    "norm_pix_loss",
    "decoder_dim",
    "decoder_depth",
    "decoder_num_heads",
)


# Pretraining starts from initialized weights; `jobs/finetune.py` starts from --weights.
NOT_PRETRAIN_FLAGS = ("weights", "head_init")


def pretrain_parser(description: str | None = None) -> argparse.ArgumentParser:
    """`jobs/pretrain.py`'s command line."""
    return training_parser("jobs/pretrain.py", description, "tiny", exclude=NOT_PRETRAIN_FLAGS)


def finetune_parser(description: str | None = None) -> argparse.ArgumentParser:
    """`jobs/finetune.py`'s command line: the `finetune` preset, ``--weights`` required."""
    return training_parser(
        "jobs/finetune.py", description, "finetune", exclude=NOT_FINETUNE_FLAGS, required=("weights",)
    )
