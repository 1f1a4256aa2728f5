"""Every ``pipemare:`` line the library prints, in one table: its text, when and why it comes.

A line is printed, logged, warned or raised only through :func:`text`, from an entry of
:data:`LINES`; a decision taken on the user's behalf prints as the ``decision`` line, and its
subject must be one of :data:`DECISIONS`. The rule for the prefix: ``pipemare:`` starts what a
run reports while it runs (its layout, its decisions, its memory, a resume, a failure found
mid-run). Errors about the arguments given (a bad config, a batch smaller than N) are raised
before anything runs, in the words of the check that refuses them, without the prefix.

The reference page ``docs/lines.md`` is generated from these tables (:func:`reference`;
its :func:`write_reference` writes it), and a static test fails where any other
module builds a string that starts with the prefix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "DECISIONS",
    "LINES",
    "PREFIXES",
    "DecisionSubject",
    "Line",
    "reference",
    "text",
    "write_reference",
]

#: How a line of this table starts; nothing outside this module builds a string starting so
#: (a schedule and its P written ``"pipemare:4"`` is no line: the prefix ends in a space).
PREFIXES = ("pipemare: ", "pipemare layout: ")

#: The kinds of line, in the order the reference lists them, and how each reaches the user.
KINDS = {
    "info": "Logged on global rank 0 through Lightning's logger, or printed.",
    "warning": "Python warnings, raised on global rank 0 unless the entry says otherwise.",
    "error": "The messages of exceptions that stop the run.",
}


@dataclasses.dataclass(frozen=True)
class Line:
    """One line pipemare prints.

    Attributes:
        key: the name code asks for it by.
        template: its text, a ``str.format`` template over named fields.
        kind: ``"info"``, ``"warning"`` or ``"error"`` (:data:`KINDS`).
        when: when it is printed.
        means: what it says about the run.
        act: what to do about it (empty where nothing is to be done).

    Example:
        >>> LINES["wandb.online"].format(url="https://wandb.ai/me/p/runs/x")
        'pipemare: W&B run at https://wandb.ai/me/p/runs/x'
    """

    key: str
    template: str
    kind: str
    when: str
    means: str
    act: str = ""

    def __post_init__(self) -> None:
        if not self.template.startswith(PREFIXES) or self.kind not in KINDS:
            raise ValueError(
                f"line {self.key!r}: a template starting {PREFIXES}, a kind of {KINDS}"
            )

    def format(self, **fields: Any) -> str:
        """The line with ``fields`` filled in."""
        return self.template.format(**fields)


@dataclasses.dataclass(frozen=True)
class DecisionSubject:
    """A subject of :class:`~pipemare.optim.settings.Decision`: what is decided, when, why.

    Attributes:
        subject: the decision's subject, as printed.
        when: when the decision is taken (and so printed).
        means: what its choice sets.
        act: how to take the decision yourself, or when to.
    """

    subject: str
    when: str
    means: str
    act: str


def _table(*lines: Line) -> dict[str, Line]:
    return {line.key: line for line in lines}


_FIT_RUN = (
    "pipemare: {stages} stages ({where}), layers per stage {balance}, schedule {schedule!r}, "
    "N={microbatches}, corrections: {corrections}"
)

#: Every ``pipemare:`` line, by key, in the order a run meets them.
LINES: dict[str, Line] = _table(
    Line(
        "memory.predicted",
        "pipemare: memory, predicted, {stage}",
        "info",
        "Once per stage, before the first step of a fit, when the pipeline is built.",
        "The bytes a stage will hold: its weights, gradients, optimiser state, the corrections' "
        "buffers (weight prediction keeps one copy of the stage's trained weights) and the "
        "activations of the most microbatches it holds in flight under the schedule.",
        "Compare the total with the device's memory. Activations grow with the microbatches in "
        "flight: `recompute=True` keeps only each stage's input; more stages hold fewer layers.",
    ),
    Line(
        "memory.not_predicted",
        "pipemare: memory not predicted ({error})",
        "warning",
        "Before the first step of a fit, where one microbatch could not be run through a stage "
        "to measure what it saves.",
        "The run goes on without the memory lines and without the check that refuses a stage "
        "too large for its device.",
        "Nothing, unless the run then runs out of memory: the error says which layer failed.",
    ),
    Line(
        "memory.too_much",
        "pipemare: {stage}, more than the {limit_mb:,.0f} MB {where}. Fixes: more stages "
        "(devices=...), each holding fewer layers; recompute=True, which keeps only each stage's "
        "input per microbatch in flight; more microbatches (microbatches=N), each smaller; or a "
        "smaller batch",
        "error",
        "Before the first step of a fit (a `MemoryError`), where a stage is predicted to need "
        "more than its CUDA device has free, or on a CPU more than `memory_limit`.",
        "The largest stage over the limit, with its parts; nothing has trained yet.",
        "One of the fixes the line names; the parts say which helps most (activations: "
        "recompute or more microbatches; weights and optimiser state: more stages).",
    ),
    Line(
        "processes",
        "pipemare layout: {replicas} pipeline(s) x {stages} stages = {processes} processes",
        "info",
        "At the start of a run with a process per stage, before the run line; indented lines "
        "follow, one per pipeline (its ranks and nodes), then the gradient all-reduce groups "
        "where there are several pipelines, and a note where a pipeline spans nodes.",
        "Which process runs which stage of which pipeline.",
        "Where the note says pipelines span nodes, choose a stage count that divides the "
        "devices per node, so that activations stay inside a node.",
    ),
    Line(
        "run",
        _FIT_RUN,
        "info",
        "At the first batch of a fit (on a resume, after the checkpoint is loaded).",
        "The layout line: the stages, the cut, the schedule, N and the corrections with their "
        "settings, as the run will apply them; `corrections: none` on a schedule without them.",
        "Check P, N and the cut are what you meant; the decision lines below it say why each "
        "choice left open was taken.",
    ),
    Line(
        "run.checkpoint",
        "pipemare: {stages} stages ({where}), layers per stage {balance}, evaluating a "
        "checkpoint trained with schedule {schedule!r}, N={microbatches}, corrections: "
        "{corrections}",
        "info",
        "At the first batch of `validate`, `test` or `predict` with a checkpoint.",
        "How the loaded checkpoint was trained, read from the checkpoint; evaluation applies "
        "no corrections, and a pipelined evaluation gives one device's results.",
    ),
    Line(
        "run.evaluation",
        "pipemare: {stages} stages ({where}), layers per stage {balance}, schedule "
        "{schedule!r}, N={microbatches} (evaluation applies no corrections)",
        "info",
        "At the first batch of `validate`, `test` or `predict` without a checkpoint.",
        "The layout evaluation runs with; nothing is trained.",
    ),
    Line(
        "decision",
        "pipemare:   {decision}",
        "info",
        "Right after the run line, one per choice taken on the user's behalf, as "
        "`subject: choice (reason)`; the subjects are listed below.",
        'What was chosen where you left a choice open (`"auto"`, a schedule\'s default), and '
        "the measurement or rule that chose it. The same lines are stored in the checkpoint.",
        "Pass the argument the subject names to decide it yourself.",
    ),
    Line(
        "resume.layout",
        "pipemare: resuming a checkpoint saved with another layout; the weights, the "
        "optimiser's state and the step count carry over; {notes}",
        "warning",
        "On a resume whose P, N, cut or corrections differ from the checkpointed run's.",
        "What did not carry over: buffers of corrections this run does not use, corrections "
        "that start afresh, a changed schedule or N.",
        "Nothing if the change was meant; otherwise resume with the checkpointed run's layout.",
    ),
    Line(
        "resume.run",
        "pipemare: resuming continues the checkpointed run; {notes}",
        "warning",
        "On a resume whose derived settings (T1's horizon) differ from what this run alone "
        "would derive.",
        "The checkpointed run's horizon is kept (or the config's new one used, where its "
        "settings changed), so a longer resume does not move every later step's rate.",
        "To set the horizon yourself, `PipeMareConfig(reschedule_steps=...)`, as the note says.",
    ),
    Line(
        "budget.steps",
        "pipemare: the pipeline-time budget of {seconds:g} s allows {steps} steps "
        "({step_seconds:.4g} s per step, replayed from measured action times)",
        "info",
        "Before the first batch, from `PipelineTimeBudget(seconds, step_seconds=...)`, where "
        "the budget ends the run before `max_steps`.",
        "The run's `max_steps` is lowered to the steps the budget allows; T1's horizon is "
        "derived from that length.",
    ),
    Line(
        "budget.horizon",
        "pipemare: T1's horizon {was} -> {horizon} steps: the pipeline-time budget of "
        "{seconds:g} s allows about {estimate} steps ({why}), not the {known} of max_steps",
        "info",
        "Once, at the `PipelineMonitor`'s first measured check, for a `PipelineTimeBudget` "
        "without `step_seconds`.",
        "T1's horizon, a fraction of the run, derived again from the steps the budget is "
        "estimated to allow; the estimate follows the machine's load.",
        "For runs that stop at the same step, pass `step_seconds` or pin the horizon with "
        "`PipeMareConfig(reschedule_steps=...)`.",
    ),
    Line(
        "diverged",
        "pipemare: training diverged at step {step} in stage {stage}: {reason} (loss {loss:.4g})",
        "warning",
        "From `ConvergenceMonitor`, at the step the loss is not finite or blew up (10x its best "
        'smoothed value); a warning with `on_divergence="warn"` or `"stop"`, the message of '
        '`DivergenceError` with `"raise"` (the default), on every rank at the same step.',
        "The stage named is the first whose output held NaN/Inf, or else the one whose "
        "gradient norm grew the most.",
        "See [Troubleshooting](troubleshooting.md#the-loss-diverges-or-turns-nan).",
    ),
    Line(
        "loss.nonfinite",
        "pipemare: the loss of step {step} is {loss} (computed on stage {stage}, the last"
        "{where}); training stopped so that nothing trains on NaN/Inf weights and the last good "
        "checkpoint stays as it is. Attach pipemare.callbacks.ConvergenceMonitor to find the "
        "first stage whose output was not finite; lower the learning rate, clip gradients "
        "(gradient_clip_val) or check the data for NaN.",
        "error",
        "At the step whose loss is NaN or infinite (`NonFiniteLossError`), on every process.",
        "No update of that step was applied and no later checkpoint written.",
        "What the line says; see "
        "[Troubleshooting](troubleshooting.md#the-loss-diverges-or-turns-nan).",
    ),
    Line(
        "gradients.nonfinite",
        "pipemare: the gradients of step {step} on stage {stage}{where} are not finite "
        "({names}) while the loss was; the update was not applied and training stopped, so the "
        "weights and the last checkpoint stay finite. Look for an operation whose backward "
        "overflows (e.g. a sqrt or log at 0, a division by a small number), lower the learning "
        "rate or clip gradients (gradient_clip_val).",
        "error",
        "At a stage's update whose gradients hold NaN or Inf though the loss was finite "
        "(`NonFiniteGradientError`).",
        "A backward overflowed; the parameters named are the stage's with non-finite gradients.",
        "What the line says.",
    ),
    Line(
        "stage.failed",
        "pipemare: stage {stage} (rank {rank}, host {host}, pid {pid}) failed or stopped "
        "responding: its process {state}; stage {my_stage} (rank {my_rank}, pid {my_pid}) "
        "{doing}; {heard}. Cause: {cause}",
        "error",
        "On every other process when one stage's process dies, stops or makes no progress "
        "(`StageFailedError`), printed to stderr as soon as found: within `heartbeat_timeout` "
        "of a process gone or stopped, within `stall_timeout` of one alive but stuck.",
        "Which stage failed, what its process is doing now, what this process waited for and "
        "the last microbatch heard from the failed one.",
        "Read the failed stage's own error above it; see "
        "[Troubleshooting](troubleshooting.md#the-run-hangs-or-a-stage-fails).",
    ),
    Line(
        "store.lost",
        "pipemare: the job's rendezvous store cannot be reached from stage {stage} (rank "
        "{rank}, pid {pid}) ({doing}) for {silence:.0f} s: the process that hosts it (rank 0 "
        "under Lightning's launcher and under torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
        "=1, else torchrun's agent) is gone, stopped or unreachable{host}. Cause: {cause}",
        "error",
        "When the heartbeat cannot reach the job's store for `heartbeat_timeout`.",
        "The process holding the store ended or hangs; the others cannot coordinate.",
        "Look at rank 0's (or torchrun's agent's) output for its own error.",
    ),
    Line(
        "heartbeat.off",
        "pipemare: no heartbeat (the store at {host}:{port} did not answer: {error}); a stopped "
        "stage is found after stall_timeout ({timeout}) only",
        "warning",
        "At the start of a multi-process run whose store did not answer the heartbeat (on the "
        "process that found it).",
        "A dead stage is then found only after `stall_timeout` (default 5 minutes).",
        "Lower `stall_timeout` if waiting that long on a failure matters.",
    ),
    Line(
        "sigterm.stalled",
        "pipemare: a process did not reach the previous step's SIGTERM check within "
        "stall_timeout ({timeout}); see the other processes' errors",
        "error",
        "At a step's SIGTERM check (Lightning's per-step collective), where a process never "
        "arrives and none is found gone or stopped on this host.",
        "Another process is stuck or failed elsewhere.",
        "Read the other processes' errors.",
    ),
    Line(
        "torchrun.restarts",
        "pipemare: torchrun may restart this job (--max-restarts), and its workers share the "
        "agent's store, which keeps the first attempt's addresses: a restart's gloo setup then "
        "often fails connecting to the dead processes (pytorch/pytorch#135712). Start torchrun "
        "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment.",
        "warning",
        "At the start of a run under `torchrun --max-restarts` without "
        "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`.",
        "A restart would likely fail to connect.",
        "Set the variable, as the line says.",
    ),
    Line(
        "checkpoint.not_written",
        "pipemare: {count} checkpoint(s) not written, their step's updates had not reached "
        "every stage when the run stopped: {files}; the files written before are intact",
        "warning",
        "When a run stops on an error or a signal while checkpoints wait for their step's "
        "updates to reach every stage (a non-flushing schedule saves without draining).",
        "Those files were never written; the earlier ones are whole.",
        "Resume from the last file written.",
    ),
    Line(
        "checkpoint.incomplete",
        "pipemare: the checkpoint of step {step} should be complete in every process by now "
        "and is not here; this is a bug, please report it",
        "error",
        "Never, unless the stages' schedules disagree.",
        "An internal check failed.",
        "Report it with the run's command and layout lines.",
    ),
    Line(
        "wandb.offline",
        "pipemare: W&B run saved offline in {where} (upload: wandb sync {where})",
        "info",
        "At the end of a run logging to W&B without an API key (printed by "
        "`OfflineSafeWandbLogger`, the packaged configs' logger).",
        "Where the offline run is.",
        "`wandb sync` the folder to upload it.",
    ),
    Line(
        "stage.state_dict",
        "pipemare: {module}.state_dict(): {empty} of its {total} tensors ({first}, ...) "
        "belong to stages other processes hold and are on the meta device, without values; "
        "torch.save would write them empty. Save with trainer.save_checkpoint(path), which "
        "gathers every stage, or call {gather} on every process first where the whole model "
        "fits in one",
        "warning",
        "When the user's own code calls `state_dict()` on a model of which this process built "
        "only its stage (on every rank that does).",
        "The state dict is not the whole model: the other stages' tensors have no values here.",
        "Save through the trainer, or gather the model first, as the line says.",
    ),
    Line(
        "trace.static",
        "pipemare: {module} was traced for the example batch's sizes only: no trace lets its "
        "batch vary ({reason}). Every microbatch must then have the example's shape, so a "
        "microbatch or a last batch of fewer rows is refused at its first call. Let the batch "
        "vary where the forward fixes it (x.reshape(-1, ...) rather than the batch size), or "
        "train with microbatches=1 and batches of one size",
        "warning",
        "When a model that is not an `nn.Sequential` is cut, and its forward fixes the batch "
        "size (again on each reuse of the kept trace).",
        "The cut works for batches of the example's size only.",
        "Let the batch vary in the forward, or keep every batch the example's size with "
        "`microbatches=1`.",
    ),
    Line(
        "delay_momentum.below",
        "pipemare: delay_momentum={given} is below the optimiser's own momentum {own}: "
        "delayed stages will update with less momentum than the last one",
        "warning",
        "At setup, where `delay_momentum` is set lower than the optimiser's momentum.",
        "Delay-aware momentum raises a delayed stage's momentum; set below the optimiser's, it "
        "lowers it instead.",
        "Set it at or above the optimiser's momentum, or `delay_momentum=None` to switch it off.",
    ),
    Line(
        "monitor.other_strategy",
        "pipemare: {monitor} watches pipemare's pipeline; with strategy {strategy} it logs nothing",
        "warning",
        "When one of pipemare's monitors is attached to a Trainer running another strategy.",
        "The monitor is idle.",
        'Use `strategy="pipemare"`, or drop the monitor.',
    ),
    Line(
        "wandb.online",
        "pipemare: W&B run at {url}",
        "info",
        "At the end of a run logging to W&B online.",
        "The run's page.",
    ),
)

#: Every subject a decision line can have, in the order they are printed.
DECISIONS: dict[str, DecisionSubject] = {
    d.subject: d
    for d in (
        DecisionSubject(
            "planned from",
            "In a fit.",
            "The batch that N, the cut and the measurements were taken from (the first "
            "training batch, read before the sanity check).",
            "Nothing; batches of another size run with the same plan.",
        ),
        DecisionSubject(
            "segments",
            "Where the pipelined module is not an `nn.Sequential`.",
            "The number of layers `torch.export` traced the forward into, and how long it took.",
            "Pass an `nn.Sequential` or `split_points` to control the cut.",
        ),
        DecisionSubject(
            "use_cache",
            "With a Hugging Face model whose config asks for a key/value cache.",
            "The cache is turned off in the pipelined calls (training never reads it).",
            "Nothing.",
        ),
        DecisionSubject(
            "recompute",
            "With a Hugging Face model whose gradient checkpointing is on.",
            "Each stage but the last keeps only its input per microbatch in flight and reruns "
            "its forward at backward time.",
            "`recompute=True/False` on the strategy.",
        ),
        DecisionSubject(
            "compile",
            "Where `compile={...}` is given or the model was passed through `torch.compile`.",
            "Each stage's forward is compiled (a compiled whole cannot be cut).",
            "`compile={...}` chooses the options.",
        ),
        DecisionSubject(
            "microbatch weights",
            'With a Hugging Face loss or `microbatch_weights` other than `"rows"`.',
            "How each microbatch's loss is weighted so the minibatch's loss and gradient are "
            "one device's (e.g. by counted label tokens).",
            "`microbatch_weights=` on the strategy.",
        ),
        DecisionSubject(
            "microbatches",
            'With `microbatches="auto"` (the default).',
            "N: P on a schedule that never flushes (every stage's weights under one update "
            "late), capped by the batch; the fastest replayed N on a flushing one; 1 with "
            "BatchNorm on a flushing one.",
            "`microbatches=N`.",
        ),
        DecisionSubject(
            "last batch",
            "In a fit whose last batch has fewer samples than N.",
            "That batch runs one sample per microbatch; copies of weight 0 fill the rest and "
            "reach neither the gradient nor the logs.",
            "`drop_last=True` on the loader skips it.",
        ),
        DecisionSubject(
            "stages",
            "Where P is left open in one process (`stages=None`), or a process runs each stage.",
            "P: one per layer of the pipelined model, or one per process.",
            "`stages=P` (one process) or `devices=P`.",
        ),
        DecisionSubject(
            "layers per stage",
            'Where `balance` is a rule (`"time"`, the default; `"even"`, `"params"`, '
            "`\"auto\"`), a checkpoint's cut or a lean build's.",
            "The cut, and the rule or measurement it came from.",
            "`balance=[...]` pins it.",
        ),
        DecisionSubject(
            "build",
            "With a model built on the meta device and a process per stage.",
            "Each process gave real storage to its own stage only, and how it was initialised.",
            "Nothing.",
        ),
        DecisionSubject(
            "links",
            "With a process per stage where the replays need the links between them.",
            "Each link's latency and bandwidth, measured now (or simulated) for the replays.",
            "`simulated_link=` to replay a slower link.",
        ),
        DecisionSubject(
            "advice",
            "Where the run's step and 1F1B's can both be replayed from the layers measured.",
            "Whether this schedule or 1F1B at its fastest N reaches the quality sooner: step "
            "times replayed from this model's layers and its training step's code around them "
            "(on the first and last stages) on this device, steps to quality from the "
            "reference tasks (not this model); `not measured` on a lean build.",
            "Follow it, or run the strategy call it names and compare.",
        ),
        DecisionSubject(
            "checkpoints",
            "In a fit.",
            "Whether checkpoints are one file of the whole model or per-stage shards.",
            "`save_distributed_checkpoint=True/False`; `pipemare consolidate` joins shards.",
        ),
        DecisionSubject(
            "corrections",
            "Where no `config` is given.",
            "The schedule's default corrections (PipeMare's on `pipemare`, none elsewhere).",
            "`config=PipeMareConfig(...)`.",
        ),
        DecisionSubject(
            "lr_reschedule horizon",
            "Where T1 runs and its horizon is derived (a fraction of the run, or kept from the "
            "checkpoint on a resume).",
            "K, the steps over which each stage's rate rises from α/τ to the user's α.",
            "`PipeMareConfig(reschedule_steps=...)` or `reschedule_epochs=...`.",
        ),
        DecisionSubject(
            "delay_momentum",
            'Where `delay_momentum="auto"`.',
            "Whether delay-aware momentum runs and its maximum; off for Muon, mixed or "
            "momentum-free optimisers.",
            "`PipeMareConfig(delay_momentum=...)`.",
        ),
        DecisionSubject(
            "spike_compensation",
            'Where `spike_compensation="auto"`.',
            "Whether spike compensation runs (only for optimisers it supports).",
            "`PipeMareConfig(spike_compensation=...)`.",
        ),
        DecisionSubject(
            "weight_prediction",
            'Where `weight_prediction="auto"`.',
            "Whether each forward runs at the weights its update will meet (one copy of the "
            "stage's weights); off with T2, a stashing schedule or plain SGD.",
            "`PipeMareConfig(weight_prediction=...)`.",
        ),
        DecisionSubject(
            "local_accumulation",
            'Where `local_accumulation="auto"`.',
            "Whether stages accumulate gradients locally to bound their delay (plain SGD only).",
            "`PipeMareConfig(local_accumulation=...)`.",
        ),
    )
}


def text(key: str, **fields: Any) -> str:
    """The line ``key`` of :data:`LINES` with ``fields`` filled in: the one way to build it.

    Example:
        >>> text("memory.not_predicted", error="no grad_fn")
        'pipemare: memory not predicted (no grad_fn)'
    """
    return LINES[key].format(**fields)


def _cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ")


def reference() -> str:
    """The reference page, ``docs/lines.md``, written from :data:`LINES` and :data:`DECISIONS`."""
    out = [
        "# Every line a run prints",
        "",
        "<!-- Generated from pipemare/lines.py by pipemare.lines.write_reference(); edit that "
        "file, not this one. -->",
        "",
        "Every line pipemare prints starts with `pipemare:` (the process table with `pipemare "
        "layout:`) and comes from one table, `pipemare.lines`; a test fails where the code "
        "prints one that is not in it. Fields in braces are filled in at run time. Errors "
        "about the arguments given are raised before anything runs and are not listed here "
        "(see [Bad input](bad-input.md)); for what to do by symptom, see "
        "[Troubleshooting](troubleshooting.md).",
        "",
    ]
    for kind, how in KINDS.items():
        out += [f"## {kind.capitalize()} lines", "", how, ""]
        for line in (entry for entry in LINES.values() if entry.kind == kind):
            out += [
                f"### `{line.key}`",
                "",
                "```text",
                line.template,
                "```",
                "",
                f"- **When:** {line.when}",
                f"- **Means:** {line.means}",
            ]
            if line.act:
                out.append(f"- **What to do:** {line.act}")
            out.append("")
    out += [
        "## Decision subjects",
        "",
        "The subject of each `pipemare:   subject: choice (reason)` line, in the order printed.",
        "",
        "| subject | printed | what it chooses | to choose it yourself |",
        "|---|---|---|---|",
    ]
    out += [
        f"| `{d.subject}` | {_cell(d.when)} | {_cell(d.means)} | {_cell(d.act)} |"
        for d in DECISIONS.values()
    ]
    return "\n".join(out) + "\n"


def write_reference(path: str = "docs/lines.md") -> None:
    """Write :func:`reference` to ``path``: the command that regenerates the page is
    ``python -c "import pipemare.lines as l; l.write_reference()"``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(reference())
