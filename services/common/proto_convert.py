"""Conversions between protobuf messages and engine types."""
from __future__ import annotations

from pdserve.engine import SamplingParams
from pdserve.engine.sampling_params import StructuredOutputsParams
from pdserve.v1 import common_pb2, worker_pb2

# A worker's role as the router and the workers name it, and as the wire does (worker.proto WorkerRole).
ROLE_ENUM = {"prefill": worker_pb2.WORKER_ROLE_PREFILL, "decode": worker_pb2.WORKER_ROLE_DECODE,
             "both": worker_pb2.WORKER_ROLE_BOTH}
ROLE_NAMES = {value: name for name, value in ROLE_ENUM.items()}

# The optional fields of common.proto's SamplingParams, with their engine types.
OPTIONAL_FIELDS = (("temperature", float), ("top_p", float), ("top_k", int), ("max_tokens", int), ("seed", int),
                   ("ignore_eos", bool), ("min_tokens", int), ("logprobs", int), ("prompt_logprobs", int),
                   ("cache_salt", str),
                   ("priority", int), ("presence_penalty", float), ("frequency_penalty", float),
                   ("repetition_penalty", float), ("min_p", float))
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_from_proto(msg: common_pb2.StructuredOutputs) -> StructuredOutputsParams | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutputsParams(choice=list(msg.choice.choices))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=msg.json_object)
    return StructuredOutputsParams(**{kind: getattr(msg, kind)})


def structured_to_proto(spec: StructuredOutputsParams) -> common_pb2.StructuredOutputs:
    kind, _ = spec.kind()
    if kind == "choice":
        return common_pb2.StructuredOutputs(choice=common_pb2.ChoiceList(choices=spec.choice))
    if kind == "json_object":
        return common_pb2.StructuredOutputs(json_object=True)
    return common_pb2.StructuredOutputs(**{kind: getattr(spec, kind)})


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset fields take the engine's defaults (SamplingParams'; proto3 zero is never read as a value)."""
    p = SamplingParams(stop_token_ids=list(msg.stop_token_ids))
    for name, kind in OPTIONAL_FIELDS:
        if msg.HasField(name):
            setattr(p, name, kind(getattr(msg, name)))
    if msg.logit_bias:
        p.logit_bias = dict(msg.logit_bias)
    if msg.bad_words_token_ids:
        p.bad_words_token_ids = [list(w.ids) for w in msg.bad_words_token_ids]
    if msg.HasField("structured_outputs"):
        p.structured_outputs = structured_from_proto(msg.structured_outputs)
    return p


def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                    max_tokens=p.max_tokens, ignore_eos=p.ignore_eos,
                                    stop_token_ids=p.stop_token_ids)
    if p.min_tokens:
        msg.min_tokens = p.min_tokens
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.seed is not None:
        msg.seed = p.seed
    if p.cache_salt is not None:
        msg.cache_salt = p.cache_salt
    if p.priority:
        msg.priority = p.priority
    for name in ("presence_penalty", "frequency_penalty", "min_p"):
        if getattr(p, name):
            setattr(msg, name, getattr(p, name))
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    if p.logit_bias:
        msg.logit_bias.update(p.logit_bias)
    if p.bad_words_token_ids:
        msg.bad_words_token_ids.extend(common_pb2.TokenSequence(ids=w) for w in p.bad_words_token_ids)
    if p.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_to_proto(p.structured_outputs))
    return msg


def logprobs_to_proto(logprobs) -> list[common_pb2.TokenLogprob]:
    """engine TokenLogprobs (or None) -> proto messages."""
    return [common_pb2.TokenLogprob(logprob=lp.logprob, top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs,
                                    rank=lp.rank)
            for lp in logprobs or ()]


def first_token_proto(out) -> worker_pb2.FirstToken:
    """The first sampled token of an engine RequestOutput, with its worker-side timings."""
    token = worker_pb2.FirstToken(token_id=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens,
                                  queue_ms=(out.queue_s or 0.0) * 1e3, prefill_ms=(out.prefill_s or 0.0) * 1e3)
    if out.finish_reason is not None:
        token.finish_reason = out.finish_reason
    if out.logprobs:
        token.logprob.CopyFrom(logprobs_to_proto(out.logprobs)[0])
    token.prompt_logprobs.extend(logprobs_to_proto((out.prompt_logprobs or [None])[1:]))   # the first is None
    return token


def decode_event_proto(out) -> worker_pb2.DecodeEvent:
    """An engine RequestOutput after the first token: its tokens, logprobs, finish reason and, on
    the last one of a speculating engine, the request's speculative decoding counts."""
    event = worker_pb2.DecodeEvent(token_ids=out.new_token_ids, finished=out.finished,
                                   logprobs=logprobs_to_proto(out.logprobs))
    if out.finish_reason is not None:
        event.finish_reason = out.finish_reason
    if out.spec_counts is not None:
        drafts, draft_tokens, accepted = out.spec_counts
        event.spec_decode.CopyFrom(common_pb2.SpecDecodeCounts(num_drafts=drafts, num_draft_tokens=draft_tokens,
                                                               num_accepted_tokens=accepted))
    return event
