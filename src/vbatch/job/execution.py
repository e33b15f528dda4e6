"""One process's run of a job: admission, LLM.stream, commits, signals, engine death, completion."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from vbatch.engine_sets.base import EngineSet, StartupCancelled
from vbatch.engine_sets.factory import open_engine_set, starts_briefly
from vbatch.errors import (
    ConfigError,
    InputError,
    ModelLoadError,
    OutputLostError,
    SettledStartupError,
    VbatchError,
    is_storage_failure,
    storage_error,
    unexpected_error,
)
from vbatch.job.finalize import finalize
from vbatch.job.journal import Journal
from vbatch.job.manifest import Manifest
from vbatch.job.options import RunOptions
from vbatch.job.paths import resume_command
from vbatch.job.reader import InputReader
from vbatch.job.results import (
    HIDDEN_KEYS,
    TokenStrings,
    error_row,
    openai_line,
    parquet_schema,
    result_row,
)
from vbatch.job.rows import InputRow, RowParser
from vbatch.job.stopping import StopControl, StopNow, StopOnSignal
from vbatch.job.tasks import (
    Task,
    embedding_dimension,
    pooled_error_row,
    pooled_row,
    pooling_params,
    task_schema,
)
from vbatch.job.validation import OutputChecker
from vbatch.job.writer import open_writer
from vbatch.lora.request import startup_requests
from vbatch.models.config import read_id2label, read_problem_type
from vbatch.sampling_params import SamplingParams

EXIT_INTERRUPTED = 75
MIN_IDLE_S = 0.05
# NOTE: the stream ticks at least this often, so a stop flag set by a signal is seen in time
# by engine sets that a signal must not interrupt (EngineSet.waits_briefly).
MAX_IDLE_S = 1.0


class JobExecution:
    """Drives reader -> LLM.stream -> writer -> journal in the main thread.

    Invariants: only the main thread touches the writer and the journal; signals reach the loop
    only through `self.stop` (StopControl); rows aborted or still in flight when the run ends
    are not committed (they rerun).
    """

    def __init__(
        self,
        job_dir: Path,
        manifest: Manifest,
        journal: Journal,
        options: RunOptions,
        llm_factory: Callable[..., EngineSet] | None,
    ) -> None:
        self.job_dir = job_dir
        self.manifest = manifest
        self.journal = journal
        self.options = options
        self.llm_factory = llm_factory or open_engine_set
        self.columns = manifest.options.columns
        self.defaults = SamplingParams.from_dict(manifest.sampling)
        # NOTE: the job's columns were checked against the input when it was created; these
        # are resolved from the whole input (--keep-all-columns, a mixed id key).
        lora_rows = manifest.lora_rows
        self.reader = InputReader(
            Path(manifest.input_path),
            manifest.input_format,
            self.columns,
            check_columns=False,
            extra_columns=(lora_rows.column,) if lora_rows and lora_rows.column else (),
        )
        model = manifest.model
        # NOTE: an OpenAI line may name an adapter as its body.model.
        served = {
            model.source,
            model.name,
            model.repo_id,
            *manifest.options.served_model_names,
            *(lora_rows.names if lora_rows else ()),
        }
        self.parser = RowParser(
            self.columns,
            self.defaults,
            manifest.options.chat_template_kwargs,
            model_names=frozenset(name for name in served if name),
            openai_defaults=self.defaults.updated(manifest.options.openai_defaults),
            loras=lora_rows,
        )
        self.task = manifest.options.task
        self.task_params = pooling_params(self.task, manifest.options.dimensions)
        self.labels: dict[int, str] = {}
        self.problem_type: str | None = None
        self.schema = None
        # NOTE: the width of a Parquet embed job's vector columns (None: any width).
        self.dimension: int | None = None
        if manifest.output_format == "parquet":
            kept = self.columns.keep_columns
            self.schema = parquet_schema(
                manifest.id_kind,
                kept,
                self.reader.arrow_schema,
                manifest.options.parse_json,
                reasoning=manifest.options.reasoning_parser is not None,
                lora=manifest.lora_rows is not None,
            )
            if self.task_params is not None:
                self.dimension = self._dimension()
                self.schema = task_schema(
                    self.task,
                    manifest.id_kind,
                    self.dimension,
                    [self.schema.field(name) for name in kept],
                )
        self.writer = open_writer(job_dir, journal, manifest, self.schema)
        self.lora_requests = startup_requests(manifest.engine.get("loras"))
        self.in_flight: dict[int, InputRow] = {}
        self.num_errors = len(journal.state.errors)
        self.num_invalid = 0
        self.checker = OutputChecker()
        self.max_errors = self._max_errors(options.max_errors)
        self.stop = StopControl(options.drain_timeout_s)
        self.is_stop_shown = False
        # NOTE: a resumed job's committed errors count against its limit as new ones do.
        self.is_over_error_limit = self.max_errors is not None and self.num_errors > self.max_errors
        self.is_finalizing = False
        self.last_commit_time = time.monotonic()
        self.token_text: Callable[[int], str] = str
        self.token_bytes: Callable[[int], list[int]] | None = None
        self.metrics: Any = None
        self.interruptible = True
        # NOTE: run just before the job's own signal handling takes over (a new job's command
        # hands SIGTERM back there: until then it interrupts as SIGINT does).
        self.before_signals: Callable[[], None] | None = None

    def _dimension(self) -> int | None:
        if self.task != Task.EMBED.value:
            return None
        return embedding_dimension(self._model_dir(), self.manifest.options.dimensions)

    def _model_dir(self) -> Path:
        from vbatch.models.loader import resolve_model

        return resolve_model(self.manifest.model_to_load()).hf_dir

    def _max_errors(self, limit: float | None) -> int | None:
        if limit is None:
            return None
        if 0 < limit < 1:
            return int(limit * self.manifest.num_rows)
        return int(limit)

    def run(self, output: Path) -> tuple[int, str]:
        """Run to completion or interruption; returns (exit code, message for the user)."""
        from rich.console import Console

        from vbatch.job.metrics import JobMetrics
        from vbatch.job.progress import ProgressDisplay

        state = self.journal.state
        self.metrics = JobMetrics(
            total_rows=self.manifest.num_rows,
            rows_done_before=len(state.committed),
            rows_errored_before=len(state.errors),
            model=self.manifest.model.name,
            input_path=self.manifest.input_path,
            output_path=str(output),
            task=self.manifest.options.task,
        )
        self.parser.warn = self.metrics.add_notice
        display = ProgressDisplay(
            self.metrics,
            mode=self.options.display,
            console=Console(stderr=True),
            log_interval_s=self.options.log_interval_s,
            metrics_file=self.options.metrics_file,
        )
        with display:
            try:
                return self._run(output)
            except BaseException:
                self.metrics.set_state("failed")
                raise

    def _run(self, output: Path) -> tuple[int, str]:
        # NOTE: outside the engine loop (finalize above all) a signal stops the run at once;
        # what is committed stays committed, and resume redoes the rest.
        if self.before_signals is not None:
            self.before_signals()
        try:
            with StopOnSignal():
                return self._run_job(output)
        except StopNow:
            self.journal.check_still_there()
            self.metrics.set_state("interrupted")
            num_done = len(self.journal.state.committed)
            return EXIT_INTERRUPTED, (
                f"interrupted: {num_done} of {self.manifest.num_rows} rows are committed"
                + (" (the final output was not written)" if self.is_finalizing else "")
                + f". Resume with:\n  {resume_command(output)}"
            )

    def _run_job(self, output: Path) -> tuple[int, str]:
        with self.stop:
            try:
                if (
                    len(self.journal.state.committed) < self.manifest.num_rows
                    and not self.is_over_error_limit
                ):
                    self._run_engine()
            except EngineNeverReady:
                raise
            except Exception as e:
                raise self._resumable(e, output, commit=True) from e
            finally:
                self.writer.close()
        num_done = len(self.journal.state.committed)
        if self.is_over_error_limit:
            given = self.options.max_errors
            shown = f"{given:g}" if isinstance(given, float) else given
            if num_done >= self.manifest.num_rows:
                raise InputError(
                    f"stopped: all {num_done} rows are committed, but {self.num_errors} "
                    f"errored, more than --max-errors {shown}, so the job is not complete; "
                    f"see the `error` field of the output rows. Rerun them with "
                    f"`{resume_command(output)} --retry-errors`, or accept them with "
                    f"`{resume_command(output)} --max-errors {self.num_errors}`"
                )
            raise InputError(
                f"stopped: {self.num_errors} rows errored, more than --max-errors "
                f"{shown}. {num_done} rows are committed; see the `error` field "
                f"of the output rows. Fix the input, or continue with "
                f"`{resume_command(output)} --max-errors N`"
            )
        if num_done < self.manifest.num_rows and not self.stop.is_stopping:
            raise InputError(
                f"{self.manifest.input_path} ended before the {self.manifest.input_rows} rows it "
                f"had when the job started: it changed during the job. {num_done} rows are "
                f"committed; restore the input and run `{resume_command(output)}`"
            )
        if num_done >= self.manifest.num_rows:
            self.metrics.set_state("committing")
            self.is_finalizing = True
            try:
                finalize(
                    self.job_dir,
                    Path(self.manifest.output_path),
                    self.journal,
                    self.schema,
                    ordered=self.manifest.options.ordered,
                )
            except Exception as e:
                raise self._resumable(e, output, commit=False) from e
            self.metrics.set_state("done")
            invalid = (
                f", {self.num_invalid} with JSON invalid against its schema (structured_valid)"
                if self.num_invalid
                else ""
            )
            return 0, f"wrote {output}: {num_done} rows, {self.num_errors} errored{invalid}"
        self.journal.check_still_there()
        self.metrics.set_state("interrupted")
        return EXIT_INTERRUPTED, (
            f"interrupted: {num_done} of {self.manifest.num_rows} rows are committed. "
            f"Resume with:\n  {resume_command(output)}"
        )

    def _resumable(self, error: Exception, output: Path, *, commit: bool) -> VbatchError:
        """The error to show when a run fails: its cause, what is committed, how to resume.

        With `commit`, finished rows are committed first: every row handed to the writer is
        complete, so that is safe (a writer whose own write failed refuses; its rows rerun). An
        output lost outside vbatch cannot be resumed, and says so itself."""
        if isinstance(error, OutputLostError):
            return error
        try:
            self.journal.check_still_there()
        except OutputLostError as lost:
            return lost
        note = ""
        if commit:
            try:
                self._commit()
            except Exception as commit_error:
                if commit_error is not error:
                    note = f" (committing the other finished rows failed: {commit_error})"
        if isinstance(error, OSError) and is_storage_failure(error):
            error = storage_error(error, then="then resume the job")
        message = str(error) if isinstance(error, VbatchError) else unexpected_error(error)
        hint = (
            f"{len(self.journal.state.committed)} rows are committed{note}. "
            f"Resume with: {resume_command(output)}"
        )
        return (type(error) if isinstance(error, VbatchError) else VbatchError)(
            f"{message}\n{hint}"
        )

    def _open_engine_set(self, engine_args: dict[str, Any]) -> Any:
        """The job's engine set, ready. A settled failure to start it (a model that cannot load,
        settings refused), in a job that never committed a row, is EngineNeverReady: the runner
        then drops a job that a resume could only fail again."""
        try:
            return self.llm_factory(
                self.manifest.model_to_load(),
                ray=self.options.ray,
                max_in_flight=self.options.max_in_flight,
                data_parallel_size=self.options.data_parallel_size,
                on_progress=self.metrics.set_startup_stage,
                on_notice=self.metrics.add_notice,
                should_stop=lambda: self.stop.is_stopping,
                **engine_args,
            )
        except (ModelLoadError, ConfigError, SettledStartupError) as e:
            if self.journal.state.num_records:
                raise
            raise EngineNeverReady(e) from e

    def _run_engine(self) -> None:
        self.metrics.set_state("loading model")
        # NOTE: rows take the run's sampling settings, never the model's generation_config
        # defaults, which are then not read (an invalid one failed every job).
        engine_args = {**self.manifest.engine, "generation_config": "vllm"}
        self.interruptible = not starts_briefly(self.options.ray)
        self.stop.is_waiting = self.interruptible
        self.stop.starting = True
        try:
            llm = self._open_engine_set(engine_args)
        except (StopNow, StartupCancelled):
            return
        finally:
            self.stop.is_waiting = self.stop.starting = False
        self.interruptible = not getattr(llm, "waits_briefly", False)
        try:
            self.metrics.set_engine_info(llm.engine_info)
            self._record_kernels(llm.engine_info.kernels)
            self.metrics.set_stats_source(lambda: llm.latest_stats, llm.engine_reports)
            tokens = TokenStrings(lambda: llm.tokenizer)
            self.token_text, self.token_bytes = tokens.text, tokens.bytes
            if self.task == Task.CLASSIFY.value:
                model_dir = self._model_dir()
                self.labels = read_id2label(model_dir)
                self.problem_type = read_problem_type(model_dir)
            self.metrics.set_state("running")
            self._loop(llm)
            self._commit()
        finally:
            # NOTE: one last look at the engines while they are as the run left them (a dead
            # core shows as dead in the final metrics file), before they are shut down.
            self.metrics.snapshot()
            self.metrics.set_stats_source(None, None)
            with contextlib.suppress(VbatchError):
                llm.shutdown()

    def _record_kernels(self, kernels: list[str]) -> None:
        if kernels and kernels != self.manifest.kernels:
            self.manifest.kernels = list(kernels)
            self.manifest.save(self.job_dir)

    def _loop(self, llm: EngineSet) -> None:
        # NOTE: with idle_s, the stream also yields None when no row finished for that long, so
        # the time-based commit fires while every row in flight is slow (or the engine stalls).
        every_s = self.options.commit_every_seconds
        idle_s = min(max(every_s, MIN_IDLE_S), MAX_IDLE_S)
        stream = llm.stream(self._requests(), self.defaults, idle_s=idle_s)
        try:
            while not self.stop.stop_now:
                self.stop.is_waiting = self.interruptible
                try:
                    result = next(stream)
                except StopIteration:
                    break
                finally:
                    self.stop.is_waiting = False
                self._show_stop()
                if result is None:
                    if (
                        self.writer.num_pending
                        and time.monotonic() - self.last_commit_time >= every_s
                    ):
                        self._commit()
                    continue
                row = self.in_flight.pop(result.index)
                pooled_task = self._pooled_task(row)
                if pooled_task is not None:
                    values = pooled_row(
                        row,
                        result,
                        pooled_task,
                        self.labels,
                        include_tokens=self.manifest.options.include_token_ids,
                        problem_type=self.problem_type,
                    )
                    self._emit(row, values, is_input_error=_refused(result))
                    continue
                if result.error is None and any(o.finish_reason == "abort" for o in result.outputs):
                    continue
                self._emit(row, self._result_values(row, result), is_input_error=_refused(result))
        except StopNow:
            pass
        finally:
            self.stop.is_waiting = False
            stream.close()

    def _requests(self) -> Iterator[Any]:
        from vbatch.llm import Request

        committed = self.journal.state.committed
        # NOTE: rows appended to the input after the job counted it are not this job's.
        rows = self.reader.rows(
            self.parser, committed, self.manifest.shard_spec, self.manifest.input_rows
        )
        for row in rows:
            self.stop.is_waiting = False
            if self.stop.is_stopping:
                self._show_stop()
                break
            if row.error is None:
                row.error = self._task_mismatch(row)
            if row.error is not None:
                task = self._pooled_task(row)
                values = (
                    error_row(row, row.error)
                    if task is None
                    else pooled_error_row(row, str(task), row.error)
                )
                self._emit(row, values, is_input_error=True)
                continue
            self.in_flight[row.index] = row
            self.checker.note((row.sampling_params or self.defaults).structured)
            self.stop.is_waiting = self.interruptible
            yield Request(
                id=row.id,
                index=row.index,
                prompt=row.prompt,
                messages=row.messages,
                sampling_params=row.sampling_params,
                chat_template_kwargs=row.chat_template_kwargs,
                pooling_params=row.pooling_params or self.task_params,
                lora_request=None if row.lora is None else self.lora_requests[row.lora],
            )
        self.stop.is_waiting = self.interruptible

    def _pooled_task(self, row: InputRow) -> str | None:
        """The pooling task whose row shape `row` gets (an embeddings line's in any job)."""
        if row.openai_kind == "embeddings":
            return Task.EMBED.value
        return None if self.task_params is None else self.task

    def _task_mismatch(self, row: InputRow) -> str | None:
        """Why `row` cannot run in this job's task, or None; an embeddings line that gives no
        `dimensions` takes the job's `--dimensions` here."""
        where = row.location
        if self.task_params is not None and row.openai_kind in ("chat", "completions"):
            return f"{where}: a {row.openai_kind} line in a --task {self.task} job"
        if self.task_params is not None and row.openai_kind is None:
            if row.sampling_params is not None:
                return (
                    f"{where}: the row's sampling_params (or response_format, guided) are "
                    f"generation settings, not read by a --task {self.task} job"
                )
            if self.manifest.options.openai_output and self.task != Task.EMBED.value:
                return (
                    f"{where}: a plain row in an OpenAI Batch file has no OpenAI response shape "
                    f"in a --task {self.task} job; put the plain rows in a file of their own"
                )
        if row.openai_kind == "embeddings" and self.task not in ("embed", "generate"):
            return f"{where}: an embeddings line in a --task {self.task} job"
        if row.openai_kind == "embeddings" and self.task == "generate" and self.schema is not None:
            return f"{where}: embeddings lines in a Parquet output need --task embed"
        params = row.pooling_params
        if row.openai_kind == "embeddings" and params is not None:
            job_dimensions = self.manifest.options.dimensions
            if params.dimensions is None and job_dimensions is not None:
                row.pooling_params = params = msgspec.structs.replace(
                    params, dimensions=job_dimensions
                )
            wanted = params.dimensions
            if self.dimension is not None and wanted is not None and wanted != self.dimension:
                if job_dimensions is None and wanted > self.dimension:
                    return (
                        f"{where}: body.dimensions {wanted} exceeds the model's embedding size "
                        f"{self.dimension}"
                    )
                return (
                    f"{where}: body.dimensions {wanted} is not this job's embedding width "
                    f"{self.dimension}: a Parquet output holds one width (give --dimensions "
                    f"{wanted}, or write JSONL)"
                )
        return None

    def _result_values(self, row: InputRow, result: Any) -> dict[str, Any]:
        """The output row of a finished request; an error row when building it raised."""
        options = self.manifest.options
        params = row.sampling_params or self.defaults
        structured = params.structured
        try:
            return result_row(
                row,
                result,
                include_token_ids=options.include_token_ids,
                parse_json=options.parse_json,
                reasoning_parser=options.reasoning_parser,
                check=(
                    functools.partial(self.checker.check, structured)
                    if structured is not None and structured.is_json
                    else None
                ),
                require_valid=options.require_valid_json,
                end_token_text=self.token_text if params.include_stop_str_in_output else None,
            )
        except VbatchError:
            raise
        except Exception as e:
            return error_row(row, _unwritable(row, e), len(result.prompt_token_ids))

    def _emit(self, row: InputRow, values: dict[str, Any], *, is_input_error: bool) -> None:
        """Hand one output row to the writer. A row that cannot be encoded (a kept value nested
        too deep for JSON, say) is written as an error row without its kept columns."""
        try:
            line = self._line(row, values)
            for key in HIDDEN_KEYS:
                values.pop(key, None)
            self.writer.add(values, row.kept, line)
        except VbatchError:
            raise
        except Exception as e:
            values = error_row(row, _unwritable(row, e), values["prompt_tokens"])
            self.writer.add(values, None, self._line(row, values))
            is_input_error = True
        if values.get("structured_valid") is False:
            self.num_invalid += 1
        is_error = values["error"] is not None
        self.metrics.on_result(
            finish_reason=values["finish_reason"],
            prompt_tokens=values["prompt_tokens"],
            completion_tokens=values.get("completion_tokens", 0),
            cached_tokens=values.get("cached_tokens", 0),
            error_kind=("input" if is_input_error else "engine") if is_error else None,
        )
        if is_error:
            self.num_errors += 1
            if self.max_errors is not None and self.num_errors > self.max_errors:
                self.is_over_error_limit = True
                self.stop.request_stop()
        options = self.options
        if self.writer.num_pending >= options.commit_every_rows or (
            time.monotonic() - self.last_commit_time >= options.commit_every_seconds
        ):
            self._commit()

    def _line(self, row: InputRow, values: dict[str, Any]) -> dict[str, Any] | None:
        if not self.manifest.options.openai_output:
            return None
        # NOTE: as vLLM, responses name the model by its first served name, if given.
        name = next(iter(self.manifest.options.served_model_names), self.manifest.model.name)
        return openai_line(row, values, name, self.token_text, self.token_bytes)

    def _commit(self) -> None:
        self.writer.commit()
        self.last_commit_time = time.monotonic()
        self.metrics.on_commit(rows_committed=len(self.journal.state.committed))

    def _show_stop(self) -> None:
        """Show a stop request on the dashboard (from the main thread: JobMetrics locks)."""
        if self.stop.stop_requested and not self.is_stop_shown:
            self.is_stop_shown = True
            self.metrics.set_state("draining")
            self.metrics.set_drain_deadline(self.stop.drain_deadline)


class EngineNeverReady(VbatchError):
    """The engine of a job that never committed a row failed to start (`cause`) for a settled
    reason: a job with nothing done that a resume would fail again."""

    def __init__(self, cause: VbatchError) -> None:
        self.cause = cause
        super().__init__(str(cause))


def _refused(result: Any) -> bool:
    """Whether the LLM refused a request before the engine saw it (bad params, a chat the
    template cannot render): an error with no prompt tokens is the row's, not the engine's."""
    return result.error is not None and not result.prompt_token_ids


def _unwritable(row: InputRow, error: Exception) -> str:
    return f"{row.location}: the output row could not be written: {type(error).__name__}: {error}"
