"""pv-divergence: train a small GPT with each P/V recipe, reproduce (or not) the MXFP4 P/V
divergence, and test what causes it and what fixes it.

What. "Hardware-Aware FP4 FlashAttention-4" (MrHuff/fp4-fa4) reports that every training run
with MXFP4 probabilities and values diverged, losses splitting from FP8 P/V and gradient norms
exploding, and lists the cause as unresolved. This study trains a nanoGPT-style model
(`_pv_divergence.gpt`: rotary positions, attention through `fp4lab.attention`, everything
else bf16 on a GPU and float32 on the CPU, so the recipe is the only quantization) on two
tasks built from the Python installation alone (`_pv_divergence.corpora`: byte-level text of
``pydoc_data.topics`` and the standard library's sources, hashed; multi-query associative
recall), once per arm and seed, with the same initial weights and the same data order for
every arm of a seed. The arms (`_pv_divergence.arms`) are the bf16 reference, the published
FP8 P/V route (``fa4fp4_causal``), the published MXFP4 P/V routes (``fa4fp4_causal_mxfp4pv``,
and ``_d64`` as the 1.2B records ran it), and variants that change one thing each to isolate
a cause or test a fix: MXFP4 on P only and on V only, V's scale rounded up (rceil),
stochastic rounding of V, no row correction, P against the running maximum (no anchor),
NVFP4 and UE5M3-scaled P/V, MatX's leakage fix, E4M3 QKV projections as the published runs
had them, gradient clipping, QK-norm, both routes' forwards with the exact gradient of
themselves in place of the FP8 backward, MXFP4 P/V's forward with bf16 attention's gradient
straight through (``mxfp4pv_bf16_grad``: the forward's error without the quantized backward),
and the routes and variants with the loss scaled by 2^13 for the backward (gradients unscaled
before use), which keeps the dO that E5M2(4 dO) flushes at this model's size.

The divergence rule, fixed before any run and computed by the code (`_pv_divergence.report`):
a run diverges at its first non-finite training loss or gradient norm (the norm added after
the first full run, where it moved no run), or at the first step where the mean,
over the last `divergence_window` steps, of its training loss minus the bf16 run's loss on
the same batch (same seed, same task) has exceeded `divergence_margin` for
`divergence_patience` consecutive steps. These are the published 1.2B runs' own drift gate
(window 32, failure threshold 0.15, patience 3; MrHuff/fp4-fa4
``results/causal_isolated_matrix_20260820/training/dolmino_dclm_a319_v3_pre2k_drift_gate_
audit_20260820.json``), so the two are comparable. A run that never meets the rule is "did not
diverge", and the report says how far it went.

What is logged (`_pv_divergence.training`, `_pv_divergence.probes`): per step the training
loss, the gradient norm (total and per attention layer), the learning rate, and each
layer's largest logit and log2 P peak against the recipe's fixed row reference on the step's
own batch (`max_logit_<layer>`, `p_log2_peak_<layer>`: where a row's P^ saturates); every
`eval_every` steps the validation loss, each layer's attention entropy and largest logit, the
trace statistics of P and V from a traced step (`fp4lab.Trace`), each layer's gradient error
against exact attention on the same activations (`fp4lab.compare`), and future leakage (the
change of the logits at positions i < j when token j changes); at the end the validation loss
with the training recipe and with exact attention on the same weights (a model that learned to
use leaked future information shows a gap there).

How it runs. One cell per (task, arm, seed); a cell checkpoints every `checkpoint_every`
steps into its scratch folder and ``--resume`` continues a killed run with the curve an
uninterrupted one has. Under ``torchrun`` the ranks train each cell together with DDP (gloo on
the CPU, NCCL on GPUs; `data_parallel`), the global batch split over them; with
``--set data_parallel=false`` the cells spread over the ranks instead (several small runs
sharing one GPU). ``--preset smoke`` runs on a 2-core CPU in about 30 seconds; ``full`` is
sized for one H200 (bf16, SDPA, FP8 and MXFP4 P/V and thirteen variants, two seeds, each
cell a resumable piece; measured as it is: 16.6 minutes in one process, in calls of 7.2 and
9.4 minutes, 2026-12-01, results/pv-divergence-full-4; _pv_divergence/GPU_PLAN.md has the
commands); ``long`` scales the same runs up. On a
GPU the runs use torch's deterministic algorithms (``deterministic``, on by default;
`PVDivergenceConfig`).

Saved activations. With ``--set activations_rows=N`` (the smoke preset: 2) each run ends
with one forward and backward of N validation sequences with its own recipe and backend and
writes each layer's q, k, v and dO with `fp4lab.analysis.save_inputs` to
``<out>/activations/<task>-<arm>-seed<s>-layer<l>.safetensors`` (rank 0, atomically, the same
bytes when a resumed run rewrites them; `_pv_divergence.training`); the report lists them with
their hashes, and any analytic study reads one: ``fp4lab study run mxfp4-pv-mechanisms --set
inputs=<out>/activations/text-mxfp4pv-seed0-layer3.safetensors``.

Speed. The issue's goal is a training step with ``fa4fp4_causal_mxfp4pv`` on the Triton
backend at no less than 0.4x the tokens/s of bf16 SDPA (the ``sdpa`` arm), measured in the same
run: ``--backend triton --set reference_arms=bf16`` (the committed full run's: the bf16 arm
on the simulation, by name; the kernels now run its bf16 P too) records each run's backend and its
steady tokens/s (the median synchronized step after ``speed_skip`` steps), and the report's
"Time and speed" section gives the ratio and whether the goal is met. Arms with stochastic
rounding run on the kernels too, with the simulation's random bits (`fp4lab.formats.streams`).
``mxfp4pv_bf16_grad`` runs two forwards per layer (MXFP4 P/V's output, bf16's for the
gradient), so its tokens/s is no measure of a kernel. The probes' trace and gradient errors
are always the reference simulation's.

Caveats. The study is small: what it does not reproduce at its scale is reported as such,
never tuned into appearing. At the smoke's sizes the MXFP4 P/V route's dQ error against exact
attention reaches 1 in the later layers (the probes, and mxfp4-pv-mechanisms on a saved file,
whose dQ/dK gap then reads NaN); why is not examined here.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

QUESTION = (
    "Does training a small GPT with MXFP4 P/V diverge where FP8 P/V does not, when, with what "
    "inside attention (P flushed, V clipped, gradient error, leakage), and which single change "
    "to the recipe causes or removes it?"
)


def _parts():
    """The study's package (studies/_pv_divergence), loaded from its path: studies/ is not a
    package, and the framework loads this file by path too."""
    name = "fp4lab_study_pv_divergence_parts"
    if name not in sys.modules:
        folder = Path(__file__).resolve().with_name("_pv_divergence")
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return {part: importlib.import_module(f"{name}.{part}")
            for part in ("arms", "corpora", "gpt", "probes", "training", "report")}


PARTS = _parts()
ARMS, REFERENCE_ARM = PARTS["arms"].ARMS, PARTS["arms"].REFERENCE_ARM
TASKS = ("text", "recall")


@dataclass(frozen=True)
class PVDivergenceConfig:
    """The study's sizes, arms and divergence rule (one field a line, commented below).

    ``deterministic`` (default on): on a GPU, each rank sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
    (where it is unset) and ``torch.use_deterministic_algorithms(True, warn_only=True)``
    before its first cell's CUDA work (`training.deterministic_algorithms`), so that two runs
    with the same seeds give the same numbers: without it two full runs on one H200 parted at
    step 1-2 by about 1e-6 in every arm, torch's SDPA included (atomics in torch's own
    backward kernels, e.g. the embedding's; fp4lab's Triton backward has none). An op without
    a deterministic version warns instead of stopping the run. Torch then also fills new
    memory (``torch.utils.deterministic.fill_uninitialized_memory``), which may cost speed.
    On the CPU it changes nothing. config.json records the field, and each run's row the
    state it ran with (``deterministic_algorithms``, ``cublas_workspace_config``). Not yet
    confirmed on a GPU: neither the equal reruns nor its cost in tokens/s has been measured.
    """

    arms: tuple[str, ...] = ("bf16", "fp8pv", "mxfp4pv")  # arms.ARMS keys; bf16 required
    seeds: tuple[int, ...] = (0, 1)  # model and data seeds (each arm sees the same ones)
    tasks: tuple[str, ...] = ("text",)  # "text" (bytes of Python's docs and sources), "recall"
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads
    n_embd: int = 256  # width; head_dim = n_embd / n_head (a multiple of 16)
    seq_len: int = 512  # tokens per sequence (a multiple of 32)
    batch: int = 16  # global batch, sequences per step (a multiple of the ranks)
    steps: int = 600  # optimizer steps
    lr: float = 2e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine decays to lr * this
    warmup: int = 60  # linear warm-up steps
    weight_decay: float = 0.1  # AdamW's, on matrices
    beta2: float = 0.95  # AdamW's second-moment decay
    eval_every: int = 50  # steps between probes
    val_batches: int = 4  # validation batches (of `batch` sequences) per probe
    probe_rows: int = 2  # sequences of the traced probe batch
    checkpoint_every: int = 100  # steps between checkpoints
    corpus_bytes: int = 16_000_000  # bytes of text taken, in the documents' sorted order
    val_fraction: float = 0.1  # documents in validation (by the hash of their names)
    recall_pairs: int = 32  # key-value pairs per recall sequence
    tile: int = 128  # attention's query and key tiles (a multiple of 32)
    divergence_margin: float = 0.15  # nats of rolling loss gap over bf16 (published gate)
    divergence_window: int = 32  # steps of the rolling mean (published gate)
    divergence_patience: int = 3  # consecutive steps above the margin (published gate)
    split_margin: float = 0.08  # nats: where the loss "splits" (the published warning)
    data_parallel: bool = True  # under torchrun: ranks train each cell together (DDP)
    activations_rows: int = 0  # >0: each run saves its attention inputs of this many rows
    reference_arms: tuple[str, ...] = ()  # arms on --backend reference whatever --backend is
    speed_skip: int = 5  # first steps out of the steady tokens/s (compiling; all if fewer)
    deterministic: bool = True  # on a GPU: torch's deterministic algorithms (see above)

    def __post_init__(self) -> None:
        self._check_lists()
        for name in ("n_layer", "n_head", "n_embd", "seq_len", "batch", "steps", "warmup",
                     "eval_every", "val_batches", "probe_rows", "checkpoint_every",
                     "corpus_bytes", "recall_pairs", "tile", "divergence_window",
                     "divergence_patience"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        head_dim = self.n_embd // self.n_head
        if self.n_embd % self.n_head or head_dim % 16:
            raise ValueError(f"n_embd / n_head must be a whole multiple of 16 (NVFP4 Q/K blocks "
                             f"of 16 along head_dim), got {self.n_embd} / {self.n_head}")
        for name in ("seq_len", "tile"):
            if getattr(self, name) % 32:
                raise ValueError(f"{name} must be a multiple of 32 (MXFP4 blocks of 32 along "
                                 f"the keys), got {getattr(self, name)}")
        if self.probe_rows > self.batch:
            raise ValueError(f"probe_rows ({self.probe_rows}) must be <= batch ({self.batch})")
        if self.speed_skip < 0:
            raise ValueError(f"speed_skip must be >= 0 (steps left out of the steady tokens/s), "
                             f"got {self.speed_skip}")
        if not 0 <= self.activations_rows <= self.batch:
            raise ValueError(f"activations_rows must lie in [0, batch] (validation sequences "
                             f"of one batch; 0: none saved), got {self.activations_rows}")
        if "recall" in self.tasks and self.seq_len + 1 < 4 * self.recall_pairs:
            raise ValueError(f"recall_pairs: {self.recall_pairs} pairs need seq_len + 1 >= "
                             f"{4 * self.recall_pairs}, got seq_len {self.seq_len}")
        if not 0 < self.val_fraction < 1 or self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("val_fraction must lie in (0, 1), lr be > 0 and min_lr_ratio in "
                             f"[0, 1]; got {self.val_fraction}, {self.lr}, {self.min_lr_ratio}")

    def _check_lists(self) -> None:
        for arm in self.arms:
            if arm not in ARMS:
                raise ValueError(f"arms: {arm!r} is not an arm; the arms are "
                                 f"{', '.join(ARMS)}")
        if REFERENCE_ARM not in self.arms:
            raise ValueError(f"arms must include {REFERENCE_ARM!r}: the divergence rule "
                             "compares every run with it")
        for arm in self.reference_arms:
            if arm not in self.arms:
                raise ValueError(f"reference_arms: {arm!r} is not one of this run's arms "
                                 f"({', '.join(self.arms)})")
        for task in self.tasks:
            if task not in TASKS:
                raise ValueError(f"tasks: {task!r} is not one of {', '.join(TASKS)}")
        for name in ("arms", "seeds", "tasks"):
            values = getattr(self, name)
            if not values or len(set(values)) != len(values):
                raise ValueError(f"{name} must be a non-empty list without repeats, got "
                                 f"{values}")


# the variants of the full preset. The third full run (results/pv-divergence-full-3,
# studies/README.md) found that at this model's size the v509 backward's fixed-scale
# E5M2(4 dO) flushes 85-98% of dO unless the loss is scaled (fp8pv_loss_scaled then trained as
# bf16 did), so the cause and fix arms run with the loss scaled by 2^13 against the scaled
# routes: MXFP4 on P or V alone, V's scale rule and rounding (rceil, stochastic), 4-bit P/V
# with finer scales (NVFP4, UE5M3) on the FP8 route, the leakage fix, QK-norm and the running
# maximum (no anchor, so no P^ saturating at 2^127). MXFP4 P/V's forward with bf16's gradient
# straight through separates the forward's error from the backward's. The two routes
# unscaled (fp8pv, mxfp4pv) and MXFP4 V alone unscaled (the third run's strongest cause) tie
# it to the earlier runs. The exact-backward arms, which the three earlier runs ran (2 of 2
# diverged with MXFP4 P/V each time, 0 of 2 with FP8), share the represented lse and are no
# control where P^ saturates (studies/README.md); they are in `long`, as is every arm. The
# committed -full, -full-2 and -full-3 ran earlier lists (their config.json).
_VARIANTS = ("fp8pv_loss_scaled", "mxfp4pv_loss_scaled", "mxfp4_p_only_loss_scaled",
             "mxfp4_v_only_loss_scaled", "mxfp4pv_rceil_v_loss_scaled",
             "mxfp4pv_sr_v_loss_scaled", "nvfp4pv_loss_scaled", "ue5m3pv_loss_scaled",
             "mxfp4pv_leakfix_loss_scaled", "mxfp4pv_qknorm_loss_scaled",
             "mxfp4pv_running_max_loss_scaled", "mxfp4pv_bf16_grad", "mxfp4_v_only")
PRESETS = {
    "smoke": PVDivergenceConfig(
        arms=("bf16", "fp8pv", "mxfp4pv", "mxfp4_v_only", "mxfp4pv_leakfix"), seeds=(0, 1),
        tasks=("text", "recall"), n_layer=2, n_head=2, n_embd=64, seq_len=64, batch=8,
        steps=32, lr=3e-3, warmup=4, eval_every=8, val_batches=2, probe_rows=2,
        checkpoint_every=8, corpus_bytes=600_000, recall_pairs=8, tile=64,
        divergence_window=8, divergence_patience=2, activations_rows=2,
    ),
    "full": PVDivergenceConfig(arms=("bf16", "sdpa", "fp8pv", "mxfp4pv", *_VARIANTS),
                               steps=400, warmup=40),
    "long": PVDivergenceConfig(
        arms=tuple(ARMS), seeds=(0, 1, 2), tasks=("text", "recall"), n_layer=6, n_head=6,
        n_embd=384, seq_len=1024, batch=32, steps=5000, warmup=250, eval_every=250,
        checkpoint_every=250, corpus_bytes=64_000_000,
    ),
}


def data_parallel(config: PVDivergenceConfig) -> bool:
    return config.data_parallel


def cells(config: PVDivergenceConfig) -> list[dict]:
    return [{"task": task, "seed": seed, "arm": arm}
            for task in config.tasks for seed in config.seeds for arm in config.arms]


def run_spec(config: PVDivergenceConfig, cell: dict, run_seed: int, cell_seed: int):
    """The training run of a cell: initial weights and data from (run seed, seed, task),
    shared by every arm; stochastic rounding from the cell's own seed."""
    corpora, gpt = PARTS["corpora"], PARTS["gpt"]
    vocab = (256 if cell["task"] == "text"
             else corpora.RecallTask(pairs=config.recall_pairs).vocab_size)
    model = gpt.GPTConfig(vocab_size=vocab, seq_len=config.seq_len, n_layer=config.n_layer,
                          n_head=config.n_head, n_embd=config.n_embd)
    shared = f"{cell['task']}-{cell['seed']}"
    return PARTS["training"].RunSpec(
        model=model, task=cell["task"], arm=cell["arm"], steps=config.steps,
        batch=config.batch, lr=config.lr, min_lr_ratio=config.min_lr_ratio,
        warmup=config.warmup, weight_decay=config.weight_decay, beta2=config.beta2,
        eval_every=config.eval_every, val_batches=config.val_batches,
        probe_rows=config.probe_rows, checkpoint_every=config.checkpoint_every,
        corpus_bytes=config.corpus_bytes, val_fraction=config.val_fraction,
        recall_pairs=config.recall_pairs, block=config.tile,
        init_seed=corpora.stream_seed(run_seed, f"init-{cell['seed']}", 0),
        data_seed=corpora.stream_seed(run_seed, f"data-{shared}", 0),
        sr_seed=cell_seed, activations_rows=config.activations_rows,
        speed_skip=config.speed_skip,
    )


ACTIVATIONS = "activations"  # <out>/activations/: the saved attention inputs


def activations_stem(cell: dict) -> str:
    """The saved activations' file names of a cell, less ``-layer<l>.safetensors``."""
    return f"{cell['task']}-{cell['arm']}-seed{cell['seed']}"


def run_cell(config: PVDivergenceConfig, cell: dict, ctx) -> dict:
    spec = run_spec(config, cell, ctx.seed, ctx.cell_seed)
    saved = None
    if config.activations_rows:
        if ctx.folder is None:
            raise ValueError("activations_rows: saving activations needs a results folder "
                             "(run the study with fp4lab study run / run_study)")
        saved = (ctx.folder / ACTIVATIONS, activations_stem(cell))
    backend = "reference" if cell["arm"] in config.reference_arms else ctx.backend
    training = PARTS["training"]
    if ctx.device.startswith("cuda"):  # every rank, before its cell's first CUDA work
        training.deterministic_algorithms(config.deterministic)
    tables = training.train(spec, ctx.device, backend, ctx.rank, ctx.world_size, ctx.scratch,
                            saved)
    if tables["runs"]:
        tables["runs"][0] |= training.determinism()
    if cell["task"] == "text" and tables["runs"]:
        corpus = PARTS["corpora"].text_corpus(config.corpus_bytes, config.val_fraction)
        tables["runs"][0] |= {"corpus_train_sha256": corpus.train_sha256,
                              "corpus_val_sha256": corpus.val_sha256,
                              "corpus_train_bytes": len(corpus.train),
                              "corpus_val_bytes": len(corpus.val),
                              "corpus_documents": corpus.documents}
    return tables


def report(config: PVDivergenceConfig, metrics, tables: dict):
    return PARTS["report"].report(config, metrics, tables)
