"""Every type that crosses a component boundary, in one module.

Rules:
- Only msgspec Structs, enums and unions here; logic lives elsewhere.
- Every union member has an explicit short tag, so renaming a class never changes the wire.
- `array_like` Structs are positional: fields are append-only with defaults. Removing or
  retyping a field bumps PROTOCOL_VERSION.
"""

from __future__ import annotations

import enum
from typing import Any, Final

import msgspec

# 2: typed Ready, StartupFailed, AbortRequest.samples; 3: speculative decoding (CachedSeq,
# BatchResult and SchedulerStats fields); 4: ModelFacts.startup_phases; 5: CachedSeq.new_token_ids
# (pipeline steps in flight)
PROTOCOL_VERSION: Final[int] = 5

# Ids are plain strings/ints on the wire; the aliases document intent.
RequestId = str
BlockId = int


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the client or by a shutdown
    ERROR = "error"  # rejected or failed; the message says why


class ErrorKind(str, enum.Enum):
    """Why a request failed, as frontends map it (HTTP status, batch error line)."""

    INVALID_REQUEST = "invalid_request"  # the request can never run as sent (a 400)
    ENGINE_DEAD = "engine_dead"  # the engine stopped (a 503)
    INTERNAL = "internal"  # a bug or an unexpected failure (a 500)


class StructuredOutputsParams(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One constraint on a request's output, as vLLM names it: exactly one field is set.

    Checked and compiled by the frontend (`frontends.structured`), enforced by the worker's sampler.
    """

    json: str | dict[str, Any] | None = None  # a JSON schema, as an object or its JSON text
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (GBNF-style, root rule `root`)
    json_object: bool = False  # any JSON object


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Per-request sampling options, named as vLLM and OpenAI name them.

    Validated by `bus.validation.check_sampling_params`.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the chosen one)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


# --------------------------------------------------------------------------- requests
class AddRequest(msgspec.Struct, kw_only=True, frozen=True, tag="add", tag_field="t"):
    """A tokenized request entering the scheduler. `params.n` samples share its prompt."""

    request_id: RequestId
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under the priority policy (vLLM convention)
    cache_salt: str | None = None


class SampleKey(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One of a request's `n` samples: (request id, sample index), never a parsed string."""

    request_id: RequestId
    sample_index: int


class AbortRequest(msgspec.Struct, kw_only=True, frozen=True, tag="abort", tag_field="t"):
    """Abort whole requests, and single samples (a stop string ended them in the frontend)."""

    request_ids: list[RequestId]
    samples: list[SampleKey] = []


class Shutdown(msgspec.Struct, kw_only=True, frozen=True, tag="shutdown", tag_field="t"):
    drain: bool = True


# ------------------------------------------------------------- scheduler -> worker plan
class NewSeq(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A sequence the worker has not seen (or sees again after preemption): sent in full once."""

    seq_id: str
    token_ids: list[int]  # prompt followed by every token generated so far
    prompt_len: int
    params: SamplingParams
    block_ids: list[BlockId]
    num_computed_tokens: int  # tokens whose KV already sits in block_ids (prefix-cache hits)
    num_scheduled_tokens: int  # tokens to run this step
    sample_index: int = 0  # which of the request's n samples; keys the seeded sampler


class CachedSeq(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A sequence the worker already holds: only the delta travels."""

    seq_id: str
    new_block_ids: list[BlockId]
    num_computed_tokens: int
    num_scheduled_tokens: int
    # Speculative decoding: the n-gram drafts, which num_scheduled_tokens includes after the one
    # real token (a draft model's worker proposes that many itself, and this stays empty).
    spec_token_ids: list[int] = []
    # new_block_ids go from this column on; the worker drops any it held there (the scheduler
    # freed the blocks of rejected drafts). -1: append.
    block_offset: int = -1
    # Pipeline parallelism: the tokens sampled since the worker last saw this sequence. Only the
    # last stage samples; the stages before it learn the tokens here, so none of them waits for
    # the last stage at the end of a step (several steps can be in flight). Empty without stages.
    new_token_ids: list[int] = []


class ExecuteBatch(msgspec.Struct, array_like=True, gc=False, frozen=True, tag="exec", tag_field="t"):
    """One step plan. A sequence samples a token when its scheduled tokens reach its end."""

    step_id: int
    new_seqs: list[NewSeq]
    cached_seqs: list[CachedSeq]
    finished_seq_ids: list[str]  # the worker drops these (finished, aborted or preempted)


# ----------------------------------------------------------------- worker -> scheduler
class TokenLogprobs(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Logprob of the sampled token plus the top-N alternatives, most likely first."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token in the distribution
    top_token_ids: list[int]
    top_logprobs: list[float]


class BatchResult(msgspec.Struct, array_like=True, gc=False, frozen=True, tag="result", tag_field="t"):
    """Sampled tokens of one step, one entry per sequence that reached its end this step."""

    step_id: int
    seq_ids: list[str]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = []  # parallel to token_ids when any seq asked
    # Tokens each seq gained, parallel to seq_ids (speculation: accepted drafts + one sampled);
    # token_ids and logprobs hold them in order. Empty: one each.
    num_tokens: list[int] = []


# ----------------------------------------------------------------- scheduler -> client
class SeqUpdate(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """New tokens of one sample of one request since the last step."""

    request_id: RequestId
    sample_index: int
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the stop token id that finished it, if any
    logprobs: list[TokenLogprobs] = []
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None


class SchedulerStats(msgspec.Struct, kw_only=True, frozen=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of usable blocks held by requests
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0  # tokens found, cumulative
    num_preemptions: int = 0  # cumulative
    num_steps: int = 0  # cumulative
    # speculative decoding, cumulative: verifications with >= 1 draft, drafts, accepted drafts
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_drafted_per_position: list[int] = []  # [i]: verifications that proposed a draft i
    spec_accepted_per_position: list[int] = []  # [i]: ... whose draft i was accepted


class StepOutput(msgspec.Struct, array_like=True, gc=False, frozen=True, tag="step", tag_field="t"):
    """Everything clients learn from one engine step, in one frame."""

    updates: list[SeqUpdate]
    stats: SchedulerStats | None = None


# ------------------------------------------------------------------ process lifecycle
# Control messages: map-like (kw_only) because they are rare and should read well in a dump.
class Hello(msgspec.Struct, kw_only=True, frozen=True, tag="hello", tag_field="t"):
    """Sent by a child as soon as it starts, before any heavy init; a version mismatch is fatal."""

    version: int
    role: str
    rank: int
    pid: int


class ModelFacts(msgspec.Struct, kw_only=True, frozen=True):
    """What a worker learns by loading the model and sizing its KV cache; the scheduler and the
    clients obey these limits."""

    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None  # None: the model has no end-of-sequence token
    dtype: str
    device: str
    num_threads: int
    # Seconds of the worker's start-up by phase ("imports", "weights", "kv_cache", "warmup"),
    # for the frontend's start-up report.
    startup_phases: dict[str, float] = {}


class Ready(msgspec.Struct, kw_only=True, frozen=True, tag="ready", tag_field="t"):
    """Sent after heavy init. Workers send their `model`; the scheduler forwards worker 0's and
    names the workers it spawned (`worker_pids`, by rank). Tokenizer processes send neither."""

    role: str
    rank: int
    model: ModelFacts | None = None
    worker_pids: list[int] = []


class StartupFailed(msgspec.Struct, kw_only=True, frozen=True, tag="sfail", tag_field="t"):
    """Sent instead of Ready: process `role`-`rank` (the sender, or a child it started) cannot
    start. `reason` is the whole message for the user, naming that process."""

    role: str
    rank: int
    reason: str


class EngineDead(msgspec.Struct, kw_only=True, frozen=True, tag="dead", tag_field="t"):
    """The scheduler's last message: every in-flight request fails with `reason`."""

    reason: str


class WorkerFailed(msgspec.Struct, kw_only=True, frozen=True, tag="wfail", tag_field="t"):
    """A worker's last message before it exits non-zero; fatal to the engine (no partial TP)."""

    rank: int
    reason: str


# ----------------------------------------------------- frontend <-> tokenizer pool
class ToolCallFunction(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    id: str
    function: ToolCallFunction
    type: str = "function"


class ChatMessage(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    role: str
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a `tool` message answers this call


class GenerateRequest(msgspec.Struct, kw_only=True, frozen=True, tag="gen", tag_field="t"):
    """A request as a frontend sends it: text, token ids or chat messages (exactly one)."""

    request_id: RequestId
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = 0.0
    echo: bool = False  # return the prompt text in the first delta (completions `echo`)
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, for the chat template
    # The frontend reads only each sample's whole text (LLM.generate, LLM.chat): a sample without
    # stop strings is then detokenized once, when it ends, not a piece every step.
    final_only: bool = False


class TokenizeRequest(msgspec.Struct, kw_only=True, frozen=True, tag="tok", tag_field="t"):
    request_id: RequestId
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True, frozen=True, tag="detok", tag_field="t"):
    request_id: RequestId
    token_ids: list[int]


class SampleDelta(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """What one sample gained in one step, as text and tokens."""

    index: int
    text_delta: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] = []
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string


class RequestDelta(msgspec.Struct, array_like=True, gc=False, frozen=True):
    request_id: RequestId
    samples: list[SampleDelta]
    finished: bool = False  # every sample finished: no more deltas for this request
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_token_ids: list[int] | None = None  # in the first delta only
    prompt_text: str | None = None  # in the first delta when `echo` was asked
    error: str | None = None  # rejected or failed; the message says why (client-safe)
    error_kind: ErrorKind | None = None


class DeltaBatch(msgspec.Struct, array_like=True, gc=False, frozen=True, tag="deltas", tag_field="t"):
    """Everything frontends learn from one engine step, in one frame."""

    deltas: list[RequestDelta]
    stats: SchedulerStats | None = None


class TokenizeResult(msgspec.Struct, kw_only=True, frozen=True, tag="tokres", tag_field="t"):
    request_id: RequestId
    token_ids: list[int] = []
    text: str | None = None  # for DetokenizeRequest
    error: str | None = None


# ------------------------------------------------------------------- channel unions
# One union (and one typed decoder, see bus.codec) per channel. A union may mix array_like and
# map-like Structs: msgspec refuses that in one Decoder, so bus.codec splits it in two and picks
# by the first msgpack byte (array or map); tags stay unique across the whole union.
ToScheduler = AddRequest | AbortRequest | Shutdown
FromScheduler = StepOutput | EngineDead
ToWorker = ExecuteBatch | Shutdown
FromWorker = BatchResult | WorkerFailed
Handshake = Hello | Ready | StartupFailed
ToTokenizer = GenerateRequest | TokenizeRequest | DetokenizeRequest | AbortRequest | Shutdown
FromTokenizer = DeltaBatch | TokenizeResult | EngineDead
