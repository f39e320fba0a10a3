"""Runs a small loglikelihood task (data.jsonl beside this file) through lm-evaluation-harness
and writes every request's score to a JSON file.

Two backends, one task, so the scores compare one to one:
  --hf FOLDER     transformers on the checkpoint (lm-eval's `hf` model, float32, CPU): the
                  reference, committed under reference/ (needs torch and transformers:
                  /work/venv-hf, scripts/requirements-fixtures.txt plus lm-eval[hf]);
  --server URL    an OpenAI-compatible completions server (lm-eval's `local-completions`,
                  tokenizing through the server's /tokenize and /tokenizer_info): what
                  deploy/tests/lm_eval.rs runs against `afd serve` (needs lm-eval[api] only).

Nothing is fetched: the dataset is the local file, HF_HOME a scratch folder, and the datasets
library runs offline.
"""

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
TASK = "afd_loglikelihood"

TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    backend = parser.add_mutually_exclusive_group(required=True)
    backend.add_argument("--hf", help="checkpoint folder, scored by transformers")
    backend.add_argument("--server", help="base URL of a completions server")
    parser.add_argument("--model-name", default="fixture", help="the served model's name")
    parser.add_argument("--out", required=True, help="where to write the scores (JSON)")
    args = parser.parse_args()

    scratch = tempfile.mkdtemp(prefix="afd-lm-eval-")
    try:
        return run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(args, scratch):
    os.environ.setdefault("HF_HOME", scratch)
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    tasks = pathlib.Path(scratch) / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=HERE / "data.jsonl"))

    import lm_eval
    from lm_eval.tasks import TaskManager

    if args.hf:
        model = "hf"
        # No BOS: the remote tokenizer of local-completions adds none, so neither does this.
        model_args = f"pretrained={args.hf},dtype=float32,device=cpu,add_bos_token=False"
    else:
        model = "local-completions"
        model_args = (
            f"base_url={args.server.rstrip('/')}/v1/completions,model={args.model_name},"
            "tokenizer_backend=remote,num_concurrent=1,max_retries=1"
        )
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=1,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    scores = [
        {
            "doc_id": s["doc_id"],
            "context": s["doc"]["context"],
            "continuation": s["doc"]["continuation"],
            "loglikelihood": float(s["resps"][0][0][0]),
            "is_greedy": bool(s["resps"][0][0][1]),
        }
        for s in samples
    ]
    metrics = {
        k.split(",")[0]: v
        for k, v in results["results"][TASK].items()
        if k.split(",")[0] in ("perplexity", "acc")
    }
    out = {"model": model, "scores": scores, "metrics": metrics}
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
