"""Shared helpers: run ``ptdp train`` as real processes, and spawn ranks for unit tests."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import torch.multiprocessing as mp

# A tiny GPT that every layout in the tests can split: 4 layers, 4 heads, dropout off. Four microbatches an
# iteration at d = 1 (two at d = 2, one at d = 4): a tensor-parallel microbatch is ~20 gloo all-reduces of ~1 ms
# each on two cores, so the microbatch count sets most of a layout's time; schedules that need more (DualPipeV
# at p = 4) raise --global-batch-size themselves.
MICRO_BATCH, GLOBAL_BATCH = 2, 8
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", "3",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--log-interval", "1"]

# (t, p, d, v) = (2, 2, 2, 2) with the interleaved schedule, on 8 processes: every parallelism at once.
LAYOUT_2222 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--virtual-pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved"]


FAULTS = Path(__file__).resolve().parent / "faults"  # sitecustomize.py: PTDP_TEST_* fault and bug injection


def worker_env() -> dict[str, str]:
    """The environment of every process a test starts: one thread each, unbuffered output, and
    tests/faults on PYTHONPATH (its sitecustomize patches nothing unless a PTDP_TEST_* variable is set)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULTS), env.get("PYTHONPATH")) if p)
    return env


def start_command(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start ``command`` in a session of its own (its process group is what a timeout kills, and what a
    test signals as a terminal's Ctrl-C would), text stdout and stderr piped."""
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def finish_command(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for ``proc``; on timeout kill its whole process group (the launcher's workers too, so a hung
    run leaves nothing behind) and fail the test."""
    with proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_command(command: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``command`` to completion (see :func:`finish_command`)."""
    return finish_command(start_command(command, env), timeout)


def run_ptdp(args: list[str], timeout: float = 240, check: bool = True,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m ptdp ARGS`` to completion (never hangs: a timeout fails the test)."""
    proc = run_command([sys.executable, "-m", "ptdp", *args], timeout, {**worker_env(), **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"ptdp {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def refused_in_process(args: list[str], capsys) -> subprocess.CompletedProcess:
    """``ptdp ARGS`` in the test's own process, for a command refused before any training or worker
    starts: its exit code and output as :func:`run_ptdp` gives them, without starting Python and torch
    again (~4 s of CPU). An exception, a traceback in a real process, fails the test."""
    from ptdp.cli.main import main as ptdp_main

    capsys.readouterr()
    try:
        code = ptdp_main(args)
    except SystemExit as e:  # the argument parser's refusal: the exit status a process would have
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


# Flags that need a process of their own: the launcher's (acted on by ``ptdp train`` before ``train()``),
# and torch.compile (dynamo's caches and recompile limit outlive a run: a later compile in the same process
# could fall back to eager unseen).
_OWN_PROCESS_FLAGS = {"--nproc-per-node", "--nnodes", "--max-restarts", "--rdzv-endpoint", "--rdzv-id",
                      "--rdzv-conf", "--monitor-interval", "--cpu-mmap-threshold", "--elastic", "--compile"}


def tiny_hf_llama_and_ours(vocab: int, max_positions: int) -> tuple:
    """A random 2-layer HF Llama (seed 0, GQA, untied) and ptdp's GPTModel holding its weights, with the
    model-parallel RNG the model needs set up: (hf, ours, ours' ModelConfig)."""
    import torch
    import transformers

    from ptdp.models import GPTModel
    from ptdp.models.llama.hf import from_hf_state, model_config_from_hf
    from ptdp.parallel.tensor.random import MODEL_PARALLEL_RNG, get_rng_tracker

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, rms_norm_eps=1e-6, initializer_range=0.1,
        tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf = transformers.LlamaForCausalLM(config).float()
    cfg = model_config_from_hf(hf.config.to_dict())
    tracker = get_rng_tracker()
    if MODEL_PARALLEL_RNG not in tracker.states:
        tracker.add(MODEL_PARALLEL_RNG, 1234)
    ours = GPTModel(cfg, vocab, vocab)
    ours.load_state_dict(from_hf_state(hf.state_dict(), cfg))
    return hf, ours, cfg


def short_documents(directory: Path, count: int, longest: int = 12) -> list[str]:
    """A byte-level corpus in ``directory`` of ``count`` random lowercase documents of 1 to ``longest`` tokens
    (each ending with its EOD; seed 0): a few documents per short sample, for the packing comparisons.
    Returns its data flags (the byte tokenizer, all of it for training)."""
    import numpy as np

    from ptdp.data import ByteTokenizer, IndexedDatasetWriter

    prefix = str(directory / "docs")
    rng = np.random.default_rng(0)
    writer = IndexedDatasetWriter(prefix, ByteTokenizer.vocab_size)
    for _ in range(count):
        writer.add_document([*rng.integers(97, 123, int(rng.integers(0, longest))), ByteTokenizer.eod_id])
    writer.finalize()
    return ["--data-path", prefix, "--tokenizer-type", "ByteTokenizer", "--split", "1,0,0"]


def save_with_norms_off_init(model, directory: Path):
    """Move a random HF model's norm weights off their initial value (so that a norm read wrongly, or HF's
    1 + w against w, shows in the logits), then save it in fp32 as safetensors; the model, in eval mode."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    model.float().eval()
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


def config_errors(world: int, **overrides) -> list[str]:
    """``validate`` of the default configuration with ``overrides`` (field name: value) set in whichever
    sections hold those fields, for ``world`` processes: the one-line errors a flag combination gets."""
    from ptdp.config import Config, validate

    config = Config()
    for section in config.sections().values():
        for key, value in overrides.items():
            if hasattr(section, key):
                setattr(section, key, value)
    return validate(config, world)


def _in_pool(nproc: int, extra: list[str], base: list[str], env: dict[str, str] | None) -> bool:
    return (nproc <= _RankPool.SIZE and env is None
            and not _OWN_PROCESS_FLAGS.intersection(a.split("=")[0] for a in [*base, *extra]))


def train_metrics(tmp_path: Path, nproc: int, extra: list[str], base: list[str] = TINY,
                  env: dict[str, str] | None = None) -> list[dict]:
    """Train with ``nproc`` workers (1 = a plain single process) and return the metrics records.

    A run without an extra environment, launcher or compile flag trains in ranks of the session's pool
    (:func:`run_layouts`): the same ``train()`` that ``ptdp train`` (and each worker of its launcher) runs,
    without starting Python and torch once more in the launcher and every worker (about 3 s of CPU each,
    ten times the tiny run itself). Tests of the command line itself (its messages, exit codes, signals,
    launcher) call :func:`run_ptdp`."""
    if _in_pool(nproc, extra, base, env):
        name = f"run-{os.urandom(4).hex()}"
        return run_layouts(tmp_path / name, {name: (nproc, extra)}, base, save=False)[name].records
    metrics = tmp_path / f"metrics-{os.urandom(4).hex()}.jsonl"
    launch = [] if nproc == 1 else ["--nproc-per-node", str(nproc)]
    run_ptdp(["train", *base, *extra, *launch, "--metrics-file", str(metrics)], env=env)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def track(records: list[dict]) -> list[tuple[float, float]]:
    """(loss, gradient norm) per record: what a bit-for-bit comparison of two runs compares."""
    return [(r["loss"], r["grad_norm"]) for r in records]


# -- equivalence: per iteration the loss and the gradient norm, at the end the weights ---------------------

@dataclass
class Run:
    """One training run: its metrics records and the checkpoint it saved at the end (for its weights)."""

    records: list[dict]
    ckpt: Path | None = None

    @property
    def losses(self) -> list[float]:
        return losses(self.records)

    @functools.cached_property
    def _state(self) -> tuple[dict, dict]:
        from ptdp.checkpointing import read_full_model_state

        assert self.ckpt is not None, "this run saved no checkpoint: run it with save=True"
        return read_full_model_state(self.ckpt)

    @property
    def weights(self) -> dict:
        """The full (unsharded) model's weights at the end of the run, by logical name."""
        return self._state[0]

    @functools.cached_property
    def initial(self) -> dict:
        """The full model's weights before training (every layout initialises them identically)."""
        return initial_full_state(*self._state)


def train_run(tmp_path: Path, nproc: int, extra: list[str], base: list[str] = TINY,
              env: dict[str, str] | None = None, save: bool = True) -> Run:
    """Train like :func:`train_metrics`; with ``save`` (unless ``extra`` saves already) the run also saves
    its final checkpoint, so that its weights can be compared (saving changes nothing in training)."""
    if _in_pool(nproc, extra, base, env):
        name = f"run-{os.urandom(4).hex()}"
        return run_layouts(tmp_path / name, {name: (nproc, extra)}, base, save=save)[name]
    ckpt = None
    if "--save" in extra:
        ckpt = Path(extra[extra.index("--save") + 1])
    elif save:
        ckpt = tmp_path / f"ckpt-{os.urandom(4).hex()}"
        extra = [*extra, "--save", str(ckpt)]
    return Run(train_metrics(tmp_path, nproc, extra, base=base, env=env), ckpt)


def _records(run: Run | list[dict]) -> list[dict]:
    return run.records if isinstance(run, Run) else run


def assert_same_run(got: Run | list[dict], reference: Run | list[dict], rtol: float = 1e-4) -> None:
    """Per iteration ``got`` logged, the loss AND the gradient norm are the reference's (matched by
    iteration number, so a resumed run compares with the reference's later iterations).

    Losses alone are not enough: Adam is invariant to the scale of the gradient, so a wrong data-parallel
    averaging factor trains the same model and logs the same losses, but not the same gradient norm.
    """
    want = {r["iteration"]: r for r in _records(reference)}
    have = _records(got)
    assert have, "no iterations logged: the comparison would be vacuous"
    problems = []
    for r in have:
        ref = want.get(r["iteration"])
        assert ref is not None, f"iteration {r['iteration']} is not in the reference (it has {sorted(want)})"
        for key in ("loss", "grad_norm"):
            a, b = r[key], ref[key]
            if not abs(a - b) <= rtol * abs(b):
                problems.append(f"iteration {r['iteration']}: {key} {a!r}, one process {b!r} "
                                f"(relative {abs(a - b) / abs(b):.2e} > {rtol:.0e})")
    assert not problems, "\n".join(problems)


def assert_same_weights(got: Run, reference: Run, rel: float = 1e-3) -> None:
    """The final weights of ``got`` are the reference's, up to fp32 reduction order (see
    :func:`assert_same_training`; the yardstick is the reference's update from the initial weights)."""
    assert_same_training(got.weights, reference.weights, reference.initial, rel=rel)


def assert_equivalent(got: Run, reference: Run, rtol: float = 1e-4) -> None:
    """Same loss and gradient norm every iteration, same weights at the end (when both saved them)."""
    assert_same_run(got, reference, rtol)
    if got.ckpt is not None and reference.ckpt is not None:
        assert_same_weights(got, reference)


_JOB = ""  # the rendezvous of the job this process runs (:func:`_entry`): its stages join under names from it
_CLIENTS: dict[tuple[str, int], object] = {}  # this process's connections to the pool's TCP store


def _join(rendezvous: str, rank: int, world_size: int) -> None:
    """Join a gloo group of ``world_size`` through ``rendezvous``: ``tcp:HOST:PORT:PREFIX`` (a name in the
    pool's TCP store) or a file path (a file:// rendezvous)."""
    import torch.distributed as dist

    if not rendezvous.startswith("tcp:"):
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
        return
    host, port, prefix = rendezvous.removeprefix("tcp:").split(":", 2)
    key = (host, int(port))
    if key not in _CLIENTS:
        _CLIENTS[key] = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, _CLIENTS[key]), rank=rank, world_size=world_size)


def _entry(rank: int, fn, world_size: int, store: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    global _JOB
    # One thread, as `ptdp train`'s launcher gives each rank: torch was imported before this line, so the
    # variable alone would not reach it, and another thread count sums in another order (other bits).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    _JOB = store
    _join(store, rank, world_size)
    # A rank returns from gloo's connectFullMesh when its own pairs are up, not everyone's: a rank that
    # destroyed the group at once could close a socket a slower peer is still handshaking on.
    dist.barrier()
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # likewise at the end: a rank done with its last send must not close it under a receiver
    finally:
        dist.destroy_process_group()


def _spawned_entry(rank: int, fn, world_size: int, store: str, args: tuple) -> None:
    from ptdp.runtime.exit import exit_now

    _entry(rank, fn, world_size, store, args)
    exit_now(0)  # not through the interpreter's teardown, which gloo's threads can abort (ptdp/runtime/exit.py)


def spawn(fn, world_size: int, tmp_path: Path, *args, timeout: float = 300) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` real gloo processes (file:// rendezvous)."""
    store = tmp_path / f"store-{os.urandom(4).hex()}"
    ctx = mp.start_processes(_spawned_entry, args=(fn, world_size, str(store), args), nprocs=world_size,
                             join=False, start_method="spawn")
    for _ in range(int(timeout / 0.5)):  # a ceiling: a hung collective fails the test instead of blocking CI
        if ctx.join(timeout=0.5):
            return
    for p in ctx.processes:
        p.kill()
    raise AssertionError("spawned ranks did not finish in time")


def _run_layouts(rank: int, world_size: int, out: str, plan: list[tuple[str, int, list[str]]],
                 before_stage: Callable[[int, str, str], None] | None = None) -> None:
    """Each stage on the first ``world`` ranks with a fresh gloo group, through the ``train()`` that
    ``ptdp train`` runs (the other ranks wait for the next stage). ``before_stage(rank, out, name)``, a
    picklable hook, runs on every rank before each stage (to record or to inject a fault, tests/data/test_data_mix.py)."""
    import torch.distributed as dist

    from ptdp.cli.main import build_parser
    from ptdp.config import config_from_args, derive, validate
    from ptdp.train.loop import train

    for name, world, argv in plan:
        if before_stage is not None:
            before_stage(rank, out, name)
        dist.barrier()  # every rank's connections are up before any tears the group down (see _entry)
        dist.destroy_process_group()
        if rank < world:
            if world > 1:
                _join(f"{_JOB}-{name}", rank, world)
            environ, handlers = dict(os.environ), {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
            _forget_earlier_runs()
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(world))
            try:
                config = config_from_args(build_parser().parse_args(["train", *argv]))
                errors = validate(config, world)
                assert not errors, (name, errors)
                train(derive(config))
            finally:  # the next stage starts from the process as it was: its environment, its signal handlers
                os.environ.clear()
                os.environ.update(environ)
                for signum, handler in handlers.items():
                    signal.signal(signum, handler)
            if world > 1:
                dist.destroy_process_group()
        # back into the whole world, so that the next stage (and the spawn helper) find a default group
        _join(f"{_JOB}-{name}-all", rank, world_size)
        dist.barrier()  # all connected before any rank returns (and _entry destroys the group) after the last


def _forget_earlier_runs() -> None:
    """What a run in a rank of the pool could find left by an earlier run of the same process, and a fresh
    ``ptdp train`` process would not: ptdp's per-process caches and records (tests/codebase/test_pool_state.py lists
    every module-level one of ptdp and says why the others are safe). The RNGs are seeded by ``train()``."""
    from ptdp.checkpointing import storage
    from ptdp.data import mix_state
    from ptdp.optim import memory

    storage._VERIFIED.clear()  # a checkpoint hashed once is not hashed again: a later corruption went unseen
    mix_state._IDENTITIES.clear()
    memory._lifetime_peak.update(rss=0, cuda=0)  # the run's peak memory, not the process's
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # VmHWM := VmRSS, as memory.window_peak_bytes does
    except OSError:
        pass


def _environment() -> dict[str, str]:
    """The environment a rank started now would get (pytest's per-test variable aside)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


class _RankPool:
    """Ranks started once per test session (each when a call first needs it) and reused by every
    :func:`run_layouts`: on two cores, starting Python and torch in 8 processes costs more than training the
    tiny model in every layout of a module, and a session has a dozen such modules. A rank runs one
    ``_entry`` at a time (a fresh gloo group each); the trainings in it already share processes stage after
    stage, as ``run_layouts`` always did. Any failure or timeout kills the whole pool (a rank may be stuck in
    a collective) and the next call starts a new one."""

    SIZE = 8  # the largest layout of the tests: (t, p, d, v) = (2, 2, 2, 2)

    def __init__(self) -> None:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the ranks before they import torch
        self.environment = _environment()  # what the ranks inherit (pooled_spawn restarts them on a change)
        self.ctx = mp.get_context("spawn")
        # The ranks' rendezvous: a TCP store served by this process on a port the OS picks, where a file
        # store per stage polls its waits every 10 ms: the 26 groups of a stage of 8 ranks are created in
        # 0.11 s instead of 0.27 s (BENCHMARKS.md, "Test-suite time").
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.outbox = self.ctx.SimpleQueue()
        self.inboxes: list = []
        self.procs: list = []

    def _grow(self, world_size: int) -> None:
        """Start the ranks a call needs that are not running yet: a session whose tests train on two ranks
        at most never starts eight."""
        import pool_rank

        while len(self.procs) < world_size:
            rank, inbox = len(self.procs), self.ctx.SimpleQueue()
            proc = self.ctx.Process(target=pool_rank.serve, args=(rank, inbox, self.outbox), daemon=True)
            proc.start()
            self.inboxes.append(inbox)
            self.procs.append(proc)

    def run(self, fn, world_size: int, store: str, args: tuple, timeout: float) -> None:
        self._grow(world_size)
        for rank in range(world_size):
            self.inboxes[rank].put((fn, world_size, store, args))
        pending, deadline = set(range(world_size)), time.monotonic() + timeout
        while pending:
            while self.outbox.empty():
                dead = [r for r in pending if not self.procs[r].is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    raise AssertionError(f"rank(s) {dead} died" if dead else "spawned ranks did not finish in time")
                time.sleep(0.05)
            rank, error = self.outbox.get()
            pending.discard(rank)
            if error is not None:
                self.close()
                raise AssertionError(f"rank {rank} failed:\n{error}")

    def close(self) -> None:
        global _POOL
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.join()
        _POOL = None


_POOL: _RankPool | None = None


def pooled_spawn(fn, world_size: int, tmp_path: Path, *args, timeout: float = 300) -> None:
    """:func:`spawn` on the session's reused ranks (for functions that leave nothing behind in a process)."""
    global _POOL
    assert world_size <= _RankPool.SIZE, world_size
    if _POOL is not None and _POOL.environment != _environment():  # a test set a variable: as a new process
        _POOL.close()
    if _POOL is None:
        _POOL = _RankPool()
    _POOL.run(fn, world_size, f"tcp:127.0.0.1:{_POOL.store.port}:{os.urandom(8).hex()}", args, timeout)


def run_layouts(tmp_path: Path, plan: dict[str, tuple[int, list[str]]], base: list[str] = TINY,
                save: bool | Collection[str] = True) -> dict[str, Run]:
    """Train every ``name: (world size, flags)`` of ``plan``, in order, inside ONE spawn of as many processes
    as the largest needs: on two cores, starting Python and torch in 8 processes costs several times what
    training the tiny model does, so a module's layouts share one start (the session's pool of ranks). With
    ``save`` each run saves its final checkpoint (unless its flags save elsewhere) for its weights; ``save``
    as a collection of names: only those runs do (a save is about a third of a tiny stage's CPU, so modules
    that compare weights for some runs only list those). A failure in one fails them all."""
    if not isinstance(save, bool):
        unknown = set(save) - set(plan)
        assert not unknown, f"save names runs the plan does not have: {sorted(unknown)}"
    tmp_path.mkdir(parents=True, exist_ok=True)
    stages, runs = [], {}
    for name, (world, flags) in plan.items():
        metrics = tmp_path / f"{name}.jsonl"
        argv = [*base, *flags, "--metrics-file", str(metrics)]
        ckpt = None
        if "--save" in flags:
            ckpt = Path(flags[flags.index("--save") + 1])
        elif save if isinstance(save, bool) else name in save:
            ckpt = tmp_path / f"{name}-ckpt"
            argv += ["--save", str(ckpt)]
        stages.append((name, world, argv))
        runs[name] = (metrics, ckpt)
    # The ceiling only catches hangs: a few seconds a stage on an idle machine, far more on a loaded one.
    pooled_spawn(_run_layouts, max(world for _, world, _ in stages), tmp_path, str(tmp_path), stages,
                 timeout=300 + 120 * len(stages))
    return {name: Run([json.loads(line) for line in metrics.read_text().splitlines()], ckpt)
            for name, (metrics, ckpt) in runs.items()}


def assert_same_training(got: dict, expected: dict, initial: dict, rel: float = 1e-3) -> None:
    """Weights trained in two layouts are the same model, up to fp32 reduction order.

    Elementwise rtol/atol is the wrong yardstick for trained weights: another layout sums gradients in
    another order, and Adam divides by sqrt(v), so a weight whose gradient nearly cancels can move by a
    sizeable fraction of one step in one layout and not the other, and a weight near zero then fails any
    relative test (seen on a fresh machine: 2.3e-6 on a weight of 7e-3). What must agree is what training
    did: per tensor, the difference between the layouts is at most ``rel`` of the update ``expected -
    initial`` (observed: <= 3e-5), and no single weight differs by more than a tenth of the largest
    single-weight update. A resharding bug (a permuted or misplaced shard) moves weights by their own
    size (std 0.02, ~100x the update) and a training bug (a lost gradient reduction, a wrong scale) moves
    the update itself by O(1): both fail loudly.
    """
    assert got.keys() == expected.keys() == initial.keys(), (got.keys() ^ expected.keys())
    moved = 0.0
    for name, want in expected.items():
        want, have, start = (t.detach().double() for t in (want, got[name], initial[name]))
        assert have.shape == want.shape == start.shape, name
        update = want - start
        diff = have - want
        moved = max(moved, update.abs().max().item())
        assert diff.norm() <= rel * update.norm() + 1e-12, (
            f"{name}: layouts differ by {diff.norm():.3e}, the update is {update.norm():.3e}")
        assert diff.abs().max() <= 0.1 * update.abs().max() + 1e-12, (
            f"{name}: one weight differs by {diff.abs().max():.3e}, the largest update is {update.abs().max():.3e}")
    assert moved > 0, "nothing was trained: the comparison would be vacuous"


def initial_full_state(tensors: dict, config: dict) -> dict:
    """The full model's initial weights for a checkpoint's config (``read_full_model_state`` form):
    ptdp initialises every layout identically, from (seed, logical name)."""
    import torch

    from ptdp.hf.convert import full_model_from_state
    from ptdp.parallel.init import init_parameters

    model = full_model_from_state(tensors, config)
    with torch.no_grad():
        init_parameters(model, config.get("training", {}).get("seed", 1234), model.cfg.init_method_std,
                        model.cfg.num_layers)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def validated_config(args: list[str]):
    """The ``Config`` of ``ptdp train`` flags, checked as at start-up (one process)."""
    import argparse

    from ptdp.config import add_config_arguments, config_from_args, derive, validate

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    config = config_from_args(parser.parse_args(args))
    assert not validate(config, 1)
    return derive(config)


# -- Hugging Face comparisons: import, export, and training against transformers + torch.optim -------------

def hf_import(tmp_path: Path, directory: Path, name: str = "ckpt"):
    """Import the HF model saved in ``directory`` into ``tmp_path / name``: (the full ptdp model, its tensors,
    its config) as read back from the checkpoint."""
    from ptdp.checkpointing import read_full_model_state
    from ptdp.hf.convert import full_model_from_state, import_hf

    import_hf(directory, tmp_path / name)
    tensors, config = read_full_model_state(tmp_path / name)
    return full_model_from_state(tensors, config), tensors, config


def assert_export_equals_hf_files(ckpt: Path, out: Path, hf_directory: Path) -> dict:
    """``ptdp export --format hf`` of ``ckpt`` into ``out`` writes the tensors of ``hf_directory`` bit for bit,
    under the same names; the exported ``config.json`` is returned."""
    import torch
    from safetensors import torch as safetensors_torch

    from ptdp.hf.convert import export_hf

    export_hf(ckpt, out)
    original = safetensors_torch.load_file(str(hf_directory / "model.safetensors"))
    exported = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    return json.loads((out / "config.json").read_text())


GREEDY_PROMPT = [5, 17, 42, 99, 7]  # the prompt the generation checks decode from


def assert_reload_equals_hf(out: Path, tokens, expected, atol: float = 0.0, ours=None, new_tokens: int = 10):
    """The export in ``out`` loads back in ``transformers`` (``AutoModelForCausalLM``) and gives ``expected``
    logits for ``tokens`` (within ``atol``); with ``ours`` (the imported ptdp model) greedy decoding of
    ``GREEDY_PROMPT`` gives the same ``new_tokens`` tokens in ``ptdp generate`` as in HF's ``generate``.
    Returns the reloaded model."""
    import torch
    import transformers

    from ptdp.cli.generate import generate

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=0, atol=atol)
        if ours is not None:
            hf_ids = reloaded.generate(torch.tensor([GREEDY_PROMPT]), max_new_tokens=new_tokens, do_sample=False,
                                       min_new_tokens=new_tokens)
    if ours is not None:
        assert generate(ours, None, GREEDY_PROMPT, new_tokens, greedy=True) == hf_ids[0, len(GREEDY_PROMPT):].tolist()
    return reloaded


def next_token_loss(logits, tokens, vocab: int):
    """The mean cross-entropy of ``logits`` (cut to the ``vocab`` real ids: ptdp pads the vocabulary) against
    ``tokens``, position by position."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[..., :vocab].flatten(0, 1).float(), tokens.flatten())


def assert_one_adamw_step_alike(hf, ours, tokens, vocab: int) -> None:
    """One ``torch.optim.AdamW`` step on each model over ``tokens``: the loss after it is HF's (AdamW is
    elementwise, so the layouts' rearrangements of the tensors do not matter), and the step changed it."""
    import torch

    def loss(model):
        logits = model(tokens).logits if model is hf else model(tokens)
        return next_token_loss(logits[:, :-1], tokens[:, 1:], vocab)

    with torch.no_grad():
        before = loss(hf)
    ours.train()
    for model in (hf, ours):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        loss(model).backward()
        optimizer.step()
    ours.eval()
    with torch.no_grad():
        after_hf, after_ours = loss(hf), loss(ours)
    assert not torch.isclose(after_hf, before)  # the step changed the model
    torch.testing.assert_close(after_ours, after_hf, rtol=1e-5, atol=1e-5)


def train_batches(args: list[str], iterations: int, global_batch: int) -> list:
    """The global batches ``ptdp train`` reads with these flags: Megatron's sample order, ``seq + 1`` ids."""
    import torch

    from ptdp.data.training_data import datasets_for_config

    stream = datasets_for_config(validated_config(args)).train
    return [torch.stack([torch.from_numpy(stream[i].astype("int64"))
                         for i in range(k * global_batch, (k + 1) * global_batch)]) for k in range(iterations)]


def hf_adamw_track(hf, batches: list, lr: float, vocab: int) -> list[tuple[float, float]]:
    """(loss, gradient norm) per iteration of HF's model under ``torch.optim.AdamW`` with the settings the
    comparisons train ptdp with: ``lr`` constant, no weight decay, the global norm clipped to 1."""
    import torch

    hf.train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.0)
    out = []
    for batch in batches:
        optimizer.zero_grad()
        loss = next_token_loss(hf(batch[:, :-1]).logits, batch[:, 1:], vocab)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimizer.step()
        out.append((loss.item(), norm.item()))
    return out


HF_ITERATIONS, HF_GLOBAL_BATCH = 3, 8  # what the HF comparisons' training flags ask for


def hf_train_flags(seq_length: int, lr: float) -> list[str]:
    """The training of the HF comparisons (the flags ``hf_adamw_track`` mirrors): ``HF_ITERATIONS`` iterations
    of ``HF_GLOBAL_BATCH`` samples in micro-batches of 2, ``lr`` constant, no weight decay, dropout off."""
    return ["--micro-batch-size", "2", "--global-batch-size", str(HF_GLOBAL_BATCH), "--train-iters",
            str(HF_ITERATIONS), "--lr", str(lr), "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
            "--weight-decay", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--seq-length",
            str(seq_length), "--log-interval", "1"]


def hf_layout_training(tmp: Path, hf, layouts: dict[str, tuple[int, list[str]]], vocab: int, seq_length: int,
                       lr: float = 1e-2) -> tuple[dict[str, Run], list[tuple[float, float]], dict]:
    """The HF comparison of a model family: the HF model ``hf`` (saved in ``tmp / "hf"``) imported, ``ptdp
    train`` in one process ("one") and in every layout of ``layouts`` (``name: (world size, flags)``, one pool
    of ranks) from that checkpoint with ``hf_train_flags``, and HF's own training on the same batches.

    Returns (the runs by name, HF's (loss, gradient norm) per iteration, HF's weights before training)."""
    import shlex

    from ptdp.hf.convert import import_hf_model, train_flags

    _, cfg, moe = import_hf_model(tmp / "hf", tmp / "imported")
    base = [*shlex.split(train_flags(cfg, moe)), "--vocab-size", str(vocab), *hf_train_flags(seq_length, lr)]
    plan = {"one": (1, ["--load", str(tmp / "imported")])}
    plan.update({name: (world, ["--load", str(tmp / "imported"), *flags]) for name, (world, flags) in layouts.items()})
    initial = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    runs = run_layouts(tmp, plan, base=base)
    return runs, hf_adamw_track(hf, train_batches(base, HF_ITERATIONS, HF_GLOBAL_BATCH), lr, vocab), initial


def assert_hf_track(run: Run, hf_track: list[tuple[float, float]]) -> None:
    """``run``'s loss and gradient norm per iteration are HF's, and HF's model trained (the comparison bites)."""
    import pytest

    got = track(run.records)
    assert len(got) == len(hf_track) == HF_ITERATIONS
    for (loss, norm), (want_loss, want_norm) in zip(got, hf_track, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-4), (got, hf_track)
        assert norm == pytest.approx(want_norm, rel=1e-3), (got, hf_track)
    assert hf_track[0][0] != pytest.approx(hf_track[-1][0], rel=1e-3)


def assert_weights_equal_hf(run: Run, hf, initial: dict, rel: float = 1e-3) -> None:
    """``run``'s final weights are HF's after its training (``assert_same_training``, read through the
    family's own HF reader; ptdp's padding rows of the vocabulary left out)."""
    from ptdp.models.families import family_for_hf

    family = family_for_hf(hf.config.model_type)
    _, _, want = family.read(hf.config.to_dict(), {k: v.detach() for k, v in hf.state_dict().items()})
    _, _, start = family.read(hf.config.to_dict(), initial)
    got = {name: run.weights[name][:value.shape[0]] for name, value in want.items()}
    assert_same_training(got, want, start, rel=rel)


def hf_family_tests(name: str, hf_model: Callable, layouts: dict, vocab: int, seq_length: int, *,
                    kinds: list[str] | None = None, lr: float = 1e-2, rel: float = 1e-3) -> tuple:
    """The training comparison every model family's test module makes, as (its module-scoped ``trained``
    fixture, its one-process test, its per-layout test), for the module to bind under those names::

        (trained, test_one_process_equals_hf_and_adamw_per_iteration_and_in_its_weights,
         test_layout_equals_hf_and_adamw_per_iteration) = hf_family_tests("gemma3", hf_model, LAYOUTS, V, S)

    ``hf_model(directory)`` saves a random HF model there and returns it; ``layouts``: ``name: (world size,
    flags)``, trained in one pool with one process (``hf_layout_training``). With ``kinds`` the module holds
    several models: ``hf_model(directory, kind)``, ``layouts`` per kind (a kind may have none), and each test
    runs per kind, each layout test for the kinds that have the layout. The one-process run also ends in HF's
    weights (``rel``: ``assert_weights_equal_hf``)."""
    import pytest

    @pytest.fixture(scope="module", name="trained")
    def trained(tmp_path_factory):
        """Per model kind, at its first test: one process and every layout from one imported checkpoint, and
        HF's training on the same batches."""
        done: dict = {}

        def of(kind: str | None) -> tuple:
            if kind not in done:
                tmp = tmp_path_factory.mktemp(name if kind is None else f"{name}-{kind}")
                hf = hf_model(tmp / "hf") if kind is None else hf_model(tmp / "hf", kind)
                runs, track, initial = hf_layout_training(tmp, hf, layouts if kind is None else layouts.get(kind, {}),
                                                          vocab, seq_length, lr=lr)
                done[kind] = runs, track, hf, initial
            return done[kind]

        return of

    def one_process(runs: dict, track, hf, initial) -> None:
        assert_hf_track(runs["one"], track)
        assert_weights_equal_hf(runs["one"], hf, initial, rel=rel)

    if kinds:
        @pytest.mark.parametrize("kind", kinds)
        def test_one_process(trained, kind):
            one_process(*trained(kind))
    else:
        def test_one_process(trained):
            one_process(*trained(None))

    cases = [(kind, layout) for kind in (kinds or [None])
             for layout in sorted(layouts if kind is None else layouts.get(kind, {}))]

    @pytest.mark.parametrize("kind, layout", cases, ids=[layout if kind is None else f"{kind}-{layout}"
                                                          for kind, layout in cases])
    def test_layout(trained, kind, layout):
        runs, track, _, _ = trained(kind)
        assert_hf_track(runs[layout], track)

    return trained, test_one_process, test_layout
