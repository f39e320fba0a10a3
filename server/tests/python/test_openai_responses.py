"""The official `openai` Python client's Responses API against two afd servers whose fake nodes
write scripted GPT-OSS harmony: one a tool call, one reasoning and an answer.

Usage: AFD_TOOL_URL=http://127.0.0.1:P AFD_ANSWER_URL=http://127.0.0.1:Q python3 test_openai_responses.py
Exits non-zero on the first failed check; prints one line per check.
"""

import json
import os
import sys

import openai

tool_client = openai.OpenAI(base_url=os.environ["AFD_TOOL_URL"].rstrip("/") + "/v1", api_key="unused")
answer_client = openai.OpenAI(base_url=os.environ["AFD_ANSWER_URL"].rstrip("/") + "/v1", api_key="unused")
model = tool_client.models.list().data[0].id
TOOLS = [{
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}]


def check(name, cond, detail=""):
    if not cond:
        print(f"FAIL {name}: {detail}", flush=True)
        sys.exit(1)
    print(f"ok   {name}", flush=True)


r = tool_client.responses.create(model=model, input="Weather in Paris?", tools=TOOLS, max_output_tokens=300)
calls = [o for o in r.output if o.type == "function_call"]
check("responses: a function_call item", len(calls) == 1 and calls[0].name == "get_weather", r.output)
check("responses: its arguments parse", json.loads(calls[0].arguments) == {"city": "Paris"}, calls[0])
reasoning = [o for o in r.output if o.type == "reasoning"]
check("responses: reasoning item", len(reasoning) == 1 and reasoning[0].content[0].text == "Need the weather.",
      r.output)
check("responses: completed, not stored", r.status == "completed" and r.store is False, r)
check("responses: usage", r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens > 0, r.usage)

args, kinds, final = [], [], None
with tool_client.responses.stream(model=model, input="Weather in Paris?", tools=TOOLS,
                                  max_output_tokens=300) as stream:
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            args.append(event.delta)
    final = stream.get_final_response()
check("responses stream: typed events", kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds)
check("responses stream: arguments in pieces", "".join(args) == '{"city":"Paris"}', args)
check("responses stream: final response", [o.type for o in final.output] == ["reasoning", "function_call"],
      final.output)

# The call goes back with its output: the next turn answers.
history = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
    {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
]
a = answer_client.responses.create(model=model, input=history, tools=TOOLS, instructions="One word.",
                                   reasoning={"effort": "low"}, max_output_tokens=300)
check("responses: output_text", a.output_text == "Four.", a.output)

texts = []
for event in answer_client.responses.create(model=model, input="2 + 2?", max_output_tokens=300, stream=True):
    if event.type == "response.output_text.delta":
        texts.append(event.delta)
check("responses stream: text deltas", "".join(texts) == "Four.", texts)

try:
    answer_client.responses.create(model=model, input="x", previous_response_id="resp_1")
    check("previous_response_id raises BadRequestError", False, "no error")
except openai.BadRequestError as e:
    check("previous_response_id raises BadRequestError", e.status_code == 400 and "store" in str(e), e)

print("all checks passed", flush=True)
