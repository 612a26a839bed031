"""`vskipper eval`: quality of a served model with a skipper, as the field measures it (docs/eval.md).

    harness     the shipped lm-eval tasks (vskipper/eval/tasks/) run by lm-evaluation-harness'
                local-completions model against a server: vskipper_arithmetic, vskipper_facts_mc
    agreement   held-out chat prompts; teacher_forced (top-1 agreement, KL to the base, in-process)
    scoring     last_integer, prefix_length, agreement, standard errors
    server      a server given by URL or started as `vskipper serve` would
    cli         the command's flags and entry point
"""
from vskipper.eval.agreement import PROMPT_SETS, heldout_prompts, teacher_forced
from vskipper.eval.harness import TASKS
from vskipper.eval.scoring import agreement, last_integer, mean_stderr, median_stderr, prefix_length

__all__ = ["PROMPT_SETS", "TASKS", "agreement", "heldout_prompts", "last_integer", "mean_stderr", "median_stderr",
           "prefix_length", "teacher_forced"]
