"""The public entry point: ``LLM(model).generate(prompts, SamplingParams(...))``, ``LLM.chat``,
``LLM.stream`` and ``LLM.logits``.

``generate`` and ``stream`` serve every prompt through the batching :class:`~dsv2_lib.engine.scheduler.Scheduler`
over a paged latent cache; which requests share a step never changes what a request generates. ``LLM``
loads the model, checks its arguments once (:class:`~dsv2_lib.engine.engine_config.EngineConfig`), checks
the prompts, and steps a :class:`~dsv2_lib.engine.step_loop.StepLoop` (schedule, run the model, sample,
stop, detokenise) to the end of the run.
"""
from __future__ import annotations

import threading
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
from dsv2_lib.engine.block_manager import BlockManager, BlockStats
from dsv2_lib.engine.engine_config import EngineConfig
from dsv2_lib.engine.model_runner import ModelRunner
from dsv2_lib.engine.request_state import RequestOutput, RequestState
from dsv2_lib.engine.sampling import SamplingParams
from dsv2_lib.engine.scheduler import Scheduler, SchedulerStats
from dsv2_lib.engine.step_loop import StepLoop
from dsv2_lib.engine.step_trace import StepTrace
from dsv2_lib.model.cache import LatentCache, PagedLatentCache, SequenceBatch
from dsv2_lib.model.deepseek_v2 import DeepseekV2
from dsv2_lib.model.tuning import Tuning

EMBEDDED_MODELS = {"tiny": Path(__file__).resolve().parent.parent / "assets" / "tiny"}

Prompt = str | list[int]
Message = dict[str, str]


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
    case at once. After a run, ``last_stats`` holds its :class:`RunStats`. ``cuda_graphs``: steps of up to
    512 tokens on a GPU (bf16/fp16), decodes and prompt chunks alike, replay CUDA graphs (:class:`~dsv2_lib.engine.graph_runner.DecodeGraphRunner`); False runs
    every launch from Python (eager), for debugging and comparison. ``async_scheduling`` (with
    ``admission="reserve"``): the host plans and launches step t+1 before it reads step t's tokens
    back, so its scheduling work overlaps the GPU's (:mod:`~dsv2_lib.engine.step_loop`). The tokens are those of
    one step at a time; on a GPU a step that still carries a request stopped the step before is a
    different batch, which may round differently, as any change of batch may. ``tuning``: where the
    model's ops switch kernel paths (:class:`~dsv2_lib.model.tuning.Tuning`; ``None``: the H200's).
    ``trace``: a file to which each run's scheduler steps are written as JSON lines
    (:mod:`~dsv2_lib.engine.step_trace`).

    One run at a time: a second ``generate``/``stream`` (another thread's, or while a stream is open)
    is refused; requests that arrive at different times share one batch through
    :class:`~dsv2_lib.engine.live_engine.LiveEngine` (what ``python -m dsv2_lib serve`` runs).

    Every argument but ``model`` is checked once, before the weights load, into ``engine_config`` (an
    :class:`EngineConfig`); ``runner`` (a :class:`ModelRunner`) runs the model's steps on the cache.
    """

    def __init__(self, model: str | Path = "tiny", device: str | None = None, dtype: str | torch.dtype | None = None,
                 max_model_len: int | None = None, kv_cache_mib: float | None = None, block_size: int = 16,
                 scheduling: str = "continuous", admission: str = "reserve", prefix_caching: bool = True,
                 max_num_batched_tokens: int | None = 8192, gpu_memory_utilization: float | None = None,
                 cuda_graphs: bool = True, async_scheduling: bool = True, tuning: Tuning | None = None,
                 trace: str | Path | None = None):
        path = resolve_model(model)
        self.config = load_config(path)
        self.engine_config = EngineConfig(
            device=device, dtype=dtype, max_model_len=max_model_len, kv_cache_mib=kv_cache_mib, block_size=block_size,
            scheduling=scheduling, admission=admission, prefix_caching=prefix_caching,
            max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=gpu_memory_utilization,
            cuda_graphs=cuda_graphs, async_scheduling=async_scheduling,
            tuning=Tuning() if tuning is None else tuning, trace=trace).for_model(self.config)
        c = self.engine_config
        cache = None if c.kv_cache_mib is None else PagedLatentCache.from_mib(
            self.config, c.kv_cache_mib, c.dtype, c.device, c.block_size, c.max_model_len)
        with torch.device(c.device), default_dtype(c.dtype):
            self.model = DeepseekV2(self.config, tuning=c.tuning)
        load_checkpoint(self.model, path)
        if c.gpu_memory_utilization is not None:  # after the weights: the pool gets what they leave
            cache = PagedLatentCache.from_gpu_memory(self.config, c.dtype, c.device, c.block_size, c.max_model_len,
                                                     c.gpu_memory_utilization, c.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, c, cache)
        self.tokenizer = Tokenizer.from_dir(path)
        self.last_stats: RunStats | None = None
        self._blocks: BlockManager | None = None  # the block pool of self.runner.cache, kept across runs
        self._trace = None if c.trace is None else StepTrace(c.trace)
        self._lock = threading.Lock()
        self._user: str | None = None  # what is running on this LLM now (a run, a stream, a LiveEngine)

    # ---- inputs -----------------------------------------------------------------------------
    def _token_ids(self, prompt: Prompt, index: int) -> list[int]:
        """A prompt's token ids, validated (range, length); ``index`` names it in errors."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text but this checkpoint has no tokenizer.json; pass token ids")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"prompt {index} is not valid Unicode text: {e.reason} at character {e.start} "
                                 f"({prompt[e.start]!r})") from None
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt {index} is {type(prompt).__name__} {prompt!r:.80}; a prompt is text or a list of token ids")
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

    def chat_prompt(self, messages: list[Message]) -> list[int]:
        """A conversation (``[{"role": ..., "content": ...}, ...]``) as prompt ids, in the checkpoint's chat
        template (:meth:`Tokenizer.apply_chat_template <dsv2_lib.core.tokenizer.Tokenizer.apply_chat_template>`),
        ending where the assistant's reply begins."""
        if self.tokenizer is None:
            raise ValueError("chat needs the checkpoint's tokenizer.json, which this checkpoint does not have")
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)

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

        A request that can never fit the cache (one sized once, smaller than its worst case) ends
        with ``finish_reason="error"`` and its ``error``; the others are served. ``progress``: a progress
        bar of finished requests on stderr (``None``: only on a terminal).
        """
        loop, states = self._start(*self._requests(prompts, params), incremental=False)
        for _ in self._drive(loop, states, progress):
            pass
        return [s.out for s in states]

    def chat(self, conversations: list[Message] | list[list[Message]],
             params: SamplingParams | list[SamplingParams] | None = None,
             progress: bool | None = None) -> list[RequestOutput]:
        """The assistant's next reply to each conversation (one, or a list), as :meth:`generate` gives it;
        a conversation is a list of ``{"role": "system" | "user" | "assistant", "content": str}``."""
        if isinstance(conversations, list) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if not isinstance(conversations, list) or not all(isinstance(c, list) for c in conversations):
            raise ValueError("chat takes a conversation (a list of {'role': ..., 'content': ...} messages) or a "
                             f"list of conversations, got {type(conversations).__name__}")
        return self.generate([self.chat_prompt(c) for c in conversations], params, progress)

    def stream(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
               progress: bool | None = False) -> Iterator[tuple[int, int, str | None]]:
        """Like :meth:`generate`, but yield ``(request index, token id, text piece)`` as tokens are produced.

        A request's pieces concatenate to its final text (a piece is held back while it ends in an
        incomplete UTF-8 character, or may be the start of a stop string); ``None`` without a
        tokenizer. Prompts are validated, and a request larger than the cache refused, here, before the
        first token. Consume (or ``close()``) the stream before starting another run on this LLM.
        No progress bar by default.
        """
        loop, states = self._start(*self._requests(prompts, params), incremental=True)
        refused = next((i for i, s in enumerate(states) if s.out.finish_reason == "error"), None)
        if refused is not None:
            self._release()
            raise ValueError(states[refused].out.error)
        index = {s.request_id: i for i, s in enumerate(states)}
        return ((index[s.request_id], token, s.piece()) for s, token in self._drive(loop, states, progress))

    def reset_prefix_cache(self) -> None:
        """Forget the prompt blocks earlier runs left in the pool's prefix cache, so that the next run
        computes every prompt in full (to time prefill, say). Only a cache sized once (``kv_cache_mib``,
        ``gpu_memory_utilization``) keeps them across runs."""
        with self._lock:
            if self._user is not None:
                raise RuntimeError(f"reset_prefix_cache: this LLM is busy with {self._user}")
            if self._blocks is not None:  # (None: the next run makes a new pool, empty)
                self._blocks.forget_cached()

    # ---- serving ----------------------------------------------------------------------------
    def _requests(self, prompts, params) -> tuple[list[list[int]], list[SamplingParams]]:
        """Prompts (one, or a list) and params (one for all, or one each) -> validated token ids and params."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt (text or token ids) or a list of prompts, got "
                             f"{type(prompts).__name__} {prompts!r:.80}")
        params = SamplingParams() if params is None else params  # not `or`: an empty list is a mismatch
        plist = params if isinstance(params, list) else [params] * len(prompts)
        for i, p in enumerate(plist):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params {i} is a {type(p).__name__}, not a SamplingParams "
                                 "(build one: SamplingParams(max_tokens=..., ...))")
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        return [self._token_ids(p, i) for i, p in enumerate(prompts)], plist

    def acquire(self, user: str) -> None:
        """Take this LLM for ``user`` (a run, a stream, a :class:`~dsv2_lib.engine.live_engine.LiveEngine`);
        refused while something else holds it. :meth:`_release` gives it back."""
        with self._lock:
            if self._user is not None:
                raise RuntimeError(
                    f"this LLM is busy with {self._user}; it serves one run at a time. Wait for it (or close() the "
                    "stream); for requests that arrive concurrently use one LiveEngine (python -m dsv2_lib serve)")
            self._user = user

    def _release(self) -> None:
        with self._lock:
            self._user = None

    def new_loop(self, limits: list[int]) -> StepLoop:
        """A :class:`StepLoop` for requests reaching at most ``limits`` tokens each (for a cache sized once,
        any: its pool is shared by every run, so what earlier runs cached stays hittable)."""
        c = self.engine_config
        cache = self.runner.cache_for(limits)
        if cache is not self.runner.cache:  # this run's own
            blocks = BlockManager(cache.num_blocks, c.block_size, c.prefix_caching)
        else:
            if self._blocks is None:
                self._blocks = BlockManager(cache.num_blocks, c.block_size, c.prefix_caching)
            blocks = self._blocks
        blocks.reset_counters()
        sched = Scheduler(blocks, c.scheduling, c.admission, c.max_num_batched_tokens)
        if self._trace is not None:
            self._trace.new_run()
        return StepLoop(self.runner, sched, cache, self.tokenizer, self.config.eos_token_id,
                        ahead=c.async_scheduling and c.admission == "reserve", trace=self._trace)

    def _start(self, ids: list[list[int]], plist: list[SamplingParams],
               incremental: bool) -> tuple[StepLoop, list[RequestState]]:
        """Take the LLM and queue every request of a run; ``incremental``: text kept up to date per token."""
        self.acquire("an unfinished stream()" if incremental else f"generate() in thread {threading.current_thread().name!r}")
        try:
            limits = [min(len(i) + p.max_tokens, self.engine_config.max_model_len) for i, p in zip(ids, plist)]
            loop = self.new_loop(limits)
            return loop, [loop.add(i, p, n - len(i), incremental) for i, p, n in zip(ids, plist, limits)]
        except BaseException:
            self._release()
            raise

    def _drive(self, loop: StepLoop, states: list[RequestState],
               progress: bool | None) -> Iterator[tuple[RequestState, int]]:
        """Step ``loop`` to the end, yielding ``(state, token)`` per token; then record ``last_stats`` and give
        the LLM back. A run that does not reach its end (an error, a stream closed early) may leave blocks
        named whose rows no step wrote, so a shared pool is then forgotten."""
        start, ended = time.perf_counter(), False
        try:
            with tqdm(total=len(states), desc="requests", unit="req", disable=None if progress is None else not progress) as bar:
                bar.update(sum(s.finished for s in states))  # refused at once
                while loop.has_work():
                    for state, token in loop.step():
                        bar.update(state.finished)
                        yield state, token
            ended = True
        finally:
            if not ended and loop.sched.blocks is self._blocks:
                self._blocks = None
            self._release()
        self.last_stats = RunStats(loop.sched.stats(), loop.sched.blocks.stats(), loop.generated,
                                   time.perf_counter() - start)
