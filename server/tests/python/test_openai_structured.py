"""The official `openai` Python client's structured outputs against an afd server whose fake
node writes GPT-OSS harmony prose: `chat.completions.parse` with a pydantic model, and a
`response_format` json_schema through `responses.parse`, must come back parsed.

Usage: AFD_BASE_URL=http://127.0.0.1:P python3 test_openai_structured.py
Exits non-zero on the first failed check; prints one line per check.
"""

import os
import sys
from typing import Literal

import openai
import pydantic

client = openai.OpenAI(base_url=os.environ["AFD_BASE_URL"].rstrip("/") + "/v1", api_key="unused")
model = client.models.list().data[0].id


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Tokyo"]
    sunny: bool


def check(name, cond, detail=""):
    if not cond:
        print(f"FAIL {name}: {detail}", flush=True)
        sys.exit(1)
    print(f"ok   {name}", flush=True)


r = client.chat.completions.parse(
    model=model, messages=[{"role": "user", "content": "Weather?"}], response_format=Weather, max_tokens=200)
parsed = r.choices[0].message.parsed
check("chat.completions.parse: a Weather", isinstance(parsed, Weather), r)
check("chat.completions.parse: finished", r.choices[0].finish_reason == "stop", r)

r = client.responses.parse(model=model, input="Weather?", text_format=Weather, max_output_tokens=200)
check("responses.parse: a Weather", isinstance(r.output_parsed, Weather), r)

print("all checks passed", flush=True)
