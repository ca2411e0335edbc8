"""Speculative decoding: a proposer drafts the next tokens of a decoding sequence, and one forward
pass verifies them with the tokens before them (engine/scheduler.py schedules a draft as k + 1
new tokens of its sequence, engine/step_plan.py lays them out as one segment whose every row is
sampled, engine/llm_engine.py accepts them). ``config`` (SpeculativeConfig), ``proposer`` (the
interface, the one a config names), ``ngram`` (prompt lookup), ``verify`` (greedy acceptance),
``metrics`` (the counters)."""
