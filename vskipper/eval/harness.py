"""The vskipper tasks run by lm-evaluation-harness (lm-eval) against a served model.

    TASKS         the task names, their data set in vskipper/data/ and their metrics
    prepare_tasks copy the shipped task files (vskipper/eval/tasks/) and their data into a directory,
                  with the data's absolute path written into each task file (lm-eval resolves
                  `data_files` against the working directory, not the task file)
    run_tasks     lm-eval's `local-completions` model against /v1/completions of a running server:
                  prompts sent as token ids (the local tokenizer), every question one user turn of
                  the model's chat template (--apply_chat_template), generation greedy

Nothing is downloaded: the data are the shipped JSONL sets, loaded by the `json` builder of
`datasets` with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from vskipper.data import HERE as DATA_DIR

TASK_DIR = Path(__file__).resolve().parent / "tasks"

# name -> (shipped data set, metrics lm-eval reports with a standard error)
TASKS = {
    "vskipper_arithmetic": ("arithmetic", ("acc",)),
    "vskipper_facts_mc": ("facts_mc", ("acc", "acc_norm")),
}


def prepare_tasks(dest: Path, names=tuple(TASKS)) -> Path:
    """Write the task files and data of `names` into `dest` (a directory lm-eval can include);
    returns `dest`. The copy is what the run used: `lm_eval --include_path DEST` reruns it."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TASK_DIR / "utils.py", dest / "utils.py")
    for name in names:
        data, _ = TASKS[name]
        data_path = (dest / f"{data}.jsonl").resolve()
        shutil.copyfile(DATA_DIR / f"{data}.jsonl", data_path)
        text = (TASK_DIR / f"{name}.yaml").read_text()
        text, n = re.subn(rf"(\n\s+test:\s*){re.escape(data)}\.jsonl",
                          lambda m: m.group(1) + json.dumps(str(data_path)), text)
        if n != 1:
            raise RuntimeError(f"{TASK_DIR / (name + '.yaml')}: expected one 'test: {data}.jsonl' entry")
        (dest / f"{name}.yaml").write_text(text)
    return dest


def _offline() -> None:
    """No model hub, no data hub: everything lm-eval needs is local."""
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(k, "1")


def model_args(completions_url: str, served_name: str, tokenizer: str, num_concurrent: int) -> dict:
    """lm-eval's local-completions arguments for a local server (the form `--model_args` takes)."""
    return {"model": served_name, "base_url": completions_url, "tokenizer": str(tokenizer),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": num_concurrent,
            "max_retries": 3, "timeout": 600}


def command_line(completions_url: str, served_name: str, tokenizer: str, names: list[str], task_dir: Path,
                 limit: int | None = None, num_concurrent: int = 8, max_gen_toks: int | None = None) -> str:
    """The lm-eval command line that runs the same evaluation by hand (the task files in task_dir)."""
    import shlex

    margs = ",".join(f"{k}={v}" for k, v in model_args(completions_url, served_name, tokenizer, num_concurrent).items())
    cmd = ["lm-eval", "run", "--model", "local-completions", "--model_args", margs, "--tasks", ",".join(names),
           "--include_path", str(task_dir), "--apply_chat_template"]
    cmd += ["--limit", str(limit)] if limit else []
    cmd += ["--gen_kwargs", f"max_gen_toks={max_gen_toks}"] if max_gen_toks else []
    return "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 " + " ".join(shlex.quote(c) for c in cmd)


def run_tasks(completions_url: str, served_name: str, tokenizer: str, names: list[str], task_dir: Path,
              limit: int | None = None, num_concurrent: int = 8, max_gen_toks: int | None = None,
              samples_dir: Path | None = None) -> dict:
    """Run the tasks `names` (prepared in `task_dir`) with lm-eval against `completions_url`.

    Returns {task: {"n": items, "<metric>": value, "<metric>_stderr": standard error, ...}}; with
    `samples_dir`, writes samples_<task>.jsonl there (per item: its id, target, the model's filtered
    response, its scores and the request arguments as lm-eval built them)."""
    _offline()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(task_dir), include_defaults=False)
    out = simple_evaluate(model="local-completions",
                          model_args=model_args(completions_url, served_name, tokenizer, num_concurrent),
                          tasks=list(names), task_manager=tm, limit=limit, apply_chat_template=True,
                          gen_kwargs={"max_gen_toks": max_gen_toks} if max_gen_toks else None,
                          bootstrap_iters=1000, log_samples=samples_dir is not None)
    if out is None:
        raise RuntimeError("lm-eval returned no results")
    results = {}
    for name in names:
        r, row = out["results"][name], {}
        row["n"] = int(out.get("n-samples", {}).get(name, {}).get("effective", 0))
        for metric in TASKS[name][1]:
            row[metric] = float(r[f"{metric},none"])
            se = r.get(f"{metric}_stderr,none")
            row[f"{metric}_stderr"] = float(se) if isinstance(se, (int, float)) else None
        results[name] = row
        if samples_dir is not None:
            with open(Path(samples_dir) / f"samples_{name}.jsonl", "w") as f:
                for s in out.get("samples", {}).get(name, []):
                    rec = {"doc_id": s["doc_id"], "id": s["doc"].get("id"), "target": s["target"],
                           "response": s["filtered_resps"], **{m: s[m] for m in TASKS[name][1] if m in s},
                           "arguments": s.get("arguments")}  # what was sent: chat-templated context(s)
                    f.write(json.dumps(rec, default=str) + "\n")
    return results
