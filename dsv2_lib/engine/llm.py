"""The public entry point: ``LLM(model).generate(prompts, SamplingParams(...))``, ``LLM.stream`` and ``LLM.logits``.

``generate`` and ``stream`` serve every prompt through the batching :class:`~dsv2_lib.engine.scheduler.Scheduler`
over a paged latent cache; which requests share a step never changes what a request generates. ``LLM``
loads the model, checks its arguments once (:class:`~dsv2_lib.engine.engine_config.EngineConfig`) and runs
the loop: schedule, step (:class:`~dsv2_lib.engine.model_runner.ModelRunner`), sample, stop, detokenise.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dsv2_lib.core.checkpoint import load_checkpoint
from dsv2_lib.core.config import load_config
from dsv2_lib.core.dtypes import default_dtype
from dsv2_lib.core.tokenizer import Tokenizer
from dsv2_lib.engine.block_manager import PENDING, BlockManager, BlockStats
from dsv2_lib.engine.engine_config import EngineConfig
from dsv2_lib.engine.model_runner import ModelRunner
from dsv2_lib.engine.sampling import SamplingParams, sample_rows, sample_rows_on_device
from dsv2_lib.engine.scheduler import Scheduler, SchedulerStats
from dsv2_lib.model.cache import LatentCache, PagedLatentCache, SequenceBatch
from dsv2_lib.model.deepseek_v2 import DeepseekV2
from dsv2_lib.ops.moe_experts import MoETuning

EMBEDDED_MODELS = {"tiny": Path(__file__).resolve().parent.parent / "assets" / "tiny"}

Prompt = str | list[int]


@dataclass
class RequestOutput:
    """One finished request: its prompt ids, the generated ids (a final stop token included), the
    generated text (``None`` without a tokenizer) and why it stopped: ``"stop"`` or ``"length"``."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str


@dataclass(frozen=True)
class RunStats:
    """What the last ``generate``/``stream`` run did: the scheduler's and the block pool's statistics,
    the tokens generated and the wall time."""

    scheduler: SchedulerStats
    blocks: BlockStats
    generated_tokens: int
    seconds: float

    def summary(self) -> str:
        """The statistics as printed by ``python -m dsv2_lib generate --stats``."""
        s, b = self.scheduler, self.blocks
        return "\n".join([
            f"KV cache pool:          {s.pool_blocks} blocks of {s.block_size} tokens ({s.pool_blocks * s.block_size} tokens)",
            f"peak active requests:   {s.peak_running}",
            f"largest decode batch:   {s.max_decode_batch}",
            f"largest step:           {s.max_step_tokens} tokens ({s.prefill_chunks} prefill chunks in all)",
            f"peak blocks allocated:  {s.peak_used_blocks}",
            f"admission waits:        {s.admission_waits} (steps spent queued, summed over requests)",
            f"free blocks at the end: {s.free_blocks}",
            f"preemptions:            {s.preemptions}",
            f"prefill tokens:         {s.prefill_tokens} computed, {s.prefix_hit_tokens} from the prefix cache "
            f"({b.prefix_hit_blocks} block hits, {b.evictions} evictions)",
            f"steps:                  {s.steps}; {self.generated_tokens} tokens generated in {self.seconds:.2f} s",
        ])


def resolve_model(model: str | Path) -> Path:
    """An embedded model's name (``"tiny"``) or a checkpoint directory -> the directory."""
    if str(model) in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[str(model)]
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model {str(model)!r}: not an embedded model ({', '.join(EMBEDDED_MODELS)}) nor a directory")
    return path


class LLM:
    """A DeepSeek-V2 model ready to generate.

    ``device=None`` picks CUDA when available; ``dtype=None`` picks bfloat16 on CUDA, float32 on
    the CPU. ``max_model_len`` caps prompt + generated tokens (default: the config's
    ``max_position_embeddings``).

    Serving: requests run through a scheduler (``scheduling``: ``"continuous"`` or ``"static"``;
    ``admission``: ``"reserve"`` or ``"optimistic"``, see :mod:`~dsv2_lib.engine.scheduler`) over a paged
    latent cache of blocks of ``block_size`` tokens, shared prompt prefixes computed once when
    ``prefix_caching``: within a run, and with a cache sized once (below) across runs too, since the
    pool and its cached blocks then outlive each run (:meth:`reset_prefix_cache` forgets them). A step computes at most ``max_num_batched_tokens`` tokens: decodes first, then
    prompt chunks (chunked prefill; ``None``: no limit, whole prompts). ``kv_cache_mib`` sizes the cache
    once, when the LLM is built (requests then wait for blocks); ``gpu_memory_utilization`` (CUDA only) sizes it once,
    after loading the weights, to what that fraction of the GPU's memory leaves
    (:meth:`PagedLatentCache.from_gpu_memory`); neither: sized at each run to hold every request's worst
    case at once. After a run, ``last_stats`` holds its :class:`RunStats`. ``cuda_graphs``: decode steps
    on a GPU (bf16/fp16) replay CUDA graphs (:class:`~dsv2_lib.engine.graph_runner.DecodeGraphRunner`); False runs
    every launch from Python (eager), for debugging and comparison. ``async_scheduling`` (with
    ``admission="reserve"``): the host plans and launches step t+1 before it reads step t's tokens
    back, so its scheduling work overlaps the GPU's (see :meth:`_run_ahead`). The tokens are those of
    one step at a time; on a GPU a step that still carries a request stopped the step before is a
    different batch, which may round differently, as any change of batch may. ``moe_tuning``: where the
    MoE layers switch kernel paths (:class:`~dsv2_lib.ops.moe_experts.MoETuning`; ``None``: the H200's).

    Every argument but ``model`` is checked once, before the weights load, into ``engine_config`` (an
    :class:`EngineConfig`); ``runner`` (a :class:`ModelRunner`) runs the model's steps on the cache.
    """

    def __init__(self, model: str | Path = "tiny", device: str | None = None, dtype: str | torch.dtype | None = None,
                 max_model_len: int | None = None, kv_cache_mib: float | None = None, block_size: int = 16,
                 scheduling: str = "continuous", admission: str = "reserve", prefix_caching: bool = True,
                 max_num_batched_tokens: int | None = 8192, gpu_memory_utilization: float | None = None,
                 cuda_graphs: bool = True, async_scheduling: bool = True, moe_tuning: MoETuning | None = None):
        path = resolve_model(model)
        self.config = load_config(path)
        self.engine_config = EngineConfig(
            device=device, dtype=dtype, max_model_len=max_model_len, kv_cache_mib=kv_cache_mib, block_size=block_size,
            scheduling=scheduling, admission=admission, prefix_caching=prefix_caching,
            max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=gpu_memory_utilization,
            cuda_graphs=cuda_graphs, async_scheduling=async_scheduling,
            moe_tuning=MoETuning() if moe_tuning is None else moe_tuning).for_model(self.config)
        c = self.engine_config
        cache = None if c.kv_cache_mib is None else PagedLatentCache.from_mib(
            self.config, c.kv_cache_mib, c.dtype, c.device, c.block_size, c.max_model_len)
        with torch.device(c.device), default_dtype(c.dtype):
            self.model = DeepseekV2(self.config, moe_tuning=c.moe_tuning)
        load_checkpoint(self.model, path)
        if c.gpu_memory_utilization is not None:  # after the weights: the pool gets what they leave
            cache = PagedLatentCache.from_gpu_memory(self.config, c.dtype, c.device, c.block_size, c.max_model_len,
                                                     c.gpu_memory_utilization, c.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, c, cache)
        self.tokenizer = Tokenizer.from_dir(path)
        self.last_stats: RunStats | None = None
        self._blocks: BlockManager | None = None  # the block pool of self.runner.cache, kept across runs
        self._serving = False  # a run over self._blocks has started and not ended

    # ---- inputs -----------------------------------------------------------------------------
    def _token_ids(self, prompt: Prompt, index: int) -> list[int]:
        """A prompt's token ids, validated (range, length); ``index`` names it in errors."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text but this checkpoint has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt {index} is {type(prompt).__name__} {prompt!r}; a prompt is text or a list of token ids")
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        vocab = self.config.vocab_size
        if not (all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < vocab):  # C loops; else find the culprit
            for pos, t in enumerate(ids):
                if not isinstance(t, int) or isinstance(t, bool):
                    raise ValueError(f"prompt {index}: token {pos} is {t!r}, not an int (a prompt is text or a list of ints)")
                if not 0 <= t < vocab:
                    raise ValueError(f"prompt {index}: token {pos} is {t!r}, outside the vocabulary [0, {vocab})")
        if len(ids) >= self.engine_config.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; the context holds {self.engine_config.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        return ids

    # ---- public API -------------------------------------------------------------------------
    def logits(self, prompt: Prompt) -> torch.Tensor:
        """float32 logits for every position of one prompt, ``[len, vocab]`` on the CPU."""
        ids = self._token_ids(prompt, 0)
        c = self.engine_config
        cache = LatentCache(self.config, 1, len(ids), c.dtype, c.device)
        batch = SequenceBatch(slots=(0,), starts=(0,), lens=(len(ids),))
        hidden = self.model(torch.tensor(ids, device=c.device), batch, cache)
        return self.model.compute_logits(hidden).cpu()

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids), all served together by the scheduler.

        ``progress``: a progress bar of finished requests on stderr (``None``: only on a terminal).
        """
        ids, plist = self._requests(prompts, params)
        out: list[list[int]] = [[] for _ in ids]
        finish: list[str | None] = [None] * len(ids)
        for i, token, reason in self._serve(ids, plist, progress):
            out[i].append(token)
            finish[i] = reason
        return [
            RequestOutput(i, o, self.tokenizer.decode(o) if self.tokenizer else None, f)
            for i, o, f in zip(ids, out, finish)
        ]

    def stream(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
               progress: bool | None = False) -> Iterator[tuple[int, int, str | None]]:
        """Like :meth:`generate`, but yield ``(request index, token id, text piece)`` as tokens are produced.

        A request's pieces concatenate to its final text (a piece is held back while it ends in an
        incomplete UTF-8 character); ``None`` without a tokenizer. Prompts are validated, and a request
        larger than the cache rejected, here, before the first token. With a cache sized once the runs of
        one LLM share it: consume (or ``close()``) one stream before starting another run, which is
        refused until then. No progress bar by default.
        """
        ids, plist = self._requests(prompts, params)
        return self._pieces(self._serve(ids, plist, progress), len(ids))

    # ---- serving ----------------------------------------------------------------------------
    def _requests(self, prompts, params) -> tuple[list[list[int]], list[SamplingParams]]:
        """Prompts (one, or a list) and params (one for all, or one each) -> validated token ids and params."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = SamplingParams() if params is None else params  # not `or`: an empty list is a mismatch
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        return [self._token_ids(p, i) for i, p in enumerate(prompts)], plist

    def _serve(self, ids: list[list[int]], plist: list[SamplingParams],
               progress: bool | None) -> Iterator[tuple[int, int, str | None]]:
        """Queue every request (rejecting at once one larger than the cache), then run the scheduler to
        the end, yielding ``(request index, token, finish reason or None)`` per sampled token."""
        c = self.engine_config
        limits = [min(len(i) + p.max_tokens, c.max_model_len) for i, p in zip(ids, plist)]
        cache = self.runner.cache_for(limits)
        if cache is not self.runner.cache:  # this run's own
            blocks = BlockManager(cache.num_blocks, c.block_size, c.prefix_caching)
        else:  # one pool for the LLM's life: what earlier runs cached stays hittable
            if self._blocks is None:
                self._blocks = BlockManager(cache.num_blocks, c.block_size, c.prefix_caching)
            blocks = self._blocks
        sched = Scheduler(blocks, c.scheduling, c.admission, c.max_num_batched_tokens)
        for i, n in zip(ids, limits):  # request ids 0, 1, ... are the prompt indices
            sched.add_request(i, n - len(i))
        return self._run(sched, cache, plist, progress)

    def _run(self, sched: Scheduler, cache: PagedLatentCache, plist: list[SamplingParams],
             progress: bool | None) -> Iterator[tuple[int, int, str | None]]:
        """Step the scheduler to the end: model, one sample per work item that samples (decodes and
        prompts' last chunks) with each request's own generator, stop decisions; then record ``last_stats``.

        On the LLM's own pool one run at a time. A run that does not reach its end (an error, a stream
        closed early) may leave blocks named whose rows no step wrote, so the pool is then forgotten."""
        shared = sched.blocks is self._blocks
        if shared and self._serving:
            raise RuntimeError("this LLM's cache is in use by an unfinished stream(): consume it or close() it "
                               "before starting another run")
        self._serving, ended = shared, False
        sched.blocks.reset_counters()
        generators = [p.generator(self.engine_config.device) for p in plist]
        start, generated = time.perf_counter(), 0
        ahead = self.engine_config.async_scheduling and sched.admission == "reserve"
        steps = self._run_ahead if ahead else self._run_in_step
        try:
            with tqdm(total=len(plist), desc="requests", unit="req", disable=None if progress is None else not progress) as bar:
                for i, token, reason in steps(sched, cache, plist, generators, bar):
                    generated += 1
                    yield i, token, reason
            ended = True
        finally:
            if shared:
                self._serving = False
                if not ended:
                    self._blocks = None
        self.last_stats = RunStats(sched.stats(), sched.blocks.stats(), generated, time.perf_counter() - start)

    def reset_prefix_cache(self) -> None:
        """Forget the prompt blocks earlier runs left in the pool's prefix cache, so that the next run
        computes every prompt in full (to time prefill, say). Only a cache sized once (``kv_cache_mib``,
        ``gpu_memory_utilization``) keeps them across runs."""
        if self._serving:
            raise RuntimeError("reset_prefix_cache: an unfinished stream() is using the cache; consume it or close() it first")
        if self._blocks is not None:  # (None: the next run makes a new pool, empty)
            self._blocks.forget_cached()

    def _run_in_step(self, sched, cache, plist, generators, bar) -> Iterator[tuple[int, int, str | None]]:
        """One step at a time: run it, read its tokens back (the host waits), update, plan the next."""
        while sched.has_unfinished():
            work = sched.schedule()
            sampled = [w for w in work if w.samples]
            logits = self.runner.step(work, cache) if work else None
            tokens = sample_rows(logits, [plist[w.request.id] for w in sampled],
                                 [generators[w.request.id] for w in sampled]) if sampled else []
            stops = [self._is_stop(t, plist[w.request.id]) for t, w in zip(tokens, sampled)]
            bar.update(len(sched.update(work, tokens, stops)))
            for w, t in zip(sampled, tokens):
                yield w.request.id, t, w.request.finish_reason

    def _run_ahead(self, sched, cache, plist, generators, bar) -> Iterator[tuple[int, int, str | None]]:
        """One step ahead of the GPU. Step t+1 is planned (its sampled tokens recorded as ``PENDING``)
        and launched, its decode tokens gathered on the GPU from step t's picks, before the host reads
        step t's tokens back; so the GPU runs step t+1 while the host resolves step t (stop checks,
        the placeholders, the yields) and plans step t+2. A request that stops at step t has already
        been given a token in step t+1: that token is dropped (:meth:`Scheduler.resolve`), its cache row
        lands in the request's own blocks before any later step reuses them."""
        pending = None  # (step, sampled work, picks on the GPU, picks on the host, copy done)
        while sched.has_unfinished() or pending is not None:
            launched = None
            if sched.has_unfinished():
                work = sched.schedule()
                step, sampled = sched.steps - 1, [w for w in work if w.samples]
                earlier = None if pending is None else (pending[2], {w.request.id: i for i, w in enumerate(pending[1])})
                logits = self.runner.step(work, cache, earlier) if work else None
                if sampled:
                    picks = sample_rows_on_device(logits, [plist[w.request.id] for w in sampled],
                                                  [generators[w.request.id] for w in sampled])
                    host = torch.empty_like(picks, device="cpu", pin_memory=picks.is_cuda)
                    host.copy_(picks, non_blocking=True)
                    done = torch.cuda.Event() if picks.is_cuda else None
                    if done is not None:
                        done.record()
                    launched = (step, sampled, picks, host, done)
                bar.update(len(sched.update(work, [PENDING] * len(sampled), [False] * len(sampled))))
            if pending is not None:
                step, sampled, _, host, done = pending
                if done is not None:
                    done.synchronize()  # this step only: the one launched above keeps running
                tokens = host.tolist()
                stops = [self._is_stop(t, plist[w.request.id]) for t, w in zip(tokens, sampled)]
                report, finished = sched.resolve(sampled, tokens, stops, step)
                bar.update(len(finished))
                for r, t, last in report:
                    yield r.id, t, r.finish_reason if last else None
            pending = launched

    def _pieces(self, tokens: Iterator[tuple[int, int, str | None]], n: int) -> Iterator[tuple[int, int, str | None]]:
        """``(index, token, reason)`` -> ``(index, token, text piece)``, detokenizing incrementally."""
        out: list[list[int]] = [[] for _ in range(n)]
        sent = [""] * n
        for i, token, reason in tokens:
            out[i].append(token)
            piece = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode(out[i])
                piece = "" if reason is None and text.endswith("\ufffd") else text[len(sent[i]):]
                sent[i] += piece
            yield i, token, piece

    def _is_stop(self, token: int, params: SamplingParams) -> bool:
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.config.eos_token_id)
