"""``paraloom serve``: serve a saved model over HTTP with the Open Inference Protocol (v2)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from paraloom.arguments import count, positive, seconds, wait
from paraloom.devices import parse_devices
from paraloom.serving.log_settings import SERVER_LOG
from paraloom.user_code import build_user_model, import_callable, import_module

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from paraloom.serving.repository.models import ModelRepository
    from paraloom.serving.served import PoolOptions
    from paraloom.serving.signature import TensorSpec

__all__ = ["add_arguments", "build_model", "main", "run", "shared_memory_on"]

_log = logging.getLogger("paraloom.serving")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``paraloom serve``'s arguments to ``parser``."""
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="a .safetensors file written by paraloom.save or paraloom train "
                        "(leave out with --models-dir to serve every model in DIR)")
    parser.add_argument("--factory", metavar="PKG.MOD:FN",
                        help="build the model by calling this function (your own architecture)")
    parser.add_argument("--weights", metavar="FILE",
                        help="with --factory: safetensors weights to load into the built model "
                        "(MODEL --factory FN does the same)")
    parser.add_argument("--name", default="model", help="the model's name in URLs (default: "
                        "model)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; "
                        "0.0.0.0 exposes the model to the network)")
    parser.add_argument("--port", type=port, default=8000, help="port (default 8000; 0: any)")
    _add_pool_arguments(parser)
    _add_signature_arguments(parser)
    _add_http_arguments(parser)


def _add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    pool = parser.add_argument_group("batching (ParallelInference)")
    pool.add_argument("--mode", default="batched", choices=["batched", "sequential", "inplace"],
                      help="inference mode (default batched)")
    pool.add_argument("--workers", type=count, default=2, help="model replicas (default 2)")
    pool.add_argument("--devices", default="auto", type=parse_devices,
                      help="auto (every GPU, else the CPU), cpu, a GPU count, or a list such "
                      "as cuda:0,cuda:1; replicas are dealt round robin (default auto)")
    pool.add_argument("--batch-limit", type=count, default=32, help="rows per batch (default 32)")
    pool.add_argument("--queue-limit", type=count, default=256,
                      help="queued requests before answering 503 (default 256)")
    pool.add_argument("--max-wait-ms", type=wait, default=0.0,
                      help="wait this long for a fuller batch (default 0: never wait)")
    pool.add_argument("--threads-per-worker", type=count, default=None,
                      help="torch threads per replica (default: torch's own setting)")


def _add_signature_arguments(parser: argparse.ArgumentParser) -> None:
    sig = parser.add_argument_group("signature (default: read from the model)")
    sig.add_argument("--input-shape", metavar="DIMS", action="append",
                     help="e.g. --input-shape=-1,1,28,28 (-1: any size; write the =); once per "
                     "input of a model with several, in forward's order")
    sig.add_argument("--input-datatype", default=None, action="append",
                     help="with --input-shape: e.g. INT64 (default FP32); once for every "
                     "input, or once per input")
    sig.add_argument("--input-name", default=None, action="append",
                     help="with --input-shape (default: input; input_0, input_1, ... for "
                     "several); once per input")


def _add_http_arguments(parser: argparse.ArgumentParser) -> None:
    http = parser.add_argument_group("HTTP")
    http.add_argument("--models-dir", metavar="DIR", help="without MODEL: serve every model "
                      "in DIR (a model repository: one sub-folder or .safetensors file per "
                      "model); with MODEL: the folder of .safetensors files that "
                      "POST /v2/repository/models/NAME/load may read (default: only MODEL)")
    http.add_argument("--grpc-port", type=port, default=None, metavar="PORT",
                      help="also serve the v2 gRPC endpoint on PORT (default: off; 0: any free "
                      "port, printed)")
    http.add_argument("--grpc-backend", choices=("auto", "uvicorn", "grpcio"), default="auto",
                      help="what serves gRPC: uvicorn's HTTP/2 (zttp; about twice grpcio's "
                      "calls/s), grpcio's grpc.aio, or auto (default: uvicorn where zttp is "
                      "installed, else grpcio)")
    http.add_argument("--max-body-mb", type=positive, default=16.0,
                      help="largest request body in MiB (default 16); larger gets 413")
    http.add_argument("--graceful-timeout", type=seconds, default=30.0,
                      help="seconds to finish in-flight requests at shutdown (default 30)")
    http.add_argument("--gil-switch-ms", type=positive, default=1.0,
                      help="Python's GIL switch interval in ms for this server (default 1; "
                      "Python's own is 5, which makes the event loop wait on the workers)")
    http.add_argument("--processes", type=count, default=1,
                      help="server processes sharing the ports, each with its own pools of "
                      "--workers replicas (default 1); more than 1 takes the HTTP and JSON "
                      "work off one event loop, but loads go by SIGHUP only")
    http.add_argument("--shared-memory", choices=("auto", "on", "off"), default="auto",
                      help="Triton's system shared memory extension: clients on this host pass "
                      "tensors through POSIX shared memory regions they register (default "
                      "auto: on when --host is a loopback address and --processes is 1)")
    http.add_argument("--allow-handlers", action="store_true",
                      help="with --models-dir: import and run each model folder's handler.py "
                      "(pre- and postprocessing, strings in and out); it is code from the "
                      "repository, so off by default: such models are listed UNAVAILABLE")
    http.add_argument("--allow-torchscript", action="store_true",
                      help="with --models-dir: serve TorchScript model.pt files (Triton's "
                      "layout: NAME/config.pbtxt, NAME/1/model.pt); a TorchScript archive is a "
                      "program, so off by default: such models are listed UNAVAILABLE")
    http.add_argument("--import", dest="imports", metavar="MODULE", action="append",
                      default=[], help="import MODULE (from the current folder or PYTHONPATH) "
                      "before loading: the module that defines the class a saved model names "
                      "(a models directory of your own architectures); repeat for several")
    http.add_argument("--log-level", default="info",
                      help="the server's log level: debug, info, warning, error (default info)")
    http.add_argument("--log-file", metavar="FILE", default=None,
                      help="append the server's log to FILE (default: the console)")
    http.add_argument("--access-log", action="store_true", help="log every request")


def _has_header(path: str) -> bool:
    from paraloom.safetensors_files import read_header

    try:
        read_header(path)
    except ValueError:
        return False
    return True


def build_model(args: argparse.Namespace) -> tuple[nn.Module, str | None]:
    """The model to serve and the paraloom file it came from (the one reloads may re-read)."""
    from paraloom.checkpoint import load

    weights = args.weights
    if args.model and args.factory:  # as paraloom evaluate takes them: MODEL's weights
        if weights is not None:
            raise ValueError("MODEL and --weights both name the weights to load into "
                             "--factory's model: pass one of them")
        weights = args.model
    elif weights is not None and not args.factory:
        raise ValueError("--weights goes with --factory (your model's class, given the file's "
                         "weights); a file from paraloom.save is served as MODEL")
    elif args.model:
        return load(args.model), args.model
    if not args.factory:
        raise ValueError("nothing to serve: pass MODEL (a file from paraloom.save) or "
                         "--factory pkg.mod:fn [--weights FILE]")
    if weights is None:
        return build_user_model(args.factory), None
    factory = import_callable(args.factory, "--factory")
    if not Path(weights).is_file():
        raise FileNotFoundError(f"weights {weights!r} do not exist")
    if _has_header(weights):
        return load(weights, factory=factory), weights
    from paraloom.safetensors_files import check_safetensors, read_tensors

    check_safetensors(weights)  # a torch.save pickle: say so, and how to convert it
    model = factory()
    model.load_state_dict(read_tensors(weights), strict=True)
    return model, None  # plain safetensors: served, but not reloadable (no paraloom header)


def _input_specs(args: argparse.Namespace) -> list[TensorSpec] | None:
    """The inputs given by --input-shape and friends; None: read them from the model."""
    if not args.input_shape:
        given = [f for f, v in (("--input-datatype", args.input_datatype),
                                ("--input-name", args.input_name)) if v is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} need{'s' * (len(given) == 1)} "
                             "--input-shape, e.g. "
                             "--input-shape=-1,16 (-1: any size); without it the input is "
                             "read from the model's first layer as FP32")
        return None
    from paraloom.serving.signature import TensorSpec

    shapes = [_dims(raw) for raw in args.input_shape]
    count = len(shapes)
    names = args.input_name or (["input"] if count == 1 else [f"input_{i}" for i in range(count)])
    datatypes = args.input_datatype or ["FP32"]
    if len(datatypes) == 1:
        datatypes = datatypes * count
    if len(names) != count or len(datatypes) != count:
        raise ValueError(f"{count} --input-shape but {len(names)} --input-name and "
                         f"{len(datatypes)} --input-datatype; give one of each per input (one "
                         "--input-datatype may stand for all)")
    return [TensorSpec(n, d, s) for n, d, s in zip(names, datatypes, shapes, strict=True)]


def port(raw: str) -> int:
    """A TCP port from the command line: 0 (any free one) to 65535."""
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a port; expected 0 (any free port) "
                                         "to 65535")
    return value


def _dims(raw: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in raw.split(","))
    except ValueError as e:
        raise ValueError(f"--input-shape {raw!r} must be integers separated by commas, e.g. "
                         "-1,1,28,28") from e


def _reload_on_sighup(app: Starlette) -> None:
    """Make SIGHUP reload the served file, or every model of the models directory, as
    ``POST .../load`` with no body does for one."""
    repository = _repository(app)
    inner = app.router.lifespan_context

    async def reload() -> None:
        try:
            for name, version in (await repository.reload()).items():
                _log.info("SIGHUP: model %r now serves version %s", name, version)
        except Exception as e:  # a bad file must not stop the server: log it, keep serving
            _log.error("SIGHUP reload failed, the old versions keep serving: %s", e)

    @contextlib.asynccontextmanager
    async def lifespan(a: Starlette) -> AsyncIterator[None]:
        async with inner(a):
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(reload()))
            try:
                yield
            finally:
                loop.remove_signal_handler(signal.SIGHUP)

    app.router.lifespan_context = lifespan


def _repository(app: Starlette) -> ModelRepository:
    """The models of an app ``_build_app`` made (create_app and create_repository_app set them)."""
    repository: ModelRepository = app.state.repository
    return repository


def _log_models(repository: ModelRepository) -> None:
    """Log each model's inputs and outputs, or why it is not served."""
    for row in repository.index():
        if row["state"] == "READY":
            meta = repository.get(row["name"]).metadata()
            _log.info("model %r: inputs %s, outputs %s", row["name"], meta["inputs"],
                      meta["outputs"])
        else:
            _log.warning("model %r not served: %s", row["name"], row["reason"])


def _pool_options(args: argparse.Namespace) -> PoolOptions:
    return {"inference_mode": args.mode, "workers": args.workers, "devices": args.devices,
            "batch_limit": args.batch_limit, "queue_limit": args.queue_limit,
            "max_wait_ms": args.max_wait_ms, "threads_per_worker": args.threads_per_worker}


def shared_memory_on(args: argparse.Namespace) -> bool:
    """Whether --shared-memory (auto: a loopback host, one process) turns the extension on.

    Regions are registered with one process, so with --processes > 1 a request could reach a
    sibling that never saw its region: refused there."""
    processes = getattr(args, "processes", 1)
    if args.shared_memory == "on" and processes > 1:
        raise ValueError("--shared-memory on needs --processes 1: each process holds its own "
                         "registered regions, and a client's requests reach any of them")
    if args.shared_memory == "auto":
        from paraloom.serving.shared_memory import on_by_default

        return on_by_default(args.host, processes)
    return bool(args.shared_memory == "on")


def _build_app(args: argparse.Namespace) -> tuple[Starlette, str | None]:
    """The app to serve and the paraloom file it serves (None: a repository or no file)."""
    from paraloom.serving.app import create_app, create_repository_app

    for module in args.imports:  # the operator's own code, named on the command line
        import_module(module, "--import")
    max_body = int(args.max_body_mb * (1 << 20))
    shared_memory = shared_memory_on(args)
    if args.models_dir and not args.model and not args.factory:
        if args.input_shape or args.input_datatype or args.input_name:
            raise ValueError("--input-shape, --input-datatype and --input-name apply to one "
                             'model; with a models directory, put "inputs" in each model\'s '
                             "config.json")
        return create_repository_app(args.models_dir, max_body_bytes=max_body,
                                     allow_handlers=args.allow_handlers,
                                     allow_torchscript=args.allow_torchscript,
                                     shared_memory=shared_memory, **_pool_options(args)), None
    if args.allow_handlers or args.allow_torchscript:
        flag = "--allow-handlers" if args.allow_handlers else "--allow-torchscript"
        raise ValueError(f"{flag} applies to a models directory (--models-dir DIR without "
                         "MODEL), whose model folders hold handler.py or model.pt")
    model, model_file = build_model(args)
    app = create_app(model, name=args.name, model_file=model_file, model_dir=args.models_dir,
                     max_body_bytes=max_body, inputs=_input_specs(args),
                     shared_memory=shared_memory, **_pool_options(args))
    return app, model_file


def _configure_logging(args: argparse.Namespace) -> None:
    """The root logger's handler (to the console, or appending to ``--log-file``), whose format
    the ``log_format`` setting then sets; uvicorn's records go through it too."""
    root = logging.getLogger()
    before = list(root.handlers)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s",
                        filename=args.log_file)
    for handler in root.handlers:
        if handler not in before:  # a program that configured logging keeps its handlers
            SERVER_LOG.own(handler)
    SERVER_LOG.file = args.log_file or ""


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code."""
    from paraloom.serving.server import close_owned_pools, serve

    try:
        _configure_logging(args)
        if args.grpc_port is not None and args.grpc_port == args.port and args.port != 0:
            raise ValueError(f"--grpc-port {args.grpc_port} is the HTTP --port too; give gRPC "
                             "a port of its own")
        if args.processes < 1:
            raise ValueError(f"--processes {args.processes}; expected 1 or more")
        if not shared_memory_on(args):  # "auto" resolved here, once, for every process
            args.shared_memory = "off"
        if args.processes > 1:
            from paraloom.serving.processes import run_processes

            return run_processes(args, run)
        app, model_file = _build_app(args)
    except (OSError, ValueError, TypeError, KeyError, ImportError, AttributeError) as e:
        print(f"paraloom serve: error: {e}", file=sys.stderr)
        return 2
    repository = _repository(app)
    if (model_file is not None or repository.source is not None) and hasattr(signal, "SIGHUP"):
        _reload_on_sighup(app)  # a model served from Python code has no file to read again
    repository.refuse_loads = getattr(args, "refuse_loads", None)
    SERVER_LOG.refuse_changes = getattr(args, "refuse_log_changes", None)
    _log_models(repository)
    try:
        serve(app, host=args.host, port=args.port, log_level=args.log_level,
              access_log=args.access_log, graceful_timeout=args.graceful_timeout,
              grpc_port=args.grpc_port, grpc_backend=args.grpc_backend,
              switch_interval=args.gil_switch_ms / 1e3,
              reuse_port=getattr(args, "reuse_port", False), uvicorn_logging=False)
    except (OSError, ValueError) as e:  # e.g. a port is taken: nothing was served
        close_owned_pools(app)
        print(f"paraloom serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it stopped on, once shut down
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m paraloom.serving.cli``: the same as ``paraloom serve``."""
    parser = argparse.ArgumentParser(prog="paraloom serve", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
