"""What goes on the wire, one module for every exchange: fp32, bf16, fp16, and blockwise
int8/int4 with error feedback, in one registry (`CODECS`, `make_codec`).

Two kinds, told apart by `summable`. fp32/bf16/fp16 can be summed hop by hop on the wire
(the transport's all-reduce and reduce-scatter add them as they pass, the ring rounding
each hop's sum to the wire dtype): data parallel on both engines and sharding send their
gradients so (`dist.wire_dtype`), through `to_wire`/`from_wire`. int8/int4 cannot: their
payloads are all-gathered as bytes and every rank decodes and sums them (DiLoCo's
`dist.outer_wire`, through `encode`/`decode`). bfloat16 travels as its uint16 bit patterns
(numpy has no bfloat16); the transport sums uint16 buffers as bfloat16.

A DiLoCo pseudo-gradient crosses the slow link once per H inner steps, so its size on the wire
is what DiLoCo trades against; it is also noise-tolerant (an average of many steps), which
is why Streaming DiLoCo sends it in 4 bits. Quantized codecs keep an error-feedback
residual: what rounding dropped this time is added to the next payload, so the sum of
the decoded values over many syncs tracks the sum of the true values to within one
rounding step, instead of drifting by a bias that grows with every sync.

Payloads are flat uint8 arrays of a size fixed by the element count, so ranks can
all-gather them as plain byte buffers; decoding is pure numpy and bit-identical everywhere.

Adding a codec: a `Codec` subclass (`nbytes`, `encode`, `decode`, `nonfinite`; `summable` and
`to_wire`/`from_wire` if a transport may add its payloads) and `@register_codec("name")`. A
codec that takes a parameter reads it from its constructor's one string argument: the config
says `dist.wire_dtype=name:param` (`make_codec`), and a name alone builds it with none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from .. import registry
from ..registry import CODEC_ALIASES as ALIASES
from ..registry import CODECS

# Elements sharing one fp32 scale: 4 bytes of scale per 128 values costs 3% at int8 and
# 6% at int4, and a block that small keeps one outlier from flattening many values.
BLOCK = 128


def bf16_bits(x: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """fp32 -> bfloat16 bit patterns (uint16), round to nearest even, as MLX's astype does.
    `scratch`, an fp32 array of x's size, spares a temporary (and its page faults)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    t = np.right_shift(u, 16, out=None if scratch is None else scratch.view(np.uint32).reshape(u.shape))
    t &= 1  # in place from here on, all uint32: 6x faster than one expression
    t += 0x7FFF
    t += u
    t >>= 16
    r = t.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        r[nan] = 0x7FC0
    return r


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Codec:
    """Identity fp32 codec; the base of the others. `encode` may update `residual` in place."""

    name = "float32"
    lossy = False
    summable = True  # the transport may add payloads hop by hop (`to_wire` buffers)
    wire_dtype: np.dtype = np.dtype(np.float32)  # what `to_wire` returns (uint16: bfloat16 bits)

    def to_wire(self, x: np.ndarray) -> np.ndarray:
        """fp32 values as the summable wire buffer (no copy for fp32)."""
        return np.asarray(x, np.float32)

    def from_wire(self, buf: np.ndarray) -> np.ndarray:
        """A summed wire buffer back to fp32 (no copy for fp32)."""
        return buf.astype(np.float32, copy=False)

    def nbytes(self, n: int) -> int:
        return 4 * n

    def encode(self, x: np.ndarray, residual: np.ndarray | None = None, consume: bool = False) -> np.ndarray:
        """The payload for x (+ residual, which is updated in place to what the payload
        drops). With `consume` x may be overwritten: no temporary the size of the model."""
        return np.ascontiguousarray(x, dtype=np.float32).view(np.uint8).copy()

    def decode(self, payload: np.ndarray, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """n fp32 values, into `out` when given (reused buffers spare page faults)."""
        dst = np.empty(n, np.float32) if out is None else out
        dst[...] = payload[: 4 * n].view(np.float32)
        return dst

    def nonfinite(self, payload: np.ndarray, n: int) -> bool:
        """Whether the payload of n values carries a non-finite one (the exchange then skips the
        step on every rank and drops the residual it poisoned)."""
        return not np.isfinite(payload[: 4 * n].view(np.float32)).all()


class BF16Codec(Codec):
    name = "bfloat16"
    lossy = True
    wire_dtype = np.dtype(np.uint16)

    def to_wire(self, x: np.ndarray) -> np.ndarray:
        return bf16_bits(x)

    def from_wire(self, buf: np.ndarray) -> np.ndarray:
        return bf16_to_f32(buf)

    def nbytes(self, n: int) -> int:
        return 2 * n

    def encode(self, x: np.ndarray, residual: np.ndarray | None = None, consume: bool = False) -> np.ndarray:
        y = _with_residual(x, residual, consume)
        bits = bf16_bits(y, scratch=residual)
        if residual is not None:
            back = residual.view(np.uint32)
            back[...] = bits
            back <<= 16
            np.subtract(y, residual, out=residual)
        return bits.view(np.uint8)

    def decode(self, payload: np.ndarray, n: int, out: np.ndarray | None = None) -> np.ndarray:
        dst = np.empty(n, np.float32) if out is None else out
        bits = dst.view(np.uint32)
        bits[...] = payload[: 2 * n].view(np.uint16)
        bits <<= 16
        return dst

    def nonfinite(self, payload: np.ndarray, n: int) -> bool:
        return bool(((payload[: 2 * n].view(np.uint16) & 0x7F80) == 0x7F80).any())  # exponent all ones


class FP16Codec(Codec):
    name = "float16"
    lossy = True
    wire_dtype = np.dtype(np.float16)

    def nbytes(self, n: int) -> int:
        return 2 * n

    def to_wire(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x).astype(np.float16)

    def encode(self, x: np.ndarray, residual: np.ndarray | None = None, consume: bool = False) -> np.ndarray:
        y = _with_residual(x, residual, consume)
        half = y.astype(np.float16)
        if residual is not None:
            np.subtract(y, half, out=residual)
        return half.view(np.uint8)

    def decode(self, payload: np.ndarray, n: int, out: np.ndarray | None = None) -> np.ndarray:
        dst = np.empty(n, np.float32) if out is None else out
        dst[...] = payload[: 2 * n].view(np.float16)
        return dst

    def nonfinite(self, payload: np.ndarray, n: int) -> bool:
        return not np.isfinite(payload[: 2 * n].view(np.float16)).all()


def _with_residual(x: np.ndarray, residual: np.ndarray | None, consume: bool) -> np.ndarray:
    if residual is None:
        return np.asarray(x, np.float32)
    if consume:
        return np.add(x, residual, out=x)
    return x + residual


class BlockQuantCodec(Codec):
    """Symmetric absmax quantization per BLOCK elements: fp32 scales, then the codes
    (int8, or int4 packed two to a byte). Layout: [scales][codes]."""

    lossy = True
    summable = False  # per-block scales: payloads are all-gathered and decoded, never added

    def __init__(self, bits: int):
        if bits not in (4, 8):
            raise ValueError(f"dist.outer_wire: int{bits} is not supported (int8 or int4)")
        self.bits = bits
        self.name = f"int{bits}"
        self.qmax = 2 ** (bits - 1) - 1

    def _blocks(self, n: int) -> int:
        return -(-n // BLOCK)

    def _code_bytes(self, n: int) -> int:
        padded = self._blocks(n) * BLOCK
        return padded if self.bits == 8 else padded // 2

    def nbytes(self, n: int) -> int:
        return 4 * self._blocks(n) + self._code_bytes(n)

    def _codes(self, y: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """fp32 scales and the codes as rounded fp32 values, shape (blocks, BLOCK); `out`
        (fp32, y's size, a whole number of blocks) receives the codes."""
        n = y.size
        nb = self._blocks(n)
        if n == nb * BLOCK:
            blocks = np.ascontiguousarray(y, np.float32).reshape(nb, BLOCK)
        else:
            blocks, out = np.zeros((nb, BLOCK), np.float32), None
            blocks.reshape(-1)[:n] = y
        # max/min instead of abs, a reciprocal instead of a divide, no clip (|code| <= qmax
        # by construction), no temporary: this runs on the whole model every round.
        scale = (np.maximum(blocks.max(axis=1), -blocks.min(axis=1)) / np.float32(self.qmax)).astype(np.float32)
        inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
        codes = np.multiply(blocks, inv[:, None], out=None if out is None else out.reshape(nb, BLOCK))
        np.rint(codes, out=codes)
        return scale, codes

    def quantize(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        scale, codes = self._codes(y)
        return scale, codes.astype(np.int8)

    def dequantize(self, scale: np.ndarray, q: np.ndarray, n: int, out: np.ndarray | None = None) -> np.ndarray:
        if n != q.size:  # padded last block
            values = (q.astype(np.float32) * scale[:, None]).reshape(-1)[:n]
            if out is None:
                return values
            out[...] = values
            return out
        dst = np.empty(q.shape, np.float32) if out is None else out.reshape(q.shape)
        dst[...] = q
        dst *= scale[:, None]
        return dst.reshape(-1)

    def encode(self, x: np.ndarray, residual: np.ndarray | None = None, consume: bool = False) -> np.ndarray:
        y = _with_residual(x, residual, consume)
        scale, codes = self._codes(y, out=residual)
        q = codes.astype(np.int8)
        if residual is not None:  # what this round's message drops goes into the next one
            codes *= scale[:, None]
            np.subtract(y, codes.reshape(-1)[: y.size], out=residual)  # codes may live in residual
        if self.bits == 8:
            packed = q.view(np.uint8).reshape(-1)
        else:
            u = (q.reshape(-1) + 8).astype(np.uint8)
            packed = u[0::2] | (u[1::2] << 4)
        return np.concatenate([scale.view(np.uint8), packed])

    def decode(self, payload: np.ndarray, n: int, out: np.ndarray | None = None) -> np.ndarray:
        nb = self._blocks(n)
        scale = payload[: 4 * nb].view(np.float32)
        codes = payload[4 * nb: 4 * nb + self._code_bytes(n)]
        if self.bits == 8:
            q = codes.view(np.int8)
        else:
            q = np.empty(codes.size * 2, np.int8)
            q[0::2] = (codes & 0x0F).astype(np.int8) - 8
            q[1::2] = (codes >> 4).astype(np.int8) - 8
        return self.dequantize(scale, q.reshape(nb, BLOCK), n, out)

    def nonfinite(self, payload: np.ndarray, n: int) -> bool:
        """A non-finite value makes its block's scale non-finite (NaN -> int8 is undefined: the
        scale carries it)."""
        return not np.isfinite(payload[: 4 * self._blocks(n)].view(np.float32)).all()

    def step_bound(self, y: np.ndarray) -> np.ndarray:
        """Per element, half the rounding step of its block: the most one encode can drop."""
        n = y.size
        blocks = np.zeros((self._blocks(n), BLOCK), np.float32)
        blocks.reshape(-1)[:n] = y
        half = np.abs(blocks).max(axis=1) / self.qmax / 2
        return np.repeat(half, BLOCK)[:n]


def int8() -> BlockQuantCodec:
    return BlockQuantCodec(8)


def int4() -> BlockQuantCodec:
    return BlockQuantCodec(4)


C = TypeVar("C")


def register_codec(name: str) -> Callable[[C], C]:
    """A class decorator: the codec under `name` in `CODECS` (`mlxdist/registry.py`; the keys
    dist.wire_dtype=NAME and dist.outer_wire=NAME choose it). A name is registered once (a
    built-in's too)."""
    return registry.registrar(CODECS, "codec", name)


def make_codec(name: str, key: str = "dist.outer_wire", summable: bool = False) -> Codec:
    """The codec `name` names (`CODECS`; `name:param` hands the codec its parameter); `key`
    names the setting in errors; `summable`: the exchange adds payloads on the wire, so a
    codec that cannot be added (int8, int4) is refused."""
    codec = registry.make(CODECS, "wire format", name, key, ALIASES)
    if summable and not codec.summable:
        raise ValueError(f"{key}={name}: this exchange sums on the wire; use {', '.join(summable_names())}")
    return codec


def summable_names() -> list[str]:
    """The registered codecs a transport may add hop by hop."""
    return registry.summable_codecs()


__all__ = ["ALIASES", "BLOCK", "CODECS", "BF16Codec", "BlockQuantCodec", "Codec", "FP16Codec", "bf16_bits",
           "bf16_to_f32", "make_codec", "register_codec", "summable_names"]
