"""GPTQ and AWQ checkpoints (`--quantization gptq|awq`, or detected from config.json): integer
weights with one scale and zero point per group of input columns, kept packed.

Published layouts (w[n, k] = scale[g, n] * (q[k, n] - zero[g, n]), g = g_idx[k]):
- GPTQ (AutoGPTQ): qweight int32 [K / p, N] packs p = 32 / bits consecutive input rows, row
  8i + j (4-bit) in bits 4j..4j+3; qzeros int32 [G, N / p] packs output columns the same way,
  stored minus one ("gptq" format; "gptq_v2" stores them as is); scales [G, N]; g_idx int32 [K]
  (k // group_size, or any grouping with desc_act / act-order).
- AWQ (AutoAWQ GEMM): qweight int32 [K, N / 8] packs 8 output columns, column 8c + ORDER[i] in
  bits 4i..4i+3; qzeros int32 [G, N / 8] the same; scales [G, N]; groups are k // group_size.

Each checkpoint matrix is unpacked once at load to integers, then repacked into the layouts the
kernels read (cpu_kernels.py's, which kernels/quant_matmul.py reads too): 4-bit as "q4" (w = d q + m
with m = -d zero), GPTQ 8-bit symmetric as "q8" (w = d (q - 128)). Act-order checkpoints have
their input columns sorted by group once here, so every group is contiguous, and x is permuted
the same way at each call (as ExLlama does). d and m are held per group of the checkpoint on CUDA,
per 32 columns on CPU (the C++ kernels' block). The LM head and embedding stay float, as the
checkpoints store them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from pagebus.workers.layers.quant import packed_mm
from pagebus.workers.layers.quant.base import LinearMethod, LinearMethodFactory

if TYPE_CHECKING:
    from pagebus.workers.layers.linear import Linear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed AWQ word holds column ORDER[i]
_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
_BLOCK = 32  # the kernels' column block: K and every group size are multiples of it


class UnsupportedQuantConfig(ValueError):
    pass


@dataclass(frozen=True)
class GroupQuantConfig:
    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group per row
    sym: bool
    zeros_minus_one: bool  # GPTQ's classic format stores each zero point minus one

    @classmethod
    def from_hf(cls, qc: dict[str, Any]) -> GroupQuantConfig:
        """config.json's quantization_config, or a clear error naming the setting we cannot serve."""
        method = qc.get("quant_method")

        def refuse(setting: str) -> UnsupportedQuantConfig:
            return UnsupportedQuantConfig(
                f"{method} checkpoint: quantization_config {setting} is not supported"
            )

        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", -1)))
        if group != -1 and (group <= 0 or group % _BLOCK):
            raise refuse(f"group_size {group} (supported: -1 or a multiple of {_BLOCK})")
        if method == "gptq":
            if bits not in (4, 8):
                raise refuse(f"bits {bits} (supported: 4, 8)")
            fmt = qc.get("checkpoint_format", "gptq")
            if fmt not in ("gptq", "gptq_v2"):
                raise refuse(f"checkpoint_format {fmt!r} (supported: gptq, gptq_v2)")
            if qc.get("lm_head"):
                raise refuse("lm_head true (a quantized LM head)")
            if qc.get("dynamic"):
                raise refuse("dynamic (per-module overrides)")
            sym = bool(qc.get("sym", True))
            if bits == 8 and not sym:
                raise refuse("sym false with bits 8 (8-bit is served symmetric only)")
            return cls("gptq", bits, group, sym, fmt == "gptq")
        if method == "awq":
            if bits != 4:
                raise refuse(f"bits {bits} (supported: 4)")
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise refuse(f"version {version!r} (supported: gemm)")
            if not qc.get("zero_point", True):
                raise refuse("zero_point false")
            if qc.get("modules_to_not_convert"):
                raise refuse(f"modules_to_not_convert {qc['modules_to_not_convert']}")
            return cls("awq", 4, group, False, False)
        raise UnsupportedQuantConfig(f"quant_method {method!r} is not GPTQ or AWQ")


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits values per word along dim 0 -> int16 [R * 32 / bits, C]."""
    per = 32 // bits
    shifts = (torch.arange(per, dtype=torch.int32) * bits)[None, :, None]
    v = (packed.to(torch.int32)[:, None, :] >> shifts) & ((1 << bits) - 1)
    return v.reshape(-1, packed.shape[1]).to(torch.int16)


def _unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits values per word along dim 1 -> int16 [R, C * 32 / bits]."""
    return _unpack_rows(packed.t().contiguous(), bits).t()


@dataclass
class Unpacked:
    """One checkpoint matrix as integers: q [N, K], scales and zeros [N, G], group of each column."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx
        return self.scales[:, g] * (self.q.float() - self.zeros[:, g])


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, checkpoint has {tuple(t.shape)}")


def unpack(cfg: GroupQuantConfig, t: dict[str, torch.Tensor], n: int, k: int, what: str) -> Unpacked:
    """A checkpoint matrix of N outputs and K inputs from its tensors (see the module docstring)."""
    for name in ("qweight", "qzeros", "scales"):
        if name not in t:
            raise ValueError(f"{what}: the checkpoint has no {name}")
    gs = k if cfg.group_size == -1 else cfg.group_size
    if k % gs:
        raise ValueError(f"{what}: {k} input features are not whole groups of {gs}")
    groups, per = k // gs, 32 // cfg.bits
    _expect(f"{what}.scales", t["scales"], (groups, n))
    scales = t["scales"].float().t().contiguous()
    if cfg.method == "gptq":
        _expect(f"{what}.qweight", t["qweight"], (k // per, n))
        _expect(f"{what}.qzeros", t["qzeros"], (groups, -(-n // per)))
        q = _unpack_rows(t["qweight"], cfg.bits).t()
        zeros = _unpack_cols(t["qzeros"], cfg.bits)[:, :n].t() + int(cfg.zeros_minus_one)
        g_idx = t["g_idx"].long() if "g_idx" in t else torch.arange(k) // gs
        _expect(f"{what}.g_idx", g_idx, (k,))
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"{what}.g_idx: group indices outside [0, {groups})")
    else:
        reverse = torch.tensor(AWQ_ORDER).argsort()  # column j of 8 sits in nibble reverse[j]
        _expect(f"{what}.qweight", t["qweight"], (k, n // 8))
        _expect(f"{what}.qzeros", t["qzeros"], (groups, n // 8))
        q = _unpack_cols(t["qweight"], 4).reshape(k, -1, 8)[..., reverse].reshape(k, n).t()
        zeros = _unpack_cols(t["qzeros"], 4).reshape(groups, -1, 8)[..., reverse].reshape(groups, n).t()
        g_idx = torch.arange(k) // gs
    return Unpacked(q.contiguous(), scales, zeros.float().contiguous(), g_idx)


@dataclass
class Packed:
    """What the kernels read. kind "q4": qs uint8 [N, K/32, 16] (cpu_kernels' nibble order), d and m
    float32 [N, K / gs]; kind "q8": qs int8 [N, K], d [N, K / gs]. perm: x's columns, or None."""

    kind: str
    tensors: list[torch.Tensor]
    perm: torch.Tensor | None


def _sort_groups(u: Unpacked, what: str) -> tuple[Unpacked, torch.Tensor | None, int]:
    """Columns reordered so each group is one contiguous run of equal length; (u, perm, group size)."""
    k = u.q.shape[1]
    perm = torch.argsort(u.g_idx, stable=True)
    g_sorted = u.g_idx[perm]
    runs = torch.unique_consecutive(g_sorted, return_counts=True)[1]
    gs = int(runs[0])
    if bool((runs != gs).any()) or gs % _BLOCK or k % _BLOCK:
        raise UnsupportedQuantConfig(
            f"{what}: g_idx groups of {runs.unique().tolist()} columns over {k} inputs; this engine needs "
            f"equal groups of a multiple of {_BLOCK} (act-order checkpoints cannot be split by tensor "
            "parallelism along their input features)"
        )
    if bool((perm == torch.arange(k)).all()):
        return u, None, gs
    return Unpacked(u.q[:, perm].contiguous(), u.scales, u.zeros, g_sorted), perm, gs


def repack(cfg: GroupQuantConfig, u: Unpacked, device: torch.device, what: str) -> Packed:
    u, perm, gs = _sort_groups(u, what)
    n, k = u.q.shape
    first = u.g_idx[::gs]  # the checkpoint group of each contiguous run
    d = u.scales[:, first].contiguous()
    z = u.zeros[:, first]
    if device.type == "cpu" and gs != _BLOCK:  # the C++ kernels read one d per 32 columns
        d, z = d.repeat_interleave(gs // _BLOCK, dim=1), z.repeat_interleave(gs // _BLOCK, dim=1)
    if cfg.bits == 8:
        if bool((z != 128).any()):
            raise UnsupportedQuantConfig(f"{what}: 8-bit zero points other than 128 (asymmetric)")
        return Packed("q8", [(u.q - 128).to(torch.int8).contiguous(), d.contiguous()], perm)
    q = u.q.to(torch.uint8).view(n, k // _BLOCK, 2, 16)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous()  # byte j: column j low, column 16 + j high
    return Packed("q4", [qs, d.contiguous(), (-d * z).contiguous()], perm)


def _matmul(p: Packed, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T: x's columns in the packed order first (act-order)."""
    return packed_mm.matmul(p.kind, x[:, p.perm] if p.perm is not None else x, p.tensors)


def dense(p: Packed) -> torch.Tensor:
    """The packed matrix as float32 [N, K], columns in the checkpoint's order (reference)."""
    w = packed_mm.dequantize(p.kind, p.tensors)
    if p.perm is None:
        return w
    out = torch.empty_like(w)
    out[:, p.perm] = w
    return out


class GroupQuantLinearMethod(LinearMethod):
    """One per layer: registers the checkpoint's tensor names as parameters, collects each shard's
    tensors, and at the end unpacks, slices (tensor parallelism), repacks and concatenates them."""

    def __init__(self, cfg: GroupQuantConfig) -> None:
        self.cfg = cfg
        self.pending: dict[str | int | None, dict[str, torch.Tensor]] = {}
        self.packed: Packed | None = None

    def create_weights(self, layer: Linear, in_features: int, out_features: int) -> None:
        self.device = torch.empty(0).device  # the model's device (the loader builds under it)
        for name in _TENSORS:
            p = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            p.weight_loader = functools.partial(self._collect, layer, name)  # type: ignore[attr-defined]
            p.optional_in_checkpoint = name == "g_idx"  # type: ignore[attr-defined]
            layer.register_parameter(name, p)

    def _collect(
        self, layer: Linear, name: str, param: Any, w: torch.Tensor, shard: str | int | None
    ) -> None:
        self.pending.setdefault(shard, {})[name] = w

    def load(self, layer: Linear, w: Any, shard: str | int | None) -> None:
        raise TypeError(
            f"a {self.cfg.method} layer loads qweight/qzeros/scales/g_idx, not a float weight; "
            "the checkpoint has an unquantized matrix where its config says it is quantized"
        )

    def _shard(self, layer: Linear, shard: str | int | None) -> Unpacked:
        """A shard's matrix unpacked whole, then cut to this rank's rows and columns (tensor
        parallelism: Linear.checkpoint_rows / checkpoint_cols, as for float weights)."""
        t = self.pending[shard]
        what = f"{type(layer).__name__} shard {shard}"
        if "qweight" not in t or "scales" not in t:
            raise ValueError(f"{what}: the checkpoint has no qweight or scales for it")
        n = t["scales"].shape[1]
        k = t["qweight"].shape[0] * (32 // self.cfg.bits if self.cfg.method == "gptq" else 1)
        u = unpack(self.cfg, t, n, k, what)
        rows = layer.out_features if shard is None else layer.shard_offsets[shard][1]
        if layer.checkpoint_rows:
            first = layer.checkpoint_rows[shard if shard is not None else next(iter(layer.shard_offsets))]
            q, scales, zeros = (x.narrow(0, first, rows) for x in (u.q, u.scales, u.zeros))
            u = Unpacked(q, scales, zeros, u.g_idx)
        if layer.checkpoint_cols is not None:
            cols = slice(layer.checkpoint_cols, layer.checkpoint_cols + layer.in_features)
            u = Unpacked(u.q[:, cols].contiguous(), u.scales, u.zeros, u.g_idx[cols])
        if tuple(u.q.shape) != (rows, layer.in_features):
            raise ValueError(
                f"{what}: expected shape {(rows, layer.in_features)}, checkpoint has {tuple(u.q.shape)}"
            )
        return u

    def process_after_loading(self, layer: Linear) -> None:
        if not self.pending:
            return
        keys: list[str | int | None] = [None] if None in self.pending else list(layer.shard_offsets)
        missing = [k for k in keys if k not in self.pending]
        if missing:
            raise ValueError(f"{self.cfg.method} layer: no tensors for shards {missing}")
        parts = [repack(self.cfg, self._shard(layer, k), self.device, f"shard {k}") for k in keys]
        perm = parts[0].perm
        if not all(
            (p.perm is None and perm is None)
            or (p.perm is not None and perm is not None and torch.equal(p.perm, perm))
            for p in parts
        ):
            raise UnsupportedQuantConfig(
                f"{self.cfg.method} layer: the fused shards {keys} have different act-order (g_idx) "
                "permutations; fusing them needs one order of input columns"
            )
        tensors = [torch.cat(ts).to(self.device) for ts in zip(*(p.tensors for p in parts), strict=True)]
        perm = perm.to(self.device) if perm is not None else None
        self.packed = Packed(parts[0].kind, tensors, perm)
        self.pending = {}
        # The parameters hold the packed arrays, so memory counts see them.
        names = ["qweight", "scales", "qzeros"][: len(tensors)]
        for name, t in zip(names, tensors, strict=True):
            getattr(layer, name).data = t
        layer.g_idx.data = perm if perm is not None else torch.empty(0, dtype=torch.long)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            raise RuntimeError(f"{self.cfg.method} layer used before its weights were loaded")
        shape = x.shape
        y = _matmul(self.packed, x.reshape(-1, shape[-1]))
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*shape[:-1], layer.out_features)


def method_factory(qc: dict[str, Any]) -> LinearMethodFactory:
    """Quantized linears for a checkpoint's quantization_config; the LM head stays float (the
    checkpoints keep it so)."""
    from pagebus.workers.layers.linear import UnquantizedLinearMethod
    from pagebus.workers.layers.parallel import ParallelLMHead

    cfg = GroupQuantConfig.from_hf(qc)

    def make(layer: Linear) -> LinearMethod:
        return UnquantizedLinearMethod() if isinstance(layer, ParallelLMHead) else GroupQuantLinearMethod(cfg)

    return make
