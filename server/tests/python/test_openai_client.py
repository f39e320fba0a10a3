"""The official `openai` Python client against a running afd server.

Usage: AFD_BASE_URL=http://127.0.0.1:PORT python3 test_openai_client.py
Exits non-zero on the first failed check; prints one line per check.
"""

import os
import sys

import openai

BASE = os.environ["AFD_BASE_URL"].rstrip("/")
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused")


def check(name, cond, detail=""):
    if not cond:
        print(f"FAIL {name}: {detail}", flush=True)
        sys.exit(1)
    print(f"ok   {name}", flush=True)


models = client.models.list()
model = models.data[0].id
check("models.list has one model with root", len(models.data) == 1 and models.data[0].model_extra.get("root"), models)

c = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0)
check("completion text", isinstance(c.choices[0].text, str) and c.choices[0].finish_reason == "length", c)
check("completion usage", c.usage.completion_tokens == 6 and c.usage.prompt_tokens > 0, c.usage)

ids = client.completions.create(
    model=model, prompt=[72, 101, 108], max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
)
check("token-id prompt", ids.usage.prompt_tokens == 3, ids.usage)
check("return_token_ids", ids.choices[0].model_extra.get("prompt_token_ids") == [72, 101, 108]
      and len(ids.choices[0].model_extra.get("token_ids")) == 4, ids.choices[0])

texts = []
usage = None
for chunk in client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True}):
    if chunk.choices:
        texts.append(chunk.choices[0].text)
    if chunk.usage:
        usage = chunk.usage
check("streamed completion equals the full one", "".join(texts) == c.choices[0].text, (texts, c.choices[0].text))
check("stream usage", usage is not None and usage.completion_tokens == 6, usage)

chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is 2 + 2?"}], max_completion_tokens=5, temperature=0
)
check("chat message", chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str), chat)
check("chat usage", chat.usage.completion_tokens == 5, chat.usage)

parts = []
roles = []
for chunk in client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]}],
    max_completion_tokens=5,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
):
    for ch in chunk.choices:
        if ch.delta.role:
            roles.append(ch.delta.role)
        if ch.delta.content:
            parts.append(ch.delta.content)
check("streamed chat: one role chunk", roles == ["assistant"], roles)
check("streamed chat equals the full one", "".join(parts) == chat.choices[0].message.content,
      ("".join(parts), chat.choices[0].message.content))

lp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                    logprobs=True, top_logprobs=2)
check("chat logprobs", len(lp.choices[0].logprobs.content) == 3
      and len(lp.choices[0].logprobs.content[0].top_logprobs) == 2, lp.choices[0].logprobs)

try:
    client.completions.create(model=model, prompt="x", max_tokens=3, temperature=-1)
    check("400 raises BadRequestError", False, "no error")
except openai.BadRequestError as e:
    check("400 raises BadRequestError", e.status_code == 400 and "temperature" in str(e), e)

try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=3)
    check("404 raises NotFoundError", False, "no error")
except openai.NotFoundError as e:
    check("404 raises NotFoundError", e.status_code == 404, e)

print("all checks passed", flush=True)
