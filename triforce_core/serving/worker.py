"""The one scheduler: a background thread that runs every generation, round-robin.

The model is shared by every caller (the app's users, the `chat` endpoint, the HTTP API);
each has their own caches (a `ChatSession` or a `Slot`). Only this thread touches the engine,
so two callers can never interleave inside a forward or write to each other's caches. Several
generations advance together: the worker takes one event from each active job in turn, and
an event is at most one speculation round or one prefill chunk (generations started with
`progress_events=True` yield a `PrefillProgress` after each chunk), so a long prefill of one
caller does not freeze the others' streams.

    job = worker.submit(lambda: session.ask("...", progress_events=True))
    for item in job:          # the events, in order; errors re-raised here
        ...
    job.cancel()              # stop: the generator is closed within one round or chunk

Stepping (the app's step mode): a job submitted with `pause_after` (a test on each item, e.g.
"this ends a speculation round") and `stepping` on waits after every such item until `step()`
is called, without holding up the other jobs; `set_stepping(False)` lets it run on, and
`cancel()` stops it whether it waits or not. `job.waits` records each wait: the item it
followed and the seconds it lasted (a generation's own clock runs on while it waits, so a
consumer leaves these out of its speeds).

What a job shares the worker with: before its first event `worker.ahead_of(job)` counts the
requests it waits behind and `worker.sharing(job)` the other answers it will advance beside;
`job.ran_with` holds the other generations whose events the worker ran between this job's own
(a speed measured over such a job is not the job's alone). A `call` is no generation: it counts
as a request ahead, never in `ran_with`.

`ThreadWorker` runs the same `Job`s each on a thread of its own, for generations that wait on a
remote engine (`remote`) rather than compute in this process.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from typing import Callable, Iterator


_END = object()
_NUMBERS = itertools.count(1)  # each job's number, for `ran_with`


class Job:
    """A generation submitted to the worker; iterate it to receive its items."""

    def __init__(self, start: Callable[[], Iterator], pause_after: Callable[[object], bool] | None = None,
                 stepping: bool = False, generation: bool = True):
        self._start = start
        self.number = next(_NUMBERS)
        self.generation = generation  # False: a `call` (one function run on the worker)
        self.started = False  # the worker has begun it (called `start()`)
        self.ran_with: set[int] = set()  # numbers of the other generations run between this job's events
        self._worked = False  # it advanced in the worker's current pass
        self._items: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()
        self.finished = threading.Event()
        self.stopped = False  # True when the job ended because of cancel()
        self._gen: Iterator | None = None
        self._pause_after = pause_after
        self.stepping = stepping and pause_after is not None
        self._lock = threading.Lock()
        self._steps = 0  # step() calls not used yet
        self._held = False  # the last item was a pause point
        self._wake: threading.Condition | None = None  # the worker's, set when submitted
        self.steps_taken = 0
        self._held_item: object = None  # the item the job pauses after
        self._wait_from: float | None = None  # when its current wait for step() began
        self.waits: list[tuple[object, float]] = []  # (item paused after, seconds waited), in order

    def cancel(self) -> None:
        self._cancelled.set()
        self._nudge()

    def step(self) -> None:
        """Stepping: let the job run to its next pause point."""
        with self._lock:
            self._steps += 1
        self._nudge()

    def set_stepping(self, on: bool) -> None:
        """Turn stepping on (pause at the next pause point) or off (run on)."""
        with self._lock:
            self.stepping = bool(on) and self._pause_after is not None
            if self.stepping and self._held and self._wait_from is None:  # paused from now on
                self._wait_from = time.perf_counter()
        self._nudge()

    @property
    def waiting(self) -> bool:
        """Paused at a pause point until `step()` (or stepping off, or cancel)."""
        with self._lock:
            return self.stepping and self._held and self._steps == 0 and not self._cancelled.is_set() \
                and not self.finished.is_set()

    def _nudge(self) -> None:
        if self._wake is not None:
            with self._wake:
                self._wake.notify()

    @property
    def waited_s(self) -> float:
        """Seconds spent waiting for `step()` so far (waits that have ended)."""
        return sum(seconds for _item, seconds in list(self.waits))

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def pending(self) -> bool:
        """Items (or the end) are queued, so `get` returns at once."""
        return not self._items.empty()

    def __iter__(self):
        while True:
            item = self._items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def get(self, timeout: float):
        """The next item, `None` after `timeout` seconds without one; raises StopIteration at the end."""
        try:
            item = self._items.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _END:
            self._items.put(_END)  # stay at the end for later calls
            raise StopIteration
        if isinstance(item, BaseException):
            self._items.put(_END)
            raise item
        return item

    def stream(self, tick: float):
        """Items as they come, and `None` after every `tick` seconds without one (a chance to
        refresh a page); ends with the job, errors re-raised."""
        while True:
            try:
                yield self.get(timeout=tick)
            except StopIteration:
                return

    # -- worker side -----------------------------------------------------------------------
    def _step(self) -> bool:
        """Advance by one event; False when the job is over."""
        try:
            if self._cancelled.is_set():
                self.stopped = True
                self._end_wait()
                if self._gen is not None:
                    self._gen.close()  # the engine stops between rounds
                return self._end()
            if self._held:
                with self._lock:
                    if self.stepping:
                        if self._steps == 0:
                            return True  # waiting for step(): nothing to do this turn
                        self._steps -= 1
                        self.steps_taken += 1
                    self._held = False
                self._end_wait()
            self._worked = True
            if self._gen is None:
                self.started = True
                self._gen = self._start()
            item = next(self._gen)
            self._items.put(item)
            self._held = self._pause_after is not None and bool(self._pause_after(item))
            self._held_item = item if self._held else None
            if self._held and self.stepping:  # its wait for step() begins now
                self._wait_from = time.perf_counter()
            return True
        except StopIteration:
            return self._end()
        except BaseException as e:  # reported to the consumer, the worker lives on
            self._items.put(e)
            return self._end()

    def _end_wait(self) -> None:
        if self._wait_from is not None:
            self.waits.append((self._held_item, time.perf_counter() - self._wait_from))
            self._wait_from = None

    def _end(self) -> bool:
        self._items.put(_END)
        self.finished.set()
        return False


class EngineWorker:
    """A daemon thread that owns every use of the engine (see the module docstring)."""

    def __init__(self, name: str = "triforce-worker"):
        self._pending: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self._running = 0
        self._active: list[Job] = []  # the jobs of the pass under way (for ahead_of and sharing)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, start: Callable[[], Iterator], pause_after: Callable[[object], bool] | None = None,
               stepping: bool = False) -> Job:
        """Queue a generation: `start()` is called in the worker and returns its event iterator.
        With `pause_after` and `stepping`, the job waits for `step()` after each item the test
        accepts (see the module docstring)."""
        return self._queue(Job(start, pause_after, stepping))

    def _queue(self, job: Job) -> Job:
        job._wake = self._wake
        with self._wake:
            if self._closed:
                raise RuntimeError("the worker is closed")
            self._pending.append(job)
            self._wake.notify()
        return job

    def call(self, fn: Callable[[], object]):
        """Run `fn()` in the worker thread (e.g. anything touching a session's caches) and return its result."""
        def start():
            yield fn()

        return next(iter(self._queue(Job(start, generation=False))))

    def ahead_of(self, job: Job) -> int:
        """Requests (generations or calls) submitted before `job`, not finished and not waiting
        for a Step, while `job` has not started: what it waits behind. 0 once it has started."""
        with self._wake:
            if job.started or job.finished.is_set():
                return 0
            others = list(self._active) + list(self._pending)
        return sum(1 for j in others if j.number < job.number and not j.finished.is_set() and not j.waiting)

    def sharing(self, job: Job) -> int:
        """The other generations the worker runs now, not waiting for a Step: what `job` advances
        beside, one event each in turn."""
        with self._wake:
            others = list(self._active) + list(self._pending)
        return sum(1 for j in others if j is not job and j.generation and not j.finished.is_set() and not j.waiting)

    @property
    def alive(self) -> bool:
        """The thread still runs (a health check's question)."""
        return self._thread.is_alive() and not self._closed

    def jobs(self) -> int:
        """Generations queued or running now."""
        with self._wake:
            return len(self._pending) + self._running

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        active: list[Job] = []
        while True:
            with self._wake:
                while not self._pending and not active and not self._closed:
                    self._wake.wait()
                if self._closed:
                    for job in active + list(self._pending):
                        job.cancel()
                        job._step()
                    return
                while self._pending:
                    active.append(self._pending.popleft())
                self._running = len(active)
                self._active = list(active)
            # One event from each active job in turn.
            for job in active:
                job._worked = False
            running = [job._step() for job in active]
            worked = [job for job in active if job._worked]
            for job in worked:  # the generations whose events ran between this job's
                job.ran_with.update(o.number for o in worked if o is not job and o.generation)
            active = [job for job, on in zip(active, running) if on]
            with self._wake:
                self._running = len(active)
                self._active = list(active)
                # every job waits for a step: sleep until one is nudged (a step, a stop, a new job)
                if active and not self._pending and not self._closed and all(j.waiting for j in active):
                    self._wake.wait(timeout=1.0)


class ThreadWorker:
    """Runs each job on a thread of its own: for generations that wait on a remote engine
    (`triforce_core.serving.remote`) rather than compute here. Nothing is shared between jobs, so
    nothing needs one thread; one job waiting on the network must not hold up another's stream.
    The same `Job`s as `EngineWorker` (stop, stepping, waits), the same calls."""

    def __init__(self, name: str = "triforce-remote"):
        self.name = name
        self._lock = threading.Lock()
        self._running = 0
        self._closed = False
        self._jobs: set[Job] = set()  # running now (cancelled by close)

    def submit(self, start: Callable[[], Iterator], pause_after: Callable[[object], bool] | None = None,
               stepping: bool = False) -> Job:
        job = Job(start, pause_after, stepping)
        job._wake = threading.Condition()
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker is closed")
            self._running += 1
            self._jobs.add(job)
        threading.Thread(target=self._run, args=(job,), name=self.name, daemon=True).start()
        return job

    def call(self, fn: Callable[[], object]):
        """`fn()` here: there is no engine whose thread it must run on."""
        return fn()

    def ahead_of(self, job: Job) -> int:
        """0: no job waits for another here (each runs on its own thread)."""
        return 0

    def sharing(self, job: Job) -> int:
        """0: the jobs here share no model in this process (each waits on its server)."""
        return 0

    @property
    def alive(self) -> bool:
        return not self._closed

    def jobs(self) -> int:
        with self._lock:
            return self._running

    def close(self) -> None:
        """No more jobs; every running one is cancelled (it ends within one event)."""
        with self._lock:
            self._closed = True
            running = list(self._jobs)
        for job in running:
            job.cancel()

    def _run(self, job: Job) -> None:
        try:
            while job._step():
                if job.waiting:
                    with job._wake:
                        job._wake.wait(timeout=1.0)
        finally:
            with self._lock:
                self._running -= 1
                self._jobs.discard(job)
