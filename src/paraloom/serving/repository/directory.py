"""A models directory: which models it holds and how one is built to serve (each model's config
is read by ``paraloom.serving.repository.config``).

Layout (one entry per model; names starting with '.' or '_' are skipped)::

    DIR/lenet.safetensors            model "lenet", defaults; options in DIR/lenet.json
    DIR/mlp/model.safetensors        model "mlp"; options in DIR/mlp/config.json
    DIR/cnn/1/model.safetensors      numbered versions: the version policy picks those served
    DIR/cnn/2/model.safetensors
    DIR/cnn/config.json

Every file must be a ``.safetensors`` written by ``paraloom.save``; pickles (``.pt``, ``.pth``,
``.pkl``, ``.bin``, ``.ckpt``) are listed as refused, never opened. Paths that resolve outside
DIR (symlinks) are refused. A config is JSON: ``name``, ``version_policy`` (Triton's:
``{"latest": {"num_versions": N}}``, default 1; ``{"all": {}}``; ``{"specific": {"versions":
[1, 3]}}``; each version served gets its own pool), ``mode``, ``workers``, ``batch_limit``,
``queue_limit``, ``max_wait_ms``, ``threads_per_worker``, ``max_batch_size`` (the most rows
one request may hold, as Triton's; 0, the default: any), ``inputs`` and ``outputs``
(``[{"name", "datatype", "shape"}]``, bound to ``forward`` as ``binding`` says) and
``reshape`` (``{"name": [model's shape without the rows]}``).

A model folder may instead be in Triton's layout for TorchScript models: ``config.pbtxt`` and
``N/model.pt`` (``paraloom.serving.repository.triton``), served when the server allows
TorchScript; a ``config.pbtxt`` also configures a ``.safetensors`` model.

A model folder (or a numbered version's folder) may hold ``handler.py``: pre- and
postprocessing around the model (``paraloom.serving.handlers``). It is code, so it runs only
when the server allows handlers; otherwise the model is listed UNAVAILABLE with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paraloom.serving.classification import read_labels
from paraloom.serving.errors import NotFoundError, listed, short_repr
from paraloom.serving.handlers import HANDLER_FILE, Handler, load_handler
from paraloom.serving.repository.binding import bind
from paraloom.serving.repository.config import (
    ModelConfig,
    VersionPolicy,
    config_path_of,
    read_config,
)
from paraloom.serving.repository.files import ModelFiles
from paraloom.serving.repository.triton import (
    PBTXT,
    TORCHSCRIPT,
    is_torchscript,
    torchscript_file,
)
from paraloom.serving.served import PoolOptions, ServedModel, build_pool
from paraloom.serving.signature import ModelSignature, infer_signature
from paraloom.serving.strings import BYTES

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Found", "ModelsDir", "NoVersionLoads", "Versions"]

_WEIGHTS = "model.safetensors"
_LABELS_MAX = 16 << 20  # the largest labels file read
_PICKLES = {".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt", ".joblib", ".npy"}


class NoVersionLoads(ValueError):
    """``build_versions``: not one version the policy picks builds; ``failed`` says why, by
    version."""

    def __init__(self, failed: Mapping[str, str]) -> None:
        self.failed = dict(failed)
        reasons = list(self.failed.values())
        super().__init__(reasons[0] if len(reasons) == 1 else "no version loads: " + "; ".join(
            f"version {v}: {r}" for v, r in self.failed.items()))


@dataclass(frozen=True)
class Versions:
    """What a model's build gave: the versions served (oldest first) and, by version, why the
    others failed."""

    served: list[ServedModel]
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Found:
    """One model of the directory: the file to serve and its version (the latest served, when
    the policy serves several: ``older`` holds the others' (version, file)), or why refused."""

    name: str
    path: Path | None
    version: int = 1
    config: ModelConfig | None = None
    folder: Path | None = None
    error: str = ""
    older: tuple[tuple[int, Path], ...] = ()
    numbered: bool = False
    """Whether the versions are numbered folders (``DIR/cnn/3/``)."""
    refused: tuple[tuple[int, str], ...] = ()
    """Versions the policy picks whose folder has no usable file: (version, why)."""

    @property
    def versions(self) -> list[int]:
        """Every version served, ascending."""
        return [v for v, _ in self.older] + ([self.version] if self.path is not None else [])


def _is_version_folder(name: str) -> bool:
    """Whether a model folder's subfolder is a version: a number, not starting with 0
    (Triton's rule: ``1``, ``12``, never ``0`` or ``007``, which it ignores)."""
    return name.isascii() and name.isdigit() and not name.startswith("0")


class ModelsDir:
    """The models in a directory, and how to build a ``ServedModel`` of one of them."""

    def __init__(self, root: str | Path, *, pool_defaults: PoolOptions | None = None,
                 retry_after: int = 1, allow_handlers: bool = False,
                 allow_torchscript: bool = False) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ValueError(f"models directory {str(root)!r} is not a directory; pass the "
                             "folder that holds one sub-folder or .safetensors file per model")
        self.pool_defaults = PoolOptions() if pool_defaults is None else pool_defaults.copy()
        self.retry_after = retry_after
        self.allow_handlers = allow_handlers
        self.allow_torchscript = allow_torchscript

    def _inside(self, path: Path) -> bool:
        return path.resolve().is_relative_to(self.root)

    def _config(self, path: Path, stem: str) -> ModelConfig | None:
        """The config at ``path``, None where there is none; ``ValueError`` for one that
        resolves outside the models directory (never opened: its text would reach clients in
        the reason) or that cannot be read."""
        if not path.is_file():
            return None
        if not self._inside(path):
            raise ValueError(f"{path.name} resolves outside the models directory: refused")
        return read_config(path, stem)

    def _entry(self, path: Path) -> Found | None:
        stem = path.stem if path.is_file() else path.name
        if not self._inside(path):
            return Found(stem, None, error=f"{path.name} resolves outside the models directory: "
                         "refused")
        if path.is_file():
            if path.suffix in _PICKLES:
                return Found(stem, None, error=f"{path.name} is a pickle-based file: refused, "
                             "paraloom never unpickles; save the model with paraloom.save "
                             "as .safetensors")
            if path.suffix != ".safetensors":
                return None  # configs, READMEs
            return self._found(stem, path, path.with_suffix(".json"), folder=None)
        return self._folder(path)

    def _folder(self, folder: Path) -> Found:
        numbered = sorted((int(p.name), p) for p in folder.iterdir() if p.is_dir()
                          and _is_version_folder(p.name))
        try:
            config_path = config_path_of(folder)
        except ValueError as e:
            return Found(folder.name, None, error=str(e))
        if not numbered:
            found = self._found(folder.name, folder / _WEIGHTS, config_path, folder=folder)
            policy = found.config.version_policy if found.config is not None else None
            if policy is not None and policy.kind == "specific" and policy.specific != (1,):
                return Found(found.name, None, error=f"the version_policy serves versions "
                             f"{list(policy.specific)}, but {folder.name}/ has no numbered "
                             "version folders (its weights are version 1); put each version "
                             f"in its folder ({folder.name}/{policy.specific[0]}/"
                             f"{_WEIGHTS}) or drop the policy")
            return found
        try:
            config = self._config(config_path, folder.name)
        except ValueError as e:
            return Found(folder.name, None, error=str(e))
        policy = config.version_policy if config is not None else VersionPolicy()
        folders = dict(numbered)  # version -> its folder
        wanted = policy.select(sorted(folders))
        # Each version stands alone, as in Triton: one without a usable file, or without its
        # folder, is UNAVAILABLE with its reason, and the others serve.
        entries = [self._found(folder.name, folders[v] / _WEIGHTS, config_path,
                               folder=folders[v], version=v) if v in folders else
                   Found(config.name if config else folder.name, None, version=v,
                         error=f"the version_policy names version {v}, which is not in "
                         f"{folder.name}/ (found {sorted(folders)})") for v in wanted]
        usable = [e for e in entries if e.path is not None]
        refused = tuple((v, e.error) for v, e in zip(wanted, entries, strict=True)
                        if e.path is None)
        if not usable:
            reasons = {error for _, error in refused}
            error = reasons.pop() if len(reasons) == 1 else "no version loads: " + "; ".join(
                f"version {v}: {error}" for v, error in refused)
            return Found(entries[-1].name, None, error=error)
        older = tuple((e.version, e.path) for e in usable[:-1] if e.path is not None)
        return replace(usable[-1], older=older, numbered=True, refused=refused)

    def _found(self, stem: str, weights: Path, config_path: Path, *, folder: Path | None,
               version: int = 1) -> Found:
        try:
            config = self._config(config_path, stem)
        except ValueError as e:
            return Found(stem, None, error=str(e))
        name = config.name if config is not None else stem
        if not weights.is_file() and folder is not None:
            script = weights.with_name(config.model_filename if config else TORCHSCRIPT)
            if script.is_file():
                refused = self._refusal(script)
                if refused:
                    return Found(name, None, error=refused)
                weights = script
        if not weights.is_file():
            script_name = (config.model_filename if config else TORCHSCRIPT)
            also = f" or {script_name} (TorchScript)" if folder is not None else ""
            pickles = [p.name for p in weights.parent.glob("*") if p.suffix in _PICKLES
                       and p.name != script_name]
            hint = f" ({pickles} are pickle-based: refused)" if pickles else ""
            return Found(name, None, error=f"no {weights.relative_to(self.root)}{also}{hint}")
        if not self._inside(weights):
            return Found(name, None, error=f"{weights.name} resolves outside the models "
                         "directory: refused")
        return Found(name, weights, version, config, folder)

    def _refusal(self, script: Path) -> str:
        """Why a model folder's ``model.pt`` is not served ("" if it is)."""
        shown = script.relative_to(self.root)
        if not self._inside(script):
            return f"{shown} resolves outside the models directory: refused"
        if not is_torchscript(script):
            return (f"{shown} is not TorchScript (a torch.save pickle?): refused, paraloom "
                    "never unpickles; save it with torch.jit.save, or with paraloom.save as "
                    "model.safetensors")
        if not self.allow_torchscript:
            return (f"{shown} is TorchScript, a program, which this server does not run: "
                    "start it with --allow-torchscript (create_repository_app("
                    "allow_torchscript=True)) to serve it")
        return ""

    def scan(self) -> dict[str, Found]:
        """Every model the directory holds now, by served name."""
        found: dict[str, Found] = {}
        for path in sorted(self.root.iterdir()):
            if path.name.startswith((".", "_")):
                continue
            entry = self._entry(path)
            if entry is None:
                continue
            if entry.name in found:
                entry = Found(entry.name, None, error=f"two entries serve the name "
                              f"{entry.name!r}; rename one (or its config's name)")
            found[entry.name] = entry
        return found

    def find(self, name: str) -> Found:
        """The model served as ``name``; ``NotFoundError`` if the directory has none."""
        found = self.scan()
        if name not in found:
            raise NotFoundError(f"no model {short_repr(name)} in the models directory "
                                f"{str(self.root)!r}; it holds {listed(found)}")
        return found[name]

    def build(self, found: Found) -> ServedModel:
        """A ``ServedModel`` with its own pool for one found model; ``ValueError`` if it fails."""
        if found.path is None:
            raise ValueError(found.error)
        return self._build_one(found.name, found.path, found.folder, found.version,
                               found.config or ModelConfig(found.name), numbered=found.numbered)

    def build_versions(self, found: Found) -> Versions:
        """Every version the policy serves, each in its own pool, latest last; a version that
        fails to build is left out with its reason, as Triton serves the versions that load.
        ``NoVersionLoads`` when none builds; ``ValueError`` for a model the directory refused."""
        if found.path is None:
            raise ValueError(found.error)
        config = found.config or ModelConfig(found.name)
        wanted: list[tuple[int, Path, Path | None, bool]] = [(v, p, p.parent, True)
                                                             for v, p in found.older]
        wanted.append((found.version, found.path, found.folder, found.numbered))
        built: list[ServedModel] = []
        failed: dict[str, str] = {str(v): error for v, error in found.refused}
        try:
            for version, path, folder, numbered in wanted:
                try:
                    built.append(self._build_one(found.name, path, folder, version, config,
                                                 numbered=numbered))
                except (ValueError, TypeError, RuntimeError, OSError, KeyError) as e:
                    failed[str(version)] = str(e)
        except BaseException:
            for served in built:  # interrupted: close the pools already started
                served.pool.close(drain=False)
            raise
        if not built:
            raise NoVersionLoads(failed)
        return Versions(built, failed)

    def _build_one(self, name: str, path: Path, folder: Path | None, version: int,
                   config: ModelConfig, *, numbered: bool) -> ServedModel:
        model, signature = self._model(path, config)
        handler = self._handler(folder, signature, f"{name}:{version}")
        outputs = [o.name for o in (handler.signature if handler else signature).outputs]
        unknown = sorted(set(config.labels) - set(outputs))
        if unknown:
            raise ValueError(f"labels are given for outputs {unknown}, which {name!r} does "
                             f"not have; its outputs are {outputs}")
        options: PoolOptions = {**self.pool_defaults, **config.pool_options}
        pool = build_pool(model, signature, None, config.outputs is None, options)
        # A load request reads from the model's own folder: DIR itself for DIR/NAME.safetensors.
        files = ModelFiles(model_file=path if path.suffix == ".safetensors" else None,
                           model_dir=folder or self.root)
        if handler is not None:  # the handler's tensors, the config's max_batch_size
            signature = replace(handler.signature, max_rows=signature.max_rows)
        labels = {n: read_labels(p.read_text(errors="replace"))
                  for n, p in config.labels.items() if self._inside(p)
                  and p.stat().st_size <= _LABELS_MAX}
        return ServedModel(name, pool, model, signature, files=files, owns_pool=True,
                           retry_after=self.retry_after, first_version=version,
                           numbered=numbered, handler=handler, batch_dim=config.batched,
                           labels=labels, version_policy=config.version_policy.as_triton(),
                           weights_file=path.name, tensor_config=_tensor_config(config))

    def _model(self, path: Path, config: ModelConfig) -> tuple[nn.Module, ModelSignature]:
        """The model in ``path`` (paraloom.save's .safetensors, or TorchScript) and its
        signature."""
        from paraloom.checkpoint import load

        shown = path.relative_to(self.root)
        script = path.suffix != ".safetensors"
        if script and (config.inputs is None or config.outputs is None):
            raise ValueError(f"{shown} is TorchScript, whose inputs and outputs cannot be read "
                             f"from it: give them in the model's {PBTXT} (input, output) or "
                             "config.json (inputs, outputs)")
        strings = [s.name for s in config.inputs or () if s.datatype == BYTES]
        if strings:
            raise ValueError(f"{shown}: inputs {strings} are TYPE_STRING (BYTES), but a model "
                             "takes tensors of numbers; declare the model's own inputs in "
                             f"its {PBTXT}, and turn strings into them with a handler.py beside "
                             "it (its INPUTS may be BYTES; paraloom serve --allow-handlers)")
        try:
            model = torchscript_file(path) if script else load(path).eval()
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            raise ValueError(f"cannot load {shown}: {e}") from e
        if config.inputs is not None:  # declared: called as Triton's PyTorch backend calls it
            model = bind(model, config.inputs, config.outputs or (), reshape=config.reshape,
                         batched=config.batched)
        elif config.reshape:
            raise ValueError(f"{shown}: reshape needs the inputs declared (input in "
                             f"{PBTXT}, inputs in config.json)")
        signature = infer_signature(model, inputs=config.inputs, outputs=config.outputs)
        return model, replace(signature, max_rows=config.max_batch_size)

    def _handler(self, folder: Path | None, signature: ModelSignature, label: str
                 ) -> Handler | None:
        """The handler.py of a model's folder (a version's own first), loaded if allowed."""
        if folder is None:
            return None
        candidates = [folder / HANDLER_FILE, folder.parent / HANDLER_FILE]
        if folder.parent == self.root:
            candidates.pop()
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            return None
        shown = path.relative_to(self.root)
        if not self._inside(path):
            raise ValueError(f"{shown} resolves outside the models directory: refused")
        if not self.allow_handlers:
            raise ValueError(f"{shown} is code, which this server does not run: start it with "
                             "--allow-handlers (create_repository_app(allow_handlers=True)) to "
                             "serve this model through its handler")
        return load_handler(path, signature, label)


def _tensor_config(config: ModelConfig) -> dict[str, dict[str, Any]]:
    """The config's ``reshape`` and ``labels`` as Triton's tensor fields, by tensor name."""
    fields: dict[str, dict[str, Any]] = {}
    for name, shape in config.reshape.items():
        fields.setdefault(name, {})["reshape"] = {"shape": list(shape)}
    for name, path in config.labels.items():
        fields.setdefault(name, {})["label_filename"] = path.name
    return fields
