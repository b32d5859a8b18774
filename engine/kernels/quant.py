"""Weight-only quantization formats, their pure-torch reference, and the call into our kernels.

int8, per output channel, symmetric: each row n of W [out, in] gets one scale, absmax / 127,
and w ≈ q × scale with q an int8 in -127..127. A quarter of float32's bytes.

int4, group-wise, with a scale and a minimum (the idea of GGUF's Q4_1): each row is cut into
groups of `group_size` (32) consecutive input channels; in a group w ≈ q × scale + min with q in
0..15, scale = (max - min) / 15. Two weights per byte, plus two floats per group: 4 + 64/32 =
6 bits per weight at group 32, 0.19 × float32's bytes. The scales and minimums may also be
float16, as a GGUF's Q4_1 blocks store them (engine/worker/quantization.py): 4 + 32/32 = 5 bits.
Packing: in each group, byte j holds weight j in its low nibble and weight j + group_size/2 in its
high nibble (the kernel unpacks a group with one mask and one shift).

Activations stay float32 ("weight-only"): the kernels widen the weights inside the dot product.
`dequantize_*` + a float matmul is the reference the kernels are tested against.

One exception, by choice of the weight: an Int4Weight with `q8_activations` (the GGUF's own Q4_1
blocks, engine/worker/quantization.py) is multiplied the way llama.cpp multiplies Q4_1: each
activation row is first rounded to int8 in blocks of 32 (`round_activations_q8`, llama.cpp's Q8_1),
so that the kernel's dot products run in integers (a few instructions per 32 weights instead of
widening each one). That rounding changes the numbers a little, so the reference rounds the same
way. The "gguf" output layer (an Int8Weight) opts in the same way.

Tiles: where our kernels have vector code for them (AVX2 or AVX-512 VNNI), the weights with
`q8_activations` are repacked once, at load (`arrange_for_kernels`), into records of 16 output
channels × one group of 32 inputs (`Int4TiledWeight`, `Int8TiledWeight`), the layout the integer
kernels read with one 512-bit load for 16 channels (engine/kernels/csrc/q8_tiles.cpp). The kernels
of both layouts sum in one order (engine/kernels/csrc/q8.h), so tiles give the rows' outputs bit for
bit; `to_rows` gives the row layout back, and the reference multiplies that.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from engine.kernels.huge_pages import Arena


@dataclass
class Int8Weight:
    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] float32
    # True: multiply by activations rounded to int8 in blocks of 32 (the "gguf" output layer)
    q8_activations: bool = False

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def nbytes(self) -> int:
        return self.qweight.numel() + 4 * self.scales.numel()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.qweight, self.scales)


@dataclass
class Int4Weight:
    packed: torch.Tensor  # [out, in / 2] uint8, two weights per byte (see the module docstring)
    scales: torch.Tensor  # [out, in / group_size] float32, or float16 (a GGUF's own values)
    mins: torch.Tensor  # [out, in / group_size], the dtype of scales
    group_size: int
    # True: multiply by activations rounded to int8 in blocks of 32, as llama.cpp does for Q4_1
    q8_activations: bool = False

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.packed.shape[1] * 2))

    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.element_size() * (
            self.scales.numel() + self.mins.numel()
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed, self.scales, self.mins)


TILE_CHANNELS = 16  # output channels per tile (Int4TiledWeight, Int8TiledWeight)
TILE_RECORD = 320  # bytes per (tile, group): 16 × 16 of nibbles, 16 float16 scales, 16 minimums


@dataclass
class Int4TiledWeight:
    """The GGUF's Q4_1 weights (an Int4Weight of group 32 with float16 scales and
    `q8_activations`) repacked at load for the kernel, as llama.cpp repacks them for its AVX-512
    and AMX kernels: `tiles[t, g]` is one 320-byte record for output channels 16t .. 16t + 15 and
    input group g, chunk i (64 bytes) holding bytes 4i .. 4i + 3 of each channel's block, then the
    16 scales, then the 16 minimums. One 512-bit load feeds 16 channels, one lane each, and a
    thread reads its records front to back (engine/kernels/csrc/q8_tiles.cpp). The same numbers
    as the Int4Weight it came from, in another order, and the same outputs bit for bit: `to_rows`
    gives that back, and is what the torch reference multiplies."""

    tiles: torch.Tensor  # [out / 16, in / 32, 320] uint8
    group_size: int = 32
    q8_activations: bool = True

    @property
    def shape(self) -> torch.Size:
        t, g, _ = self.tiles.shape
        return torch.Size((t * TILE_CHANNELS, g * self.group_size))

    def nbytes(self) -> int:
        return self.tiles.numel()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.tiles,)

    def to_rows(self) -> Int4Weight:
        """The Int4Weight these tiles were made from (`tile_int4_q8` undone)."""
        t, g, _ = self.tiles.shape
        nibbles = self.tiles[..., :256].reshape(t, g, 4, TILE_CHANNELS, 4)
        packed = nibbles.permute(0, 3, 1, 2, 4).reshape(t * TILE_CHANNELS, g * 16)

        def halves(lo: int) -> torch.Tensor:
            values = self.tiles[..., lo : lo + 32].contiguous().view(torch.float16)
            return values.transpose(1, 2).reshape(t * TILE_CHANNELS, g)

        return Int4Weight(
            packed.contiguous(), halves(256).contiguous(), halves(288).contiguous(), 32, True
        )


def can_tile(qw: "QuantizedWeight") -> bool:
    """A weight the tiled kernels take: activations rounded to 8 bits, whole tiles of 16 output
    channels, groups of 32; an Int4Weight with float16 scales (a GGUF's Q4_1), or an
    Int8Weight (the "gguf" output layer)."""
    if not getattr(qw, "q8_activations", False) or qw.shape[0] % TILE_CHANNELS:
        return False
    if isinstance(qw, Int8Weight):
        return qw.shape[1] % 32 == 0
    return isinstance(qw, Int4Weight) and qw.group_size == 32 and qw.scales.dtype == torch.float16


def tile_int4_q8(qw: Int4Weight) -> Int4TiledWeight:
    """Repack `qw` (see `can_tile`) into 320-byte records of 16 channels × one group."""
    n, k = qw.shape
    t, g = n // TILE_CHANNELS, k // 32
    nibbles = qw.packed.reshape(t, TILE_CHANNELS, g, 4, 4).permute(0, 2, 3, 1, 4)

    def halves(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(t, TILE_CHANNELS, g).transpose(1, 2).contiguous().view(torch.uint8)

    records = (nibbles.reshape(t, g, 256), halves(qw.scales), halves(qw.mins))
    return Int4TiledWeight(torch.cat(records, dim=-1).contiguous())


INT8_RECORD = 512  # bytes per (tile, group) of an Int8TiledWeight: 16 channels × 32 weights


@dataclass
class Int8TiledWeight:
    """A per-channel int8 weight with `q8_activations` (the "gguf" output layer) in tiles of 16
    channels for the integer kernel: `tiles[t, g]` holds, in 8 chunks of 64 bytes, weights
    4i .. 4i + 3 of group g of each of the 16 channels, stored as q + 128 (unsigned, as the
    instruction wants them). The kernel takes the 128 back off (engine/kernels/csrc/q8_tiles.cpp);
    the numbers are those of `to_rows()`."""

    tiles: torch.Tensor  # [out / 16, in / 32, 512] uint8
    scales: torch.Tensor  # [out] float32
    q8_activations: bool = True

    @property
    def shape(self) -> torch.Size:
        t, g, _ = self.tiles.shape
        return torch.Size((t * TILE_CHANNELS, g * 32))

    def nbytes(self) -> int:
        return self.tiles.numel() + 4 * self.scales.numel()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.tiles, self.scales)

    def shifted_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """q + 128 of output channels `rows` ([len, in] uint8), read from their tiles: a tied
        embedding looks its tokens up here without untiling the whole table."""
        groups = self.tiles.shape[1]
        tile, channel = rows >> 4, rows & 15  # TILE_CHANNELS = 16 (a shift: ~10 us less a step)
        first = (tile * (groups * INT8_RECORD) + channel * 4).unsqueeze(1)  # [len, 1]
        return self.tiles.view(-1)[first + _int8_row_offsets(groups)]

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return (self.shifted_rows(rows).float() - 128.0) * self.scales[rows].unsqueeze(-1)

    def to_rows(self) -> Int8Weight:
        shifted = self.shifted_rows(torch.arange(self.shape[0]))
        return Int8Weight((shifted.to(torch.int16) - 128).to(torch.int8), self.scales, True)


@functools.cache
def _int8_row_offsets(groups: int) -> torch.Tensor:
    """Where a channel's weights 0 .. 32·groups - 1 lie in its tiles, from its first byte: group
    g at g × 512, weights 4i .. 4i + 3 of the group in chunk i, 64 bytes apart."""
    weight = torch.arange(groups * 32)
    group, within = weight // 32, weight % 32
    return group * INT8_RECORD + (within // 4) * 64 + within % 4


def tile_int8_q8(qw: Int8Weight) -> Int8TiledWeight:
    """Repack `qw` (see `can_tile`) into 512-byte records of 16 channels × one group."""
    n, k = qw.shape
    t, g = n // TILE_CHANNELS, k // 32
    shifted = (qw.qweight.to(torch.int16) + 128).to(torch.uint8)
    chunks = shifted.view(t, TILE_CHANNELS, g, 8, 4).permute(0, 2, 3, 1, 4)
    return Int8TiledWeight(chunks.reshape(t, g, INT8_RECORD).contiguous(), qw.scales)


QuantizedWeight = Int8Weight | Int4Weight | Int4TiledWeight | Int8TiledWeight
QUANTIZED_TYPES = (Int8Weight, Int4Weight, Int4TiledWeight, Int8TiledWeight)
TILED_TYPES = (Int4TiledWeight, Int8TiledWeight)


def storage_key(weight) -> int:
    """What identifies a weight's memory, so that a tied or shared one counts once: its storage
    pointer, or the object itself for a quantized weight, a bfloat16 one prepacked for oneDNN
    (engine/kernels/linear_precision.py `prepacked`) or one in tiles (bfloat16_tiles.py), which
    have none."""
    if not isinstance(weight, torch.Tensor) or weight.is_mkldnn:
        return id(weight)
    return weight.data_ptr()


def weight_nbytes(weight) -> int:
    """Bytes a weight occupies: a tensor's elements, or a quantized or tiled weight's packed
    values (with its scales and minimums)."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return weight.nbytes()


_tiles: dict[int, tuple[weakref.ref, object]] = {}  # id(row weight) → (that weight, its tiles)


def once_per_weight(w, make):
    """make(w), once while `w` lives: the engines of a process share one model
    (engine/worker/worker.py), and so one copy of what is made from its weights (tiles)."""
    entry = _tiles.get(id(w))
    if entry is not None and entry[0]() is w:
        return entry[1]
    made, key = make(w), id(w)
    _tiles[key] = (weakref.ref(w, lambda _: _tiles.pop(key, None)), made)
    return made


def tiles_of(w: Int4Weight | Int8Weight, arena: Arena) -> Int4TiledWeight | Int8TiledWeight:
    """`w` repacked into tiles (in `arena`'s huge pages), once while `w` lives."""
    tile = tile_int8_q8 if isinstance(w, Int8Weight) else tile_int4_q8
    return once_per_weight(w, lambda rows: arena.place(tile(rows)))


def arrange_for_kernels(weights: dict, kernels) -> dict:
    """The weights as the chosen linear path reads them best, decided once at load: the "gguf"
    matrices (Q4_1 layers, the int8 output layer) repacked into tiles where the extension
    (`kernels`) runs that tiled format in vector code (`q8_tile_formats`: int4 with AVX2 or
    AVX-512 VNNI, int8 likewise); else (another CPU, the torch reference) in rows, their
    file's order. Our kernels' outputs are the same bit for bit either way (the torch reference
    sums in its own order); other weights are left as they are."""
    formats = set(kernels.q8_tile_formats()) if kernels is not None else set()
    arranged: dict[int, object] = {}  # by id: a tied embedding stays the output layer's object
    arena = Arena()

    def arrange(w):
        if isinstance(w, TILED_TYPES):
            w = w.to_rows()
        if can_tile(w) and ("int8" if isinstance(w, Int8Weight) else "int4") in formats:
            return tiles_of(w, arena)
        return w

    out = {}
    for name, w in weights.items():
        if id(w) not in arranged:
            arranged[id(w)] = arrange(w)
        out[name] = arranged[id(w)]
    return out


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Per-output-channel symmetric int8: scale = max |w| of the row / 127."""
    w = w.float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row: any scale
    q = torch.round(w / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.contiguous())


def dequantize_int8(qw: Int8Weight) -> torch.Tensor:
    return qw.qweight.float() * qw.scales.unsqueeze(1)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Group-wise asymmetric int4: per group, min and scale = (max - min) / 15,
    q = round((w - min) / scale)."""
    out_features, in_features = w.shape
    if group_size % 2 or in_features % group_size:
        raise ValueError(
            f"in_features {in_features} must be a multiple of an even group_size {group_size}"
        )
    groups = w.float().view(out_features, in_features // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (hi - lo) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: q = 0
    q = torch.round((groups - lo.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    half = group_size // 2
    packed = q[..., :half] | (q[..., half:] << 4)  # low nibble: first half, high: second half
    return Int4Weight(
        packed.reshape(out_features, in_features // 2).contiguous(),
        scales.contiguous(),
        lo.contiguous(),
        group_size,
    )


def unpack_int4(qw: Int4Weight) -> torch.Tensor:
    """The 0..15 values, [out, in] uint8."""
    out_features, in_features = qw.shape
    half = qw.group_size // 2
    b = qw.packed.view(out_features, in_features // qw.group_size, half)
    return torch.cat((b & 0x0F, b >> 4), dim=-1).view(out_features, in_features)


def dequantize_int4(qw: Int4Weight) -> torch.Tensor:
    out_features, in_features = qw.shape
    q = unpack_int4(qw).float().view(out_features, -1, qw.group_size)
    scales, mins = qw.scales.float().unsqueeze(-1), qw.mins.float().unsqueeze(-1)
    return (q * scales + mins).view(out_features, in_features)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    if isinstance(qw, TILED_TYPES):
        qw = qw.to_rows()
    return dequantize_int8(qw) if isinstance(qw, Int8Weight) else dequantize_int4(qw)


def dequantize_rows(qw: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
    """Only the rows `rows` of W, dequantized to float32: an embedding lookup in a quantized
    table (a tied embedding shares its matrix with the quantized output layer)."""
    if isinstance(qw, Int8Weight):
        return qw.qweight[rows].float() * qw.scales[rows].unsqueeze(-1)
    if isinstance(qw, Int8TiledWeight):
        return qw.dequantize_rows(rows)
    if isinstance(qw, Int4TiledWeight):
        qw = qw.to_rows()
    sub = Int4Weight(qw.packed[rows], qw.scales[rows], qw.mins[rows], qw.group_size)
    return dequantize_int4(sub)


Q8_BLOCK = 32  # activation values per int8 block (llama.cpp's Q8_1)


def round_activations_q8(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] (in a multiple of 32) rounded as llama.cpp's Q8_1 rounds it, in float32: per
    block of 32 values d = max |x| / 127 and x ≈ round(x / d) × d, an int8 times one scale."""
    blocks = x.float().reshape(*x.shape[:-1], -1, Q8_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(d > 0, blocks / d, torch.zeros_like(blocks)).round().clamp(-127, 127)
    return (q * d).reshape(x.shape)


def reference_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The readable definition: dequantize, then an ordinary float matmul (after rounding the
    activations to 8-bit blocks for a weight that asks for it)."""
    if qw.q8_activations:
        b = bias.float() if bias is not None else None
        y = torch.nn.functional.linear(round_activations_q8(x), dequantize(qw), b)
        return y.to(x.dtype)
    return torch.nn.functional.linear(x, dequantize(qw).to(x.dtype), bias)


def kernel_linear(qw: QuantizedWeight, kernels):
    """`qw`'s C++ kernel with its tensors bound, chosen once per layer: `kernels.QuantLinear`
    (engine/kernels/csrc/fused_blocks.cpp), called as linear(x, bias) on [rows, in] contiguous
    float32 rows."""
    if isinstance(qw, Int8Weight):
        kind = "int8_q8" if qw.q8_activations else "int8"
        return kernels.QuantLinear(kind, list(qw.tensors()), 0)
    if isinstance(qw, TILED_TYPES):
        kind = "int4_tiles" if isinstance(qw, Int4TiledWeight) else "int8_tiles"
        return kernels.QuantLinear(kind, list(qw.tensors()), 0)
    kind = "int4_q8" if qw.q8_activations else "int4"
    return kernels.QuantLinear(kind, list(qw.tensors()), qw.group_size)


def quantized_linear(
    x: torch.Tensor,
    qw: QuantizedWeight,
    bias: torch.Tensor | None = None,
    kernels=None,
    linear=None,
) -> torch.Tensor:
    """y = x @ Wᵀ (+ bias) with a quantized W. x may have any leading dimensions ([..., in]).
    `kernels`: the compiled extension (engine.kernels.load()) to run our C++ kernel, None for the
    reference above; the caller chooses (a model resolves it once per engine, see
    engine/kernels/__init__.py `resolve_linear`), and may pass the kernel already bound
    (`linear`, from `kernel_linear`: a layer binds it once). Off a CPU, or in a dtype the kernel
    does not take, the reference runs whatever `kernels` is. The kernel computes in float32:
    bfloat16 or float16 activations are widened on the way in and narrowed on the way out (a few
    KB per decode step; the weights, the bytes that matter, are read once either way)."""
    if (
        kernels is None
        or not x.is_cpu
        or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
    ):
        return reference_linear(x, qw, bias)
    flat = x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
    x2 = x if flat else x.reshape(-1, x.shape[-1]).float().contiguous()
    b = bias.float().contiguous() if bias is not None else None
    y = (linear if linear is not None else kernel_linear(qw, kernels))(x2, b)
    # A decode step's [tokens, in] float32 rows need no reshaping (a few us of 121 calls a step).
    return y if flat else y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
