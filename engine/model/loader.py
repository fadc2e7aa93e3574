"""Load a Hugging Face safetensors checkpoint folder into a LlamaForCausalLM, tensor by tensor."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import CheckpointError
from engine.model.attention_backend import AttentionBackend
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some exporters save that carry nothing the model needs (recomputed from the config).
_HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device | str, attention: AttentionBackend | None = None
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model described by ``path/config.json`` and fill every parameter from safetensors.

    Every tensor is cast to ``dtype`` and copied to ``device`` as it is read, so peak host memory is one
    tensor, not the checkpoint. Any inconsistency between the folder and the model is a CheckpointError
    naming the file and the tensor. ``attention``: the attention backend (default the torch reference).
    """
    folder = Path(path)
    config = ModelConfig.from_dir(folder)
    files = _weight_files(folder)
    names_by_file = {file: _tensor_names(file) for file in files}
    model = LlamaForCausalLM(config, dtype, device, attention)
    params = dict(model.named_parameters())  # tied lm_head is deduplicated away
    _check_names(folder, names_by_file, params, config.tie_word_embeddings)
    for file, names in names_by_file.items():
        _load_file(file, names, params)
    return model.eval(), config


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the checkpoint, from the single file or the shard index."""
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    index = folder / INDEX_FILE
    if index.is_file():
        return _shards(index)
    others = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if others:
        raise CheckpointError(
            f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}; found {', '.join(others)}, "
            "but only safetensors checkpoints are supported"
        )
    raise CheckpointError(f"{folder}: no safetensors weights ({SINGLE_FILE} or {INDEX_FILE})")


def _shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: cannot read the shard index: {exc!r}") from exc
    shards = []
    for name in sorted(set(weight_map.values())):
        shard = index.parent / name
        if not shard.is_file():
            tensor = next(t for t, f in weight_map.items() if f == name)
            raise CheckpointError(f"{index}: lists shard {name} (e.g. for tensor {tensor}) but it is missing")
        shards.append(shard)
    return shards


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file: {exc}") from exc


def _is_skipped(name: str, tied: bool) -> bool:
    """Tensors that are read past: recomputed buffers, and lm_head when it is the embedding."""
    return name.endswith(_HARMLESS_SUFFIXES) or (tied and name == "lm_head.weight")


def _check_names(
    folder: Path, names_by_file: dict[Path, list[str]], params: dict[str, torch.nn.Parameter], tied: bool
) -> None:
    """Fail before reading any data if a tensor is unexpected or a parameter has no tensor."""
    found: set[str] = set()
    for file, names in names_by_file.items():
        for name in names:
            if _is_skipped(name, tied):
                continue
            if name not in params:
                raise CheckpointError(f"{file}: unexpected tensor {name} (no such parameter in the model)")
            found.add(name)
    missing = sorted(set(params) - found)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{folder}: checkpoint is missing required tensor(s) {shown}")


@torch.no_grad()
def _load_file(file: Path, names: list[str], params: dict[str, torch.nn.Parameter]) -> None:
    with safe_open(file, framework="pt") as f:
        for name in names:
            param = params.get(name)
            if param is None:  # a skipped tensor (see _is_skipped)
                continue
            shape = tuple(f.get_slice(name).get_shape())
            if shape != tuple(param.shape):
                raise CheckpointError(
                    f"{file}: tensor {name} has shape {list(shape)} but the model expects {list(param.shape)}"
                )
            param.copy_(f.get_tensor(name))  # casts to the model's dtype and device


def random_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    std: float = 0.02,
    attention: AttentionBackend | None = None,
) -> LlamaForCausalLM:
    """A model of ``config``'s shape with seeded random weights (norms 1, the rest normal with ``std``), built on
    ``device``: what benchmarks and tests use where no checkpoint is needed (bench/gpu.py's Llama-3-8B shape)."""
    model = LlamaForCausalLM(config, dtype, device, attention)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
    return model.eval()
