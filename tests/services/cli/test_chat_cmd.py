"""`pdserve chat`: piped turns get exactly the offline engine's greedy replies to the chat-templated
conversation so far (the earlier replies in its history), in process and through a router (whose
session reuses the earlier turns' KV); /clear starts over; a model without a chat template, or an
unreachable router, is one error line."""
from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path


from pdserve.engine import SamplingParams
from pdserve.services.cli import chat_cmd
from pdserve.services.cli.commands import main
from pdserve.services.deployment.launcher import free_port
from tests.serving import TEST_ENGINE_ARGS, start_cluster

MAX_NEW = 12
TURNS = ["What is the capital of France?", "And of Spain?"]


def _chat(argv: list[str], stdin: str, capsys, monkeypatch) -> tuple[int, str, str]:
    """`pdserve chat ARGV` in this process with stdin piped: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        code = main(["chat", *argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    out = capsys.readouterr()
    return code, out.out, out.err


def _rendered(monkeypatch) -> list[list[dict]]:
    """The conversations chat renders, one per turn (a copy of each)."""
    seen: list[list[dict]] = []
    real = chat_cmd.render

    def spy(tokenizer, messages):
        seen.append([dict(m) for m in messages])
        return real(tokenizer, messages)

    monkeypatch.setattr(chat_cmd, "render", spy)
    return seen


def _expected(llm, turns: list[str], system: str | None = None) -> list[str]:
    """The offline engine's greedy reply to each turn, the conversation so far chat-templated."""
    messages = [{"role": "system", "content": system}] if system else []
    replies = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        reply = llm.generate([ids], SamplingParams(temperature=0, max_tokens=MAX_NEW))[0].text
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


def _history(turns: list[str], replies: list[str]) -> list[dict]:
    return [m for t, r in zip(turns, replies) for m in ({"role": "user", "content": t},
                                                        {"role": "assistant", "content": r})]


def test_piped_turns_in_process_are_the_offline_replies_to_the_whole_conversation(
        tiny_qwen3: str, served_reference, capsys, monkeypatch) -> None:
    seen = _rendered(monkeypatch)
    stdin = "".join(t + "\n" for t in TURNS) + "/exit\nnever sent\n"
    code, out, err = _chat(["--model", tiny_qwen3, *TEST_ENGINE_ARGS, "--temperature", "0",
                            "--max-tokens", str(MAX_NEW), "--verbose"], stdin, capsys, monkeypatch)
    assert code == 0, err
    want = _expected(served_reference, TURNS)
    assert out == "".join(r + "\n" for r in want)   # only the replies, a newline after each
    assert seen == [[{"role": "user", "content": TURNS[0]}],   # the second turn carries the first reply
                    [*_history(TURNS[:1], want[:1]), {"role": "user", "content": TURNS[1]}]]
    usage = [line for line in err.splitlines() if line.startswith("[finish_reason=")]
    assert len(usage) == 2 and "cached_tokens=0 " not in usage[1], err   # the prefix cache held turn 1


def test_clear_starts_a_new_conversation_and_keeps_the_system_message(
        tiny_qwen3: str, served_reference, capsys, monkeypatch) -> None:
    seen = _rendered(monkeypatch)
    system = "You are terse."
    stdin = f"{TURNS[0]}\n/clear\n/nonsense\n\n/help\n{TURNS[1]}\n"   # EOF ends it too
    code, out, err = _chat(["--model", tiny_qwen3, *TEST_ENGINE_ARGS, "--temperature", "0", "--max-tokens",
                            str(MAX_NEW), "--system", system], stdin, capsys, monkeypatch)
    assert code == 0, err
    sys_msg = {"role": "system", "content": system}
    assert seen == [[sys_msg, {"role": "user", "content": TURNS[0]}], [sys_msg, {"role": "user", "content": TURNS[1]}]]
    assert out == "".join(_expected(served_reference, [t], system)[0] + "\n" for t in TURNS)
    assert "Unknown command '/nonsense'" in err and "/clear" in err   # notes and help on stderr when piped


def test_piped_turns_through_a_router_are_the_offline_replies_and_reuse_the_session(
        tiny_qwen3: str, served_reference, capsys, monkeypatch) -> None:
    cluster = start_cluster(tiny_qwen3, prefill_workers=1, decode_workers=1)
    try:
        seen = _rendered(monkeypatch)
        stdin = "".join(t + "\n" for t in TURNS) + "/exit\n"
        # no --model: the tokenizer is the router's model directory's
        code, out, err = _chat(["--router", cluster.router_address, "--temperature", "0", "--max-tokens",
                                str(MAX_NEW), "--verbose"], stdin, capsys, monkeypatch)
    finally:
        cluster.stop()
    assert code == 0, err
    want = _expected(served_reference, TURNS)
    assert out == "".join(r + "\n" for r in want)
    assert seen[1] == [*_history(TURNS[:1], want[:1]), {"role": "user", "content": TURNS[1]}]
    usage = [line for line in err.splitlines() if line.startswith("[finish_reason=")]
    assert len(usage) == 2 and "cached_tokens=0 " not in usage[1], err   # the earlier turn's KV was reused


def test_a_model_without_a_chat_template_is_one_error_line_exit_2(tiny_qwen3: str, tmp_path: Path, capsys,
                                                                   monkeypatch) -> None:
    model = tmp_path / "base-model"
    shutil.copytree(tiny_qwen3, model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    code, out, err = _chat(["--model", str(model)], "hi\n", capsys, monkeypatch)
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"pdserve: error: chat needs an instruct model with a chat template, and {model} has none "
                     f"(tokenizer_config.json chat_template or chat_template.jinja); `pdserve generate` completes "
                     f"plain prompts"]


def test_an_unreachable_router_is_one_error_line_exit_1(capsys, monkeypatch) -> None:
    address = f"127.0.0.1:{free_port()}"   # nothing listens there
    code, out, err = _chat(["--router", address], "hi\n", capsys, monkeypatch)
    assert code == 1 and out == ""
    assert [line for line in err.splitlines() if line.strip()] == [
        f"pdserve: error: cannot reach the router at {address} (UNAVAILABLE): is it running? start one with "
        f"`pdserve up`, or pass its address with --router HOST:PORT"]
