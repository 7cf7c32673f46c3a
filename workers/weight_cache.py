"""The weights as held after loading, kept on disk so the next start skips making them again.

Holding the default model as float32 or float16 column tiles takes ~2 s of a ~6 s start on a
2-core CPU (and twice that on a busy one): every Q4_1 block of the GGUF decoded to float32 in
numpy, the fused QKV and gate/up matrices assembled, each matrix repacked. The result depends
only on the checkpoint file, the options that shape it and the code that makes it, so the first
start saves it (one safetensors file per key) and later starts copy it back in ~0.2 s.

The key covers: the checkpoint (path, size and mtime of each file), the held format, the model
dtype, this rank's place in the tp x pp grid, the torch version, the compiled CPU ops' build (CPU
flags and source) and the source of the worker and kernel packages, so any code change starts
afresh. Only layers whose quant method keeps its whole loaded state in tensors
(`LinearMethod.held_in_tensors`) are cached, on CPU only. At most a few GiB stay on disk: older
entries go first. A file that cannot be read or written costs the cache, never the start.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from pagebus.bus.config import cache_root
from pagebus.workers.distributed.state import current
from pagebus.workers.host_memory import memory_order
from pagebus.workers.layers.linear import Linear
from torch import nn

log = logging.getLogger(__name__)

# Bump when what an entry holds changes in a way the source digest does not see.
FORMAT = 1
# Entries kept: the newest ones up to this many bytes (the newest is always kept).
MAX_BYTES = 3 * 2**30
_PACKAGES = ("workers", "kernels")
_SOURCE_SUFFIXES = (".py", ".cpp", ".h")


def _checkpoint_files(path: str) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    return sorted(f for f in p.iterdir() if f.suffix in (".safetensors", ".json", ".gguf") and f.is_file())


@functools.cache
def _source_digest() -> str:
    """sha256 over the source of the packages that decide how weights are held (once a process:
    a draft model or a second load keys on the same code)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for pkg in _PACKAGES:
        for f in sorted((root / pkg).rglob("*")):
            if f.suffix in _SOURCE_SUFFIXES and f.is_file():
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _native_build() -> str:
    from pagebus.kernels import cpu_native

    why_not = cpu_native.available()
    return f"none: {why_not}" if why_not is not None else cpu_native.build_digest()


def cache_key(path: str, held: str, dtype: torch.dtype) -> str:
    layout = current().layout
    parts = [
        f"format {FORMAT}",
        f"held {held}",
        f"dtype {dtype}",
        f"layout tp {layout.tp_size} pp {layout.pp_size} rank {layout.rank}",
        f"torch {torch.__version__}",
        f"native {_native_build()}",
        f"source {_source_digest()}",
    ]
    for f in _checkpoint_files(path):
        st = f.stat()
        parts.append(f"file {f.resolve()} {st.st_size} {st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def weight_cache_applies(model: nn.Module, device: torch.device) -> bool:
    """Whether the model's held weights are wholly its tensors (see the module docstring)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    return device.type == "cpu" and bool(linears) and all(m.quant_method.held_in_tensors for m in linears)


def held_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer once (a tied embedding's matrix is the head's)."""
    return dict([*model.named_parameters(), *model.named_buffers()])


def rebind_held_weights(model: nn.Module) -> None:
    """Every Linear takes its calls again from the tensors it now holds (after they were put back
    from a cache entry or moved)."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.bind_held_weights()


class WeightCache:
    def __init__(self, key: str, root: Path | None = None) -> None:
        self.dir = (root or cache_root()) / "weights"
        self.path = self.dir / f"{key}.safetensors"

    def restore(self, model: nn.Module) -> bool:
        """Put the held tensors of a cached entry into the freshly built `model`; False (and the
        model untouched) when there is none or it does not fit this model."""
        if not self.path.is_file():
            return False
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("pagebus", "{}"))
                tensors = held_tensors(model)
                if set(meta.get("order", {})) != set(tensors):
                    raise ValueError("its tensor names are not this model's")
                loaded = {}
                for name, t in tensors.items():
                    stored = f.get_tensor(name)
                    if stored.numel() != t.numel():
                        raise ValueError(f"{name}: {stored.numel()} elements, the model has {t.numel()}")
                    # A copy in ordinary memory: the file's pages are a read-only mapping.
                    inverse = sorted(range(stored.dim()), key=meta["order"][name].__getitem__)
                    loaded[name] = stored.clone().permute(inverse)
        except Exception as e:  # a damaged or foreign file: load from the checkpoint instead
            log.warning("weight cache %s not used (%s); loading from the checkpoint", self.path, e)
            self.path.unlink(missing_ok=True)
            return False
        for name, t in tensors.items():
            t.data = loaded[name]
        rebind_held_weights(model)
        os.utime(self.path)  # most recently used: pruned last
        log.info("weights as held read from the weight cache %s", self.path)
        return True

    def store(self, model: nn.Module) -> None:
        """Save `model`'s held tensors under this key (atomically), then prune old entries."""
        from safetensors.torch import save_file

        tensors = held_tensors(model)
        order = {name: memory_order(t) for name, t in tensors.items()}  # saved so, put back as the same view
        flat = {name: t.permute(order[name]) for name, t in tensors.items()}
        if not all(t.is_contiguous() for t in flat.values()):
            log.info("weight cache: a held tensor is not dense; not cached")
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.stem}.", suffix=".tmp", dir=self.dir)
            os.close(fd)
            try:
                save_file(flat, tmp, metadata={"pagebus": json.dumps({"order": order})})
                os.replace(tmp, self.path)  # readers see no file or a whole one
            finally:
                Path(tmp).unlink(missing_ok=True)
        except Exception as e:  # e.g. a read-only home, a full disk (safetensors' own errors too)
            log.warning(
                "weight cache: could not write %s (%s); the next start loads the checkpoint again",
                self.path,
                e,
            )
            return
        log.info("weights as held saved to the weight cache %s", self.path)
        prune(self.dir, keep=self.path)


def prune(directory: Path, keep: Path, max_bytes: int = MAX_BYTES) -> None:
    """Delete the least recently used entries beyond `max_bytes` in all (never `keep`)."""
    entries = []
    for f in directory.glob("*.safetensors"):
        try:
            st = f.stat()
        except FileNotFoundError:  # another process pruned it
            continue
        entries.append((f == keep, st.st_mtime, st.st_size, f))
    total = 0
    for is_keep, _, size, f in sorted(entries, reverse=True):
        total += size
        if total > max_bytes and not is_keep:
            f.unlink(missing_ok=True)
