"""One training run: AdamW with warm-up and cosine decay, probes every few steps,
checkpoints that a killed run resumes from with the same curve, DDP when several ranks share
the run.

Determinism. A run's numbers are functions of its `RunSpec` alone: the model's initial
weights come from `init_seed`, the batch of step s from (`data_seed`, s) (`corpora`), the
stochastic rounding of step s from (`sr_seed`, s, layer); nothing reads torch's global
random state after initialisation. A checkpoint (every `checkpoint_every` steps, in the
cell's scratch folder) holds the model, the optimizer, the step, the rows logged so far and
torch's random states; resuming from it repeats the uninterrupted run bit for bit on the same
device. Under DDP the global batch is drawn once and rank r takes rows r*b..(r+1)*b of it;
each rank's loss is its sum over its targets divided by the global batch's number of
targets, and the gradients are summed over the ranks (a comm hook in place of DDP's mean), so
the gradient reaching attention (its dO) is the very tensor one process computes: recipes
with fixed scales (fp4-fa4's E5M2(4 dO)) flush the same elements, and the same global batch
gives the same losses as one process up to the rounding of the all-reduce. A recipe with a
scale over a whole tensor (``nvfp4pv``'s V, the E4M3 QKV projections) couples the sequences
of a batch, so its numbers depend on how the batch is split.

Loss scale. An arm with `arms.Arm.loss_scale` s != 1 differentiates s * loss and divides
every parameter's gradient by s before anything reads it (the logged norms, clipping, the
non-finite check, the optimizer, DDP's all-reduce having summed the scaled ones). s is a power
of two, so in unquantized arithmetic the run is bit for bit the unscaled one except where a
value under- or overflows; the quantized attention backward sees dO s times larger. There is
no dynamic scaling: a scaled gradient that overflows makes the step non-finite.

The run stops early, marked diverged, at the first non-finite training loss or gradient
norm (an optimizer step on NaN gradients would only carry NaN on; that step takes none). Its
last step always checkpoints. Before that, rank 0 examines the step (`probes.autopsy`: the
same global batch's forward on the same weights, a row per layer in the ``autopsy`` table):
which layer's attention output first turns non-finite, the logits and log2 P's peak there,
and whether the reference path and exact attention give a finite output on the same q, k, v.

Saved activations. With `activations_rows` > 0, rank 0 ends the run with one forward and
backward of the first `activations_rows` sequences of the first validation batch with the
run's own recipe and backend (`probes.captured_step`, the loss scaled as a training step's,
times the arm's loss scale: the dO saved is the one its backward quantizes) and writes each
layer's q, k, v (after the rotary map) and dO with `fp4lab.analysis.save_inputs` to
``<folder>/<stem>-layer<l>.safetensors``, each file atomically
(`fp4lab.studies.atomic_write`). They are functions of the weights, which a resumed run
repeats bit for bit, so a run killed after writing them and rerun from its last checkpoint
writes the same bytes over them; the temporary files a kill leaves are removed first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from fp4lab.analysis import save_inputs
from fp4lab.studies import atomic_write

from . import probes
from .arms import ARMS
from .corpora import RecallTask, stream_seed, text_corpus
from .gpt import GPT, AttentionCall, GPTConfig

__all__ = ["RunSpec", "train", "after_step", "deterministic_algorithms", "determinism"]

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class RunSpec:
    """Everything one run depends on (the study builds it from its config and the cell)."""

    model: GPTConfig
    task: str  # "text" or "recall"
    arm: str  # a key of arms.ARMS
    steps: int
    batch: int  # global batch (sequences per step, over all ranks)
    lr: float
    min_lr_ratio: float  # the cosine decays to lr * this
    warmup: int  # linear warm-up steps
    weight_decay: float
    beta2: float
    eval_every: int
    val_batches: int
    probe_rows: int  # sequences of the traced probe batch
    checkpoint_every: int
    corpus_bytes: int
    val_fraction: float
    recall_pairs: int
    block: int  # attention tiles
    init_seed: int
    data_seed: int
    sr_seed: int
    activations_rows: int = 0  # validation sequences whose attention inputs are saved; 0: none
    speed_skip: int = 5  # first steps left out of the steady tokens/s


def deterministic_algorithms(on: bool) -> dict:
    """Torch's deterministic algorithms on (cuBLAS's fixed workspace ``:4096:8`` set where
    ``CUBLAS_WORKSPACE_CONFIG`` is unset; an op without a deterministic version warns) or off,
    for this process; the state now (`determinism`). The study calls it on GPUs only, before
    a cell's CUDA work: cuBLAS reads its workspace setting when it starts."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on, warn_only=True)
    return determinism()


def determinism() -> dict:
    """Whether torch's deterministic algorithms are on, and cuBLAS's workspace setting (None:
    unset), as a run's row records them."""
    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


def after_step(step: int) -> None:
    """Called after each step's bookkeeping (the tests replace it to interrupt a run)."""


def learning_rate(spec: RunSpec, step: int) -> float:
    """Linear warm-up to lr over `warmup` steps, then cosine decay to lr * min_lr_ratio."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    floor = spec.lr * spec.min_lr_ratio
    return floor + 0.5 * (spec.lr - floor) * (1 + math.cos(math.pi * min(progress, 1.0)))


def task_of(spec: RunSpec):
    if spec.task == "text":
        return text_corpus(spec.corpus_bytes, spec.val_fraction)
    return RecallTask(pairs=spec.recall_pairs)


def build(spec: RunSpec, device: str) -> tuple[GPT, torch.optim.Optimizer]:
    """The model (initialised from init_seed) and AdamW (decay on matrices only)."""
    arm = ARMS[spec.arm]
    config = GPTConfig(**{**asdict(spec.model), "qkv_format": arm.qkv_format,
                          "qk_norm": arm.qk_norm})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.init_seed)
        model = GPT(config)
    model.to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay},
              {"params": other, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, spec.beta2),
                                    foreach=False)


@dataclass
class Ranks:
    """The ranks sharing this run (rank, world size, the process group DDP reduces over)."""

    rank: int = 0
    world: int = 1
    group: object = None

    def sum(self, value: float) -> float:
        """The sum of `value` over the ranks (over the framework's gloo group)."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    def max(self, values: list[float]) -> list[float]:
        """The elementwise maximum of `values` over the ranks (NaN where any rank has NaN)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        nan = torch.isnan(t).to(torch.float64)
        dist.all_reduce(t.nan_to_num_(nan=-math.inf), op=dist.ReduceOp.MAX)
        dist.all_reduce(nan, op=dist.ReduceOp.MAX)
        return [math.nan if n else float(v) for v, n in zip(t, nan, strict=True)]


def _sum_gradients(group, bucket):
    """A DDP comm hook: the bucket's gradients summed over the ranks (DDP's own averages)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])


_NCCL_GROUP = None


def ranks_for(rank: int, world: int, device: str) -> Ranks:
    """Ranks over the framework's gloo group on the CPU, over an NCCL group on GPUs."""
    global _NCCL_GROUP
    if world == 1:
        return Ranks()
    if device.startswith("cuda") and _NCCL_GROUP is None:
        _NCCL_GROUP = dist.new_group(backend="nccl")
    return Ranks(rank, world, _NCCL_GROUP if device.startswith("cuda") else None)


class Checkpoints:
    """Rank 0 writes `CHECKPOINT` atomically into the cell's scratch folder; every rank reads
    it back. A checkpoint of another run (its spec or world size differ) is refused."""

    def __init__(self, folder: Path | None, spec: RunSpec, ranks: Ranks) -> None:
        self.path = None if folder is None else Path(folder) / CHECKPOINT
        self.key = {"spec": repr(spec), "world": ranks.world}
        self.rank = ranks.rank

    def load(self, device: str) -> dict | None:
        if self.path is None or not self.path.exists():
            return None
        state = torch.load(self.path, map_location=device, weights_only=True)
        if state["key"] != self.key:
            raise ValueError(f"--resume: {self.path} is the checkpoint of another run "
                             f"({state['key']}), not of {self.key}")
        return state

    def save(self, state: dict) -> None:
        if self.path is None or self.rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{CHECKPOINT}.{os.getpid()}.tmp")
        torch.save({**state, "key": self.key}, tmp)
        os.replace(tmp, self.path)


def _autocast(device: str):
    if device.startswith("cuda"):
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def _random_states(device: str) -> dict:
    states = {"cpu": torch.get_rng_state()}
    if device.startswith("cuda"):
        states["cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return states


def _set_random_states(states: dict, device: str) -> None:
    torch.set_rng_state(states["cpu"].cpu())
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"].cpu(), torch.device(device))


class Run:
    """A run in progress: its model, optimizer, data, probes and logged rows."""

    def __init__(self, spec: RunSpec, device: str, backend: str, ranks: Ranks,
                 scratch: Path | None) -> None:
        self.spec, self.device, self.backend, self.ranks = spec, device, backend, ranks
        self.arm = ARMS[spec.arm]
        self.task = task_of(spec)
        self.autocast = _autocast(device)
        self.model, self.optimizer = build(spec, device)
        self.probe_model, _ = build(spec, device)  # probes never touch the training model
        self.trained = self.model
        if ranks.world > 1:
            self.trained = DistributedDataParallel(
                self.model, device_ids=[torch.device(device)] if device.startswith("cuda")
                else None, process_group=ranks.group)
            self.trained.register_comm_hook(ranks.group, _sum_gradients)
        self.checkpoints = Checkpoints(scratch, spec, ranks)
        self.rows = {"metrics": [], "evals": [], "layers": [], "autopsy": []}
        self.step, self.train_seconds, self.nonfinite_step = 0, 0.0, None
        self.val = [self.batch("val", i) for i in range(spec.val_batches)]

    def batch(self, split: str, step: int):
        spec = self.spec
        x, y = self.task.batch(split, spec.data_seed, step, spec.batch, spec.model.seq_len)
        return x.to(self.device), y.to(self.device)

    def local_batch(self, step: int):
        """This rank's rows of the global training batch, and the global number of targets."""
        x, y = self.batch("train", step)
        share = self.spec.batch // self.ranks.world
        rows = slice(self.ranks.rank * share, (self.ranks.rank + 1) * share)
        return x[rows], y[rows], int((y >= 0).sum())

    def call(self, step: int, trace=None) -> AttentionCall:
        recipe = self.arm.recipe
        seed = None
        if recipe is not None and recipe.stochastic:
            seed = stream_seed(self.spec.sr_seed, "sr", step)
        return AttentionCall(recipe, self.backend, self.spec.block, seed, trace,
                             gradient=self.arm.gradient)

    # -- checkpoints ----------------------------------------------------------------------
    def resume(self) -> bool:
        state = self.checkpoints.load(self.device)
        if state is None:
            return False
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.rows = state["step"], {"autopsy": [], **state["rows"]}
        self.train_seconds, self.nonfinite_step = state["train_seconds"], state["nonfinite"]
        _set_random_states(state["random"], self.device)
        return True

    def save(self) -> None:
        self.checkpoints.save({
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "step": self.step, "rows": self.rows, "train_seconds": self.train_seconds,
            "nonfinite": self.nonfinite_step, "random": _random_states(self.device),
        })

    # -- one step ---------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step; the row of per-step numbers."""
        spec, step = self.spec, self.step
        lr = learning_rate(spec, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        x, y, targets = self.local_batch(step)
        scores = {}  # layer -> (2,): its largest logit and log2 P peak, this step
        call = dataclasses.replace(self.call(step), watch=lambda layer, q, k: scores.__setitem__(
            layer, probes.step_scores(q, k, self.arm.recipe)))
        with self.autocast():
            logits = self.trained(x, call)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1,
                                   reduction="sum") / targets
        self._backward(loss)
        norms = self._grad_norms()
        if self.arm.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.arm.grad_clip)
        value = self.ranks.sum(float(loss.detach()))
        if math.isfinite(value) and math.isfinite(norms["grad_norm"]):
            self.optimizer.step()  # never on non-finite gradients (they would only carry on)
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)  # the step's kernels, not their launch
        seconds = time.perf_counter() - start
        self.train_seconds += seconds
        tokens = (step + 1) * spec.batch * spec.model.seq_len
        return {"step": step, "tokens": tokens, "lr": lr, "loss": value, **norms,
                **self._step_scores(scores), "step_seconds": seconds}

    def _step_scores(self, scores: dict) -> dict:
        """Each layer's largest logit and log2 P peak of this step's batch (the maximum over
        the ranks' local batches), `max_logit_<layer>`, `p_log2_peak_<layer>`."""
        layers = range(self.spec.model.n_layer)
        values = self.ranks.max([float(v) for layer in layers for v in scores[layer].cpu()])
        row = {}
        for layer in layers:
            row[f"max_logit_{layer}"], row[f"p_log2_peak_{layer}"] = values[2 * layer:][:2]
        return row

    def _backward(self, loss: torch.Tensor) -> None:
        """The gradients of `loss`; with the arm's loss scale, those of loss * scale divided
        by the scale again, so that everything after (norms, clipping, the non-finite check,
        the optimizer) reads the unscaled gradient: a power of two, both steps are exact where
        nothing under- or overflows, and only the quantized attention backward sees its dO
        scaled."""
        scale = self.arm.loss_scale
        if scale == 1:
            loss.backward()
            return
        (loss * scale).backward()
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(scale)

    def _grad_norms(self) -> dict:
        """The total gradient norm and each attention layer's (before any clipping)."""
        total = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in self.model.parameters()
                               if p.grad is not None))
        row = {"grad_norm": float(total)}
        for layer in range(self.spec.model.n_layer):
            grads = [p.grad for p in self.model.attention_parameters(layer)]
            row[f"attn_grad_norm_{layer}"] = float(torch.sqrt(sum(
                g.double().pow(2).sum() for g in grads)))
        return row

    # -- probes -----------------------------------------------------------------------------
    def probe(self) -> None:
        """(rank 0) The validation loss, the traced step's rows per layer and the leakage."""
        if self.ranks.rank != 0:
            return
        spec, model = self.spec, self.probe_model
        model.load_state_dict(self.model.state_dict())
        call = self.call(-1)  # the probes' own stochastic-rounding draws
        head = {"step": self.step - 1, "tokens": self.step * spec.batch * spec.model.seq_len}
        val = probes.validation_loss(model, self.val, call, self.autocast)
        x, y = (t[: spec.probe_rows] for t in self.val[0])
        leak = probes.leakage(model, x, model.config.vocab_size, call, self.autocast)
        self.rows["evals"].append({**head, "val_loss": val, **leak})
        for row in probes.traced_step(model, x, y, call, self.autocast, spec.batch,
                                      self.arm.loss_scale):
            self.rows["layers"].append({**head, **row})

    def examine(self, step: int) -> None:
        """(rank 0) The autopsy (`probes.autopsy`) of step `step`, whose loss was not finite:
        its whole global batch on the weights that made it (the optimizer skipped the step)."""
        if self.ranks.rank != 0:
            return
        model = self.probe_model
        model.load_state_dict(self.model.state_dict())
        x, y = self.batch("train", step)
        for row in probes.autopsy(model, x, y, self.call(step), self.autocast):
            self.rows["autopsy"].append({"step": step, "world": self.ranks.world, **row})

    def save_activations(self, folder: Path, stem: str) -> list[dict]:
        """(rank 0) Each layer's q, k, v, dO from one forward and backward with the training
        recipe (module docstring), written to <folder>/<stem>-layer<l>.safetensors; a row per
        file."""
        spec, model = self.spec, self.probe_model
        model.load_state_dict(self.model.state_dict())
        x, y = (t[: spec.activations_rows] for t in self.val[0])
        capture = probes.captured_step(model, x, y, self.call(-1), self.autocast, spec.batch,
                                       self.arm.loss_scale)
        recipe = self.arm.recipe.name if self.arm.recipe is not None else "torch SDPA"
        rows = []
        for layer, tensors in enumerate(zip(capture.q, capture.k, capture.v, strict=True)):
            tensors = (*tensors, capture.do[layer])
            path = Path(folder) / f"{stem}-layer{layer}.safetensors"
            for stale in path.parent.glob(f".{path.name}.*.tmp.safetensors"):
                stale.unlink()  # a killed write's
            atomic_write(path, lambda tmp, t=tensors: save_inputs(tmp, *t),
                         suffix=".tmp.safetensors")
            rows.append({
                "layer": layer, "file": f"{path.parent.name}/{path.name}", "recipe": recipe,
                "backend": self.backend if self.arm.recipe is not None else "sdpa",
                "rows": x.shape[0], "loss_scale": self.arm.loss_scale, "after_step": self.step,
                "finite": all(bool(t.isfinite().all()) for t in tensors),
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            })
        return rows

    def finish(self) -> dict:
        """(rank 0) The final validation loss with the training recipe and with exact
        attention on the same weights, and the run's totals."""
        spec, model = self.spec, self.probe_model
        model.load_state_dict(self.model.state_dict())
        exact = AttentionCall(ARMS["exact"].recipe, "reference", spec.block)
        trained = probes.validation_loss(model, self.val, self.call(-1), self.autocast)
        tokens = self.step * spec.batch * spec.model.seq_len
        steps = self.rows["metrics"]
        steady = [r["step_seconds"] for r in (steps[spec.speed_skip:] or steps)]
        return {
            "backend": self.backend if self.arm.recipe is not None else "sdpa",
            "steps_done": self.step, "tokens": tokens, "val_loss": trained,
            "val_loss_exact_attention": probes.validation_loss(model, self.val, exact,
                                                               self.autocast),
            "nonfinite_step": self.nonfinite_step, "train_seconds": self.train_seconds,
            "tokens_per_second": tokens / self.train_seconds if self.train_seconds else None,
            "tokens_per_second_steady": (spec.batch * spec.model.seq_len / statistics.median(
                steady) if steady else None),
            "init_seed": spec.init_seed, "data_seed": spec.data_seed, "sr_seed": spec.sr_seed,
        }


def train(spec: RunSpec, device: str, backend: str, rank: int = 0, world: int = 1,
          scratch: Path | None = None,
          activations: tuple[Path, str] | None = None) -> dict[str, list[dict]]:
    """Run (or resume from `scratch`) the training `spec` describes; its tables of rows:
    ``metrics`` per step, ``evals`` per probe, ``layers`` per probe and layer, ``autopsy``
    per layer at a non-finite step (`Run.examine`), ``runs`` one
    row of totals, and with `spec.activations_rows` > 0 ``activations``, one row per file
    written to `activations` (folder, file stem) (the other ranks return empty tables)."""
    if spec.activations_rows and activations is None:
        raise ValueError("activations: a run with activations_rows > 0 needs the (folder, "
                         "stem) its files go to")
    if spec.batch % world:
        raise ValueError(f"batch ({spec.batch}) must be a multiple of the ranks ({world})")
    run = Run(spec, device, backend, ranks_for(rank, world, device), scratch)
    if not run.resume():
        run.probe()  # the initial model, before any step
    while run.step < spec.steps and run.nonfinite_step is None:
        row = run.train_step()
        run.rows["metrics"].append(row)
        run.step += 1
        if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])):
            run.nonfinite_step = row["step"]
            run.examine(row["step"])
        elif run.step % spec.eval_every == 0 or run.step == spec.steps:
            run.probe()
        if (run.step % spec.checkpoint_every == 0 or run.nonfinite_step is not None
                or run.step == spec.steps):
            run.save()
        after_step(run.step)
    saved = {"activations": []} if spec.activations_rows else {}
    if rank != 0:
        return {"metrics": [], "evals": [], "layers": [], "autopsy": [], "runs": [], **saved}
    if spec.activations_rows:
        saved["activations"] = run.save_activations(*activations)
    return {**run.rows, "runs": [run.finish()], **saved}
