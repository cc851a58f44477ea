"""A record of what the scheduler did, step by step, as JSON lines (``LLM(trace=path)``).

Four kinds of line, each with an ``"event"``: ``"run"`` when a run starts (request ids and steps
count from 0 again); ``"add"`` when a request is queued (its prompt length
and ``max_tokens``); ``"step"`` when a step is planned (its work items: request, ``prefill`` or
``decode``, first position, tokens, prompt tokens found in the prefix cache at admission; the
requests preempted; blocks allocated to the items and in use after planning; the CUDA graph the step
ran as, its entries (one per token) and the captured size that held them); ``"finish"`` when a request ends (the step, the
reason, the blocks it gave back). Chapter 11 draws its Gantt chart from such a file.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from dsv2_lib.engine.scheduler import Request, Scheduler, Work


class StepTrace:
    """Appends one JSON line per event to ``path`` (created empty at construction)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = self.path.open("w")
        self._start = time.perf_counter()
        self._blocks: dict[int, int] = {}  # request id -> blocks in its table at its last step
        self._seen: dict[int, tuple[int, int]] = {}  # request id -> (preemptions, cached tokens) seen so far
        self._running: dict[int, Request] = {}  # admitted at the last step

    def new_run(self) -> None:
        """A new ``generate``/``stream`` run (or a live engine) starts: request ids and steps count from 0."""
        self._blocks, self._seen, self._running = {}, {}, {}
        self._write(event="run")

    def added(self, r: Request) -> None:
        self._seen[r.id] = (0, 0)
        self._write(event="add", request=r.id, prompt_tokens=len(r.prompt), max_tokens=r.max_tokens)

    def step(self, sched: Scheduler, work: list[Work], graph: tuple[int, int] | None) -> None:
        """Step ``sched.steps - 1``, just planned; ``graph``: ``(entries, bucket)`` when it (or its decode items) ran as a graph."""
        preempted = [rid for rid, r in self._running.items() if r.preemptions > self._seen[rid][0]]
        freed = sum(self._blocks.pop(rid, 0) for rid in preempted)
        allocated, items = 0, []
        for w in work:
            r = w.request
            allocated += len(w.block_table) - self._blocks.get(r.id, 0)
            self._blocks[r.id] = len(w.block_table)
            items.append({"request": r.id, "kind": "prefill" if w.prefill else "decode", "start": w.positions.start,
                          "tokens": len(w.token_ids), "samples": w.samples,
                          "cached": r.cached_tokens - self._seen[r.id][1]})
            self._seen[r.id] = (r.preemptions, r.cached_tokens)
        self._running = {r.id: r for r in sched.running}
        self._write(event="step", step=sched.steps - 1, items=items, preempted=preempted, waiting=len(sched.waiting),
                    blocks={"allocated": allocated, "freed_by_preemption": freed,
                            "used": sched.blocks.num_blocks - sched.blocks.num_free_blocks},
                    graph=None if graph is None else {"entries": graph[0], "bucket": graph[1]})

    def finished(self, r: Request) -> None:
        self._running.pop(r.id, None)
        del self._seen[r.id]
        self._write(event="finish", request=r.id, step=r.finished_step, reason=r.finish_reason,
                    freed=self._blocks.pop(r.id, 0), output_tokens=len(r.output))

    def close(self) -> None:
        self._file.close()

    def _write(self, **record) -> None:
        record["time"] = round(time.perf_counter() - self._start, 6)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
