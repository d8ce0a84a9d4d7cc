"""The full (unsharded) model in one process, with no process group: for ``ptdp generate`` and for
Hugging Face export/import. Names and shapes are the logical ones (``GPTModel`` built with t = 1), e.g.
``layers.0.attention.qkv.weight`` is ``[3, h, h]`` (the q, k and v blocks) and
``embedding.word_embeddings.weight`` is ``[padded_vocab, h]`` (rows past ``model.vocab_size`` are padding).

``torch.distributed.checkpoint`` (with DTensor and sympy, about a second of CPU) is imported where a checkpoint
is read or written, not with the module.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch

from ptdp.checkpointing import storage
from ptdp.checkpointing.validation import model_shape
from ptdp.config import Config
from ptdp.models import TIED_EMBEDDING, GPTModel
from ptdp.models.gpt import on_meta


def read_full_model_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The full model tensors and the saved config (``Config.to_dict()`` form, ``model.vocab_size`` set to
    the real vocabulary) of the checkpoint at ``path``: a ``--save`` directory (its ``latest``) or one
    ``iter_*`` directory. Checksums are verified first.
    """
    model = FullModelReader(path)
    tensors = {key: model.empty(key) for key in model.sources.values()}
    model.load(tensors)
    return {name: tensors[key] for name, key in model.sources.items()}, model.config


class FullModelReader:
    """A checkpoint's full tensors, read in one process whole or one at a time (a streamed export holds
    one parameter at a time, never the model). ``sources``: logical name -> the saved key holding its
    truth (the fp32 master weights of a 16-bit run, the model's own copy otherwise)."""

    def __init__(self, path: str | Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        if not Path(path).exists():
            raise storage.CheckpointError(f"{path} does not exist")
        if not Path(path).is_dir():
            raise storage.CheckpointError(f"{path} is not a directory (give the --save directory of a run)")
        directory = storage.resolve(path)
        if directory is None:
            raise storage.CheckpointError(f"{path} holds no checkpoint yet (no {storage.LATEST} file)")
        storage.verify_checksums(directory)
        info = storage.read_info(directory)
        self.directory = directory
        self.saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
        names = [key.removeprefix("model.") for key, meta in self.saved.items()
                 if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)]
        self.sources = {name: f"optimizer.{name}.main_param" if f"optimizer.{name}.main_param" in self.saved
                        else f"model.{name}" for name in names}
        self.config = info["config"]
        self.config["model"]["vocab_size"] = info["model"]["vocab_size"]

    def shape(self, name: str) -> torch.Size:
        return self.saved[self.sources[name]].size

    def empty(self, key: str) -> torch.Tensor:
        return torch.empty(self.saved[key].size, dtype=self.saved[key].properties.dtype)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill ``tensors`` (saved key -> tensor of its full shape) from the checkpoint."""
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
            dcp.load(tensors, checkpoint_id=self.directory, no_dist=True)

    def tensor(self, name: str) -> torch.Tensor:
        """The full tensor of parameter ``name`` (only it is read)."""
        key = self.sources[name]
        out = {key: self.empty(key)}
        self.load(out)
        return out[key]


def write_full_model_state(path: str | Path, tensors: dict[str, torch.Tensor], config_dict: dict,
                           iteration: int = 0, consumed_samples: int = 0,
                           optimizer: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write ``tensors`` (full, logical names) as the iteration-0 checkpoint of ``path``, loadable by
    ``--load`` in any layout; it holds no optimizer state, so AdamW starts fresh. ``config_dict`` is a
    ``Config.to_dict()`` or just its ``model`` section; ``model.vocab_size`` defaults to the embedding's
    rows, and an unpadded embedding is padded with zero rows. A ``path`` that holds checkpoints already
    raises :class:`~.storage.CheckpointError` (``ptdp import``'s one line) and is left as it was.
    ``iteration``/``consumed_samples``: where an imported run stood (a Megatron-LM save), so ``ptdp train
    --load`` goes on from the next iteration and sample; no data state is recorded, so the builder's order
    (Megatron's) is read from sample ``iteration * --global-batch-size`` on. ``optimizer``: per parameter
    its full optimizer state (``{exp_avg, exp_avg_sq, step[, main_param]}``, ``state.py``'s keys), every
    trained parameter's, so that ``--load`` resumes AdamW in any layout.
    """
    if storage.saved_iterations(path) or (Path(path) / storage.LATEST).exists():  # iteration 0 would replace `latest`
        raise storage.CheckpointError(f"--save {path} already holds a run's checkpoints; writing a model there would "
                                      f"move {Path(path) / storage.LATEST} back to iteration 0; --save a fresh directory")
    config = _config_from_dict(config_dict)
    model_cfg = config.model
    embedding = tensors.get(TIED_EMBEDDING)
    if embedding is None:
        raise ValueError(f"write_full_model_state: no {TIED_EMBEDDING} among the tensors")
    vocab = model_cfg.vocab_size or embedding.shape[0]
    padded = model_cfg.padded_vocab_size(vocab, 1)
    model_cfg.vocab_size = vocab
    with on_meta():  # the parameters and the persistent buffers (a router's expert bias)
        expected = {name: p.shape for name, p in GPTModel(model_cfg, vocab, padded, config.moe).state_dict().items()}
    tensors = dict(tensors)
    if embedding.shape[0] == vocab < padded:
        tensors[TIED_EMBEDDING] = torch.cat([embedding, embedding.new_zeros(padded - vocab, embedding.shape[1])])
    missing, unexpected = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"write_full_model_state: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"write_full_model_state: {name} has shape {tuple(tensors[name].shape)}, "
                             f"the config says {tuple(shape)}")
    state = {f"model.{name}": tensors[name].detach().to("cpu", torch.float32).contiguous() for name in expected}
    if optimizer is not None:
        state.update(_optimizer_entries(optimizer, model_cfg, vocab, padded, config))
    import torch.distributed.checkpoint as dcp

    root = Path(path)
    tmp = storage.prepare_temporary(root, iteration)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp, no_dist=True)
    storage.write_info(tmp, {
        "iteration": iteration, "consumed_samples": consumed_samples, "model": model_shape(model_cfg, vocab, padded),
        "layout": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
                   "virtual_pipeline_model_parallel_size": 1, "pipeline_schedule": "1f1b"},
        "contents": ["model"] + (["optimizer"] if optimizer is not None else []), "config": config.to_dict(),
    })
    return storage.commit(root, iteration)


def _optimizer_entries(optimizer: dict, model_cfg, vocab: int, padded: int, config: Config) -> dict[str, torch.Tensor]:
    """``optimizer.<name>.<field>`` entries, checked: every trained parameter's state, each shaped like it."""
    with torch.device("meta"):
        params = {name: p.shape for name, p in GPTModel(model_cfg, vocab, padded, config.moe).named_parameters()}
    missing, unexpected = sorted(params.keys() - optimizer.keys()), sorted(optimizer.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"write_full_model_state: optimizer state missing {missing[:3]}, unexpected {unexpected[:3]}")
    out = {}
    for name, fields in optimizer.items():
        for field, value in fields.items():
            value = value.detach().to("cpu", torch.float32).clone() if field == "step" else value.detach().to("cpu", torch.float32)
            if field != "step" and value.shape[0] < params[name][0] and name == TIED_EMBEDDING:  # padding rows
                value = torch.cat([value, value.new_zeros(params[name][0] - value.shape[0], *value.shape[1:])])
            if field == "step" and value.dim() != 0 or field != "step" and tuple(value.shape) != tuple(params[name]):
                raise ValueError(f"write_full_model_state: the optimizer's {field} of {name} has shape "
                                 f"{tuple(value.shape)}, the parameter {tuple(params[name])}")
            out[f"optimizer.{name}.{field}"] = value.contiguous()
    return out


def _config_from_dict(config_dict: dict) -> Config:
    sections = config_dict if "model" in config_dict else {"model": config_dict}
    config = Config()
    for section_name, values in sections.items():
        section = config.sections().get(section_name)
        if section is None:
            raise ValueError(f"write_full_model_state: unknown config section {section_name!r}")
        known = {f.name for f in dataclasses.fields(section)}
        for key, value in values.items():
            if key in known:
                setattr(section, key, value)
            elif section_name != "model" or key not in ("ffn_size", "padded_vocab_size"):
                raise ValueError(f"write_full_model_state: unknown config key {section_name}.{key}")
    return config
