"""The Ray Train worker loop: one rank's run, written in the order the host does it.

    Trainer(...): the model, its step, the data plan, the checkpoint resumed from
    train(): epoch after epoch, step after step; finish(): every rank's bad samples, the export

A step, N+1, on the host (top) beside the device (below), with step N a log line and a checkpoint:

    host    input N+1, agree | queue fwd+bwd N+1 | report N, save N | queue update N+1 | take report N+1
    device  ... step N ......| fwd+bwd N+1 .........................| update N+1 ...

- input N+1, agree: this rank's next step of micro-batches, built ahead on a thread (`pipeline.train.input`),
  and one agreement of every rank on how many samples the step holds, any data error, any preemption
  notice (`pipeline.train.state.agree_on_step`). Once the rank's stream has run dry, the next epoch's input
  starts here, while this epoch's last steps train.
- queue fwd+bwd N+1, queue update N+1: the step in two calls (`pipeline.train.step.train_step.TrainStep`).
- report N, save N: between them, what must be done before N+1 writes what a checkpoint of N holds: N's
  report (its window's wait for the device to have run step N, an event behind it and not N+1; a row of
  `metrics.jsonl`, a log line, a report to Ray Train), N's checkpoint save, and the wait for the save's copy
  of the state (`Checkpointer.staged`; asynchronous saves: `pipeline.train.checkpointing.saver`). The
  device runs N+1's forward and backward meanwhile.
- take report N+1: at a log line, what the row needs, taken without waiting for the device (its window
  closed behind the step, `pipeline.train.observe.metrics.MetricsWindow.close`; with a checkpoint,
  `Checkpointer.take`). It is finished at the next boundary: between N+2's two calls, or at once where no
  step follows (the epoch's or the schedule's end, a data error, a preemption notice).

Every report is finished in one place (`finish_report`), so every row holds the values of its own step; the
stop on too many skipped steps in a row, found when a row is finished, comes during the next step. The epoch's
rules (unequal streams, the smaller last steps) are in docs/design.md, "Training"; where a rank stands in its
epoch, and how a resume goes on at the sample, `pipeline.train.input.cursor`; a preemption notice's
checkpoint, `pipeline.train.checkpointing.preemption`. With --probe-data every checkpoint is probed beside
training (`pipeline.train.scoring`): rank 0 takes the probes' records into their rows in `finish_report`,
without waiting, and the run's end waits for the last before it exports (with --keep-best, `best/` too).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pipeline import dcp
from pipeline.data.bad_samples import BadSamples
from pipeline.train import finetune
from pipeline.train.checkpointing import checkpoint, lease, preemption
from pipeline.train.checkpointing.checkpoint import resize_line
from pipeline.train.checkpointing.saver import Checkpointer, FiniteCheck, Saver, WeightsNotFinite
from pipeline.train.config import worker_config
from pipeline.train.input.cursor import EpochCursor
from pipeline.train.input.dataplan import StepInputs
from pipeline.train.input.feeder import feeder_plan_for
from pipeline.train.input.ledger import Ledger
from pipeline.train.input.prefetch import StepInput
from pipeline.train.observe import goodput, mfu, sinks, stacks
from pipeline.train.observe.metrics import (
    ACCURACIES,
    MetricsLog,
    MetricsWindow,
    SkippedSteps,
    format_line,
    log_line,
)
from pipeline.train.observe.watchdog import Watchdog
from pipeline.train.scoring import best
from pipeline.train.scoring.probe import SCORES, ProbePlan, submit
from pipeline.train.scoring.results import ProbeResults, wait_in_step
from pipeline.train.session import RaySession
from pipeline.train.state import (
    Rank,
    StepAgreement,
    TrainState,
    agree_on_step,
    control_group,
    gather_bad_samples,
)
from pipeline.train.step.ema import WeightEMA
from pipeline.train.step.model import build_model, model_config
from pipeline.train.step.objective import objective_for
from pipeline.train.step.optim import optimizer_kernels
from pipeline.train.step.train_step import Gradients, StepStats, TrainStep
from pipeline.train.watch import StepWatch, TakenStep

# The boundary after the schedule's last step: no input is taken, and, as at an epoch's end, no step runs.
SCHEDULE_END = StepAgreement(samples=0, someone_ran_dry=False, error="")


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


def train_loop_per_worker(loop_config: dict[str, Any], watch: StepWatch | None = None) -> dict[str, Any]:
    """Entry point of every Ray Train worker (see `pipeline.train.driver.fit`); returns the run summary."""
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # a line per rank per epoch otherwise
    try:
        trainer = Trainer(loop_config, RaySession(worker_config(loop_config).run_dir), watch)
    except (dcp.CheckpointRefusedError, finetune.HeadInitError) as e:  # every rank alike: a restart would too
        return {"metrics": {}, "bad_samples": {}, "error": str(e)}
    return trainer.train()


class Trainer:
    """One rank's part of a run. `train()` returns the summary that rank 0 hands to the driver:
    `metrics` (the last logged step), `bad_samples` (all ranks merged), `error` ("" or one line),
    `resumed_from` (checkpoint, step and epoch this attempt resumed from, or None).

    Who this rank is (rank, world size, device, the agreements' group, micro-batches per step) is its
    `Rank`, ``me``; the rest is the run's: the model and its step, the data plan and the cursor in it, the
    checkpointer, and the report in flight."""

    def __init__(self, loop_config: dict[str, Any], session: RaySession, watch: StepWatch | None = None):
        started = time.time()  # the attempt's start, for the account of the run's time
        self.config = config = worker_config(loop_config)
        self.session, self.watch = session, watch or StepWatch()
        self.shards: list[str] = loop_config["shards"]  # every source's, for the log lines
        self.eval_shards: list[str] = loop_config.get("eval_shards", [])
        self.val_shards: list[str] = loop_config.get("val_shards", [])  # --keep-best eval's, or --val-data
        # The checkpoint probe (`pipeline.train.scoring`), with --probe-data.
        self.probe: ProbePlan | None = loop_config.get("probe")
        self.lease: str | None = loop_config.get("lease")  # the driver's lease on --out (`lease`)
        world = session.world
        accum = config.optim.batch_size // (config.optim.micro_batch_size * world)
        self.me = me = Rank(session.rank, world, session.device, control_group(), accum)
        stacks.start(me.rank)  # with VITRAY_SAMPLE_STACKS only
        self.model_config = model_config(config)
        self.objective = objective_for(config)  # loss, batch columns, FLOPs, what final/ holds
        self.data_config = config.data_for(self.model_config.patch_size)
        self.plan = feeder_plan_for(loop_config, config, self.data_config, me, self.objective.columns)
        self.model = build_model(config, me.device)
        self.step = TrainStep(self.model, config, me.device, self.objective)
        decay = config.optim.ema_decay  # the EMA of the weights (`pipeline.train.step.ema`), or None
        self.ema = None if decay is None else WeightEMA(self.model, decay, config.optim.ema_every)
        self.state = self.resume()
        # Where this rank stands in the epoch, and its bad-sample counts as of the last step's input.
        # The data thread counts into a copy of its own, so samples it read ahead for steps that never
        # ran (the run stopped) are not counted.
        self.cursor = self.resume_cursor()
        log = None if me.rank else MetricsLog(config.run_dir, self.state.step, watch=True)
        self.log = None if log is None else sinks.attach(log, config)
        # Where the run's time goes, rank 0's rows carrying it (`pipeline.train.observe.goodput`), in the
        # driver's session (an attempt run without one, in a test, is a session of its own).
        resumed = None if self.resumed_from is None else self.state.step
        self.clock = goodput.Clock(
            None if log is None else config.run_dir, loop_config.get("session") or goodput.new_session(started),
            started=started, workers=world, resumed_step=resumed, price=config.run.price_per_device_hour,
            resumed_row=None if log is None or resumed is None else log.row(resumed),
        )  # fmt: skip
        saved_config = {
            "train": config.to_dict(),
            "model_config": self.model_config.to_dict(),
            "data": self.data_config.to_dict(),
            **self.objective.checkpoint_meta(),
        }
        asynchronous, probed = config.run.async_checkpoint, self.probe is not None
        saver = Saver(
            session, self.model, self.step.optimizer, self.ema, asynchronous=asynchronous, probed=probed
        )
        self.checkpointer = Checkpointer(saver, me, self.model, saved_config)
        # Rank 0 takes the probes' records into the rows (`pipeline.train.scoring.results`); a checkpoint's
        # report holds the score --keep-best ranks by (`best.report_fields`).
        keep = config.scoring.keep_best
        self.probes = None if self.probe is None or me.rank else ProbeResults(self.probe, self.log, keep)
        self.report_fields = best.report_fields(keep)
        self.best: best.Best | None = None  # best/ as the run's end chose it (rank 0)
        self.start: dict[str, Any] | None = None  # a fine-tuning's starting point's scores (`score_start`)
        self.preemption = preemption.PreemptionWatcher(me.rank, world, first_step=self.state.step)
        # The reports: the window of steps since the last log line, the skipped steps counted on the
        # device, the report in flight (finished at the next step boundary), and the last row made.
        self.window, self.skipped = MetricsWindow(me.device), SkippedSteps(me.device)
        self.pending: Pending | None = None
        self.last_stats: tuple[StepStats, int] | None = None  # and its epoch: a row at a preemption notice
        self.last_metrics: dict[str, Any] = {}
        self.peak_tflops, peak_note = mfu.peak_tflops(me.device)
        self.first_step, self.run_start = self.state.step, time.perf_counter()
        self.upcoming: tuple[int, StepInputs] | None = None  # the next epoch's input, started ahead
        self.announce(peak_note)
        # From here to the last step: no step finished within the bound is a hang (its stacks, one line,
        # the attempt failed: `pipeline.train.observe.watchdog`); the loop says at which seam it stands.
        self.hang = Watchdog(
            me.rank, world, config.run_dir, config.run.hang_timeout, max_failures=config.run.max_failures
        )

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
                            self.objective.idle_inputs(self.me.device), data_cpus=self.plan.cpus(0),
                        )  # fmt: skip
                    if self.ema is not None:
                        self.ema.reset()  # the EMA starts from the pretrained weights
                return TrainState(seed=self.config.run.seed)
            directory, source = resumed
            checkpoint.check_compatible(
                directory, self.model_config, self.objective.checkpoint_meta(), self.config.optim
            )
            loaded = checkpoint.load(directory, self.model, self.step.optimizer, self.ema)
            state = TrainState.from_dict(loaded)
        self.resumed_from = {"checkpoint": source, "step": state.step, "epoch": state.epoch}
        if self.ema is not None and not self.ema.restored and self.me.rank == 0:
            log_line(
                f"{source} holds no EMA of the weights: the EMA starts from its weights at step {state.step}"
            )
        return state

    def resume_cursor(self) -> EpochCursor:
        """This rank's place in the epoch: the start, or what the checkpoint resumed from holds."""
        me, stream, position = self.me, self.plan.fingerprint, self.plan.position()
        layout = (me.rank, me.world, self.config.optim.micro_batch_size, stream, self.data_config)
        state = self.state
        ledger = Ledger.resume(self.shards, state.ledger, state.step, state.epoch)  # what each epoch consumed
        if self.resumed_from is None:
            return EpochCursor.start(*layout, position=position, ledger=ledger)
        done = state.step >= self.config.last_step
        cursor, note = EpochCursor.resume(
            state, *layout, schedule_done=done, position=position, ledger=ledger
        )
        if me.rank == 0 and self.state.world not in (None, me.world):
            log_line(resize_line(self.config, self.state.world, me.world, self.state.step))
        if me.rank == 0:
            where = f"resumed from {self.resumed_from['checkpoint']} at step {self.state.step}"
            log_line(f"{where} (epoch {self.state.epoch})" + (f": {note}" if note else ""))
        return cursor

    def announce(self, peak_note: str) -> None:
        """Collective: the run's shape in one log line (rank 0 writes it)."""
        me = self.me
        nodes: list[Any] = [None] * me.world
        dist.all_gather_object(nodes, (self.session.node_id, self.ema.nbytes if self.ema else 0))
        if me.rank == 0 and self.ema is not None:
            log_line(
                f"EMA of the weights (decay {self.ema.decay} per step, updated every {self.ema.every}): "
                f"float32, {max(b for _, b in nodes) / 2**20:.1f} MiB on the largest worker's shards"
            )
        if me.rank == 0:
            c, optimizer = self.config, self.step.optimizer
            log_line(
                f"{self.model_config.name}: {me.world} workers on {len({n for n, _ in nodes})} node(s), "
                f"{c.optim.micro_batch_size} images x {me.accum} accumulation each = batch {c.optim.batch_size}; "
                f"{len(self.shards)} shards; {peak_note}; "
                f"{type(optimizer).__name__} ({optimizer_kernels(optimizer)})"
            )

    # --- the run ---------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        error = ""
        try:
            self.score_start()
            while self.state.step < self.config.last_step:
                self.train_epoch()
        except StopRun as stop:
            error = str(stop)
        finally:
            self.hang.close()
            self.preemption.close()
            if self.upcoming is not None:  # started ahead for an epoch the run did not reach
                self.upcoming[1].close()
            self.plan.close()
        return self.finish(error)

    def train_epoch(self) -> None:
        """Step after step until every rank's stream has run dry or the schedule ends; then the next epoch
        begins. Each step boundary in the order the host meets it (the module's timeline)."""
        state = self.state
        upcoming, self.upcoming = self.upcoming, None
        ahead = upcoming is not None and upcoming[0] == state.epoch
        data = upcoming[1] if ahead else self.plan.epoch_input(state.epoch, self.cursor, ahead=None)
        try:
            while True:
                step_input, agreement = self.next_step_input(data)
                stop = agreement.error or self.no_full_step(agreement)  # "": none
                keep = self.preempted() if agreement.preempted and not stop else None
                runs = agreement.runs and not stop
                gradients = self.forward_backward(data, step_input, agreement) if runs else None
                self.finish_report()  # the last log line's: behind this step's forward and backward
                if stop:
                    raise StopRun(stop)
                if keep is not None:  # the checkpoint made, every rank stops: Ray Train restarts the run
                    preemption.stop(keep, self.checkpointer, self.me.rank)
                if gradients is None:
                    break  # every rank's stream has run dry (or the schedule has ended)
                staging = time.perf_counter()
                self.checkpointer.staged()  # an asynchronous save's copy, before the update writes the state
                self.clock.spent("checkpoint", staging, time.perf_counter())
                self.update(gradients)
        finally:
            data.close()  # stops this epoch's Ray Data execution if it is still running
        if state.step >= self.config.last_step:
            return
        state.epoch += 1
        self.cursor.next_epoch(self.me.group)

    def next_step_input(self, data: StepInputs) -> tuple[StepInput | None, StepAgreement]:
        """Collective: this rank's input for the next step, and what every rank agrees on; after the
        schedule's last step, no input and `SCHEDULE_END`. Once this rank's stream has run dry (seen on
        the data thread, steps ahead of the input taken here), the next epoch's input starts here, while
        this epoch's last steps train."""
        state, last_step = self.state, self.config.last_step
        if state.step >= last_step:
            return None, SCHEDULE_END
        self.hang.at("input", state.step + 1)
        wait_start = time.perf_counter()
        step_input = data.next()
        waited = time.perf_counter()
        self.window.data_wait += waited - wait_start
        self.clock.spent("data_wait", wait_start, waited)
        if self.upcoming is None and state.step + 1 < last_step and (final := data.ran_dry()) is not None:
            self.upcoming = (
                state.epoch + 1,
                self.plan.epoch_input(state.epoch + 1, self.cursor, ahead=final),
            )
        i, notice = step_input, self.preemption.notice(state.step)
        self.hang.at("agreement", state.step + 1)
        agreed = time.perf_counter()
        agreement = agree_on_step(i.samples, i.ran_dry, i.error, self.me.group, preempted=notice is not None)
        self.window.sync_wait += time.perf_counter() - agreed  # a rank ahead waits here for the others
        if agreement.error or not agreement.preempted:  # a preemption's checkpoint precedes this input
            self.cursor.saw(step_input.bad_samples, step_input.counted, step_input.tallied_bad)
        return step_input, agreement

    def no_full_step(self, agreement: StepAgreement) -> str:
        """Why an epoch cannot start: its first step holds less than a batch on every rank; "" else."""
        if not self.cursor.at_start or agreement.samples >= self.config.optim.batch_size:
            return ""
        return (
            f"epoch {self.state.epoch} gave no full step: {len(self.shards)} shards hold fewer than "
            f"{self.config.optim.batch_size} readable samples per step across {self.me.world} workers; use "
            "more data or a smaller --batch-size"
        )

    def forward_backward(
        self, data: StepInputs, step_input: StepInput, agreement: StepAgreement
    ) -> Gradients:
        """The step's input on the device and its forward and backward passes queued (`TrainStep`)."""
        state, me = self.state, self.me
        # Its places (the same on all ranks), its samples by position and for the ledger.
        self.cursor.took(me.accum, step_input.bad_samples, step_input.consumed, step_input.tallied)
        micro_batches = step_input.to_device(me.device)
        data.release(step_input)
        self.watch.taken(TakenStep(state.step + 1, state.epoch, step_input.keys, step_input.bad_samples))
        self.hang.at("forward/backward", state.step + 1)
        self.clock.began(state.step + 1)
        return self.step.forward_backward(
            state.step, micro_batches, global_count=agreement.samples, micro_steps=me.accum
        )

    def update(self, gradients: Gradients) -> None:
        """The step's update queued, and its sums added to the window; at a log line, its report taken
        (and finished at the next step boundary), after an evaluation where one is due."""
        self.hang.at("update", self.state.step + 1)
        stats = self.step.update(gradients)
        self.state.step += 1
        step, run = self.state.step, self.config.run
        self.hang.finished(step)
        if step == self.first_step + 1:  # the optimizer's state made: the saves' buffers too
            self.checkpointer.warm()
            self.clock.first_step()  # the attempt's start-up (or its restart) ends here
        if self.ema is not None:
            self.ema.update(step)
        self.window.add_step(stats.loss_sum, stats.correct, stats.count, stats.skipped)
        self.skipped.add(stats.skipped)
        self.last_stats = stats, self.state.epoch
        self.watch.trained(step, stats)
        last = step == self.config.last_step
        save = step % run.checkpoint_every == 0 or last
        evaluate = bool(self.eval_shards) and (last or (run.eval_every > 0 and step % run.eval_every == 0))
        validate = bool(self.val_shards) and save  # every checkpoint's, what --keep-best eval ranks by
        if save or evaluate or step % run.log_every == 0:
            scores = self.evaluate(test=evaluate, val=validate) if evaluate or validate else None
            self.take_report(stats, self.state.epoch, save=save, evaluation=scores)

    def evaluate(self, *, test: bool = True, val: bool = False) -> dict[str, float]:
        """Collective: the row's top-1 accuracies (`finetune.evaluate_in_run`): with ``test``, over the
        evaluation shards, ``eval_accuracy``, and with an EMA ``eval_ema_accuracy``, the EMA's weights in the
        model for that pass (`WeightEMA.applied`); with ``val``, over the validation split, ``val_accuracy``.
        Their time is not training time: the metrics window starts later by as much."""
        cpus = self.plan.cpus(self.state.epoch)
        idle = self.objective.idle_inputs(self.me.device)

        def score(shards: list[str], weights: str = "", split: str = "eval") -> float:
            try:
                accuracy, seconds = finetune.evaluate_in_run(
                    self.model, shards, self.config, self.model_config.patch_size, self.me, idle,
                    step=self.state.step, data_cpus=cpus, weights=weights, split=split,
                )  # fmt: skip
            except RuntimeError as e:  # every rank raises alike, with the failing rank's message
                raise StopRun(str(e)) from e
            self.window.start += seconds
            return accuracy

        scores, evaluating = {}, time.perf_counter()
        with self.hang.paused():  # a pass over the evaluation shards is no step
            if test:
                scores["eval_accuracy"] = score(self.eval_shards)
                if self.ema is not None:
                    with self.ema.applied():
                        scores["eval_ema_accuracy"] = score(self.eval_shards, "EMA")
            if val:
                scores["val_accuracy"] = score(self.val_shards, split="val")
        self.clock.spent("evaluation", evaluating, time.perf_counter())
        return scores

    # --- report and checkpoint -------------------------------------------------------------------
    def take_report(
        self, stats: StepStats, epoch: int, *, save: bool, evaluation: dict[str, float] | None = None
    ) -> None:
        """Collective: this step's report (``epoch``: the one it trained in), taken without waiting for the
        device (`Pending`; with ``save``, a checkpoint's `Checkpointer.take`) and finished at the next step
        boundary (`finish_report`). A run whose lease on --out was taken over stops here, before the row."""
        me, state = self.me, self.state
        if lost := lease.agreed_lost(self.lease, self.config.run_dir, me.rank, me.group):  # a rerun's?
            raise StopRun(lost)
        window, self.window = self.window, self.window.close(stats.grad_norm, self.skipped)
        check = self.checkpointer.take(state, self.cursor) if save else None
        self.pending = Pending(window, state.step, epoch, stats.lr, self.cursor.counts, evaluation, check)

    def finish_report(self) -> None:
        """Collective: the `Pending` report, if any: wait for the device to have run its step (no later
        step), check the skipped steps, then the report (with its checkpoint), the row and the log line.
        Weights that are not finite are not saved: the run stops."""
        if self.pending is None:
            return
        p, self.pending = self.pending, None
        self.hang.at("report", self.state.step + 1)
        counts = p.window.wait()
        error = self.skipped.check(
            self.state, p.step, counts, self.config.optim.max_skipped_steps, self.me.rank
        )
        if error:
            raise StopRun(error)
        metrics = p.window.reduce(
            step=p.step,
            epoch=p.epoch,
            lr=p.lr,
            samples_seen=p.counts.total,
            bad_samples=p.counts.bad,
            skipped_steps=self.state.skipped_steps,
            flops_per_image=self.objective.flops_per_image(),
            peak_tflops=self.peak_tflops,
            has_accuracy=self.objective.has_accuracy,
            group=self.me.group,
        )
        metrics.update(p.evaluation or {})
        metrics.update(self.plan.metrics(p.counts, self.me.group))  # mixed: where it is in each source
        assert p.window.end is not None  # the window ended where the device ran its step (`wait`)
        metrics.update(self.clock.row(p.step, p.window.end))  # its time, and the run's account then
        if p.checkpoint is None:
            self.session.report(metrics)
        else:
            metrics["checkpoint_stall_s"] = self.save(p.checkpoint, metrics)
        if self.log is not None:
            log_line(format_line(metrics, self.config.last_step, self.run_start, self.first_step))
            self.log.append(metrics, flush=p.checkpoint is not None)
            if p.checkpoint is not None or self.config.run_dir.is_local:  # as metrics.jsonl is written
                self.clock.store()
        if self.probes is not None:  # the probes that landed since the last line, into their rows
            self.probes.poll()
        stacks.mark(p.step)
        self.last_metrics = metrics

    def save(self, check: FiniteCheck, row: dict[str, Any], *, written: bool = False) -> float:
        """Collective: this step's checkpoint, reported with its ``row`` (stored first unless ``written``: a
        run killed once it registers keeps the row); the seconds training waited, stored at the next flush."""
        if self.log is not None:
            self.log.flush(pending=None if written else row)
        try:
            report = {**self.report_fields, **row}  # the score --keep-best ranks by, NaN until known
            saving = time.perf_counter()
            stall = self.checkpointer.save(self.state, check, report)
            self.clock.spent("checkpoint", saving, time.perf_counter())
        except WeightsNotFinite as e:
            raise StopRun(
                f"{e} and were not saved; resume from the last checkpoint with a lower --lr or a smaller "
                "--grad-clip"
            ) from e
        if self.probes is not None:
            self.probes.expect(self.state.step)
        return stall

    def preempted(self) -> preemption.Stop:
        """Collective, at a step boundary where some rank has a preemption notice: every rank's notice
        settled into one plan (`pipeline.train.checkpointing.preemption`) and, where a checkpoint of the
        steps so far is to be made, this step's report takes it (finished at this boundary)."""
        step, run = self.state.step, self.config.run
        held = step % run.checkpoint_every == 0 or (self.resumed_from or {}).get("step") == step
        keep = preemption.agree(
            self.preemption, self.me, step, self.checkpointer, held=held, max_failures=run.max_failures
        )
        if keep.saves:
            if self.pending is not None:  # this step's log line: its row goes with the checkpoint
                check = self.checkpointer.take(self.state, self.cursor)
                self.pending = dataclasses.replace(self.pending, checkpoint=check)
            elif self.last_metrics.get("step") == step:  # its row written already, at its epoch's end
                self.save(self.checkpointer.take(self.state, self.cursor), self.last_metrics, written=True)
            else:  # no log line at this step: a row of its own
                assert self.last_stats is not None  # a step of this attempt (the one resumed is held)
                self.take_report(*self.last_stats, save=True)
        return keep

    # --- finish ----------------------------------------------------------------------------------
    def finish(self, error: str) -> dict[str, Any]:
        """Collective: the last checkpoint in storage, and its probe's record; merge every rank's bad
        samples; export the model (and with --keep-best the best checkpoint) unless the run failed."""
        closing = time.perf_counter()
        self.checkpointer.close()
        if not error and self.probe is not None:  # every rank in step until rank 0 has them
            self.clock.spent("checkpoint", closing, waiting := time.perf_counter())
            wait_in_step(self.probes, 2 * self.probe.timeout, self.me.group)
            self.clock.spent("evaluation", waiting, closing := time.perf_counter())  # the last probe
        me, merged = self.me, BadSamples.from_config(self.data_config)
        for counts in gather_bad_samples(self.cursor.counts, me.group):
            merged.merge(counts)
        lost = lease.agreed_lost(self.lease, self.config.run_dir, me.rank, me.group)
        if not (error := error or lost):
            if self.log is not None:  # the last checkpoint's stall, which followed its row's write
                self.log.flush()
            self.export()
            if self.log is not None and self.config.scoring.keep_best:  # rank 0: best/
                self.best = best.keep(
                    self.config.scoring.keep_best, self.config.run_dir, self.log, self.export_extra
                )
        self.clock.spent("checkpoint", closing, time.perf_counter())  # the last save and the exports
        if self.log is not None:
            self.log.close()  # sinks held open for the probes that land after their rows
        summary = {"metrics": self.last_metrics, "bad_samples": merged.to_dict(), "error": error}
        if self.probes is not None or self.best is not None:
            best_of = {"by": self.config.scoring.keep_best, **vars(self.best)} if self.best else None
            start = self.start or (self.probes.start if self.probes else None)
            summary.update(probe=self.probes.last if self.probes else None, best=best_of, start=start)
        # The run's account at the attempt's end, which the driver closes its session with (nothing is
        # written where another run took --out over).
        return {**summary, "resumed_from": self.resumed_from, "goodput": self.clock.at_end(store=not lost)}

    def export(self) -> None:
        """Collective: the run directory's `final/` (and `final_ema/` with an EMA of the weights)."""
        # A run resumed at the end of its schedule trained no step: its last step's row was logged.
        metrics = self.last_metrics or (self.log.row(self.state.step) if self.log else {})
        extra, exported = self.export_extra(metrics, self.state.step), self.objective.export_state
        checkpoint.export_run(self.config.run_dir, self.model, self.model_config, extra, exported, self.ema)

    def export_extra(self, metrics: dict[str, Any], step: int) -> dict[str, Any]:
        """What an export of the weights at ``step`` records beside them (its config.json): the objective,
        the preprocessing, the run's figures at that step (``metrics``: its row) and the run's config."""
        config = self.config
        return {
            **self.objective.checkpoint_meta(),  # MAE: objective, mask ratio, decoder (not exported)
            "preprocessing": self.data_config.to_dict(),
            "training": {
                "step": step,
                "max_steps": config.optim.max_steps,
                "finished": step >= config.optim.max_steps,
                **{key: metrics.get(key) for key in ("loss", *(key for key, *_ in ACCURACIES), *SCORES)},
                "config": config.to_dict(),
            },
        }

    # --- the best checkpoint (--keep-best) -------------------------------------------------------
    def score_start(self) -> None:
        """Collective, before a fine-tuning's first step with --keep-best: its starting point (the pretrained
        weights under its first head) scored and exported as best/, so best/ is never worse than the start
        (`pipeline.train.scoring.best`). eval: the validation split's accuracy, here; probe, knn: the probe
        of best/ beside training (its record into best/'s own); loss: no score yet. Not again on resume."""
        kind = self.config.scoring.keep_best
        if kind in (None, "loss") or not self.config.arch.weights or self.resumed_from is not None:
            return
        scores = self.evaluate(test=False, val=True) if kind == "eval" else {}
        self.start = {"step": 0, "checkpoint": best.BEST, **scores} if scores else None
        key, _ = best.SCORES[kind]
        extra = best.training_record(self.export_extra(scores, 0), kind, 0, scores.get(key))
        where = self.config.run_dir.join(best.BEST)
        checkpoint.export_into(where, self.model, self.model_config, extra, self.objective.export_state)
        if self.probes is not None and self.probe is not None and kind in ("probe", "knn"):
            submit(self.probe, best.BEST, 0)
            self.probes.expect(0)
