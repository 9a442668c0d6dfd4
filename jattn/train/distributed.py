"""Starting JAX on several processes, and agreeing on preemption.

`initialize` calls `jax.distributed.initialize`:

- with the explicit arguments when `--coordinator_address`, `--num_processes`
  and `--process_id` are given (e.g. two processes on 127.0.0.1);
- with no arguments when the environment is a cluster JAX detects itself: a
  SLURM job step with more than one task, a multi-host TPU slice that
  advertises its workers (TPU_WORKER_HOSTNAMES, as on GKE), or whenever
  ``JATTN_DISTRIBUTED=1`` (launch/tpu_vm.sh sets it: on TPU VMs JAX finds
  the peers from the metadata server);
- not at all otherwise (one process sees all local devices).

Several CPU processes need a collectives backend; gloo is selected before the
backend starts (it only affects the CPU client, so GPU/TPU runs are unchanged).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import weakref

import jax

__all__ = [
    "PreemptionWatch",
    "Terminated",
    "cluster_detected",
    "dropped_there",
    "initialize",
    "warn",
]


def cluster_detected(env: dict[str, str] | None = None) -> bool:
    """True in a multi-task SLURM step, a multi-host TPU slice, or with JATTN_DISTRIBUTED=1."""
    env = os.environ if env is None else env
    if env.get("JATTN_DISTRIBUTED") == "1":
        return True
    slurm_tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or "1"
    if env.get("SLURM_JOB_ID") and slurm_tasks.isdigit() and int(slurm_tasks) > 1:
        return True
    tpu_hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    return "," in tpu_hosts or bool(env.get("MEGASCALE_COORDINATOR_ADDRESS"))


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Starts the distributed runtime if this is a multi-process run.

    Returns:
      True if `jax.distributed.initialize` was called.

    Raises:
      ValueError: only some of the three explicit arguments were given.
    """
    explicit = (coordinator_address, num_processes, process_id)
    if any(a is not None for a in explicit):
        if any(a is None for a in explicit):
            raise ValueError(
                "--coordinator_address, --num_processes and --process_id go together; got "
                f"coordinator_address={coordinator_address!r}, num_processes={num_processes!r}, "
                f"process_id={process_id!r}"
            )
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process_id={process_id} must be in [0, {num_processes})")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
        return True
    if cluster_detected():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize()
        return True
    return False


# How long a SIGTERM that arrived where an exception would be dropped waits to be
# delivered again (`PreemptionWatch`).
_AGAIN_S = 0.05


def dropped_there(frame) -> bool:
    """Whether an exception raised by a signal handler in `frame` would be dropped.

    Python runs a signal handler in whatever frame the main thread executes. In
    a garbage collector callback (jax registers one: ``_xla_gc_callback``,
    often running while jax imports or compiles), a ``__del__`` finaliser or a
    `weakref.finalize` callback (``Exception ignored in: <finalize object>``:
    a SIGTERM 2 s into start-up, CI's fault sweep, 2026-12-06), an exception is
    printed as ``Exception ignored in: ...`` and lost: a handler that raised
    `Terminated` or `SystemExit` there let the run go on to its last step
    (issue 54).
    """
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    callbacks.add(weakref.finalize.__call__.__code__)
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


class Terminated(SystemExit):
    """SIGTERM at a moment the loop cannot save at (start-up, final evaluation), or a
    second SIGTERM. A SystemExit (status 143, as the signal's default would give when
    nobody catches it), so that neither ``except Exception`` nor asyncio's tasks,
    which keep other BaseExceptions (orbax runs its file operations in them),
    swallow it.

    Attributes:
      stage: "start-up", "training" (a second SIGTERM), "blocked" (no step
        finished within `PreemptionWatch.grace_s` of the first) or "finishing".
    """

    def __init__(self, stage: str):
        super().__init__(128 + 15)
        self.stage = stage

    def __str__(self) -> str:
        return f"SIGTERM during {self.stage}"


class PreemptionWatch:
    """Tells the loop, at a step every process agrees on, that SIGTERM arrived.

    One process: a SIGTERM handler (installed only from the main thread; the
    previous handler is restored by `close`). While `stage` is "training"
    the first SIGTERM sets a flag that the loop reads after each step, so it
    saves that step and exits (and once more when it ends: `requested`); any
    other stage ("start-up", "finishing"), and a second SIGTERM while the
    first waits for its save, raises `Terminated` at once, so that a run
    blocked before its first step, in a save or in data loading still ends
    when told. Never where the exception would be dropped (`dropped_there`):
    there the signal is delivered again 50 ms later; and a `Terminated`
    dropped where that could not be seen is delivered again by
    `sys.unraisablehook`. A first SIGTERM that the loop does not see within
    `grace_s` (a step or a batch that never comes) is delivered again to the
    main thread, which then raises `Terminated` with stage "blocked".
    Several processes: JAX's preemption sync point, so that all of them stop
    at the same step and write one consistent checkpoint.
    """

    def __init__(self, stage: str = "training", grace_s: float = 60.0) -> None:
        self._flag = threading.Event()
        self.grace_s = grace_s
        self._timer: threading.Timer | None = None
        self._previous = None
        self.stage = stage
        self._raised: str | None = None  # the stage of a Terminated already raised
        self._multi = jax.process_count() > 1
        self._previous_hook = None
        if not self._multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)
            self._previous_hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        if self.stage == "training" and not self._flag.is_set():
            self._flag.set()
            self._timer = threading.Timer(self.grace_s, self._unblock)
            self._timer.daemon = True
            self._timer.start()
        elif dropped_there(frame):
            # Raised here, Terminated would be printed as "Exception ignored" and the
            # run would go on: the signal is delivered again in a moment, elsewhere.
            self._again()
        else:
            self._raised = self.stage
            raise Terminated(self.stage)

    @staticmethod
    def _again() -> None:
        later = threading.Timer(_AGAIN_S, signal.pthread_kill,
                                (threading.main_thread().ident, signal.SIGTERM))  # fmt: skip
        later.daemon = True
        later.start()

    def _unraisable(self, unraisable) -> None:
        """`sys.unraisablehook` while the watch is open: a `Terminated` that Python
        dropped where `dropped_there` could not tell (a plain weakref callback's
        frame looks like any other) is delivered again, not printed."""
        if isinstance(unraisable.exc_value, Terminated):
            self._again()
        else:
            self._previous_hook(unraisable)

    def enter(self, stage: str) -> None:
        """Moves the watch to `stage` ("training" when the loop starts). A `Terminated`
        raised earlier that never ended the run (caught and dropped on its way up, by a
        bare ``except:`` or ``except BaseException``) is raised again here: the likely
        way a SIGTERM 2 s into start-up once let a test run train all its steps with
        no word (CI, 2026-12-06)."""
        if self._raised is not None:
            raise Terminated(self._raised)
        self.stage = stage

    def _unblock(self) -> None:
        """The loop did not see the flag in time: interrupt whatever blocks it."""
        self.stage = "blocked"
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    @property
    def requested(self) -> bool:
        """Whether a first SIGTERM set the flag (one process), seen by `reached` or not:
        the loop reads it once more when it ends, for one that came during the last
        step's log, evaluation or save."""
        return self._flag.is_set()

    def reached(self, step: int) -> bool:
        """True once a preemption notice has arrived (the same step on every process)."""
        if self._multi:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            try:
                return bool(multihost_utils.reached_preemption_sync_point(step))
            except RuntimeError:  # no preemption manager: not started by jax.distributed
                return False
        if self._flag.is_set() and self._timer is not None:
            self._timer.cancel()  # seen: the loop saves and stops by itself
            self._timer = None
        return self._flag.is_set()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self._previous_hook is not None:
            sys.unraisablehook = self._previous_hook
            self._previous_hook = None


def warn(line: str) -> None:
    """One line on stderr (process 0 only): a skipped checkpoint, archived metrics, ..."""
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)
