"""Native-aspect patches (``--patches native``): each image at its own aspect ratio, on the largest patch
grid that fits a token budget, and micro-batches that hold one token budget with little padding.

    image (crop) w x h -> `native_grid`: (gh, gw), gh * gw <= max_patches, gw / gh ~ w / h
                       -> resized to (gw P) x (gh P), patchified in the read task (`pipeline.data.decode`)
                       -> `native_rows`: a row of fixed width max_patches, the image's gh * gw patches first:

    patches  uint8 (M, P*P*C)  the image's patches row-major over its own grid, then zeros
    coords   int16 (M, 2)      each patch's (row, col) in that grid; (0, 0) for padding
    mask     bool  (M,)        True for the image's gh * gw patches
    grid     int16 (2,)        (gh, gw); (0, 0) on an error row

MAE (`mask_native`): each image's own gh * gw patches are shuffled, v = `native_visible` of them stay
visible: ``visible`` (Mv, K) and ``masked`` (M - Mv, K), each padded, with Mv = v(M); ``coords`` and
``mask`` hold the visible slots' then the masked slots' (M in all), as ``ids_shuffle`` orders grid places.

The grid (`native_grid`): the candidates are the grids whose one side is a whole number of patches and
whose other side is the image's aspect ratio times it, rounded (half a patch of distortion at most);
of those that fit, the one with most patches (then the least distortion). Every image, small or large,
is resized to fill the budget (as SigLIP 2's NaFlex does): at 256 patches, images of aspect ratios
between 1:3 and 3:1 fill 95% of it on average.

Micro-batches (`pack`): a row's length is its image's gh * gw. The rows of the stream are taken
``WINDOW`` micro-batches' worth at a time, sorted by length (longest first) and cut into micro-batches,
each padded to its longest row rounded up to a multiple of `length_step` (about max_patches / 32, a
multiple of 8) and holding ``budget // length`` rows, ``budget = micro_batch_size x max_patches``: the
tokens of a square micro-batch at that many patches per image, padding included. So every micro-batch
holds nearly one budget of tokens, compiled graphs see a few lengths (those images of usual aspect
ratios round to), and the padding is what rounding to the step and the spread of lengths in one
micro-batch leave (BENCHMARKS.md, "Native-aspect batches"). The rows a window leaves over (fewer than
a micro-batch) go first into the next window's first micro-batch (padded as its longest row), so none
waits more than one window (unless one micro-batch of them needs more rows than a window holds); the
stream's last micro-batch holds what is left. Everything is a pure function of the rank's stream,
so a resume that re-reads it gets the same micro-batches (`pipeline.train.input.cursor`).

Imports no torch, like the rest of `pipeline.data`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from vit.patchify import patchify

Batch = dict[str, np.ndarray]
PATCH_MODES = ("square", "native")
# The largest --max-patches: a 4,096-px side at 16-px patches, squared; attention over more fits no GPU.
MAX_PATCHES = 65_536
# The model's inputs of a native row, in the order the model takes them: model(patches, coords, mask, grid).
INPUTS = ("patches", "coords", "mask", "grid")
# MAE's: model(visible, masked, coords, mask, grid).
MAE_INPUTS = ("visible", "masked", "coords", "mask", "grid")
WINDOW = 8  # micro-batches' worth of rows sorted together by `pack`
LENGTH_STEPS = 32  # `length_step`: about max_patches / 32


def native_grid(width: int, height: int, max_patches: int) -> tuple[int, int]:
    """The patch grid (gh, gw) of a ``width`` x ``height`` image (or crop) under ``max_patches``
    (module docstring): integer arithmetic, so the same on every machine."""
    if width < 1 or height < 1 or max_patches < 1:
        raise ValueError(f"no patch grid for a {width}x{height} image under {max_patches} patches")
    best, best_key = (1, 1), (1, -abs(math.log(height / width)))
    for by_rows in (True, False):
        side = 1
        while True:
            if by_rows:  # gh = side rows; gw = side * width / height, rounded half up
                gh, gw = side, max(1, (2 * width * side + height) // (2 * height))
            else:
                gh, gw = max(1, (2 * height * side + width) // (2 * width)), side
            if gh * gw > max_patches:
                break
            key = (gh * gw, -abs(math.log((gw * height) / (gh * width))))
            if key > best_key:
                best, best_key = (gh, gw), key
            side += 1
    return best


def length_step(max_patches: int) -> int:
    """The lengths micro-batches are padded to are multiples of this: max_patches / `LENGTH_STEPS`,
    rounded up to a multiple of 8 (kernels like them), at least 8."""
    per_step = -(-max_patches // LENGTH_STEPS)  # ceil(max_patches / LENGTH_STEPS)
    return max(8, -(-per_step // 8) * 8)


def padded_length(length: int, max_patches: int) -> int:
    """A micro-batch's length for its longest row of ``length`` patches: rounded up to the step, at most
    ``max_patches``."""
    step = length_step(max_patches)
    return min(max_patches, -(-length // step) * step)


def native_visible(num_patches: int, mask_ratio: float) -> int:
    """Patches of an image of ``num_patches`` its MAE encoder sees: ``floor(n (1 - mask_ratio))``, as
    `pipeline.data.masking.num_visible`, kept within [1, n - 1] (an image of few patches keeps one of
    each). Never decreasing in n, nor is n minus it: a row of the widest image bounds every other's."""
    if num_patches < 2:
        raise ValueError(f"an image of {num_patches} patch cannot be masked: MAE needs at least 2")
    n = math.floor(num_patches * (1 - mask_ratio) + 1e-9)  # 1e-9 as in `num_visible`
    return min(max(n, 1), num_patches - 1)


def native_rows(images: list[np.ndarray | None], patch_size: int, max_patches: int) -> Batch:
    """Channels-last images ``(gh P, gw P, C)`` (None: an error row) -> the columns ``patches``,
    ``coords``, ``mask``, ``grid`` of their rows (module docstring), each ``max_patches`` wide."""
    b, k = len(images), patch_size * patch_size * 3
    patches = np.zeros((b, max_patches, k), np.uint8)
    coords = np.zeros((b, max_patches, 2), np.int16)
    mask = np.zeros((b, max_patches), bool)
    grid = np.zeros((b, 2), np.int16)
    for i, image in enumerate(images):
        if image is None:
            continue
        gh, gw = image.shape[0] // patch_size, image.shape[1] // patch_size
        n = gh * gw
        if n > max_patches:
            raise ValueError(f"a {gh}x{gw} patch grid does not fit max_patches {max_patches}")
        patches[i, :n] = patchify(image, patch_size)  # (n, K), row-major over the image's grid
        coords[i, :n] = np.stack(np.divmod(np.arange(n), gw), axis=1)  # (n, 2): (row, col)
        mask[i, :n] = True
        grid[i] = (gh, gw)
    return {"patches": patches, "coords": coords, "mask": mask, "grid": grid}


def mask_native(batch: Batch, ids: list[np.ndarray | None], mask_ratio: float) -> Batch:
    """Native rows -> MAE's: ``ids[i]`` a permutation of row i's own patches (None: an error row, whose
    slots stay empty). ``patches`` becomes ``visible`` and ``masked``; ``coords`` and ``mask`` hold the
    visible slots' then the masked slots' (module docstring)."""
    patches, coords = batch["patches"], batch["coords"]
    b, width, k = patches.shape
    wide = native_visible(width, mask_ratio)  # Mv: every row's visible patches fit
    visible = np.zeros((b, wide, k), np.uint8)
    masked = np.zeros((b, width - wide, k), np.uint8)
    slots = np.zeros((b, width, 2), np.int16)
    real = np.zeros((b, width), bool)
    for i, order in enumerate(ids):
        if order is None:
            continue
        n = len(order)
        v = native_visible(n, mask_ratio)
        visible[i, :v], masked[i, : n - v] = patches[i, order[:v]], patches[i, order[v:]]
        slots[i, :v], slots[i, wide : wide + n - v] = coords[i, order[:v]], coords[i, order[v:]]
        real[i, :v], real[i, wide : wide + n - v] = True, True
    out = {name: column for name, column in batch.items() if name != "patches"}
    return {**out, "visible": visible, "masked": masked, "coords": slots, "mask": real}


def lengths(batch: Batch) -> np.ndarray:
    """Each row's length: its image's patches, gh * gw ``(B,)``."""
    grid = batch["grid"].astype(np.int64)
    return grid[:, 0] * grid[:, 1]


def cut(batch: Batch, rows: np.ndarray, length: int, mask_ratio: float | None) -> Batch:
    """The micro-batch of ``rows`` of ``batch``, its token columns cut to ``length`` patches an image
    (MAE: its visible and masked slots to those of an image of ``length`` patches)."""
    out = _rows(batch, rows)
    if "visible" not in batch:
        for name in ("patches", "coords", "mask"):
            out[name] = out[name][:, :length]
        return out
    wide, v = batch["visible"].shape[1], native_visible(length, mask_ratio)
    out["visible"], out["masked"] = out["visible"][:, :v], out["masked"][:, : length - v]
    for name in ("coords", "mask"):
        column = out[name]
        out[name] = np.concatenate([column[:, :v], column[:, wide : wide + length - v]], axis=1)
    return out


def pack(
    batches: Iterator[Batch], size: int, max_patches: int, mask_ratio: float | None = None
) -> Iterator[Batch]:
    """Native rows (bad ones removed) -> micro-batches of ``size x max_patches`` tokens each (module
    docstring); every row once, the stream's last micro-batch what is left."""
    budget, window = size * max_patches, WINDOW * size
    held: list[Batch] = []
    carried = 0  # rows at the front of ``held`` left over by the last window
    count = 0
    for batch in batches:
        if len(batch["key"]):
            held.append(batch)
            count += len(batch["key"])
        while count >= carried + window:  # a window of exactly that many rows: however the stream is cut
            pool = _concat(held)
            head, tail = (_rows(pool, slice(0, carried + window)), _rows(pool, slice(carried + window, None)))
            out, rest = _window(head, carried, budget, max_patches, mask_ratio, final=False)
            yield from out
            held, carried = [rest, tail], len(rest["key"])
            count = carried + len(tail["key"])
    if count:
        out, _ = _window(_concat(held), carried, budget, max_patches, mask_ratio, final=True)
        yield from out


def _rows(batch: Batch, rows: slice | np.ndarray) -> Batch:
    return {name: column[rows] for name, column in batch.items()}


def _concat(batches: list[Batch]) -> Batch:
    return (
        batches[0] if len(batches) == 1 else {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    )


def _window(
    pool: Batch, carried: int, budget: int, max_patches: int, mask_ratio: float | None, *, final: bool
) -> tuple[list[Batch], Batch]:
    """One window's micro-batches: the ``carried`` rows first, then the rest longest first (stable); the
    rows too few for another micro-batch are left over (all taken when ``final``)."""
    n = lengths(pool)
    order = np.concatenate([np.arange(carried), carried + np.argsort(-n[carried:], kind="stable")])
    out, start = [], 0
    while start < len(order):
        # The longest row still to place, of the carried ones and the next of the sorted rest: no row
        # of this micro-batch is longer, so its rows fit the budget.
        longest = int(n[order[start:]].max()) if start < carried else int(n[order[start]])
        rows = budget // padded_length(longest, max_patches)
        if start + rows > len(order) and not final:
            break
        taken = order[start : start + rows]
        out.append(cut(pool, taken, padded_length(int(n[taken].max()), max_patches), mask_ratio))
        start += len(taken)
    return out, _rows(pool, np.sort(order[start:]))  # the rest, in the stream's order


def padding_share(batch: Batch) -> float:
    """The share of a micro-batch's patch slots that are padding (the model computes them for nothing)."""
    mask = batch["mask"]
    return 1.0 - float(mask.sum()) / mask.size if mask.size else 0.0
