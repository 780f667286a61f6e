"""The Ray Train worker loop: data in, FSDP2 steps, metrics and checkpoints out.

    train_loop_per_worker -> Trainer(set up, resume) -> train(): epochs -> steps -> report / checkpoint
                                                      -> finish(): every rank's bad samples, the export

What the loop holds besides the model, its optimizer step and the run's state, each a narrow interface:

- ``me``, a `pipeline.train.state.Rank`: rank, world size, device, the agreements' CPU group and the
  micro-batches per step, fixed at set-up;
- ``plan``, a `pipeline.train.dataplan.DataPlan`: everything the loop asks of its data, the same for a
  plain ``--data`` (`OneSource`) and a mixture (`MixedSources`), its pipeline in the training process or
  in a feeder process (`pipeline.train.feeder`): an epoch's step inputs, the empty position by sample its
  checkpoints record, its streams' fingerprint and what its metrics rows add;
- ``cursor``, a `pipeline.train.cursor.EpochCursor`: where this rank stands in the epoch;
- ``checkpointer``, a `pipeline.train.saver.Checkpointer`: save, wait, the longest save; the preemption
  check (`pipeline.train.preemption.checkpoint_and_stop`) saves with it too.

Data: each epoch has one shard order, a pure function of (seed, epoch). Rank r streams
`order[r::world]` through its own Ray Data pipeline (read -> decode -> crop -> patchify), so which
sample lands on which rank at which step is deterministic. (Ray's `get_dataset_shard` balances
blocks across workers on demand, which is neither reproducible nor resumable mid-epoch; that is why
the split is done here.) Mixed sources: `pipeline.train.dataplan`.

Resume at the sample: a checkpoint holds how many micro-batches each rank has taken from its stream
this epoch. A run resumed at the same world size and micro-batch size rebuilds the same streams,
re-reads those micro-batches without training on them and goes on from the next sample, so a
stopped and resumed run trains on the same samples, in the same order, as a straight one (the re-read
runs at the data pipeline's speed). At another layout the checkpoint's position by sample deals the
epoch's remaining samples to the new ranks, each once, in another order (`pipeline.train.position`).

An epoch is every good sample once: its rules (streams of unequal length, the smaller last steps, a short
first step) are written in docs/design.md, "Training"; here, `pipeline.train.state.StepAgreement` is how
the ranks agree every step on how many samples it holds, until every rank's stream has run dry.
A preemption notice on any rank rides on the same agreement: every rank checkpoints at that step
boundary and stops, and Ray Train restarts the run from there (`pipeline.train.preemption`).

The GPU is not kept waiting on the host: the next steps' input is built on a background thread
(`pipeline.train.prefetch`), which starts the next epoch's pipeline as soon as this one's runs dry, the
ranks' agreements go through a CPU group, and loss and accuracy
stay on the device until a log line is due, as do the counts of skipped steps: with fused AdamW a
step waits for nothing (`pipeline.train.step`); other AdamW kernels read the gradient norm back.

A log line does not leave the device idle either. At a plain log step N (no checkpoint, no evaluation,
not the last step) the loop takes what the row needs without waiting for the device (`Pending`: the
window closed behind step N, `pipeline.train.metrics.MetricsWindow.close`), queues step N+1, and only
then finishes step N's report: it waits for the device to have run step N (an event, not step N+1's
kernels), checks the skipped steps, reports to Ray Train and writes the row and the log line while the
device runs step N+1. The rows are the same as if written at step N; what moves is when: the stop on too
many skipped steps in a row comes one step later (after step N+1 ran), and a run that stops or is
preempted before step N+1 writes step N's row first. A checkpoint goes one move further: at step N
it takes what the save needs of that moment (`Checkpointer.take`: every rank's cursor, the weights'
finite check behind the step), and its report and save are finished inside step N+1, once that step's
forward and backward are queued and before its update (`Trainer.before_update`), so the device runs them
while the host writes the row and starts the save; the row is still stored before the checkpoint can
register. An evaluation and the last step keep the report in place (the end waits anyway).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pipeline import dcp
from pipeline.data.bad_samples import BadSamples
from pipeline.train import checkpoint, finetune, lease, mfu, preemption, sinks, stacks
from pipeline.train.config import TrainConfig, worker_config
from pipeline.train.cursor import EpochCursor
from pipeline.train.dataplan import StepInputs
from pipeline.train.ema import WeightEMA
from pipeline.train.feeder import feeder_plan_for
from pipeline.train.metrics import ACCURACIES, MetricsLog, MetricsWindow, SkippedSteps, format_line, log_line
from pipeline.train.model import build_model, model_config
from pipeline.train.objective import objective_for
from pipeline.train.optim import optimizer_kernels
from pipeline.train.prefetch import StepInput
from pipeline.train.saver import Checkpointer, FiniteCheck, Saver, WeightsNotFinite
from pipeline.train.session import RaySession
from pipeline.train.state import (
    Rank,
    StepAgreement,
    TrainState,
    agree_on_step,
    control_group,
    gather_bad_samples,
)
from pipeline.train.step import StepStats, TrainStep


class StopRun(Exception):
    """The run ends on an error every rank agreed on; the message is the one line the driver shows."""


@dataclass(frozen=True)
class Pending:
    """A log line's report as of its step, taken without waiting for the device: the window closed
    behind the step (its device values in flight to the host), and the host values its row needs; with
    a checkpoint, what the save takes of that step (`Checkpointer.take`)."""

    window: MetricsWindow
    step: int
    epoch: int
    lr: float
    counts: BadSamples  # this rank's bad-sample counts as of the step's input (`EpochCursor.counts`)
    evaluation: dict[str, float] | None = None
    checkpoint: FiniteCheck | None = None  # a checkpoint's finite check, taken behind the step


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any]:
    """Entry point of every Ray Train worker (see `pipeline.train.driver.fit`); returns the run summary."""
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # a line per rank per epoch otherwise
    try:
        trainer = Trainer(loop_config, RaySession(worker_config(loop_config).run_dir))
    except (dcp.CheckpointRefusedError, finetune.HeadInitError) as e:  # every rank alike: a restart would too
        return {"metrics": {}, "bad_samples": {}, "error": str(e)}
    return trainer.train()


def resize_line(config: TrainConfig, saved: int, world: int, step: int) -> str:
    """The log line of a group resumed at another size than its checkpoint's: from how many workers to
    how many, why, the step it resumes at, and the accumulation that keeps the global batch. Ray Train
    tells a new group no reason; the sizes do: an elastic group smaller than its checkpoint's lost workers
    (a node left, or a process died), a larger one found room that nodes brought."""
    if isinstance(config.cluster.num_workers, int):
        why = "--num-workers changed"
    elif world < saved:
        why = f"{saved - world} lost: a node left or a worker died"
    else:
        why = f"room for {world - saved} more: nodes joined"
    micro, batch, before = config.optim.micro_batch_size, config.optim.batch_size, config.accumulation(saved)
    return (
        f"workers: from {saved} to {world} ({why}); resuming at step {step}, the batch kept at {batch} = "
        f"{world} x {micro} x {config.accumulation(world)} accumulation"
        + (f" (was x {before})" if before else "")
    )


class Trainer:
    """One rank's part of a run. `train()` returns the summary that rank 0 hands to the driver:
    `metrics` (the last logged step), `bad_samples` (all ranks merged), `error` ("" or one line),
    `resumed_from` (checkpoint, step and epoch this attempt resumed from, or None)."""

    def __init__(self, loop_config: dict[str, Any], session: RaySession):
        self.config = config = worker_config(loop_config)
        self.shards: list[str] = loop_config["shards"]  # every source's, for the log lines
        self.session = session
        self.rank, self.world, self.device = session.rank, session.world, session.device
        stacks.start(self.rank)  # with VITRAY_SAMPLE_STACKS only
        self.eval_shards: list[str] = loop_config.get("eval_shards", [])
        self.lease: str | None = loop_config.get("lease")  # the driver's lease on --out (`lease`)
        self.model_config = model_config(config)
        self.objective = objective_for(config)  # loss, batch columns, FLOPs, what final/ holds
        self.data_config = config.data_for(self.model_config.patch_size)
        self.accum = config.optim.batch_size // (config.optim.micro_batch_size * self.world)
        self.me = Rank(self.rank, self.world, self.device, control_group(), self.accum)
        columns = self.objective.columns
        self.plan = feeder_plan_for(loop_config, config, self.data_config, self.me, columns)
        self.model = build_model(config, self.device)
        self.step_fn = TrainStep(self.model, config, self.device, self.objective)
        decay = config.optim.ema_decay  # the EMA of the weights (`pipeline.train.ema`), or None
        self.ema = None if decay is None else WeightEMA(self.model, decay, config.optim.ema_every)
        self.group = self.me.group  # before resume: --head-init probe agrees on its batches with it
        self.state = self.resume()
        # Where this rank stands in the epoch, and its bad-sample counts as of the last step's input.
        # The data thread counts into a copy of its own, so samples it read ahead for steps that never
        # ran (the run stopped) are not counted.
        self.cursor = self.resume_cursor()
        self.skipped = SkippedSteps(self.device)
        log = None if self.rank else MetricsLog(config.run_dir, self.state.step, watch=True)
        self.log = None if log is None else sinks.attach(log, config)
        saved_config = {
            "train": config.to_dict(),
            "model_config": self.model_config.to_dict(),
            "data": self.data_config.to_dict(),
            **self.objective.checkpoint_meta(),
        }
        saver = Saver(
            session, self.model, self.step_fn.optimizer, self.ema, asynchronous=config.run.async_checkpoint
        )
        self.checkpointer = Checkpointer(saver, self.me, self.model, saved_config)
        # A checkpoint's save and the wait for its copy, inside the next step before its update.
        self.step_fn.before_update = self.before_update
        self.peak_tflops, peak_note = mfu.peak_tflops(self.device)
        self.flops_per_image = self.objective.flops_per_image()
        self.last_metrics: dict[str, Any] = {}
        self.first_step, self.run_start = self.state.step, time.perf_counter()
        self.window = MetricsWindow(self.device)
        self.pending: Pending | None = None  # a report finished in or after the next step
        self.upcoming: tuple[int, StepInputs] | None = None  # the next epoch's input, started ahead
        self.preemption = preemption.PreemptionWatcher(self.rank, self.world, first_step=self.state.step)
        self.announce(peak_note)

    # --- set up ----------------------------------------------------------------------------------
    def resume(self) -> TrainState:
        """Collective: load the checkpoint Ray Train hands over, if any; the state to continue from."""
        self.resumed_from: dict[str, Any] | None = None  # in the summary: where this attempt began
        with self.session.resume_from() as resumed:
            if resumed is None:
                if self.config.arch.weights:  # fine-tuning starts from these; a resume from its checkpoint
                    state = finetune.pretrained_state(self.config, self.model_config)
                    finetune.load_pretrained(self.model, state)
                    if self.config.arch.head_init == "probe":
                        finetune.probe_head_in_run(
                            self.model, self.shards, self.config, self.model_config.patch_size, self.me,
                            self.objective.idle_inputs(self.device), data_cpus=self.plan.cpus(0),
                        )  # fmt: skip
                    if self.ema is not None:
                        self.ema.reset()  # the EMA starts from the pretrained weights
                return TrainState(seed=self.config.run.seed)
            directory, source = resumed
            checkpoint.check_compatible(
                directory, self.model_config, self.objective.checkpoint_meta(), self.config.optim
            )
            loaded = checkpoint.load(directory, self.model, self.step_fn.optimizer, self.ema)
            state = TrainState.from_dict(loaded)
        self.resumed_from = {"checkpoint": source, "step": state.step, "epoch": state.epoch}
        if self.ema is not None and not self.ema.restored and self.rank == 0:
            log_line(
                f"{source} holds no EMA of the weights: the EMA starts from its weights at step {state.step}"
            )
        return state

    def resume_cursor(self) -> EpochCursor:
        """This rank's place in the epoch: the start, or what the checkpoint resumed from holds."""
        stream, position = self.plan.fingerprint, self.plan.position()
        layout = (self.rank, self.world, self.config.optim.micro_batch_size, stream, self.data_config)
        if self.resumed_from is None:
            return EpochCursor.start(*layout, position=position)
        done = self.state.step >= self.config.last_step
        cursor, note = EpochCursor.resume(self.state, *layout, schedule_done=done, position=position)
        if self.rank == 0 and self.state.world not in (None, self.world):
            log_line(resize_line(self.config, self.state.world, self.world, self.state.step))
        if self.rank == 0:
            where = f"resumed from {self.resumed_from['checkpoint']} at step {self.state.step}"
            log_line(f"{where} (epoch {self.state.epoch})" + (f": {note}" if note else ""))
        return cursor

    def announce(self, peak_note: str) -> None:
        """Collective: the run's shape in one log line (rank 0 writes it)."""
        nodes: list[Any] = [None] * self.world
        dist.all_gather_object(nodes, (self.session.node_id, self.ema.nbytes if self.ema else 0))
        if self.rank == 0 and self.ema is not None:
            log_line(
                f"EMA of the weights (decay {self.ema.decay} per step, updated every {self.ema.every}): "
                f"float32, {max(b for _, b in nodes) / 2**20:.1f} MiB on the largest worker's shards"
            )
        if self.rank == 0:
            c = self.config
            log_line(
                f"{self.model_config.name}: {self.world} workers on {len({n for n, _ in nodes})} node(s), "
                f"{c.optim.micro_batch_size} images x {self.accum} accumulation each = batch {c.optim.batch_size}; "
                f"{len(self.shards)} shards; {peak_note}; "
                f"{type(self.step_fn.optimizer).__name__} ({optimizer_kernels(self.step_fn.optimizer)})"
            )

    # --- the run ---------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        error = ""
        try:
            while self.state.step < self.config.last_step:
                self.train_epoch()
            self.finish_report()  # none: the last step's report is never deferred
        except StopRun as stop:
            error = str(stop)
        finally:
            self.preemption.close()
            if self.upcoming is not None:  # started ahead for an epoch the run did not reach
                self.upcoming[1].close()
            self.plan.close()
        return self.finish(error)

    def train_epoch(self) -> None:
        """Steps until the schedule ends or every rank's stream has run dry; then the next epoch begins."""
        state, last_step = self.state, self.config.last_step
        upcoming, self.upcoming = self.upcoming, None
        data = upcoming[1] if upcoming is not None and upcoming[0] == state.epoch else self.epoch_input()
        try:
            while state.step < last_step:
                step_input, agreement = self.next_step_input(data)
                if agreement.error or agreement.preempted or agreement.epoch_over:
                    self.finish_report()  # no step of this input to overlap the last log line's report
                if agreement.error:
                    raise StopRun(agreement.error)
                if self.cursor.at_start and agreement.samples < self.config.optim.batch_size:
                    raise StopRun(
                        f"epoch {state.epoch} gave no full step: {len(self.shards)} shards hold fewer than "
                        f"{self.config.optim.batch_size} readable samples per step across {self.world} "
                        "workers; use more data or a smaller --batch-size"
                    )
                if agreement.preempted:  # a checkpoint of the steps so far, then Ray Train restarts the run
                    self.checkpoint_and_stop()
                if agreement.epoch_over:
                    break
                self.train_step(data, step_input, agreement)
        finally:
            data.close()  # stops this epoch's Ray Data execution if it is still running
        if state.step >= last_step:
            return
        state.epoch += 1
        self.cursor.next_epoch()

    def epoch_input(self, ahead: BadSamples | None = None) -> StepInputs:
        """This rank's steps of input for the current epoch, after the micro-batches it has taken; or,
        given ``ahead`` (the counts this epoch's stream ended with), the next epoch's from its start."""
        epoch = self.state.epoch + (ahead is not None)
        on_dry = lambda final: self.start_next_epoch(epoch, final)  # noqa: E731
        return self.plan.epoch_input(epoch, self.cursor, ahead=ahead, on_dry=on_dry)

    def start_next_epoch(self, epoch: int, final: BadSamples) -> None:
        """On the data thread, when this rank's stream of ``epoch`` has run dry: the next epoch's input
        starts now, while the epoch's last steps train (`Prefetcher`); `train_epoch` takes it."""
        if epoch == self.state.epoch and self.state.step + 1 < self.config.last_step:
            self.upcoming = (epoch + 1, self.epoch_input(ahead=final))

    def next_step_input(self, data: StepInputs) -> tuple[StepInput, StepAgreement]:
        """Collective: this rank's input for the next step, and what all ranks agree on."""
        wait_start = time.perf_counter()
        step_input = data.next()
        self.window.data_wait += time.perf_counter() - wait_start
        i, notice = step_input, self.preemption.notice(self.state.step)
        agreed = time.perf_counter()
        agreement = agree_on_step(i.samples, i.ran_dry, i.error, self.group, preempted=notice is not None)
        self.window.sync_wait += time.perf_counter() - agreed  # a rank ahead waits here for the others
        if agreement.error or not agreement.preempted:  # a preemption's checkpoint precedes this input
            self.cursor.saw(step_input.bad_samples, step_input.counted)
        return step_input, agreement

    def train_step(self, data: StepInputs, step_input: StepInput, agreement: StepAgreement) -> None:
        self.cursor.took(self.accum, step_input.bad_samples, step_input.consumed)  # places: same on all
        micro_batches = step_input.to_device(self.device)
        data.release(step_input)
        stats = self.step_fn(
            self.state.step, micro_batches, global_count=agreement.samples, micro_steps=self.accum
        )
        self.state.step += 1
        if self.state.step == self.first_step + 1:  # the optimizer's state made: the saves' buffers too
            self.checkpointer.warm()
        self.last_stats = stats  # for a checkpoint on a preemption notice (`pipeline.train.preemption`)
        if self.ema is not None:
            self.ema.update(self.state.step)
        self.window.add_step(stats.loss_sum, stats.correct, stats.count, stats.skipped)
        self.skipped.add(stats.skipped)
        self.finish_report()  # the last log line's, now that this step is queued behind its step
        step, config = self.state.step, self.config
        last = step == config.last_step
        save = step % config.run.checkpoint_every == 0 or last
        evaluate = bool(self.eval_shards) and (
            last or (config.run.eval_every > 0 and step % config.run.eval_every == 0)
        )
        if save or evaluate:
            # A checkpoint is saved inside the next step (`before_update`); beside an evaluation or at
            # the last step, now.
            evaluation = self.evaluate() if evaluate else None
            self.report(stats, save=save, evaluation=evaluation, defer=not (evaluate or last))
        elif step % config.run.log_every == 0:
            self.report(stats, save=False, defer=True)

    def before_update(self) -> None:
        """Inside each step, its forward and backward queued and its update not (`TrainStep.before_update`):
        the checkpoint of the step before, if that step made one (the device runs this step's forward and
        backward meanwhile), then the wait for the save's copy of the state (`Checkpointer.staged`)."""
        if self.pending is not None and self.pending.checkpoint is not None:
            self.finish_report()
        self.checkpointer.staged()

    def evaluate(self) -> dict[str, float]:
        """Collective: the row's top-1 accuracies over the evaluation shards (`finetune.evaluate_in_run`):
        ``eval_accuracy``, and with an EMA ``eval_ema_accuracy``, the EMA's weights in the model for that
        pass (`WeightEMA.applied`). Their time is not training time: the metrics window starts later
        by as much."""
        cpus = self.plan.cpus(self.state.epoch)
        idle = self.objective.idle_inputs(self.device)

        def score(weights: str = "") -> float:
            try:
                accuracy, seconds = finetune.evaluate_in_run(
                    self.model, self.eval_shards, self.config, self.model_config.patch_size, self.me, idle,
                    step=self.state.step, data_cpus=cpus, weights=weights,
                )  # fmt: skip
            except RuntimeError as e:  # every rank raises alike, with the failing rank's message
                raise StopRun(str(e)) from e
            self.window.start += seconds
            return accuracy

        scores = {"eval_accuracy": score()}
        if self.ema is not None:
            with self.ema.applied():
                scores["eval_ema_accuracy"] = score("EMA")
        return scores

    # --- report and checkpoint -------------------------------------------------------------------
    def report(
        self, stats: StepStats, *, save: bool, evaluation: dict[str, float] | None = None, defer: bool = False
    ) -> None:
        """Collective: a report to Ray Train (with a checkpoint), then a log line and `metrics.jsonl` row;
        with ``defer``, only what it needs is taken now (`Pending`, and a checkpoint's `Checkpointer.take`),
        and `finish_report` makes it once the next step is queued (a checkpoint: its forward and backward,
        `before_update`). A run whose lease on --out was taken over stops here, before the row."""
        if lost := lease.agreed_lost(self.lease, self.config.run_dir, self.rank, self.group):  # a rerun's?
            raise StopRun(lost)
        state = self.state
        window, self.window = self.window, self.window.close(stats.grad_norm, self.skipped)
        check = self.checkpointer.take(state, self.cursor) if save else None
        self.pending = Pending(
            window, state.step, state.epoch, stats.lr, self.cursor.counts, evaluation, check
        )
        if not defer:
            self.finish_report()

    def finish_report(self) -> None:
        """Collective: the `Pending` report, if any: wait for the device to have run its step (no later
        step), check the skipped steps, then the report (and checkpoint), the row and the log line."""
        if self.pending is None:
            return
        p, self.pending = self.pending, None
        counts = p.window.wait()
        error = self.skipped.check(self.state, p.step, counts, self.config.optim.max_skipped_steps, self.rank)
        if error:
            raise StopRun(error)
        metrics = p.window.reduce(
            step=p.step,
            epoch=p.epoch,
            lr=p.lr,
            samples_seen=p.counts.total,
            bad_samples=p.counts.bad,
            skipped_steps=self.state.skipped_steps,
            flops_per_image=self.flops_per_image,
            peak_tflops=self.peak_tflops,
            has_accuracy=self.objective.has_accuracy,
            group=self.group,
        )
        metrics.update(p.evaluation or {})
        metrics.update(self.plan.metrics(p.counts, self.group))  # mixed: where it is in each source
        if p.checkpoint is not None:
            # The history is stored before the checkpoint can register: a run killed after it keeps the row.
            # That is the checkpoint's one write to an object store: its stall reaches it at the next flush.
            if self.log is not None:
                self.log.flush(pending=metrics)
            self.save_checkpoint(metrics, p.checkpoint)
        else:
            self.session.report(metrics)
        if self.log is not None:
            log_line(format_line(metrics, self.config.last_step, self.run_start, self.first_step))
            self.log.append(metrics, flush=p.checkpoint is not None)
        stacks.mark(p.step)
        self.last_metrics = metrics

    def save_checkpoint(self, metrics: dict[str, Any], check: FiniteCheck | None = None) -> None:
        """Collective: a checkpoint with these metrics (`Checkpointer.save`, of what ``check``'s `take` took,
        or taken now); the seconds training waited become the row's ``checkpoint_stall_s``. Weights that
        are not finite stop the run instead."""
        check = check or self.checkpointer.take(self.state, self.cursor)
        try:
            metrics["checkpoint_stall_s"] = self.checkpointer.save(self.state, check, metrics)
        except WeightsNotFinite as e:
            raise StopRun(
                f"{e} and were not saved; resume from the last checkpoint with a lower --lr or a smaller --grad-clip"
            ) from e

    def checkpoint_and_stop(self) -> None:
        """Collective, on a preemption notice: `pipeline.train.preemption.checkpoint_and_stop`."""
        step, resumed = self.state.step, self.resumed_from

        def save() -> None:
            if self.last_metrics.get("step") == step:  # logged at this step: the same row goes with it
                if self.log is not None:
                    self.log.flush()
                self.save_checkpoint(self.last_metrics)
            else:
                self.report(self.last_stats, save=True)

        preemption.checkpoint_and_stop(
            self.preemption, self.me, step, self.checkpointer, save,
            held=step % self.config.run.checkpoint_every == 0 or (resumed or {}).get("step") == step,
            max_failures=self.config.run.max_failures,
        )  # fmt: skip

    # --- finish ----------------------------------------------------------------------------------
    def finish(self, error: str) -> dict[str, Any]:
        """Collective: the last checkpoint in storage; merge every rank's bad samples; export the model
        unless the run failed."""
        self.checkpointer.close()
        merged = BadSamples.from_config(self.data_config)
        for counts in gather_bad_samples(self.cursor.counts, self.group):
            merged.merge(counts)
        if not (error := error or lease.agreed_lost(self.lease, self.config.run_dir, self.rank, self.group)):
            if self.log is not None:  # the last checkpoint's stall, which followed its row's write
                self.log.flush()
            self.export()
        summary = {"metrics": self.last_metrics, "bad_samples": merged.to_dict(), "error": error}
        return {**summary, "resumed_from": self.resumed_from}

    def export(self) -> None:
        """Collective: the run directory's `final/` (and `final_ema/` with an EMA of the weights)."""
        config = self.config
        # A run resumed at the end of its schedule trained no step: its last step's row was logged.
        metrics = self.last_metrics or (self.log.row(self.state.step) if self.log else {})
        extra = {
            **self.objective.checkpoint_meta(),  # MAE: objective, mask ratio, decoder (not exported)
            "preprocessing": self.data_config.to_dict(),
            "training": {
                "step": self.state.step,
                "max_steps": config.optim.max_steps,
                "finished": self.state.step >= config.optim.max_steps,
                **{key: metrics.get(key) for key in ("loss", *(key for key, *_ in ACCURACIES))},
                "config": config.to_dict(),
            },
        }
        exported = self.objective.export_state
        checkpoint.export_run(config.run_dir, self.model, self.model_config, extra, exported, self.ema)
